//! What a handler knows about the execution it is in.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{select, Either};

use crate::cancel::CancelToken;
use crate::error::Cancelled;
use crate::runtime::{Instant, Runtime};

/// The execution's deadline has passed. An ordinary (retryable) error: a
/// timeout is not a shutdown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("execution deadline exceeded")]
pub struct DeadlineExceeded;

/// Per-execution context handed to a handler.
///
/// Deadlines and cancellation are cooperative: nothing forces a handler to
/// return, it must look. [`JobContext::sleep`] and
/// [`JobContext::check_cancelled`] make that easy.
#[derive(Clone)]
pub struct JobContext {
    inner: Arc<Inner>,
}

struct Inner {
    job: String,
    queue: String,
    message_id: String,
    attempt: u32,
    in_process_attempt: u32,
    in_process_limit: u32,
    deadline: Option<Instant>,
    cancel: CancelToken,
    runtime: Arc<dyn Runtime>,
    metadata: BTreeMap<String, String>,
}

impl fmt::Debug for JobContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobContext")
            .field("job", &self.inner.job)
            .field("message_id", &self.inner.message_id)
            .field("attempt", &self.inner.attempt)
            .field("in_process_attempt", &self.inner.in_process_attempt)
            .finish_non_exhaustive()
    }
}

/// Everything needed to build a [`JobContext`].
#[derive(Clone)]
pub(crate) struct ContextParts {
    pub(crate) job: String,
    pub(crate) queue: String,
    pub(crate) message_id: String,
    pub(crate) attempt: u32,
    pub(crate) in_process_limit: u32,
    pub(crate) cancel: CancelToken,
    pub(crate) runtime: Arc<dyn Runtime>,
    pub(crate) metadata: BTreeMap<String, String>,
}

impl JobContext {
    pub(crate) fn new(
        parts: &ContextParts,
        in_process_attempt: u32,
        deadline: Option<Instant>,
    ) -> Self {
        JobContext {
            inner: Arc::new(Inner {
                job: parts.job.clone(),
                queue: parts.queue.clone(),
                message_id: parts.message_id.clone(),
                attempt: parts.attempt,
                in_process_attempt,
                in_process_limit: parts.in_process_limit,
                deadline,
                cancel: parts.cancel.clone(),
                runtime: parts.runtime.clone(),
                metadata: parts.metadata.clone(),
            }),
        }
    }

    /// A context for calling a handler directly (in unit tests of handlers).
    pub fn detached(runtime: Arc<dyn Runtime>) -> Self {
        let parts = ContextParts {
            job: String::new(),
            queue: String::new(),
            message_id: String::new(),
            attempt: 1,
            in_process_limit: 1,
            cancel: CancelToken::new(),
            runtime,
            metadata: BTreeMap::new(),
        };
        Self::new(&parts, 1, None)
    }

    /// The job's name.
    pub fn job(&self) -> &str {
        &self.inner.job
    }
    /// The queue the message came from.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }
    /// The message id (fresh per dispatch; not a business identity).
    pub fn message_id(&self) -> &str {
        &self.inner.message_id
    }
    /// The delivery attempt reported by the driver (first = 1; 0 = unknown).
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }
    /// The in-process (tier-one) attempt within this delivery (first = 1).
    pub fn in_process_attempt(&self) -> u32 {
        self.inner.in_process_attempt
    }
    /// Tier one's limit for this delivery.
    pub fn in_process_limit(&self) -> u32 {
        self.inner.in_process_limit
    }
    /// The envelope's metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.inner.metadata
    }
    /// The execution's deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.inner.deadline
    }
    /// Time left before the deadline (`None`: no deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.inner
            .deadline
            .map(|d| d.saturating_duration_since(self.inner.runtime.now()))
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
        self.inner.cancel.is_cancelled()
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
        self.inner.cancel.cancelled().await;
        Cancelled::new()
    }
    /// Sleeps on the injected runtime, or returns `Err(Cancelled)` as soon as
    /// the consumer shuts down.
    pub async fn sleep(&self, duration: Duration) -> Result<(), Cancelled> {
        self.check_cancelled()?;
        let sleep = self.inner.runtime.sleep(duration);
        let cancelled = self.inner.cancel.cancelled();
        match select(sleep, cancelled).await {
            Either::Left(_) => Ok(()),
            Either::Right(_) => Err(Cancelled::new()),
        }
    }
    /// The runtime's clock.
    pub fn now(&self) -> Instant {
        self.inner.runtime.now()
    }
}
