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
use crate::failures::{Admin, ClaimedFailure, FailureStore, QueueDepth, StoredFailure};
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

/// A failure entry and whether a claim holds it.
struct MemoryFailure {
    entry: StoredFailure,
    /// Bumped by each claim; a claim is live while the entry's `claim`
    /// still holds its number.
    claim: Option<u64>,
}

#[derive(Default)]
struct State {
    claims: u64,
    queues: HashMap<String, QueueState>,
    failures: HashMap<String, Vec<MemoryFailure>>,
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
            .map(|entries| {
                entries
                    .iter()
                    .filter_map(|f| f.entry.record.clone())
                    .collect()
            })
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

#[cfg(feature = "testing")]
impl MemoryDriver {
    /// Puts `body` among `queue`'s failure entries as it is, as something
    /// other than the consumer might have (a body that is not a failure
    /// record, say). For the conformance suite; not a supported API.
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let mut state = self.state();
        self.inner.lifecycle.check_running()?;
        state
            .failures
            .entry(queue.to_string())
            .or_default()
            .push(MemoryFailure {
                entry: StoredFailure::from_body(body),
                claim: None,
            });
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

    fn failure_store(&self) -> Option<&dyn FailureStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
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

#[async_trait]
impl FailureStore for MemoryDriver {
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        Ok(self
            .state()
            .failures
            .get(queue)
            .map(|entries| entries.iter().map(|f| f.entry.clone()).collect())
            .unwrap_or_default())
    }

    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError> {
        let mut state = self.state();
        state.claims += 1;
        let number = state.claims;
        let Some(found) = state
            .failures
            .get_mut(queue)
            .and_then(|entries| entries.iter_mut().find(|f| f.entry.matches(id)))
        else {
            return Ok(None);
        };
        if found.claim.is_some() {
            return Ok(None);
        }
        found.claim = Some(number);
        Ok(Some(Box::new(MemoryClaim {
            driver: self.clone(),
            queue: queue.to_string(),
            entry: found.entry.clone(),
            number: Some(number),
        })))
    }

    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        let mut state = self.state();
        let Some(entries) = state.failures.get_mut(queue) else {
            return Ok(0);
        };
        let before = entries.len();
        entries.retain(|f| f.claim.is_some() || !ids.contains(&f.entry.id));
        Ok((before - entries.len()) as u64)
    }
}

#[async_trait]
impl Admin for MemoryDriver {
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        let state = self.state();
        Ok(state
            .queues
            .get(queue)
            .map_or_else(QueueDepth::default, |q| {
                QueueDepth::new(
                    q.ready.len() as u64,
                    Some(q.in_flight as u64),
                    Some(q.delayed as u64),
                )
            }))
    }

    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        let mut state = self.state();
        if let Some(q) = state.queues.get_mut(queue) {
            q.ready.clear();
        }
        state.failures.remove(queue);
        Ok(())
    }
}

/// A claimed memory failure entry.
struct MemoryClaim {
    driver: MemoryDriver,
    queue: String,
    entry: StoredFailure,
    /// `None` once removed or released.
    number: Option<u64>,
}

impl MemoryClaim {
    /// Ends the claim, removing the entry or giving it back.
    fn end(&mut self, remove: bool) {
        let Some(number) = self.number.take() else {
            return;
        };
        let mut state = self.driver.state();
        if let Some(entries) = state.failures.get_mut(&self.queue) {
            if let Some(i) = entries.iter().position(|f| f.claim == Some(number)) {
                if remove {
                    entries.remove(i);
                } else {
                    entries[i].claim = None;
                }
            }
        }
    }
}

impl Drop for MemoryClaim {
    fn drop(&mut self) {
        self.end(false);
    }
}

#[async_trait]
impl ClaimedFailure for MemoryClaim {
    fn entry(&self) -> &StoredFailure {
        &self.entry
    }

    async fn remove(mut self: Box<Self>) -> Result<(), DriverError> {
        self.end(true);
        Ok(())
    }

    async fn release(mut self: Box<Self>) -> Result<(), DriverError> {
        self.end(false);
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
                    .push(MemoryFailure {
                        entry: StoredFailure::from_body(record.encode()),
                        claim: None,
                    });
            }
        }
        self.stored = None;
        self.release();
        Ok(())
    }
}
