use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
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
use crate::kit::{lock, Lifecycle};

const NAME: &str = "memory";

/// Settings for the memory driver.
#[derive(Debug, Clone)]
pub struct MemoryConfig {
    /// Longest retry delay a settlement may request (`None`: no limit).
    /// Longer requests fail as [`ErrorKind::Unsupported`] and the message is
    /// held for [`refused_hold`](Self::refused_hold); a consumer refuses to
    /// start with a job that declares longer delays.
    pub max_retry_delay: Option<Duration>,
    /// How long a message whose retry the driver refused is held before it
    /// is delivered again (default [`jobrail::REFUSED_SETTLEMENT_HOLD`], 30
    /// s), as a broker's visibility timeout or AckWait would hold it: a
    /// refused settlement never becomes a hot loop.
    pub refused_hold: Duration,
    /// The longest dispatch delay one message holds (`None`, the default:
    /// any). A longer delay is carried in steps, as on a broker with a
    /// maximum delay ([`Capabilities::max_dispatch_delay`]): for tests of
    /// long delays on the memory driver.
    pub max_dispatch_delay: Option<Duration>,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            max_retry_delay: None,
            refused_hold: jobrail::REFUSED_SETTLEMENT_HOLD,
            max_dispatch_delay: None,
        }
    }
}

impl MemoryConfig {
    /// Sets [`max_retry_delay`](Self::max_retry_delay).
    pub fn max_retry_delay(mut self, max: Option<Duration>) -> Self {
        self.max_retry_delay = max;
        self
    }

    /// Sets [`max_dispatch_delay`](Self::max_dispatch_delay).
    pub fn max_dispatch_delay(mut self, max: Option<Duration>) -> Self {
        self.max_dispatch_delay = max;
        self
    }

    /// Sets [`refused_hold`](Self::refused_hold).
    pub fn refused_hold(mut self, hold: Duration) -> Self {
        self.refused_hold = hold;
        self
    }
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
    delayed: usize,
    in_flight: usize,
}

/// One queue: its own lock, so deliveries and settlements of a queue never
/// touch the driver-wide map (they hold the queue itself, not its name).
struct Queue {
    name: String,
    state: Mutex<QueueState>,
    notify: Notify,
}

impl Queue {
    fn new(name: &str) -> Self {
        Queue {
            name: name.to_string(),
            state: Mutex::default(),
            notify: Notify::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, QueueState> {
        lock(&self.state)
    }
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
    queues: HashMap<String, Arc<Queue>>,
    failures: HashMap<String, Vec<MemoryFailure>>,
    timers: Vec<AbortHandle>,
}

struct Inner {
    config: MemoryConfig,
    /// Marked stopped by `stop` just before `stopped`; gives the error.
    lifecycle: Lifecycle,
    /// Set before `stop` clears each queue under that queue's lock, and
    /// read under the queue's lock wherever work is added, so nothing is
    /// queued after a stop. One atomic load: every delivery and settlement
    /// reads it, from every worker thread.
    stopped: AtomicBool,
    state: Mutex<State>,
}

impl Inner {
    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// [`ErrorKind::Stopped`] once stopped.
    fn check_running(&self) -> Result<(), DriverError> {
        if self.is_stopped() {
            // `lifecycle` was marked first: this is the stopped error.
            self.lifecycle.check_running()?;
        }
        Ok(())
    }
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
/// so it is redelivered with a higher attempt number, as a broker would. A
/// retry the driver refuses (a delay above
/// [`MemoryConfig::max_retry_delay`]) is held for
/// [`MemoryConfig::refused_hold`] first, as a broker's lease would hold it.
///
/// It has no size limit ([`Capabilities::max_message_bytes`] is `None`):
/// a message is only as large as memory allows.
///
/// Each queue has a lock of its own, apart from the driver-wide one (the
/// map of queues, the failure entries, the retry timers): a subscription
/// and its deliveries hold their queue, so taking a delivery is one lock of
/// the queue and settling it is one more, with no lookup or copy of the
/// queue's name. [`Driver::send_batch`] puts a batch's undelayed messages
/// in under one lock of the queue, in order, behind one wake-up; a delayed
/// message gets its own timer, as with [`Driver::send`].
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
    ///
    /// # Example
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use jobrail::Job;
    /// use jobrail_native::{MemoryConfig, MemoryDriver, Producer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Behaves like a broker whose longest retry delay is one hour.
    /// let driver = Arc::new(MemoryDriver::new(
    ///     MemoryConfig::default().max_retry_delay(Some(Duration::from_secs(3600))),
    /// ));
    /// let job = Job::<String>::builder("echo").max_deliveries(3).build()?;
    /// Producer::new(driver.clone()).dispatch(&job).send(&"hi".to_string()).await?;
    /// assert_eq!(driver.depth("default"), 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(config: MemoryConfig) -> Self {
        MemoryDriver {
            inner: Arc::new(Inner {
                config,
                lifecycle: Lifecycle::new(NAME),
                stopped: AtomicBool::new(false),
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

    /// `queue`, created on first use.
    fn queue(&self, name: &str) -> Arc<Queue> {
        let mut state = self.state();
        if let Some(queue) = state.queues.get(name) {
            return queue.clone();
        }
        let queue = Arc::new(Queue::new(name));
        state.queues.insert(name.to_string(), queue.clone());
        queue
    }

    /// `queue` if it has been used.
    fn existing(&self, name: &str) -> Option<Arc<Queue>> {
        self.state().queues.get(name).cloned()
    }

    /// Messages on `queue` that are ready, delayed or being handled.
    pub fn depth(&self, queue: &str) -> usize {
        self.existing(queue).map_or(0, |q| {
            let q = q.state();
            q.ready.len() + q.delayed + q.in_flight
        })
    }

    /// Messages on `queue` ready for delivery now.
    pub fn ready(&self, queue: &str) -> usize {
        self.existing(queue).map_or(0, |q| q.state().ready.len())
    }

    fn enqueue(&self, queue: &Queue, stored: Stored, front: bool) -> Result<(), DriverError> {
        {
            let mut q = queue.state();
            self.inner.check_running()?;
            if front {
                q.ready.push_front(stored);
            } else {
                q.ready.push_back(stored);
            }
        }
        queue.notify.notify_one();
        Ok(())
    }

    fn enqueue_later(
        &self,
        queue: &Arc<Queue>,
        stored: Stored,
        delay: Duration,
    ) -> Result<(), DriverError> {
        let mut state = self.state();
        {
            let mut q = queue.state();
            self.inner.check_running()?;
            q.delayed += 1;
        }
        let driver = self.clone();
        let queue = queue.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            {
                let mut q = queue.state();
                if driver.inner.is_stopped() {
                    return;
                }
                q.delayed -= 1;
                q.ready.push_back(stored);
            }
            queue.notify.notify_one();
        });
        state.timers.retain(|t| !t.is_finished());
        state.timers.push(timer.abort_handle());
        Ok(())
    }

    /// Sends one message to `queue` (now, or after its delay).
    fn send_to(&self, queue: &Arc<Queue>, message: Outgoing) -> Result<(), DriverError> {
        let stored = Stored::new(message.body);
        match message.delay {
            Some(delay) if !delay.is_zero() => self.enqueue_later(queue, stored, delay),
            _ => self.enqueue(queue, stored, false),
        }
    }
}

impl Stored {
    fn new(body: Vec<u8>) -> Self {
        Stored {
            body,
            deliveries: 0,
            shutdown_returns: 0,
        }
    }
}

#[cfg(feature = "testing")]
impl MemoryDriver {
    /// Puts `body` among `queue`'s failure entries as it is, as something
    /// other than the consumer might have (a body that is not a failure
    /// record, say). For the conformance suite; not a supported API.
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let mut state = self.state();
        self.inner.check_running()?;
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
            refused_hold: self.inner.config.refused_hold,
            max_dispatch_delay: self.inner.config.max_dispatch_delay,
            ..Capabilities::full()
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.send_to(&self.queue(queue), message)
    }

    /// The messages without a delay go in under one lock of the queue, in
    /// order, behind one wake-up; each delayed one gets its own timer, as
    /// [`send`](Driver::send) gives it. A stopped driver refuses every
    /// message ([`ErrorKind::Stopped`]).
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let target = self.queue(queue);
        let mut results = Vec::with_capacity(messages.len());
        let mut delayed = Vec::new();
        let mut added = false;
        {
            let mut q = target.state();
            for message in messages {
                let result = match self.inner.check_running() {
                    Err(stopped) => Err(stopped),
                    Ok(()) if message.delay.is_some_and(|d| !d.is_zero()) => {
                        // Its timer starts once the queue's lock is let go.
                        delayed.push((results.len(), message));
                        Ok(())
                    }
                    Ok(()) => {
                        q.ready.push_back(Stored::new(message.body));
                        added = true;
                        Ok(())
                    }
                };
                results.push(result);
            }
        }
        if added {
            target.notify.notify_one();
        }
        for (i, message) in delayed {
            results[i] = self.send_to(&target, message);
        }
        results
    }

    async fn subscribe(
        &self,
        queue: &str,
        _prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.check_running()?;
        Ok(Box::new(MemorySubscription {
            driver: self.clone(),
            queue: self.queue(queue),
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
        self.inner.stopped.store(true, Ordering::SeqCst);
        let mut state = self.state();
        for timer in state.timers.drain(..) {
            timer.abort();
        }
        for queue in state.queues.values() {
            {
                let mut q = queue.state();
                q.ready.clear();
                q.delayed = 0;
            }
            queue.notify.notify_waiters();
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
        // A set: a bulk removal names thousands of ids.
        let ids: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        let mut state = self.state();
        let Some(entries) = state.failures.get_mut(queue) else {
            return Ok(0);
        };
        let before = entries.len();
        entries.retain(|f| f.claim.is_some() || !ids.contains(f.entry.id.as_str()));
        Ok((before - entries.len()) as u64)
    }
}

#[async_trait]
impl Admin for MemoryDriver {
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        Ok(self.existing(queue).map_or_else(QueueDepth::default, |q| {
            let q = q.state();
            QueueDepth::new(
                q.ready.len() as u64,
                Some(q.in_flight as u64),
                Some(q.delayed as u64),
            )
        }))
    }

    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        let mut state = self.state();
        if let Some(q) = state.queues.get(queue) {
            q.state().ready.clear();
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
    queue: Arc<Queue>,
}

#[async_trait]
impl Subscription for MemorySubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        loop {
            let notified = self.queue.notify.notified();
            let taken = {
                let mut q = self.queue.state();
                if self.driver.inner.is_stopped() {
                    return None;
                }
                q.ready.pop_front().map(|mut stored| {
                    stored.deliveries = stored.deliveries.saturating_add(1);
                    q.in_flight += 1;
                    (stored, !q.ready.is_empty())
                })
            };
            if let Some((stored, more)) = taken {
                if more {
                    // Another subscription of the queue may be waiting on
                    // the wake-up this one took.
                    self.queue.notify.notify_one();
                }
                let attempt = stored.deliveries;
                return Some(Ok(Box::new(MemoryDelivery {
                    driver: self.driver.clone(),
                    queue: self.queue.clone(),
                    stored: Some(stored),
                    attempt,
                })));
            }
            notified.await;
        }
    }
}

struct MemoryDelivery {
    driver: MemoryDriver,
    queue: Arc<Queue>,
    stored: Option<Stored>,
    attempt: u32,
}

impl MemoryDelivery {
    /// No longer in flight; `requeue` goes back to the front (a dropped
    /// delivery) or the back (an immediate retry) of the queue, under the
    /// same lock, unless the driver has stopped.
    fn release(&mut self, requeue: Option<(Stored, bool)>) -> Result<(), DriverError> {
        let added = {
            let mut q = self.queue.state();
            q.in_flight = q.in_flight.saturating_sub(1);
            match requeue {
                None => false,
                Some((stored, front)) => {
                    self.driver.inner.check_running()?;
                    if front {
                        q.ready.push_front(stored);
                    } else {
                        q.ready.push_back(stored);
                    }
                    true
                }
            }
        };
        if added {
            self.queue.notify.notify_one();
        }
        Ok(())
    }
}

impl Drop for MemoryDelivery {
    /// Unsettled: back to the front of the queue, count kept.
    fn drop(&mut self) {
        if let Some(stored) = self.stored.take() {
            let _ = self.release(Some((stored, true)));
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
        if let Err(stopped) = self.driver.inner.check_running() {
            // Dropping would try to requeue; a stopped driver keeps nothing.
            self.stored = None;
            let _ = self.release(None);
            return Err(stopped);
        }
        match settlement {
            Settlement::Ack | Settlement::Reject => {}
            Settlement::Retry { delay, shutdown } => {
                let delay = delay.unwrap_or(Duration::ZERO);
                if let Some(max) = self.driver.inner.config.max_retry_delay {
                    if delay > max {
                        // Kept, but held as a lease would hold it: handed
                        // straight back, it would loop.
                        let hold = self.driver.inner.config.refused_hold;
                        let stored = self
                            .stored
                            .take()
                            .expect("unsettled delivery has its message");
                        let _ = self.release(None);
                        self.driver.enqueue_later(&self.queue, stored, hold)?;
                        return Err(DriverError::new(
                            NAME,
                            ErrorKind::Unsupported,
                            format!(
                                "retry delay {delay:?} exceeds this driver's maximum {max:?}; the \
                                 message is held for {hold:?} (refused_hold), then delivered again"
                            ),
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
                return if delay.is_zero() {
                    self.release(Some((stored, false)))
                } else {
                    let _ = self.release(None);
                    self.driver.enqueue_later(&self.queue, stored, delay)
                };
            }
            Settlement::Fail(record) => {
                self.driver
                    .state()
                    .failures
                    .entry(self.queue.name.clone())
                    .or_default()
                    .push(MemoryFailure {
                        entry: StoredFailure::from_body(record.encode()),
                        claim: None,
                    });
            }
        }
        self.stored = None;
        self.release(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outgoing(body: &str, delay: Option<Duration>) -> Outgoing {
        Outgoing {
            id: body.into(),
            body: body.as_bytes().to_vec(),
            delay,
        }
    }

    async fn take(subscription: &mut Box<dyn Subscription>) -> Box<dyn Delivery> {
        subscription.next().await.unwrap().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_keeps_order_and_each_messages_delay() {
        let driver = MemoryDriver::default();
        let results = driver
            .send_batch(
                "q",
                vec![
                    outgoing("a", None),
                    outgoing("later", Some(Duration::from_secs(5))),
                    outgoing("b", Some(Duration::ZERO)),
                    outgoing("c", None),
                ],
            )
            .await;
        assert_eq!(results.len(), 4);
        assert!(results.iter().all(Result::is_ok));
        assert_eq!((driver.ready("q"), driver.depth("q")), (3, 4));

        let mut subscription = driver.subscribe("q", 8).await.unwrap();
        for expected in ["a", "b", "c"] {
            let delivery = take(&mut subscription).await;
            assert_eq!(delivery.body(), expected.as_bytes());
            assert_eq!(delivery.attempt(), 1);
            delivery.settle(&Settlement::Ack).await.unwrap();
        }
        assert_eq!((driver.ready("q"), driver.depth("q")), (0, 1));
        tokio::time::advance(Duration::from_secs(5)).await;
        let delivery = take(&mut subscription).await;
        assert_eq!(delivery.body(), b"later");
        delivery.settle(&Settlement::Ack).await.unwrap();
        assert_eq!(driver.depth("q"), 0);
    }

    #[tokio::test]
    async fn a_batch_wakes_a_waiting_subscription_and_a_stopped_driver_refuses_each_message() {
        let driver = MemoryDriver::default();
        let mut subscription = driver.subscribe("q", 8).await.unwrap();
        let waiting = tokio::spawn(async move {
            let delivery = take(&mut subscription).await;
            let body = delivery.body().to_vec();
            delivery.settle(&Settlement::Ack).await.unwrap();
            body
        });
        tokio::task::yield_now().await;
        let results = driver
            .send_batch("q", vec![outgoing("x", None), outgoing("y", None)])
            .await;
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(waiting.await.unwrap(), b"x");
        assert_eq!(driver.ready("q"), 1);

        driver.stop().await.unwrap();
        let results = driver
            .send_batch(
                "q",
                vec![
                    outgoing("z", None),
                    outgoing("w", Some(Duration::from_secs(1))),
                ],
            )
            .await;
        assert_eq!(results.len(), 2);
        for result in results {
            assert_eq!(result.unwrap_err().kind(), ErrorKind::Stopped);
        }
        assert_eq!(driver.depth("q"), 0);
    }

    #[tokio::test]
    async fn an_unsettled_delivery_goes_back_to_the_front_with_its_count() {
        let driver = MemoryDriver::default();
        driver
            .send_batch("q", vec![outgoing("a", None), outgoing("b", None)])
            .await;
        let mut subscription = driver.subscribe("q", 8).await.unwrap();
        drop(take(&mut subscription).await);
        assert_eq!((driver.ready("q"), driver.depth("q")), (2, 2));
        let again = take(&mut subscription).await;
        assert_eq!((again.body(), again.attempt()), (&b"a"[..], 2));
    }
}
