//! A deterministic simulation of the whole system.
//!
//! # Why
//!
//! Unit tests check one rule at a time with the inputs their author thought
//! of. The defects that hurt a queue facade live between the rules: a marker
//! hidden by a wrapper, a shutdown on the last allowed delivery, a panic at a
//! place nobody tried, a consumer that starves a queue when its concurrency
//! is low. In the spirit of FoundationDB's and TigerBeetle's simulation
//! testing, this crate runs the REAL `jobrail::Registry` (executor, breaker,
//! the `Registry::deliver` pipeline), the REAL native
//! `jobrail_native::Consumer` and the REAL edge batch loop
//! (`jobrail_edge::EdgeConsumer`) against model backends, on a tokio
//! current-thread runtime with paused time: hours of virtual time pass in
//! milliseconds, and a seed fixes everything (jobs, policies, messages,
//! outcome scripts, faults), so any failure replays exactly.
//!
//! # How
//!
//! A seed generates a [`scenario::Scenario`]: one to four jobs with random
//! policies, a consumer concurrency, five to forty messages (some
//! malformed, with unknown job names, undecodable or invalid), one outcome
//! script per message (one scripted outcome per handler execution, then
//! success) and up to four faults (crash, graceful shutdown, refused
//! settlements, lost connection, a handler that kills its worker). One seed
//! in four also makes one of its jobs *charging*: its messages carry a
//! business key drawn from one to three (several messages share a key, as
//! duplicate dispatches of one order do), and its handler (`charge`) runs
//! each scripted execution inside the real `jobrail::run_once`, on one
//! `MemoryClaims` per run that every consumer and edge instance share, on
//! the simulation's clock, with a lease longer than any execution (so a
//! lease ends only for a holder that died). The charge happens when a
//! claimed execution succeeds: the run's ledger records it then, and the
//! completion follows with no await in between (atomic, as Postgres's
//! `complete_in` makes them). An execution that finds its key done runs no
//! step and succeeds; one that finds it held runs no step and asks for a
//! retry after the remaining lease. The [`model`] backends mimic memory,
//! RabbitMQ, SQS, NATS JetStream, Cloudflare Queues and the Postgres queue
//! (attempt counting, redelivery timing, what reject and fail do, and on
//! Postgres the fencing of a settlement whose lease was taken over) and
//! record one trace. The
//! Cloudflare host (`cloudflare`) drives the edge's batch loop as the
//! Worker's JavaScript driver does: a handler panic aborts the wasm instance,
//! and the invocation resumes in a fresh one on the batch's unsettled
//! messages, the panicking one settled as one failed execution; a handler
//! that kills the worker loses the invocation (unmarked messages come back
//! with a delivery spent). After the run, [`check`] checks the invariants
//! below against that trace; for invariant 11 the batch-mates of a panic
//! are also run alone on the memory model.
//!
//! # Invariants
//!
//! 1. Every message ends exactly once (acked, one failure record, dropped by
//!    a reject, dead-lettered), or is still held for a reason; a second
//!    failure record only after a crash between record and acknowledgement.
//! 2. Executions per message stay within N x (M + shutdown retries + 1),
//!    plus executions of deliveries abandoned by injected faults.
//! 3. No message fails with zero executions unless a rule says so (malformed,
//!    undecodable, unknown name, invalid payload, or a cap spent by injected
//!    crashes, or a rejection the platform did not keep because the
//!    invocation holding it was lost).
//! 4. A delivery abandoned without settlement is explained by an injected
//!    fault; otherwise a delivery task died.
//! 5. An event follows each accepted settlement, and only those.
//! 6. Every retry waits at least the delay requested.
//! 7. A graceful-shutdown retry never costs the last execution: the next
//!    delivery runs the handler.
//! 8. The settlement matches the outcome table for the delivery's last
//!    execution.
//! 9. Liveness: every message is terminal by the horizon.
//! 10. The crash bound: the deliveries that ran the handler (crashed ones
//!     included) stay within the cap plus the graceful-shutdown returns
//!     (plus one of grace where those cannot be counted), so a message
//!     that kills its worker every time ends in a failure record; a
//!     broker's own delivery limit set to the least a driver accepts never
//!     ends a message before the facade does (checked under invariant 1).
//! 11. A panic stays with its message: at the edge, a message that never
//!     panics settles as it does alone (same end, deliveries and executions
//!     as the memory model running it by itself), whatever its batch-mates
//!     do, unless an injected fault or the invocation's budget touched it.
//!     An execution cut short by a batch-mate's crash runs again and does
//!     not count (nor under invariant 2).
//! 12. A message that panics on every execution ends in exactly one failure
//!     record, on the delivery at its cap; at the edge, where the crash ends
//!     the delivery's execution, after exactly one execution per delivery
//!     (natively tier one retries the panic within the delivery). An
//!     execution of a charging message that found its key done or held did
//!     not panic: the message is left out.
//! 13. Effects happen once (the charging job). The claim operations of the
//!     trace are replayed against a model of the claim rules (fences grow
//!     by one; `Held` tells the live lease's remaining time exactly; `Done`
//!     follows a completion; a completion or release only by the live latest
//!     claim).
//!     - 13a. At most one charge per business key, whatever the crashes,
//!       shutdowns, panics and redeliveries; every charge happens under the
//!       key's live latest claim and its completion is accepted.
//!     - 13b. A charging message acknowledged as a success (its handler ran
//!       the charge, or found the key done) has exactly one charge of its
//!       key behind it; `Done` is answered only after a completion, and a
//!       charged key is completed.
//!     - 13c. A key held by a holder that died (a killed worker, a crashed
//!       consumer, a crashed edge instance) is not claimed again before its
//!       lease ends. Meanwhile its deliveries settle by the ordinary rules:
//!       a retry after at least the remaining lease (checked under 8, the
//!       held answer being a `RetryAfter` of that time), or at the cap a
//!       failure whose cause is the held claim. Conversely, a holder that
//!       did not die gives its claim back the instant its execution ends:
//!       completed after a success, released after an error or (natively,
//!       where it unwinds) a panic.
//!
//!     The outcome table (8) takes a done key's execution as a success and
//!     a held one's as that `RetryAfter`; execution counts (2, 10) count
//!     them as the executions they are. Invariant 11 leaves charging
//!     messages out: their fate hangs on their key's other messages and on
//!     the claims crashes left behind.
//! 14. A refused settlement never becomes a hot loop: after a settlement
//!     the backend refused, the message's next delivery comes no sooner
//!     than the backend's hold (its lease: SQS's visibility, NATS's
//!     AckWait; half the Postgres lease, the least of it left after a
//!     renewal; 30 s where it has none: memory, RabbitMQ, the edge), unless
//!     a crash, restart, lost connection or instance panic came between.
//!     [`run_refusing`] holds every backend to the rate this implies with
//!     every settlement refused.
//! 15. Long delays. One seed in four dispatches some messages with a delay
//!     (zero; short; a leg's multiple, or a RabbitMQ bucket, give or take
//!     two seconds; anything up to 30 days, or 40 legs where that is less),
//!     and puts crashes, shutdowns and lost connections near their due
//!     times. The producer's side is `Producer::prepare`'s (the edge's
//!     `prepare_send`) with the shared functions (`jobrail::with_due`,
//!     `jobrail::delay_leg`) on the model's wall clock
//!     ([`model::DELAY_EPOCH_MS`] plus the virtual time); each backend
//!     model holds a leg as the backend does ([`Semantics::longest_leg`]:
//!     RabbitMQ a day, rounded down to a bucket; SQS 900 s, whole seconds up;
//!     the edge a day, whole seconds up; memory, NATS and Postgres any
//!     delay, Postgres to the microsecond up); and the consumer's step
//!     (`jobrail::delay_remaining` on that clock: a copy delayed by the next
//!     leg, the delivery acknowledged) is taken by the model as a delivery
//!     is handed out. A delayed message never reaches a consumer before its
//!     due time; becomes deliverable within the backend's precision after it
//!     ([`Semantics::delay_precision`]: RabbitMQ the smallest bucket, SQS and
//!     the edge 1 s, Postgres 1 µs, memory and NATS exactly, each plus the
//!     clock's millisecond; a body that is not an envelope, held whole, as
//!     the backend rounds a plain delay); is stepped only before it; counts
//!     attempt 1 on its first delivery (a step runs nothing and counts
//!     nothing); costs at most [`Semantics::delay_messages_bound`] messages
//!     (`ceil(delay / leg)`; RabbitMQ's greedy bound); and is not lost (9,
//!     whose horizon runs from the last due time). Not modelled: a step's
//!     send or acknowledgement failing (the model's never fail, and nothing
//!     awaits between them, so a crash cannot leave two copies), and how
//!     soon a consumer takes a deliverable message (its slots, its
//!     restarts).
//! 16. Schedules ([`schedule`]): several schedulers, crashing and
//!     restarting, run the real `jobrail::ScheduleFiring` on one
//!     `jobrail::MemoryClaims` on virtual time: each tick at most once but
//!     for a firer's death between its send and its completion, never
//!     early, nothing at or before the first start, a watched tick taken
//!     over within the lease and the poll, missed ticks as the policy says
//!     (`Skip`, `Latest`, `Each(n)`), ticks as the expression's across a
//!     daylight-saving transition.
//!
//! The clock is the real `jobrail_native::TokioRuntime`, whose clock follows
//! tokio's paused time (the simulation found that it did not: breaker
//! cool-downs and deadlines read the wall clock while sleeps were virtual).

use std::collections::BTreeMap;
use std::sync::{Arc, Once};
use std::time::Duration;

use jobrail::{Envelope, Runtime};
use jobrail_native::{Consumer, ConsumerHandle, Driver, Outgoing, TokioRuntime};
use rand::Rng;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

mod charge;
pub mod check;
mod cloudflare;
pub mod model;
pub mod scenario;
pub mod schedule;

pub use check::{ClaimStats, DelayStats, Report, Violation};
use model::{Abandon, Ev, MState, Model, Semantics, World};
use scenario::{Fault, Kind, Scenario};
pub use schedule::{run_schedule_seed, ScheduleReport, ScheduleStats};

/// Virtual time after the last dispatch before the run stops.
pub const HORIZON: Duration = Duration::from_secs(6 * 3600);
/// Cloudflare's `max_retries` in the model.
pub const CF_MAX_RETRIES: u32 = 20;

/// A backend to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Backend {
    /// In-memory driver.
    Memory,
    /// RabbitMQ.
    Rabbit,
    /// SQS.
    Sqs,
    /// NATS JetStream.
    Nats,
    /// Cloudflare Queues.
    Cloudflare,
    /// The Postgres queue (`jobrail_postgres::PgDriver`).
    Postgres,
}

impl Backend {
    /// Every backend.
    pub const ALL: [Backend; 6] = [
        Backend::Memory,
        Backend::Rabbit,
        Backend::Sqs,
        Backend::Nats,
        Backend::Cloudflare,
        Backend::Postgres,
    ];

    /// How many backends a seed's draw picks from: the five the simulation
    /// first had, so that adding a backend changed no seed's draws (every
    /// scenario, on every backend, stays as it was).
    const FIRST_DRAWN: usize = 5;

    /// The backend seed `seed` runs on when none is named: a backend added
    /// after the first five takes one seed in [`Backend::ALL`]`.len()` (by
    /// the seed alone); any other seed, `drawn` of the first five.
    fn picked(seed: u64, drawn: usize) -> Backend {
        let all = Backend::ALL.len() as u64;
        let later = (seed % all) as usize;
        if later >= Backend::FIRST_DRAWN {
            Backend::ALL[later]
        } else {
            Backend::ALL[drawn]
        }
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Rabbit => "rabbit",
            Backend::Sqs => "sqs",
            Backend::Nats => "nats",
            Backend::Cloudflare => "cloudflare",
            Backend::Postgres => "postgres",
        }
    }

    /// Parses a command-line name.
    pub fn parse(s: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == s)
    }

    fn sem(self) -> Semantics {
        match self {
            Backend::Memory => Semantics::Memory,
            Backend::Rabbit => Semantics::Rabbit,
            Backend::Sqs => Semantics::Sqs,
            Backend::Nats => Semantics::Nats,
            Backend::Cloudflare => Semantics::Cloudflare,
            Backend::Postgres => Semantics::Postgres,
        }
    }
}

fn quiet_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let p = info.payload();
            let text = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            if !text.starts_with("sim:") {
                previous(info);
            }
        }));
    });
}

/// Runs one seed and checks the invariants.
pub fn run_seed(seed: u64, backend: Option<Backend>) -> Report {
    quiet_panics();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let drawn = rng.gen_range(0..Backend::FIRST_DRAWN);
    let backend = backend.unwrap_or(Backend::picked(seed, drawn));
    let sc = scenario::generate(&mut rng, backend.sem());
    let rt = paused_runtime();
    let world = simulate_on(&rt, &sc, HORIZON);
    // Invariant 11's reference: each batch-mate of a panic, run by itself.
    let mut alone = BTreeMap::new();
    for n in check::alone_candidates(&sc, &world) {
        let solo = simulate_on(&rt, &scenario::alone(&sc, n), HORIZON);
        alone.insert(n, check::fate(&solo, n));
    }
    drop(rt);
    check::check(seed, backend, &sc, &world, &alone)
}

/// Virtual time [`run_refusing`] runs for after the last dispatch.
pub const REFUSING_HORIZON: Duration = Duration::from_secs(30 * 60);

/// What a run with every settlement refused showed ([`run_refusing`]).
#[derive(Debug)]
pub struct RefusalReport {
    /// The seed.
    pub seed: u64,
    /// The backend simulated.
    pub backend: Backend,
    /// Settlements refused in the run.
    pub refused: usize,
    /// The most handler executions of one message per hour of the time it
    /// was in the run (first delivery to the end).
    pub worst_per_hour: f64,
    /// What broke the bound (invariant 14, and its rate form), if anything.
    pub violations: Vec<String>,
    /// The run's trace and invariant check (the other invariants are not
    /// expected to hold: nothing is ever settled), for the traces of the
    /// messages concerned.
    pub report: Report,
}

impl RefusalReport {
    /// The violations, with the traces of the messages concerned.
    pub fn details(&self) -> String {
        let mut out = format!(
            "seed {} backend {} with every settlement refused: {} refusals\n",
            self.seed,
            self.backend.name(),
            self.refused
        );
        let mut shown = Vec::new();
        for v in &self.violations {
            out.push_str(&format!("  {v}\n"));
            let m = v.split(['m', ' ', ']']).find_map(|t| t.parse::<u64>().ok());
            if let Some(m) = m.filter(|m| !shown.contains(m) && shown.len() < 3) {
                shown.push(m);
                out.push_str(&format!(
                    "--- trace of m{m} ---\n{}",
                    self.report.trace_of(m)
                ));
            }
        }
        out.push_str(&format!(
            "replay: cargo run -p jobrail-simulation -- --seed {} --backend {} --refusing\n",
            self.seed,
            self.backend.name()
        ));
        out
    }
}

/// The hot-loop property: seed `seed`'s scenario on `backend` with every
/// settlement refused from the start ([`Fault::Refuse`] without end, the
/// seed's other faults left out), for [`REFUSING_HORIZON`] of virtual time.
/// Nothing is ever settled, so no message ends (but at the edge, where the
/// platform's `max_retries` dead-letters it, or by a rejection, which asks
/// nothing of the platform): the check is that no message runs faster than
/// the backend's refused-settlement hold lets it, on every backend model.
///
/// Each message's handler executions stay within its in-process attempts
/// times (the run time after its first delivery over the hold, plus two,
/// plus one per crash, restart, lost connection or lost invocation of the
/// run, each of which may return a message at once); and invariant 14 holds
/// for every refused delivery.
pub fn run_refusing(seed: u64, backend: Backend) -> RefusalReport {
    quiet_panics();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut sc = scenario::generate(&mut rng, backend.sem());
    sc.faults = vec![(Duration::ZERO, Fault::Refuse(u32::MAX))];
    // Dispatch delays left out: the property is the refusals' (a delay
    // only postpones the first delivery, and would stretch the run).
    for m in &mut sc.msgs {
        m.delay = None;
    }
    let world = simulate_on(&paused_runtime(), &sc, REFUSING_HORIZON);
    let hold = sc.sem.refused_hold();
    let st = world.lock();
    let end = st.trace.iter().map(|e| e.at).max().unwrap_or_default();
    let restarts = check::handing_back_faults(&st.trace).len() as u64;
    let refused = st
        .trace
        .iter()
        .filter(|e| matches!(e.ev, Ev::Refused { .. }))
        .count();
    let mut violations = Vec::new();
    let mut worst_per_hour = 0.0f64;
    for plan in &sc.msgs {
        let mine: Vec<&model::Entry> = st.trace.iter().filter(|e| e.msg == Some(plan.n)).collect();
        let Some(first) = mine.iter().find(|e| matches!(e.ev, Ev::Delivered { .. })) else {
            continue;
        };
        let executions = mine
            .iter()
            .filter(|e| matches!(e.ev, Ev::Exec { .. }))
            .count() as u64;
        let span = end.saturating_sub(first.at);
        let tier_one = u64::from(sc.jobs[plan.job].tier_one.max(1));
        let bound = tier_one * (span.as_secs() / hold.as_secs().max(1) + 2 + restarts);
        if executions > bound {
            violations.push(format!(
                "m{} ran {executions} times in {span:?} with every settlement refused: more than \
                 {bound} ({tier_one} in-process attempts per delivery, one delivery per {hold:?} hold)",
                plan.n
            ));
        }
        let hours = span.as_secs_f64().max(hold.as_secs_f64()) / 3600.0;
        worst_per_hour = worst_per_hour.max(executions as f64 / hours);
    }
    drop(st);
    let report = check::check(seed, backend, &sc, &world, &BTreeMap::new());
    violations.extend(
        report
            .violations
            .iter()
            .filter(|v| v.invariant == 14)
            .map(ToString::to_string),
    );
    RefusalReport {
        seed,
        backend,
        refused,
        worst_per_hour,
        violations,
        report,
    }
}

/// A current-thread tokio runtime on paused (virtual) time.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime")
}

/// Runs `sc` on `rt` until every message is done or `horizon` after its
/// last dispatch (the edge's futures, not `Send`, as local tasks).
fn simulate_on(rt: &tokio::runtime::Runtime, sc: &Scenario, horizon: Duration) -> Arc<World> {
    if sc.sem == Semantics::Cloudflare {
        tokio::task::LocalSet::new().block_on(rt, simulate(sc, horizon))
    } else {
        rt.block_on(simulate(sc, horizon))
    }
}

enum Host {
    Native(ConsumerHandle),
    Edge(Vec<tokio::task::JoinHandle<()>>),
}

fn start(sc: &Scenario, world: &Arc<World>, clock: &Arc<TokioRuntime>, inc: u32) -> Host {
    {
        let mut st = world.lock();
        world.log(&mut st, None, Ev::Fault(format!("consumer {inc} starts")));
    }
    if sc.sem == Semantics::Cloudflare {
        // One instance per queue, each building its own consumer (the edge's
        // futures are not `Send`: local tasks).
        let shared = std::rc::Rc::new(sc.clone());
        let mut queues: Vec<String> = sc.jobs.iter().map(|j| j.queue.clone()).collect();
        queues.sort();
        queues.dedup();
        let tasks = queues
            .into_iter()
            .map(|q| {
                tokio::task::spawn_local(cloudflare::run_queue(
                    shared.clone(),
                    world.clone(),
                    clock.clone(),
                    q,
                    sc.batch,
                    sc.concurrency,
                    inc,
                    CF_MAX_RETRIES,
                ))
            })
            .collect();
        return Host::Edge(tasks);
    }
    let registry = scenario::registry(sc, world, clock);
    let driver: Arc<dyn Driver> = Arc::new(Model {
        world: world.clone(),
        incarnation: inc,
    });
    let runtime: Arc<dyn Runtime> = clock.clone();
    Host::Native(
        Consumer::builder(driver, registry)
            .concurrency(sc.concurrency)
            .runtime(runtime)
            .build()
            .spawn(),
    )
}

async fn stop(host: Host, world: &World, inc: u32, graceful: bool) {
    {
        let mut st = world.lock();
        if graceful {
            st.shutting.insert(inc);
        } else {
            st.crashed.insert(inc);
        }
        let what = if graceful {
            "graceful shutdown"
        } else {
            "crash"
        };
        world.log(
            &mut st,
            None,
            Ev::Fault(format!("{what} of consumer {inc}")),
        );
    }
    match host {
        Host::Native(h) if graceful => {
            let _ = h.shutdown().await;
        }
        Host::Native(h) => h.abort(),
        Host::Edge(tasks) => {
            // No graceful shutdown at the edge: the instance is reset, and
            // the invocations in flight are lost.
            for t in tasks {
                t.abort();
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            let active: Vec<u64> = world.lock().cf_active.iter().copied().collect();
            world.lock().crashed.insert(inc);
            world.cf_end(&active, Some(Abandon::Crash), CF_MAX_RETRIES);
        }
    }
    // Let aborted tasks drop their deliveries.
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A handler killed its worker: abort the consumer (nothing settled) and
/// start a new one, as a process supervisor would.
async fn crash_and_restart(
    sc: &Scenario,
    world: &Arc<World>,
    clock: &Arc<TokioRuntime>,
    host: Host,
    inc: u32,
) -> (Host, u32) {
    stop(host, world, inc, false).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    (start(sc, world, clock, inc + 1), inc + 1)
}

fn outgoing(sc: &Scenario, m: &scenario::MsgPlan) -> (String, Vec<u8>) {
    let job = &sc.jobs[m.job].name;
    let env = match m.kind {
        Kind::Malformed => {
            return (
                format!("malformed-{}", m.n),
                format!("not an envelope {}", m.n).into_bytes(),
            )
        }
        Kind::Valid | Kind::Invalid => {
            let mut payload = serde_json::json!({"n": m.n, "invalid": m.kind == Kind::Invalid});
            if let Some(key) = &m.key {
                payload["key"] = key.clone().into();
            }
            Envelope::new(job.clone(), payload)
        }
        Kind::UnknownName => Envelope::new("job-nobody-knows", serde_json::json!({"n": m.n})),
        Kind::Undecodable => Envelope::new(job.clone(), serde_json::json!({"n": "text"})),
    };
    (env.id.clone(), env.encode())
}

/// Runs `sc` until every message is done or `horizon` after its last
/// dispatch.
async fn simulate(sc: &Scenario, horizon: Duration) -> Arc<World> {
    let world = World::new(sc.sem);
    world.lock().broker_limit = sc.broker_limit;
    let clock = Arc::new(TokioRuntime);
    let t0 = tokio::time::Instant::now();
    let mut sends = Vec::new();
    {
        let mut st = world.lock();
        for m in &sc.msgs {
            let (id, body) = outgoing(sc, m);
            st.ids.insert(id.clone(), m.n);
            st.scripts.insert(m.n, m.script.clone());
            sends.push((m.at, m.queue.clone(), id, body, m.delay));
        }
    }
    let sender = Model {
        world: world.clone(),
        incarnation: 0,
    };
    let sem = sc.sem;
    let dispatcher = tokio::spawn(async move {
        for (at, queue, id, body, delay) in sends {
            tokio::time::sleep_until(t0 + at).await;
            let now_ms = sender.world.now_ms();
            let (body, delay) = model::prepare_dispatch(sem, body, delay, now_ms);
            let _ = sender.send(&queue, Outgoing { id, body, delay }).await;
        }
    });
    let mut inc = 0;
    let mut host = start(sc, &world, &clock, inc);
    for (at, fault) in &sc.faults {
        loop {
            tokio::select! {
                biased;
                _ = tokio::time::sleep_until(t0 + *at) => break,
                _ = world.crash_requested.notified() => {
                    (host, inc) = crash_and_restart(sc, &world, &clock, host, inc).await;
                }
            }
        }
        match fault {
            Fault::Crash(pause) | Fault::Shutdown(pause) => {
                stop(host, &world, inc, matches!(fault, Fault::Shutdown(_))).await;
                tokio::time::sleep(*pause).await;
                inc += 1;
                host = start(sc, &world, &clock, inc);
            }
            Fault::Refuse(n) => {
                let mut st = world.lock();
                st.refuse += n;
                world.log(
                    &mut st,
                    None,
                    Ev::Fault(format!("refuse the next {n} settlements")),
                );
            }
            Fault::ConnectionLost => {
                {
                    let mut st = world.lock();
                    world.log(&mut st, None, Ev::Fault("connection lost".into()));
                }
                world.lose_connection(inc);
            }
        }
    }
    // The horizon runs from the last due time (a dispatch plus its delay).
    let last = sc.msgs.iter().map(|m| m.due()).max().unwrap_or_default();
    let horizon = t0 + last + horizon;
    loop {
        let (done, idle_until) = {
            let st = world.lock();
            let done = dispatcher.is_finished()
                && st.msgs.len() == sc.msgs.len()
                && st.msgs.values().all(|m| m.state == MState::Done);
            // Nothing in flight and every message held for later (a long
            // delay): nothing can end before the first comes back.
            let idle = dispatcher.is_finished()
                && !st
                    .msgs
                    .values()
                    .any(|m| matches!(m.state, MState::InFlight(_)));
            let next = st
                .msgs
                .values()
                .filter(|m| m.state == MState::Ready)
                .map(|m| m.avail)
                .min();
            (done, next.filter(|_| idle))
        };
        let runaway = world.lock().deliveries > 20_000;
        let now = tokio::time::Instant::now();
        if done || runaway || now >= horizon {
            break;
        }
        let poll = Duration::from_secs(5);
        let wake = match idle_until {
            Some(at) if at > now + poll => at.min(horizon),
            _ => now + poll,
        };
        tokio::select! {
            biased;
            _ = world.crash_requested.notified() => {
                (host, inc) = crash_and_restart(sc, &world, &clock, host, inc).await;
            }
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
    stop(host, &world, inc, true).await;
    world
}
