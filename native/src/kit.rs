//! The driver kit: what every driver needs the same way, written once,
//! public so that a driver outside this crate is built as this crate's own
//! are (the in-memory, RabbitMQ, NATS and SQS drivers here, the Postgres
//! store and relay of `jobrail-postgres`, use it).
//!
//! - [`failed`]: a [`DriverError`] that keeps the client library's error
//!   as its cause, with what the driver was doing.
//! - [`lock`]: a mutex lock that carries on past a poisoned lock.
//! - [`Lifecycle`]: the stopped state, readable at once and awaitable.
//! - [`Reconnect`]: the wait before each reconnection attempt.
//! - [`Capabilities::refuse_oversize`]: the refusal of a body over the
//!   backend's size limit, before any I/O.
//!
//! `guide/writing-a-driver.md` in the repository shows where each goes in
//! a driver's files.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use jobrail::Backoff;
use tokio::sync::watch;

use crate::driver::{DriverError, ErrorKind};
#[cfg(doc)]
use crate::Capabilities;

/// What a driver was doing when a backend client's call failed, with the
/// client's own error kept as the [`source`](std::error::Error::source) (so
/// [`DriverError::find`] reaches it). Its text is `"{doing}: {cause}"`, so a
/// log line that prints only the top error still says everything.
#[derive(Debug, thiserror::Error)]
#[error("{doing}: {source}")]
struct Step<E: std::error::Error + Send + Sync + 'static> {
    doing: String,
    #[source]
    source: E,
}

/// A [`DriverError`] of `kind` from `driver`: `doing` failed with the
/// client's error `source`.
///
/// The error's text is `"{driver} driver: {kind}: {doing}: {source}"`, so a
/// log line that prints only the top error says everything, and `source`
/// stays reachable as a value through [`DriverError::find`] (a caller can
/// tell a refused connection from a timeout by the client's own error).
/// Keep URLs, passwords, tokens and keys out of `doing`.
///
/// ```
/// use jobrail_native::{kit, ErrorKind};
///
/// let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
/// let err = kit::failed("mine", ErrorKind::Connection, "declare queue `jobs`", refused);
/// assert_eq!(err.kind(), ErrorKind::Connection);
/// assert!(err.to_string().ends_with("declare queue `jobs`: refused"));
/// assert!(err.find::<std::io::Error>().is_some());
/// ```
pub fn failed<E: std::error::Error + Send + Sync + 'static>(
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
/// usable after a panic in another thread that held the lock. That is sound
/// only for state that every critical section leaves whole (no invariant
/// broken halfway through a section that may panic): keep sections short
/// and free of calls that can panic with the state half changed.
///
/// ```
/// use std::sync::Mutex;
/// use jobrail_native::kit::lock;
///
/// let acks = Mutex::new(Vec::new());
/// lock(&acks).push(7_u64);
/// assert_eq!(*lock(&acks), [7]);
/// ```
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a driver has been stopped, readable at once and awaitable.
///
/// A driver holds one, answers [`check_running`](Self::check_running)'s
/// [`ErrorKind::Stopped`] from every call after `stop`, and ends its
/// background tasks on [`stopped`](Self::stopped). Stopping happens once:
/// [`stop`](Self::stop) says which call did it, so that call alone closes
/// the connection.
///
/// ```
/// use jobrail_native::{kit::Lifecycle, ErrorKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let life = Lifecycle::new("mine");
/// assert!(life.check_running().is_ok());
/// assert!(life.stop(), "the first stop");
/// assert!(!life.stop());
/// assert_eq!(life.check_running().unwrap_err().kind(), ErrorKind::Stopped);
/// life.stopped().await; // at once: it is stopped
/// # }
/// ```
#[derive(Debug)]
pub struct Lifecycle {
    driver: &'static str,
    stopped: watch::Sender<bool>,
}

impl Lifecycle {
    /// A running driver named `driver`.
    pub fn new(driver: &'static str) -> Self {
        let (stopped, _) = watch::channel(false);
        Lifecycle { driver, stopped }
    }

    /// Whether [`stop`](Self::stop) has been called.
    pub fn is_stopped(&self) -> bool {
        *self.stopped.borrow()
    }

    /// [`ErrorKind::Stopped`] once stopped, naming the driver; `Ok` before.
    pub fn check_running(&self) -> Result<(), DriverError> {
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

    /// Marks the driver stopped; `true` for the call that stopped it, `false`
    /// for every later one. Wakes every [`stopped`](Self::stopped) and
    /// [`watch`](Self::watch) waiter.
    pub fn stop(&self) -> bool {
        !self.stopped.send_replace(true)
    }

    /// Resolves once the driver is stopped (at once if it already is).
    /// Cancel-safe: dropping the future loses nothing.
    pub async fn stopped(&self) {
        let mut watch = self.stopped.subscribe();
        // The sender lives as long as `self`, so this only ends on `true`.
        let _ = watch.wait_for(|stopped| *stopped).await;
    }

    /// A receiver for tasks that outlive a borrow of the driver: its value
    /// turns `true` once, on [`stop`](Self::stop), and stays so.
    pub fn watch(&self) -> watch::Receiver<bool> {
        self.stopped.subscribe()
    }
}

/// The wait before each reconnection (or resubscription) attempt: doubling
/// from `first` up to `max`, on the `jobrail` crate's own [`Backoff`]
/// schedule (no jitter), and back to `first` after a success.
///
/// Every wait is between `first` and `max`; the count of failures
/// saturates, so a backend that stays away for ever waits `max` between
/// attempts for ever.
///
/// ```
/// use std::time::Duration;
/// use jobrail_native::kit::Reconnect;
///
/// let mut wait = Reconnect::new(Duration::from_millis(100), Duration::from_secs(1));
/// assert_eq!(wait.failed(), Duration::from_millis(100));
/// assert_eq!(wait.failed(), Duration::from_millis(200));
/// assert_eq!(wait.upcoming(), Duration::from_millis(400));
/// wait.succeeded();
/// assert_eq!(wait.failed(), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone)]
pub struct Reconnect {
    schedule: Backoff,
    failures: u32,
}

impl Reconnect {
    /// Waits from `first`, doubling, never above `max` (nor below `first`).
    pub fn new(first: Duration, max: Duration) -> Self {
        Reconnect {
            schedule: Backoff::exponential(first, 2.0, max.max(first)),
            failures: 0,
        }
    }

    /// The wait after the `failures`-th failure in a row (1 for the first):
    /// for clients that count failures themselves.
    pub fn after(&self, failures: u32) -> Duration {
        // Backoff's attempt 2 waits `first`.
        self.schedule.delay(failures.saturating_add(1))
    }

    /// Records one more failure; the wait before the next attempt.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.after(self.failures)
    }

    /// The wait [`failed`](Self::failed) would return next, without counting.
    pub fn upcoming(&self) -> Duration {
        self.after(self.failures.saturating_add(1))
    }

    /// A success: the next failure waits `first` again.
    pub fn succeeded(&mut self) {
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
