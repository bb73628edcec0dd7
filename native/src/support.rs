//! What every driver needs the same way, written once: errors that keep the
//! client's cause, poison-tolerant locks, the stopped state, and the wait
//! between reconnection attempts.
// Without any driver feature nothing here has a user.
#![cfg_attr(
    not(any(
        feature = "memory",
        feature = "rabbitmq",
        feature = "nats",
        feature = "sqs"
    )),
    allow(dead_code)
)]

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use jobrail::Backoff;
use tokio::sync::watch;

use crate::driver::{DriverError, ErrorKind};

/// What a driver was doing when a backend client's call failed, with the
/// client's own error kept as the [`source`](std::error::Error::source) (so
/// [`DriverError::find`] reaches it). Its text is `"{doing}: {cause}"`, so a
/// log line that prints only the top error still says everything.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "sqs")),
    allow(dead_code)
)]
#[derive(Debug, thiserror::Error)]
#[error("{doing}: {source}")]
pub(crate) struct Step<E: std::error::Error + Send + Sync + 'static> {
    doing: String,
    #[source]
    source: E,
}

/// A [`DriverError`] of `kind` from `driver`: `doing` failed with the
/// client's error `source`, which is kept.
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "sqs")),
    allow(dead_code)
)]
pub(crate) fn failed<E: std::error::Error + Send + Sync + 'static>(
    driver: &'static str,
    kind: ErrorKind,
    doing: impl Into<String>,
    source: E,
) -> DriverError {
    DriverError::new(
        driver,
        kind,
        Step {
            doing: doing.into(),
            source,
        },
    )
}

/// Locks `mutex`, carrying on past a poisoned lock: driver state stays
/// usable after a panic elsewhere (every critical section leaves it whole).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a driver has been stopped, readable at once and awaitable.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    driver: &'static str,
    stopped: watch::Sender<bool>,
}

impl Lifecycle {
    /// A running driver named `driver`.
    pub(crate) fn new(driver: &'static str) -> Self {
        let (stopped, _) = watch::channel(false);
        Lifecycle { driver, stopped }
    }

    /// Whether [`stop`](Self::stop) has been called.
    pub(crate) fn is_stopped(&self) -> bool {
        *self.stopped.borrow()
    }

    /// [`ErrorKind::Stopped`] once stopped.
    pub(crate) fn check_running(&self) -> Result<(), DriverError> {
        if self.is_stopped() {
            Err(DriverError::new(
                self.driver,
                ErrorKind::Stopped,
                format!("the {} driver has been stopped", self.driver),
            ))
        } else {
            Ok(())
        }
    }

    /// Marks the driver stopped; `true` for the call that stopped it.
    pub(crate) fn stop(&self) -> bool {
        !self.stopped.send_replace(true)
    }

    #[cfg_attr(
        not(any(feature = "rabbitmq", feature = "nats", feature = "sqs")),
        allow(dead_code)
    )]
    /// Resolves once the driver is stopped (at once if it already is).
    pub(crate) async fn stopped(&self) {
        let mut watch = self.stopped.subscribe();
        // The sender lives as long as `self`, so this only ends on `true`.
        let _ = watch.wait_for(|stopped| *stopped).await;
    }

    /// A receiver for tasks that outlive a borrow of the driver.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) fn watch(&self) -> watch::Receiver<bool> {
        self.stopped.subscribe()
    }
}

/// The wait before each reconnection (or resubscription) attempt: doubling
/// from `first` up to `max`, on the crate's own [`Backoff`] schedule, and
/// back to `first` after a success.
#[derive(Debug, Clone)]
pub(crate) struct Reconnect {
    schedule: Backoff,
    failures: u32,
}

impl Reconnect {
    /// Waits from `first`, doubling, never above `max` (nor below `first`).
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Reconnect {
            schedule: Backoff::exponential(first, 2.0, max.max(first)),
            failures: 0,
        }
    }

    /// The wait after the `failures`-th failure in a row (1 for the first):
    /// for clients that count failures themselves.
    pub(crate) fn after(&self, failures: u32) -> Duration {
        // Backoff's attempt 2 waits `first`.
        self.schedule.delay(failures.saturating_add(1))
    }

    /// Records one more failure; the wait before the next attempt.
    pub(crate) fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.after(self.failures)
    }

    /// The wait [`failed`](Self::failed) would return next, without counting.
    pub(crate) fn upcoming(&self) -> Duration {
        self.after(self.failures.saturating_add(1))
    }

    /// A success: the next failure waits `first` again.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("refused by the server")]
    struct ClientError;

    #[test]
    fn a_failed_step_keeps_the_client_error() {
        let err = failed(
            "test",
            ErrorKind::Connection,
            "declare queue `q`",
            ClientError,
        );
        assert_eq!(
            err.to_string(),
            "test driver: connection error: declare queue `q`: refused by the server"
        );
        assert!(err.find::<ClientError>().is_some());
        let err = err.not_sent();
        assert_eq!(err.kind(), ErrorKind::NotAccepted);
        assert!(
            err.find::<ClientError>().is_some(),
            "not_sent keeps the cause"
        );
        assert!(err
            .to_string()
            .contains("not sent: test driver: connection error: declare queue"));
    }

    #[test]
    fn reconnect_waits_double_up_to_the_cap_and_reset() {
        let mut wait = Reconnect::new(Duration::from_millis(100), Duration::from_millis(500));
        assert_eq!(wait.upcoming(), Duration::from_millis(100));
        let waits: Vec<_> = (0..5).map(|_| wait.failed().as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 500, 500]);
        wait.succeeded();
        assert_eq!(wait.failed(), Duration::from_millis(100));
        assert_eq!(wait.after(u32::MAX), Duration::from_millis(500));
    }

    #[tokio::test]
    async fn lifecycle_reports_and_awaits_the_stop() {
        let life = Lifecycle::new("test");
        assert!(life.check_running().is_ok());
        assert!(life.stop());
        assert!(!life.stop(), "only the first call stops it");
        let err = life.check_running().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Stopped);
        assert!(err.to_string().contains("the test driver has been stopped"));
        life.stopped().await;
    }
}
