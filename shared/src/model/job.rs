//! Job declarations ([`Job`], [`JobSpec`]).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::model::breaker::CircuitBreaker;
use crate::model::error::BoxError;
use crate::model::policy::{Backoff, PolicyError, RetryPolicy, TierOnePolicy};

/// The queue a job goes to when none is named.
pub(crate) const DEFAULT_QUEUE: &str = "default";

/// The untyped part of a job declaration: everything the rules need.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The job's name, carried in every envelope.
    pub name: String,
    /// The queue its messages travel on.
    pub queue: String,
    /// Tier two: the delivery cap and the delay between deliveries.
    pub retry: RetryPolicy,
    /// Whether the declaration chose its cap ([`JobBuilder::max_deliveries`]
    /// or [`JobBuilder::uncapped`]), or an override set it. A job that did
    /// not is uncapped by default, and [`Registry::warnings`](crate::Registry::warnings)
    /// says so.
    pub cap_chosen: bool,
    /// Tier one: in-process attempts within a delivery.
    pub tier_one: TierOnePolicy,
    /// Bound on one execution's context. `None`: no deadline.
    pub timeout: Option<Duration>,
    /// The circuit breaker guarding the job's dependency, if any. While it is
    /// open, tier-one retries are skipped.
    pub breaker: Option<CircuitBreaker>,
    /// What the attached breaker counts.
    pub breaker_feed: BreakerFeed,
}

/// What a job's attached circuit breaker counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BreakerFeed {
    /// Every execution of the job: a success closes the breaker; an ordinary
    /// failure (an error, a panic, a retry-after, a missed deadline) counts
    /// toward opening it. A permanent failure, a rejection, a cancellation or
    /// a claim held by another worker ([`ClaimHeld`](crate::ClaimHeld)) says
    /// nothing about the dependency and is not counted.
    #[default]
    Executions,
    /// Only the calls the handler makes itself through
    /// [`CircuitBreaker::call`]; the job only reads the breaker (to skip tier
    /// one while it is open). For handlers that call the breaker themselves,
    /// which would otherwise count each failure twice.
    HandlerCalls,
}

impl JobSpec {
    /// Checks every field; called when a job is declared and after overrides.
    pub fn validate(&self) -> Result<(), PolicyError> {
        validate_name(&self.name, "name", &self.name)?;
        validate_name(&self.name, "queue", &self.queue)?;
        if self.tier_one.attempts == 0 {
            return Err(PolicyError::invalid(
                &self.name,
                "tier_one.attempts",
                "must be at least 1 (1 disables in-process retries)",
            ));
        }
        if let Some(Backoff::Exponential { initial, max, .. }) = &self.retry.backoff {
            if !max.is_zero() && initial > max {
                return Err(PolicyError::invalid(
                    &self.name,
                    "backoff.initial",
                    format!("{initial:?} exceeds backoff.max {max:?}"),
                ));
            }
        }
        if let Backoff::Exponential { initial, max, .. } = &self.tier_one.backoff {
            if !max.is_zero() && initial > max {
                return Err(PolicyError::invalid(
                    &self.name,
                    "tier_one.initial",
                    format!("{initial:?} exceeds tier_one.max {max:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// Names of jobs and queues: 1 to 200 characters of ASCII letters, digits,
/// `-`, `_` and `.`, so that every backend can carry them unescaped.
fn validate_name(job: &str, field: &'static str, value: &str) -> Result<(), PolicyError> {
    if value.is_empty() {
        return Err(PolicyError::invalid(job, field, "must not be empty"));
    }
    if value.len() > 200 {
        return Err(PolicyError::invalid(
            job,
            field,
            "must be at most 200 characters",
        ));
    }
    if let Some(c) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-_.".contains(*c)))
    {
        return Err(PolicyError::invalid(
            job,
            field,
            format!("character {c:?} is not allowed (use letters, digits, '-', '_', '.')"),
        ));
    }
    Ok(())
}

type Validator<P> = Arc<dyn Fn(&P) -> Result<(), BoxError> + Send + Sync>;

/// A typed job declaration: the payload type `P` plus its [`JobSpec`].
///
/// A job is declared once, with its name, queue and policy, and validated
/// then: an invalid policy is an error at declaration (or at start, for
/// configuration overrides), never a surprise when a message arrives.
///
/// ```
/// use std::time::Duration;
/// use jobrail::Job;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct BuildReport { report_id: u64 }
///
/// let job = Job::<BuildReport>::builder("build-report")
///     .queue("reports")
///     .max_deliveries(5)
///     .backoff(Duration::from_secs(2), 2.0, Duration::from_secs(10))
///     .build()
///     .expect("valid policy");
/// assert_eq!(job.name(), "build-report");
/// ```
pub struct Job<P> {
    spec: Arc<JobSpec>,
    validator: Option<Validator<P>>,
    _payload: PhantomData<fn() -> P>,
}

impl<P> Clone for Job<P> {
    fn clone(&self) -> Self {
        Job {
            spec: self.spec.clone(),
            validator: self.validator.clone(),
            _payload: PhantomData,
        }
    }
}

impl<P> fmt::Debug for Job<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job").field("spec", &self.spec).finish()
    }
}

impl<P> Job<P> {
    /// Starts a declaration.
    ///
    /// `name` is the job's wire name: every message carries it, and a worker
    /// finds the handler by it. The queue defaults to `default`; a job that
    /// does not choose its cap ([`max_deliveries`](JobBuilder::max_deliveries)
    /// or [`uncapped`](JobBuilder::uncapped)) is named by
    /// [`Registry::warnings`](crate::Registry::warnings). The guide's chapter on
    /// [declaring jobs](https://github.com/jobrail/jobrail/blob/main/guide/jobs.md)
    /// explains each setting.
    ///
    /// # Example
    ///
    /// ```
    /// use std::time::Duration;
    /// use jobrail::Job;
    ///
    /// struct Charge {
    ///     order_id: u64,
    /// }
    ///
    /// let charge = Job::<Charge>::builder("charge")
    ///     .queue("payments")
    ///     // Five deliveries in all, 1 s, 2 s, 4 s, 8 s apart (at most 60 s).
    ///     .max_deliveries(5)
    ///     .backoff(Duration::from_secs(1), 2.0, Duration::from_secs(60))
    ///     // Within each delivery, up to three executions before redelivery.
    ///     .tier_one(3)
    ///     .timeout(Duration::from_secs(30))
    ///     .build()?;
    /// assert_eq!(charge.queue(), "payments");
    /// assert_eq!(charge.spec().retry.max_deliveries, 5);
    ///
    /// // A cap of zero deliveries is refused: a job without a cap says so.
    /// assert!(Job::<Charge>::builder("charge").max_deliveries(0).build().is_err());
    /// # Ok::<(), jobrail::PolicyError>(())
    /// ```
    pub fn builder(name: impl Into<String>) -> JobBuilder<P> {
        JobBuilder {
            spec: JobSpec {
                name: name.into(),
                queue: DEFAULT_QUEUE.to_string(),
                retry: RetryPolicy::default(),
                cap_chosen: false,
                tier_one: TierOnePolicy::default(),
                timeout: None,
                breaker: None,
                breaker_feed: BreakerFeed::default(),
            },
            zero_cap: false,
            validator: None,
            _payload: PhantomData,
        }
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The job's queue.
    pub fn queue(&self) -> &str {
        &self.spec.queue
    }

    /// The validated policy.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// Runs the validation hook, if any.
    pub fn validate_payload(&self, payload: &P) -> Result<(), BoxError> {
        match &self.validator {
            Some(v) => v(payload),
            None => Ok(()),
        }
    }
}

/// Builder returned by [`Job::builder`].
pub struct JobBuilder<P> {
    spec: JobSpec,
    /// `max_deliveries(0)` was asked for: refused at build.
    zero_cap: bool,
    validator: Option<Validator<P>>,
    _payload: PhantomData<fn() -> P>,
}

impl<P> JobBuilder<P> {
    /// The queue the job's messages travel on (default `"default"`).
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.spec.queue = queue.into();
        self
    }

    /// The delivery cap (tier two): total deliveries, counting the first.
    /// `max_deliveries(5)` is one delivery and at most four redeliveries;
    /// `max_deliveries(1)`, no redelivery. At the cap, a failure is terminal
    /// and gets its failure record. Zero is refused at build: a job without
    /// a cap says [`uncapped`](Self::uncapped).
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.spec.retry.max_deliveries = deliveries;
        self.spec.cap_chosen = true;
        self.zero_cap = deliveries == 0;
        self
    }

    /// No delivery cap of the facade's: a failing message is delivered again
    /// until it succeeds, fails permanently, or the backend's own limit (a
    /// quorum queue's delivery limit, an SQS redrive policy, Cloudflare's
    /// `max_retries`) ends it. The default when neither this nor
    /// [`max_deliveries`](Self::max_deliveries) is called, but then
    /// [`Registry::warnings`](crate::Registry::warnings) names the job.
    pub fn uncapped(mut self) -> Self {
        self.spec.retry.max_deliveries = 0;
        self.spec.cap_chosen = true;
        self.zero_cap = false;
        self
    }

    /// The cap as a value: `Some(n)` is [`max_deliveries(n)`](Self::max_deliveries),
    /// `None` is [`uncapped`](Self::uncapped). For declarations computed
    /// from configuration.
    pub fn delivery_cap(self, cap: Option<u32>) -> Self {
        match cap {
            Some(deliveries) => self.max_deliveries(deliveries),
            None => self.uncapped(),
        }
    }

    /// Exponential delay between deliveries: before delivery `k` (k >= 2),
    /// `initial * multiplier^(k-2)` capped at `max` (`max == 0`: no cap).
    /// Replaces any earlier [`backoff_fn`](Self::backoff_fn).
    pub fn backoff(mut self, initial: Duration, multiplier: f64, max: Duration) -> Self {
        self.spec.retry.backoff = Some(Backoff::exponential(initial, multiplier, max));
        self
    }

    /// A custom delay between deliveries: `f(attempt)` for the attempt about to
    /// run (>= 2). Replaces any earlier [`backoff`](Self::backoff). The function
    /// may be called concurrently.
    pub fn backoff_fn(mut self, f: impl Fn(u32) -> Duration + Send + Sync + 'static) -> Self {
        self.spec.retry.backoff = Some(Backoff::custom(f));
        self
    }

    /// Bounds one execution's context. Zero: no deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.spec.timeout = (!timeout.is_zero()).then_some(timeout);
        self
    }

    /// Tier one: executions per delivery (1 disables in-process retries).
    pub fn tier_one(mut self, attempts: u32) -> Self {
        self.spec.tier_one.attempts = attempts;
        self
    }

    /// Tier one's exponential backoff between in-process attempts.
    pub fn tier_one_backoff(mut self, initial: Duration, multiplier: f64, max: Duration) -> Self {
        self.spec.tier_one.backoff = Backoff::exponential(initial, multiplier, max);
        self
    }

    /// The longest retry-after tier one waits for in-process; longer
    /// requests go to tier two.
    pub fn tier_one_max_wait(mut self, max_wait: Duration) -> Self {
        self.spec.tier_one.max_wait = max_wait;
        self
    }

    /// The circuit breaker guarding this job's dependency. Every execution
    /// counts ([`BreakerFeed::Executions`]): a job that keeps failing opens
    /// it, and while it is open each delivery runs once (tier one is
    /// skipped), so an outage costs one execution per delivery.
    pub fn breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.spec.breaker = Some(breaker);
        self.spec.breaker_feed = BreakerFeed::Executions;
        self
    }

    /// Attaches a breaker the handler feeds itself through
    /// [`CircuitBreaker::call`] ([`BreakerFeed::HandlerCalls`]): executions
    /// are not counted again; the job only reads it to skip tier one.
    pub fn breaker_fed_by_handler(mut self, breaker: CircuitBreaker) -> Self {
        self.spec.breaker = Some(breaker);
        self.spec.breaker_feed = BreakerFeed::HandlerCalls;
        self
    }

    /// A check run before any attempt; an error is a permanent failure that
    /// costs no execution. Keep it free of effects: a payload it refuses
    /// (or a check that panics) is checked once more, by the two-pass
    /// read that reports the failure.
    pub fn validate(
        mut self,
        check: impl Fn(&P) -> Result<(), BoxError> + Send + Sync + 'static,
    ) -> Self {
        self.validator = Some(Arc::new(check));
        self
    }

    /// Validates and finishes the declaration.
    pub fn build(self) -> Result<Job<P>, PolicyError> {
        if self.zero_cap {
            return Err(PolicyError::invalid(
                &self.spec.name,
                "max_deliveries",
                "must be at least 1 (it counts the first delivery); a job without a cap says `.uncapped()`",
            ));
        }
        self.spec.validate()?;
        Ok(Job {
            spec: Arc::new(self.spec),
            validator: self.validator,
            _payload: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_cap_is_chosen_or_visibly_absent() {
        let default = Job::<()>::builder("a").build().unwrap();
        assert_eq!(default.spec().retry.max_deliveries, 0);
        assert!(!default.spec().cap_chosen);
        let uncapped = Job::<()>::builder("a").uncapped().build().unwrap();
        assert_eq!(uncapped.spec().retry.max_deliveries, 0);
        assert!(uncapped.spec().cap_chosen);
        let capped = Job::<()>::builder("a").max_deliveries(5).build().unwrap();
        assert_eq!(capped.spec().retry.max_deliveries, 5);
        assert!(capped.spec().cap_chosen);
        let err = Job::<()>::builder("a")
            .max_deliveries(0)
            .build()
            .unwrap_err();
        assert!(
            err.to_string().contains("max_deliveries") && err.to_string().contains(".uncapped()"),
            "{err}"
        );
        // The last call wins, as for every other setting.
        let later = Job::<()>::builder("a")
            .max_deliveries(0)
            .uncapped()
            .build()
            .unwrap();
        assert!(later.spec().cap_chosen);
        assert_eq!(
            Job::<()>::builder("a")
                .delivery_cap(Some(3))
                .build()
                .unwrap()
                .spec()
                .retry
                .max_deliveries,
            3
        );
        assert_eq!(
            Job::<()>::builder("a")
                .delivery_cap(None)
                .build()
                .unwrap()
                .spec()
                .retry
                .max_deliveries,
            0
        );
    }

    #[test]
    fn invalid_declarations_are_errors_at_build() {
        let err = Job::<()>::builder("").build().unwrap_err();
        assert!(err.to_string().contains("`name`"), "{err}");
        let err = Job::<()>::builder("ok")
            .queue("has space")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("`queue`"), "{err}");
        let err = Job::<()>::builder("ok").tier_one(0).build().unwrap_err();
        assert!(err.to_string().contains("tier_one.attempts"), "{err}");
        let err = Job::<()>::builder("ok")
            .backoff(Duration::from_secs(5), 2.0, Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("backoff.initial"), "{err}");
    }

    #[test]
    fn backoff_forms_replace_each_other() {
        let job = Job::<()>::builder("j")
            .backoff(Duration::from_secs(1), 2.0, Duration::ZERO)
            .backoff_fn(|a| Duration::from_secs(a as u64))
            .build()
            .unwrap();
        assert!(matches!(job.spec().retry.backoff, Some(Backoff::Custom(_))));
        let job = Job::<()>::builder("j")
            .backoff_fn(|a| Duration::from_secs(a as u64))
            .backoff(Duration::from_secs(1), 2.0, Duration::ZERO)
            .build()
            .unwrap();
        assert!(matches!(
            job.spec().retry.backoff,
            Some(Backoff::Exponential { .. })
        ));
    }

    #[test]
    fn zero_timeout_means_none() {
        let job = Job::<()>::builder("j")
            .timeout(Duration::ZERO)
            .build()
            .unwrap();
        assert_eq!(job.spec().timeout, None);
    }
}
