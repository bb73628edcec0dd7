//! Unique dispatch: at most one job per key within a time window
//! ([`Producer::dispatch_unique`]).

use std::time::Duration;

use jobrail::{Claim, ClaimError, ClaimStore, Job};
use serde::Serialize;

use crate::driver::{DriverError, ErrorKind};
use crate::producer::{DispatchOptions, Producer};

/// What [`Producer::dispatch_unique`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UniqueDispatch {
    /// The job was sent: its message id.
    Dispatched(String),
    /// A job with the same key was dispatched within the window: nothing was
    /// sent. The window ends in `remaining`.
    Duplicate {
        /// Until the key may be dispatched again.
        remaining: Duration,
    },
}

/// Why [`Producer::dispatch_unique`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UniqueDispatchError {
    /// The claim store did not answer (or refused the key or the window):
    /// nothing was sent.
    #[error("unique dispatch: {0}")]
    Claim(#[from] ClaimError),
    /// The dispatch failed. The key stays taken for the window only if the
    /// backend may have accepted the message ([`ErrorKind::Uncertain`]);
    /// otherwise it was given back, and the dispatch may be repeated.
    #[error("unique dispatch: {0}")]
    Dispatch(#[from] DriverError),
}

impl Producer {
    /// Dispatches `payload` as `job` unless a job with the same `key` was
    /// dispatched within `window`: the unique jobs of Sidekiq and the unique
    /// tasks of asynq, on any [`ClaimStore`].
    ///
    /// The key (`unique:<job name>:<key>` in the store, so it never meets a
    /// handler's own claims) is claimed for `window` and never completed: it
    /// frees itself when the window ends. A claim already held answers
    /// [`UniqueDispatch::Duplicate`] and sends nothing. If the dispatch
    /// certainly did not reach the backend (refused, encode error), the
    /// claim is released so the caller can try again at once; if it may
    /// have ([`ErrorKind::Uncertain`]), the key stays taken for the window.
    ///
    /// This prevents duplicate *dispatches*; it does not make the handler
    /// run once (redelivery still repeats it): for that, claim in the
    /// handler ([`jobrail::run_once`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use jobrail::{Job, MemoryClaims};
    /// use jobrail_native::{MemoryDriver, Producer, UniqueDispatch};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let job = Job::<u64>::builder("rebuild-index").build()?;
    /// let producer = Producer::new(Arc::new(MemoryDriver::default()));
    /// let claims = MemoryClaims::new();
    /// let hour = Duration::from_secs(3600);
    /// let first = producer.dispatch_unique(&claims, "tenant-7", hour, &job, &7).await?;
    /// assert!(matches!(first, UniqueDispatch::Dispatched(_)));
    /// let again = producer.dispatch_unique(&claims, "tenant-7", hour, &job, &7).await?;
    /// assert!(matches!(again, UniqueDispatch::Duplicate { .. }));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn dispatch_unique<S, P>(
        &self,
        claims: &S,
        key: &str,
        window: Duration,
        job: &Job<P>,
        payload: &P,
    ) -> Result<UniqueDispatch, UniqueDispatchError>
    where
        S: ClaimStore + ?Sized,
        P: Serialize,
    {
        self.dispatch_unique_with(
            claims,
            key,
            window,
            job,
            payload,
            DispatchOptions::default(),
        )
        .await
    }

    /// [`Producer::dispatch_unique`] with options (delay, metadata).
    pub async fn dispatch_unique_with<S, P>(
        &self,
        claims: &S,
        key: &str,
        window: Duration,
        job: &Job<P>,
        payload: &P,
        options: DispatchOptions,
    ) -> Result<UniqueDispatch, UniqueDispatchError>
    where
        S: ClaimStore + ?Sized,
        P: Serialize,
    {
        let key = format!("unique:{}:{key}", job.name());
        let fence = match claims.claim(&key, window).await? {
            Claim::Claimed { fence } => fence,
            Claim::Held { remaining } => return Ok(UniqueDispatch::Duplicate { remaining }),
            // Nothing here completes a unique key; a store shared with code
            // that did holds it for good.
            Claim::Done => {
                return Ok(UniqueDispatch::Duplicate {
                    remaining: Duration::MAX,
                })
            }
        };
        match self.dispatch_with(job, payload, options).await {
            Ok(id) => Ok(UniqueDispatch::Dispatched(id)),
            Err(e) => {
                if e.kind() != ErrorKind::Uncertain {
                    let _ = claims.release(&key, fence).await;
                }
                Err(e.into())
            }
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use jobrail::MemoryClaims;

    use super::*;
    use crate::{Driver, MemoryDriver};

    fn job() -> Job<u64> {
        Job::<u64>::builder("rebuild").queue("q").build().unwrap()
    }

    #[tokio::test]
    async fn one_dispatch_per_key_and_window() {
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let claims = MemoryClaims::new();
        let window = Duration::from_millis(300);
        let mut sent = 0;
        for _ in 0..5 {
            if let UniqueDispatch::Dispatched(_) = producer
                .dispatch_unique(&claims, "k", window, &job(), &1)
                .await
                .unwrap()
            {
                sent += 1;
            }
        }
        assert_eq!(sent, 1);
        // Another key, and the same key for another job, are their own.
        let other = Job::<u64>::builder("other").queue("q").build().unwrap();
        for (job, key) in [(&job(), "k2"), (&other, "k")] {
            let d = producer
                .dispatch_unique(&claims, key, window, job, &1)
                .await;
            assert!(matches!(d, Ok(UniqueDispatch::Dispatched(_))), "{d:?}");
        }
        assert_eq!(driver.ready("q"), 3);
        tokio::time::sleep(window + Duration::from_millis(50)).await;
        let after = producer
            .dispatch_unique(&claims, "k", window, &job(), &1)
            .await;
        assert!(
            matches!(after, Ok(UniqueDispatch::Dispatched(_))),
            "{after:?}"
        );
    }

    #[tokio::test]
    async fn a_dispatch_that_was_not_accepted_gives_the_key_back() {
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let claims = MemoryClaims::new();
        let window = Duration::from_secs(60);
        // A payload that cannot encode (a map with non-string keys).
        let job = Job::<BTreeMap<(u8, u8), u8>>::builder("pairs")
            .queue("q")
            .build()
            .unwrap();
        let bad = BTreeMap::from([((1, 2), 3)]);
        let failed = producer
            .dispatch_unique(&claims, "k", window, &job, &bad)
            .await;
        assert!(
            matches!(&failed, Err(UniqueDispatchError::Dispatch(e)) if e.kind() == ErrorKind::Encode),
            "{failed:?}"
        );
        let good = producer
            .dispatch_unique(&claims, "k", window, &job, &BTreeMap::new())
            .await;
        assert!(
            matches!(good, Ok(UniqueDispatch::Dispatched(_))),
            "{good:?}"
        );
        // A stopped backend refuses: the key is given back too.
        driver.stop().await.unwrap();
        let refused = producer
            .dispatch_unique(&claims, "k3", window, &job, &BTreeMap::new())
            .await;
        assert!(
            matches!(refused, Err(UniqueDispatchError::Dispatch(_))),
            "{refused:?}"
        );
        assert!(matches!(
            claims.claim("unique:pairs:k3", window).await.unwrap(),
            Claim::Claimed { .. }
        ));
    }

    #[tokio::test]
    async fn a_bad_key_or_window_is_refused_before_sending() {
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let claims = MemoryClaims::new();
        let zero = producer
            .dispatch_unique(&claims, "k", Duration::ZERO, &job(), &1)
            .await;
        assert!(
            matches!(
                zero,
                Err(UniqueDispatchError::Claim(ClaimError::Invalid(_)))
            ),
            "{zero:?}"
        );
        assert_eq!(driver.depth("q"), 0, "nothing sent");
    }
}
