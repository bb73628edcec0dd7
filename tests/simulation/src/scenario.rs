//! What a seed generates: jobs and their policies, messages and their
//! outcome scripts, faults; and the scripted handlers.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{
    BoxError, BoxFuture, BreakerConfig, BreakerError, CircuitBreaker, Job, JobContext, JobError,
    Permanent, Registry, Reject, RetryAfter, UnknownNameAttempts,
};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::model::{Eff, Ev, Semantics, Sink, State, World};
use jobrail_native::TokioRuntime;

/// One scripted handler execution.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Return `Ok(())`.
    Ok,
    /// An ordinary error.
    Ordinary,
    /// A retry-after marker, wrapped.
    RetryAfter(Duration, Vec<Wrap>),
    /// A permanent marker, wrapped.
    Permanent(Vec<Wrap>),
    /// A reject marker, wrapped.
    Reject(Vec<Wrap>),
    /// Panic before returning the future (at the edge: the wasm instance
    /// aborts).
    PanicBefore,
    /// Panic inside the future (at the edge: the wasm instance aborts).
    PanicInside,
    /// Sleep past the timeout ignoring the context, then fail.
    Hang,
    /// Wait for cancellation up to this long.
    CooperativeCancel(Duration),
    /// The worker process dies while running it (the OOM killer, a
    /// segfault in a native library): the consumer is aborted, settling
    /// nothing, and a new one starts. At the edge, the instance dies.
    KillsWorker,
}

/// A wrapper around a marker (innermost first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wrap {
    /// An application error whose `source()` is the inner error.
    User,
    /// `std::io::Error::other(inner)`.
    Io,
    /// `CircuitBreaker::call` returning the inner error (`BreakerError::Inner`).
    Breaker,
}

/// A message's script: one step per execution, then `Ok`.
pub type Script = Vec<Step>;

/// What kind of message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A normal payload for a registered job.
    Valid,
    /// A payload the validation hook refuses.
    Invalid,
    /// Not an envelope.
    Malformed,
    /// An unknown job name.
    UnknownName,
    /// A payload that does not decode.
    Undecodable,
}

impl Kind {
    /// Whether a rule fails it without executing.
    pub fn no_exec(self) -> bool {
        !matches!(self, Kind::Valid)
    }
}

/// A generated job.
#[derive(Debug, Clone)]
pub struct JobPlan {
    /// Name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Attempt cap (0: none).
    pub cap: u32,
    /// Tier-one attempts.
    pub tier_one: u32,
    /// Tier-one max wait, if set.
    pub t1_max_wait: Option<Duration>,
    /// Backoff: 0 none, 1 exponential, 2 function.
    pub backoff: u8,
    /// Timeout.
    pub timeout: Option<Duration>,
    /// Breaker (threshold, cool-down).
    pub breaker: Option<(u32, Duration)>,
    /// Validation hook.
    pub validate: bool,
}

impl JobPlan {
    /// The tier-one max wait in force.
    pub fn max_wait(&self) -> Duration {
        self.t1_max_wait.unwrap_or(Duration::from_secs(5))
    }
}

/// A generated message.
#[derive(Debug, Clone)]
pub struct MsgPlan {
    /// Number.
    pub n: u64,
    /// Job index (for valid/invalid/undecodable).
    pub job: usize,
    /// Queue.
    pub queue: String,
    /// Kind.
    pub kind: Kind,
    /// Dispatch time.
    pub at: Duration,
    /// Script.
    pub script: Script,
    /// The business key a charging job's message carries.
    pub key: Option<String>,
    /// The dispatch delay (`None`: none; a zero delay is none too).
    pub delay: Option<Duration>,
}

impl MsgPlan {
    /// When it is due: its dispatch plus its delay.
    pub fn due(&self) -> Duration {
        self.at + self.delay.unwrap_or_default()
    }
}

/// A generated fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Abort the consumer, restart after the pause.
    Crash(Duration),
    /// Graceful shutdown, restart after the pause.
    Shutdown(Duration),
    /// Refuse the next n settlements.
    Refuse(u32),
    /// Lose the connection: the deliveries in flight can no longer be
    /// settled (RabbitMQ's channel, NATS's connection; on Postgres, whose
    /// leases are not tied to a connection, the worker is cut off past its
    /// lease and its rows are taken over).
    ConnectionLost,
}

/// Everything a seed generates.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Backend.
    pub sem: Semantics,
    /// Jobs.
    pub jobs: Vec<JobPlan>,
    /// Consumer concurrency.
    pub concurrency: usize,
    /// Unknown-name cap.
    pub unknown_cap: u32,
    /// Messages.
    pub msgs: Vec<MsgPlan>,
    /// Faults by time.
    pub faults: Vec<(Duration, Fault)>,
    /// Cloudflare: batch size.
    pub batch: usize,
    /// The broker's own delivery limit (JetStream `MaxDeliver`, SQS
    /// `maxReceiveCount`, quorum `x-delivery-limit`), in deliveries: `None`,
    /// or the least the drivers accept, [`jobrail::deliveries_needed`] for
    /// the largest cap. A message the broker ends by it is a violation.
    pub broker_limit: Option<u32>,
    /// The charging job, if the seed has one.
    pub charging: Option<Charging>,
}

/// A charging job: its handler runs each scripted execution inside
/// `jobrail::run_once` on the business key its message carries, and the
/// effect (the charge) happens when the execution succeeds.
#[derive(Debug, Clone)]
pub struct Charging {
    /// The job's index.
    pub job: usize,
    /// The lease of every claim: longer than any execution
    /// ([`LONGEST_EXECUTION`]), so only a holder that died lets it end.
    pub lease: Duration,
    /// How many business keys its messages share.
    pub keys: u32,
}

/// The longest a scripted execution runs: a cooperative cancel waits up to
/// 20 s; a hang, past a timeout of at most 5 s, 6 s; everything else at once.
pub const LONGEST_EXECUTION: Duration = Duration::from_secs(20);

/// The payload of every job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Payload {
    /// Message number.
    pub n: u64,
    /// Refused by the validation hook.
    #[serde(default)]
    pub invalid: bool,
    /// A charging job's business key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

fn ms(r: &mut ChaCha8Rng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(r.gen_range(lo..=hi))
}

fn wraps(r: &mut ChaCha8Rng) -> Vec<Wrap> {
    let k = r.gen_range(0..=3);
    (0..k)
        .map(|_| {
            *[Wrap::User, Wrap::Io, Wrap::Breaker]
                .choose(r)
                .expect("wrap")
        })
        .collect()
}

fn step(r: &mut ChaCha8Rng) -> Step {
    match r.gen_range(0..100) {
        0..=14 => Step::Ok,
        15..=39 => Step::Ordinary,
        40..=49 => Step::RetryAfter(Duration::from_secs(r.gen_range(0..=8)), wraps(r)),
        50..=57 => Step::Permanent(wraps(r)),
        58..=63 => Step::Reject(wraps(r)),
        64..=69 => Step::PanicBefore,
        70..=75 => Step::PanicInside,
        76..=81 => Step::Hang,
        _ => Step::CooperativeCancel(ms(r, 500, 20_000)),
    }
}

/// Generates the scenario of `seed` for `sem`.
pub fn generate(r: &mut ChaCha8Rng, sem: Semantics) -> Scenario {
    let nq = r.gen_range(1..=3);
    let queues: Vec<String> = (0..nq).map(|i| format!("q{i}")).collect();
    let njobs = r.gen_range(1..=4);
    let mut jobs = Vec::new();
    for j in 0..njobs {
        let queue = if j < nq {
            queues[j].clone()
        } else {
            queues.choose(r).expect("queue").clone()
        };
        let cap = if r.gen_bool(0.08) {
            0
        } else {
            r.gen_range(1..=5)
        };
        jobs.push(JobPlan {
            name: format!("job{j}"),
            queue,
            cap,
            tier_one: r.gen_range(1..=3),
            t1_max_wait: r
                .gen_bool(0.3)
                .then(|| Duration::from_secs(r.gen_range(0..=3))),
            backoff: r.gen_range(0..=2),
            timeout: r
                .gen_bool(0.5)
                .then(|| Duration::from_secs(r.gen_range(1..=5))),
            breaker: r
                .gen_bool(0.3)
                .then(|| (r.gen_range(1..=3), Duration::from_secs(r.gen_range(1..=10)))),
            validate: r.gen_bool(0.3),
        });
    }
    let queues: Vec<String> = {
        let mut q: Vec<String> = jobs.iter().map(|j| j.queue.clone()).collect();
        q.sort();
        q.dedup();
        q
    };
    let concurrency = r.gen_range(1..=4);
    let nmsgs = r.gen_range(5..=40);
    let spread = r.gen_range(1..=120u64);
    let mut msgs = Vec::new();
    for n in 1..=nmsgs {
        let job = r.gen_range(0..jobs.len());
        let kind = match r.gen_range(0..100) {
            0..=4 => Kind::Malformed,
            5..=9 => Kind::UnknownName,
            10..=13 => Kind::Undecodable,
            14..=19 if jobs[job].validate => Kind::Invalid,
            _ => Kind::Valid,
        };
        let queue = match kind {
            Kind::Malformed | Kind::UnknownName => queues.choose(r).expect("queue").clone(),
            _ => jobs[job].queue.clone(),
        };
        let len = r.gen_range(0..=5);
        let script = (0..len).map(|_| step(r)).collect();
        msgs.push(MsgPlan {
            n,
            job,
            queue,
            kind,
            at: ms(r, 0, spread * 1000),
            script,
            key: None,
            delay: None,
        });
    }
    msgs.sort_by_key(|m| (m.at, m.n));
    let nfaults = r.gen_range(0..=4);
    let mut faults = Vec::new();
    for _ in 0..nfaults {
        let at = ms(r, 0, (spread + 60) * 1000);
        let fault = match r.gen_range(0..4) {
            0 => Fault::Crash(ms(r, 0, 60_000)),
            1 => Fault::Shutdown(ms(r, 0, 60_000)),
            2 => Fault::Refuse(r.gen_range(1..=3)),
            // Postgres: a worker cut off from the server past its lease
            // (the row is taken over at the lease's end).
            _ if matches!(
                sem,
                Semantics::Rabbit | Semantics::Nats | Semantics::Postgres
            ) =>
            {
                Fault::ConnectionLost
            }
            _ if sem == Semantics::Cloudflare => Fault::Refuse(r.gen_range(1..=3)),
            _ => Fault::Crash(ms(r, 0, 60_000)),
        };
        faults.push((at, fault));
    }
    faults.sort_by_key(|f| f.0);
    let mut sc = Scenario {
        sem,
        jobs,
        concurrency,
        unknown_cap: r.gen_range(1..=4),
        msgs,
        faults,
        batch: r.gen_range(1..=5),
        broker_limit: None,
        charging: None,
    };
    let limited = matches!(sem, Semantics::Rabbit | Semantics::Sqs | Semantics::Nats)
        && r.gen_bool(0.5)
        && sc.jobs.iter().all(|j| j.cap != 0);
    if limited {
        let largest = sc.jobs.iter().map(|j| j.cap).chain([sc.unknown_cap]).max();
        sc.broker_limit = largest.and_then(|cap| jobrail::deliveries_needed(cap, true));
    }
    // Crash loops: a few messages kill their worker every time (or once).
    // At the edge, where a panic brings the instance down, a few panic every
    // time, past any cap times tier one (without a draw of their own, so
    // every other message and every other backend's scenario stay as they
    // were; natively a panic is an ordinary error, and each one costs a
    // captured backtrace).
    for m in &mut sc.msgs {
        match r.gen_range(0..100) {
            0..=3 => m.script = vec![Step::KillsWorker; 12],
            4..=7 => {
                let at = r.gen_range(0..=m.script.len());
                m.script.insert(at, Step::KillsWorker);
            }
            8..=11 if sem == Semantics::Cloudflare => {
                m.script = (0..ALWAYS_PANICS)
                    .map(|i| {
                        if (m.n + i) % 2 == 0 {
                            Step::PanicInside
                        } else {
                            Step::PanicBefore
                        }
                    })
                    .collect();
            }
            _ => {}
        }
    }
    // Charging: one job in four seeds runs its effect once per business key
    // (drawn last, so everything else a seed generates stays as it was).
    if r.gen_bool(0.25) {
        let job = r.gen_range(0..sc.jobs.len());
        let keys = r.gen_range(1..=3);
        let lease = LONGEST_EXECUTION + ms(r, 1_000, 60_000);
        for m in &mut sc.msgs {
            if m.job == job && matches!(m.kind, Kind::Valid | Kind::Invalid) {
                m.key = Some(format!("order-{}", r.gen_range(0..keys)));
            }
        }
        sc.charging = Some(Charging { job, lease, keys });
    }
    // Long delays: one seed in four dispatches some of its messages with a
    // delay (drawn last, as the charging job).
    if r.gen_bool(0.25) {
        for m in &mut sc.msgs {
            if r.gen_bool(0.4) {
                let mut delay = dispatch_delay(r, sem);
                if m.kind == Kind::Malformed {
                    // Not an envelope: no due time to carry a longer delay
                    // in steps (the producer refuses one), one leg at most.
                    delay = sem.longest_leg().map_or(delay, |leg| delay.min(leg));
                }
                m.delay = Some(delay);
            }
        }
        // Faults where the delays end: a crash, a shutdown or a lost
        // connection a moment before or after a due time, so that due
        // messages meet restarts and redeliveries, as the early ones do.
        let dues: Vec<Duration> = sc
            .msgs
            .iter()
            .filter(|m| m.delay.is_some_and(|d| !d.is_zero()))
            .map(MsgPlan::due)
            .collect();
        if !dues.is_empty() && r.gen_bool(0.6) {
            for _ in 0..r.gen_range(1..=2) {
                let due = *dues.choose(r).expect("a due time");
                let at = due.saturating_sub(ms(r, 0, 3_000)) + ms(r, 0, 3_000);
                let fault = match r.gen_range(0..3) {
                    0 => Fault::Crash(ms(r, 0, 60_000)),
                    1 => Fault::Shutdown(ms(r, 0, 60_000)),
                    _ if matches!(
                        sem,
                        Semantics::Rabbit | Semantics::Nats | Semantics::Postgres
                    ) =>
                    {
                        Fault::ConnectionLost
                    }
                    _ => Fault::Crash(ms(r, 0, 60_000)),
                };
                sc.faults.push((at, fault));
            }
            sc.faults.sort_by_key(|f| f.0);
        }
    }
    sc
}

/// The longest dispatch delay a scenario draws: 30 days, or 40 legs where
/// a leg is shorter (SQS: 10 hours), to bound the steps a run takes.
fn longest_delay(sem: Semantics) -> Duration {
    let month = Duration::from_secs(30 * 86_400);
    sem.longest_leg().map_or(month, |leg| month.min(leg * 40))
}

/// A dispatch delay for `sem`, in whole milliseconds: none (zero), short,
/// a leg's multiple give or take a little, one of RabbitMQ's buckets give
/// or take a little, or anything up to [`longest_delay`].
fn dispatch_delay(r: &mut ChaCha8Rng, sem: Semantics) -> Duration {
    let leg = sem.longest_leg().unwrap_or(Duration::from_secs(86_400));
    let near = |r: &mut ChaCha8Rng, at: Duration| {
        let off = ms(r, 0, 2_000);
        if r.gen_bool(0.5) {
            at + off
        } else {
            at.saturating_sub(off)
        }
    };
    let longest = longest_delay(sem).as_millis() as u64;
    match r.gen_range(0..5) {
        0 => Duration::ZERO,
        1 => ms(r, 1, 10_000),
        2 => {
            let k = r.gen_range(1..=3);
            near(r, leg * k)
        }
        3 => {
            let b = *crate::model::BUCKETS.choose(r).expect("bucket");
            near(r, Duration::from_secs(b))
        }
        _ => ms(r, 1, longest),
    }
}

/// What a `PanicBefore` step panics with.
pub(crate) const PANIC_BEFORE: &str = "sim: panic before the handler's future";
/// What a `PanicInside` step panics with.
pub(crate) const PANIC_INSIDE: &str = "sim: panic inside the handler's future";

/// The length of an always-panicking script: more than the largest cap
/// (5) times the largest tier one (3).
const ALWAYS_PANICS: u64 = 16;

/// Whether `step` panics (or kills its worker) when it runs.
pub fn panics(step: &Step) -> bool {
    matches!(
        step,
        Step::PanicBefore | Step::PanicInside | Step::KillsWorker
    )
}

/// The scenario of message `n` run by itself on the memory model: the same
/// jobs, message and script, no other message, no fault.
pub fn alone(sc: &Scenario, n: u64) -> Scenario {
    let mut m = sc.msgs.iter().find(|m| m.n == n).expect("message").clone();
    m.at = Duration::ZERO;
    Scenario {
        sem: Semantics::Memory,
        jobs: sc.jobs.clone(),
        concurrency: 1,
        unknown_cap: sc.unknown_cap,
        msgs: vec![m],
        faults: Vec::new(),
        batch: 1,
        broker_limit: None,
        charging: sc.charging.clone(),
    }
}

/// An application error wrapping another.
#[derive(Debug)]
struct UserError(BoxError);

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("while doing sim work")
    }
}

impl StdError for UserError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.0.as_ref())
    }
}

/// A concrete error type holding a boxed error, for `BreakerError<E>`
/// (which needs a sized `E`): the operation's own error, shown as it is, with
/// the held error as its source. (A wrapper that forwarded `source()` past
/// the held error, like thiserror's `transparent`, would hide a marker; the
/// guide (guide/rules.md) says to use `#[source]` instead.)
#[derive(Debug)]
struct Transparent(BoxError);

impl fmt::Display for Transparent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl StdError for Transparent {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.0.as_ref())
    }
}

/// Runs a failing call with `err` through `breaker`: the boxed
/// `BreakerError::Inner(err)`, or the breaker's refusal (`true`) if it is open.
async fn call_failing<E>(breaker: &CircuitBreaker, err: E) -> (BoxError, bool)
where
    E: StdError + Send + Sync + 'static,
{
    match breaker.call(|| async move { Err::<(), E>(err) }).await {
        Err(BreakerError::Open(o)) => (Box::new(BreakerError::<E>::Open(o)), true),
        Err(e) => (Box::new(e), false),
        Ok(()) => unreachable!("the call always fails"),
    }
}

/// A marker directly inside `BreakerError::Inner` keeps its own type there;
/// anything else is held by [`Transparent`].
async fn through_breaker(breaker: &CircuitBreaker, inner: BoxError) -> (BoxError, bool) {
    let inner = match inner.downcast::<Permanent>() {
        Ok(p) => return call_failing(breaker, *p).await,
        Err(e) => e,
    };
    let inner = match inner.downcast::<RetryAfter>() {
        Ok(p) => return call_failing(breaker, *p).await,
        Err(e) => e,
    };
    match inner.downcast::<Reject>() {
        Ok(p) => call_failing(breaker, *p).await,
        Err(e) => call_failing(breaker, Transparent(e)).await,
    }
}

async fn marker(breaker: &CircuitBreaker, base: BoxError, wraps: &[Wrap]) -> (JobError, bool) {
    let mut err = base;
    let mut open = false;
    for w in wraps {
        err = match w {
            Wrap::User => Box::new(UserError(err)),
            Wrap::Io => Box::new(std::io::Error::other(err)),
            Wrap::Breaker => {
                let (e, o) = through_breaker(breaker, err).await;
                open |= o;
                e
            }
        };
    }
    (JobError::new(err), open)
}

fn step_name(s: &Step) -> String {
    format!("{s:?}")
}

/// The delivery of message `n` an execution with `ctx` belongs to.
pub(crate) fn delivery_of(st: &State, n: u64, ctx: &JobContext) -> Option<u64> {
    st.dlvs
        .iter()
        .filter(|(_, d)| d.msg == n && d.attempt == ctx.attempt() && !d.ended)
        .map(|(&id, _)| id)
        .next_back()
}

/// Records the start of an execution; returns the step and the delivery.
pub(crate) fn begin(world: &World, n: u64, ctx: &JobContext) -> (Step, Option<u64>) {
    let mut st = world.lock();
    let idx = delivery_of(&st, n, ctx);
    let script = st.scripts.entry(n).or_default();
    let step = if script.is_empty() {
        Step::Ok
    } else {
        script.remove(0)
    };
    if world.sem == Semantics::Cloudflare {
        if let Some(d) = idx {
            World::cf_consumed(&mut st, d, Some(&step));
        }
    }
    world.log(
        &mut st,
        Some(n),
        Ev::Exec {
            delivery: idx,
            attempt: ctx.attempt(),
            in_process: ctx.in_process_attempt(),
            step: step_name(&step),
        },
    );
    (step, idx)
}

pub(crate) fn result(world: &World, n: u64, delivery: Option<u64>, eff: Eff) {
    let mut st = world.lock();
    world.log(&mut st, Some(n), Ev::ExecResult { delivery, eff });
}

pub(crate) async fn run_step(
    world: Arc<World>,
    ctx: JobContext,
    n: u64,
    delivery: Option<u64>,
    step: Step,
    breaker: CircuitBreaker,
    timeout: Option<Duration>,
) -> Result<(), JobError> {
    let (eff, res) = match step {
        Step::Ok | Step::PanicBefore | Step::KillsWorker => (Eff::Ok, Ok(())),
        Step::Ordinary => (
            Eff::Ordinary,
            Err(JobError::new(std::io::Error::other("sim ordinary failure"))),
        ),
        Step::RetryAfter(d, w) => {
            let (e, open) = marker(&breaker, Box::new(RetryAfter::without_cause(d)), &w).await;
            (
                if open {
                    Eff::BreakerOpen
                } else {
                    Eff::RetryAfter(d)
                },
                Err(e),
            )
        }
        Step::Permanent(w) => {
            let (e, open) = marker(&breaker, Box::new(Permanent::new("sim permanent")), &w).await;
            (
                if open {
                    Eff::BreakerOpen
                } else {
                    Eff::Permanent
                },
                Err(e),
            )
        }
        Step::Reject(w) => {
            let (e, open) = marker(&breaker, Box::new(Reject::new("sim reject")), &w).await;
            (if open { Eff::BreakerOpen } else { Eff::Reject }, Err(e))
        }
        Step::PanicInside => {
            tokio::task::yield_now().await;
            result(&world, n, delivery, Eff::Panic);
            panic!("{PANIC_INSIDE}");
        }
        Step::Hang => {
            tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(2)) + Duration::from_secs(1))
                .await;
            (
                Eff::Ordinary,
                Err(JobError::new(std::io::Error::other("sim hang ended"))),
            )
        }
        Step::CooperativeCancel(w) => {
            tokio::select! {
                _ = ctx.cancelled() => {}
                _ = tokio::time::sleep(w) => {}
            }
            match ctx.check_cancelled() {
                Ok(()) => (Eff::Ok, Ok(())),
                Err(c) => (Eff::Cancelled, Err(JobError::new(c))),
            }
        }
    };
    result(&world, n, delivery, eff);
    res
}

/// Builds a fresh registry (a new process) for the scenario.
pub fn registry(sc: &Scenario, world: &Arc<World>, clock: &Arc<TokioRuntime>) -> Registry {
    let mut registry = Registry::new();
    for (j, plan) in sc.jobs.iter().enumerate() {
        let mut b = Job::<Payload>::builder(plan.name.clone())
            .queue(plan.queue.clone())
            .delivery_cap((plan.cap > 0).then_some(plan.cap))
            .tier_one(plan.tier_one)
            .tier_one_backoff(Duration::from_millis(200), 2.0, Duration::from_secs(1));
        match plan.backoff {
            1 => b = b.backoff(Duration::from_secs(1), 2.0, Duration::from_secs(8)),
            2 => b = b.backoff_fn(|a| Duration::from_millis(500) * a),
            _ => {}
        }
        if let Some(w) = plan.t1_max_wait {
            b = b.tier_one_max_wait(w);
        }
        if let Some(t) = plan.timeout {
            b = b.timeout(t);
        }
        let breaker = match plan.breaker {
            Some((threshold, cool_down)) => {
                let br = CircuitBreaker::with_clock(
                    format!("{}-dep", plan.name),
                    BreakerConfig {
                        failure_threshold: threshold,
                        cool_down,
                    },
                    clock.clone(),
                )
                .expect("breaker");
                b = b.breaker(br.clone());
                br
            }
            None => CircuitBreaker::with_clock(
                "standalone",
                BreakerConfig {
                    failure_threshold: u32::MAX,
                    cool_down: Duration::from_secs(1),
                },
                clock.clone(),
            )
            .expect("breaker"),
        };
        if plan.validate {
            b = b.validate(|p: &Payload| {
                if p.invalid {
                    Err("sim: invalid payload".into())
                } else {
                    Ok(())
                }
            });
        }
        let job = b.build().expect("valid job");
        if let Some(charging) = sc.charging.as_ref().filter(|c| c.job == j) {
            let (world, lease, timeout) = (world.clone(), charging.lease, plan.timeout);
            registry
                .register(&job, move |ctx: JobContext, p: Payload| {
                    crate::charge::handler(world.clone(), ctx, p, lease, breaker.clone(), timeout)
                })
                .expect("register");
            continue;
        }
        let world = world.clone();
        let timeout = plan.timeout;
        registry
            .register(&job, move |ctx: JobContext, p: Payload| {
                let edge = world.sem == Semantics::Cloudflare;
                if edge && crate::cloudflare::frozen() {
                    // The instance has crashed: nothing more runs in it.
                    return Box::pin(std::future::pending())
                        as BoxFuture<'static, Result<(), JobError>>;
                }
                let (step, delivery) = begin(&world, p.n, &ctx);
                if step == Step::KillsWorker {
                    let world = world.clone();
                    return Box::pin(async move {
                        if world.sem == Semantics::Cloudflare {
                            crate::cloudflare::crash(delivery, None);
                        } else {
                            world.request_crash();
                        }
                        std::future::pending::<Result<(), JobError>>().await
                    }) as BoxFuture<'static, Result<(), JobError>>;
                }
                if step == Step::PanicBefore {
                    result(&world, p.n, delivery, Eff::Panic);
                    // On wasm32 a panic aborts the instance: no unwinding.
                    if edge {
                        crate::cloudflare::crash(delivery, Some(PANIC_BEFORE));
                        return Box::pin(std::future::pending());
                    }
                    panic!("{PANIC_BEFORE}");
                }
                let world = world.clone();
                let breaker = breaker.clone();
                let n = p.n;
                Box::pin(async move {
                    if edge && step == Step::PanicInside {
                        result(&world, n, delivery, Eff::Panic);
                        crate::cloudflare::crash(delivery, Some(PANIC_INSIDE));
                        std::future::pending::<()>().await;
                    }
                    run_step(world, ctx, n, delivery, step, breaker, timeout).await
                })
            })
            .expect("register");
    }
    registry.unknown_name_attempts(UnknownNameAttempts::limited(sc.unknown_cap));
    registry.unknown_name_retry_delay(Duration::from_secs(1));
    registry.event_sink(Arc::new(Sink(world.clone())));
    registry
}
