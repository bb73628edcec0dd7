//! Model backends: one [`Model`] driver whose [`Semantics`] mimic a real
//! backend's counting, redelivery and settlement, recording everything into
//! one trace.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{Event, EventKind, EventSink, FailureKind, FailureRecord, MemoryClaims, Settlement};
use jobrail_native::{
    Capabilities, Delivery, Driver, DriverError, ErrorKind, Outgoing, Subscription, TokioRuntime,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Which backend a model mimics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Semantics {
    /// The in-memory driver.
    Memory,
    /// RabbitMQ (quorum queue, delay buckets).
    Rabbit,
    /// Amazon SQS (visibility timeouts).
    Sqs,
    /// NATS JetStream (AckWait, Nak, Term).
    Nats,
    /// Cloudflare Workers Queues (batches, implicit ack).
    Cloudflare,
    /// The Postgres queue (`jobrail_postgres::PgDriver`): a message is a
    /// row; a fetch counts an attempt and leases the row (30 s, as the driver's default,
    /// renewed every half lease while the delivery is held); settlements
    /// fenced by the lease; fail deletes the row and stores the record in
    /// one statement.
    Postgres,
}

/// SQS visibility timeout, NATS AckWait and the Postgres lease (each
/// driver's default).
pub(crate) const LEASE: Duration = Duration::from_secs(30);
/// SQS's limit on visibility from receive.
pub(crate) const SQS_MAX: Duration = Duration::from_secs(12 * 3600);
/// Cloudflare's longest retry delay.
pub(crate) const CF_MAX: Duration = Duration::from_secs(24 * 3600);
/// How long a message whose settlement was refused stays away where the
/// backend has no lease (the memory driver, RabbitMQ, the edge's own retry).
pub(crate) const REFUSED_HOLD: Duration = jobrail::REFUSED_SETTLEMENT_HOLD;
/// SQS's longest dispatch delay (`DelaySeconds`), the SQS driver's default
/// `max_dispatch_delay`.
pub(crate) const SQS_MAX_DELAY: Duration = Duration::from_secs(900);
/// The simulation's wall clock at the start of a run, in Unix milliseconds:
/// due times ([`jobrail::Envelope::due_ms`]) are written and compared on it,
/// the virtual time elapsed added. It lies years before any real clock, so
/// the real consumers' own wall-clock check
/// (`jobrail::delay_remaining(body, jobrail::unix_now_ms())`) finds every
/// body due: the model takes the consumer's step on virtual time instead
/// (as it hands a delivery out), with the same shared functions.
pub const DELAY_EPOCH_MS: u64 = 1_600_000_000_000;

impl Semantics {
    /// The least time a message whose settlement was refused stays away:
    /// the lease (SQS's visibility, NATS's AckWait), half the Postgres
    /// lease (the row is held until its lease ends, at least half a lease
    /// after its last renewal: what `PgDriver` reports), or the hold of a
    /// backend without one.
    pub fn refused_hold(self) -> Duration {
        match self {
            Semantics::Memory | Semantics::Rabbit | Semantics::Cloudflare => REFUSED_HOLD,
            Semantics::Sqs | Semantics::Nats => LEASE,
            Semantics::Postgres => LEASE / 2,
        }
    }

    /// The longest dispatch delay one message holds
    /// ([`Capabilities::max_dispatch_delay`] of the driver's default
    /// configuration; `None`: any): RabbitMQ's largest bucket, SQS's 900 s,
    /// the edge's 24 h ([`jobrail_edge::MAX_DELAY`]); memory, NATS (its
    /// driver holds a delay itself) and Postgres any.
    pub fn longest_leg(self) -> Option<Duration> {
        match self {
            Semantics::Memory | Semantics::Nats | Semantics::Postgres => None,
            Semantics::Rabbit => Some(Duration::from_secs(BUCKETS[BUCKETS.len() - 1])),
            Semantics::Sqs => Some(SQS_MAX_DELAY),
            Semantics::Cloudflare => Some(jobrail_edge::MAX_DELAY),
        }
    }

    /// How much later than its due time a delayed message may become
    /// deliverable (invariant 15), the model's wall clock's millisecond
    /// included: RabbitMQ the smallest bucket (a leg below it is held that
    /// long), SQS and the edge a second (whole seconds, rounded up; the
    /// edge's batch wait is zero in the model, its host taking a batch as
    /// soon as one message is there), Postgres a microsecond, memory and
    /// NATS nothing.
    pub fn delay_precision(self) -> Duration {
        let ms = Duration::from_millis(1);
        ms + match self {
            Semantics::Memory | Semantics::Nats => Duration::ZERO,
            Semantics::Rabbit => Duration::from_secs(BUCKETS[0]),
            Semantics::Sqs | Semantics::Cloudflare => Duration::from_secs(1),
            Semantics::Postgres => Duration::from_micros(1),
        }
    }

    /// How long the backend holds a new message sent with `delay` (`body`:
    /// what it carries): RabbitMQ's `dispatch_hold` (a body with a due time
    /// rounds down to a bucket, the smallest below it; any other rounds up),
    /// SQS's and the edge's whole seconds rounded up, Postgres's
    /// microseconds rounded up, memory and NATS as asked.
    pub(crate) fn dispatch_hold(self, body: &[u8], delay: Duration) -> Duration {
        if delay.is_zero() {
            return delay;
        }
        match self {
            Semantics::Memory | Semantics::Nats => delay,
            Semantics::Rabbit => {
                let buckets = BUCKETS.map(Duration::from_secs);
                if jobrail::delay_remaining(body, 0).is_some() {
                    let below = buckets.iter().copied().rfind(|b| *b <= delay);
                    below.unwrap_or(buckets[0])
                } else {
                    let above = buckets.iter().copied().find(|b| *b >= delay);
                    above.expect("a delay within the largest bucket")
                }
            }
            Semantics::Sqs | Semantics::Cloudflare => {
                Duration::from_secs(jobrail::whole_seconds_up(delay))
            }
            Semantics::Postgres => pg_micros(delay),
        }
    }

    /// The most messages a dispatch delay of `delay` costs on this backend
    /// (the dispatch and its steps), invariant 15: `ceil(delay / leg)` where
    /// a leg is held whole (SQS, the edge; one where any delay is), and on
    /// RabbitMQ, where each leg rounds down to a bucket, the greedy bound:
    /// the steps of each bucket while the rest is below the next one
    /// (`floor((min(delay, next) - 1 ms) / bucket)`, the largest
    /// `floor(delay / bucket)`), plus one for a rest below the smallest
    /// bucket. Late deliveries (a busy or restarting consumer) only shorten
    /// the rest a step sees, and each level's count stays within its bound.
    pub fn delay_messages_bound(self, delay: Duration) -> u64 {
        match (self, self.longest_leg()) {
            (Semantics::Rabbit, _) => {
                let d = delay.as_millis() as u64;
                let ms: Vec<u64> = BUCKETS.iter().map(|b| b * 1000).collect();
                let mut bound = 1;
                for (i, b) in ms.iter().enumerate() {
                    let top = match ms.get(i + 1) {
                        Some(next) => d.min(next - 1),
                        None => d,
                    };
                    bound += top / b;
                }
                bound
            }
            (_, None) => 1,
            (_, Some(leg)) => (delay.as_nanos().div_ceil(leg.as_nanos()) as u64).max(1),
        }
    }
}

/// The envelope `body` as the producer sends it with a dispatch `delay`,
/// at `now_ms` on the model's wall clock: the body (a due time written in
/// where the backend holds delays in steps) and the first leg's delay.
/// Natively as `Producer::prepare` does it (a backend with a
/// `max_dispatch_delay` gets the due time for every delay, and the first
/// leg); at the edge as `prepare_send` does (a due time only beyond 24 h).
pub(crate) fn prepare_dispatch(
    sem: Semantics,
    body: Vec<u8>,
    delay: Option<Duration>,
    now_ms: u64,
) -> (Vec<u8>, Option<Duration>) {
    let Some(delay) = delay.filter(|d| !d.is_zero()) else {
        return (body, None);
    };
    let Some(longest) = sem.longest_leg() else {
        return (body, Some(delay));
    };
    if sem == Semantics::Cloudflare && delay <= longest {
        return (body, Some(delay));
    }
    let delay_ms = u64::try_from(delay.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
    match jobrail::with_due(&body, now_ms.saturating_add(delay_ms)) {
        Some(due) => (due, Some(jobrail::delay_leg(delay, Some(longest)))),
        // Not an envelope: held whole where it fits (the producer refuses
        // a longer one; the scenarios never ask for it).
        None => (body, Some(delay.min(longest))),
    }
}

/// Postgres: when a row leased at `fetched` and held until `now` becomes
/// due again if nothing settles it: its lease was renewed every half lease
/// while held, so it ends one lease after the last renewal, between half a
/// lease and a lease from `now`.
fn pg_lease_end(fetched: Instant, now: Instant) -> Instant {
    let half = LEASE / 2;
    let renewals = (now - fetched).as_nanos() / half.as_nanos();
    fetched + half * renewals as u32 + LEASE
}

/// Postgres: a delay as the driver stores it, rounded up to the
/// microsecond (never shortened).
fn pg_micros(d: Duration) -> Duration {
    let micros = d.as_micros() + u128::from(!d.subsec_nanos().is_multiple_of(1000));
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
}

/// The RabbitMQ model's delay buckets.
pub(crate) const BUCKETS: [u64; 7] = [1, 5, 30, 120, 600, 3600, 86400];

/// A settlement as the trace shows it.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// Ack.
    Ack,
    /// Retry.
    Retry {
        /// Requested delay.
        delay: Option<Duration>,
        /// Shutdown rule.
        shutdown: bool,
    },
    /// Reject.
    Reject,
    /// Terminal failure.
    Fail {
        /// Failure kind.
        kind: FailureKind,
        /// Executions in the delivery.
        executions: u32,
    },
}

impl Settled {
    pub(crate) fn of(s: &Settlement) -> Self {
        match s {
            Settlement::Ack => Settled::Ack,
            Settlement::Retry { delay, shutdown } => Settled::Retry {
                delay: *delay,
                shutdown: *shutdown,
            },
            Settlement::Reject => Settled::Reject,
            Settlement::Fail(r) => Settled::Fail {
                kind: r.kind,
                executions: r.executions,
            },
        }
    }
}

/// Why a delivery ended without settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandon {
    /// The consumer was aborted (an injected crash).
    Crash,
    /// The connection was lost (injected).
    ConnectionLost,
    /// The backend refused the settlement (injected).
    Refused,
    /// The backend refused the settlement as unsupported.
    Unsupported,
    /// A Cloudflare instance crashed and no message could be blamed: the
    /// unsettled messages of the batch were handed back.
    InvocationAborted,
    /// A Cloudflare invocation was lost with its isolate (a handler killed
    /// the worker).
    WorkerKilled,
    /// Nothing known: a delivery task died.
    Unknown,
}

impl Abandon {
    /// Whether an injected fault explains it.
    pub fn injected(self) -> bool {
        !matches!(self, Abandon::Unknown)
    }
}

/// What a handler execution produced, as the simulation intended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eff {
    /// Ok.
    Ok,
    /// An ordinary error (including a hang past the timeout).
    Ordinary,
    /// A retry-after marker.
    RetryAfter(Duration),
    /// A permanent marker.
    Permanent,
    /// A reject marker.
    Reject,
    /// A panic.
    Panic,
    /// The breaker refused the call (ordinary).
    BreakerOpen,
    /// The handler returned `Cancelled` during shutdown.
    Cancelled,
}

/// One entry of the trace.
#[derive(Debug, Clone)]
pub enum Ev {
    /// Dispatched.
    Sent {
        /// The queue.
        queue: String,
        /// What kind of message.
        what: String,
    },
    /// Sent with a dispatch delay: `leg` asked of the backend (the first
    /// leg of a longer delay), deliverable from `available` (since the
    /// start), due at `due` (the envelope's due time, if written).
    Delayed {
        /// The delay of this message (the first leg).
        leg: Duration,
        /// When the backend makes it deliverable, since the start.
        available: Duration,
    },
    /// A delivery before its due time, carried on by the consumer's step
    /// (the shared rule on the model's wall clock): a copy delayed by the
    /// next leg, the delivery acknowledged, no handler run, no attempt.
    Step {
        /// How long before its due time it came.
        remaining: Duration,
        /// The next leg (`jobrail::delay_leg`).
        leg: Duration,
        /// When the copy is deliverable, since the start.
        available: Duration,
    },
    /// Handed to a consumer.
    Delivered {
        /// Delivery number (global).
        delivery: u64,
        /// Reported attempt.
        attempt: u32,
        /// Reported shutdown returns.
        shutdown_returns: Option<u32>,
        /// Consumer incarnation.
        incarnation: u32,
    },
    /// A handler execution began.
    Exec {
        /// The delivery it belongs to.
        delivery: Option<u64>,
        /// Reported attempt.
        attempt: u32,
        /// In-process attempt.
        in_process: u32,
        /// Scripted outcome.
        step: String,
    },
    /// What the execution produced.
    ExecResult {
        /// The delivery.
        delivery: Option<u64>,
        /// The effective outcome.
        eff: Eff,
    },
    /// A settlement was accepted.
    Accepted {
        /// The delivery.
        delivery: u64,
        /// The settlement.
        settled: Settled,
        /// Whether the delivery's consumer was shutting down.
        shutting_down: bool,
    },
    /// A settlement was refused.
    Refused {
        /// The delivery.
        delivery: u64,
        /// The settlement.
        settled: Settled,
        /// The error kind.
        kind: ErrorKind,
        /// Whether the delivery's consumer was shutting down.
        shutting_down: bool,
    },
    /// A delivery ended without settlement.
    Abandoned {
        /// The delivery.
        delivery: u64,
        /// Why.
        reason: Abandon,
    },
    /// A failure record was written.
    Record {
        /// The delivery.
        delivery: u64,
        /// The first line of the record's error text (a panic's backtrace,
        /// which follows, differs from run to run).
        reason: String,
    },
    /// The backend removed the message for good (how).
    Removed(String),
    /// The event sink received an event.
    Emitted {
        /// The event name.
        kind: String,
    },
    /// An injected fault or a consumer start.
    Fault(String),
    /// Cloudflare: this delivery's code panicked and brought down the
    /// instance running its batch; `mates` are the batch's other messages.
    InstancePanic {
        /// The delivery whose code panicked.
        delivery: u64,
        /// The other messages of the batch.
        mates: Vec<u64>,
    },
    /// A charging handler's operation on the claim store, and its answer.
    Claim {
        /// The delivery whose execution made it.
        delivery: Option<u64>,
        /// The business key.
        key: String,
        /// The operation.
        op: ClaimOp,
        /// The store's answer.
        answer: ClaimAnswer,
    },
    /// The charge of `key` happened: the scripted execution under the claim
    /// `fence` succeeded (its completion follows with no await between).
    Effect {
        /// The delivery whose execution charged.
        delivery: Option<u64>,
        /// The business key.
        key: String,
        /// The claim's fence.
        fence: u64,
    },
    /// Cloudflare: a batch-mate's panic reset the instance while this
    /// delivery was being worked on; its `executions` so far are void (their
    /// script steps are put back) and the delivery runs again.
    Interrupted {
        /// The delivery.
        delivery: u64,
        /// The executions cut short.
        executions: u32,
    },
}

/// An operation on the claim store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOp {
    /// `claim` for this lease.
    Claim(Duration),
    /// `complete` of this fence.
    Complete(u64),
    /// `release` of this fence.
    Release(u64),
}

/// What the claim store answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAnswer {
    /// `claim`: this execution holds the key under this fence.
    Claimed(u64),
    /// `claim`: the key is done.
    Done,
    /// `claim`: another holder's lease runs this much more.
    Held(Duration),
    /// `complete` or `release` succeeded.
    Ok,
    /// `complete` or `release`: the claim was lost.
    Lost,
    /// Any other error.
    Error(String),
}

/// A trace entry: when, which message, what.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Global sequence number.
    pub seq: u64,
    /// Virtual time since the start.
    pub at: Duration,
    /// The sim message number, if any.
    pub msg: Option<u64>,
    /// What happened.
    pub ev: Ev,
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self
            .msg
            .map(|m| format!("m{m}"))
            .unwrap_or_else(|| "-".into());
        write!(
            f,
            "#{:<5} {:>10.3}s {:>4} {:?}",
            self.seq,
            self.at.as_secs_f64(),
            m,
            self.ev
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MState {
    Ready,
    InFlight(u64),
    Done,
}

pub(crate) struct Msg {
    pub(crate) queue: String,
    pub(crate) body: Vec<u8>,
    pub(crate) state: MState,
    pub(crate) avail: Instant,
    order: i64,
    /// Memory deliveries / SQS receive count / NATS delivered / CF attempts
    /// / Postgres `attempts` (every fetch).
    pub(crate) count: u32,
    /// RabbitMQ: carried attempts header.
    carried: u32,
    /// RabbitMQ: x-delivery-count.
    dcount: u32,
    /// RabbitMQ: carried shutdown count; memory: accepted shutdown retries;
    /// Postgres: the `shutdowns` column.
    shutdowns: u32,
    /// SQS: the last receive; Postgres: the last fetch (its lease's start).
    receive_at: Instant,
    /// Cloudflare: the retry delay the platform should apply.
    pub(crate) cf_delay: Option<Duration>,
}

pub(crate) struct Dlv {
    pub(crate) msg: u64,
    pub(crate) incarnation: u32,
    pub(crate) attempt: u32,
    pub(crate) ended: bool,
    pub(crate) orphaned: bool,
    /// Postgres: an orphaned delivery's worker is cut off from the server
    /// until then (just past its lease's end).
    cut_until: Option<Instant>,
}

/// The shared state of a model backend and the trace.
pub(crate) struct State {
    pub(crate) msgs: BTreeMap<u64, Msg>,
    pub(crate) ids: BTreeMap<String, u64>,
    pub(crate) dlvs: BTreeMap<u64, Dlv>,
    next_dlv: u64,
    next_order: i64,
    seq: u64,
    pub(crate) trace: Vec<Entry>,
    pub(crate) crashed: BTreeSet<u32>,
    pub(crate) shutting: BTreeSet<u32>,
    pub(crate) refuse: u32,
    pub(crate) conn_epoch: u64,
    pub(crate) pending_event: Option<(u64, Settled)>,
    pub(crate) violations: Vec<(Option<u64>, u8, String)>,
    pub(crate) scripts: BTreeMap<u64, crate::scenario::Script>,
    pub(crate) deliveries: u64,
    pub(crate) cf_marks: BTreeMap<u64, Mark>,
    pub(crate) cf_active: BTreeSet<u64>,
    /// Cloudflare: when each delivery's invocation stops starting work (its
    /// budget less the settlement reserve), since the start.
    pub(crate) cf_work_end: BTreeMap<u64, Duration>,
    /// Cloudflare: the failure record just sent through the failure queue
    /// (its settlement), or refused; the message's `ack` or `retry` follows.
    cf_sent: Option<Result<(Settled, String), Settled>>,
    /// Cloudflare: a platform call waiting for the event that reports it.
    cf_call: Option<(u64, u64, CfCall)>,
    /// Cloudflare: the script steps each delivery has consumed in the
    /// current run of its invocation (put back if a crash voids them), one
    /// per execution (`None`: an execution that ran no step).
    pub(crate) cf_consumed: BTreeMap<u64, Vec<Option<crate::scenario::Step>>>,
    /// The broker's own delivery limit, in deliveries (see
    /// `Scenario::broker_limit`).
    pub(crate) broker_limit: Option<u32>,
    /// The charging job's ledger: the charges of each business key, by
    /// message and claim fence, as they happened.
    pub(crate) ledger: BTreeMap<String, Vec<(u64, u64)>>,
}

/// What a Cloudflare message was marked with during an invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    Ack,
    Retry(Option<Duration>),
    Nothing,
}

/// A call of the edge on a Cloudflare message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CfCall {
    /// `ack()`; `record`: after a failure record was sent (a terminal
    /// failure), its settlement.
    Ack { record: Option<Settled> },
    /// `retry({delaySeconds})`.
    Retry(Option<u32>),
}

/// A delivery taken: id, message, body, attempt, shutdown returns.
pub(crate) type Taken = (u64, u64, Vec<u8>, u32, Option<u32>);

/// A model backend's world: state, clock origin and wake-ups.
pub struct World {
    pub(crate) sem: Semantics,
    pub(crate) start: Instant,
    state: Mutex<State>,
    pub(crate) notify: Notify,
    /// A handler killed its worker: the run loop crashes the consumer.
    pub(crate) crash_requested: Notify,
    /// The claim store of the charging job, shared by every consumer
    /// incarnation and instance (as a database would be), on the
    /// simulation's clock.
    pub(crate) claims: MemoryClaims,
}

impl World {
    pub(crate) fn new(sem: Semantics) -> Arc<Self> {
        Arc::new(World {
            sem,
            start: Instant::now(),
            state: Mutex::new(State {
                msgs: BTreeMap::new(),
                ids: BTreeMap::new(),
                dlvs: BTreeMap::new(),
                next_dlv: 1,
                next_order: 1,
                seq: 0,
                trace: Vec::new(),
                crashed: BTreeSet::new(),
                shutting: BTreeSet::new(),
                refuse: 0,
                conn_epoch: 0,
                pending_event: None,
                violations: Vec::new(),
                scripts: BTreeMap::new(),
                deliveries: 0,
                cf_marks: BTreeMap::new(),
                cf_active: BTreeSet::new(),
                cf_work_end: BTreeMap::new(),
                cf_sent: None,
                cf_call: None,
                cf_consumed: BTreeMap::new(),
                broker_limit: None,
                ledger: BTreeMap::new(),
            }),
            notify: Notify::new(),
            crash_requested: Notify::new(),
            claims: MemoryClaims::with_clock(Arc::new(TokioRuntime)),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn log(&self, st: &mut State, msg: Option<u64>, ev: Ev) {
        st.seq += 1;
        let entry = Entry {
            seq: st.seq,
            at: Instant::now() - self.start,
            msg,
            ev,
        };
        st.trace.push(entry);
    }

    /// A handler killed its worker process.
    pub(crate) fn request_crash(&self) {
        self.crash_requested.notify_one();
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::full();
        c.refused_hold = self.sem.refused_hold();
        c.max_dispatch_delay = self.sem.longest_leg();
        match self.sem {
            Semantics::Memory => {}
            Semantics::Rabbit => {
                c.max_retry_delay = Some(Duration::from_secs(BUCKETS[BUCKETS.len() - 1]));
            }
            Semantics::Sqs => {
                c.max_retry_delay = Some(SQS_MAX);
                c.reject_drops = false;
                c.redelivery_hint = LEASE;
            }
            Semantics::Nats => {
                c.max_retry_delay = None;
                c.redelivery_hint = LEASE;
            }
            Semantics::Cloudflare => {
                c.max_retry_delay = Some(CF_MAX);
                c.counts_shutdown_returns = false;
            }
            Semantics::Postgres => {
                // As `PgDriver::capabilities` on the default configuration.
                c.max_retry_delay = None;
                c.redelivery_hint = LEASE;
                c.max_message_bytes = Some(16 * 1024 * 1024);
            }
        }
        c
    }

    fn order(st: &mut State, front: bool) -> i64 {
        st.next_order += 1;
        if front {
            -st.next_order
        } else {
            st.next_order
        }
    }

    /// The model's wall clock, in Unix milliseconds ([`DELAY_EPOCH_MS`]
    /// plus the virtual time elapsed, rounded down).
    pub(crate) fn now_ms(&self) -> u64 {
        DELAY_EPOCH_MS + (Instant::now() - self.start).as_millis() as u64
    }

    pub(crate) fn add_message(
        &self,
        n: u64,
        queue: &str,
        id: &str,
        body: Vec<u8>,
        what: &str,
        delay: Option<Duration>,
    ) {
        let mut st = self.lock();
        st.ids.insert(id.to_string(), n);
        let order = Self::order(&mut st, false);
        let now = Instant::now();
        let avail = now + delay.map_or(Duration::ZERO, |d| self.sem.dispatch_hold(&body, d));
        st.msgs.insert(
            n,
            Msg {
                queue: queue.to_string(),
                body,
                state: MState::Ready,
                avail,
                order,
                count: 0,
                carried: 0,
                dcount: 0,
                shutdowns: 0,
                receive_at: now,
                cf_delay: None,
            },
        );
        self.log(
            &mut st,
            Some(n),
            Ev::Sent {
                queue: queue.to_string(),
                what: what.to_string(),
            },
        );
        if let Some(leg) = delay {
            let available = avail - self.start;
            self.log(&mut st, Some(n), Ev::Delayed { leg, available });
        }
        drop(st);
        self.notify.notify_waiters();
    }

    /// The consumer's step (natively `Steps::step`, at the edge
    /// `EdgeConsumer::step`), on the model's wall clock: message `n`, about
    /// to be delivered, is not due for `remaining`; a copy (the same body)
    /// is sent delayed by the next leg and the delivery acknowledged, as
    /// one operation (the model's send and acknowledgement do not fail, and
    /// nothing awaits between them). The copy is a new message: nothing
    /// counted, no attempt.
    fn step(&self, st: &mut State, n: u64, remaining: Duration, now: Instant) {
        let sem = self.sem;
        let leg = jobrail::delay_leg(remaining, sem.longest_leg());
        let back = Self::order(st, false);
        let m = st.msgs.get_mut(&n).expect("message");
        let held = match sem {
            // `leg_seconds`: whole seconds, rounded up, at least one.
            Semantics::Cloudflare => Duration::from_secs(jobrail::whole_seconds_up(leg).max(1)),
            _ => sem.dispatch_hold(&m.body, leg),
        };
        m.avail = now + held;
        m.order = back;
        m.count = 0;
        m.carried = 0;
        m.dcount = 0;
        m.shutdowns = 0;
        m.receive_at = now;
        m.cf_delay = None;
        let available = m.avail - self.start;
        self.log(
            st,
            Some(n),
            Ev::Step {
                remaining,
                leg,
                available,
            },
        );
    }

    /// Takes the next available message of `queues` (or says when one will be).
    pub(crate) fn take(
        &self,
        queues: &[String],
        incarnation: u32,
    ) -> Result<Taken, Option<Instant>> {
        let now = Instant::now();
        let mut st = self.lock();
        // Postgres fetches the oldest run time first; the others, in order.
        let pg = self.sem == Semantics::Postgres;
        let mut best: Option<((Option<Instant>, i64), u64)> = None;
        let mut wake: Option<Instant> = None;
        for (&n, m) in &st.msgs {
            if m.state != MState::Ready || !queues.contains(&m.queue) {
                continue;
            }
            if m.avail <= now {
                let rank = (pg.then_some(m.avail), m.order);
                if best.is_none_or(|(o, _)| rank < o) {
                    best = Some((rank, n));
                }
            } else if wake.is_none_or(|w| m.avail < w) {
                wake = Some(m.avail);
            }
        }
        let Some((_, n)) = best else { return Err(wake) };
        if let Some(remaining) = jobrail::delay_remaining(&st.msgs[&n].body, self.now_ms()) {
            self.step(&mut st, n, remaining, now);
            drop(st);
            return self.take(queues, incarnation);
        }
        if let Some(limit) = st.broker_limit {
            // The broker's count since the message was (re)published.
            let m = &st.msgs[&n];
            let native = match self.sem {
                Semantics::Rabbit => m.dcount + 1,
                Semantics::Sqs | Semantics::Nats => m.count + 1,
                // No delivery limit of its own (`max_deliveries` none).
                Semantics::Memory | Semantics::Cloudflare | Semantics::Postgres => 0,
            };
            if native > limit {
                st.msgs.get_mut(&n).expect("message").state = MState::Done;
                self.log(
                    &mut st,
                    Some(n),
                    Ev::Removed(format!("ended by the broker's delivery limit of {limit}")),
                );
                // The limit leaves room for the crash bound; only settlements
                // the backend kept refusing (an injected fault no limit can
                // outlast) may run a message into it.
                // Nor a message whose record the facade already wrote (a crash
                // took the acknowledgement after it): it has ended.
                let excused = st.trace.iter().any(|e| {
                    e.msg == Some(n) && matches!(e.ev, Ev::Refused { .. } | Ev::Record { .. })
                });
                if !excused {
                    st.violations.push((
                        Some(n),
                        1,
                        format!(
                            "m{n} was ended by the broker's own delivery limit ({limit} deliveries) before the facade ended it"
                        ),
                    ));
                }
                drop(st);
                return self.take(queues, incarnation);
            }
        }
        let id = st.next_dlv;
        st.next_dlv += 1;
        st.deliveries += 1;
        let sem = self.sem;
        let m = st.msgs.get_mut(&n).expect("message");
        m.state = MState::InFlight(id);
        let (attempt, sr) = match sem {
            Semantics::Memory => {
                m.count += 1;
                (m.count, Some(m.shutdowns))
            }
            Semantics::Rabbit => (m.carried + m.dcount + 1, Some(m.shutdowns)),
            // A graceful-shutdown retry republishes with the count carried
            // (see the retry below), as the NATS and SQS drivers do.
            Semantics::Sqs => {
                m.count += 1;
                m.receive_at = now;
                (m.carried + m.count, Some(m.shutdowns))
            }
            Semantics::Nats => {
                m.count += 1;
                (m.carried + m.count, Some(m.shutdowns))
            }
            Semantics::Cloudflare => {
                m.count += 1;
                (m.count, None)
            }
            // The fetch adds one to `attempts` and leases the row; the
            // `shutdowns` column is reported beside it.
            Semantics::Postgres => {
                m.count += 1;
                m.receive_at = now;
                (m.count, Some(m.shutdowns))
            }
        };
        let body = m.body.clone();
        st.dlvs.insert(
            id,
            Dlv {
                msg: n,
                incarnation,
                attempt,
                ended: false,
                orphaned: false,
                cut_until: None,
            },
        );
        self.log(
            &mut st,
            Some(n),
            Ev::Delivered {
                delivery: id,
                attempt,
                shutdown_returns: sr,
                incarnation,
            },
        );
        if sem == Semantics::Cloudflare {
            st.cf_active.insert(id);
        }
        Ok((id, n, body, attempt, sr))
    }

    /// Puts a message back after an unsettled end of its delivery.
    fn give_back(&self, st: &mut State, n: u64, reason: Abandon) {
        let now = Instant::now();
        let sem = self.sem;
        let front = Self::order(st, true);
        let back = Self::order(st, false);
        let m = st.msgs.get_mut(&n).expect("message");
        m.state = MState::Ready;
        // A refused settlement is held as a lease would hold it, never
        // handed straight back.
        let refused = matches!(reason, Abandon::Refused | Abandon::Unsupported);
        match sem {
            Semantics::Memory => {
                m.avail = if refused { now + REFUSED_HOLD } else { now };
                m.order = front;
            }
            Semantics::Rabbit => {
                m.dcount += 1;
                m.avail = if refused { now + REFUSED_HOLD } else { now };
                m.order = front;
            }
            Semantics::Sqs => {
                m.avail = now + LEASE;
                m.order = back;
            }
            Semantics::Nats => {
                m.order = back;
                m.avail = match reason {
                    Abandon::Crash
                    | Abandon::ConnectionLost
                    | Abandon::Refused
                    | Abandon::Unsupported => now + LEASE,
                    _ => now,
                };
            }
            Semantics::Cloudflare => {
                m.order = back;
                m.avail = now + m.cf_delay.take().unwrap_or(Duration::ZERO);
            }
            Semantics::Postgres => {
                m.order = back;
                m.avail = match reason {
                    // Nothing settled or released the row: a refused
                    // settlement (the row stays held), a crashed worker (no
                    // process left to release it), a worker cut off past
                    // its lease (taken over). It is due when its lease ends.
                    Abandon::Crash
                    | Abandon::ConnectionLost
                    | Abandon::Refused
                    | Abandon::Unsupported => pg_lease_end(m.receive_at, now),
                    // A delivery dropped unsettled in a live process: due
                    // again at once, its attempt counted.
                    _ => now,
                };
            }
        }
    }

    /// A delivery ended without settlement.
    pub(crate) fn abandon(&self, id: u64, hint: Option<Abandon>) {
        let mut st = self.lock();
        let Some(d) = st.dlvs.get_mut(&id) else {
            return;
        };
        if d.ended {
            return;
        }
        d.ended = true;
        if d.orphaned {
            return;
        }
        let (n, inc) = (d.msg, d.incarnation);
        let reason = hint.unwrap_or(if st.crashed.contains(&inc) {
            Abandon::Crash
        } else {
            Abandon::Unknown
        });
        self.log(
            &mut st,
            Some(n),
            Ev::Abandoned {
                delivery: id,
                reason,
            },
        );
        self.give_back(&mut st, n, reason);
        drop(st);
        self.notify.notify_waiters();
    }

    /// Connection loss: every in-flight delivery of `incarnation` becomes unsettleable.
    pub(crate) fn lose_connection(&self, incarnation: u32) {
        let mut st = self.lock();
        st.conn_epoch += 1;
        let ids: Vec<u64> = st
            .dlvs
            .iter()
            .filter(|(_, d)| d.incarnation == incarnation && !d.ended && !d.orphaned)
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let d = st.dlvs.get_mut(&id).expect("delivery");
            d.orphaned = true;
            let n = d.msg;
            self.log(
                &mut st,
                Some(n),
                Ev::Abandoned {
                    delivery: id,
                    reason: Abandon::ConnectionLost,
                },
            );
            self.give_back(&mut st, n, Abandon::ConnectionLost);
            if self.sem == Semantics::Postgres {
                // The cut-off outlasts the lease by a second: the row is
                // due (and may be taken over) before the worker is back.
                let due = st.msgs[&n].avail;
                let d = st.dlvs.get_mut(&id).expect("delivery");
                d.cut_until = Some(due + Duration::from_secs(1));
            }
        }
        drop(st);
        self.notify.notify_waiters();
    }

    fn finish(&self, st: &mut State, id: u64) {
        if let Some(d) = st.dlvs.get_mut(&id) {
            d.ended = true;
        }
    }

    /// Carries out a settlement per the semantics. `Ok(true)`: accepted.
    pub(crate) async fn settle(
        &self,
        id: u64,
        settlement: &Settlement,
    ) -> Result<(), (ErrorKind, Option<Abandon>)> {
        // Postgres: a settlement of a worker cut off from the server waits
        // for the connection to come back (past the lease's end).
        let cut_until = self.lock().dlvs[&id].cut_until;
        if let Some(until) = cut_until {
            tokio::time::sleep_until(until).await;
        }
        match self.settle_step(id, settlement, false)? {
            Some(()) => Ok(()),
            None => {
                // Record published; a crash here leaves the message queued.
                tokio::time::sleep(Duration::from_millis(1)).await;
                self.settle_step(id, settlement, true).map(|_| ())
            }
        }
    }

    /// `Ok(None)`: the record is published, acknowledge after a pause.
    fn settle_step(
        &self,
        id: u64,
        settlement: &Settlement,
        resumed: bool,
    ) -> Result<Option<()>, (ErrorKind, Option<Abandon>)> {
        let settled = Settled::of(settlement);
        let now = Instant::now();
        let mut st = self.lock();
        let (n, inc, orphaned) = {
            let d = &st.dlvs[&id];
            (d.msg, d.incarnation, d.orphaned)
        };
        let shutting_down = st.shutting.contains(&inc);
        let refuse = |this: &Self, st: &mut State, kind: ErrorKind| {
            this.log(
                st,
                Some(n),
                Ev::Refused {
                    delivery: id,
                    settled: settled.clone(),
                    kind,
                    shutting_down,
                },
            );
        };
        // Postgres: the worker was cut off past its lease, and is back
        // (`settle` waited). Once another fetch took the row, the
        // settlement is fenced by the lease token ("lease was taken over"),
        // nothing applied; a row nobody fetched still has this delivery's
        // token, and the settlement applies as usual.
        if orphaned && self.sem == Semantics::Postgres {
            if st.dlvs.range(id + 1..).any(|(_, d)| d.msg == n) {
                refuse(self, &mut st, ErrorKind::NotAccepted);
                self.finish(&mut st, id);
                return Err((ErrorKind::NotAccepted, None));
            }
        } else if orphaned {
            refuse(self, &mut st, ErrorKind::Connection);
            self.finish(&mut st, id);
            return Err((ErrorKind::Connection, None));
        }
        if st.refuse > 0 && !resumed {
            st.refuse -= 1;
            refuse(self, &mut st, ErrorKind::NotAccepted);
            return Err((ErrorKind::NotAccepted, Some(Abandon::Refused)));
        }
        // (Cloudflare settles through `cf_call`, not here.)
        let sem = self.sem;
        match settlement {
            Settlement::Ack => {}
            Settlement::Reject => {
                if sem == Semantics::Sqs {
                    // No call: the message returns when its visibility runs out.
                    let back = Self::order(&mut st, false);
                    let m = st.msgs.get_mut(&n).expect("message");
                    m.state = MState::Ready;
                    m.avail = now + LEASE;
                    m.order = back;
                    return self
                        .accept(st, id, n, settled, shutting_down, false)
                        .map(Some);
                }
            }
            Settlement::Retry { delay, shutdown } => {
                let d = delay.unwrap_or(Duration::ZERO);
                let wait = match sem {
                    // Any time ahead, no maximum; without a delay, one
                    // lease later (the redelivery hint).
                    Semantics::Postgres => Some(pg_micros(delay.unwrap_or(LEASE))),
                    Semantics::Memory | Semantics::Nats => Some(d),
                    Semantics::Rabbit => {
                        if d.is_zero() {
                            Some(d)
                        } else {
                            BUCKETS
                                .iter()
                                .map(|s| Duration::from_secs(*s))
                                .find(|b| *b >= d)
                        }
                    }
                    Semantics::Sqs => {
                        let secs =
                            Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0));
                        let receive_at = st.msgs[&n].receive_at;
                        (now + secs <= receive_at + SQS_MAX).then_some(secs)
                    }
                    Semantics::Cloudflare => unreachable!("the edge settles through cf_call"),
                };
                let Some(wait) = wait else {
                    refuse(self, &mut st, ErrorKind::Unsupported);
                    return Err((ErrorKind::Unsupported, Some(Abandon::Unsupported)));
                };
                let back = Self::order(&mut st, false);
                let attempt = st.dlvs[&id].attempt;
                let m = st.msgs.get_mut(&n).expect("message");
                m.state = MState::Ready;
                m.avail = now + wait;
                m.order = back;
                if *shutdown {
                    m.shutdowns += 1;
                }
                if sem == Semantics::Rabbit {
                    m.carried = attempt;
                    m.dcount = 0;
                }
                if *shutdown && matches!(sem, Semantics::Sqs | Semantics::Nats) {
                    // A copy carrying the count replaces the message.
                    m.carried = attempt;
                    m.count = 0;
                }
                return self
                    .accept(st, id, n, settled, shutting_down, false)
                    .map(Some);
            }
            Settlement::Fail(_) => {
                if !resumed {
                    let reason = match settlement {
                        Settlement::Fail(r) => first_line(&r.reason),
                        _ => String::new(),
                    };
                    self.log(
                        &mut st,
                        Some(n),
                        Ev::Record {
                            delivery: id,
                            reason,
                        },
                    );
                    // Postgres deletes the row and stores the record in one
                    // statement: no crash comes between them.
                    if !matches!(sem, Semantics::Memory | Semantics::Postgres) {
                        return Ok(None);
                    }
                }
            }
        }
        st.msgs.get_mut(&n).expect("message").state = MState::Done;
        let how = settlement.name().to_string();
        self.log(&mut st, Some(n), Ev::Removed(how));
        self.accept(st, id, n, settled, shutting_down, true)
            .map(Some)
    }

    fn accept(
        &self,
        mut st: MutexGuard<'_, State>,
        id: u64,
        n: u64,
        settled: Settled,
        shutting_down: bool,
        _terminal: bool,
    ) -> Result<(), (ErrorKind, Option<Abandon>)> {
        if let Some((m, s)) = st.pending_event.take() {
            st.violations.push((
                Some(m),
                5,
                format!("accepted settlement {s:?} of m{m} was never reported by an event"),
            ));
        }
        st.pending_event = Some((n, settled.clone()));
        self.log(
            &mut st,
            Some(n),
            Ev::Accepted {
                delivery: id,
                settled,
                shutting_down,
            },
        );
        self.finish(&mut st, id);
        drop(st);
        self.notify.notify_waiters();
        Ok(())
    }

    /// The event sink's view: an event must follow an accepted settlement.
    pub(crate) fn on_event(&self, event: &Event) {
        if self.sem == Semantics::Cloudflare {
            return self.cf_event(event);
        }
        let mut st = self.lock();
        let msg = st.ids.get(&event.message_id).copied();
        self.log(
            &mut st,
            msg,
            Ev::Emitted {
                kind: event.kind.name().to_string(),
            },
        );
        match st.pending_event.take() {
            None => st.violations.push((
                msg,
                5,
                format!(
                    "event `{}` (attempt {}) emitted without an accepted settlement",
                    event.kind.name(),
                    event.attempt
                ),
            )),
            Some((n, s)) => {
                let ok = matches!(
                    (&event.kind, &s),
                    (EventKind::Succeeded { .. }, Settled::Ack)
                        | (EventKind::Retried { .. }, Settled::Retry { .. })
                        | (EventKind::Rejected { .. }, Settled::Reject)
                        | (EventKind::Failed { .. }, Settled::Fail { .. })
                );
                if !ok || msg.is_some_and(|m| m != n) {
                    st.violations.push((
                        Some(n),
                        5,
                        format!(
                            "event `{}` does not match the accepted settlement {s:?} of m{n}",
                            event.kind.name()
                        ),
                    ));
                }
            }
        }
    }
}

/// A recording event sink.
pub(crate) struct Sink(pub(crate) Arc<World>);

impl EventSink for Sink {
    fn emit(&self, event: &Event) {
        self.0.on_event(event);
    }
}

/// The model driver, as one consumer incarnation sees it.
pub struct Model {
    pub(crate) world: Arc<World>,
    pub(crate) incarnation: u32,
}

fn derr(kind: ErrorKind, text: impl Into<String>) -> DriverError {
    DriverError::new("model", kind, text.into())
}

#[async_trait]
impl Driver for Model {
    fn name(&self) -> &'static str {
        "model"
    }

    fn capabilities(&self) -> Capabilities {
        self.world.capabilities()
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let n = self.world.lock().ids.get(&message.id).copied();
        let Some(n) = n else {
            return Err(derr(ErrorKind::NotAccepted, "unknown sim message"));
        };
        self.world.add_message(
            n,
            queue,
            &message.id,
            message.body,
            "dispatch",
            message.delay,
        );
        Ok(())
    }

    async fn subscribe(
        &self,
        queue: &str,
        _prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        let epoch = self.world.lock().conn_epoch;
        Ok(Box::new(ModelSubscription {
            world: self.world.clone(),
            queues: vec![queue.to_string()],
            incarnation: self.incarnation,
            epoch,
        }))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        Ok(())
    }
}

struct ModelSubscription {
    world: Arc<World>,
    queues: Vec<String>,
    incarnation: u32,
    epoch: u64,
}

#[async_trait]
impl Subscription for ModelSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        loop {
            let notified = self.world.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let epoch = self.world.lock().conn_epoch;
            if epoch != self.epoch {
                self.epoch = epoch;
                return Some(Err(derr(ErrorKind::Connection, "connection lost")));
            }
            match self.world.take(&self.queues, self.incarnation) {
                Ok((id, msg, body, attempt, sr)) => {
                    return Some(Ok(Box::new(ModelDelivery {
                        world: self.world.clone(),
                        id,
                        _msg: msg,
                        body,
                        attempt,
                        sr,
                        done: false,
                        hint: None,
                    })))
                }
                Err(Some(at)) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                Err(None) => notified.await,
            }
        }
    }
}

struct ModelDelivery {
    world: Arc<World>,
    id: u64,
    _msg: u64,
    body: Vec<u8>,
    attempt: u32,
    sr: Option<u32>,
    done: bool,
    hint: Option<Abandon>,
}

impl Drop for ModelDelivery {
    fn drop(&mut self) {
        if !self.done {
            self.world.abandon(self.id, self.hint);
        }
    }
}

#[async_trait]
impl Delivery for ModelDelivery {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn shutdown_returns(&self) -> Option<u32> {
        self.sr
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        match self.world.settle(self.id, settlement).await {
            Ok(()) => {
                self.done = true;
                Ok(())
            }
            Err((kind, hint)) => {
                match hint {
                    None => self.done = true,
                    Some(h) => self.hint = Some(h),
                }
                Err(derr(kind, format!("settlement refused: {kind}")))
            }
        }
    }
}

impl World {
    /// Cloudflare: the invocation holding `batch` ended (`aborted`: lost, and why).
    pub(crate) fn cf_end(&self, batch: &[u64], aborted: Option<Abandon>, max_retries: u32) {
        let cause = aborted;
        let aborted = cause.is_some();
        let now = Instant::now();
        let mut st = self.lock();
        if let Some((id, n, call)) = st.cf_call.take() {
            st.violations.push((
                Some(n),
                5,
                format!("platform call {call:?} on delivery {id} was never reported by an event"),
            ));
        }
        st.cf_sent = None;
        for &id in batch {
            if !st.cf_active.remove(&id) {
                continue;
            }
            let mark = st.cf_marks.remove(&id);
            let d = &st.dlvs[&id];
            let (n, ended) = (d.msg, d.ended);
            if !ended {
                let crashed = aborted && st.crashed.contains(&st.dlvs[&id].incarnation);
                self.finish(&mut st, id);
                self.log(
                    &mut st,
                    Some(n),
                    Ev::Abandoned {
                        delivery: id,
                        reason: if crashed {
                            Abandon::Crash
                        } else {
                            cause.unwrap_or(Abandon::Unknown)
                        },
                    },
                );
            }
            if ended && aborted && mark == Some(Mark::Nothing) {
                // A rejection asks nothing of the platform: the lost
                // invocation does not acknowledge the message, which comes
                // back with a delivery spent.
                let reason = cause.unwrap_or(Abandon::Unknown);
                self.log(
                    &mut st,
                    Some(n),
                    Ev::Abandoned {
                        delivery: id,
                        reason,
                    },
                );
            }
            st.cf_consumed.remove(&id);
            let retry = match mark {
                Some(Mark::Ack) => None,
                Some(Mark::Retry(d)) => Some(d),
                Some(Mark::Nothing) | None if aborted => Some(None),
                Some(Mark::Nothing) | None => None,
            };
            let back = Self::order(&mut st, false);
            let m = st.msgs.get_mut(&n).expect("message");
            match retry {
                None => {
                    m.state = MState::Done;
                    let how = match mark {
                        Some(Mark::Ack) => "ack",
                        _ => "implicit ack",
                    };
                    self.log(&mut st, Some(n), Ev::Removed(how.into()));
                }
                Some(_) if m.count > max_retries => {
                    m.state = MState::Done;
                    self.log(&mut st, Some(n), Ev::Removed("dead-lettered".into()));
                }
                Some(d) => {
                    m.state = MState::Ready;
                    m.avail = now + d.unwrap_or(crate::cloudflare::DEFAULT_RETRY_DELAY);
                    m.order = back;
                }
            }
        }
        drop(st);
        self.notify.notify_waiters();
    }
}

/// The first line of `text`.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_string()
}

/// Whole seconds, rounded up, as the edge asks the platform for a delay.
fn whole_seconds(d: Duration) -> u32 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)) as u32
}

impl World {
    /// Cloudflare: an invocation starts on `batch`; it stops starting work
    /// after `work` (its budget less the settlement reserve).
    pub(crate) fn cf_started(&self, batch: &[u64], work: Duration) {
        let mut st = self.lock();
        let end = (Instant::now() - self.start) + work;
        for id in batch {
            st.cf_work_end.insert(*id, end);
        }
    }

    /// Cloudflare: the deliveries of `batch` not settled yet.
    pub(crate) fn cf_unsettled(&self, batch: &[u64]) -> BTreeSet<u64> {
        let st = self.lock();
        batch
            .iter()
            .copied()
            .filter(|id| !st.dlvs[id].ended)
            .collect()
    }

    /// Cloudflare: an execution of `delivery` ran, consuming `step` of its
    /// script (`None`: a charging handler's execution that found its key
    /// done or held and ran no step).
    pub(crate) fn cf_consumed(st: &mut State, delivery: u64, step: Option<&crate::scenario::Step>) {
        st.cf_consumed
            .entry(delivery)
            .or_default()
            .push(step.cloned());
    }

    /// Cloudflare: the edge sent `text` through the failure queue. `Err`:
    /// refused (an injected fault).
    pub(crate) fn cf_send(&self, text: &str) -> Result<(), ()> {
        if crate::cloudflare::frozen() {
            return Ok(());
        }
        let mut st = self.lock();
        let (settled, reason) = match serde_json::from_str::<FailureRecord>(text) {
            Ok(r) => (
                Settled::Fail {
                    kind: r.kind,
                    executions: r.executions,
                },
                first_line(&r.reason),
            ),
            Err(e) => {
                st.violations
                    .push((None, 0, format!("the failure record does not decode: {e}")));
                return Ok(());
            }
        };
        if let Some(left) = st.cf_sent.take() {
            st.violations.push((
                None,
                0,
                format!("a failure record ({left:?}) was sent without its message's ack or retry"),
            ));
        }
        if st.refuse > 0 {
            st.refuse -= 1;
            st.cf_sent = Some(Err(settled));
            return Err(());
        }
        st.cf_sent = Some(Ok((settled, reason)));
        Ok(())
    }

    /// Cloudflare: the edge called `ack()` or `retry()` on `id`. `Err`:
    /// refused (an injected fault); the platform did not take the mark.
    pub(crate) fn cf_call(&self, id: u64, call: CfCall) -> Result<(), ()> {
        if crate::cloudflare::frozen() {
            return Ok(());
        }
        let mut st = self.lock();
        let n = st.dlvs[&id].msg;
        if let Some((other, m, c)) = st.cf_call.take() {
            st.violations.push((
                Some(m),
                5,
                format!("platform call {c:?} on delivery {other} was never reported by an event"),
            ));
        }
        let call = match (st.cf_sent.take(), call) {
            (None, call) => call,
            (Some(Ok((record, reason))), CfCall::Ack { .. }) => {
                self.log(
                    &mut st,
                    Some(n),
                    Ev::Record {
                        delivery: id,
                        reason,
                    },
                );
                CfCall::Ack {
                    record: Some(record),
                }
            }
            (Some(Err(settled)), CfCall::Retry(Some(secs)))
                if Duration::from_secs(u64::from(secs)) == REFUSED_HOLD =>
            {
                // The send failed: the edge keeps the message for
                // redelivery, held as a lease would hold it.
                self.cf_refuse(&mut st, id, n, settled);
                st.cf_marks.insert(id, Mark::Retry(Some(REFUSED_HOLD)));
                return Ok(());
            }
            (Some(sent), call) => {
                st.violations.push((
                    Some(n),
                    0,
                    format!("platform call {call:?} after the failure record send {sent:?}"),
                ));
                call
            }
        };
        if st.refuse > 0 {
            st.refuse -= 1;
            let settled = match &call {
                CfCall::Ack { record: Some(r) } => r.clone(),
                CfCall::Ack { record: None } => Settled::Ack,
                CfCall::Retry(s) => Settled::Retry {
                    delay: s.map(|s| Duration::from_secs(u64::from(s))),
                    shutdown: false,
                },
            };
            self.cf_refuse(&mut st, id, n, settled);
            return Err(());
        }
        let mark = match &call {
            CfCall::Ack { .. } => Mark::Ack,
            CfCall::Retry(s) => Mark::Retry(s.map(|s| Duration::from_secs(u64::from(s)))),
        };
        st.cf_marks.insert(id, mark);
        st.cf_call = Some((id, n, call));
        Ok(())
    }

    /// Cloudflare: a settlement of `id` the platform refused; the delivery
    /// has ended for the edge.
    fn cf_refuse(&self, st: &mut State, id: u64, n: u64, settled: Settled) {
        st.cf_consumed.remove(&id);
        self.log(
            st,
            Some(n),
            Ev::Refused {
                delivery: id,
                settled,
                kind: ErrorKind::Uncertain,
                shutting_down: false,
            },
        );
        self.finish(st, id);
        self.log(
            st,
            Some(n),
            Ev::Abandoned {
                delivery: id,
                reason: Abandon::Refused,
            },
        );
    }

    /// Cloudflare: the event sink's view. The event must report the platform
    /// call just made (a rejection: none), and only then is the settlement
    /// accepted (the event says what it was, the shutdown rule included).
    fn cf_event(&self, event: &Event) {
        if crate::cloudflare::frozen() {
            // Reported after the crash: it never happened.
            return;
        }
        let mut st = self.lock();
        let msg = st.ids.get(&event.message_id).copied();
        let call = st.cf_call.take();
        let found = match (&event.kind, call) {
            (EventKind::Rejected { .. }, None) => {
                match msg.and_then(|n| match st.msgs.get(&n).map(|m| m.state) {
                    Some(MState::InFlight(id)) => Some((id, n)),
                    _ => None,
                }) {
                    Some((id, n)) => {
                        st.cf_marks.insert(id, Mark::Nothing);
                        Ok((id, n, Settled::Reject))
                    }
                    None => Err("a rejection of no delivery in flight".to_string()),
                }
            }
            (kind, Some((id, n, call))) => {
                let settled = match (kind, &call) {
                    (EventKind::Succeeded { .. }, CfCall::Ack { record: None }) => {
                        Some(Settled::Ack)
                    }
                    (EventKind::Failed { failure }, CfCall::Ack { record: Some(r) }) => {
                        let s = Settled::Fail {
                            kind: failure.kind,
                            executions: event.executions,
                        };
                        (s == *r).then_some(s)
                    }
                    (
                        EventKind::Retried {
                            delay, shutdown, ..
                        },
                        CfCall::Retry(secs),
                    ) if delay.map(whole_seconds) == *secs => Some(Settled::Retry {
                        delay: *delay,
                        shutdown: *shutdown,
                    }),
                    _ => None,
                };
                match settled {
                    Some(s) if msg.is_none_or(|m| m == n) => Ok((id, n, s)),
                    _ => Err(format!("platform call {call:?} on delivery {id} of m{n}")),
                }
            }
            (_, None) => Err("no platform call".to_string()),
        };
        match found {
            Ok((id, n, settled)) => {
                st.cf_consumed.remove(&id);
                self.log(
                    &mut st,
                    Some(n),
                    Ev::Accepted {
                        delivery: id,
                        settled,
                        shutting_down: false,
                    },
                );
                self.finish(&mut st, id);
            }
            Err(what) => st.violations.push((
                msg,
                5,
                format!(
                    "event `{}` (attempt {}) does not report an accepted settlement: {what}",
                    event.kind.name(),
                    event.attempt
                ),
            )),
        }
        self.log(
            &mut st,
            msg,
            Ev::Emitted {
                kind: event.kind.name().to_string(),
            },
        );
        drop(st);
        self.notify.notify_waiters();
    }

    /// Cloudflare: the instance running `batch` crashed on a panic of
    /// `culprit`'s code (`None`: no message can be blamed). Executions of the
    /// other unsettled deliveries are void: their script steps go back.
    pub(crate) fn cf_reset(&self, batch: &[u64], culprit: Option<u64>, text: &str) {
        let mut st = self.lock();
        st.cf_sent = None;
        for &id in batch {
            let steps = st.cf_consumed.remove(&id).unwrap_or_default();
            if Some(id) == culprit || st.dlvs[&id].ended || steps.is_empty() {
                continue;
            }
            let n = st.dlvs[&id].msg;
            let script = st.scripts.entry(n).or_default();
            script.splice(0..0, steps.iter().flatten().cloned());
            self.log(
                &mut st,
                Some(n),
                Ev::Interrupted {
                    delivery: id,
                    executions: steps.len() as u32,
                },
            );
        }
        match culprit {
            Some(culprit) => {
                let n = st.dlvs[&culprit].msg;
                let mates = batch
                    .iter()
                    .filter(|d| **d != culprit)
                    .map(|d| st.dlvs[d].msg)
                    .collect();
                self.log(
                    &mut st,
                    Some(n),
                    Ev::InstancePanic {
                        delivery: culprit,
                        mates,
                    },
                );
            }
            None => self.log(
                &mut st,
                None,
                Ev::Fault(format!("a panic no message can be blamed for: {text}")),
            ),
        }
    }

    /// Cloudflare: no message can be blamed for a crash: every unsettled
    /// message of `batch` is handed back with `retry()`.
    pub(crate) fn cf_hand_back(&self, batch: &[u64]) {
        let mut st = self.lock();
        for &id in batch {
            if st.dlvs[&id].ended {
                continue;
            }
            let n = st.dlvs[&id].msg;
            st.cf_marks.insert(id, Mark::Retry(None));
            self.finish(&mut st, id);
            self.log(
                &mut st,
                Some(n),
                Ev::Abandoned {
                    delivery: id,
                    reason: Abandon::InvocationAborted,
                },
            );
        }
    }
}
