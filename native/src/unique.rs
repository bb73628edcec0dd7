//! Unique dispatch: at most one job per key within a time window
//! ([`Dispatch::unique`](crate::Dispatch::unique)).

use crate::driver::DriverError;

/// What a unique dispatch ([`Dispatch::unique`](crate::Dispatch::unique)) did: the job's message id, or a
/// duplicate and the rest of its window ([`jobrail::UniqueDispatch`]).
pub use jobrail::UniqueDispatch;

/// Why a unique dispatch failed: the claim store's error
/// (nothing was sent), or the driver's. The key stays taken for the window
/// only if the backend may have accepted the message
/// ([`ErrorKind::Uncertain`](crate::ErrorKind::Uncertain)); otherwise it was given back, and the
/// dispatch may be repeated.
pub type UniqueDispatchError = jobrail::UniqueDispatchError<DriverError>;

impl From<DriverError> for UniqueDispatchError {
    fn from(e: DriverError) -> Self {
        jobrail::UniqueDispatchError::Dispatch(e)
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use jobrail::{Claim, ClaimError, ClaimStore, Job, MemoryClaims};
    use serde::Serialize;

    use super::*;
    use crate::{Driver, ErrorKind, MemoryDriver, Producer};

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
        send(
            producer
                .dispatch(job)
                .unique(claims, "k", Duration::ZERO)
                .send(payload),
        );
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
                .dispatch(&job())
                .unique(&claims, "k", window)
                .send(&1)
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
                .dispatch(job)
                .unique(&claims, key, window)
                .send(&1)
                .await;
            assert!(matches!(d, Ok(UniqueDispatch::Dispatched(_))), "{d:?}");
        }
        assert_eq!(driver.ready("q"), 3);
        tokio::time::sleep(window + Duration::from_millis(50)).await;
        let after = producer
            .dispatch(&job())
            .unique(&claims, "k", window)
            .send(&1)
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
            .dispatch(&job)
            .unique(&claims, "k", window)
            .send(&bad)
            .await;
        assert!(
            matches!(&failed, Err(UniqueDispatchError::Dispatch(e)) if e.kind() == ErrorKind::Encode),
            "{failed:?}"
        );
        let good = producer
            .dispatch(&job)
            .unique(&claims, "k", window)
            .send(&BTreeMap::new())
            .await;
        assert!(
            matches!(good, Ok(UniqueDispatch::Dispatched(_))),
            "{good:?}"
        );
        // A stopped backend refuses: the key is given back too.
        driver.stop().await.unwrap();
        let refused = producer
            .dispatch(&job)
            .unique(&claims, "k3", window)
            .send(&BTreeMap::new())
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
            .dispatch(&job())
            .unique(&claims, "k", Duration::ZERO)
            .send(&1)
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
