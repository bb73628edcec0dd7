//! Cloudflare Queues in a native test: run a worker's jobs and handlers
//! under the platform's delivery rules with `cargo test`, without wrangler.
//!
//! [`CloudflareQueues`] is an in-memory model of the queues a worker's
//! wrangler.toml declares. It builds each queue's consumer exactly as the
//! Worker does (the operator variables of [`Options`], the check
//! of wrangler.toml against the jobs, the settlement log) and hands it batches
//! through the same batch loop the Worker runs ([`crate::EdgeConsumer`]), so
//! a message settles here as it would under `wrangler dev`. Time is virtual:
//! nothing sleeps, and a test of a job with a 30-second backoff and a
//! 12-hour unknown-name delay finishes at once.
//!
//! ```
//! use jobrail::{Job, JobContext, JobError, Registry};
//! use jobrail_edge::testing::{CloudflareQueues, MessageState};
//!
//! const WRANGLER: &str = r#"
//! [[queues.producers]]
//! queue = "failed"
//! binding = "FAILED"
//!
//! [[queues.producers]]
//! queue = "jobs"
//! binding = "JOBS"
//!
//! [[queues.consumers]]
//! queue = "jobs"
//! max_retries = 10
//! dead_letter_queue = "jobs-dlq"
//! "#;
//!
//! fn job() -> Job<u32> {
//!     Job::<u32>::builder("double").queue("jobs").max_deliveries(3).build().unwrap()
//! }
//!
//! fn jobs() -> Result<Registry, jobrail::RegistryError> {
//!     let mut registry = Registry::new();
//!     registry.register(&job(), |_ctx: JobContext, n: u32| async move {
//!         if n == 0 { Err(JobError::permanent("zero")) } else { Ok(()) }
//!     })?;
//!     Ok(registry)
//! }
//!
//! let options = jobrail_edge::Options {
//!     failure_queue: Some("FAILED"),
//!     ..jobrail_edge::Options::DEFAULT
//! };
//! let mut cf = CloudflareQueues::new(WRANGLER, jobs, options).unwrap();
//! let good = cf.send(&job(), &21);
//! let bad = cf.send(&job(), &0);
//! cf.run_until_idle();
//!
//! assert_eq!(cf.state(&good), &MessageState::Acked);
//! assert_eq!(cf.message(&bad).attempts(), [1]);
//! let record = cf.message(&bad).failure_record().unwrap();
//! assert_eq!(record.kind, jobrail::FailureKind::Permanent);
//! assert_eq!(cf.failure_records().len(), 1);
//! ```
//!
//! # The model
//!
//! Facts about the platform come from Cloudflare's Queues documentation
//! ("Configure Queues", "Batching, Retries and Delays", "Dead Letter Queues",
//! "JavaScript APIs").
//!
//! - **Queues and consumers.** The queues the worker consumes with its jobs
//!   (those the jobs name, and those of [`Options::queue_concurrency`]) are
//!   consumed with the settings of their `[[queues.consumers]]` entry:
//!   `max_batch_size` (default 10), `max_batch_timeout` (default 5 s),
//!   `max_retries` (default 3), `retry_delay` (default none) and
//!   `dead_letter_queue` ([`crate::wrangler::ConsumerSettings`]). Any other
//!   queue (a dead-letter queue, the failure queue, a queue the Worker hands
//!   to its `other_queues` hook) is not consumed: its messages stay there,
//!   readable with [`CloudflareQueues::queued`].
//! - **Messages.** A message has an id, a body and a delivery count
//!   (`attempts`, 1 on the first delivery). It becomes visible after its send
//!   delay, or its retry delay.
//! - **Batches.** A batch holds up to `max_batch_size` visible messages of one
//!   queue, in the order they became visible. The platform delivers it as soon
//!   as it is full, or `max_batch_timeout` after the batch's window opened:
//!   when its first message became visible, or when the queue's previous
//!   batch went out if that was later. Messages sent
//!   together are delivered together; a redelivered message joins whatever is
//!   visible when its batch goes out. One invocation runs at a time.
//! - **Settling.** Within an invocation a message's first explicit call wins
//!   (later ones are ignored, as on the platform). When the invocation
//!   returns, `ack()` removes the message; `retry(delaySeconds)` makes it
//!   visible again after the delay (none given: the consumer's `retry_delay`)
//!   with one more attempt; a message with no call is acknowledged, because
//!   the invocation returned normally (that is how a rejection ends).
//! - **Giving up.** A message retried on its delivery `max_retries + 1` is
//!   moved to the consumer's dead-letter queue (a new message there, with
//!   the same body), or deleted when the consumer has none
//!   ([`MessageState::DeadLettered`], [`MessageState::Dropped`]).
//! - **Sending.** A failure record sent through a producer binding
//!   (`[[queues.producers]]`, resolved binding to queue) is appended to that
//!   queue. [`CloudflareQueues::fail_sends`] makes sends through a binding fail,
//!   to test that a failed failure-queue send keeps the message.
//! - **Delays beyond 24 hours.** A send delayed beyond
//!   [`MAX_DELAY`](crate::MAX_DELAY) carries its due time in the envelope and
//!   becomes visible after 24 hours, as `EdgeProducer` sends it; the
//!   consumer sends each delivery before the due time on to its queue
//!   through the queue's producer binding, delayed by the next leg
//!   ([`MessageState::SentOn`]: a new message, the same body, visible after
//!   that delay), without running. [`CloudflareQueues::legs`] lists the
//!   messages one delay took. The consumer's wall clock (what it compares
//!   due times with) is virtual too: [`CloudflareQueues::unix_now_ms`].
//! - **Cron Triggers.** [`CloudflareQueues::trigger`] delivers a Cron
//!   Trigger as the Worker's `scheduled` handler receives it: the
//!   schedules of [`Options::schedules`] it fires send their due ticks'
//!   jobs through the producer bindings of their queues, each tick claimed
//!   once in [`CloudflareQueues::claims`] (D1 at the edge; here in memory,
//!   on the virtual clock). The platform fires nothing by itself: a test
//!   calls `trigger` for each minute it wants, and leaves one out to model
//!   a trigger the platform dropped.
//!
//! # Time
//!
//! The clock is a [`jobrail::VirtualRuntime`]; the consumer and the handlers
//! get a runtime on it. Sleeps on that runtime (backoff, tier one's waits,
//! [`jobrail::JobContext::sleep`]) complete when the clock reaches their end,
//! and the clock jumps to the next one whenever nothing else can run, just as
//! [`CloudflareQueues::run_batch`] jumps it to the next batch. Work that does
//! not sleep takes no virtual time, so the invocation budget
//! (`EDGE_BUDGET_MS`) runs out only through sleeps. A handler that awaits
//! something else (real I/O) is waited for in real time, at most
//! [`EXTERNAL_WAIT_LIMIT`] at a stretch.
//!
//! # The Worker's configuration
//!
//! `[vars]` of the given wrangler.toml are the operator variables
//! (listed on [`Options`]), and [`CloudflareQueues::var`] overrides
//! one, as `wrangler dev --var` would. The check of wrangler.toml against the
//! jobs runs with them, as in the Worker, and a configuration the Worker
//! would refuse is refused by [`CloudflareQueues::new`] and
//! [`CloudflareQueues::var`], naming the job and the field.
//!
//! # What the model leaves out
//!
//! - **Panics.** Natively a handler's panic is caught inside the pipeline and
//!   is an ordinary error, which tier one may retry within the delivery. At
//!   the edge (wasm32) a panic aborts the instance: that message's execution
//!   ends there, tier one does not retry it, and the Worker settles it by the
//!   job's retry policy as one failed execution
//!   ([`jobrail::Registry::crashed`]) while its batch-mates carry on. So for a
//!   job without tier one (`tier_one(1)`, the default) the settlements here
//!   and at the edge are identical; with tier one a panicking message may use
//!   more executions here (and may succeed in-process where the edge retries
//!   it through the platform). At the edge, with a consumer `concurrency`
//!   above 1, the batch-mates that were running when the instance aborted
//!   start again from the beginning: one more (partial) execution each.
//! - **Concurrency of invocations.** One invocation at a time; the
//!   platform's `max_concurrency` and parallel invocations of one queue are
//!   not modelled (the consumer's own `concurrency` within an invocation is).
//! - **Duplicates.** The platform delivers at least once; the harness never
//!   redelivers a message that was acknowledged.
//! - **Limits.** Message and batch sizes, retention (a message left on a
//!   queue stays forever), the platform's wall-clock and CPU limits, and a
//!   producer's `delivery_delay` are not modelled. One message's delay is
//!   limited to [`MAX_DELAY`](crate::MAX_DELAY); a longer dispatch delay
//!   takes several (above).
//! - **Hooks.** The `consumer!` macro's `other_queues` and `after_batch`
//!   hooks take JavaScript values and are not run.
//! - **Order.** The platform's order within a batch is best effort; the
//!   harness's is fixed, so a test that passes may rely on an order the
//!   platform does not promise.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jobrail::testing::TestRuntime;
use jobrail::{Clock, Envelope, EventKind, FailureRecord, Job, Registry};
use serde::{Deserialize, Serialize};

use crate::batch::{EdgeConsumer, Wall};
use crate::error::{EdgeError, EdgeErrorKind};
use crate::options::{build_consumer, Options, VARIABLES};
use crate::wrangler::{ConsumerSettings, Wrangler};

/// How many invocations [`CloudflareQueues::run_until_idle`] runs before it
/// decides the queues will never be idle, unless
/// [`CloudflareQueues::max_invocations`] says otherwise.
pub const DEFAULT_MAX_INVOCATIONS: usize = 10_000;

/// The longest a batch may wait, in real time, for something other than the
/// virtual clock (a handler awaiting real I/O) before the harness panics:
/// the limit of [`TestRuntime`], which drives every batch.
pub use jobrail::testing::EXTERNAL_WAIT_LIMIT;

mod platform;
mod report;

use self::platform::{HarnessBindings, HarnessMessage, Recorder, Shared, Tracker};
pub use self::report::{
    BatchRun, Call, DeliveryReport, EventRecord, MessageReport, MessageState, Queued,
};

/// The queues of one worker, in memory, on a virtual clock. See the
/// [module documentation](self).
pub struct CloudflareQueues {
    jobs: Box<dyn Fn() -> Result<Registry, String>>,
    options: Options,
    wrangler: Wrangler,
    vars: BTreeMap<String, String>,
    runtime: TestRuntime,
    /// The consumed queues: consumer and settings.
    consumers: BTreeMap<String, (EdgeConsumer, ConsumerSettings)>,
    queues: BTreeMap<String, Vec<Queued>>,
    last_batch: BTreeMap<String, Duration>,
    reports: Vec<MessageReport>,
    by_id: HashMap<String, usize>,
    events: Vec<EventRecord>,
    batches: Vec<BatchRun>,
    shared: Arc<Mutex<Shared>>,
    max_invocations: usize,
    /// The wall clock when the harness was created (Unix milliseconds).
    epoch_ms: u64,
    /// The claims the schedules' ticks are claimed in (D1 at the edge).
    claims: jobrail::MemoryClaims,
}

impl fmt::Debug for CloudflareQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudflareQueues")
            .field("now", &self.now())
            .field("consumed", &self.consumers.keys().collect::<Vec<_>>())
            .field(
                "waiting",
                &self
                    .queues
                    .iter()
                    .map(|(queue, waiting)| (queue, waiting.len()))
                    .collect::<BTreeMap<_, _>>(),
            )
            .field("batches", &self.batches.len())
            .finish_non_exhaustive()
    }
}

impl CloudflareQueues {
    /// The queues of a worker whose wrangler.toml is `wrangler_toml`, whose
    /// jobs `jobs` builds (called for each consumer, as the Worker does), and
    /// whose options are `options` (its `wrangler` field is replaced by
    /// `wrangler_toml`).
    ///
    /// Refuses what the Worker would refuse: a wrangler.toml that does not
    /// parse or does not fit the jobs (every problem named with its job and
    /// field), an operator variable in `[vars]` that is not a number, or jobs
    /// that do not build.
    pub fn new<F, E>(wrangler_toml: &str, jobs: F, options: Options) -> Result<Self, String>
    where
        F: Fn() -> Result<Registry, E> + 'static,
        E: fmt::Display,
    {
        let wrangler = Wrangler::parse(wrangler_toml).map_err(|e| e.to_string())?;
        let vars = vars_of(wrangler_toml)?;
        // `Options` holds the text for the life of the program (the macro
        // embeds it); a test's copy is kept as long.
        let text: &'static str = Box::leak(wrangler_toml.to_owned().into_boxed_str());
        let mut harness = CloudflareQueues {
            jobs: Box::new(move || jobs().map_err(|e| format!("the jobs do not build: {e}"))),
            options: Options {
                wrangler: text,
                ..options
            },
            wrangler,
            vars,
            runtime: TestRuntime::new(),
            consumers: BTreeMap::new(),
            queues: BTreeMap::new(),
            last_batch: BTreeMap::new(),
            reports: Vec::new(),
            by_id: HashMap::new(),
            events: Vec::new(),
            batches: Vec::new(),
            shared: Arc::default(),
            max_invocations: DEFAULT_MAX_INVOCATIONS,
            epoch_ms: jobrail::unix_now_ms(),
            claims: jobrail::MemoryClaims::new(),
        };
        harness.claims =
            jobrail::MemoryClaims::with_clock(Arc::new(harness.runtime.clock().clone()));
        harness.consumers = harness.build_consumers()?;
        Ok(harness)
    }

    /// Sets the operator variable `name` (listed on [`Options`], such as
    /// `EDGE_BUDGET_MS`) to `value`, overriding `[vars]`, and rebuilds the
    /// consumers with it (their registries and counters start afresh, as
    /// after a redeploy).
    /// Refuses an unknown name, a value the Worker would not read, and a
    /// value with which wrangler.toml no longer fits the jobs; the previous
    /// value is kept then.
    pub fn var(&mut self, name: &str, value: &str) -> Result<&mut Self, String> {
        if !VARIABLES.contains(&name) {
            return Err(format!(
                "`{name}` is not an operator variable of the consumer (one of {})",
                VARIABLES.join(", ")
            ));
        }
        let previous = self.vars.insert(name.to_string(), value.to_string());
        match self.build_consumers() {
            Ok(consumers) => {
                self.consumers = consumers;
                Ok(self)
            }
            Err(e) => {
                match previous {
                    Some(previous) => self.vars.insert(name.to_string(), previous),
                    None => self.vars.remove(name),
                };
                Err(e)
            }
        }
    }

    /// Caps the invocations one [`run_until_idle`](Self::run_until_idle)
    /// may run (default [`DEFAULT_MAX_INVOCATIONS`]).
    pub fn max_invocations(&mut self, invocations: usize) -> &mut Self {
        self.max_invocations = invocations;
        self
    }

    /// Makes the next `times` sends through the producer binding `binding`
    /// fail (an error whose outcome is uncertain, as a failed `send()` is).
    pub fn fail_sends(&mut self, binding: &str, times: usize) -> &mut Self {
        lock(&self.shared)
            .send_failures
            .insert(binding.to_string(), times);
        self
    }

    /// Sends `payload` for `job` to the job's queue, as the Worker's
    /// `EdgeProducer::dispatch` does (a fresh [`Envelope`] as JSON text),
    /// visible at once. Returns the message id (the envelope's id).
    ///
    /// # Panics
    ///
    /// If `payload` does not serialize, or its message is above the
    /// platform's size limit ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES); see
    /// [`try_send`](Self::try_send)).
    pub fn send<P: Serialize>(&mut self, job: &Job<P>, payload: &P) -> String {
        self.send_with_delay(job, payload, Duration::ZERO)
    }

    /// Sends like [`send`](Self::send), due only after `delay` (rounded up
    /// to whole seconds, as the platform takes `delaySeconds`), as
    /// `EdgeProducer`'s `Dispatch::delay` sends it: of any length, a delay
    /// beyond [`MAX_DELAY`](crate::MAX_DELAY) carried in steps (see the
    /// [module documentation](self)).
    ///
    /// # Panics
    ///
    /// If `payload` does not serialize, or its message is above the
    /// platform's size limit ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES)).
    pub fn send_with_delay<P: Serialize>(
        &mut self,
        job: &Job<P>,
        payload: &P,
        delay: Duration,
    ) -> String {
        self.send_envelope(job.queue(), job, payload, delay)
    }

    /// Sends like [`send`](Self::send), to `queue` instead of the job's own
    /// queue (a second queue the worker consumes with the same jobs, such as
    /// one listed in `Options::queue_concurrency`).
    ///
    /// # Panics
    ///
    /// If `payload` does not serialize, or its message is above the
    /// platform's size limit ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES); see
    /// [`try_send`](Self::try_send)).
    pub fn send_to<P: Serialize>(&mut self, queue: &str, job: &Job<P>, payload: &P) -> String {
        self.send_envelope(queue, job, payload, Duration::ZERO)
    }

    /// Sends like [`send`](Self::send), but returns the error
    /// `EdgeProducer::dispatch` returns instead of panicking: a message above
    /// the platform's limit ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES)) is refused
    /// and nothing is queued.
    pub fn try_send<P: Serialize>(
        &mut self,
        job: &Job<P>,
        payload: &P,
    ) -> Result<String, EdgeError> {
        self.try_send_envelope(job.queue(), job, payload, Duration::ZERO)
    }

    fn send_envelope<P: Serialize>(
        &mut self,
        queue: &str,
        job: &Job<P>,
        payload: &P,
        delay: Duration,
    ) -> String {
        self.try_send_envelope(queue, job, payload, delay)
            .unwrap_or_else(|e| panic!("sending job `{}`: {e}", job.name()))
    }

    fn try_send_envelope<P: Serialize>(
        &mut self,
        queue: &str,
        job: &Job<P>,
        payload: &P,
        delay: Duration,
    ) -> Result<String, EdgeError> {
        let payload = serde_json::to_value(payload).map_err(|e| {
            let context = format!("the payload for job `{}` does not serialize", job.name());
            EdgeError::caused_by(EdgeErrorKind::Encode, Some(&context), e)
        })?;
        let envelope = Envelope::new(job.name(), payload);
        let (text, seconds) = crate::limits::prepare_send(
            crate::limits::envelope_text(&envelope)?,
            Some(delay),
            jobrail::UNIX_EPOCH + Duration::from_millis(self.unix_now_ms()),
        )?;
        let id = envelope.id.clone();
        let visible_at = self.now() + Duration::from_secs(u64::from(seconds.unwrap_or(0)));
        self.enqueue(queue, id.clone(), text.into_bytes(), visible_at);
        Ok(id)
    }

    /// Sends `body` as is to `queue` (a malformed body, an envelope of a job
    /// this worker does not know, or any queue of the model), visible at
    /// once. Returns the new message's id.
    pub fn send_raw(&mut self, queue: &str, body: impl Into<Vec<u8>>) -> String {
        let id = jobrail::new_message_id();
        let now = self.now();
        self.enqueue(queue, id.clone(), body.into(), now);
        id
    }

    /// The consumer's wall clock, in milliseconds since the Unix epoch: the
    /// real time when the harness was created plus [`now`](Self::now). Due
    /// times ([`jobrail::Envelope::due_ms`]) are compared with it.
    pub fn unix_now_ms(&self) -> u64 {
        let elapsed = u64::try_from(self.now().as_millis()).unwrap_or(u64::MAX);
        self.epoch_ms.saturating_add(elapsed)
    }

    /// Moves the virtual clock forward to the wall-clock time `unix_ms`
    /// ([`unix_now_ms`](Self::unix_now_ms)), if that is later, without
    /// delivering anything.
    pub fn advance_to(&mut self, unix_ms: u64) {
        let now = self.unix_now_ms();
        if unix_ms > now {
            self.advance(Duration::from_millis(unix_ms - now));
        }
    }

    /// The claim store the schedules' ticks are claimed in (the Worker's
    /// D1 database, `Options::schedule_claims`), on the virtual clock.
    pub fn claims(&self) -> &jobrail::MemoryClaims {
        &self.claims
    }

    /// Delivers the Cron Trigger `cron` now ([`unix_now_ms`](Self::unix_now_ms)),
    /// as the Worker's `scheduled` handler runs it: the schedules of
    /// [`Options::schedules`] it fires ([`EdgeScheduler::fire`](crate::EdgeScheduler::fire))
    /// send their ticks' jobs through the producer bindings of their
    /// queues (visible at once; [`fail_sends`](Self::fail_sends) applies),
    /// each tick claimed once in [`claims`](Self::claims). Run the jobs
    /// with [`run_until_idle`](Self::run_until_idle).
    ///
    /// # Panics
    ///
    /// If the options declare no schedules, or they do not build or the
    /// edge cannot fire them.
    pub fn trigger(&mut self, cron: &str) -> Vec<crate::ScheduleFired> {
        let at = jobrail::UNIX_EPOCH + Duration::from_millis(self.unix_now_ms());
        self.trigger_at(cron, at)
    }

    /// [`trigger`](Self::trigger), with the trigger's scheduled time
    /// `scheduled` (the clock does not move).
    pub fn trigger_at(
        &mut self,
        cron: &str,
        scheduled: jobrail::SystemTime,
    ) -> Vec<crate::ScheduleFired> {
        let schedules = self
            .options
            .schedules
            .expect("no schedules declared (Options::schedules)");
        let schedules = schedules().unwrap_or_else(|e| panic!("the schedules do not build: {e}"));
        let mut scheduler = crate::EdgeScheduler::new(schedules, self.wrangler.crons())
            .unwrap_or_else(|e| panic!("{e}"));
        scheduler.wall = Wall::Virtual {
            epoch_ms: self.epoch_ms,
            clock: self.runtime.clock().clone(),
        };
        let sent = std::cell::RefCell::new(Vec::new());
        let (wrangler, shared) = (&self.wrangler, &self.shared);
        let send = |dispatch: jobrail::TickDispatch| {
            let result = (|| {
                let binding = wrangler.binding_to(&dispatch.queue).ok_or_else(|| {
                    EdgeError::new(
                        EdgeErrorKind::Config,
                        format!("no producer binding to `{}`", dispatch.queue),
                    )
                })?;
                let envelope = dispatch.envelope();
                let text = crate::limits::envelope_text(&envelope)?;
                let mut shared = lock(shared);
                if let Some(left) = shared.send_failures.get_mut(binding).filter(|n| **n > 0) {
                    *left -= 1;
                    return Err(EdgeError::uncertain(
                        &format!("queue `{binding}`"),
                        "the send failed (CloudflareQueues::fail_sends)",
                    ));
                }
                sent.borrow_mut()
                    .push((dispatch.queue.clone(), envelope.id.clone(), text));
                Ok(envelope.id)
            })();
            std::future::ready(result)
        };
        let fired =
            self.runtime
                .run(scheduler.fire(cron, scheduled, &self.claims, &self.runtime, send));
        let now = self.now();
        for (queue, id, text) in sent.into_inner() {
            self.enqueue(&queue, id, text.into_bytes(), now);
        }
        fired
    }

    /// Moves the virtual clock forward by `by` without delivering anything.
    pub fn advance(&mut self, by: Duration) {
        self.runtime.clock().advance(by);
    }

    /// Runs one invocation: the next batch the platform would deliver (moving
    /// the clock to its delivery), through the Worker's batch loop, then the
    /// platform's handling of each message's call. `None` when no consumed
    /// queue holds a message.
    pub fn run_batch(&mut self) -> Option<BatchRun> {
        let (queue, at) = self.next_batch()?;
        let now = self.now();
        if at > now {
            self.runtime.clock().advance(at - now);
        }
        let started = self.now();
        self.last_batch.insert(queue.clone(), started);
        let (consumer, settings) = &self.consumers[&queue];
        let batch = take_batch(
            self.queues.entry(queue.clone()).or_default(),
            started,
            settings.max_batch_size,
        );

        let index = self.batches.len();
        let mut messages = Vec::with_capacity(batch.len());
        let mut calls = Vec::with_capacity(batch.len());
        for queued in &batch {
            let call = Arc::new(Mutex::new(None));
            calls.push(call.clone());
            messages.push(HarnessMessage {
                id: queued.id.clone(),
                attempts: queued.attempts,
                body: queued.body.clone(),
                call,
                clock: self.runtime.clock().clone(),
            });
            if let Some(&i) = self.by_id.get(&queued.id) {
                self.reports[i].deliveries.push(DeliveryReport {
                    attempt: queued.attempts,
                    batch: index,
                    delivered_at: started,
                    events: Vec::new(),
                    call: None,
                    called_at: None,
                });
            }
        }

        let bindings = HarnessBindings {
            shared: self.shared.clone(),
            wrangler: &self.wrangler,
            clock: self.runtime.clock().clone(),
        };
        let tracker = Tracker(self.shared.clone());
        let summary = self.runtime.run(consumer.consume_observed(
            &queue,
            messages,
            &bindings,
            self.runtime.now(),
            None,
            &tracker,
        ));
        let settings = settings.clone();
        let finished = self.now();

        let (observed, outbox) = {
            let mut shared = lock(&self.shared);
            shared.current = None;
            (
                std::mem::take(&mut shared.observed),
                std::mem::take(&mut shared.outbox),
            )
        };
        for record in observed {
            if let Some(delivery) = self
                .by_id
                .get(&record.message)
                .and_then(|&i| self.reports[i].deliveries.last_mut())
            {
                delivery.events.push(record.clone());
            }
            self.events.push(record);
        }
        let mut records = HashMap::new();
        let mut copies = HashMap::new();
        for sent in outbox {
            let id = jobrail::new_message_id();
            match (&sent.message, sent.delay) {
                (Some(message), Some(_)) => {
                    copies.insert(message.clone(), id.clone());
                }
                (Some(message), None) => {
                    if let Ok(record) = FailureRecord::decode(&sent.body) {
                        records.insert(message.clone(), record);
                    }
                }
                (None, _) => {}
            }
            let visible_at = sent.at + sent.delay.unwrap_or_default();
            self.enqueue(&sent.queue, id, sent.body, visible_at);
        }

        let ids: Vec<String> = batch.iter().map(|m| m.id.clone()).collect();
        for (queued, call) in batch.into_iter().zip(calls) {
            let call = lock(&call).take();
            let copy = copies.remove(&queued.id);
            self.settle(
                &queue,
                &settings,
                queued,
                call,
                &mut records,
                copy,
                finished,
            );
        }

        let run = BatchRun {
            index,
            queue,
            started,
            finished,
            messages: ids,
            summary,
        };
        self.batches.push(run.clone());
        Some(run)
    }

    /// Runs invocations until no consumed queue holds a message, moving the
    /// clock to each batch; returns how many ran.
    ///
    /// # Panics
    ///
    /// If the queues are still not idle after
    /// [`max_invocations`](Self::max_invocations) invocations.
    pub fn run_until_idle(&mut self) -> usize {
        let mut invocations = 0;
        loop {
            if invocations >= self.max_invocations && self.next_batch().is_some() {
                panic!(
                    "the queues are not idle after {invocations} invocations (raise the limit with max_invocations if that is expected): {self:?}"
                );
            }
            match self.run_batch() {
                Some(_) => invocations += 1,
                None => return invocations,
            }
        }
    }

    /// Time on the virtual clock since the harness was created.
    pub fn now(&self) -> Duration {
        self.runtime.elapsed()
    }

    /// The life of message `id` so far.
    ///
    /// # Panics
    ///
    /// If no message has that id.
    pub fn message(&self, id: &str) -> &MessageReport {
        self.find(id)
            .unwrap_or_else(|| panic!("no message with id `{id}`"))
    }

    /// The messages one dispatch took: message `id`, then each copy it was
    /// sent on as ([`MessageState::SentOn`]), in order. One for a message
    /// due when delivered; `ceil(delay / 24 h)` for a dispatch delay beyond
    /// 24 hours, the last the one whose delivery ran.
    ///
    /// # Panics
    ///
    /// If no message has that id.
    pub fn legs(&self, id: &str) -> Vec<&MessageReport> {
        let mut legs = vec![self.message(id)];
        while let Some(MessageState::SentOn { copy }) = legs.last().map(|m| &m.state) {
            match self.find(copy) {
                Some(next) => legs.push(next),
                None => break,
            }
        }
        legs
    }

    /// The life of message `id`, if there is one.
    pub fn find(&self, id: &str) -> Option<&MessageReport> {
        self.by_id.get(id).map(|&i| &self.reports[i])
    }

    /// Where message `id` stands.
    ///
    /// # Panics
    ///
    /// If no message has that id.
    pub fn state(&self, id: &str) -> &MessageState {
        &self.message(id).state
    }

    /// Every message, in the order they were sent (failure records and
    /// dead-letter copies included).
    pub fn messages(&self) -> &[MessageReport] {
        &self.reports
    }

    /// Every event the consumers reported, in order.
    pub fn events(&self) -> &[EventRecord] {
        &self.events
    }

    /// Every invocation so far.
    pub fn batches(&self) -> &[BatchRun] {
        &self.batches
    }

    /// The messages waiting on `queue` (on a queue the harness does not
    /// consume, everything ever sent there).
    pub fn queued(&self, queue: &str) -> &[Queued] {
        self.queues.get(queue).map_or(&[], Vec::as_slice)
    }

    /// The failure records on the failure queue (the queue of the options'
    /// `failure_queue` binding), in the order they were sent; empty when the
    /// worker has none.
    pub fn failure_records(&self) -> Vec<FailureRecord> {
        self.options
            .failure_queue
            .and_then(|binding| self.wrangler.producer_binding(binding))
            .map(|queue| {
                self.queued(queue)
                    .iter()
                    .filter_map(|m| FailureRecord::decode(&m.body).ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The messages waiting on the dead-letter queue of `queue`'s consumer
    /// (empty when it has none).
    pub fn dead_letter(&self, queue: &str) -> &[Queued] {
        self.wrangler
            .consumer(queue)
            .and_then(|c| c.dead_letter_queue.as_deref())
            .map_or(&[], |dlq| self.queued(dlq))
    }

    /// The consumer of `queue`, as the Worker would hold it (for its
    /// registry's counters and its settings); `None` for a queue the harness
    /// does not consume.
    pub fn consumer(&self, queue: &str) -> Option<&EdgeConsumer> {
        self.consumers.get(queue).map(|(consumer, _)| consumer)
    }

    /// The consumer of every queue the worker consumes with its jobs (the
    /// queues the jobs name and those of `Options::queue_concurrency`),
    /// built as the Worker builds it, with the events recorded for the
    /// harness.
    fn build_consumers(
        &self,
    ) -> Result<BTreeMap<String, (EdgeConsumer, ConsumerSettings)>, String> {
        let var = |name: &str| self.vars.get(name).cloned();
        let probe = (self.jobs)()?;
        let mut queues = probe.queues();
        for (queue, _) in self.options.queue_concurrency {
            if !queues.iter().any(|q| q == queue) {
                queues.push(queue.to_string());
            }
        }
        if queues.is_empty() {
            // No consumer to build: the check still runs.
            crate::options::check(&probe, &self.options, None)?;
        }
        let mut probe = Some(probe);
        let mut consumers = BTreeMap::new();
        for queue in queues {
            let mut registry = match probe.take() {
                Some(registry) => registry,
                None => (self.jobs)()?,
            };
            let inner = registry.current_event_sink();
            registry.event_sink(Arc::new(Recorder {
                inner,
                shared: self.shared.clone(),
                clock: self.runtime.clock().clone(),
            }));
            // The harness's bindings are the producers its wrangler.toml declares.
            let bound = |binding: &str| self.wrangler.producer_binding(binding).is_some();
            let mut consumer = build_consumer(
                &queue,
                registry,
                &self.options,
                &var,
                &bound,
                Arc::new(self.runtime.clone()),
            )?;
            consumer.wall = Wall::Virtual {
                epoch_ms: self.epoch_ms,
                clock: self.runtime.clock().clone(),
            };
            let settings = self.wrangler.consumer(&queue).cloned().ok_or_else(|| {
                format!("wrangler.toml has no [[queues.consumers]] entry for `{queue}`")
            })?;
            consumers.insert(queue, (consumer, settings));
        }
        Ok(consumers)
    }

    fn enqueue(&mut self, queue: &str, id: String, body: Vec<u8>, visible_at: Duration) {
        let sent_at = self.now().min(visible_at);
        self.by_id.insert(id.clone(), self.reports.len());
        self.reports.push(MessageReport {
            id: id.clone(),
            queue: queue.to_string(),
            body: body.clone(),
            sent_at,
            deliveries: Vec::new(),
            state: MessageState::Pending,
        });
        self.queues
            .entry(queue.to_string())
            .or_default()
            .push(Queued {
                id,
                body,
                attempts: 0,
                visible_at,
            });
    }

    /// The platform's handling of one message once the invocation
    /// returned; `copy` is the copy a step sent it on as.
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &mut self,
        queue: &str,
        settings: &ConsumerSettings,
        mut queued: Queued,
        call: Option<(Call, Duration)>,
        records: &mut HashMap<String, FailureRecord>,
        copy: Option<String>,
        now: Duration,
    ) {
        let Some(&index) = self.by_id.get(&queued.id) else {
            return;
        };
        let (outcome, call_kind) = {
            let delivery = self.reports[index]
                .deliveries
                .last_mut()
                .expect("a delivered message has a delivery");
            delivery.call = call.map(|(c, _)| c);
            delivery.called_at = call.map(|(_, at)| at);
            (delivery.outcome().map(|e| e.kind.clone()), delivery.call)
        };
        let state = match call_kind {
            Some(Call::Ack) if outcome.is_none() && copy.is_some() => MessageState::SentOn {
                copy: copy.unwrap_or_default(),
            },
            Some(Call::Ack) => match outcome {
                Some(EventKind::Failed { failure }) => MessageState::Failed {
                    failure,
                    record: records.remove(&queued.id).map(Box::new),
                },
                _ => MessageState::Acked,
            },
            None => match outcome {
                Some(EventKind::Rejected { .. }) => MessageState::Rejected,
                _ => MessageState::Acked,
            },
            Some(Call::Retry { .. }) if queued.attempts >= settings.deliveries() => {
                match &settings.dead_letter_queue {
                    Some(dlq) => {
                        let id = jobrail::new_message_id();
                        self.enqueue(dlq, id.clone(), queued.body, now);
                        MessageState::DeadLettered {
                            queue: dlq.clone(),
                            id,
                        }
                    }
                    None => MessageState::Dropped,
                }
            }
            Some(Call::Retry { delay_seconds }) => {
                let delay = delay_seconds
                    .map_or(settings.retry_delay, |s| Duration::from_secs(u64::from(s)));
                queued.visible_at = now + delay;
                self.queues
                    .entry(queue.to_string())
                    .or_default()
                    .push(queued);
                MessageState::Pending
            }
        };
        self.reports[index].state = state;
    }

    /// The queue whose batch the platform delivers next, and when.
    fn next_batch(&self) -> Option<(String, Duration)> {
        let now = self.now();
        let mut next: Option<(Duration, &String)> = None;
        for (queue, (_, settings)) in &self.consumers {
            let mut times: Vec<Duration> =
                self.queued(queue).iter().map(|m| m.visible_at).collect();
            if times.is_empty() {
                continue;
            }
            times.sort();
            // The batch window opens with its first visible message, and no
            // earlier than the queue's previous batch.
            let opens = times[0].max(self.last_batch.get(queue).copied().unwrap_or_default());
            let mut at = opens.saturating_add(settings.max_batch_timeout);
            if let Some(&full) = times.get(settings.max_batch_size.max(1) as usize - 1) {
                at = at.min(full.max(opens));
            }
            let at = at.max(now);
            if next.is_none_or(|(best, _)| at < best) {
                next = Some((at, queue));
            }
        }
        next.map(|(at, queue)| (queue.clone(), at))
    }
}

/// Takes the batch out of `waiting`: up to `size` messages visible at `now`,
/// in the order they became visible (then the order they were queued).
fn take_batch(waiting: &mut Vec<Queued>, now: Duration, size: u32) -> Vec<Queued> {
    let mut order: Vec<usize> = (0..waiting.len())
        .filter(|&i| waiting[i].visible_at <= now)
        .collect();
    order.sort_by_key(|&i| (waiting[i].visible_at, i));
    order.truncate(size.max(1) as usize);
    let mut slots: Vec<Option<Queued>> = waiting.drain(..).map(Some).collect();
    let batch = order
        .iter()
        .filter_map(|&i| slots[i].take())
        .map(|mut m| {
            m.attempts += 1;
            m
        })
        .collect();
    waiting.extend(slots.into_iter().flatten());
    batch
}

/// The `[vars]` of a wrangler.toml, as the Worker's `env.var` reads them.
fn vars_of(text: &str) -> Result<BTreeMap<String, String>, String> {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct File {
        vars: BTreeMap<String, toml::Value>,
    }
    let file: File = toml::from_str(text).map_err(|e| format!("wrangler.toml: {e}"))?;
    Ok(file
        .vars
        .into_iter()
        .filter_map(|(name, value)| {
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Float(x) => x.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                _ => return None,
            };
            Some((name, text))
        })
        .collect())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_window_closes_when_full_or_at_the_timeout() {
        let queued = |visible: u64| Queued {
            id: visible.to_string(),
            body: Vec::new(),
            attempts: 0,
            visible_at: Duration::from_secs(visible),
        };
        let mut waiting = vec![queued(5), queued(0), queued(9), queued(0)];
        let batch = take_batch(&mut waiting, Duration::from_secs(5), 2);
        let ids: Vec<&str> = batch.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(
            ids,
            ["0", "0"],
            "the earliest visible first, at most the size"
        );
        assert!(batch.iter().all(|m| m.attempts == 1));
        let left: Vec<&str> = waiting.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(left, ["5", "9"]);
    }
}
