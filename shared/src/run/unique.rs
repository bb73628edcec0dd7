//! Unique dispatch: at most one job per key within a time window
//! ([`dispatch_unique`]), the rule every producer runs.
//!
//! A producer asks for "this job, unless one with the same key went out
//! within the window" (Sidekiq's unique jobs, asynq's unique tasks). The
//! window is a claim on a [`ClaimStore`] that is never completed: its lease
//! is the window, so the key frees itself when the window ends. The rule
//! lives here, once; the native `Producer` and the edge's `EdgeProducer`
//! call it with their own send and their own reading of a send's error.

use std::future::Future;
use std::time::Duration;

use crate::run::claim::{Claim, ClaimError, ClaimStore};

/// What a unique dispatch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UniqueDispatch<T = String> {
    /// The job was sent: what the send returned (the producers' message id).
    Dispatched(T),
    /// A job with the same key was dispatched within the window: nothing
    /// was sent.
    Duplicate {
        /// Until the key may be dispatched again. [`Duration::MAX`] when
        /// the key was completed in the store (unique dispatch never
        /// completes its keys, but code sharing the store may have): such a
        /// key stays taken for good.
        remaining: Duration,
    },
}

impl<T> UniqueDispatch<T> {
    /// What the send returned, if this call sent the job.
    pub fn dispatched(&self) -> Option<&T> {
        match self {
            UniqueDispatch::Dispatched(sent) => Some(sent),
            UniqueDispatch::Duplicate { .. } => None,
        }
    }
}

/// Why a unique dispatch failed: the claim store's error (nothing was sent)
/// or the send's own error `E`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UniqueDispatchError<E> {
    /// The claim store did not answer, or refused the key or the window
    /// ([`ClaimError::Invalid`], checked before any I/O): nothing was sent.
    #[error("unique dispatch: {0}")]
    Claim(#[from] ClaimError),
    /// The send failed. The key was given back if the send certainly did
    /// not go out, so the dispatch may be repeated at once; if it may have,
    /// the key stays taken for the window.
    #[error("unique dispatch: {0}")]
    Dispatch(#[source] E),
}

/// The store key of a unique dispatch: `unique:<job name>:<key>`, so it
/// never meets a handler's own claims, nor another job's keys.
fn store_key(job_name: &str, key: &str) -> String {
    format!("unique:{job_name}:{key}")
}

/// Sends a job unless one of `job_name` with the same `key` was dispatched
/// within `window`: the rule behind every producer's unique dispatch (`.unique(...)` on its dispatch builder).
///
/// - The store key `unique:<job name>:<key>` is claimed for `window` (a
///   non-empty `key`, at most [`MAX_CLAIM_KEY_BYTES`](crate::MAX_CLAIM_KEY_BYTES)
///   bytes in all, a window of 1 ms to [`MAX_CLAIM_LEASE`](crate::MAX_CLAIM_LEASE):
///   checked before any I/O, [`UniqueDispatchError::Claim`] with
///   [`ClaimError::Invalid`]). The claim is
///   never completed: the key frees itself when the window ends.
/// - If this call holds the key, `send` runs once; its value comes back as
///   [`UniqueDispatch::Dispatched`].
/// - If another dispatch holds it, nothing is sent:
///   [`UniqueDispatch::Duplicate`] with the rest of the window. A key
///   completed in the store answers `Duplicate` with [`Duration::MAX`].
/// - If `send` fails, `certainly_unsent` reads its error. `true` (refused
///   before anything went out: an encode error, a size limit, a stopped
///   backend) releases the claim, so the caller can try again at once;
///   `false` (the message may have gone out) keeps the key for the window,
///   as a dispatch that happened would. Either way the error comes back as
///   [`UniqueDispatchError::Dispatch`]. A release that fails leaves the key
///   taken until the window ends; a `send` that panics or is dropped leaves
///   it taken too.
///
/// It prevents duplicate *dispatches*, not duplicate runs: redelivery still
/// repeats a handler; for that, claim in the handler ([`run_once`](crate::run_once)).
///
/// ```
/// use std::time::Duration;
/// use jobrail::{dispatch_unique, MemoryClaims, UniqueDispatch};
///
/// let claims = MemoryClaims::new();
/// let hour = Duration::from_secs(3600);
/// // A producer's send, and what its errors mean (here: never sent).
/// let send = move || async move { Ok::<_, std::io::Error>("message-1".to_string()) };
/// let unsent = |_: &std::io::Error| true;
/// futures_executor::block_on(async {
///     let first = dispatch_unique(&claims, "rebuild-index", "tenant-7", hour, send, unsent).await;
///     assert_eq!(first.unwrap(), UniqueDispatch::Dispatched("message-1".to_string()));
///     let again = dispatch_unique(&claims, "rebuild-index", "tenant-7", hour, send, unsent).await;
///     assert!(matches!(again.unwrap(), UniqueDispatch::Duplicate { .. }));
/// });
/// ```
pub async fn dispatch_unique<S, T, E, F, Fut, C>(
    claims: &S,
    job_name: &str,
    key: &str,
    window: Duration,
    send: F,
    certainly_unsent: C,
) -> Result<UniqueDispatch<T>, UniqueDispatchError<E>>
where
    S: ClaimStore + ?Sized,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    C: FnOnce(&E) -> bool,
{
    // The business key itself must be one the claim rules take (an empty
    // key would still make a store key, `unique:<job>:`), and so must the
    // store key: both before the store or the send is called.
    crate::run::claim::validate_claim(key, window)?;
    let key = store_key(job_name, key);
    crate::run::claim::validate_claim(&key, window)?;
    let fence = match claims.claim(&key, window).await? {
        Claim::Claimed { fence } => fence,
        Claim::Held { remaining } => return Ok(UniqueDispatch::Duplicate { remaining }),
        Claim::Done => {
            return Ok(UniqueDispatch::Duplicate {
                remaining: Duration::MAX,
            })
        }
    };
    match send().await {
        Ok(sent) => Ok(UniqueDispatch::Dispatched(sent)),
        Err(e) => {
            if certainly_unsent(&e) {
                // Best effort: if the release fails, the window ends it.
                let _ = claims.release(&key, fence).await;
            }
            Err(UniqueDispatchError::Dispatch(e))
        }
    }
}

#[cfg(all(test, feature = "memory-claims"))]
mod tests {
    use std::cell::Cell;
    use std::error::Error as _;
    use std::sync::Arc;

    use futures_executor::block_on;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::model::runtime::VirtualRuntime;
    use crate::run::claim::{MemoryClaims, MAX_CLAIM_KEY_BYTES, MAX_CLAIM_LEASE};

    /// A send's error, and whether it certainly did not go out.
    #[derive(Debug, thiserror::Error)]
    #[error("send failed (sent: {maybe_sent})")]
    struct SendFailed {
        maybe_sent: bool,
    }

    fn unsent(e: &SendFailed) -> bool {
        !e.maybe_sent
    }

    fn store() -> (MemoryClaims, VirtualRuntime) {
        let runtime = VirtualRuntime::new();
        (MemoryClaims::with_clock(Arc::new(runtime.clone())), runtime)
    }

    /// A unique dispatch whose send counts itself in `sends` and answers
    /// with its number, or fails as `fail` says.
    fn dispatch(
        claims: &MemoryClaims,
        job: &str,
        key: &str,
        window: Duration,
        sends: &Cell<u32>,
        fail: Option<SendFailed>,
    ) -> Result<UniqueDispatch<u32>, UniqueDispatchError<SendFailed>> {
        let send = move || async move {
            sends.set(sends.get() + 1);
            match fail {
                Some(e) => Err(e),
                None => Ok(sends.get()),
            }
        };
        block_on(dispatch_unique(claims, job, key, window, send, unsent))
    }

    #[test]
    fn one_dispatch_per_key_and_window() {
        let (claims, runtime) = store();
        let sends = Cell::new(0);
        let window = Duration::from_secs(60);
        let first = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
        assert_eq!(first, UniqueDispatch::Dispatched(1));
        assert_eq!(first.dispatched(), Some(&1));
        for elapsed in [0, 10, 59] {
            runtime.advance(Duration::from_secs(elapsed) - runtime.elapsed());
            let again = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
            assert_eq!(
                again,
                UniqueDispatch::Duplicate {
                    remaining: window - Duration::from_secs(elapsed)
                }
            );
            assert_eq!(again.dispatched(), None);
        }
        assert_eq!(sends.get(), 1, "duplicates send nothing");
        // Another key, and the same key of another job, are their own.
        for (job, key) in [("rebuild", "k2"), ("other", "k")] {
            let own = dispatch(&claims, job, key, window, &sends, None).unwrap();
            assert!(matches!(own, UniqueDispatch::Dispatched(_)), "{job} {key}");
        }
        assert_eq!(sends.get(), 3);
        // When the window ends, the key dispatches again.
        runtime.advance(Duration::from_secs(1));
        let after = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
        assert_eq!(after, UniqueDispatch::Dispatched(4));
    }

    #[test]
    fn the_store_key_is_the_job_name_and_the_key() {
        let (claims, _) = store();
        let sends = Cell::new(0);
        let window = Duration::from_secs(60);
        dispatch(&claims, "rebuild", "tenant:7", window, &sends, None).unwrap();
        assert_eq!(
            block_on(claims.claim("unique:rebuild:tenant:7", window)).unwrap(),
            Claim::Held { remaining: window },
            "held under unique:<job name>:<key> for the window"
        );
        // A key the store has as done (completed by code sharing the store)
        // is a duplicate for good, and sends nothing.
        let Claim::Claimed { fence } =
            block_on(claims.claim("unique:rebuild:settled", window)).unwrap()
        else {
            panic!("a fresh key is claimed");
        };
        block_on(claims.complete("unique:rebuild:settled", fence)).unwrap();
        let done = dispatch(&claims, "rebuild", "settled", window, &sends, None).unwrap();
        assert_eq!(
            done,
            UniqueDispatch::Duplicate {
                remaining: Duration::MAX
            }
        );
        assert_eq!(sends.get(), 1);
    }

    #[test]
    fn a_send_that_certainly_failed_gives_the_key_back() {
        let (claims, _) = store();
        let sends = Cell::new(0);
        let window = Duration::from_secs(60);
        let refused = SendFailed { maybe_sent: false };
        let failed = dispatch(&claims, "rebuild", "k", window, &sends, Some(refused));
        assert!(
            matches!(
                failed,
                Err(UniqueDispatchError::Dispatch(SendFailed {
                    maybe_sent: false
                }))
            ),
            "{failed:?}"
        );
        let retried = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
        assert_eq!(retried, UniqueDispatch::Dispatched(2), "the key came back");
    }

    #[test]
    fn a_send_that_may_have_gone_out_keeps_the_key_for_the_window() {
        let (claims, runtime) = store();
        let sends = Cell::new(0);
        let window = Duration::from_secs(60);
        let uncertain = SendFailed { maybe_sent: true };
        let failed = dispatch(&claims, "rebuild", "k", window, &sends, Some(uncertain));
        assert!(
            matches!(
                failed,
                Err(UniqueDispatchError::Dispatch(SendFailed {
                    maybe_sent: true
                }))
            ),
            "{failed:?}"
        );
        runtime.advance(Duration::from_secs(20));
        let again = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
        assert_eq!(
            again,
            UniqueDispatch::Duplicate {
                remaining: Duration::from_secs(40)
            }
        );
        runtime.advance(Duration::from_secs(40));
        let after = dispatch(&claims, "rebuild", "k", window, &sends, None).unwrap();
        assert_eq!(after, UniqueDispatch::Dispatched(2));
    }

    #[test]
    fn a_bad_key_or_window_is_refused_before_sending() {
        let (claims, _) = store();
        let sends = Cell::new(0);
        let long = "k".repeat(MAX_CLAIM_KEY_BYTES);
        for (key, window) in [
            ("k", Duration::ZERO),
            ("k", MAX_CLAIM_LEASE + Duration::from_millis(1)),
            // Within the limit alone, beyond it with `unique:rebuild:`.
            (long.as_str(), Duration::from_secs(1)),
        ] {
            let refused = dispatch(&claims, "rebuild", key, window, &sends, None);
            assert!(
                matches!(
                    refused,
                    Err(UniqueDispatchError::Claim(ClaimError::Invalid(_)))
                ),
                "{window:?}: {refused:?}"
            );
        }
        assert_eq!(sends.get(), 0, "nothing sent");
        // The longest window is accepted.
        let longest = dispatch(&claims, "rebuild", "k", MAX_CLAIM_LEASE, &sends, None);
        assert!(matches!(longest, Ok(UniqueDispatch::Dispatched(1))));
    }

    /// A store that would answer every claim, and counts the calls that
    /// reached it.
    #[derive(Default)]
    struct Counting {
        inner: MemoryClaims,
        calls: std::sync::atomic::AtomicU32,
    }

    impl ClaimStore for Counting {
        fn claim<'a>(
            &'a self,
            key: &'a str,
            lease: Duration,
        ) -> crate::BoxFuture<'a, Result<Claim, ClaimError>> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.claim(key, lease)
        }
        fn complete<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
        ) -> crate::BoxFuture<'a, Result<(), ClaimError>> {
            self.inner.complete(key, fence)
        }
        fn release<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
        ) -> crate::BoxFuture<'a, Result<(), ClaimError>> {
            self.inner.release(key, fence)
        }
        fn extend<'a>(
            &'a self,
            key: &'a str,
            fence: u64,
            lease: Duration,
        ) -> crate::BoxFuture<'a, Result<(), ClaimError>> {
            self.inner.extend(key, fence, lease)
        }
    }

    /// An empty business key (whose store key, `unique:<job>:`, the claim
    /// rules would take), and every key or window those rules refuse, are
    /// refused before the store or the send is called, as invalid input.
    #[test]
    fn an_empty_or_invalid_key_is_refused_before_any_io() {
        let claims = Counting::default();
        let sends = Cell::new(0);
        let long = "k".repeat(MAX_CLAIM_KEY_BYTES);
        for (key, window) in [
            ("", Duration::from_secs(60)),
            ("k", Duration::ZERO),
            ("k", MAX_CLAIM_LEASE + Duration::from_millis(1)),
            (long.as_str(), Duration::from_secs(1)),
        ] {
            let send = || async {
                sends.set(sends.get() + 1);
                Ok::<_, SendFailed>(())
            };
            let refused = block_on(dispatch_unique(
                &claims, "rebuild", key, window, send, unsent,
            ));
            match refused {
                Err(UniqueDispatchError::Claim(ClaimError::Invalid(why))) => {
                    if key.is_empty() {
                        assert!(why.contains("empty"), "{why}");
                    }
                }
                other => panic!("{key:?} {window:?}: {other:?}"),
            }
        }
        assert_eq!(sends.get(), 0, "nothing sent");
        assert_eq!(
            claims.calls.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the store was never called"
        );
    }

    #[test]
    fn errors_name_their_cause() {
        let claim: UniqueDispatchError<SendFailed> = ClaimError::Invalid("no key".into()).into();
        assert_eq!(claim.to_string(), "unique dispatch: invalid claim: no key");
        assert!(claim.source().is_some_and(|s| s.is::<ClaimError>()));
        let send = UniqueDispatchError::Dispatch(SendFailed { maybe_sent: true });
        assert_eq!(
            send.to_string(),
            "unique dispatch: send failed (sent: true)"
        );
        assert!(send.source().is_some_and(|s| s.is::<SendFailed>()));
    }
}
