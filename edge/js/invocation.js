// One queue invocation, driven so that a panic in one message's code does
// not fail the rest of the batch.
//
// On wasm32 a Rust panic aborts the WebAssembly instance: nothing more of the
// batch can run in it, and the invocation's promise never settles. JavaScript
// state survives the abort, so the consumer records its progress here (which
// message is being worked on, which are settled). When the panic hook reports
// a crash, `drive` resets the instance and calls the consumer again with the
// same invocation: the message whose code panicked is settled by the rules as
// a failed execution, and the messages it interrupted or never reached run
// as if nothing had happened, without spending a delivery.

export class Invocation {
  constructor(batch, env) {
    this.batch = batch;
    this.env = env;
    this.startedAt = Date.now();
    this.settledIds = new Set();
    this.active = new Set();
    this.crashedId = null;
    this.crashMessage = null;
    this.crashes = 0;
    this.onCrash = null;
  }

  elapsedMs() {
    return Date.now() - this.startedAt;
  }

  setActive(id, active) {
    if (active) this.active.add(id);
    else this.active.delete(id);
  }

  settled(id) {
    this.settledIds.add(id);
  }

  isSettled(id) {
    return this.settledIds.has(id);
  }

  // Called by the panic hook, inside the instance that is about to abort:
  // record only, and continue from a fresh task.
  crashed(message) {
    const active = [...this.active];
    this.crashedId = active.length === 1 ? active[0] : null;
    this.crashMessage = String(message);
    this.crashes += 1;
    const onCrash = this.onCrash;
    this.onCrash = null;
    if (onCrash) setTimeout(onCrash, 0);
  }
}

// Runs `first` (the consumer's promise for the invocation) to completion,
// resuming with `resume(invocation)` after each crash. `reset` gives the
// module a fresh instance.
export function drive(invocation, first, resume, reset) {
  return new Promise((resolve, reject) => {
    const watch = (promise) => {
      const crashesBefore = invocation.crashes;
      invocation.onCrash = recover;
      promise.then(
        (value) => {
          invocation.onCrash = null;
          resolve(value);
        },
        (error) => {
          // A crash is handled by `recover`; anything else fails the
          // invocation as before.
          if (invocation.crashes === crashesBefore) {
            invocation.onCrash = null;
            reject(error);
          }
        },
      );
    };
    const recover = () => {
      try {
        reset();
        const state = globalThis.__worker_init_state;
        if (state) state.criticalError = false;
      } catch (error) {
        reject(error);
        return;
      }
      invocation.active.clear();
      const messages = invocation.batch.messages;
      // Each crash settles one message, so a batch of n resumes at most n
      // times; a crash no message can be blamed for hands the rest back.
      if (invocation.crashedId === null || invocation.crashes > messages.length) {
        for (const message of messages) {
          if (!invocation.isSettled(message.id)) message.retry();
        }
        console.error(
          `queue-edge: a panic outside any message's code (${invocation.crashMessage}); unsettled messages handed back`,
        );
        resolve(undefined);
        return;
      }
      console.error(
        `queue-edge: message ${invocation.crashedId} panicked (${invocation.crashMessage}); the rest of the batch continues`,
      );
      watch(resume(invocation));
    };
    watch(first);
  });
}
