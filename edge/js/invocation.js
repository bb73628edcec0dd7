// Queue invocations, driven so that a panic in one message's code does not
// fail the rest of its batch, nor the other invocations of the isolate.
//
// On wasm32 a Rust panic aborts the WebAssembly instance: nothing more runs in
// it, and every invocation's promise into it never settles. JavaScript state
// survives the abort, so each invocation records its progress here (which
// message is being worked on, which are settled). The panic hook reports the
// crash; `recover` then gives the module a fresh instance (once, whatever the
// number of invocations) and continues each invocation in it: the message
// whose code panicked is settled by the rules as one failed execution, and
// every other unsettled message runs as if nothing had happened, without
// spending a delivery.

// The invocations in flight in this isolate.
const live = new Set();
// The module's instance reset and the consumer's resume entry point.
let reset = null;
let resume = null;
// A recovery waiting to run.
let recovery = null;
// Aborts reported by the panic hook whose `error` event has not been seen yet.
let unreported = 0;
let listening = false;

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
    this.recover = null;
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
}

// Called by the panic hook, inside the instance that is about to abort:
// record, and recover from a fresh task. Only one message is polled at a
// time in the isolate, so at most one invocation has an active message: the
// one whose code panicked.
export function reportPanic(message) {
  const culprit = [...live].find((invocation) => invocation.active.size === 1);
  for (const invocation of live) {
    invocation.crashes += 1;
    invocation.crashMessage = String(message);
    invocation.crashedId = invocation === culprit ? [...invocation.active][0] : null;
    invocation.blameless = culprit !== undefined && invocation !== culprit;
  }
  unreported += 1;
  if (recovery === null) recovery = setTimeout(recoverAll, 0);
}

// The `worker` crate's shim marks the instance for reset when the abort's
// RuntimeError reaches the isolate's `error` event, which can happen after
// the instance was already reset here; a second reset would kill the resumed
// invocations, so that mark is cleared once the reset it asks for is done.
function listen() {
  if (listening) return;
  listening = true;
  addEventListener("error", (event) => {
    if (!(event.error instanceof WebAssembly.RuntimeError) || unreported === 0) return;
    unreported -= 1;
    const state = globalThis.__worker_init_state;
    if (state && recovery === null) state.criticalError = false;
  });
}

function recoverAll() {
  recovery = null;
  try {
    // The `worker` crate's panic hook marked the instance; if the mark is
    // gone, an invocation that arrived since has had the shim reset it.
    const state = globalThis.__worker_init_state;
    if (!state || state.criticalError) {
      reset();
      if (state) {
        state.criticalError = false;
        state.instanceId += 1;
      }
    }
  } catch (error) {
    console.error(`jobrail-edge: the instance could not be reset (${error})`);
  }
  for (const invocation of [...live]) {
    if (invocation.recover) invocation.recover();
  }
}

// The envelope id of a message, when its body is an envelope: the id that
// settlements, events and failure records carry (the platform's own message
// id is another).
function envelopeId(message) {
  try {
    const body = typeof message.body === "string" ? JSON.parse(message.body) : message.body;
    return body && typeof body.id === "string" ? body.id : null;
  } catch {
    return null;
  }
}

// Runs `first` (the consumer's promise for the invocation) to completion,
// resuming after each crash. `resumeFn(invocation)` continues an invocation
// in a fresh instance; `resetFn()` gives the module one.
export function drive(invocation, first, resumeFn, resetFn) {
  resume = resumeFn;
  reset = resetFn;
  listen();
  live.add(invocation);
  return new Promise((resolve, reject) => {
    const finish = (settle, value) => {
      live.delete(invocation);
      invocation.recover = null;
      settle(value);
    };
    let handled = 0;
    const watch = (promise) => {
      const crashesBefore = invocation.crashes;
      promise.then(
        (value) => {
          if (invocation.crashes === crashesBefore) finish(resolve, value);
        },
        (error) => {
          // A crash is handled by `recover`; anything else fails the
          // invocation as before.
          if (invocation.crashes === crashesBefore) finish(reject, error);
        },
      );
    };
    invocation.recover = () => {
      if (invocation.crashes === handled) return;
      handled = invocation.crashes;
      invocation.active.clear();
      const messages = invocation.batch.messages;
      // Each crash blamed on this invocation settles one of its messages, so
      // a batch of n resumes at most n times for its own panics; a panic no
      // message can be blamed for hands the rest back to the platform.
      const blamed = invocation.crashedId !== null;
      if ((!blamed && !invocation.blameless) || invocation.crashes > 2 * messages.length + 8) {
        for (const message of messages) {
          if (!invocation.isSettled(message.id)) message.retry();
        }
        console.error(
          `jobrail-edge: a panic outside any message's code (${invocation.crashMessage}); unsettled messages handed back`,
        );
        finish(resolve, undefined);
        return;
      }
      if (blamed) {
        const culprit = messages.find((message) => message.id === invocation.crashedId);
        const envelope = culprit ? envelopeId(culprit) : null;
        console.error(
          `jobrail-edge: message ${invocation.crashedId} (envelope ${envelope ?? "none"}) panicked (${invocation.crashMessage}); the rest of the batch continues`,
        );
      }
      watch(resume(invocation));
    };
    watch(first);
  });
}
