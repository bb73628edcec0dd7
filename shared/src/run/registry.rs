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

use std::any::Any;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::model::backend::SettlementError;
use crate::model::cancel::CancelToken;
use crate::model::envelope::{Envelope, EnvelopeError, EnvelopeView};
use crate::model::error::JobError;
use crate::model::error::Panicked;
use crate::model::failure::{Failure, FailureKind};
use crate::model::job::{Job, JobSpec};
use crate::model::maybe_send::{BoxFuture, MaybeSend, MaybeSync};
use crate::model::panic::guard;
use crate::model::policy::PolicyError;
use crate::model::policy::PANICKED_BACKOFF_DELAY;
use crate::model::record::FailureRecord;
use crate::model::runtime::{Instant, Runtime};
use crate::observe::event::{Event, EventKind, EventSink};
use crate::observe::metrics::JobMeter;
use crate::observe::stats::{Count, Counters, Resolution, Stats, UNREGISTERED_JOBS};
use crate::rules::settle::{
    exceeds_crash_bound, is_shutdown, settle, settle_unknown_name, Decision, Settlement,
    UnknownNameAttempts, SHUTDOWN_GRACE, UNKNOWN_NAME_RETRY_DELAY,
};
use crate::run::context::{ContextParts, JobContext};
use crate::run::executor::run_tiers;

pin_project_lite::pin_project! {
    /// A payload decoded for its job's handler (when the delivery is
    /// prepared), then, in the same allocation, the handler's first
    /// execution that took it: one box holds both, one after the other.
    #[project = FirstRunProj]
    enum FirstRun<P, Fut> {
        Payload { payload: Option<P> },
        Running { #[pin] future: Fut },
    }
}

impl<P, Fut: Future> Future for FirstRun<P, Fut> {
    type Output = Fut::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Fut::Output> {
        match self.project() {
            FirstRunProj::Running { future } => future.poll(cx),
            FirstRunProj::Payload { .. } => unreachable!("a first run is polled once started"),
        }
    }
}

/// A payload decoded for its job's handler, its type erased: decoded once,
/// when the delivery is prepared, and handed to the first execution (a
/// [`FirstRun`], whose box the execution's future reuses).
#[cfg(not(target_arch = "wasm32"))]
type AnyPayload = Box<dyn Any + Send>;
/// A payload decoded for its job's handler, its type erased.
#[cfg(target_arch = "wasm32")]
type AnyPayload = Box<dyn Any>;

/// A job whose payload type has been erased, so handlers of different types
/// can live in one registry.
pub(crate) trait ErasedJob: MaybeSend + MaybeSync {
    fn spec(&self) -> &JobSpec;
    fn spec_mut(&mut self) -> &mut JobSpec;
    /// The keys of its metrics on its queue.
    fn meter(&self) -> &JobMeter;
    /// Its counters in the registry's [`Stats`].
    fn counters(&self) -> &Counters;
    /// Its name and queue, shared with the contexts of its deliveries.
    fn names(&self) -> (&Arc<str>, &Arc<str>);
    /// Decodes the raw JSON payload (once) and validates it, without
    /// running anything.
    fn prepare(&self, payload: &str) -> Result<AnyPayload, Failure>;
    /// Starts one execution: with the payload `prepare` decoded (the first
    /// execution), or decoding `payload` again (a tier-one retry).
    fn run(
        &self,
        ctx: JobContext,
        prepared: Option<AnyPayload>,
        payload: &str,
    ) -> BoxFuture<'static, Result<(), JobError>>;
}

struct TypedJob<P, H> {
    spec: JobSpec,
    meter: JobMeter,
    counters: Arc<Counters>,
    name: Arc<str>,
    queue: Arc<str>,
    job: Job<P>,
    handler: H,
}

impl<P, H, Fut> ErasedJob for TypedJob<P, H>
where
    P: DeserializeOwned + MaybeSend + 'static,
    H: Fn(JobContext, P) -> Fut + MaybeSend + MaybeSync + 'static,
    Fut: Future<Output = Result<(), JobError>> + MaybeSend + 'static,
{
    fn spec(&self) -> &JobSpec {
        &self.spec
    }

    fn spec_mut(&mut self) -> &mut JobSpec {
        &mut self.spec
    }

    fn meter(&self) -> &JobMeter {
        &self.meter
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn names(&self) -> (&Arc<str>, &Arc<str>) {
        (&self.name, &self.queue)
    }

    fn prepare(&self, payload: &str) -> Result<AnyPayload, Failure> {
        let typed: P = serde_json::from_str(payload).map_err(|e| Failure {
            kind: FailureKind::UndecodablePayload,
            message: format!(
                "payload does not decode as job `{}`: {}",
                self.spec.name,
                crate::model::redact::json_error_unplaced(&e)
            ),
        })?;
        self.job.validate_payload(&typed).map_err(|e| Failure {
            kind: FailureKind::InvalidPayload,
            message: format!("payload failed validation: {e}"),
        })?;
        Ok(Box::new(FirstRun::<P, Fut>::Payload {
            payload: Some(typed),
        }))
    }

    fn run(
        &self,
        ctx: JobContext,
        prepared: Option<AnyPayload>,
        payload: &str,
    ) -> BoxFuture<'static, Result<(), JobError>> {
        if let Some(mut first) = prepared.and_then(|p| p.downcast::<FirstRun<P, Fut>>().ok()) {
            if let FirstRun::Payload { payload } = &mut *first {
                if let Some(typed) = payload.take() {
                    // The payload's box becomes the execution's.
                    *first = FirstRun::Running {
                        future: (self.handler)(ctx, typed),
                    };
                    return Box::into_pin(first);
                }
            }
        }
        match serde_json::from_str::<P>(payload) {
            Ok(typed) => Box::pin((self.handler)(ctx, typed)),
            Err(e) => Box::pin(std::future::ready(Err(JobError::permanent(e)))),
        }
    }
}

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

/// What running the handler produced, for the event.
#[derive(Default)]
struct RunSummary {
    executions: u32,
    resolution: Option<Resolution>,
    error: Option<String>,
    shutdown: bool,
    /// An owned copy of the message id, for the event to take.
    message_id: Option<String>,
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

    /// Processes one delivery: everything but the backend call.
    pub async fn process(
        &self,
        delivery: Incoming<'_>,
        runtime: &Arc<dyn Runtime>,
        cancel: &CancelToken,
    ) -> Processed {
        let (mut envelope, job) = match self.route(delivery) {
            Ok(routed) => routed,
            Err(unrunnable) => return *unrunnable,
        };
        let spec = job.spec();
        let payload = envelope.payload.get();
        let prepared = match guard(|| job.prepare(payload)) {
            Ok(Ok(prepared)) => prepared,
            Ok(Err(failure)) => {
                let envelope = envelope.to_envelope();
                let known = Known::from_envelope(&envelope);
                return self.fail_early(delivery, known, Some(&envelope), failure);
            }
            // A validation hook that panics is an ordinary error: retried by
            // the job's policy, with no execution.
            Err(panicked) => {
                let result = Err(JobError::from(panicked));
                let decision = settle(&spec.retry, delivery.attempt, &result, false);
                let summary = RunSummary {
                    error: result.as_ref().err().map(JobError::chain_text),
                    ..RunSummary::default()
                };
                return self.finish(delivery, &envelope, decision, summary);
            }
        };

        if exceeds_crash_bound(
            spec.retry.attempts,
            delivery.attempt,
            delivery.shutdown_returns,
        ) {
            // Earlier deliveries ended without a settlement (a worker that
            // crashed or was killed mid-job): the cap is spent, so fail
            // without running the handler again.
            let failure = Failure {
                kind: FailureKind::AttemptsExhausted,
                message: format!(
                    "delivery {} exceeds the cap of {} ({}): earlier deliveries ended without a settlement that retries (a worker that crashed, or a rejection the backend returned)",
                    delivery.attempt,
                    spec.retry.attempts,
                    match delivery.shutdown_returns {
                        Some(n) => format!("{n} of them handed back by a graceful shutdown"),
                        None => format!("with {SHUTDOWN_GRACE} delivery of grace: this backend cannot count graceful-shutdown returns"),
                    }
                ),
            };
            return self.finish(
                delivery,
                &envelope,
                Decision::Fail(failure),
                RunSummary::default(),
            );
        }
        let (name, queue) = job.names();
        let parts = Arc::new(ContextParts {
            job: name.clone(),
            queue: if &**queue == delivery.queue {
                queue.clone()
            } else {
                Arc::from(delivery.queue)
            },
            message_id: envelope.id.to_string(),
            attempt: delivery.attempt,
            in_process_limit: spec.tier_one.attempts,
            cancel: cancel.clone(),
            runtime: runtime.clone(),
            // Lent to the context, and given back below.
            metadata: std::mem::take(&mut envelope.metadata),
        });
        let meter = self.meter(&envelope.job, delivery.queue);
        let mut prepared = Some(prepared);
        let run = run_tiers(
            spec,
            |ctx| job.run(ctx, prepared.take(), payload),
            &parts,
            &meter,
            delivery.deadline,
        )
        .await;
        job.counters()
            .add(Count::Executions, u64::from(run.executions));
        // The event takes the context's copy of the id, and the envelope
        // its metadata back, when no handler kept a context (the usual
        // case); else they are copied.
        let message_id = match Arc::try_unwrap(parts) {
            Ok(parts) => {
                envelope.metadata = parts.metadata;
                Some(parts.message_id)
            }
            Err(parts) => {
                envelope.metadata.clone_from(&parts.metadata);
                None
            }
        };
        let settlement = settle(
            &spec.retry,
            delivery.attempt,
            &run.result,
            cancel.is_cancelled(),
        );
        let resolution = Resolution::classify(
            delivery.attempt,
            spec.retry.attempts,
            run.in_process,
            spec.tier_one.attempts,
        );
        let summary = RunSummary {
            executions: run.executions,
            resolution: Some(resolution),
            error: run.result.as_ref().err().map(JobError::chain_text),
            shutdown: is_shutdown(&run.result, cancel.is_cancelled()),
            message_id,
        };
        self.finish(delivery, &envelope, settlement, summary)
    }

    /// A delivery the consumer will not run now (the edge's invocation budget
    /// ran low before it started): a zero-delay retry without execution,
    /// reported like the shutdown rule. The backend still counts the delivery.
    pub fn defer(&self, delivery: Incoming<'_>, reason: &str) -> Processed {
        let envelope = Envelope::decode(delivery.body).ok();
        let kind = EventKind::Retried {
            delay: Some(Duration::ZERO),
            error: reason.to_string(),
            shutdown: true,
        };
        Processed {
            event: self.event(delivery, envelope.as_ref(), 0, kind),
            settlement: Settlement::Retry {
                delay: Some(Duration::ZERO),
                shutdown: true,
            },
        }
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
        let (envelope, job) = match self.route(delivery) {
            Ok(routed) => routed,
            Err(unrunnable) => return *unrunnable,
        };
        let spec = job.spec();
        let result: Result<(), JobError> = Err(JobError::from(Panicked::new(
            panic_message.to_string(),
            String::new(),
        )));
        // The execution counts on the job's attached breaker as a caught
        // panic does.
        crate::run::executor::feed_breaker(spec, &result);
        let decision = settle(&spec.retry, delivery.attempt, &result, false);
        job.counters().add(Count::Executions, 1);
        self.meter(&envelope.job, delivery.queue)
            .crashed_execution();
        let summary = RunSummary {
            executions: 1,
            resolution: None,
            error: result.as_ref().err().map(JobError::chain_text),
            shutdown: false,
            message_id: None,
        };
        self.finish(delivery, &envelope, decision, summary)
    }

    /// The one decision for a body no handler can run, shared by
    /// [`Registry::process`] and [`Registry::crashed`]: a body that is not
    /// an envelope fails at once with its record; an envelope of a job no
    /// handler is registered for follows the unknown-name rule (a retry,
    /// then its record at the cap). Otherwise the envelope (its payload
    /// still raw: nothing of the job's own code has run) and its job.
    #[allow(clippy::type_complexity)]
    fn route<'b>(
        &self,
        delivery: Incoming<'b>,
    ) -> Result<(EnvelopeView<'b>, &dyn ErasedJob), Box<Processed>> {
        let envelope = match EnvelopeView::decode(delivery.body) {
            Ok(envelope) => envelope,
            Err(e) => return Err(Box::new(self.malformed(delivery, e))),
        };
        match self.jobs.get(&*envelope.job) {
            Some(job) => Ok((envelope, job.as_ref())),
            None => {
                let settlement = settle_unknown_name(
                    &envelope.job,
                    delivery.attempt,
                    self.unknown_name_attempts,
                    self.unknown_name_delay,
                );
                Err(Box::new(self.finish(
                    delivery,
                    &envelope,
                    settlement,
                    RunSummary::default(),
                )))
            }
        }
    }

    /// A body that is not an envelope (or one of a newer format): a terminal
    /// failure at once, keeping whatever identity the body shows.
    fn malformed(&self, delivery: Incoming<'_>, error: EnvelopeError) -> Processed {
        let failure = Failure {
            kind: FailureKind::MalformedEnvelope,
            message: error.to_string(),
        };
        let known = Known::from_body(delivery.body);
        self.fail_early(delivery, known, None, failure)
    }

    /// The settlement of a delivery whose processing panicked outside the
    /// handler (a defect of the facade): a retry after
    /// [`PANICKED_BACKOFF_DELAY`], never at once.
    pub(crate) fn recover(&self, delivery: Incoming<'_>, panicked: &Panicked) -> Processed {
        let known = Known::from_body(delivery.body);
        let delay = Some(PANICKED_BACKOFF_DELAY);
        let mut event = self.event(
            delivery,
            None::<&Envelope>,
            0,
            EventKind::Retried {
                delay,
                error: panicked.to_string(),
                shutdown: false,
            },
        );
        event.job = known.job.unwrap_or_default();
        event.message_id = known.message_id.unwrap_or_default();
        Processed {
            event,
            settlement: Settlement::Retry {
                delay,
                shutdown: false,
            },
        }
    }

    fn fail_early(
        &self,
        delivery: Incoming<'_>,
        known: Known,
        envelope: Option<&Envelope>,
        failure: Failure,
    ) -> Processed {
        let mut record = FailureRecord::build(
            delivery.queue,
            &failure,
            delivery.attempt,
            0,
            envelope,
            delivery.body,
        );
        record.job.clone_from(&known.job);
        record.message_id.clone_from(&known.message_id);
        let mut event = self.event(
            delivery,
            envelope,
            0,
            EventKind::Failed {
                failure: failure.clone(),
            },
        );
        event.job = known.job.unwrap_or_default();
        event.message_id = known.message_id.unwrap_or_default();
        Processed {
            event,
            settlement: Settlement::Fail(Box::new(record)),
        }
    }

    fn finish(
        &self,
        delivery: Incoming<'_>,
        envelope: &impl Message,
        decision: Decision,
        run: RunSummary,
    ) -> Processed {
        let RunSummary {
            executions,
            resolution,
            error,
            shutdown,
            message_id,
        } = run;
        // Made only for the outcomes that carry it.
        let error =
            move || error.unwrap_or_else(|| format!("unknown job name `{}`", envelope.job()));
        let (kind, settlement) = match decision {
            Decision::Ack => (
                EventKind::Succeeded {
                    resolution: resolution.unwrap_or(Resolution::FirstAttempt),
                },
                Settlement::Ack,
            ),
            Decision::Retry { delay, .. } => (
                EventKind::Retried {
                    delay,
                    error: error(),
                    shutdown,
                },
                Settlement::Retry { delay, shutdown },
            ),
            Decision::Reject => (EventKind::Rejected { error: error() }, Settlement::Reject),
            Decision::Fail(failure) => {
                let record = FailureRecord::build(
                    delivery.queue,
                    &failure,
                    delivery.attempt,
                    executions,
                    Some(&envelope.owned()),
                    delivery.body,
                );
                (
                    EventKind::Failed { failure },
                    Settlement::Fail(Box::new(record)),
                )
            }
        };
        let mut event = self.event(delivery, None::<&Envelope>, executions, kind);
        event.job = envelope.job().to_string();
        event.message_id = message_id.unwrap_or_else(|| envelope.id().to_string());
        event.payload = self.include_payload.then(|| envelope.payload_value());
        Processed { event, settlement }
    }

    fn event(
        &self,
        delivery: Incoming<'_>,
        envelope: Option<&impl Message>,
        executions: u32,
        kind: EventKind,
    ) -> Event {
        Event {
            job: envelope.map(|e| e.job().to_string()).unwrap_or_default(),
            message_id: envelope.map(|e| e.id().to_string()).unwrap_or_default(),
            queue: delivery.queue.to_string(),
            attempt: delivery.attempt,
            executions,
            kind,
            payload: envelope
                .filter(|_| self.include_payload)
                .map(|e| e.payload_value()),
        }
    }

    /// The counters' entry for `job`: its own if registered, else the one
    /// shared entry [`UNREGISTERED_JOBS`] (names from message bodies must
    /// not grow the counters without bound).
    fn counted_as<'a>(&self, job: &'a str) -> &'a str {
        if self.jobs.contains_key(job) {
            job
        } else {
            UNREGISTERED_JOBS
        }
    }

    /// Reports the backend's answer to a settlement: counts it and emits the
    /// event if accepted; reports a settlement failure otherwise.
    /// [`Registry::deliver`] calls it; a host that settles by other means
    /// calls it itself.
    pub fn settled(&self, processed: &Processed, outcome: Result<(), &SettlementError>) {
        let meter = self.meter(&processed.event.job, &processed.event.queue);
        self.report(processed, outcome, &meter);
    }

    /// The metrics of a delivery of `job` from `queue`: the registered
    /// job's keys when it is registered for that queue, else keys made for
    /// the delivery (under [`UNREGISTERED_JOBS`] for a name no handler is
    /// registered for).
    pub(crate) fn meter(&self, job: &str, queue: &str) -> Meter<'_> {
        if let Some(registered) = self.jobs.get(job) {
            if registered.meter().is_for(queue) {
                return Meter::Registered(registered.as_ref());
            }
        }
        let job = self.counted_as(job);
        let mut others = self.other_meters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(meter) = others.get(queue).and_then(|by_job| by_job.get(job)) {
            return Meter::Shared(meter.clone());
        }
        let meter = Arc::new(JobMeter::new(job, queue));
        others
            .entry(queue.to_string())
            .or_default()
            .insert(job.to_string(), meter.clone());
        Meter::Shared(meter)
    }

    /// [`Registry::settled`], with the delivery's metrics looked up once.
    pub(crate) fn report(
        &self,
        processed: &Processed,
        outcome: Result<(), &SettlementError>,
        meter: &Meter<'_>,
    ) {
        let event = &processed.event;
        let counters = match meter {
            Meter::Registered(job) => job.counters(),
            Meter::Shared(_) => match self.jobs.get(&event.job) {
                Some(job) => job.counters(),
                None => &self.unregistered,
            },
        };
        meter.settled(&event.kind, &processed.settlement, outcome);
        match outcome {
            Ok(()) => {
                let count = match &event.kind {
                    EventKind::Succeeded { resolution } => match resolution {
                        Resolution::FirstAttempt => Count::FirstAttempt,
                        Resolution::TierOne { .. } => Count::TierOne,
                        Resolution::TierTwo { .. } => Count::TierTwo,
                    },
                    EventKind::Retried { .. } => Count::Retried,
                    EventKind::Rejected { .. } => Count::Rejected,
                    EventKind::Failed { .. } => Count::Failed,
                };
                counters.add(count, 1);
                if let Some(sink) = &self.sink {
                    sink.emit(event);
                }
            }
            Err(error) => {
                counters.add(Count::SettlementErrors, 1);
                if let Some(sink) = &self.sink {
                    sink.settlement_failed(event, error);
                }
            }
        }
    }
}

/// The metric keys of one delivery: its registered job's, or shared ones
/// made at the first delivery of another job and queue.
pub(crate) enum Meter<'a> {
    /// The registered job's own (its counters come with it).
    Registered(&'a dyn ErasedJob),
    Shared(Arc<JobMeter>),
}

impl std::ops::Deref for Meter<'_> {
    type Target = JobMeter;

    fn deref(&self) -> &JobMeter {
        match self {
            Meter::Registered(job) => job.meter(),
            Meter::Shared(meter) => meter,
        }
    }
}

/// An envelope as the registry reads it: owned ([`Envelope::decode`]) or
/// borrowed from the body ([`EnvelopeView`], the one-pass read of
/// [`Registry::process`]).
trait Message {
    fn job(&self) -> &str;
    fn id(&self) -> &str;
    /// The payload as a JSON value (events that include payloads).
    fn payload_value(&self) -> serde_json::Value;
    /// The owned envelope (failure records).
    fn owned(&self) -> Cow<'_, Envelope>;
}

impl Message for Envelope {
    fn job(&self) -> &str {
        &self.job
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn payload_value(&self) -> serde_json::Value {
        self.payload.clone()
    }
    fn owned(&self) -> Cow<'_, Envelope> {
        Cow::Borrowed(self)
    }
}

impl Message for EnvelopeView<'_> {
    fn job(&self) -> &str {
        &self.job
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn payload_value(&self) -> serde_json::Value {
        EnvelopeView::payload_value(self)
    }
    fn owned(&self) -> Cow<'_, Envelope> {
        Cow::Owned(self.to_envelope())
    }
}

/// What is known of a message's identity, even when its envelope did not
/// decode: events and failure records carry whatever could be read.
struct Known {
    job: Option<String>,
    message_id: Option<String>,
}

impl Known {
    fn from_envelope(envelope: &Envelope) -> Self {
        Known {
            job: Some(envelope.job.clone()),
            message_id: Some(envelope.id.clone()),
        }
    }

    /// Reads `job` and `id` from a body that is JSON but not a valid
    /// envelope (a missing field, a newer version); nothing otherwise.
    fn from_body(body: &[u8]) -> Self {
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).unwrap_or_default();
        let text = |name: &str| fields.get(name).and_then(|v| v.as_str()).map(String::from);
        Known {
            job: text("job"),
            message_id: text("id"),
        }
    }
}
