//! Testing handlers on virtual time, for any host: a [`TestQueue`] runs a
//! [`Registry`]'s jobs through the same pipeline every host runs
//! ([`Registry::deliver`]), on a clock that jumps instead of sleeping.
//!
//! A test dispatches payloads, runs the queue until it is idle, and reads
//! what happened to each message: the attempt of every delivery, the
//! settlement it got and its event, the retry delays, the tier that resolved
//! a success and the failure record of a terminal failure. A job with a
//! 30-second backoff and five deliveries finishes at once; the clock reads
//! the time the backend would have taken.
//!
//! ```
//! use std::time::Duration;
//! use jobrail::testing::{MessageState, TestQueue};
//! use jobrail::{FailureKind, Job, JobContext, JobError, Registry, Resolution};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Charge { cents: u64 }
//!
//! let job = Job::<Charge>::builder("charge")
//!     .max_deliveries(3)
//!     .backoff(Duration::from_secs(30), 2.0, Duration::ZERO)
//!     .build()
//!     .unwrap();
//! let mut registry = Registry::new();
//! registry
//!     .register(&job, |ctx: JobContext, charge: Charge| async move {
//!         match charge.cents {
//!             0 => Err(JobError::permanent("nothing to charge")),
//!             _ if ctx.attempt() < 2 => Err(JobError::new("gateway timeout")),
//!             _ => Ok(()),
//!         }
//!     })
//!     .unwrap();
//!
//! let mut queue = TestQueue::new(registry);
//! let paid = queue.send(&job, &Charge { cents: 500 });
//! let empty = queue.send(&job, &Charge { cents: 0 });
//! queue.run_until_idle();
//!
//! let report = queue.message(&paid);
//! assert_eq!(report.attempts(), [1, 2]);
//! assert_eq!(report.retry_delays(), [Some(Duration::from_secs(30))]);
//! assert_eq!(report.resolution(), Some(Resolution::TierTwo { delivery: 2, of: 3, in_process: 1 }));
//! assert_eq!(queue.now(), Duration::from_secs(30));
//! assert_eq!(queue.state(&empty), &MessageState::Failed);
//! assert_eq!(queue.message(&empty).failure_record().unwrap().kind, FailureKind::Permanent);
//! assert_eq!(queue.failure_records().len(), 1);
//! ```
//!
//! # The model
//!
//! One queue per name, consumed one delivery at a time, in the order
//! messages become visible (then the order they were sent). A message's
//! attempt starts at 1 and counts every delivery. The settlement the rules
//! decide is carried out as a backend would: `Ack` and `Reject` remove the
//! message, `Fail` stores its failure record ([`TestQueue::failure_records`])
//! and removes it, `Retry` makes it visible again after its delay (a retry
//! with no delay of its own, the driver's timing, after
//! [`TestQueue::default_retry_delay`], zero unless set). The queue has no
//! delivery limit of its own: the job's cap is the only one.
//!
//! Sleeps on the queue's runtime (backoff inside tier one,
//! [`JobContext::sleep`](crate::JobContext::sleep), timeouts) complete when
//! the virtual clock reaches their end; the clock moves to the next one
//! whenever nothing else can run ([`TestRuntime::run`]). A handler that
//! awaits something else (real I/O) is waited for in real time, at most
//! [`EXTERNAL_WAIT_LIMIT`] at a stretch. Native only: it parks the thread.
//!
//! Backend specifics are not modelled: the edge's batches and dead-letter
//! queues are in `jobrail_edge::testing::CloudflareQueues` (built on the
//! same [`TestRuntime`]), and each native driver's behaviour is checked by
//! the conformance suite.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use serde::Serialize;

use crate::{
    encode_envelope, BoxFuture, CancelToken, Clock, DeliveryHandle, Event, EventKind,
    FailureRecord, Instant, Job, Registry, Resolution, Runtime, Settlement, SettlementError,
    VirtualRuntime,
};

/// The longest [`TestRuntime::run`] waits, in real time, for something other
/// than the virtual clock (a handler awaiting real I/O) before it panics.
pub const EXTERNAL_WAIT_LIMIT: Duration = Duration::from_secs(60);

/// How many deliveries [`TestQueue::run_until_idle`] runs before it decides
/// the queue will never be idle, unless [`TestQueue::max_deliveries`] says
/// otherwise.
pub const DEFAULT_MAX_DELIVERIES: usize = 10_000;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A virtual clock with timers: a sleep completes once the clock reaches its
/// end, and [`TestRuntime::run`] moves the clock to the next end when
/// nothing else can run. (A [`VirtualRuntime`]'s own sleep moves the clock
/// as soon as it is created, even when it loses a race.)
#[derive(Clone, Default)]
pub struct TestRuntime {
    clock: VirtualRuntime,
    timers: Arc<Mutex<Timers>>,
}

impl fmt::Debug for TestRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestRuntime")
            .field("elapsed", &self.clock.elapsed())
            .field("pending_sleeps", &lock(&self.timers).waiting.len())
            .finish()
    }
}

#[derive(Default)]
struct Timers {
    next_id: u64,
    /// Polled, unfinished sleeps: their end and their waker.
    waiting: BTreeMap<u64, (Duration, Waker)>,
}

impl TestRuntime {
    /// A runtime whose clock starts at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// The virtual clock underneath (its [`VirtualRuntime::elapsed`] is the
    /// time since this runtime was made).
    pub fn clock(&self) -> &VirtualRuntime {
        &self.clock
    }

    /// Virtual time since this runtime was made.
    pub fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Moves the clock forward (sleeps due by then complete when next
    /// polled).
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// Whether a polled sleep is still waiting for the clock.
    pub fn has_pending_sleeps(&self) -> bool {
        !lock(&self.timers).waiting.is_empty()
    }

    /// Runs `future` to completion on this thread: when it waits and nothing
    /// has woken it, the clock moves to the next sleep's end; with no sleep
    /// pending, it waits in real time for a wake from elsewhere.
    ///
    /// # Panics
    ///
    /// If it waits longer than [`EXTERNAL_WAIT_LIMIT`] of real time with no
    /// sleep pending.
    pub fn run<F: Future>(&self, future: F) -> F::Output {
        let signal = Arc::new(Signal {
            woken: AtomicBool::new(false),
            thread: std::thread::current(),
        });
        let waker = Waker::from(signal.clone());
        let mut cx = Context::from_waker(&waker);
        let mut future = pin!(future);
        loop {
            signal.woken.store(false, Ordering::SeqCst);
            if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
                return output;
            }
            if signal.woken.load(Ordering::SeqCst) || self.fire_next_timer() {
                continue;
            }
            let waiting = std::time::Instant::now();
            while !signal.woken.load(Ordering::SeqCst) {
                let Some(left) = EXTERNAL_WAIT_LIMIT.checked_sub(waiting.elapsed()) else {
                    panic!(
                        "a test waited {EXTERNAL_WAIT_LIMIT:?} of real time for something other than the virtual clock"
                    );
                };
                std::thread::park_timeout(left);
            }
        }
    }

    /// Moves the clock to the earliest pending sleep's end and wakes every
    /// sleep due by then; `false` if no sleep is pending.
    fn fire_next_timer(&self) -> bool {
        let due = {
            let mut timers = lock(&self.timers);
            let Some(end) = timers.waiting.values().map(|(end, _)| *end).min() else {
                return false;
            };
            let now = self.clock.elapsed();
            if end > now {
                self.clock.advance(end - now);
            }
            let now = self.clock.elapsed();
            let ids: Vec<u64> = timers
                .waiting
                .iter()
                .filter(|(_, (end, _))| *end <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| timers.waiting.remove(&id))
                .map(|(_, waker)| waker)
                .collect::<Vec<_>>()
        };
        for waker in due {
            waker.wake();
        }
        true
    }
}

impl Clock for TestRuntime {
    fn now(&self) -> Instant {
        self.clock.now()
    }
}

impl Runtime for TestRuntime {
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(Sleep {
            end: self.clock.elapsed().saturating_add(duration),
            id: None,
            runtime: self.clone(),
        })
    }
}

struct Sleep {
    end: Duration,
    id: Option<u64>,
    runtime: TestRuntime,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let mut timers = lock(&this.runtime.timers);
        if this.runtime.clock.elapsed() >= this.end {
            if let Some(id) = this.id.take() {
                timers.waiting.remove(&id);
            }
            return Poll::Ready(());
        }
        let id = *this.id.get_or_insert_with(|| {
            timers.next_id += 1;
            timers.next_id
        });
        timers.waiting.insert(id, (this.end, cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            lock(&self.runtime.timers).waiting.remove(&id);
        }
    }
}

/// Wakes the thread running [`TestRuntime::run`].
struct Signal {
    woken: AtomicBool,
    thread: std::thread::Thread,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// Where a message stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageState {
    /// Waiting for a delivery.
    Pending,
    /// Acknowledged after success.
    Acked,
    /// Rejected by its handler (`Settlement::Reject`): removed, no record.
    Rejected,
    /// Failed terminally: its record is in [`MessageReport::failure_record`].
    Failed,
}

/// One delivery of a message and what the rules decided for it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryReport {
    /// The delivery's attempt (first = 1).
    pub attempt: u32,
    /// When it was delivered, on the virtual clock.
    pub delivered_at: Duration,
    /// When its settlement was carried out, on the virtual clock.
    pub settled_at: Duration,
    /// The settlement the rules decided.
    pub settlement: Settlement,
    /// The event reported for it.
    pub event: Event,
}

impl DeliveryReport {
    /// Handler executions during this delivery (tier one's in-process
    /// retries included; 0 when no handler ran).
    pub fn executions(&self) -> u32 {
        self.event.executions
    }
}

/// The life of one message.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageReport {
    /// The message id (for a typed send, the envelope's).
    pub id: String,
    /// The queue it was sent to.
    pub queue: String,
    /// Its body.
    pub body: Vec<u8>,
    /// When it was sent, on the virtual clock.
    pub sent_at: Duration,
    /// Its deliveries, in order.
    pub deliveries: Vec<DeliveryReport>,
    /// Where it stands now.
    pub state: MessageState,
    record: Option<Box<FailureRecord>>,
}

impl MessageReport {
    /// The attempt of each delivery, in order (`[1, 2, 3]` for a message
    /// delivered three times).
    pub fn attempts(&self) -> Vec<u32> {
        self.deliveries.iter().map(|d| d.attempt).collect()
    }

    /// Handler executions over all deliveries.
    pub fn executions(&self) -> u32 {
        self.deliveries.iter().map(DeliveryReport::executions).sum()
    }

    /// The delay each retry asked for, in order (`None`: the driver's
    /// timing).
    pub fn retry_delays(&self) -> Vec<Option<Duration>> {
        self.deliveries
            .iter()
            .filter_map(|d| match d.settlement {
                Settlement::Retry { delay, .. } => Some(delay),
                _ => None,
            })
            .collect()
    }

    /// Which tier resolved its success, once it succeeded.
    pub fn resolution(&self) -> Option<Resolution> {
        self.deliveries.last().and_then(|d| match d.event.kind {
            EventKind::Succeeded { resolution } => Some(resolution),
            _ => None,
        })
    }

    /// Its failure record, if it failed terminally.
    pub fn failure_record(&self) -> Option<&FailureRecord> {
        self.record.as_deref()
    }
}

struct Waiting {
    id: String,
    queue: String,
    body: Vec<u8>,
    attempt: u32,
    visible_at: Duration,
    order: u64,
}

/// A queue on virtual time for testing handlers. See the
/// [module documentation](self).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail::testing::{MessageState, TestQueue};
/// use jobrail::{FailureKind, Job, JobContext, JobError, Registry};
///
/// let job = Job::<u32>::builder("flaky")
///     .max_deliveries(3)
///     .backoff(Duration::from_secs(30), 2.0, Duration::ZERO)
///     .build()?;
/// let mut registry = Registry::new();
/// registry.register(&job, |_ctx: JobContext, _n: u32| async move {
///     Err::<(), _>(JobError::new("upstream busy"))
/// })?;
///
/// let mut queue = TestQueue::new(registry);
/// let sent = queue.send(&job, &1);
/// queue.run_until_idle();
/// assert_eq!(queue.state(&sent), &MessageState::Failed);
/// assert_eq!(queue.message(&sent).attempts(), [1, 2, 3]);
/// assert_eq!(queue.failure_records()[0].kind, FailureKind::AttemptsExhausted);
/// assert_eq!(queue.now(), Duration::from_secs(30 + 60)); // no time passed
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TestQueue {
    registry: Registry,
    runtime: TestRuntime,
    shared: Arc<dyn Runtime>,
    waiting: Vec<Waiting>,
    reports: Vec<MessageReport>,
    by_id: HashMap<String, usize>,
    records: Vec<FailureRecord>,
    default_retry_delay: Duration,
    max_deliveries: usize,
    sent: u64,
}

impl fmt::Debug for TestQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestQueue")
            .field("now", &self.now())
            .field("waiting", &self.waiting.len())
            .field("messages", &self.reports.len())
            .field("failure_records", &self.records.len())
            .finish_non_exhaustive()
    }
}

impl TestQueue {
    /// A queue running `registry`'s jobs, its clock at zero.
    pub fn new(registry: Registry) -> Self {
        let runtime = TestRuntime::new();
        TestQueue {
            registry,
            shared: Arc::new(runtime.clone()),
            runtime,
            waiting: Vec::new(),
            reports: Vec::new(),
            by_id: HashMap::new(),
            records: Vec::new(),
            default_retry_delay: Duration::ZERO,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            sent: 0,
        }
    }

    /// The delay of a retry that asks for none (the driver's timing, as a
    /// job without a backoff has); zero unless set.
    pub fn default_retry_delay(&mut self, delay: Duration) -> &mut Self {
        self.default_retry_delay = delay;
        self
    }

    /// How many deliveries [`run_until_idle`](Self::run_until_idle) runs
    /// before it panics ([`DEFAULT_MAX_DELIVERIES`] unless set).
    pub fn max_deliveries(&mut self, deliveries: usize) -> &mut Self {
        self.max_deliveries = deliveries;
        self
    }

    /// The registry it runs (its stats count what ran).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The runtime the handlers get (its clock is [`TestQueue::now`]).
    pub fn runtime(&self) -> &TestRuntime {
        &self.runtime
    }

    /// Sends `payload` as `job`, visible at once; returns its message id.
    ///
    /// # Panics
    ///
    /// If the payload does not serialize to JSON.
    pub fn send<P: Serialize>(&mut self, job: &Job<P>, payload: &P) -> String {
        self.send_after(job, payload, Duration::ZERO)
    }

    /// Sends `payload` as `job`, visible after `delay`; returns its id.
    ///
    /// # Panics
    ///
    /// If the payload does not serialize to JSON.
    pub fn send_after<P: Serialize>(
        &mut self,
        job: &Job<P>,
        payload: &P,
        delay: Duration,
    ) -> String {
        let (id, body) = encode_envelope(job.name(), payload, &BTreeMap::new())
            .unwrap_or_else(|e| panic!("the payload of `{}` does not encode: {e}", job.name()));
        self.enqueue(job.queue(), id.clone(), body, delay);
        id
    }

    /// Sends a body as is to `queue` (a malformed message, an unknown job
    /// name); returns the id it was given.
    pub fn send_raw(&mut self, queue: &str, body: impl Into<Vec<u8>>) -> String {
        let id = crate::new_message_id();
        self.enqueue(queue, id.clone(), body.into(), Duration::ZERO);
        id
    }

    fn enqueue(&mut self, queue: &str, id: String, body: Vec<u8>, delay: Duration) {
        let now = self.now();
        self.sent += 1;
        self.waiting.push(Waiting {
            id: id.clone(),
            queue: queue.to_string(),
            body: body.clone(),
            attempt: 1,
            visible_at: now.saturating_add(delay),
            order: self.sent,
        });
        self.by_id.insert(id.clone(), self.reports.len());
        self.reports.push(MessageReport {
            id,
            queue: queue.to_string(),
            body,
            sent_at: now,
            deliveries: Vec::new(),
            state: MessageState::Pending,
            record: None,
        });
    }

    /// Moves the clock forward.
    pub fn advance(&mut self, by: Duration) {
        self.runtime.advance(by);
    }

    /// Virtual time since the queue was made.
    pub fn now(&self) -> Duration {
        self.runtime.elapsed()
    }

    /// Runs the next delivery (moving the clock to when its message becomes
    /// visible) and carries out its settlement; `None` when no message
    /// waits.
    pub fn run_next(&mut self) -> Option<&DeliveryReport> {
        let next = self
            .waiting
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| (w.visible_at, w.order))
            .map(|(i, _)| i)?;
        let waiting = self.waiting.swap_remove(next);
        let now = self.now();
        if waiting.visible_at > now {
            self.runtime.advance(waiting.visible_at - now);
        }
        let delivered_at = self.now();
        let attempt = waiting.attempt;
        let handle = TestDelivery {
            body: &waiting.body,
            attempt: waiting.attempt,
        };
        let delivered = self.runtime.run(self.registry.deliver(
            &waiting.queue,
            handle,
            &self.shared,
            &CancelToken::new(),
        ));
        let settled_at = self.now();
        let processed = delivered.processed;
        let index = self.by_id[&waiting.id];
        let state = match &processed.settlement {
            Settlement::Ack => MessageState::Acked,
            Settlement::Reject => MessageState::Rejected,
            Settlement::Fail(record) => {
                self.records.push((**record).clone());
                self.reports[index].record = Some(record.clone());
                MessageState::Failed
            }
            Settlement::Retry { delay, .. } => {
                let delay = delay.unwrap_or(self.default_retry_delay);
                self.sent += 1;
                self.waiting.push(Waiting {
                    attempt: waiting.attempt.saturating_add(1),
                    visible_at: settled_at.saturating_add(delay),
                    order: self.sent,
                    ..waiting
                });
                MessageState::Pending
            }
        };
        let report = &mut self.reports[index];
        report.state = state;
        report.deliveries.push(DeliveryReport {
            attempt,
            delivered_at,
            settled_at,
            settlement: processed.settlement,
            event: processed.event,
        });
        report.deliveries.last()
    }

    /// Runs deliveries until no message waits, moving the clock to each;
    /// returns how many ran.
    ///
    /// # Panics
    ///
    /// If messages still wait after [`max_deliveries`](Self::max_deliveries)
    /// deliveries (a job with no cap that always fails never ends).
    pub fn run_until_idle(&mut self) -> usize {
        let mut deliveries = 0;
        while !self.waiting.is_empty() {
            if deliveries >= self.max_deliveries {
                panic!(
                    "the queue is not idle after {deliveries} deliveries (a job without a cap that keeps failing? raise the limit with max_deliveries if that is expected): {self:?}"
                );
            }
            self.run_next();
            deliveries += 1;
        }
        deliveries
    }

    /// The life of the message `id`.
    ///
    /// # Panics
    ///
    /// If no message has that id.
    pub fn message(&self, id: &str) -> &MessageReport {
        self.find(id)
            .unwrap_or_else(|| panic!("no message with id `{id}`"))
    }

    /// The life of the message `id`, if there is one.
    pub fn find(&self, id: &str) -> Option<&MessageReport> {
        self.by_id.get(id).map(|&i| &self.reports[i])
    }

    /// Where the message `id` stands.
    ///
    /// # Panics
    ///
    /// If no message has that id.
    pub fn state(&self, id: &str) -> &MessageState {
        &self.message(id).state
    }

    /// Every message sent, in order.
    pub fn messages(&self) -> &[MessageReport] {
        &self.reports
    }

    /// Every failure record stored, in order.
    pub fn failure_records(&self) -> &[FailureRecord] {
        &self.records
    }

    /// How many messages wait for a delivery.
    pub fn pending(&self) -> usize {
        self.waiting.len()
    }
}

/// The handle of one delivery: the settlement is carried out by the queue
/// after the pipeline returns, from what the rules decided.
struct TestDelivery<'a> {
    body: &'a [u8],
    attempt: u32,
}

impl DeliveryHandle for TestDelivery<'_> {
    fn body(&self) -> &[u8] {
        self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn settle<'a>(self, _settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a,
    {
        Box::pin(std::future::ready(Ok(())))
    }
}

/// A claim store that stops a scheduler between a tick's send and its
/// record, as a kill there would: the completion of the claim of a tick of
/// `schedule` later than `after` never answers; everything else goes to the
/// store it wraps. The scheduler using it sends its first such tick and
/// hangs; another scheduler on the wrapped store takes the tick over when
/// its lease ends and sends it again. For testing what a queue, a
/// `TickSink` or a handler does with that copy (which carries the first
/// send's message id, [`TickDispatch::message_id`](crate::TickDispatch::message_id)).
/// The ticks up to `after` pass: a scheduler marks those fired at its
/// start, without sending them.
pub struct StopBeforeRecord<S> {
    inner: S,
    prefix: String,
    after: i64,
}

impl<S: crate::ClaimStore> StopBeforeRecord<S> {
    /// Wraps `inner` for the ticks of `schedule` later than `after`.
    pub fn new(inner: S, schedule: &crate::Schedule, after: crate::Tick) -> Self {
        StopBeforeRecord {
            inner,
            prefix: format!("schedule:{}:", schedule.name()),
            after: after.unix_seconds(),
        }
    }
}

impl<S> fmt::Debug for StopBeforeRecord<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StopBeforeRecord")
            .field("prefix", &self.prefix)
            .field("after", &self.after)
            .finish()
    }
}

impl<S: crate::ClaimStore> crate::ClaimStore for StopBeforeRecord<S> {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> crate::BoxFuture<'a, Result<crate::Claim, crate::ClaimError>> {
        self.inner.claim(key, lease)
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
    ) -> crate::BoxFuture<'a, Result<(), crate::ClaimError>> {
        let tick = key
            .strip_prefix(self.prefix.as_str())
            .and_then(crate::Tick::parse)
            .map(|t| t.unix_seconds());
        match tick {
            Some(t) if t > self.after => Box::pin(std::future::pending()),
            _ => self.inner.complete(key, fence),
        }
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
    ) -> crate::BoxFuture<'a, Result<(), crate::ClaimError>> {
        self.inner.release(key, fence)
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> crate::BoxFuture<'a, Result<(), crate::ClaimError>> {
        self.inner.extend(key, fence, lease)
    }

    fn state<'a>(
        &'a self,
        key: &'a str,
    ) -> crate::BoxFuture<'a, Result<crate::ClaimState, crate::ClaimError>> {
        self.inner.state(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps_end_in_order_on_the_virtual_clock() {
        let runtime = TestRuntime::new();
        let order = Arc::new(Mutex::new(Vec::new()));
        let sleeper = |secs: u64| {
            let (runtime, order) = (runtime.clone(), order.clone());
            async move {
                runtime.sleep(Duration::from_secs(secs)).await;
                lock(&order).push((secs, runtime.elapsed()));
            }
        };
        runtime.run(futures_util::future::join3(
            sleeper(3),
            sleeper(1),
            sleeper(2),
        ));
        let s = Duration::from_secs;
        assert_eq!(*lock(&order), [(1, s(1)), (2, s(2)), (3, s(3))]);
        assert_eq!(runtime.elapsed(), s(3));
    }

    #[test]
    fn a_sleep_that_loses_a_race_does_not_move_the_clock() {
        let runtime = TestRuntime::new();
        let short = runtime.sleep(Duration::from_secs(1));
        let long = runtime.sleep(Duration::from_secs(30));
        runtime.run(futures_util::future::select(short, long));
        assert_eq!(runtime.elapsed(), Duration::from_secs(1));
        assert!(
            !runtime.has_pending_sleeps(),
            "the dropped sleep is forgotten"
        );
    }
}
