//! A circuit breaker per named dependency ([`CircuitBreaker`]).

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::metrics::{counter, gauge, SharedString};

use crate::model::error::{BreakerOpen, JobError};
use crate::model::policy::PolicyError;
use crate::model::runtime::{Clock, Instant, SystemClock};

/// Breaker thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (at least 1).
    pub failure_threshold: u32,
    /// How long the breaker stays open before letting a probe through.
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            cool_down: Duration::from_secs(30),
        }
    }
}

/// The breaker's state as seen now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls pass; failures are counted.
    Closed,
    /// Calls fail at once.
    Open,
    /// The cool-down has passed: the next call is a probe.
    HalfOpen,
}

/// The result of a call through the breaker.
#[derive(Debug)]
pub enum BreakerError<E> {
    /// The breaker refused the call; the operation did not run.
    Open(BreakerOpen),
    /// The operation ran and failed.
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for BreakerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BreakerError::Open(open) => fmt::Display::fmt(open, f),
            BreakerError::Inner(err) => fmt::Display::fmt(err, f),
        }
    }
}

/// The source is the wrapped error itself (the refusal, or the operation's
/// own error), never past it: outcome markers such as
/// [`Permanent`](crate::Permanent) returned by the operation stay visible to
/// [`JobError::outcome`](crate::JobError::outcome).
impl<E: StdError + 'static> StdError for BreakerError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            BreakerError::Open(open) => Some(open),
            BreakerError::Inner(err) => Some(err),
        }
    }
}

/// A handler that calls a breaker with an operation returning [`JobError`]
/// gets the operation's own error back (markers included) with `?`; a
/// refusal becomes an error whose outcome is
/// [`Outcome::BreakerOpen`](crate::Outcome::BreakerOpen).
impl From<BreakerError<JobError>> for JobError {
    fn from(err: BreakerError<JobError>) -> Self {
        match err {
            BreakerError::Open(open) => JobError::new(open),
            BreakerError::Inner(err) => err,
        }
    }
}

#[derive(Debug)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

struct Inner {
    name: String,
    config: BreakerConfig,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
}

/// A shareable circuit breaker. Clones share state.
///
/// Why: when a dependency is down, retrying it in-process only adds load and
/// latency. After `failure_threshold` consecutive failures the breaker opens;
/// calls through it then fail at once (without running the protected
/// operation) until `cool_down` has passed, when one probe call is let
/// through (half-open). The probe's success closes the breaker; its failure
/// opens it again. The executor skips tier-one retries while a job's breaker
/// is open, so the delivery falls straight through to broker redelivery
/// (tier two), where the wait is longer and costs nothing.
///
/// The clock is injected, so the breaker behaves the same natively and on the
/// edge and is testable without sleeping.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail::{BreakerConfig, BreakerState, CircuitBreaker, Job};
///
/// let payments = CircuitBreaker::new(
///     "payments-api",
///     BreakerConfig { failure_threshold: 2, cool_down: Duration::from_secs(30) },
/// )?;
/// // The job's executions feed it; while it is open, tier one is skipped and
/// // the delivery goes back to the backend with its backoff.
/// let job = Job::<u64>::builder("charge").max_deliveries(5).tier_one(3).breaker(payments.clone()).build()?;
///
/// payments.record_failure();
/// payments.record_failure();
/// assert_eq!(payments.state(), BreakerState::Open);
/// assert!(payments.acquire().is_err());
/// # let _ = job;
/// # Ok::<(), jobrail::PolicyError>(())
/// ```
#[derive(Clone)]
pub struct CircuitBreaker {
    inner: Arc<Inner>,
}

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("name", &self.inner.name)
            .field("config", &self.inner.config)
            .field("state", &self.state())
            .finish()
    }
}

impl CircuitBreaker {
    /// A breaker on the system clock.
    pub fn new(name: impl Into<String>, config: BreakerConfig) -> Result<Self, PolicyError> {
        Self::with_clock(name, config, Arc::new(SystemClock))
    }

    /// A breaker on an injected clock.
    pub fn with_clock(
        name: impl Into<String>,
        config: BreakerConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, PolicyError> {
        let name = name.into();
        if config.failure_threshold == 0 {
            return Err(PolicyError::invalid(
                &name,
                "breaker.failure_threshold",
                "must be at least 1",
            ));
        }
        breaker_created(&name);
        Ok(CircuitBreaker {
            inner: Arc::new(Inner {
                name,
                config,
                clock,
                state: Mutex::new(State::Closed { failures: 0 }),
            }),
        })
    }

    /// The breaker's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state now (an open breaker whose cool-down passed reads half-open).
    pub fn state(&self) -> BreakerState {
        match *self.lock() {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { until } if self.inner.clock.now() < until => BreakerState::Open,
            State::Open { .. } | State::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether calls would be refused now.
    pub fn is_open(&self) -> bool {
        match *self.lock() {
            State::Open { until } => self.inner.clock.now() < until,
            State::HalfOpen { probing } => probing,
            State::Closed { .. } => false,
        }
    }

    /// Asks to make a call: `Ok` lets it run, `Err` refuses it.
    pub fn acquire(&self) -> Result<(), BreakerOpen> {
        let mut state = self.lock();
        match *state {
            State::Closed { .. } => Ok(()),
            State::Open { until } if self.inner.clock.now() < until => Err(self.open_error()),
            State::Open { .. } | State::HalfOpen { probing: false } => {
                let was_open = matches!(*state, State::Open { .. });
                *state = State::HalfOpen { probing: true };
                drop(state);
                if was_open {
                    self.entered(BreakerState::HalfOpen);
                }
                Ok(())
            }
            State::HalfOpen { probing: true } => Err(self.open_error()),
        }
    }

    fn open_error(&self) -> BreakerOpen {
        BreakerOpen::new(self.inner.name.clone())
    }

    /// Records a successful call: closes the breaker.
    pub fn record_success(&self) {
        let previous = std::mem::replace(&mut *self.lock(), State::Closed { failures: 0 });
        if !matches!(previous, State::Closed { .. }) {
            self.entered(BreakerState::Closed);
        }
    }

    /// Records a change of state in the metrics (outside the state lock).
    fn entered(&self, state: BreakerState) {
        breaker_entered(&self.inner.name, state);
    }

    /// Records a failed call: may open the breaker.
    pub fn record_failure(&self) {
        let mut state = self.lock();
        let open = State::Open {
            until: self.inner.clock.now() + self.inner.config.cool_down,
        };
        let previous = std::mem::replace(&mut *state, State::Closed { failures: 0 });
        *state = match previous {
            State::Closed { failures } => {
                let failures = failures.saturating_add(1);
                if failures >= self.inner.config.failure_threshold {
                    open
                } else {
                    State::Closed { failures }
                }
            }
            State::HalfOpen { .. } | State::Open { .. } => open,
        };
        let opened =
            matches!(*state, State::Open { .. }) && !matches!(previous, State::Open { .. });
        drop(state);
        if opened {
            self.entered(BreakerState::Open);
        }
    }

    /// Runs `operation` through the breaker. While open, returns
    /// [`BreakerError::Open`] without running it.
    pub async fn call<T, E, F, Fut>(&self, operation: F) -> Result<T, BreakerError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.acquire().map_err(BreakerError::Open)?;
        let mut guard = ProbeGuard {
            breaker: self,
            done: false,
        };
        let result = operation().await;
        guard.done = true;
        match &result {
            Ok(_) => self.record_success(),
            Err(_) => self.record_failure(),
        }
        result.map_err(BreakerError::Inner)
    }
}

/// Counts an abandoned call (its future dropped) as a failure, so a dropped
/// half-open probe cannot leave the breaker refusing calls forever.
struct ProbeGuard<'a> {
    breaker: &'a CircuitBreaker,
    done: bool,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.breaker.record_failure();
        }
    }
}

// A breaker records its own metrics, where its state changes (named in
// `describe_metrics`, which describes them with the rest).

/// The gauge of a breaker's state.
pub(crate) const BREAKER_STATE: &str = "jobrail_breaker_state";
/// The counter of a breaker's changes of state.
pub(crate) const BREAKER_TRANSITIONS: &str = "jobrail_breaker_transitions_total";

/// A breaker named `name` entered `state`.
pub(crate) fn breaker_entered(name: &str, state: BreakerState) {
    let (value, to) = match state {
        BreakerState::Closed => (0.0, "closed"),
        BreakerState::Open => (1.0, "open"),
        BreakerState::HalfOpen => (2.0, "half_open"),
    };
    let breaker = SharedString::from_owned(name.to_string());
    gauge!(BREAKER_STATE, "breaker" => breaker.clone()).set(value);
    counter!(BREAKER_TRANSITIONS, "breaker" => breaker, "to" => to).increment(1);
}

/// A breaker named `name` was created (closed): its gauge reads 0 from the
/// start rather than appearing at its first change.
pub(crate) fn breaker_created(name: &str) {
    gauge!(BREAKER_STATE, "breaker" => name.to_string()).set(0.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::runtime::VirtualRuntime;
    use futures_executor::block_on;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn breaker(clock: &VirtualRuntime) -> CircuitBreaker {
        let config = BreakerConfig {
            failure_threshold: 2,
            cool_down: Duration::from_secs(10),
        };
        CircuitBreaker::with_clock("upstream", config, Arc::new(clock.clone())).unwrap()
    }

    #[test]
    fn opens_after_threshold_refuses_then_probes() {
        let clock = VirtualRuntime::new();
        let b = breaker(&clock);
        let ran = std::cell::Cell::new(0);
        let fail = || async {
            ran.set(ran.get() + 1);
            Err::<(), _>("down")
        };
        assert!(matches!(
            block_on(b.call(fail)),
            Err(BreakerError::Inner(_))
        ));
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(matches!(
            block_on(b.call(fail)),
            Err(BreakerError::Inner(_))
        ));
        assert_eq!(b.state(), BreakerState::Open);
        assert!(matches!(block_on(b.call(fail)), Err(BreakerError::Open(_))));
        assert_eq!(ran.get(), 2, "an open breaker must not run the operation");

        clock.advance(Duration::from_secs(10));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(matches!(
            block_on(b.call(fail)),
            Err(BreakerError::Inner(_))
        ));
        assert_eq!(ran.get(), 3);
        assert_eq!(b.state(), BreakerState::Open, "a failed probe reopens");

        clock.advance(Duration::from_secs(10));
        assert_eq!(block_on(b.call(|| async { Ok::<_, &str>(5) })).unwrap(), 5);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn only_one_probe_at_a_time() {
        let clock = VirtualRuntime::new();
        let b = breaker(&clock);
        b.record_failure();
        b.record_failure();
        clock.advance(Duration::from_secs(11));
        assert!(b.acquire().is_ok());
        assert!(b.acquire().is_err());
        b.record_success();
        assert!(b.acquire().is_ok());
    }

    #[test]
    fn zero_threshold_is_invalid() {
        let config = BreakerConfig {
            failure_threshold: 0,
            cool_down: Duration::ZERO,
        };
        assert!(CircuitBreaker::new("x", config).is_err());
    }
}
