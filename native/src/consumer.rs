//! The native worker: pulls deliveries, runs handlers, settles.
//!
//! One pump task per queue takes deliveries while a concurrency permit is
//! free, and spawns one task per delivery. Shutdown follows the rules' order:
//! stop taking new deliveries and close the subscriptions (what was not taken
//! stays with the backend, and a broker that pushes stops pushing before any
//! settlement frees a prefetch slot), cancel the handlers' contexts, then join
//! every active delivery, each of which settles with a fresh 30-second budget
//! that shutdown does not cut short. Only then may the application stop the
//! driver.

use std::sync::Arc;
use std::time::Duration;

use queue::{failure_budget, CancelToken, Registry, Runtime};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{error, info, warn, Instrument};

use crate::driver::{Delivery, Driver, DriverError, ErrorKind, Subscription};
use crate::runtime::TokioRuntime;

/// Builder for a [`Consumer`].
pub struct ConsumerBuilder {
    driver: Arc<dyn Driver>,
    registry: Registry,
    concurrency: usize,
    runtime: Arc<dyn Runtime>,
}

impl ConsumerBuilder {
    /// At most `n` deliveries handled at once (default 8; at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
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
        }
    }
}

/// Runs registered handlers against a driver's queues.
pub struct Consumer {
    driver: Arc<dyn Driver>,
    registry: Arc<Registry>,
    concurrency: usize,
    runtime: Arc<dyn Runtime>,
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
    /// Fails at once if a queue cannot be subscribed.
    pub async fn run(self, cancel: CancelToken) -> Result<(), DriverError> {
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let handlers = CancelToken::new();
        let mut pumps = JoinSet::new();
        for queue in self.registry.queues() {
            let subscription = self.driver.subscribe(&queue, self.concurrency).await?;
            let pump = Pump {
                driver: self.driver.clone(),
                registry: self.registry.clone(),
                runtime: self.runtime.clone(),
                intake: cancel.clone(),
                handlers: handlers.clone(),
                permits: permits.clone(),
                prefetch: self.concurrency,
                queue,
            };
            pumps.spawn(pump.run(subscription));
        }
        let mut stopped = Vec::new();
        while let Some(joined) = pumps.join_next().await {
            match joined {
                Ok(pump) => stopped.push(pump),
                Err(e) => error!("consumer pump task failed: {e}"),
            }
        }
        handlers.cancel();
        for (mut active, subscription) in stopped {
            while active.join_next().await.is_some() {}
            drop(subscription);
        }
        Ok(())
    }
}

struct Pump {
    driver: Arc<dyn Driver>,
    registry: Arc<Registry>,
    runtime: Arc<dyn Runtime>,
    /// Stops taking deliveries.
    intake: CancelToken,
    /// Cancels the handlers' contexts (after intake has stopped).
    handlers: CancelToken,
    permits: Arc<Semaphore>,
    prefetch: usize,
    queue: String,
}

impl Pump {
    /// Takes deliveries until intake stops; returns the deliveries still
    /// being handled and the closed subscription.
    async fn run(
        self,
        mut subscription: Box<dyn Subscription>,
    ) -> (JoinSet<()>, Box<dyn Subscription>) {
        let mut active = JoinSet::new();
        let mut reconnect_wait = Duration::from_millis(100);
        loop {
            let permit = tokio::select! {
                biased;
                _ = self.intake.cancelled() => break,
                permit = self.permits.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
            };
            let next = tokio::select! {
                biased;
                _ = self.intake.cancelled() => break,
                next = subscription.next() => next,
            };
            match next {
                None => break,
                Some(Ok(delivery)) => {
                    reconnect_wait = Duration::from_millis(100);
                    let registry = self.registry.clone();
                    let runtime = self.runtime.clone();
                    let cancel = self.handlers.clone();
                    let queue = self.queue.clone();
                    active.spawn(async move {
                        handle(&registry, &runtime, &cancel, &queue, delivery).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    drop(permit);
                    warn!(queue = %self.queue, "subscription failed, resubscribing in {reconnect_wait:?}: {e}");
                    tokio::select! {
                        _ = self.intake.cancelled() => break,
                        _ = tokio::time::sleep(reconnect_wait) => {}
                    }
                    reconnect_wait = (reconnect_wait * 2).min(Duration::from_secs(30));
                    match self.driver.subscribe(&self.queue, self.prefetch).await {
                        Ok(fresh) => subscription = fresh,
                        Err(e) => warn!(queue = %self.queue, "resubscribe failed: {e}"),
                    }
                }
            }
            while active.try_join_next().is_some() {}
        }
        subscription.close().await;
        (active, subscription)
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

fn log_outcome(processed: &queue::Processed) {
    use queue::EventKind;
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
