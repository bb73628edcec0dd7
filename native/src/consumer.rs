use std::sync::Arc;
use std::time::Duration;

use futures_util::future::select_all;
use jobrail::{failure_budget, CancelToken, Registry, Runtime, Settlement};
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn, Instrument};

use crate::driver::{Delivery, Driver, DriverError, ErrorKind, Outgoing, Subscription};
use crate::kit::Reconnect;
use crate::metrics::DepthPoller;
use crate::runtime::TokioRuntime;

/// Builder for a [`Consumer`].
pub struct ConsumerBuilder {
    driver: Arc<dyn Driver>,
    registry: Registry,
    concurrency: usize,
    runtime: Arc<dyn Runtime>,
    depth_every: Option<Duration>,
    overlap: Option<crate::scheduler::OverlapGuard>,
}

impl ConsumerBuilder {
    /// At most `n` deliveries handled at once (default 8; at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Records each queue's depth (the `jobrail_queue_depth` gauge, see
    /// [`describe_metrics`](crate::describe_metrics)) every `every`, at
    /// least every 100 ms, and once more when the consumer stops, where the
    /// driver reports depths ([`Driver::admin`]). Off by default: each poll
    /// is a request to the backend.
    pub fn queue_depth_every(mut self, every: Duration) -> Self {
        self.depth_every = Some(every.max(MIN_DEPTH_INTERVAL));
        self
    }

    /// Replaces the clock and sleep (tests).
    pub fn runtime(mut self, runtime: Arc<dyn Runtime>) -> Self {
        self.runtime = runtime;
        self
    }

    /// Runs each delivery through `guard`, so that the jobs of a schedule
    /// with [`jobrail::Overlap::Skip`] never run two at once
    /// ([`Scheduler::overlap_guard`](crate::Scheduler::overlap_guard)).
    pub fn overlap_guard(mut self, guard: crate::scheduler::OverlapGuard) -> Self {
        self.overlap = Some(guard);
        self
    }

    /// Finishes; logs each job's failure budget.
    pub fn build(self) -> Consumer {
        let hint = self.driver.capabilities().redelivery_hint;
        for spec in self.registry.specs() {
            info!(
                driver = self.driver.name(),
                "failure budget: {}",
                failure_budget(spec, hint)
            );
        }
        Consumer {
            driver: self.driver,
            registry: Arc::new(self.registry),
            concurrency: self.concurrency,
            runtime: self.runtime,
            depth_every: self.depth_every,
            overlap: self.overlap,
        }
    }
}

/// The shortest interval between two depth polls.
const MIN_DEPTH_INTERVAL: Duration = Duration::from_millis(100);

/// Runs registered handlers against a driver's queues.
///
/// One intake loop takes deliveries from every queue under one concurrency
/// limit (a slot is taken only once a queue has a delivery for it, so an
/// idle queue never starves the others) and hands each to a free worker,
/// which runs [`jobrail::Registry::deliver`]. The workers are at most
/// `concurrency` long-lived tasks, started as the load first needs them: a
/// delivery costs no task, no allocation of the pipeline's state and no
/// join of its own, only two channel hand-offs (to the worker, and the
/// worker back to the free list). A panic that escapes the pipeline (a
/// driver's or an event sink's) is logged and drops the delivery
/// unsettled, so the backend keeps the message; the worker goes on.
/// [`ConsumerHandle::abort`] drops the workers with their deliveries. Shutdown follows the rules' order:
/// stop taking new deliveries and close the subscriptions (what was not taken
/// stays with the backend, and a broker that pushes stops pushing before any
/// settlement frees a prefetch slot), cancel the handlers' contexts, then join
/// every active delivery, each of which settles with a fresh 30-second budget
/// that shutdown does not cut short. Only then may the application stop the
/// driver.
pub struct Consumer {
    driver: Arc<dyn Driver>,
    registry: Arc<Registry>,
    concurrency: usize,
    runtime: Arc<dyn Runtime>,
    depth_every: Option<Duration>,
    overlap: Option<crate::scheduler::OverlapGuard>,
}

/// A running consumer.
pub struct ConsumerHandle {
    cancel: CancelToken,
    task: tokio::task::JoinHandle<Result<(), DriverError>>,
    registry: Arc<Registry>,
}

impl ConsumerHandle {
    /// The registry (for its counters).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Stops at once, settling nothing: every active delivery is abandoned
    /// to the backend, as if the worker process had died. The backend
    /// redelivers them by its own rules (a broker's redelivery, a lease that
    /// runs out). For tests of crash recovery; a worker that is asked to
    /// stop uses [`shutdown`](Self::shutdown).
    pub fn abort(self) {
        self.task.abort();
    }

    /// Cancels handlers, stops taking deliveries, and waits until every
    /// active delivery has been settled.
    pub async fn shutdown(self) -> Result<(), DriverError> {
        self.cancel.cancel();
        self.task
            .await
            .map_err(|e| DriverError::new("consumer", ErrorKind::Stopped, e))?
    }
}

impl Consumer {
    /// Starts building a consumer of `registry`'s queues on `driver`.
    ///
    /// Each registered job's queue is consumed; [`ConsumerBuilder::concurrency`]
    /// bounds the deliveries in progress. [`Consumer::spawn`] runs it on the
    /// current tokio runtime, [`Consumer::run_until_signal`] until Ctrl-C or
    /// SIGTERM (then drains: [`ConsumerHandle::shutdown`]).
    ///
    /// # Example
    ///
    /// ```
    /// use std::sync::Arc;
    /// use jobrail::{Job, JobContext, Registry};
    /// use jobrail_native::{Consumer, MemoryDriver, Producer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let job = Job::<u32>::builder("square").max_deliveries(3).build()?;
    /// let mut registry = Registry::new();
    /// registry.register(&job, |_ctx: JobContext, n: u32| async move {
    ///     println!("{}", n * n);
    ///     Ok(())
    /// })?;
    ///
    /// let driver = Arc::new(MemoryDriver::default());
    /// Producer::new(driver.clone()).dispatch(&job).send(&7).await?;
    /// let consumer = Consumer::builder(driver.clone(), registry)
    ///     .concurrency(8)
    ///     .build()
    ///     .spawn();
    /// while driver.depth("default") > 0 {
    ///     tokio::task::yield_now().await;
    /// }
    /// // Stops taking deliveries and waits for those in progress to settle.
    /// consumer.shutdown().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(driver: Arc<dyn Driver>, registry: Registry) -> ConsumerBuilder {
        ConsumerBuilder {
            driver,
            registry,
            concurrency: 8,
            runtime: Arc::new(TokioRuntime),
            depth_every: None,
            overlap: None,
        }
    }

    /// The registry (for its counters).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Runs in a background task until [`ConsumerHandle::shutdown`].
    pub fn spawn(self) -> ConsumerHandle {
        let cancel = CancelToken::new();
        let registry = self.registry.clone();
        let token = cancel.clone();
        let task = tokio::spawn(async move { self.run(token).await });
        ConsumerHandle {
            cancel,
            task,
            registry,
        }
    }

    /// Runs until the process receives SIGINT or SIGTERM (Ctrl-C on other
    /// platforms), then shuts down gracefully: what a deployed worker's
    /// `main` usually ends with. Stop the driver afterwards.
    pub async fn run_until_signal(self) -> Result<(), DriverError> {
        let handle = self.spawn();
        shutdown_signal().await;
        info!("shutdown signal received: finishing active deliveries");
        handle.shutdown().await
    }

    /// Runs until `cancel` is cancelled, then shuts down in order: stop
    /// taking deliveries (each subscription is closed, so the backend sends
    /// no more), cancel the active handlers' contexts, and join every active
    /// delivery (each settles with its own fresh budget).
    /// Fails at once if the driver refuses a job ([`Driver::check_job`]),
    /// holds a refused settlement for no time (`refused_hold` zero), a
    /// job (or the unknown-name rule) declares a retry delay longer than the
    /// driver's `max_retry_delay` ([`jobrail::check_retry_delays`]), a
    /// backend's delivery limit is below what a job needs
    /// ([`Driver::delivery_limit`], [`jobrail::check_delivery_limit`]), or a
    /// queue cannot be subscribed. Logs each of the registry's
    /// [`warnings`](jobrail::Registry::warnings) (a job whose delivery cap
    /// was never chosen) at `WARN` first.
    pub async fn run(self, cancel: CancelToken) -> Result<(), DriverError> {
        for warning in self.registry.warnings() {
            warn!(driver = self.driver.name(), "{warning}");
        }
        for spec in self.registry.specs() {
            self.driver.check_job(spec)?;
        }
        let capabilities = self.driver.capabilities();
        if capabilities.refused_hold.is_zero() {
            return Err(DriverError::new(
                self.driver.name(),
                ErrorKind::Config,
                "the driver's refused_hold is zero: a message whose settlement the backend refused \
                 would come back at once, again and again; hold it at least as long as a lease",
            ));
        }
        if let Some(longest) = capabilities.max_retry_delay {
            jobrail::check_retry_delays(&self.registry, longest)
                .map_err(|e| DriverError::new(self.driver.name(), ErrorKind::Config, e))?;
        }
        let counts_shutdown_returns = capabilities.counts_shutdown_returns;
        for queue in self.registry.queues() {
            let limit = self.driver.delivery_limit(&queue).await?;
            jobrail::check_delivery_limit(&self.registry, &queue, limit, counts_shutdown_returns)
                .map_err(|e| DriverError::new(self.driver.name(), ErrorKind::Config, e))?;
        }
        let mut sources = Vec::new();
        for queue in self.registry.queues() {
            let subscription = self.driver.subscribe(&queue, self.concurrency).await?;
            sources.push(Source::new(queue, subscription));
        }
        let depth = self
            .depth_every
            .and_then(|every| DepthPoller::start(&self.driver, self.registry.queues(), every));
        let intake = Intake {
            driver: self.driver.clone(),
            shared: Arc::new(Shared {
                registry: self.registry,
                runtime: self.runtime,
                handlers: CancelToken::new(),
                steps: Steps {
                    driver: self.driver,
                    longest: capabilities.max_dispatch_delay,
                    hold: capabilities.refused_hold,
                },
                overlap: self.overlap,
            }),
            prefetch: self.concurrency,
        };
        intake.run(sources, &cancel).await;
        if let Some(depth) = depth {
            depth.finish().await;
        }
        Ok(())
    }
}

/// Takes deliveries from every queue under one concurrency limit.
///
/// A slot of the limit is taken only once some queue has a delivery for it:
/// the intake waits for a free slot, then for the first delivery from any
/// queue (polled in turn, starting with a different queue each time), so an
/// idle queue never holds a slot and every queue is served at any
/// concurrency of at least 1.
struct Intake {
    driver: Arc<dyn Driver>,
    /// What every delivery task needs, behind one reference count.
    shared: Arc<Shared>,
    /// The concurrency limit, and the prefetch asked of each subscription.
    prefetch: usize,
}

/// The registry, runtime and handlers' cancellation every delivery task
/// shares.
struct Shared {
    registry: Arc<Registry>,
    runtime: Arc<dyn Runtime>,
    /// Cancels the handlers' contexts (after intake has stopped).
    handlers: CancelToken,
    /// Where a delivery that is not yet due is sent on.
    steps: Steps,
    /// The schedules' overlap guard, if any.
    overlap: Option<crate::scheduler::OverlapGuard>,
}

/// The longest rest of a delay a consumer waits out holding the delivery,
/// rather than sending it on as one more step: 1 s (what SQS's whole
/// seconds or RabbitMQ's smallest default bucket would add to it), or the
/// backend's longest step if that is shorter.
const STEP_HOLD: Duration = Duration::from_secs(1);

/// The steps of delays the backend holds only up to a limit
/// ([`Capabilities::max_dispatch_delay`](crate::Capabilities::max_dispatch_delay)).
struct Steps {
    driver: Arc<dyn Driver>,
    /// The longest delay one message holds (`None`: any).
    longest: Option<Duration>,
    /// How long a delivery whose step could not be sent stays away.
    hold: Duration,
}

impl Steps {
    /// Carries on a delivery that is `remaining` from its due time: sends
    /// the same body under the same id, delayed by the next leg, then
    /// acknowledges the delivery. The handler does not run and no attempt
    /// is counted (the copy is a new message). If the copy is not sent
    /// (three tries), the delivery is handed back as a graceful shutdown
    /// hands it back (a return the job's cap does not count, though the
    /// attempt number the handler sees may), to come back after the
    /// backend's hold: nothing is lost, nothing loops.
    /// A crash between the send and the acknowledgement leaves two copies,
    /// as any at-least-once hand-over does.
    async fn step(&self, queue: &str, delivery: Box<dyn Delivery>, remaining: Duration) {
        #[derive(serde::Deserialize)]
        struct Id {
            id: String,
        }
        let leg = jobrail::delay_leg(remaining, self.longest);
        let id = serde_json::from_slice::<Id>(delivery.body())
            .map(|e| e.id)
            .unwrap_or_default();
        let copy = Outgoing {
            id: id.clone(),
            body: delivery.body().to_vec(),
            delay: Some(leg),
        };
        // A refusal can be brief (a hold queue declared a moment ago): the
        // copy is sent again twice before the delivery is handed back.
        let mut sent = self.driver.send(queue, copy.clone()).await;
        for pause in [Duration::from_millis(50), Duration::from_millis(250)] {
            match &sent {
                Err(e) if matches!(e.kind(), ErrorKind::NotAccepted | ErrorKind::Uncertain) => {
                    tokio::time::sleep(pause).await;
                    sent = self.driver.send(queue, copy.clone()).await;
                }
                _ => break,
            }
        }
        match sent {
            Ok(()) => match delivery.settle(&Settlement::Ack).await {
                Ok(()) => debug!(message_id = %id, ?remaining, ?leg, "delay step: sent on"),
                Err(e) => warn!(
                    message_id = %id,
                    kind = %e.kind(),
                    "delay step: sent on, but the delivery's acknowledgement failed \
                     (two copies may arrive when due): {e}"
                ),
            },
            Err(e) => {
                warn!(
                    message_id = %id,
                    kind = %e.kind(),
                    "delay step: not sent on; the delivery is handed back: {e}"
                );
                let back = Settlement::Retry {
                    delay: Some(self.hold.min(leg)),
                    shutdown: true,
                };
                if let Err(e) = delivery.settle(&back).await {
                    warn!(message_id = %id, "delay step: hand-back failed: {e}");
                }
            }
        }
    }
}

/// A delivery handed to a worker, with its queue.
type Work = (Arc<str>, Box<dyn Delivery>);

/// The delivery workers: at most `concurrency` long-lived tasks, started as
/// the load first needs them. A worker runs one delivery at a time and
/// then offers itself again on `idle`; a free slot of the limit is an idle
/// worker. A delivery costs no task of its own: the worker's state (the
/// pipeline's future included) is allocated once, not per delivery.
struct Workers {
    /// Each started worker's inbox (room for the one delivery it runs).
    inboxes: Vec<mpsc::Sender<Work>>,
    /// Numbers of the workers that are free (never-started ones included).
    idle: mpsc::UnboundedReceiver<usize>,
    idle_tx: mpsc::UnboundedSender<usize>,
    tasks: JoinSet<()>,
}

impl Workers {
    fn new(concurrency: usize) -> Self {
        let (idle_tx, idle) = mpsc::unbounded_channel();
        for number in 0..concurrency {
            let _ = idle_tx.send(number);
        }
        Workers {
            inboxes: Vec::with_capacity(concurrency),
            idle,
            idle_tx,
            tasks: JoinSet::new(),
        }
    }

    /// Hands `work` to the free worker `number`, starting it if needed.
    fn hand(&mut self, number: usize, work: Work, shared: &Arc<Shared>) {
        if number == self.inboxes.len() {
            let (inbox, mut mailbox) = mpsc::channel::<Work>(1);
            let (shared, idle) = (shared.clone(), self.idle_tx.clone());
            self.tasks.spawn(async move {
                while let Some((queue, delivery)) = mailbox.recv().await {
                    let handled = AssertUnwindSafe(handle(&shared, &queue, delivery));
                    if let Err(panic) = handled.catch_unwind().await {
                        report_panic(&panic_text(panic.as_ref()));
                    }
                    if idle.send(number).is_err() {
                        break;
                    }
                }
            });
            self.inboxes.push(inbox);
        }
        // A free worker's inbox is empty: this never waits or fails while
        // the worker runs (a worker that died is reported when joined, and
        // its delivery dropped, which leaves the message with the backend).
        let _ = self.inboxes[number].try_send(work);
    }

    /// Lets every worker finish its delivery and waits for all of them.
    async fn join(mut self) {
        self.inboxes.clear();
        drop(self.idle_tx);
        while let Some(joined) = self.tasks.join_next().await {
            report_task_end(joined);
        }
    }
}

impl Intake {
    async fn run(self, mut sources: Vec<Source>, stop: &CancelToken) {
        let mut workers = Workers::new(self.prefetch);
        let mut turn = 0usize;
        // One cancellation future for the whole run, polled before each
        // slot and each delivery is taken (`biased`), so a stop is seen
        // before anything more is taken even when slots and deliveries are
        // ready at once.
        let mut stopping = std::pin::pin!(stop.cancelled());
        loop {
            let worker = tokio::select! {
                biased;
                _ = &mut stopping => break,
                worker = workers.idle.recv() => match worker {
                    Some(worker) => worker,
                    None => break,
                },
            };
            let live = sources.iter().filter(|source| !source.ended).count();
            let next = if live == 1 {
                // One queue (the usual case): no fan-in to build.
                let Some(source) = sources.iter_mut().find(|source| !source.ended) else {
                    break;
                };
                tokio::select! {
                    biased;
                    _ = &mut stopping => break,
                    next = source.next(&self.driver, self.prefetch) => next,
                }
            } else {
                let mut waits: Vec<_> = sources
                    .iter_mut()
                    .filter(|source| !source.ended)
                    .map(|source| Box::pin(source.next(&self.driver, self.prefetch)))
                    .collect();
                if waits.is_empty() {
                    break;
                }
                let first = turn % waits.len();
                waits.rotate_left(first);
                turn = turn.wrapping_add(1);
                tokio::select! {
                    biased;
                    _ = &mut stopping => break,
                    (next, _, _) = select_all(waits) => next,
                }
            };
            match next {
                Some(work) => workers.hand(worker, work, &self.shared),
                // Not used: free again.
                None => {
                    let _ = workers.idle_tx.send(worker);
                }
            }
        }
        for source in &mut sources {
            if let Some(subscription) = source.subscription.as_mut() {
                subscription.close().await;
            }
        }
        self.shared.handlers.cancel();
        workers.join().await;
        drop(sources);
    }
}

/// A delivery whose pipeline panicked outside the handler (the pipeline
/// catches handler and processing panics, so this is a driver's or an
/// event sink's panic): logged; the delivery was dropped unsettled, and the
/// backend redelivers the message by its own rules. The worker goes on.
fn report_panic(text: &str) {
    error!("a delivery task panicked; the backend keeps its message: {text}");
}

/// A panic's message, when it is text.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A worker that died (a panic that escaped): logged.
fn report_task_end(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            report_panic(&e.to_string());
        }
    }
}

const FIRST_RESUBSCRIBE_WAIT: Duration = Duration::from_millis(100);
const MAX_RESUBSCRIBE_WAIT: Duration = Duration::from_secs(30);

/// One queue's subscription, resubscribed with a growing wait when it fails.
struct Source {
    /// Shared with each delivery task (no copy of the name per delivery).
    queue: Arc<str>,
    /// `None` while waiting to resubscribe.
    subscription: Option<Box<dyn Subscription>>,
    resubscribe_at: Option<tokio::time::Instant>,
    wait: Reconnect,
    /// The subscription ended for good (the driver stopped).
    ended: bool,
}

impl Source {
    fn new(queue: String, subscription: Box<dyn Subscription>) -> Self {
        Source {
            queue: queue.into(),
            subscription: Some(subscription),
            resubscribe_at: None,
            wait: Reconnect::new(FIRST_RESUBSCRIBE_WAIT, MAX_RESUBSCRIBE_WAIT),
            ended: false,
        }
    }

    /// The next delivery and its queue; `None` once the subscription has
    /// ended for good. Cancel-safe: the intake drops it whenever another
    /// queue delivers first, and a pending resubscription keeps its time.
    async fn next(
        &mut self,
        driver: &Arc<dyn Driver>,
        prefetch: usize,
    ) -> Option<(Arc<str>, Box<dyn Delivery>)> {
        loop {
            if self.subscription.is_none() {
                if let Some(at) = self.resubscribe_at {
                    tokio::time::sleep_until(at).await;
                }
                match driver.subscribe(&self.queue, prefetch).await {
                    Ok(fresh) => {
                        self.subscription = Some(fresh);
                        self.resubscribe_at = None;
                    }
                    Err(e) => {
                        warn!(queue = %self.queue, "resubscribe failed, retrying in {:?}: {e}", self.wait.upcoming());
                        self.back_off();
                        continue;
                    }
                }
            }
            let subscription = self.subscription.as_mut()?;
            match subscription.next().await {
                None => {
                    self.ended = true;
                    return None;
                }
                Some(Ok(delivery)) => {
                    self.wait.succeeded();
                    return Some((self.queue.clone(), delivery));
                }
                Some(Err(e)) => {
                    warn!(queue = %self.queue, "subscription failed, resubscribing in {:?}: {e}", self.wait.upcoming());
                    self.subscription = None;
                    self.back_off();
                }
            }
        }
    }

    fn back_off(&mut self) {
        self.resubscribe_at = Some(tokio::time::Instant::now() + self.wait.failed());
    }
}

async fn handle(shared: &Shared, queue: &str, delivery: Box<dyn Delivery>) {
    if let Some(remaining) = jobrail::delay_remaining(delivery.body(), jobrail::unix_now_ms()) {
        let hold = shared.steps.longest.map_or(STEP_HOLD, |l| l.min(STEP_HOLD));
        if remaining > hold {
            return shared.steps.step(queue, delivery, remaining).await;
        }
        // Within a step and less than another step's rounding would add (a
        // whole second on SQS, the smallest bucket on RabbitMQ): waited out
        // here, holding the delivery.
        tokio::time::sleep(remaining).await;
    }
    // A schedule's job whose previous tick still runs is settled here.
    let (delivery, running) = match &shared.overlap {
        Some(guard) => match guard.enter(delivery).await {
            Some(entered) => entered,
            None => return,
        },
        None => (delivery, None),
    };
    let attempt = delivery.attempt();
    let span = tracing::info_span!(
        "delivery",
        queue,
        attempt,
        job = tracing::field::Empty,
        message_id = tracing::field::Empty
    );
    async move {
        let delivered = shared
            .registry
            .deliver(queue, delivery, &shared.runtime, &shared.handlers)
            .await;
        let processed = &delivered.processed;
        let span = tracing::Span::current();
        span.record("job", &*processed.event.job);
        span.record("message_id", processed.event.message_id.as_str());
        match &delivered.outcome {
            Ok(()) => log_outcome(processed),
            Err(e) => error!(
                settlement = processed.settlement.name(),
                kind = %e.kind(),
                "settlement failed: {e}"
            ),
        }
    }
    .instrument(span)
    .await;
    if let Some(running) = running {
        running.leave().await;
    }
}

fn log_outcome(processed: &jobrail::Processed) {
    use jobrail::EventKind;
    let executions = processed.executions();
    match &processed.event.kind {
        EventKind::Succeeded { resolution } => info!(?resolution, executions, "succeeded"),
        EventKind::Retried {
            delay,
            error,
            shutdown,
        } => {
            warn!(?delay, shutdown, executions, "retrying: {error}")
        }
        EventKind::Rejected { error } => warn!(executions, "rejected: {error}"),
        EventKind::Failed { failure } => {
            error!(kind = ?failure.kind, executions, "failed: {}", failure.message)
        }
    }
}

/// Completes when the process receives SIGINT or SIGTERM (Ctrl-C where
/// there are no Unix signals).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                warn!("cannot listen for SIGTERM ({e}); waiting for Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use async_trait::async_trait;
    use jobrail::{Job, JobContext, Settlement};

    use super::*;
    use crate::{Capabilities, MemoryDriver, Outgoing, Producer};

    /// The memory driver, with one delivery whose `attempt()` panics: a
    /// panic outside the pipeline's guards (the consumer reads it first).
    struct PanicsOnce {
        inner: MemoryDriver,
        armed: Arc<AtomicBool>,
    }

    struct Sub(Box<dyn Subscription>, Arc<AtomicBool>);
    struct Del(Box<dyn Delivery>, Arc<AtomicBool>);

    #[async_trait]
    impl Driver for PanicsOnce {
        fn name(&self) -> &'static str {
            "panics-once"
        }
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
            self.inner.send(queue, message).await
        }
        async fn subscribe(
            &self,
            queue: &str,
            prefetch: usize,
        ) -> Result<Box<dyn Subscription>, DriverError> {
            let sub = self.inner.subscribe(queue, prefetch).await?;
            Ok(Box::new(Sub(sub, self.armed.clone())))
        }
        async fn stop(&self) -> Result<(), DriverError> {
            self.inner.stop().await
        }
    }

    #[async_trait]
    impl Subscription for Sub {
        async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
            let armed = self.1.clone();
            self.0
                .next()
                .await
                .map(|d| d.map(|d| Box::new(Del(d, armed)) as Box<dyn Delivery>))
        }
        async fn close(&mut self) {
            self.0.close().await
        }
    }

    #[async_trait]
    impl Delivery for Del {
        fn body(&self) -> &[u8] {
            self.0.body()
        }
        fn attempt(&self) -> u32 {
            if self.1.swap(false, Ordering::SeqCst) {
                panic!("a driver's delivery panicked");
            }
            self.0.attempt()
        }
        async fn settle(self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
            self.0.settle(settlement).await
        }
    }

    /// A panic that escapes the pipeline (here, a driver's delivery) costs
    /// its delivery, dropped unsettled, which the backend keeps and hands
    /// out again, and not the worker: at concurrency 1, with a single
    /// worker, every job still runs and is settled afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_outside_the_handler_leaves_the_worker_running() {
        let driver = Arc::new(PanicsOnce {
            inner: MemoryDriver::default(),
            armed: Arc::new(AtomicBool::new(true)),
        });
        let job = Job::<u32>::builder("n").queue("q").build().unwrap();
        let producer = Producer::new(driver.clone());
        for n in 0..4 {
            producer.dispatch(&job).send(&n).await.unwrap();
        }
        let mut registry = Registry::new();
        registry
            .register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
        let consumer = Consumer::builder(driver.clone(), registry)
            .concurrency(1)
            .build()
            .spawn();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while driver.inner.depth("q") > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the worker stopped after the panic: {} messages left",
                driver.inner.depth("q")
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!driver.armed.load(Ordering::SeqCst), "the panic happened");
        let stats = consumer.registry().stats().job("n");
        assert_eq!(
            (stats.succeeded(), stats.executions),
            (4, 4),
            "each job ran and settled once (the panic came before its run): {stats:?}"
        );
        consumer.shutdown().await.unwrap();
    }
}
