use std::sync::Arc;
use std::time::Duration;

use futures_util::future::select_all;
use jobrail::{failure_budget, CancelToken, Registry, Runtime};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{error, info, warn, Instrument};

use crate::driver::{Delivery, Driver, DriverError, ErrorKind, Subscription};
use crate::metrics::DepthPoller;
use crate::runtime::TokioRuntime;
use crate::support::Reconnect;

/// Builder for a [`Consumer`].
pub struct ConsumerBuilder {
    driver: Arc<dyn Driver>,
    registry: Registry,
    concurrency: usize,
    runtime: Arc<dyn Runtime>,
    depth_every: Option<Duration>,
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
        }
    }
}

/// The shortest interval between two depth polls.
const MIN_DEPTH_INTERVAL: Duration = Duration::from_millis(100);

/// Runs registered handlers against a driver's queues.
///
/// One intake loop takes deliveries from every queue under one concurrency
/// limit (a slot is taken only once a queue has a delivery for it, so an
/// idle queue never starves the others) and spawns one task per delivery,
/// which runs [`jobrail::Registry::deliver`]. Shutdown follows the rules' order:
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
    pub fn builder(driver: Arc<dyn Driver>, registry: Registry) -> ConsumerBuilder {
        ConsumerBuilder {
            driver,
            registry,
            concurrency: 8,
            runtime: Arc::new(TokioRuntime),
            depth_every: None,
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
    /// a backend's delivery limit is below what a job needs
    /// ([`Driver::delivery_limit`], [`jobrail::check_delivery_limit`]), or a
    /// queue cannot be subscribed.
    pub async fn run(self, cancel: CancelToken) -> Result<(), DriverError> {
        for spec in self.registry.specs() {
            self.driver.check_job(spec)?;
        }
        let counts_shutdown_returns = self.driver.capabilities().counts_shutdown_returns;
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
            driver: self.driver,
            registry: self.registry,
            runtime: self.runtime,
            handlers: CancelToken::new(),
            permits: Arc::new(Semaphore::new(self.concurrency)),
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
    registry: Arc<Registry>,
    runtime: Arc<dyn Runtime>,
    /// Cancels the handlers' contexts (after intake has stopped).
    handlers: CancelToken,
    permits: Arc<Semaphore>,
    prefetch: usize,
}

impl Intake {
    async fn run(self, mut sources: Vec<Source>, stop: &CancelToken) {
        let mut active = JoinSet::new();
        let mut turn = 0usize;
        loop {
            let permit = tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                permit = self.permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
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
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                (next, _, _) = select_all(waits) => next,
            };
            if let Some((queue, delivery)) = next {
                let registry = self.registry.clone();
                let runtime = self.runtime.clone();
                let cancel = self.handlers.clone();
                active.spawn(async move {
                    handle(&registry, &runtime, &cancel, &queue, delivery).await;
                    drop(permit);
                });
            }
            reap(&mut active);
        }
        for source in &mut sources {
            if let Some(subscription) = source.subscription.as_mut() {
                subscription.close().await;
            }
        }
        self.handlers.cancel();
        while let Some(joined) = active.join_next().await {
            report_task_end(joined);
        }
        drop(sources);
    }
}

fn reap(active: &mut JoinSet<()>) {
    while let Some(joined) = active.try_join_next() {
        report_task_end(joined);
    }
}

/// A delivery task that died (the pipeline catches handler and processing
/// panics, so this is a driver's or an event sink's panic): logged; the
/// backend redelivers the message by its own rules.
fn report_task_end(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        if e.is_panic() {
            error!("a delivery task panicked; the backend keeps its message: {e}");
        }
    }
}

const FIRST_RESUBSCRIBE_WAIT: Duration = Duration::from_millis(100);
const MAX_RESUBSCRIBE_WAIT: Duration = Duration::from_secs(30);

/// One queue's subscription, resubscribed with a growing wait when it fails.
struct Source {
    queue: String,
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
            queue,
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
    ) -> Option<(String, Box<dyn Delivery>)> {
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

async fn handle(
    registry: &Registry,
    runtime: &Arc<dyn Runtime>,
    cancel: &CancelToken,
    queue: &str,
    delivery: Box<dyn Delivery>,
) {
    let attempt = delivery.attempt();
    let span = tracing::info_span!(
        "delivery",
        queue,
        attempt,
        job = tracing::field::Empty,
        message_id = tracing::field::Empty
    );
    async move {
        let delivered = registry.deliver(queue, delivery, runtime, cancel).await;
        let processed = &delivered.processed;
        let span = tracing::Span::current();
        span.record("job", processed.event.job.as_str());
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
    .await
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
