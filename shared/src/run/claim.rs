//! Running an effect once: claims on a business key ([`ClaimStore`],
//! [`run_once`], [`MemoryClaims`]).
//!
//! Both tiers of retry run a handler more than once, and a crash between an
//! effect and its acknowledgement repeats the effect. A claim makes the
//! repeat harmless: before the effect, the handler claims a *business* key
//! (an order id, a report id; never the message id, which is new on every
//! dispatch) with a lease. The store answers, atomically:
//!
//! - [`Claim::Claimed`]: this caller holds the key until the lease ends. Run
//!   the effect, then [`ClaimStore::complete`]. The claim carries a fencing
//!   token ([`Claim::Claimed::fence`]) that grows on every new claim of the
//!   key, so a holder whose lease ran out cannot complete over a newer one.
//! - [`Claim::Done`]: a holder completed the effect already: skip it, and
//!   acknowledge.
//! - [`Claim::Held`]: another holder's lease runs for `remaining` more. The
//!   delivery is settled as a retry after that time, through the ordinary
//!   [`RetryAfter`](crate::RetryAfter) marker ([`Claim::proceed`]).
//!
//! A holder that dies (process killed, instance evicted) simply stops: its
//! lease expires and the next claim takes the key with a higher fence. A
//! completion is accepted only while the holder's lease is live and its
//! fence is the key's latest; a late one gets [`ClaimError::Lost`].
//!
//! [`run_once`] wraps the three answers for a handler; stores implement
//! [`ClaimStore`]: [`MemoryClaims`] here (one process, tests and the quick
//! start), Postgres and Redis in `jobrail-native`, Cloudflare D1 in
//! `jobrail-edge`. The conformance suite for claim stores
//! (`jobrail-conformance`) holds every store to the same answers.
//!
//! # What a claim cannot do
//!
//! A claim turns "at least once" into "once" only for what the store can see.
//! If the process dies after an effect outside the store (an HTTP call, an
//! email) and before [`ClaimStore::complete`], the lease expires and the
//! effect runs again: use the remote side's idempotency key too, or record
//! the completion in the same transaction as a database effect (the
//! Postgres store's `complete_in`). A lease shorter than the effect lets a
//! second holder start while the first still works: pick a lease longer
//! than the job's timeout, or [`ClaimStore::extend`] it.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use crate::model::error::{BoxError, JobError, RetryAfter};
use crate::model::maybe_send::{BoxFuture, MaybeSend, MaybeSync};

/// The longest key a store accepts, in bytes.
pub const MAX_CLAIM_KEY_BYTES: usize = 512;

/// The longest lease a store accepts: 7 days.
pub const MAX_CLAIM_LEASE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The shortest retry [`Claim::proceed`] asks for when another holder's
/// lease is about to end (so a retry never spins on a lease that ends now).
pub const MIN_HELD_RETRY: Duration = Duration::from_millis(50);

/// What a claim attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This caller holds the key: run the effect, then complete the claim
    /// with `fence`.
    Claimed {
        /// The fencing token: greater than every earlier claim's of this key.
        fence: u64,
    },
    /// The effect happened already (a holder completed the claim).
    Done,
    /// Another holder's lease runs for `remaining` more.
    Held {
        /// Until the other holder's lease ends (zero when it is ending now).
        remaining: Duration,
    },
}

impl Claim {
    /// What a handler does next: `Ok(Some(fence))` to run the effect,
    /// `Ok(None)` to skip it (done), or, when another holder has the key, an
    /// error carrying [`RetryAfter`] of the lease's remaining time (at least
    /// [`MIN_HELD_RETRY`]), which settles the delivery as a retry then.
    ///
    /// ```
    /// use std::time::Duration;
    /// use jobrail::{Claim, Outcome};
    ///
    /// assert_eq!(Claim::Claimed { fence: 3 }.proceed("order-7").unwrap(), Some(3));
    /// assert_eq!(Claim::Done.proceed("order-7").unwrap(), None);
    /// let held = Claim::Held { remaining: Duration::from_secs(4) }.proceed("order-7").unwrap_err();
    /// assert_eq!(held.outcome(), Outcome::RetryAfter(Duration::from_secs(4)));
    /// ```
    pub fn proceed(self, key: &str) -> Result<Option<u64>, JobError> {
        match self {
            Claim::Claimed { fence } => Ok(Some(fence)),
            Claim::Done => Ok(None),
            Claim::Held { remaining } => {
                let delay = remaining.max(MIN_HELD_RETRY);
                Err(RetryAfter::new(
                    ClaimHeld {
                        key: key.to_owned(),
                        remaining,
                    },
                    delay,
                )
                .into())
            }
        }
    }
}

/// The cause of the retry [`Claim::proceed`] asks for: another holder has
/// the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimHeld {
    /// The business key.
    pub key: String,
    /// Until the other holder's lease ends.
    pub remaining: Duration,
}

impl fmt::Display for ClaimHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "claim `{}` is held by another worker for {} ms more",
            self.key,
            self.remaining.as_millis()
        )
    }
}

impl std::error::Error for ClaimHeld {}

/// Why a claim operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// The completion (or extension, or release) came too late: the claim's
    /// lease had ended, or a newer claim (higher fence) took the key. The
    /// effect may run again under the newer claim.
    #[error(
        "claim `{key}` (fence {fence}) was lost: its lease ended or a newer claim took the key"
    )]
    Lost {
        /// The business key.
        key: String,
        /// The fence of the lost claim.
        fence: u64,
    },
    /// The key or the lease is not acceptable (empty or too long a key, a
    /// zero or too long lease).
    #[error("invalid claim: {0}")]
    Invalid(String),
    /// The store did not answer, or answered with an error; nothing can be
    /// said about the claim.
    #[error("claim store error: {0}")]
    Store(#[source] BoxError),
    /// The store cannot do this operation (a store without
    /// [`ClaimStore::state`], say): nothing was read or changed.
    #[error("unsupported by this claim store: {0}")]
    Unsupported(String),
}

/// The state of a key, read without changing it ([`ClaimStore::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimState {
    /// Never claimed, released, or its last lease ended: the next claim
    /// takes it.
    Free,
    /// A holder's lease runs for `remaining` more.
    Held {
        /// Until the holder's lease ends.
        remaining: Duration,
    },
    /// A holder completed it: every claim answers [`Claim::Done`].
    Done,
}

impl ClaimError {
    /// A store error from any cause.
    pub fn store(cause: impl Into<BoxError>) -> Self {
        ClaimError::Store(cause.into())
    }
}

/// Checks a key and a lease as every store does before any I/O: a key of 1
/// to [`MAX_CLAIM_KEY_BYTES`] bytes, a lease of at least one millisecond
/// and at most [`MAX_CLAIM_LEASE`].
pub fn validate_claim(key: &str, lease: Duration) -> Result<(), ClaimError> {
    if key.is_empty() {
        return Err(ClaimError::Invalid("the key is empty".into()));
    }
    if key.len() > MAX_CLAIM_KEY_BYTES {
        return Err(ClaimError::Invalid(format!(
            "the key is {} bytes, more than {MAX_CLAIM_KEY_BYTES}",
            key.len()
        )));
    }
    if lease < Duration::from_millis(1) {
        return Err(ClaimError::Invalid(format!(
            "a lease of {lease:?} is shorter than one millisecond"
        )));
    }
    if lease > MAX_CLAIM_LEASE {
        return Err(ClaimError::Invalid(format!(
            "a lease of {lease:?} is longer than {MAX_CLAIM_LEASE:?}"
        )));
    }
    Ok(())
}

/// A store of claims on business keys.
///
/// Every operation is atomic in the store: two callers racing on one key
/// never both get [`Claim::Claimed`] for live leases. See the module docs of
/// the crate's claim API ([`run_once`]) for the rules.
pub trait ClaimStore: MaybeSend + MaybeSync {
    /// Claims `key` for `lease`, unless it is done or held under a live
    /// lease. A claim of a key whose lease ended (its holder died or gave
    /// up) succeeds with a higher fence.
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>>;

    /// Records that the effect of the claim `fence` happened: every later
    /// claim of `key` answers [`Claim::Done`]. [`ClaimError::Lost`] if the
    /// lease has ended or `fence` is not the key's latest claim.
    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>>;

    /// Gives the claim `fence` up without completing it (the effect did not
    /// happen): the next claim succeeds at once. [`ClaimError::Lost`] if it
    /// was no longer held by `fence` (nothing changes then).
    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>>;

    /// Extends the live claim `fence` to end `lease` from now (for effects
    /// longer than the first lease). [`ClaimError::Lost`] if it was no
    /// longer held by `fence`.
    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>>;

    /// Reads the state of `key` without claiming or changing it (the
    /// schedules' listing of the ticks fired reads it). The default answers
    /// [`ClaimError::Unsupported`]: a store that can read its keys
    /// overrides it.
    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        let _ = key;
        Box::pin(async {
            Err(ClaimError::Unsupported(
                "this claim store cannot read the state of a key".into(),
            ))
        })
    }
}

impl<S: ClaimStore + ?Sized> ClaimStore for Arc<S> {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        (**self).claim(key, lease)
    }
    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        (**self).complete(key, fence)
    }
    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        (**self).release(key, fence)
    }
    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        (**self).extend(key, fence, lease)
    }
    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        (**self).state(key)
    }
}

/// What [`run_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once<T> {
    /// This call ran the effect (and recorded its completion); its value.
    Ran(T),
    /// The effect had happened already: it did not run again.
    AlreadyDone,
}

impl<T> Once<T> {
    /// Whether this call ran the effect.
    pub fn ran(&self) -> bool {
        matches!(self, Once::Ran(_))
    }
}

/// Runs `effect` once for `key`, across every worker and redelivery that
/// shares `store`.
///
/// - The key is claimed for `lease`. If this call holds it, `effect` runs
///   with the claim's fence; on success the completion is recorded and the
///   value returned ([`Once::Ran`]); on error the claim is released (so a
///   retry may run the effect at once) and the error returned unchanged,
///   markers and all. A panic in the effect releases the claim too, then
///   goes on (the pipeline settles it as a panic).
/// - A handler that abandons the effect (drops the future, say when its
///   deadline passes) or a worker killed mid-effect cannot release: the
///   claim is held until its lease ends, and a retry meanwhile is asked to
///   wait for it. Pick a lease a little longer than the job's timeout.
/// - A held key's retry does not count toward the job's circuit breaker: it
///   says nothing about the dependency.
/// - If the effect happened already, nothing runs: [`Once::AlreadyDone`],
///   and the handler returns `Ok` (the delivery is acknowledged).
/// - If another worker holds the key, the error asks for a retry after the
///   remaining lease ([`Claim::proceed`]).
/// - A store error, or a completion that came too late
///   ([`ClaimError::Lost`]), is an ordinary error: the delivery retries, and
///   a repeat finds the key done, or claims it again.
///
/// ```
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// use jobrail::{run_once, JobError, MemoryClaims, Once};
///
/// let store = MemoryClaims::new();
/// let charges = AtomicU32::new(0);
/// let charge = || async {
///     charges.fetch_add(1, Ordering::SeqCst);
///     Ok::<_, JobError>("receipt-1")
/// };
/// futures_executor::block_on(async {
///     let first = run_once(&store, "order-42", Duration::from_secs(30), |_fence| charge()).await;
///     assert_eq!(first.unwrap(), Once::Ran("receipt-1"));
///     // A redelivery of the same order: the charge does not happen again.
///     let again = run_once(&store, "order-42", Duration::from_secs(30), |_fence| charge()).await;
///     assert_eq!(again.unwrap(), Once::AlreadyDone);
/// });
/// assert_eq!(charges.load(Ordering::SeqCst), 1);
/// ```
pub async fn run_once<S, T, F, Fut>(
    store: &S,
    key: &str,
    lease: Duration,
    effect: F,
) -> Result<Once<T>, JobError>
where
    S: ClaimStore + ?Sized,
    F: FnOnce(u64) -> Fut,
    Fut: Future<Output = Result<T, JobError>>,
{
    let claim = store.claim(key, lease).await.map_err(JobError::new)?;
    let Some(fence) = claim.proceed(key)? else {
        return Ok(Once::AlreadyDone);
    };
    // A panic in the effect (or in the call that makes its future) releases
    // the claim before it goes on to the pipeline, which settles it as a
    // panic: the retry may run the effect at once instead of waiting out the
    // lease. (Where panics abort, wasm32, the lease ends the claim instead.)
    let outcome = AssertUnwindSafe(async move { effect(fence).await })
        .catch_unwind()
        .await;
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(panic) => {
            let _ = store.release(key, fence).await;
            std::panic::resume_unwind(panic)
        }
    };
    match outcome {
        Ok(value) => {
            store.complete(key, fence).await.map_err(JobError::new)?;
            Ok(Once::Ran(value))
        }
        Err(err) => {
            // Best effort: if the release fails, the lease expires instead.
            let _ = store.release(key, fence).await;
            Err(err)
        }
    }
}

#[cfg(feature = "memory-claims")]
mod memory {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::model::runtime::{Clock, Instant, SystemClock};

    /// Claims in this process's memory: for tests, the quick start and a
    /// single worker process. Nothing survives the process, and two processes
    /// do not share it; use Postgres, Redis or D1 for that.
    ///
    /// Clones share the same claims. Time comes from a [`Clock`] (the system
    /// clock by default; a [`VirtualRuntime`](crate::VirtualRuntime) in tests).
    #[derive(Clone)]
    pub struct MemoryClaims {
        clock: Arc<dyn Clock>,
        state: Arc<Mutex<HashMap<String, Slot>>>,
    }

    #[derive(Debug, Clone, Copy)]
    struct Slot {
        /// The latest fence given out for the key.
        fence: u64,
        /// `Some(end)` while held (until `end`), `None` once done or released.
        held_until: Option<Instant>,
        done: bool,
    }

    impl fmt::Debug for MemoryClaims {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("MemoryClaims")
                .field("keys", &self.state.lock().map(|s| s.len()).unwrap_or(0))
                .finish()
        }
    }

    impl Default for MemoryClaims {
        fn default() -> Self {
            Self::new()
        }
    }

    impl MemoryClaims {
        /// An empty store on the system clock.
        pub fn new() -> Self {
            Self::with_clock(Arc::new(SystemClock))
        }

        /// An empty store on `clock`.
        pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
            MemoryClaims {
                clock,
                state: Arc::new(Mutex::new(HashMap::new())),
            }
        }

        fn with_state<R>(&self, f: impl FnOnce(&mut HashMap<String, Slot>, Instant) -> R) -> R {
            let now = self.clock.now();
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut state, now)
        }

        fn claim_now(&self, key: &str, lease: Duration) -> Result<Claim, ClaimError> {
            validate_claim(key, lease)?;
            Ok(self.with_state(|state, now| {
                let slot = state.entry(key.to_owned()).or_insert(Slot {
                    fence: 0,
                    held_until: None,
                    done: false,
                });
                if slot.done {
                    return Claim::Done;
                }
                if let Some(end) = slot.held_until {
                    if end > now {
                        return Claim::Held {
                            remaining: end - now,
                        };
                    }
                }
                slot.fence += 1;
                slot.held_until = Some(now + lease);
                Claim::Claimed { fence: slot.fence }
            }))
        }

        /// Applies `change` to the live claim `fence` of `key`, or says it is lost.
        fn held(
            &self,
            key: &str,
            fence: u64,
            change: impl FnOnce(&mut Slot, Instant),
        ) -> Result<(), ClaimError> {
            self.with_state(|state, now| match state.get_mut(key) {
                Some(slot)
                    if slot.fence == fence
                        && !slot.done
                        && slot.held_until.is_some_and(|end| end > now) =>
                {
                    change(slot, now);
                    Ok(())
                }
                _ => Err(ClaimError::Lost {
                    key: key.to_owned(),
                    fence,
                }),
            })
        }
    }

    impl ClaimStore for MemoryClaims {
        fn claim<'a>(
            &'a self,
            key: &'a str,
            lease: Duration,
        ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
            let result = self.claim_now(key, lease);
            Box::pin(async move { result })
        }

        fn complete<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
        ) -> BoxFuture<'a, Result<(), ClaimError>> {
            let result = self.held(key, fence, |slot, _| {
                slot.done = true;
                slot.held_until = None;
            });
            Box::pin(async move { result })
        }

        fn release<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
        ) -> BoxFuture<'a, Result<(), ClaimError>> {
            let result = self.held(key, fence, |slot, _| slot.held_until = None);
            Box::pin(async move { result })
        }

        fn extend<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
            lease: Duration,
        ) -> BoxFuture<'a, Result<(), ClaimError>> {
            let result = validate_claim(key, lease).and_then(|()| {
                self.held(key, fence, |slot, now| slot.held_until = Some(now + lease))
            });
            Box::pin(async move { result })
        }

        fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
            let state = self.with_state(|state, now| match state.get(key) {
                Some(slot) if slot.done => ClaimState::Done,
                Some(Slot {
                    held_until: Some(end),
                    ..
                }) if *end > now => ClaimState::Held {
                    remaining: *end - now,
                },
                _ => ClaimState::Free,
            });
            Box::pin(async move { Ok(state) })
        }
    }
}
#[cfg(feature = "memory-claims")]
pub use memory::MemoryClaims;

#[cfg(all(test, feature = "memory-claims"))]
mod tests {
    use super::*;
    use crate::model::runtime::VirtualRuntime;
    use crate::Outcome;
    use futures_executor::block_on;

    fn store() -> (MemoryClaims, VirtualRuntime) {
        let runtime = VirtualRuntime::new();
        (MemoryClaims::with_clock(Arc::new(runtime.clone())), runtime)
    }

    fn claim(store: &MemoryClaims, key: &str, lease: Duration) -> Claim {
        block_on(store.claim(key, lease)).unwrap()
    }

    #[test]
    fn a_claim_is_exclusive_until_its_lease_ends() {
        let (store, runtime) = store();
        let lease = Duration::from_secs(10);
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 1 });
        runtime.advance(Duration::from_secs(4));
        assert_eq!(
            claim(&store, "k", lease),
            Claim::Held {
                remaining: Duration::from_secs(6)
            }
        );
        runtime.advance(Duration::from_secs(6));
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 2 });
        // The first holder's completion is too late: the key has a newer claim.
        assert!(matches!(
            block_on(store.complete("k", 1)),
            Err(ClaimError::Lost { fence: 1, .. })
        ));
        block_on(store.complete("k", 2)).unwrap();
        assert_eq!(claim(&store, "k", lease), Claim::Done);
    }

    #[test]
    fn a_completion_after_the_lease_is_lost_even_if_nobody_took_the_key() {
        let (store, runtime) = store();
        let lease = Duration::from_secs(1);
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 1 });
        runtime.advance(lease);
        assert!(matches!(
            block_on(store.complete("k", 1)),
            Err(ClaimError::Lost { .. })
        ));
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 2 });
    }

    #[test]
    fn release_and_extend() {
        let (store, runtime) = store();
        let lease = Duration::from_secs(2);
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 1 });
        block_on(store.release("k", 1)).unwrap();
        assert_eq!(claim(&store, "k", lease), Claim::Claimed { fence: 2 });
        block_on(store.extend("k", 2, Duration::from_secs(10))).unwrap();
        runtime.advance(Duration::from_secs(5));
        block_on(store.complete("k", 2)).unwrap();
        assert!(matches!(
            block_on(store.release("k", 2)),
            Err(ClaimError::Lost { .. })
        ));
        assert_eq!(claim(&store, "k", lease), Claim::Done);
    }

    #[test]
    fn bad_keys_and_leases_are_refused() {
        let (store, _) = store();
        for (key, lease) in [
            ("", Duration::from_secs(1)),
            ("k", Duration::ZERO),
            ("k", MAX_CLAIM_LEASE + Duration::from_secs(1)),
        ] {
            assert!(matches!(
                block_on(store.claim(key, lease)),
                Err(ClaimError::Invalid(_))
            ));
        }
        let long = "k".repeat(MAX_CLAIM_KEY_BYTES + 1);
        assert!(matches!(
            block_on(store.claim(&long, Duration::from_secs(1))),
            Err(ClaimError::Invalid(_))
        ));
    }

    #[test]
    fn run_once_settles_held_keys_as_a_retry_and_failed_effects_release() {
        let (store, runtime) = store();
        let lease = Duration::from_secs(30);
        claim(&store, "k", lease);
        runtime.advance(Duration::from_secs(10));
        let held = block_on(run_once(&store, "k", lease, |_| async {
            Ok::<_, JobError>(())
        }))
        .unwrap_err();
        assert_eq!(held.outcome(), Outcome::RetryAfter(Duration::from_secs(20)));
        assert!(held.find::<ClaimHeld>().is_some());

        // A failing effect keeps its outcome and frees the key.
        let failed = block_on(run_once(&store, "other", lease, |_| async {
            Err::<(), _>(JobError::permanent("card declined"))
        }))
        .unwrap_err();
        assert_eq!(failed.outcome(), Outcome::Permanent);
        assert_eq!(claim(&store, "other", lease), Claim::Claimed { fence: 2 });
    }

    #[test]
    fn a_panicking_effect_releases_its_claim() {
        let (store, _) = store();
        let lease = Duration::from_secs(30);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            block_on(run_once(&store, "k", lease, |_| async {
                panic!("card processor bug");
                #[allow(unreachable_code)]
                Ok::<(), JobError>(())
            }))
        }));
        assert!(caught.is_err(), "the panic goes on to the caller");
        assert_eq!(
            claim(&store, "k", lease),
            Claim::Claimed { fence: 2 },
            "the key is free at once, not held for the lease"
        );
    }
}
