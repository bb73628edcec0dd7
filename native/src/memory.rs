use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{FailureRecord, Settlement};
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::driver::{
    Capabilities, Delivery, Driver, DriverError, ErrorKind, Outgoing, Subscription,
};
use crate::support::{lock, Lifecycle};

const NAME: &str = "memory";

/// Settings for the memory driver.
#[derive(Debug, Clone, Default)]
pub struct MemoryConfig {
    /// Longest retry delay a settlement may request (`None`: no limit).
    /// Longer requests fail as [`ErrorKind::Unsupported`] and the message
    /// stays queued.
    pub max_retry_delay: Option<Duration>,
}

#[derive(Debug)]
struct Stored {
    body: Vec<u8>,
    deliveries: u32,
    /// Deliveries handed back by a graceful shutdown (they do not consume
    /// the job's cap).
    shutdown_returns: u32,
}

#[derive(Default)]
struct QueueState {
    ready: VecDeque<Stored>,
    notify: Arc<Notify>,
    delayed: usize,
    in_flight: usize,
}

#[derive(Default)]
struct State {
    queues: HashMap<String, QueueState>,
    failures: HashMap<String, Vec<FailureRecord>>,
    timers: Vec<AbortHandle>,
}

struct Inner {
    config: MemoryConfig,
    /// Set before `stop` clears the queues under the state lock, and read
    /// under that lock wherever work is added, so nothing is queued after a
    /// stop.
    lifecycle: Lifecycle,
    state: Mutex<State>,
}

/// The in-memory driver. Clones share the same queues.
///
/// For tests, demos and single-process applications. It keeps its own
/// delivery counter per message (and, apart, how many deliveries a graceful
/// shutdown handed back, so those never consume the job's cap), delays
/// retries with timers, drops rejected
/// messages and keeps terminal failures in an inspectable list. Nothing
/// survives the process: [`MemoryDriver::stop`](crate::Driver::stop)
/// discards pending and delayed work and refuses further retries.
///
/// A delivery dropped without settlement (a crashed handler task, a consumer
/// that went away) goes back to the front of its queue with its count kept,
/// so it is redelivered with a higher attempt number, as a broker would.
///
/// It has no size limit ([`Capabilities::max_message_bytes`] is `None`):
/// a message is only as large as memory allows.
#[derive(Clone)]
pub struct MemoryDriver {
    inner: Arc<Inner>,
}

impl Default for MemoryDriver {
    fn default() -> Self {
        Self::new(MemoryConfig::default())
    }
}

impl MemoryDriver {
    /// A driver with `config`.
    pub fn new(config: MemoryConfig) -> Self {
        MemoryDriver {
            inner: Arc::new(Inner {
                config,
                lifecycle: Lifecycle::new(NAME),
                state: Mutex::default(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// Terminal failures recorded for `queue`, oldest first.
    pub fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        self.state()
            .failures
            .get(queue)
            .cloned()
            .unwrap_or_default()
    }

    /// Messages on `queue` that are ready, delayed or being handled.
    pub fn depth(&self, queue: &str) -> usize {
        self.state()
            .queues
            .get(queue)
            .map_or(0, |q| q.ready.len() + q.delayed + q.in_flight)
    }

    /// Messages on `queue` ready for delivery now.
    pub fn ready(&self, queue: &str) -> usize {
        self.state().queues.get(queue).map_or(0, |q| q.ready.len())
    }

    fn enqueue(&self, queue: &str, stored: Stored, front: bool) -> Result<(), DriverError> {
        let mut state = self.state();
        self.inner.lifecycle.check_running()?;
        let q = state.queues.entry(queue.to_string()).or_default();
        if front {
            q.ready.push_front(stored);
        } else {
            q.ready.push_back(stored);
        }
        q.notify.notify_one();
        Ok(())
    }

    fn enqueue_later(
        &self,
        queue: &str,
        stored: Stored,
        delay: Duration,
    ) -> Result<(), DriverError> {
        let mut state = self.state();
        self.inner.lifecycle.check_running()?;
        state.queues.entry(queue.to_string()).or_default().delayed += 1;
        let driver = self.clone();
        let queue = queue.to_string();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut state = driver.state();
            if driver.inner.lifecycle.is_stopped() {
                return;
            }
            let q = state.queues.entry(queue).or_default();
            q.delayed -= 1;
            q.ready.push_back(stored);
            q.notify.notify_one();
        });
        state.timers.retain(|t| !t.is_finished());
        state.timers.push(timer.abort_handle());
        Ok(())
    }
}

#[async_trait]
impl Driver for MemoryDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: self.inner.config.max_retry_delay,
            ..Capabilities::full()
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let stored = Stored {
            body: message.body,
            deliveries: 0,
            shutdown_returns: 0,
        };
        match message.delay {
            Some(delay) if !delay.is_zero() => self.enqueue_later(queue, stored, delay),
            _ => self.enqueue(queue, stored, false),
        }
    }

    async fn subscribe(
        &self,
        queue: &str,
        _prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        let mut state = self.state();
        self.inner.lifecycle.check_running()?;
        let notify = state
            .queues
            .entry(queue.to_string())
            .or_default()
            .notify
            .clone();
        Ok(Box::new(MemorySubscription {
            driver: self.clone(),
            queue: queue.to_string(),
            notify,
        }))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.lifecycle.stop();
        let mut state = self.state();
        for timer in state.timers.drain(..) {
            timer.abort();
        }
        for q in state.queues.values_mut() {
            q.ready.clear();
            q.delayed = 0;
            q.notify.notify_waiters();
        }
        Ok(())
    }
}

struct MemorySubscription {
    driver: MemoryDriver,
    queue: String,
    notify: Arc<Notify>,
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        loop {
            let notified = self.notify.notified();
            {
                let mut state = self.driver.state();
                if self.driver.inner.lifecycle.is_stopped() {
                    return None;
                }
                let q = state.queues.entry(self.queue.clone()).or_default();
                if let Some(mut stored) = q.ready.pop_front() {
                    stored.deliveries = stored.deliveries.saturating_add(1);
                    q.in_flight += 1;
                    if !q.ready.is_empty() {
                        q.notify.notify_one();
                    }
                    let attempt = stored.deliveries;
                    return Some(Ok(Box::new(MemoryDelivery {
                        driver: self.driver.clone(),
                        queue: self.queue.clone(),
                        stored: Some(stored),
                        attempt,
                    })));
                }
            }
            notified.await;
        }
    }
}

struct MemoryDelivery {
    driver: MemoryDriver,
    queue: String,
    stored: Option<Stored>,
    attempt: u32,
}

impl MemoryDelivery {
    fn release(&mut self) {
        let mut state = self.driver.state();
        if let Some(q) = state.queues.get_mut(&self.queue) {
            q.in_flight = q.in_flight.saturating_sub(1);
        }
    }
}

impl Drop for MemoryDelivery {
    /// Unsettled: back to the front of the queue, count kept.
    fn drop(&mut self) {
        if let Some(stored) = self.stored.take() {
            self.release();
            let _ = self.driver.enqueue(&self.queue, stored, true);
        }
    }
}

#[async_trait]
impl Delivery for MemoryDelivery {
    fn body(&self) -> &[u8] {
        self.stored.as_ref().map_or(&[], |s| &s.body)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn shutdown_returns(&self) -> Option<u32> {
        self.stored.as_ref().map(|s| s.shutdown_returns)
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        if let Err(stopped) = self.driver.inner.lifecycle.check_running() {
            // Dropping would try to requeue; a stopped driver keeps nothing.
            self.stored = None;
            self.release();
            return Err(stopped);
        }
        match settlement {
            Settlement::Ack | Settlement::Reject => {}
            Settlement::Retry { delay, shutdown } => {
                let delay = delay.unwrap_or(Duration::ZERO);
                if let Some(max) = self.driver.inner.config.max_retry_delay {
                    if delay > max {
                        // Leave the message queued (Drop puts it back).
                        return Err(DriverError::new(
                            NAME,
                            ErrorKind::Unsupported,
                            format!("retry delay {delay:?} exceeds this driver's maximum {max:?}"),
                        ));
                    }
                }
                let mut stored = self
                    .stored
                    .take()
                    .expect("unsettled delivery has its message");
                if *shutdown {
                    stored.shutdown_returns = stored.shutdown_returns.saturating_add(1);
                }
                self.release();
                return if delay.is_zero() {
                    self.driver.enqueue(&self.queue, stored, false)
                } else {
                    self.driver.enqueue_later(&self.queue, stored, delay)
                };
            }
            Settlement::Fail(record) => {
                self.driver
                    .state()
                    .failures
                    .entry(self.queue.clone())
                    .or_default()
                    .push(FailureRecord::clone(record));
            }
        }
        self.stored = None;
        self.release();
        Ok(())
    }
}
