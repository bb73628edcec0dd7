//! Claims where the rules meet: a handler that runs its effect through
//! [`run_once`] on a [`MemoryClaims`], delivered through
//! [`Registry::process`] on a virtual clock the claims share, so leases,
//! tier-one waits, timeouts and retries move on one time line.
//!
//! Each test states the rule it holds the pipeline to, taken from the docs
//! of the claim API and of the settlement table:
//!
//! - a held key settles through the ordinary `RetryAfter` marker: waited in
//!   process when it fits tier one, a retry after the remaining lease
//!   otherwise, subject to the cap on the last delivery;
//! - an effect that fails, panics or is interrupted by shutdown gives its
//!   claim up at once, and its outcome is kept;
//! - an effect dropped mid-way (a timeout, a killed worker) leaves its claim
//!   to the lease;
//! - a completed key is never run again, whatever the message id.
//!
//! The last test generates sequences of claim operations and checks the
//! store's answers against a small model of the rules.

// On wasm32 the claims are not `Send` (nothing there is shared across
// threads); one `Arc` type keeps both targets alike.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_executor::block_on;
use futures_util::future::{select, Either};
use jobrail::{
    run_once, whole_seconds_up, BoxFuture, CancelToken, Claim, ClaimError, ClaimHeld, ClaimStore,
    Clock, Envelope, EventKind, FailureKind, Incoming, Instant, Job, JobBuilder, JobContext,
    JobError, MaybeSend, MaybeSync, MemoryClaims, Once, Outcome, Processed, Registry, Runtime,
    Settlement, VirtualRuntime, MIN_HELD_RETRY,
};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// The lease the handler claims its order for, unless a test says otherwise.
const LEASE: Duration = Duration::from_secs(30);

/// The job's name, and the queue its deliveries come from.
const JOB: &str = "charge";
const QUEUE: &str = "default";

#[derive(serde::Serialize, serde::Deserialize)]
struct Order {
    id: u32,
}

/// The business key of an order: what the handler claims.
fn key(id: u32) -> String {
    format!("order-{id}")
}

/// A fresh message (a new message id) for order `id`.
fn body(id: u32) -> Vec<u8> {
    Envelope::new(JOB, serde_json::json!({ "id": id })).encode()
}

fn declare() -> JobBuilder<Order> {
    Job::<Order>::builder(JOB)
}

/// The answer of a future that must be ready at once (every operation of a
/// `MemoryClaims` is); usable inside a runtime's `sleep`, where a nested
/// executor is not.
fn ready<T>(fut: impl Future<Output = T>) -> T {
    match pin!(fut).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(value) => value,
        Poll::Pending => panic!("a memory claim operation must answer at once"),
    }
}

/// What one handler execution's `run_once` answered.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    /// The effect ran, with this fence, and its completion was recorded.
    Ran(u64),
    /// The key was done: the effect did not run.
    AlreadyDone,
    /// Another holder had the key for this much more.
    Held(Duration),
    /// Any other error, by the outcome it asks for.
    Failed(Outcome),
}

/// One job, `charge`, whose handler charges an order through `run_once`
/// on `claims`, everything on the virtual clock `clock`.
struct Rig {
    registry: Registry,
    clock: VirtualRuntime,
    claims: MemoryClaims,
    /// The fence of every effect that started, in order.
    started: Arc<Mutex<Vec<u64>>>,
    /// What each handler execution that finished saw.
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// A rig whose effect is `effect(ctx, fence, n)`, `n` counting the effects
/// started so far (the first is 1). A handler whose execution has a deadline
/// drops its `run_once` (and the effect in it) when the deadline comes: the
/// job's timeout as a handler enforces it.
fn rig<E, Fut>(builder: JobBuilder<Order>, lease: Duration, effect: E) -> Rig
where
    E: Fn(JobContext, u64, usize) -> Fut + MaybeSend + MaybeSync + 'static,
    Fut: Future<Output = Result<(), JobError>> + MaybeSend + 'static,
{
    let clock = VirtualRuntime::new();
    let claims = MemoryClaims::with_clock(Arc::new(clock.clone()));
    let started = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let effect = Arc::new(effect);
    let job = builder.build().unwrap();
    let mut registry = Registry::new();
    let (c, e, st, se) = (claims.clone(), effect, started.clone(), seen.clone());
    registry
        .register(&job, move |ctx: JobContext, order: Order| {
            let (claims, effect, started, seen) = (c.clone(), e.clone(), st.clone(), se.clone());
            async move {
                let key = key(order.id);
                let effect_ctx = ctx.clone();
                let once = run_once(&claims, &key, lease, |fence| {
                    let n = {
                        let mut started = started.lock().unwrap();
                        started.push(fence);
                        started.len()
                    };
                    let effect = effect(effect_ctx, fence, n);
                    async move { effect.await.map(|()| fence) }
                });
                let result = match ctx.deadline() {
                    None => once.await,
                    Some(_) => match select(pin!(once), pin!(ctx.sleep(Duration::MAX))).await {
                        Either::Left((result, _)) => result,
                        Either::Right((woke, _)) => Err(JobError::from(
                            woke.expect_err("an endless sleep ends at the deadline"),
                        )),
                    },
                };
                seen.lock().unwrap().push(match &result {
                    Ok(Once::Ran(fence)) => Seen::Ran(*fence),
                    Ok(Once::AlreadyDone) => Seen::AlreadyDone,
                    Err(err) => match err.find::<ClaimHeld>() {
                        Some(held) => Seen::Held(held.remaining),
                        None => Seen::Failed(err.outcome()),
                    },
                });
                result.map(|_| ())
            }
        })
        .unwrap();
    Rig {
        registry,
        clock,
        claims,
        started,
        seen,
    }
}

impl Rig {
    /// Delivery `attempt` of `body` on the rig's clock, no shutdown.
    fn deliver(&self, body: &[u8], attempt: u32) -> Processed {
        self.deliver_on(
            body,
            attempt,
            None,
            Arc::new(self.clock.clone()),
            &CancelToken::new(),
        )
    }

    fn deliver_on(
        &self,
        body: &[u8],
        attempt: u32,
        shutdown_returns: Option<u32>,
        runtime: Arc<dyn Runtime>,
        cancel: &CancelToken,
    ) -> Processed {
        let delivery = Incoming {
            queue: QUEUE,
            body,
            attempt,
            shutdown_returns,
            deadline: None,
        };
        let processed = block_on(self.registry.process(delivery, &runtime, cancel));
        self.registry.settled(&processed, Ok(()));
        processed
    }

    /// Another worker's claim of order `id`, straight on the store.
    fn claim(&self, id: u32, lease: Duration) -> Claim {
        ready(self.claims.claim(&key(id), lease)).unwrap()
    }

    fn started(&self) -> Vec<u64> {
        self.started.lock().unwrap().clone()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn seen_last(&self) -> Seen {
        self.seen().last().cloned().expect("a handler execution")
    }
}

fn failed(p: &Processed) -> (FailureKind, &str) {
    match &p.settlement {
        Settlement::Fail(record) => (record.kind, record.reason.as_str()),
        other => panic!("expected a terminal failure, got {other:?}"),
    }
}

fn retry(delay: Duration) -> Settlement {
    Settlement::Retry {
        delay: Some(delay),
        shutdown: false,
    }
}

/// The rig's clock, whose sleeps run an action on the claims half-way
/// through the first sleep: something another worker does while this
/// delivery waits.
struct MidSleep {
    clock: VirtualRuntime,
    claims: MemoryClaims,
    action: Mutex<Option<fn(&MemoryClaims)>>,
    sleeps: Mutex<Vec<Duration>>,
}

impl MidSleep {
    fn new(rig: &Rig, action: fn(&MemoryClaims)) -> Arc<Self> {
        Arc::new(MidSleep {
            clock: rig.clock.clone(),
            claims: rig.claims.clone(),
            action: Mutex::new(Some(action)),
            sleeps: Mutex::new(Vec::new()),
        })
    }

    fn acted(&self) -> bool {
        self.action.lock().unwrap().is_none()
    }

    fn sleeps(&self) -> Vec<Duration> {
        self.sleeps.lock().unwrap().clone()
    }
}

impl Clock for MidSleep {
    fn now(&self) -> Instant {
        self.clock.now()
    }
}

impl Runtime for MidSleep {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let half = duration / 2;
        self.clock.advance(half);
        if let Some(action) = self.action.lock().unwrap().take() {
            action(&self.claims);
        }
        self.clock.advance(duration - half);
        self.sleeps.lock().unwrap().push(duration);
        Box::pin(std::future::ready(()))
    }
}

/// The rig's clock, whose sleeps never end and start shutdown.
struct ShutdownDuringSleep {
    clock: VirtualRuntime,
    cancel: CancelToken,
}

impl Clock for ShutdownDuringSleep {
    fn now(&self) -> Instant {
        self.clock.now()
    }
}

impl Runtime for ShutdownDuringSleep {
    fn sleep(&self, _: Duration) -> BoxFuture<'static, ()> {
        self.cancel.cancel();
        Box::pin(std::future::pending())
    }
}

// --- 1. held, and the lease ends within tier one's wait -------------------

/// A held key whose remaining lease fits tier one's max wait is waited for in
/// process; the holder completes meanwhile, so the second execution finds the
/// key done and the delivery is acknowledged without running the effect.
#[test]
fn held_within_tier_one_waits_in_process_and_finds_the_key_done() {
    let builder = declare()
        .max_deliveries(3)
        .tier_one(2)
        .tier_one_max_wait(S(10));
    let rig = rig(builder, LEASE, |_, _, _| async { Ok(()) });
    assert_eq!(rig.claim(1, S(8)), Claim::Claimed { fence: 1 });
    // The other worker finishes its charge 4 s into this delivery's wait.
    let runtime = MidSleep::new(&rig, |claims| {
        ready(claims.complete(&key(1), 1)).expect("the other holder's lease is live");
    });

    let p = rig.deliver_on(&body(1), 1, None, runtime.clone(), &CancelToken::new());

    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(p.executions(), 2, "one wait in process, one more execution");
    assert!(runtime.acted(), "the holder completed during the wait");
    assert_eq!(runtime.sleeps(), [S(8)], "waited out the remaining lease");
    assert_eq!(rig.seen(), [Seen::Held(S(8)), Seen::AlreadyDone]);
    assert!(rig.started().is_empty(), "the effect did not run here");
    assert_eq!(rig.claim(1, LEASE), Claim::Done);
}

/// The same wait, but the holder dies instead: its lease ends as the wait
/// does, and the second execution claims the key with a higher fence.
#[test]
fn held_within_tier_one_claims_the_key_when_the_lease_ends_during_the_wait() {
    let builder = declare()
        .max_deliveries(3)
        .tier_one(2)
        .tier_one_max_wait(S(10));
    let rig = rig(builder, LEASE, |_, _, _| async { Ok(()) });
    assert_eq!(rig.claim(1, S(3)), Claim::Claimed { fence: 1 });

    let p = rig.deliver(&body(1), 1);

    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.clock.sleeps(), [S(3)]);
    assert_eq!(rig.seen(), [Seen::Held(S(3)), Seen::Ran(2)]);
    assert_eq!(rig.started(), [2]);
    assert_eq!(rig.claim(1, LEASE), Claim::Done);
}

// --- 2. held beyond tier one's wait -----------------------------------------

/// A held key whose remaining lease is longer than tier one's max wait is a
/// retry after exactly the remaining lease (not a failure) below the cap,
/// with no in-process wait; the holder keeps its claim.
#[test]
fn held_beyond_tier_one_retries_after_the_remaining_lease() {
    let builder = declare()
        .max_deliveries(3)
        .tier_one(3)
        .tier_one_max_wait(S(5))
        .backoff(S(1), 2.0, S(10));
    let rig = rig(builder, LEASE, |_, _, _| async { Ok(()) });
    assert_eq!(rig.claim(1, LEASE), Claim::Claimed { fence: 1 });

    for (attempt, at) in [(1, MS(10_500)), (2, MS(20_001))] {
        rig.clock.advance(at - rig.clock.elapsed());
        let remaining = LEASE - at;
        let p = rig.deliver(&body(1), attempt);
        assert_eq!(p.settlement, retry(remaining), "attempt {attempt}");
        assert_eq!(p.executions(), 1, "no tier-one wait beyond its max");
        assert_eq!(rig.seen_last(), Seen::Held(remaining));
        // A backend counting whole seconds rounds up: never before the end.
        let Settlement::Retry {
            delay: Some(delay), ..
        } = p.settlement
        else {
            unreachable!()
        };
        assert!(S(whole_seconds_up(delay)) >= remaining);
        assert!(matches!(p.event.kind, EventKind::Retried { .. }));
    }
    assert!(rig.clock.sleeps().is_empty());
    assert!(rig.started().is_empty());
    ready(rig.claims.complete(&key(1), 1)).expect("the holder still holds the key");
}

/// A lease about to end asks for a retry no sooner than [`MIN_HELD_RETRY`].
#[test]
fn a_lease_about_to_end_retries_after_the_minimum() {
    let rig = rig(declare().max_deliveries(3), LEASE, |_, _, _| async {
        Ok(())
    });
    assert_eq!(rig.claim(1, MS(20)), Claim::Claimed { fence: 1 });
    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, retry(MIN_HELD_RETRY));
    assert_eq!(rig.seen(), [Seen::Held(MS(20))]);
}

// --- 3. held on the last delivery -------------------------------------------

/// A held key on the last delivery (attempt == cap): the retry-after is
/// subject to the cap, so the delivery fails terminally, attempts exhausted,
/// and the failure names the holder's claim. The holder keeps its claim.
#[test]
fn held_on_the_last_delivery_fails_with_attempts_exhausted() {
    let builder = declare().max_deliveries(3).tier_one_max_wait(S(5));
    let rig = rig(builder, LEASE, |_, _, _| async { Ok(()) });
    assert_eq!(rig.claim(1, LEASE), Claim::Claimed { fence: 1 });
    rig.clock.advance(S(10));

    let p = rig.deliver(&body(1), 3);

    let (kind, reason) = failed(&p);
    assert_eq!(kind, FailureKind::AttemptsExhausted);
    let held = ClaimHeld {
        key: key(1),
        remaining: S(20),
    };
    assert!(
        reason.contains(&held.to_string()),
        "the cause is the held claim: {reason}"
    );
    assert_eq!(rig.seen(), [Seen::Held(S(20))]);
    assert!(rig.started().is_empty());
    assert!(matches!(p.event.kind, EventKind::Failed { .. }));
    ready(rig.claims.complete(&key(1), 1)).expect("the holder still holds the key");
}

// --- 4. the effect panics -------------------------------------------------------

/// A panicking effect: the pipeline settles the panic as an ordinary error
/// (a retry after the backoff), and the claim is free at once: the next
/// delivery, with no time passed, runs the effect with a higher fence.
#[cfg(panic = "unwind")]
#[test]
fn a_panicking_effect_retries_and_frees_the_key_at_once() {
    let builder = declare().max_deliveries(3).backoff(S(2), 2.0, S(10));
    let rig = rig(builder, LEASE, |_, _, n| async move {
        assert!(n > 1, "card processor bug");
        Ok(())
    });

    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, retry(S(2)));
    assert!(
        matches!(&p.event.kind, EventKind::Retried { error, .. } if error.contains("card processor bug")),
        "{:?}",
        p.event.kind
    );
    assert_eq!(rig.started(), [1]);

    let p = rig.deliver(&body(1), 2);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 2], "a higher fence, no lease waited");
    assert_eq!(rig.seen(), [Seen::Ran(2)]);
    assert_eq!(rig.clock.elapsed(), Duration::ZERO);
}

/// The same panic under tier one: the in-process retry claims the key again
/// after tier one's backoff, not after the lease.
#[cfg(panic = "unwind")]
#[test]
fn a_panicking_effect_is_retried_in_process_with_a_higher_fence() {
    let builder = declare()
        .max_deliveries(3)
        .tier_one(2)
        .tier_one_backoff(MS(100), 2.0, S(1));
    let rig = rig(builder, LEASE, |_, _, n| async move {
        assert!(n > 1, "card processor bug");
        Ok(())
    });
    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(p.executions(), 2);
    assert_eq!(rig.started(), [1, 2]);
    assert_eq!(rig.clock.sleeps(), [MS(100)], "tier one's backoff only");
    assert_eq!(rig.claim(1, LEASE), Claim::Done);
}

// --- 5. the effect fails --------------------------------------------------------

/// Each outcome an effect asks for is the delivery's outcome, and the claim
/// is given up: the next claim, with no time passed, gets the next fence.
#[test]
fn a_failing_effect_keeps_its_outcome_and_releases_the_claim() {
    type Case = (
        &'static str,
        fn() -> JobError,
        fn(&Processed) -> bool,
        Outcome,
    );
    let cases: [Case; 4] = [
        (
            "permanent",
            || JobError::permanent("card declined"),
            |p| failed(p).0 == FailureKind::Permanent,
            Outcome::Permanent,
        ),
        (
            "reject",
            || JobError::reject("not ours"),
            |p| p.settlement == Settlement::Reject,
            Outcome::Reject,
        ),
        (
            "retry after",
            || JobError::retry_after("rate limited", S(60)),
            |p| p.settlement == retry(S(60)),
            Outcome::RetryAfter(S(60)),
        ),
        (
            "ordinary",
            || JobError::new("gateway timeout"),
            |p| p.settlement == retry(S(2)),
            Outcome::Ordinary,
        ),
    ];
    for (name, error, settled_so, outcome) in cases {
        let builder = declare().max_deliveries(3).backoff(S(2), 2.0, S(10));
        let rig = rig(builder, LEASE, move |_, _, _| async move { Err(error()) });
        let p = rig.deliver(&body(1), 1);
        assert!(settled_so(&p), "{name}: {:?}", p.settlement);
        assert_eq!(rig.seen(), [Seen::Failed(outcome)], "{name}");
        assert_eq!(rig.started(), [1], "{name}");
        assert_eq!(
            rig.claim(1, LEASE),
            Claim::Claimed { fence: 2 },
            "{name}: released, not held for the lease"
        );
    }
}

/// A short retry-after from the effect is waited in process; the claim it
/// gave up is claimed again with the next fence.
#[test]
fn a_short_retry_after_from_the_effect_claims_again_in_process() {
    let builder = declare()
        .max_deliveries(3)
        .tier_one(2)
        .tier_one_max_wait(S(5));
    let rig = rig(builder, LEASE, |_, _, n| async move {
        if n == 1 {
            Err(JobError::retry_after("rate limited", S(1)))
        } else {
            Ok(())
        }
    });
    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.clock.sleeps(), [S(1)]);
    assert_eq!(
        rig.seen(),
        [Seen::Failed(Outcome::RetryAfter(S(1))), Seen::Ran(2)]
    );
}

// --- 6. shutdown mid-effect -------------------------------------------------------

/// Shutdown while the effect waits: the effect returns the cancellation, its
/// claim is given up, and the delivery is handed back by the shutdown rule
/// (a zero-delay retry that skips the cap, here on the last delivery). The
/// redelivery runs the effect with the next fence, without waiting a lease.
#[test]
fn shutdown_mid_effect_releases_and_hands_the_delivery_back() {
    let rig = rig(declare().max_deliveries(3), LEASE, |ctx, _, _| async move {
        ctx.sleep(S(10)).await?;
        Ok(())
    });
    let cancel = CancelToken::new();
    let stopping = Arc::new(ShutdownDuringSleep {
        clock: rig.clock.clone(),
        cancel: cancel.clone(),
    });

    let p = rig.deliver_on(&body(1), 3, Some(0), stopping, &cancel);

    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(Duration::ZERO),
            shutdown: true,
        }
    );
    assert!(matches!(
        p.event.kind,
        EventKind::Retried { shutdown: true, .. }
    ));
    assert_eq!(rig.seen(), [Seen::Failed(Outcome::Cancelled)]);
    assert_eq!(rig.started(), [1]);

    // The backend hands it back, counting the shutdown return.
    let p = rig.deliver_on(
        &body(1),
        4,
        Some(1),
        Arc::new(rig.clock.clone()),
        &CancelToken::new(),
    );
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 2]);
    assert_eq!(rig.seen_last(), Seen::Ran(2));
    assert_eq!(rig.clock.elapsed(), S(10), "the effect's own sleep only");
}

// --- 7. the effect is dropped mid-way --------------------------------------------

/// The job's timeout fires while the effect hangs. Timeouts are cooperative
/// (a deadline in the context): this handler honours it by dropping its
/// `run_once` at the deadline, so nothing gives the claim up. It stays held until its lease ends; a
/// redelivery before then is a retry after the remaining lease, and one
/// after it runs the effect with the next fence. The dropped holder's
/// completion would be too late.
#[test]
fn a_timeout_mid_effect_leaves_the_claim_to_its_lease() {
    let builder = declare()
        .max_deliveries(5)
        .timeout(S(10))
        .backoff(S(1), 1.0, S(1));
    let rig = rig(builder, S(15), |_, _, n| async move {
        if n == 1 {
            std::future::pending::<()>().await;
        }
        Ok(())
    });

    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, retry(S(1)), "a missed deadline is ordinary");
    assert_eq!(rig.seen(), [Seen::Failed(Outcome::Ordinary)]);
    assert_eq!(rig.started(), [1]);
    assert_eq!(rig.clock.elapsed(), S(10));

    rig.clock.advance(S(1));
    let p = rig.deliver(&body(1), 2);
    assert_eq!(p.settlement, retry(S(4)), "the rest of the 15 s lease");
    assert_eq!(rig.seen_last(), Seen::Held(S(4)));
    assert_eq!(rig.started(), [1]);

    rig.clock.advance(S(4));
    let p = rig.deliver(&body(1), 3);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 2]);
    assert!(matches!(
        ready(rig.claims.complete(&key(1), 1)),
        Err(ClaimError::Lost { fence: 1, .. })
    ));
}

/// The same when the whole delivery is dropped mid-effect (a worker killed):
/// the redelivery waits out the lease, then runs with the next fence.
#[test]
fn a_delivery_dropped_mid_effect_leaves_the_claim_to_its_lease() {
    let rig = rig(declare().max_deliveries(5), LEASE, |_, _, n| async move {
        if n == 1 {
            std::future::pending::<()>().await;
        }
        Ok(())
    });
    let runtime: Arc<dyn Runtime> = Arc::new(rig.clock.clone());
    let first = body(1);
    {
        let delivery = Incoming {
            queue: QUEUE,
            body: &first,
            attempt: 1,
            shutdown_returns: None,
            deadline: None,
        };
        let cancel = CancelToken::new();
        let mut running = pin!(rig.registry.process(delivery, &runtime, &cancel));
        let poll = running
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()));
        assert!(poll.is_pending(), "the effect hangs");
    }
    assert_eq!(rig.started(), [1]);
    assert!(rig.seen().is_empty(), "the execution never finished");

    rig.clock.advance(S(5));
    let p = rig.deliver(&first, 2);
    assert_eq!(p.settlement, retry(LEASE - S(5)));
    rig.clock.advance(LEASE - S(5));
    let p = rig.deliver(&first, 3);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 2]);
}

// --- 8. a duplicate of a completed job ---------------------------------------------

/// The same order dispatched again (a new message id): acknowledged, the
/// effect not run, `AlreadyDone`, however much later it comes.
#[test]
fn a_duplicate_of_a_completed_job_is_acknowledged_without_running() {
    let rig = rig(declare().max_deliveries(3), LEASE, |_, _, _| async {
        Ok(())
    });
    let (first, second) = (body(1), body(1));
    let p1 = rig.deliver(&first, 1);
    assert_eq!(p1.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1]);

    rig.clock.advance(LEASE * 10);
    let p2 = rig.deliver(&second, 1);
    assert_ne!(p1.event.message_id, p2.event.message_id, "a new message");
    assert_eq!(p2.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1], "the effect ran once");
    assert_eq!(rig.seen(), [Seen::Ran(1), Seen::AlreadyDone]);
    // Another order is its own key.
    assert_eq!(rig.deliver(&body(2), 1).settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 1]);
}

// --- beyond the list: an effect longer than its lease ----------------------------

/// An effect that outlives its lease: its completion is lost (an ordinary
/// retry, nothing recorded), and the redelivery claims the key again with
/// the next fence and runs the effect again, as the claim docs warn.
#[test]
fn a_completion_after_the_lease_is_lost_and_the_effect_runs_again() {
    let builder = declare().max_deliveries(3).backoff(S(1), 1.0, S(1));
    let rig = rig(builder, S(5), |ctx, _, n| async move {
        if n == 1 {
            ctx.sleep(S(8)).await?;
        }
        Ok(())
    });
    let p = rig.deliver(&body(1), 1);
    assert_eq!(p.settlement, retry(S(1)), "a lost completion is ordinary");
    assert_eq!(rig.seen(), [Seen::Failed(Outcome::Ordinary)]);
    assert!(
        matches!(&p.event.kind, EventKind::Retried { error, .. } if error.contains("was lost")),
        "{:?}",
        p.event.kind
    );
    assert_eq!(rig.started(), [1]);

    let p = rig.deliver(&body(1), 2);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1, 2]);
    assert_eq!(rig.claim(1, LEASE), Claim::Done);
}

/// The same, with another worker that claimed the key after the first lease
/// ended and completed it while the first effect still ran.
#[test]
fn a_late_holder_finds_the_key_done_by_a_newer_one() {
    let builder = declare().max_deliveries(3).backoff(S(1), 1.0, S(1));
    let rig = rig(builder, S(5), |ctx, _, _| async move {
        ctx.sleep(S(12)).await?;
        Ok(())
    });
    // Half-way (6 s in) the first lease has ended: another worker claims
    // the key (fence 2) and completes it.
    let runtime = MidSleep::new(&rig, |claims| {
        assert_eq!(
            ready(claims.claim(&key(1), S(5))).unwrap(),
            Claim::Claimed { fence: 2 }
        );
        ready(claims.complete(&key(1), 2)).unwrap();
    });
    let p = rig.deliver_on(&body(1), 1, None, runtime.clone(), &CancelToken::new());
    assert!(runtime.acted());
    assert_eq!(p.settlement, retry(S(1)));
    let p = rig.deliver(&body(1), 2);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(rig.started(), [1], "the effect did not run a second time");
    assert_eq!(rig.seen_last(), Seen::AlreadyDone);
}

// --- 9. generated sequences against a model -------------------------------------------

#[cfg(not(target_arch = "wasm32"))]
mod generated {
    use super::*;
    use proptest::prelude::*;

    const WORKERS: usize = 3;
    const KEYS: [&str; 3] = ["k0", "k1", "k2"];

    /// Which fence a worker presents.
    #[derive(Debug, Clone, Copy)]
    enum Pick {
        /// The last one it was given for the key (the latest if none).
        Own,
        /// The key's latest.
        Latest,
        /// One below the latest.
        Stale,
        /// One never given out.
        Unissued,
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Claim {
            worker: usize,
            key: usize,
            lease: u64,
        },
        Complete {
            worker: usize,
            key: usize,
            pick: Pick,
        },
        Release {
            worker: usize,
            key: usize,
            pick: Pick,
        },
        Extend {
            worker: usize,
            key: usize,
            pick: Pick,
            lease: u64,
        },
        /// Moves the clock this many milliseconds.
        Advance(u64),
        /// Moves the clock exactly to the end of the key's latest lease.
        ToLeaseEnd(usize),
    }

    fn pick() -> impl Strategy<Value = Pick> {
        prop_oneof![
            3 => Just(Pick::Own),
            2 => Just(Pick::Latest),
            1 => Just(Pick::Stale),
            1 => Just(Pick::Unissued),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        let worker = 0..WORKERS;
        let key = 0..KEYS.len();
        let lease = prop_oneof![Just(1u64), Just(5), 1u64..=120];
        prop_oneof![
            4 => (worker.clone(), key.clone(), lease.clone())
                .prop_map(|(worker, key, lease)| Op::Claim { worker, key, lease }),
            2 => (worker.clone(), key.clone(), pick())
                .prop_map(|(worker, key, pick)| Op::Complete { worker, key, pick }),
            2 => (worker.clone(), key.clone(), pick())
                .prop_map(|(worker, key, pick)| Op::Release { worker, key, pick }),
            2 => (worker, key.clone(), pick(), lease)
                .prop_map(|(worker, key, pick, lease)| Op::Extend { worker, key, pick, lease }),
            3 => prop_oneof![Just(0u64), 1u64..=150].prop_map(Op::Advance),
            1 => key.prop_map(Op::ToLeaseEnd),
        ]
    }

    /// What the rules say of one key.
    #[derive(Debug, Default, Clone)]
    struct KeyModel {
        /// The latest fence given out (0: none yet).
        latest: u64,
        /// When the latest claim's lease ends; `None` once it was released
        /// or completed (or before any claim).
        lease_end: Option<Duration>,
        done: bool,
        /// Every claim granted: its fence and when it stops holding the key
        /// (`None` once given up or completed).
        grants: Vec<(u64, Option<Duration>)>,
    }

    impl KeyModel {
        fn live(&self, now: Duration) -> bool {
            self.lease_end.is_some_and(|end| end > now)
        }

        /// Whether an operation with `fence` must succeed.
        fn accepts(&self, fence: u64, now: Duration) -> bool {
            fence == self.latest && self.live(now) && !self.done
        }

        fn grant_mut(&mut self, fence: u64) -> &mut (u64, Option<Duration>) {
            self.grants
                .iter_mut()
                .find(|(f, _)| *f == fence)
                .expect("an accepted fence was granted")
        }
    }

    struct World {
        clock: VirtualRuntime,
        store: MemoryClaims,
        keys: Vec<KeyModel>,
        /// Each worker's last fence, per key.
        own: [[Option<u64>; KEYS.len()]; WORKERS],
    }

    impl World {
        fn new() -> Self {
            let clock = VirtualRuntime::new();
            World {
                store: MemoryClaims::with_clock(Arc::new(clock.clone())),
                clock,
                keys: vec![KeyModel::default(); KEYS.len()],
                own: [[None; KEYS.len()]; WORKERS],
            }
        }

        fn fence(&self, worker: usize, key: usize, pick: Pick) -> u64 {
            let latest = self.keys[key].latest;
            match pick {
                Pick::Own => self.own[worker][key].unwrap_or(latest),
                Pick::Latest => latest,
                Pick::Stale => latest.saturating_sub(1),
                Pick::Unissued => latest + 1,
            }
        }

        /// Applies `op` to the store and checks the answer against the model.
        fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
            let now = self.clock.elapsed();
            match op {
                Op::Advance(ms) => self.clock.advance(MS(ms)),
                Op::ToLeaseEnd(key) => {
                    if let Some(end) = self.keys[key].lease_end.filter(|end| *end > now) {
                        self.clock.advance(end - now);
                    }
                }
                Op::Claim { worker, key, lease } => {
                    let lease = MS(lease);
                    let answer = ready(self.store.claim(KEYS[key], lease));
                    let model = &mut self.keys[key];
                    let answer = answer.map_err(|e| TestCaseError::fail(format!("{e}")))?;
                    if model.done {
                        prop_assert_eq!(answer, Claim::Done, "done is absorbing");
                    } else if model.live(now) {
                        let end = model.lease_end.unwrap();
                        prop_assert_eq!(
                            answer,
                            Claim::Held {
                                remaining: end - now
                            },
                            "a live lease holds the key"
                        );
                    } else {
                        let Claim::Claimed { fence } = answer else {
                            return Err(TestCaseError::fail(format!(
                                "a free key must be claimed, got {answer:?}"
                            )));
                        };
                        if model.latest == 0 {
                            prop_assert_eq!(fence, 1, "fences start at 1");
                        }
                        prop_assert!(
                            fence > model.latest,
                            "fence {} after {}",
                            fence,
                            model.latest
                        );
                        model.latest = fence;
                        model.lease_end = Some(now + lease);
                        model.grants.push((fence, Some(now + lease)));
                        self.own[worker][key] = Some(fence);
                    }
                }
                Op::Complete { worker, key, pick } => {
                    let fence = self.fence(worker, key, pick);
                    let answer = ready(self.store.complete(KEYS[key], fence));
                    let model = &mut self.keys[key];
                    if model.accepts(fence, now) {
                        prop_assert!(answer.is_ok(), "complete {}: {:?}", fence, answer);
                        model.done = true;
                        model.lease_end = None;
                        model.grant_mut(fence).1 = None;
                    } else {
                        lost(answer, KEYS[key], fence)?;
                    }
                }
                Op::Release { worker, key, pick } => {
                    let fence = self.fence(worker, key, pick);
                    let answer = ready(self.store.release(KEYS[key], fence));
                    let model = &mut self.keys[key];
                    if model.accepts(fence, now) {
                        prop_assert!(answer.is_ok(), "release {}: {:?}", fence, answer);
                        model.lease_end = None;
                        model.grant_mut(fence).1 = None;
                    } else {
                        lost(answer, KEYS[key], fence)?;
                    }
                }
                Op::Extend {
                    worker,
                    key,
                    pick,
                    lease,
                } => {
                    let fence = self.fence(worker, key, pick);
                    let answer = ready(self.store.extend(KEYS[key], fence, MS(lease)));
                    let model = &mut self.keys[key];
                    if model.accepts(fence, now) {
                        prop_assert!(answer.is_ok(), "extend {}: {:?}", fence, answer);
                        model.lease_end = Some(now + MS(lease));
                        model.grant_mut(fence).1 = Some(now + MS(lease));
                    } else {
                        lost(answer, KEYS[key], fence)?;
                    }
                }
            }
            // At most one live holder per key, counted over every claim the
            // store granted (not over the model's single lease).
            let now = self.clock.elapsed();
            for (name, model) in KEYS.iter().zip(&self.keys) {
                let live = model
                    .grants
                    .iter()
                    .filter(|(_, end)| end.is_some_and(|end| end > now))
                    .count();
                prop_assert!(live <= 1, "{} live holders of {}", live, name);
                prop_assert!(
                    model.grants.windows(2).all(|w| w[0].0 < w[1].0),
                    "fences of {} grow: {:?}",
                    name,
                    model.grants
                );
            }
            Ok(())
        }
    }

    fn lost(answer: Result<(), ClaimError>, key: &str, fence: u64) -> Result<(), TestCaseError> {
        match answer {
            Err(ClaimError::Lost { key: k, fence: f }) if k == key && f == fence => Ok(()),
            other => Err(TestCaseError::fail(format!(
                "{key} fence {fence} must be lost, got {other:?}"
            ))),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Random interleavings of claim, complete, release, extend and time
        /// over one to three keys: every answer is the one the rules give.
        #[test]
        fn claim_operations_follow_the_rules(
            keys in 1..=KEYS.len(),
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut world = World::new();
            for op in ops {
                let op = match op {
                    Op::Claim { worker, key, lease } => Op::Claim { worker, key: key % keys, lease },
                    Op::Complete { worker, key, pick } => Op::Complete { worker, key: key % keys, pick },
                    Op::Release { worker, key, pick } => Op::Release { worker, key: key % keys, pick },
                    Op::Extend { worker, key, pick, lease } => {
                        Op::Extend { worker, key: key % keys, pick, lease }
                    }
                    Op::ToLeaseEnd(key) => Op::ToLeaseEnd(key % keys),
                    advance => advance,
                };
                world.step(op)?;
            }
        }
    }
}

/// A held claim says nothing about the job's dependency: it does not count
/// toward the job's attached breaker (a breaker opened by a busy key would
/// skip tier one for every other key of the job).
#[test]
fn a_held_claim_does_not_count_toward_the_breaker() {
    let breaker = jobrail::CircuitBreaker::with_clock(
        "payments",
        jobrail::BreakerConfig {
            failure_threshold: 1,
            cool_down: S(60),
        },
        Arc::new(jobrail::SystemClock),
    )
    .unwrap();
    let builder = declare()
        .max_deliveries(3)
        .tier_one(2)
        .tier_one_max_wait(S(1))
        .breaker(breaker.clone());
    let rig = rig(builder, LEASE, |_, _, _| async { Ok(()) });
    assert_eq!(rig.claim(1, LEASE), Claim::Claimed { fence: 1 });
    let p = rig.deliver(&body(1), 1);
    assert!(
        matches!(p.settlement, Settlement::Retry { .. }),
        "{:?}",
        p.settlement
    );
    assert_eq!(rig.seen_last(), Seen::Held(LEASE));
    assert_eq!(
        breaker.state(),
        jobrail::BreakerState::Closed,
        "a held claim opened the job's breaker"
    );
}
