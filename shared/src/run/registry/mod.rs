//! The registry of handlers and the processing of one delivery ([`Registry`]).
//!
//! A successful delivery costs one parse of its body and one typed decode
//! of its payload: the envelope is read into a view borrowed from the body
//! (the payload left raw), the job's type decodes the raw payload once for
//! its validation hook, and that same value is handed to the first
//! execution. Only a tier-one retry decodes the payload again (the handler
//! took the first value). The context shares the registered job's name and
//! queue and is made once per delivery; the event takes its copy of the
//! message id back when the handler kept no context. A job's counters are
//! made when it is registered and counted with atomic adds, and without a
//! metrics recorder no clock is read for durations.

mod crash;
mod decide;
mod erased;
mod message;
mod report;

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::model::backend::SettlementError;
use crate::model::cancel::CancelToken;
use crate::model::error::JobError;
use crate::model::job::{Job, JobSpec};
use crate::model::maybe_send::{MaybeSend, MaybeSync};
use crate::model::policy::PolicyError;
use crate::model::runtime::{Instant, Runtime};
use crate::observe::event::{Event, EventSink};
use crate::observe::metrics::JobMeter;
use crate::observe::stats::{Counters, Stats, UNREGISTERED_JOBS};
use crate::rules::settle::{Settlement, UnknownNameAttempts, UNKNOWN_NAME_RETRY_DELAY};
use crate::run::context::JobContext;
use crate::run::state::{MissingState, StateMap};

use self::erased::{ErasedJob, TypedJob};

/// A registration error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two handlers for one job name.
    #[error("job `{0}` is already registered")]
    Duplicate(String),
    /// A policy is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// Handlers by job name, plus consumer-wide settings and counters.
///
/// [`Registry::process`] is the whole consumer pipeline for one delivery,
/// written once for every backend: decode the envelope, find the handler,
/// decode and validate the payload, run the two retry tiers, and decide the
/// settlement. The driver carries the settlement out and reports back with
/// [`Registry::settled`], which emits the event and counts the outcome only
/// if the backend accepted it.
pub struct Registry {
    jobs: BTreeMap<String, Box<dyn ErasedJob>>,
    unknown_name_attempts: UnknownNameAttempts,
    unknown_name_delay: Duration,
    sink: Option<Arc<dyn EventSink>>,
    include_payload: bool,
    stats: Arc<Stats>,
    /// The counters of deliveries of names no handler is registered for.
    unregistered: Arc<Counters>,
    /// Metric keys of deliveries no registered job's keys fit, by queue
    /// and counted job name: a registered name or [`UNREGISTERED_JOBS`], on
    /// a queue the host consumes, so the map stays small.
    other_meters: Mutex<BTreeMap<String, BTreeMap<String, Arc<JobMeter>>>>,
    /// What handlers read with `JobContext::state`.
    pub(super) state: StateMap,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("jobs", &self.jobs.keys().collect::<Vec<_>>())
            .field("unknown_name_attempts", &self.unknown_name_attempts)
            .finish_non_exhaustive()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// What the rules know of one delivery as it comes in: its queue, body and
/// counts, as the host reports them. The host's means to settle it is a
/// separate [`DeliveryHandle`](crate::DeliveryHandle) (natively a driver's
/// `jobrail_native::Delivery`); [`Registry::deliver`] builds this from one.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The queue it came from.
    pub queue: &'a str,
    /// The raw body.
    pub body: &'a [u8],
    /// The delivery attempt (first = 1; 0 = the driver cannot count).
    pub attempt: u32,
    /// Earlier deliveries of this message that ended in an accepted
    /// graceful-shutdown retry, where the backend carries that count; `None`
    /// where it cannot.
    pub shutdown_returns: Option<u32>,
    /// When the driver's hold on the delivery ends, if it must end (the edge's
    /// invocation budget). Tier one does not sleep past it and each
    /// execution's deadline is no later than it.
    pub deadline: Option<Instant>,
}

/// The result of processing one delivery: what to ask the backend, and what
/// to report once it answers.
#[derive(Debug, Clone)]
pub struct Processed {
    /// The settlement to request (a terminal failure carries its record).
    pub settlement: Settlement,
    /// The event to emit if the backend accepts the settlement.
    pub event: Event,
}

impl Processed {
    /// Handler executions in this delivery.
    pub fn executions(&self) -> u32 {
        self.event.executions
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        let stats = Arc::<Stats>::default();
        Registry {
            jobs: BTreeMap::new(),
            unknown_name_attempts: UnknownNameAttempts::default(),
            unknown_name_delay: UNKNOWN_NAME_RETRY_DELAY,
            sink: None,
            include_payload: false,
            state: StateMap::default(),
            unregistered: stats.counters(UNREGISTERED_JOBS),
            stats,
            other_meters: Mutex::default(),
        }
    }

    /// Registers `handler` for `job`.
    ///
    /// ```
    /// use jobrail::{Job, JobContext, JobError, Registry};
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Ping { n: u32 }
    ///
    /// let job = Job::<Ping>::builder("ping").build().unwrap();
    /// let mut registry = Registry::new();
    /// registry
    ///     .register(&job, |_ctx: JobContext, ping: Ping| async move {
    ///         if ping.n == 0 { return Err(JobError::permanent("n must be positive")); }
    ///         Ok(())
    ///     })
    ///     .unwrap();
    /// ```
    pub fn register<P, H, Fut>(
        &mut self,
        job: &Job<P>,
        handler: H,
    ) -> Result<&mut Self, RegistryError>
    where
        P: DeserializeOwned + MaybeSend + 'static,
        H: Fn(JobContext, P) -> Fut + MaybeSend + MaybeSync + 'static,
        Fut: Future<Output = Result<(), JobError>> + MaybeSend + 'static,
    {
        if self.jobs.contains_key(job.name()) {
            return Err(RegistryError::Duplicate(job.name().to_string()));
        }
        let entry = TypedJob {
            spec: job.spec().clone(),
            meter: JobMeter::new(job.name(), job.queue()),
            counters: self.stats.counters(job.name()),
            name: Arc::from(job.name()),
            queue: Arc::from(job.queue()),
            job: job.clone(),
            handler,
        };
        self.jobs.insert(job.name().to_string(), Box::new(entry));
        Ok(self)
    }

    /// Caps deliveries of messages whose job name has no handler.
    pub fn unknown_name_attempts(&mut self, cap: UnknownNameAttempts) -> &mut Self {
        self.unknown_name_attempts = cap;
        self
    }

    /// The cap set with [`Registry::unknown_name_attempts`] (the default
    /// unless it was changed). A backend's own delivery limit must leave
    /// room for it, so a host reads it to check that limit.
    pub fn unknown_name_attempts_setting(&self) -> UnknownNameAttempts {
        self.unknown_name_attempts
    }

    /// How long an unknown job name waits before its next delivery (default
    /// 30 s: time for the deployment that knows the name to roll out).
    pub fn unknown_name_retry_delay(&mut self, delay: Duration) -> &mut Self {
        self.unknown_name_delay = delay;
        self
    }

    /// The delay set with [`Registry::unknown_name_retry_delay`] (30 s
    /// unless changed): a backend with a longest retry delay must hold it
    /// ([`crate::check_retry_delays`]).
    pub fn unknown_name_retry_delay_setting(&self) -> Duration {
        self.unknown_name_delay
    }

    /// The event sink set with [`Registry::event_sink`], if any (a host that
    /// adds its own sink forwards to it).
    pub fn current_event_sink(&self) -> Option<Arc<dyn EventSink>> {
        self.sink.clone()
    }

    /// Where events go.
    pub fn event_sink(&mut self, sink: Arc<dyn EventSink>) -> &mut Self {
        self.sink = Some(sink);
        self
    }

    /// Include payloads in events (off by default: they may hold secrets).
    pub fn events_include_payload(&mut self, include: bool) -> &mut Self {
        self.include_payload = include;
        self
    }

    /// The registered jobs' policies, by name.
    pub fn specs(&self) -> impl Iterator<Item = &JobSpec> {
        self.jobs.values().map(|j| j.spec())
    }

    /// One registered job's policy.
    pub fn spec(&self, name: &str) -> Option<&JobSpec> {
        self.jobs.get(name).map(|j| j.spec())
    }

    /// Mutable access to a job's policy (used by configuration overrides;
    /// re-validate afterwards).
    pub(crate) fn spec_mut(&mut self, name: &str) -> Option<&mut JobSpec> {
        self.jobs.get_mut(name).map(|j| j.spec_mut())
    }

    /// Gives every handler `value`, read in the handler with
    /// [`JobContext::state::<T>()`](crate::JobContext::state): a database
    /// pool, a client, a configuration, given once here instead of cloned
    /// into each handler's closure. One value per type (a second value of a
    /// type replaces the first); wrap two values of one type in types of
    /// your own. The value is shared, never cloned per delivery: put what a
    /// handler mutates behind a lock or an atomic.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use jobrail::testing::TestQueue;
    /// use jobrail::{Job, JobContext, Registry};
    ///
    /// struct Sent(AtomicU64);
    ///
    /// let job = Job::<String>::builder("send-mail").max_deliveries(3).build().unwrap();
    /// let mut registry = Registry::new();
    /// registry.state(Sent(AtomicU64::new(0)));
    /// registry
    ///     .register(&job, |ctx: JobContext, _to: String| async move {
    ///         ctx.state::<Sent>()?.0.fetch_add(1, Ordering::Relaxed);
    ///         Ok(())
    ///     })
    ///     .unwrap();
    ///
    /// let mut queue = TestQueue::new(registry);
    /// queue.send(&job, &"ada@example.com".to_string());
    /// queue.run_until_idle();
    /// let sent = queue.registry().state_of::<Sent>().unwrap();
    /// assert_eq!(sent.0.load(Ordering::Relaxed), 1);
    /// ```
    pub fn state<T: Any + MaybeSend + MaybeSync>(&mut self, value: T) -> &mut Self {
        self.state.insert(value);
        self
    }

    /// The state of type `T` given with [`Registry::state`], for a host or
    /// a test to read back.
    pub fn state_of<T: Any>(&self) -> Result<&T, MissingState> {
        self.state.get::<T>()
    }

    /// What a host should tell its operator when it starts: one line per
    /// registered job that is uncapped by default (neither
    /// [`JobBuilder::max_deliveries`](crate::JobBuilder::max_deliveries) nor
    /// [`JobBuilder::uncapped`](crate::JobBuilder::uncapped) was called, and
    /// no override set a cap), whose failing messages are delivered until
    /// the backend's own limit, if any, ends them. The native consumer and
    /// the edge log each line as a warning when they start.
    ///
    /// ```
    /// use jobrail::{Job, JobContext, Registry};
    ///
    /// let mut registry = Registry::new();
    /// let forgot = Job::<u32>::builder("forgot").build().unwrap();
    /// let chose = Job::<u32>::builder("chose").uncapped().build().unwrap();
    /// for job in [&forgot, &chose] {
    ///     registry.register(job, |_ctx: JobContext, _n: u32| async { Ok(()) }).unwrap();
    /// }
    /// let warnings = registry.warnings();
    /// assert_eq!(warnings.len(), 1);
    /// assert!(warnings[0].contains("`forgot`"));
    /// ```
    pub fn warnings(&self) -> Vec<String> {
        self.specs()
            .filter(|spec| spec.retry.max_deliveries == 0 && !spec.cap_chosen)
            .map(|spec| {
                format!(
                    "job `{}` has no delivery cap: a failing message is delivered again until it succeeds or the backend's own limit ends it; declare `.max_deliveries(n)`, or `.uncapped()` if that is meant",
                    spec.name
                )
            })
            .collect()
    }

    /// The distinct queues of the registered jobs.
    pub fn queues(&self) -> Vec<String> {
        let mut queues: Vec<String> = self.specs().map(|s| s.queue.clone()).collect();
        queues.sort();
        queues.dedup();
        queues
    }

    /// The resolution and outcome counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    // The public face of the work the other files do (one `impl` block,
    // so the API lists them together).

    /// Processes one delivery: everything but the backend call.
    pub async fn process(
        &self,
        delivery: Incoming<'_>,
        runtime: &Arc<dyn Runtime>,
        cancel: &CancelToken,
    ) -> Processed {
        self.decide(delivery, runtime, cancel).await
    }

    /// A delivery the consumer will not run now (the edge's invocation budget
    /// ran low before it started): a zero-delay retry without execution,
    /// reported like the shutdown rule. The backend still counts the delivery.
    pub fn defer(&self, delivery: Incoming<'_>, reason: &str) -> Processed {
        self.decide_deferred(delivery, reason)
    }

    /// The settlement of a delivery whose execution brought its host down (a
    /// handler panic on a target where panics abort, such as wasm32): decided
    /// as if that one execution had returned the panic as its error, so the
    /// job's retry policy and cap apply as they do where panics unwind. The
    /// host calls it once it is running again, before anything else runs the
    /// delivery. A body that is not a known job's envelope is settled as
    /// [`Registry::process`] settles it (the same decision: a malformed
    /// envelope's failure record, the unknown-name retry and, at its cap, its
    /// record), without running anything. A known job's payload is not
    /// decoded again: its decoder may be what brought the host down.
    pub fn crashed(&self, delivery: Incoming<'_>, panic_message: &str) -> Processed {
        self.decide_crashed(delivery, panic_message)
    }

    /// Reports the backend's answer to a settlement: counts it and emits the
    /// event if accepted; reports a settlement failure otherwise.
    /// [`Registry::deliver`] calls it; a host that settles by other means
    /// calls it itself.
    pub fn settled(&self, processed: &Processed, outcome: Result<(), &SettlementError>) {
        self.report_answer(processed, outcome)
    }
}
