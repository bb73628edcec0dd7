//! Unique dispatch: at most one job per key within a time window
//! ([`Producer::dispatch_unique`]).

use std::time::Duration;

use jobrail::{ClaimStore, Job};
use serde::Serialize;

use crate::driver::{DriverError, ErrorKind};
use crate::producer::{DispatchOptions, Producer};

/// What [`Producer::dispatch_unique`] did: the job's message id, or a
/// duplicate and the rest of its window ([`jobrail::UniqueDispatch`]).
pub use jobrail::UniqueDispatch;

/// Why [`Producer::dispatch_unique`] failed: the claim store's error
/// (nothing was sent), or the driver's. The key stays taken for the window
/// only if the backend may have accepted the message
/// ([`ErrorKind::Uncertain`]); otherwise it was given back, and the
/// dispatch may be repeated.
pub type UniqueDispatchError = jobrail::UniqueDispatchError<DriverError>;

impl From<DriverError> for UniqueDispatchError {
    fn from(e: DriverError) -> Self {
        jobrail::UniqueDispatchError::Dispatch(e)
    }
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
    /// The rule is [`jobrail::dispatch_unique`], shared with the edge's
    /// producer.
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
        jobrail::dispatch_unique(
            claims,
            job.name(),
            key,
            window,
            || self.dispatch_with(job, payload, options),
            |e: &DriverError| e.kind() != ErrorKind::Uncertain,
        )
        .await
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use jobrail::{Claim, ClaimError, MemoryClaims};

    use super::*;
    use crate::{Driver, MemoryDriver};

    /// A multi-threaded runtime can spawn a unique dispatch (checked when
    /// this compiles).
    #[allow(dead_code)]
    fn dispatch_unique_is_send<S: ClaimStore, P: Serialize + Sync>(
        producer: &Producer,
        claims: &S,
        job: &Job<P>,
        payload: &P,
    ) {
        fn send<T: Send>(_: T) {}
        send(producer.dispatch_unique(claims, "k", Duration::ZERO, job, payload));
    }

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

    /// `?` turns a driver's error and a store's into a unique dispatch's.
    #[test]
    fn errors_convert_with_the_question_mark() {
        fn driver() -> Result<(), UniqueDispatchError> {
            Err(DriverError::new("memory", ErrorKind::Stopped, "stopped"))?
        }
        fn store() -> Result<(), UniqueDispatchError> {
            Err(ClaimError::Invalid("no key".into()))?
        }
        assert!(matches!(
            driver(),
            Err(UniqueDispatchError::Dispatch(e)) if e.kind() == ErrorKind::Stopped
        ));
        assert!(matches!(
            store(),
            Err(UniqueDispatchError::Claim(ClaimError::Invalid(_)))
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
