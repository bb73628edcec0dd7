//! What a handler knows about the execution it is in ([`JobContext`]).

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{select, Either};

use crate::model::cancel::CancelToken;
use crate::model::error::Cancelled;
use crate::model::runtime::{Instant, Runtime};
use crate::run::state::{MissingState, StateMap};

/// The execution's deadline has passed. An ordinary (retryable) error: a
/// timeout is not a shutdown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("execution deadline exceeded")]
pub struct DeadlineExceeded;

/// Why [`JobContext::sleep`] ended before its time.
///
/// Its [`source`](std::error::Error::source) is the [`Cancelled`] or the
/// [`DeadlineExceeded`], so a handler can return it with `?`: a cancellation
/// settles by the shutdown rule, a missed deadline as an ordinary error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Interrupted {
    /// The consumer is shutting down.
    #[error("sleep interrupted: {0}")]
    Cancelled(#[source] Cancelled),
    /// The execution's deadline came first.
    #[error("sleep interrupted: {0}")]
    DeadlineExceeded(#[source] DeadlineExceeded),
}

impl Interrupted {
    /// Whether shutdown ended the sleep (the handler should return the error).
    pub fn is_cancelled(&self) -> bool {
        matches!(self, Interrupted::Cancelled(_))
    }

    /// Whether the execution's deadline ended the sleep.
    pub fn is_deadline_exceeded(&self) -> bool {
        matches!(self, Interrupted::DeadlineExceeded(_))
    }
}

impl From<Cancelled> for Interrupted {
    fn from(cancelled: Cancelled) -> Self {
        Interrupted::Cancelled(cancelled)
    }
}

impl From<DeadlineExceeded> for Interrupted {
    fn from(deadline: DeadlineExceeded) -> Self {
        Interrupted::DeadlineExceeded(deadline)
    }
}

/// Per-execution context handed to a handler.
///
/// Deadlines and cancellation are cooperative: nothing forces a handler to
/// return, it must look. [`JobContext::sleep`] (which ends at either),
/// [`JobContext::check_deadline`] and [`JobContext::check_cancelled`] make
/// that easy.
///
/// An execution ends for two outside reasons: its deadline (the job's
/// timeout, or the driver's hold on the delivery) and shutdown. Both are
/// cooperative: the handler looks, through [`JobContext::check_deadline`],
/// [`JobContext::check_cancelled`], or by waiting with [`JobContext::sleep`],
/// which ends at whichever comes first, like a Go `select` on `ctx.Done()`.
/// The two are told apart because they settle differently: a shutdown error
/// ([`Cancelled`], or one wrapping it) hands the delivery back at once,
/// skipping the cap; a missed deadline ([`DeadlineExceeded`]) is an ordinary
/// error that follows the job's retry policy.
///
/// A context is cheap to clone and to make: what is the same for every
/// execution of a delivery (names, id, metadata, cancellation, runtime) is
/// made once per delivery and shared; each execution adds only its attempt
/// and deadline. The job and queue names are the registered job's own
/// (shared, not copied) when the delivery comes from the job's queue.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail::testing::TestQueue;
/// use jobrail::{Job, JobContext, JobError, Registry};
///
/// struct Mailer {
///     from: &'static str,
/// }
///
/// let job = Job::<String>::builder("notify").max_deliveries(3).tier_one(2).build()?;
/// let mut registry = Registry::new();
/// registry.state(Mailer { from: "ops@example.com" });
/// registry.register(&job, |ctx: JobContext, to: String| async move {
///     let mailer = ctx.state::<Mailer>()?; // the registry's state, by type
///     // The delivery (tier two) and the execution within it (tier one).
///     if (ctx.attempt(), ctx.in_process_attempt()) == (1, 1) {
///         return Err(JobError::new(format!("{} -> {to}: busy", mailer.from)));
///     }
///     ctx.check_deadline()?; // an error once the job's timeout has passed
///     Ok(())
/// })?;
///
/// let mut queue = TestQueue::new(registry);
/// let sent = queue.send(&job, &"ada@example.com".to_string());
/// queue.run_until_idle();
/// assert_eq!(queue.message(&sent).attempts(), [1]); // resolved in process
/// # let _ = Duration::ZERO;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct JobContext {
    parts: Arc<ContextParts>,
    in_process_attempt: u32,
    deadline: Option<Instant>,
}

impl fmt::Debug for JobContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobContext")
            .field("job", &self.parts.job)
            .field("message_id", &self.parts.message_id)
            .field("attempt", &self.parts.attempt)
            .field("in_process_attempt", &self.in_process_attempt)
            .finish_non_exhaustive()
    }
}

/// What every execution of one delivery shares, made once per delivery.
pub(crate) struct ContextParts {
    pub(crate) job: Arc<str>,
    pub(crate) queue: Arc<str>,
    pub(crate) message_id: String,
    pub(crate) attempt: u32,
    pub(crate) in_process_limit: u32,
    pub(crate) cancel: CancelToken,
    pub(crate) runtime: Arc<dyn Runtime>,
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) state: StateMap,
}

impl JobContext {
    pub(crate) fn new(
        parts: &Arc<ContextParts>,
        in_process_attempt: u32,
        deadline: Option<Instant>,
    ) -> Self {
        JobContext {
            parts: parts.clone(),
            in_process_attempt,
            deadline,
        }
    }

    /// A context for calling a handler directly (in unit tests of handlers).
    pub fn detached(runtime: Arc<dyn Runtime>) -> Self {
        let parts = ContextParts {
            job: Arc::from(""),
            queue: Arc::from(""),
            message_id: String::new(),
            attempt: 1,
            in_process_limit: 1,
            cancel: CancelToken::new(),
            runtime,
            metadata: BTreeMap::new(),
            state: StateMap::default(),
        };
        Self::new(&Arc::new(parts), 1, None)
    }

    /// The job's name.
    pub fn job(&self) -> &str {
        &self.parts.job
    }
    /// The queue the message came from.
    pub fn queue(&self) -> &str {
        &self.parts.queue
    }
    /// The message id (fresh per dispatch; not a business identity).
    pub fn message_id(&self) -> &str {
        &self.parts.message_id
    }
    /// The delivery attempt reported by the driver (first = 1; 0 = unknown).
    pub fn attempt(&self) -> u32 {
        self.parts.attempt
    }
    /// The in-process (tier-one) attempt within this delivery (first = 1).
    pub fn in_process_attempt(&self) -> u32 {
        self.in_process_attempt
    }
    /// Tier one's limit for this delivery.
    pub fn in_process_limit(&self) -> u32 {
        self.parts.in_process_limit
    }
    /// The envelope's metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.parts.metadata
    }
    /// The value of type `T` the registry was given with
    /// [`Registry::state`](crate::Registry::state) (a pool, a client, a
    /// configuration), or [`MissingState`] if it was given none: with `?`,
    /// an ordinary error of this execution.
    pub fn state<T: Any>(&self) -> Result<&T, MissingState> {
        self.parts.state.get::<T>()
    }
    /// The execution's deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
    /// Time left before the deadline (`None`: no deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(self.parts.runtime.now()))
    }
    /// `Err(DeadlineExceeded)` once the deadline has passed.
    pub fn check_deadline(&self) -> Result<(), DeadlineExceeded> {
        match self.remaining() {
            Some(left) if left.is_zero() => Err(DeadlineExceeded),
            _ => Ok(()),
        }
    }
    /// Whether the consumer is shutting down.
    pub fn is_cancelled(&self) -> bool {
        self.parts.cancel.is_cancelled()
    }
    /// `Err(Cancelled)` once the consumer is shutting down. Returning that
    /// error (or one wrapping it) settles the delivery as a zero-delay retry.
    pub fn check_cancelled(&self) -> Result<(), Cancelled> {
        if self.is_cancelled() {
            Err(Cancelled::new())
        } else {
            Ok(())
        }
    }
    /// Completes with [`Cancelled`] when the consumer shuts down.
    pub async fn cancelled(&self) -> Cancelled {
        self.parts.cancel.cancelled().await;
        Cancelled::new()
    }
    /// Sleeps on the injected runtime for `duration`, or less: the sleep ends
    /// at whichever comes first, the consumer's shutdown, the execution's
    /// deadline, or the end of `duration`.
    ///
    /// - Shutdown (before or during the sleep): `Err` with
    ///   [`Interrupted::is_cancelled`]; its source is [`Cancelled`], so
    ///   returning it (`?`) settles the delivery by the shutdown rule.
    /// - The deadline, when it comes before `duration` ends (or has already
    ///   passed): `Err` after sleeping until the deadline; its source is
    ///   [`DeadlineExceeded`], an ordinary error.
    /// - Otherwise `Ok(())` after `duration` (a sleep that ends exactly at
    ///   the deadline completes).
    ///
    /// ```
    /// # use jobrail::{JobContext, JobError};
    /// # use std::time::Duration;
    /// async fn poll_until_ready(ctx: JobContext) -> Result<(), JobError> {
    ///     // A shutdown or a missed deadline ends the wait and the handler.
    ///     ctx.sleep(Duration::from_millis(500)).await?;
    ///     Ok(())
    /// }
    /// ```
    pub async fn sleep(&self, duration: Duration) -> Result<(), Interrupted> {
        self.check_cancelled()?;
        let (wait, end) = match self.remaining() {
            Some(left) if left < duration => (left, Err(DeadlineExceeded.into())),
            _ => (duration, Ok(())),
        };
        if wait.is_zero() {
            return end;
        }
        let sleep = self.parts.runtime.sleep(wait);
        let cancelled = self.parts.cancel.cancelled();
        match select(sleep, cancelled).await {
            Either::Left(_) => end,
            Either::Right(_) => Err(Cancelled::new().into()),
        }
    }
    /// The runtime's clock.
    pub fn now(&self) -> Instant {
        self.parts.runtime.now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::error::{JobError, Outcome};
    use crate::model::maybe_send::BoxFuture;
    use crate::model::runtime::{Clock, VirtualRuntime};
    use futures_executor::block_on;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn parts(runtime: Arc<dyn Runtime>, cancel: &CancelToken) -> Arc<ContextParts> {
        Arc::new(ContextParts {
            job: Arc::from("j"),
            queue: Arc::from("q"),
            message_id: "m".to_string(),
            attempt: 1,
            in_process_limit: 1,
            cancel: cancel.clone(),
            runtime,
            metadata: BTreeMap::new(),
            state: StateMap::default(),
        })
    }

    #[test]
    fn a_sleep_ends_at_the_deadline() {
        let clock = VirtualRuntime::new();
        let parts = parts(Arc::new(clock.clone()), &CancelToken::new());
        let ctx = JobContext::new(&parts, 1, Some(clock.now() + S(2)));
        let err = block_on(ctx.sleep(S(10))).expect_err("the deadline ends the sleep");
        assert_eq!(
            clock.elapsed(),
            S(2),
            "slept until the deadline, not past it"
        );
        assert!(err.is_deadline_exceeded());
        assert_eq!(
            JobError::from(err.clone()).chain_text(),
            "sleep interrupted: execution deadline exceeded"
        );
        assert!(!err.is_cancelled());
        assert_eq!(
            JobError::from(err).outcome(),
            Outcome::Ordinary,
            "a timeout is not a shutdown"
        );

        let err = block_on(ctx.sleep(S(1))).expect_err("the deadline has passed");
        assert_eq!(
            clock.elapsed(),
            S(2),
            "no sleep once the deadline has passed"
        );
        assert!(JobError::from(err).is::<DeadlineExceeded>());
    }

    #[test]
    fn a_sleep_shorter_than_the_time_left_completes() {
        let clock = VirtualRuntime::new();
        let parts = parts(Arc::new(clock.clone()), &CancelToken::new());
        let ctx = JobContext::new(&parts, 1, Some(clock.now() + S(2)));
        assert!(block_on(ctx.sleep(S(2))).is_ok());
        assert_eq!(clock.elapsed(), S(2));
        let ctx = JobContext::new(&parts, 1, None);
        assert!(block_on(ctx.sleep(S(60))).is_ok());
        assert_eq!(clock.elapsed(), S(62));
    }

    /// Sleeps never finish; starting one starts shutdown.
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

    #[test]
    fn cancellation_ends_a_sleep_with_the_shutdown_outcome() {
        let cancel = CancelToken::new();
        let clock = VirtualRuntime::new();
        let runtime = Arc::new(ShutdownDuringSleep {
            clock: clock.clone(),
            cancel: cancel.clone(),
        });
        let parts = parts(runtime, &cancel);
        let ctx = JobContext::new(&parts, 1, Some(clock.now() + S(2)));
        let err = block_on(ctx.sleep(S(10))).expect_err("shutdown ends the sleep");
        assert!(err.is_cancelled());
        let err = JobError::from(err);
        assert_eq!(err.outcome(), Outcome::Cancelled);
        assert!(crate::rules::settle::is_shutdown(&Err(err), true));

        let err = block_on(ctx.sleep(S(1))).expect_err("already shutting down");
        assert_eq!(JobError::from(err).outcome(), Outcome::Cancelled);
    }
}
