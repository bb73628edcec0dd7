//! What the scenarios need from a backend, and helpers they share.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{Event, EventSink, FailureRecord, Registry};
use jobrail_native::{
    Consumer, ConsumerHandle, Driver, DriverError, ErrorKind, Failures, Outgoing, Producer,
    QueueDepth,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::scenarios::Work;

/// A backend under test.
#[async_trait]
pub trait Backend: Send + Sync {
    /// A driver connected to the backend. Each call may open a new
    /// connection; all of them see the same queues.
    async fn connect(&self) -> Arc<dyn Driver>;

    /// Failure records transferred for messages consumed from `queue`,
    /// oldest first, read without consuming them. The default reads them
    /// through the driver's failure store ([`Failures::all`]), leaving out
    /// entries that are not records.
    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        Failures::new(self.connect().await)
            .all(queue)
            .await
            .unwrap_or_else(|e| panic!("failure records of `{queue}` unreadable: {e}"))
            .into_iter()
            .filter_map(|entry| entry.record)
            .collect()
    }

    /// Puts `body` among `queue`'s failure entries as it is, bypassing the
    /// consumer (something that is not a failure record, say), where the
    /// backend offers it ([`Hooks::inject_failure_body`]). The default
    /// refuses as unsupported.
    async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let _ = (queue, body);
        Err(DriverError::new(
            "conformance",
            ErrorKind::Unsupported,
            "this backend puts nothing among the failures by hand",
        ))
    }

    /// Puts `body` on the work queue `queue` as it is, through the
    /// backend's own client, bypassing the facade (its size limit
    /// included), where the backend offers it ([`Hooks::inject_body`]). The
    /// default refuses as unsupported.
    async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let _ = (queue, body);
        Err(DriverError::new(
            "conformance",
            ErrorKind::Unsupported,
            "this backend takes no body by hand",
        ))
    }

    /// How long a scenario may wait for something that should happen
    /// promptly (backends with coarse timers need more).
    fn patience(&self) -> Duration {
        Duration::from_secs(10)
    }

    /// Which of the optional set-ups below this backend offers, known
    /// without I/O: the scenarios that need a set-up are registered only
    /// where it is offered.
    fn hooks(&self) -> Hooks {
        Hooks::default()
    }

    /// A driver whose hold on a delivery (a lease, a visibility timeout) is
    /// short, its length reported as the driver's
    /// [`redelivery_hint`](jobrail_native::Capabilities::redelivery_hint).
    /// `None` where deliveries are not held for a time.
    async fn short_hold(&self) -> Option<Arc<dyn Driver>> {
        None
    }

    /// A driver on which the backend ends a message of `queue` on its own
    /// after `deliveries` deliveries (JetStream `MaxDeliver`, a quorum
    /// queue's delivery limit, an SQS redrive policy's `maxReceiveCount`).
    /// `None` where the backend has no such limit.
    async fn delivery_limited(&self, queue: &str, deliveries: u32) -> Option<Arc<dyn Driver>> {
        let _ = (queue, deliveries);
        None
    }

    /// Drivers configured with secrets (a password, keys) and pointed where
    /// nothing listens. `None` where the configuration holds no secret.
    async fn unreachable(&self) -> Option<Unreachable> {
        None
    }
}

/// The optional set-ups a [`Backend`] offers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hooks {
    /// [`Backend::short_hold`] gives a driver.
    pub short_hold: bool,
    /// [`Backend::delivery_limited`] gives a driver.
    pub delivery_limit: bool,
    /// [`Backend::unreachable`] gives drivers.
    pub unreachable: bool,
    /// [`Backend::inject_failure_body`] puts a body among the failures.
    pub inject_failure_body: bool,
    /// [`Backend::inject_body`] puts a body on a work queue.
    pub inject_body: bool,
}

/// Drivers holding secrets in their configuration, pointed where nothing
/// listens (see [`Backend::unreachable`]).
pub struct Unreachable {
    /// The secrets, none of which may appear in an error or a `Debug`.
    pub secrets: Vec<String>,
    /// The `Debug` output of each configuration.
    pub configs: Vec<String>,
    /// Drivers made without I/O, to send and subscribe through.
    pub drivers: Vec<Arc<dyn Driver>>,
    /// What connecting with each configuration gave.
    pub connected: Vec<Result<Arc<dyn Driver>, DriverError>>,
}

/// Events collected from a registry, with waiting.
#[derive(Clone, Default)]
pub struct Events {
    inner: Arc<EventsInner>,
}

#[derive(Default)]
struct EventsInner {
    events: Mutex<Vec<(Instant, Event)>>,
    settlement_failures: Mutex<Vec<(Event, String)>>,
    changed: Notify,
}

impl EventSink for Events {
    fn emit(&self, event: &Event) {
        self.inner
            .events
            .lock()
            .unwrap()
            .push((Instant::now(), event.clone()));
        self.inner.changed.notify_waiters();
    }

    fn settlement_failed(&self, event: &Event, error: &jobrail::SettlementError) {
        self.inner
            .settlement_failures
            .lock()
            .unwrap()
            .push((event.clone(), error.to_string()));
        self.inner.changed.notify_waiters();
    }
}

impl Events {
    /// Every event so far.
    pub fn all(&self) -> Vec<Event> {
        self.inner
            .events
            .lock()
            .unwrap()
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// Every event with the time it was emitted.
    pub fn timed(&self) -> Vec<(Instant, Event)> {
        self.inner.events.lock().unwrap().clone()
    }

    /// Event names (`succeeded`, `retried`...) in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.all().iter().map(|e| e.kind.name()).collect()
    }

    /// Settlement failures reported so far.
    pub fn settlement_failures(&self) -> Vec<(Event, String)> {
        self.inner.settlement_failures.lock().unwrap().clone()
    }

    /// Waits until `done(events)` holds; panics after `patience`.
    pub async fn wait_for(
        &self,
        patience: Duration,
        what: &str,
        done: impl Fn(&[Event]) -> bool,
    ) -> Vec<Event> {
        let deadline = Instant::now() + patience;
        loop {
            let notified = self.inner.changed.notified();
            let all = self.all();
            if done(&all) {
                return all;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let all = self.all();
                if done(&all) {
                    return all;
                }
                panic!(
                    "timed out after {patience:?} waiting for {what}; events so far: {:#?}",
                    all
                );
            }
        }
    }

    /// Waits until `n` events named `name` were emitted.
    pub async fn wait_count(&self, patience: Duration, name: &str, n: usize) -> Vec<Event> {
        self.wait_for(patience, &format!("{n} `{name}` events"), |all| {
            all.iter().filter(|e| e.kind.name() == name).count() >= n
        })
        .await
    }

    /// Waits until a settlement failure has been reported.
    pub async fn wait_settlement_failure(&self, patience: Duration) -> (Event, String) {
        let deadline = Instant::now() + patience;
        loop {
            let notified = self.inner.changed.notified();
            if let Some(first) = self.settlement_failures().into_iter().next() {
                return first;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("timed out waiting for a settlement failure");
            }
        }
    }
}

/// A scenario's working set: a unique queue, a driver, a producer, events.
pub struct Harness {
    /// The queue this scenario owns.
    pub queue: String,
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// A producer on the driver.
    pub producer: Producer,
    /// Events from consumers started by [`Harness::start`].
    pub events: Events,
    /// How long to wait for prompt things.
    pub patience: Duration,
}

impl Harness {
    /// Connects and picks a queue name unique to this run.
    pub async fn new(backend: &dyn Backend, scenario: &str) -> Self {
        let driver = backend.connect().await;
        Self::on(backend, driver, Self::queue_name(scenario))
    }

    /// A harness for `queue` on `driver` (one from a [`Backend`] set-up).
    pub fn on(backend: &dyn Backend, driver: Arc<dyn Driver>, queue: String) -> Self {
        Harness {
            queue,
            producer: Producer::new(driver.clone()),
            driver,
            events: Events::default(),
            patience: backend.patience(),
        }
    }

    /// A queue name for `scenario`, unique to this run.
    pub fn queue_name(scenario: &str) -> String {
        format!(
            "cf-{}-{}",
            scenario.replace('_', "-"),
            &jobrail::new_message_id()[..8]
        )
    }

    /// A job declaration for the scenario payload on this harness's queue.
    pub fn job(&self, name: &str) -> jobrail::JobBuilder<Work> {
        jobrail::Job::<Work>::builder(name).queue(self.queue.clone())
    }

    /// Starts a consumer of `registry` (its events go to [`Harness::events`]).
    pub fn start(&self, mut registry: Registry, concurrency: usize) -> ConsumerHandle {
        registry.event_sink(Arc::new(self.events.clone()));
        fit_unknown_name_delay(&mut registry, self.driver.as_ref());
        Consumer::builder(self.driver.clone(), registry)
            .concurrency(concurrency)
            .build()
            .spawn()
    }

    /// Runs `job` with a handler that succeeds, until `n` messages have
    /// succeeded, then shuts the consumer down; returns the ids of the work
    /// the handler saw, sorted.
    pub async fn consume_ids(&self, job: &jobrail::Job<Work>, n: usize) -> Vec<u32> {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let mut registry = Registry::new();
        registry
            .register(job, move |_ctx, work: Work| {
                record.lock().unwrap().push(work.id);
                std::future::ready(Ok(()))
            })
            .unwrap();
        let consumer = self.start(registry, 1);
        self.events.wait_count(self.patience, "succeeded", n).await;
        consumer.shutdown().await.unwrap();
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_unstable();
        seen
    }

    /// Starts a consumer on a fresh connection.
    pub async fn start_on(
        &self,
        driver: Arc<dyn Driver>,
        mut registry: Registry,
    ) -> ConsumerHandle {
        registry.event_sink(Arc::new(self.events.clone()));
        fit_unknown_name_delay(&mut registry, driver.as_ref());
        Consumer::builder(driver, registry)
            .concurrency(4)
            .build()
            .spawn()
    }
}

/// Lowers the registry's unknown-name delay (30 s unless a scenario set
/// it) to the backend's longest retry delay where that is shorter (the
/// suite's RabbitMQ buckets end at seconds), which a consumer would
/// otherwise refuse at start ([`jobrail::check_retry_delays`]).
pub fn fit_unknown_name_delay(registry: &mut Registry, driver: &dyn Driver) {
    if let Some(longest) = driver.capabilities().max_retry_delay {
        if registry.unknown_name_retry_delay_setting() > longest {
            registry.unknown_name_retry_delay(longest);
        }
    }
}

/// Records each execution a handler makes: the delivery attempt, the
/// in-process attempt and when it started.
#[derive(Clone, Default)]
pub struct Calls(Arc<Mutex<Vec<(u32, u32, Instant)>>>);

impl Calls {
    /// Records one execution; returns how many there have been (first = 1).
    pub fn record(&self, ctx: &jobrail::JobContext) -> usize {
        let mut calls = self.0.lock().unwrap();
        calls.push((ctx.attempt(), ctx.in_process_attempt(), Instant::now()));
        calls.len()
    }

    /// Executions so far.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The delivery attempt of each execution.
    pub fn attempts(&self) -> Vec<u32> {
        self.0.lock().unwrap().iter().map(|c| c.0).collect()
    }

    /// (delivery attempt, in-process attempt) of each execution.
    pub fn seen(&self) -> Vec<(u32, u32)> {
        self.0.lock().unwrap().iter().map(|c| (c.0, c.1)).collect()
    }

    /// When each execution started.
    pub fn times(&self) -> Vec<Instant> {
        self.0.lock().unwrap().iter().map(|c| c.2).collect()
    }

    /// Time between consecutive executions.
    pub fn gaps(&self) -> Vec<Duration> {
        let times = self.times();
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// A handler that records each execution here and returns
    /// `outcome(ctx, n)`, where `n` counts executions so far (first = 1).
    pub fn handler<F>(
        &self,
        outcome: F,
    ) -> impl Fn(jobrail::JobContext, Work) -> std::future::Ready<Result<(), jobrail::JobError>>
           + Send
           + Sync
           + 'static
    where
        F: Fn(&jobrail::JobContext, usize) -> Result<(), jobrail::JobError> + Send + Sync + 'static,
    {
        let calls = self.clone();
        move |ctx, _| {
            let n = calls.record(&ctx);
            std::future::ready(outcome(&ctx, n))
        }
    }
}

/// How many messages `queue` holds, as the driver's admin interface
/// ([`Driver::admin`]) reports; panics where the driver has none.
pub async fn depth(driver: &(impl Driver + ?Sized), queue: &str) -> QueueDepth {
    let admin = driver
        .admin()
        .unwrap_or_else(|| panic!("the {} driver has no admin interface", driver.name()));
    admin
        .depth(queue)
        .await
        .unwrap_or_else(|e| panic!("the depth of `{queue}`: {e}"))
}

/// Every message a depth counts: ready, in flight and delayed (those the
/// backend reports).
pub fn held(depth: QueueDepth) -> u64 {
    depth.ready + depth.in_flight.unwrap_or(0) + depth.delayed.unwrap_or(0)
}

/// A raw message for tests that talk to a driver directly: body `{}`.
pub fn outgoing(id: &str, delay: Option<Duration>) -> Outgoing {
    Outgoing {
        id: id.into(),
        body: b"{}".to_vec(),
        delay,
    }
}
