//! Schedules: several schedulers firing one schedule on one claim store.
//!
//! A seed generates a [`ScheduleScenario`]: a cron expression (every
//! second, every minute, every quarter of an hour, or a fixed local hour),
//! read in a time zone (UTC, Paris, New York, Lord Howe with its half-hour
//! shift) over a run placed across a daylight-saving transition; a missed
//! policy (skip, latest, each of the last 1, 3 or 200); a tick lease; and
//! two to five schedulers, each with a poll latency and a life plan: started
//! at generated times, each life ending in a crash (between passes, or in a
//! send: before the job went out, or after it went out and before the
//! claim's completion), restarted after a pause, the last life running to
//! the end. Sends fail now and then (certainly unsent, or uncertain).
//!
//! Every scheduler runs the real [`jobrail::ScheduleFiring`] on the real
//! [`jobrail::MemoryClaims`], whose leases run on a [`jobrail::VirtualRuntime`]
//! advanced with the run; `fire_due` is given the virtual wall clock. A
//! scheduler that crashes in a send has its pass dropped where it stands
//! (the send never completes), its claim left to its lease. Events happen
//! in time order, ties in an order the seed draws; a scheduler's next pass
//! is the `next_wake` the rule reports plus a latency of up to its poll.
//!
//! # Invariants (16)
//!
//! - 16a. At most once: a tick is dispatched twice only after a firer died
//!   between its send and its completion of that tick (each such death
//!   allows one more dispatch).
//! - 16b. Never early: no dispatch before its tick's time.
//! - 16c. First seen: no tick at or before the first scheduler's start (in
//!   whole seconds) is ever dispatched, whatever the policy.
//! - 16d. Watched ticks fire, and a dead firer's tick is taken over in time:
//!   a tick that came due while a scheduler was up (started at or before
//!   it), and that did not meet a failed send, is dispatched by `max(tick +
//!   poll, the last death of a firer holding it) + lease + poll + 2 s` (the
//!   held retry's least wait and the second's truncation), provided that
//!   scheduler lives until then.
//! - 16e. Missed ticks follow the policy: the ticks a scheduler dispatches
//!   from before its start (less its grace) are, under `Skip`, none; under
//!   `Latest`, only the latest such tick, and none if a tick came due in its
//!   grace; under `Each(n)`, only the last `n`. Conversely a restarted
//!   scheduler that lives long enough dispatches what its policy selects
//!   (`Latest`: the latest missed tick; `Each(n)`: each of the last `n`), so
//!   under `Each(n)` with a scheduler up within every stretch of `n` ticks,
//!   each tick after the first start is dispatched exactly once but for the
//!   deaths of 16a.
//! - 16f. The ticks are the schedule's: each dispatched tick is one of the
//!   expression's, and across the transition an interval expression's
//!   ticks stay evenly spaced in UTC (a skipped local time has none, a
//!   repeated one has both), a fixed-time one's between 22 and 26 hours
//!   apart (one a local day).
//! - 16g. The store's record (`ClaimStore::state`, what the schedules'
//!   listing reads) at the end: a tick reads done exactly when it was
//!   dispatched by a firer that lived to complete it (a tick after the
//!   first start that was never dispatched is not done).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use jobrail::{
    ClaimState, ClaimStore, MemoryClaims, Missed, Schedule, ScheduleFiring, SystemTime, Tick,
    TickDispatch, TickOutcome, VirtualRuntime, UNIX_EPOCH,
};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// What kind of cron expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CronKind {
    /// `* * * * * *`.
    EverySecond,
    /// `0 * * * * *`.
    EveryMinute,
    /// `0 */15 * * * *`.
    Quarterly,
    /// A fixed local time each day (`0 30 2 * * *`, in the hour a
    /// transition skips or repeats, or `0 0 9 * * *`).
    Daily(&'static str),
}

impl CronKind {
    fn expression(self) -> &'static str {
        match self {
            CronKind::EverySecond => "* * * * * *",
            CronKind::EveryMinute => "0 * * * * *",
            CronKind::Quarterly => "0 */15 * * * *",
            CronKind::Daily(e) => e,
        }
    }

    /// The spacing of its ticks in UTC (an interval expression), or `None`
    /// (a fixed time, a day apart in local time).
    fn spacing(self) -> Option<i64> {
        match self {
            CronKind::EverySecond => Some(1),
            CronKind::EveryMinute => Some(60),
            CronKind::Quarterly => Some(900),
            CronKind::Daily(_) => None,
        }
    }

    /// How long a run lasts before its tail.
    fn run(self) -> Duration {
        match self {
            CronKind::EverySecond => Duration::from_secs(8 * 60),
            CronKind::EveryMinute => Duration::from_secs(4 * 3600),
            CronKind::Quarterly => Duration::from_secs(18 * 3600),
            CronKind::Daily(_) => Duration::from_secs(5 * 86_400),
        }
    }
}

/// How a life of a scheduler ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Death {
    /// Between passes, holding nothing.
    Clean,
    /// In the first send of its first pass at or after the crash time,
    /// before the job went out (a pass that sends nothing ends cleanly).
    BeforeSend,
    /// In that send, after the job went out, before the completion.
    AfterSend,
}

/// One life of a scheduler: from `start` to its death (the last life runs
/// to the end of the run).
#[derive(Debug, Clone, Copy)]
pub struct Life {
    /// When it starts, since the run's start.
    pub start: Duration,
    /// When and how it dies, since the run's start.
    pub death: Option<(Duration, Death)>,
}

/// A scheduler: its poll latency and its lives.
#[derive(Debug, Clone)]
pub struct SchedulerPlan {
    /// Each pass comes up to this much after the rule's `next_wake`.
    pub poll: Duration,
    /// Its lives, in order, not overlapping.
    pub lives: Vec<Life>,
}

/// Everything a schedule seed generates.
#[derive(Debug, Clone)]
pub struct ScheduleScenario {
    /// The expression's kind.
    pub cron: CronKind,
    /// The IANA zone.
    pub zone: &'static str,
    /// The run's start, in Unix seconds.
    pub epoch: i64,
    /// The run's length (ticks up to then are held to 16d and 16e).
    pub run: Duration,
    /// The tail after it, with every last life up.
    pub tail: Duration,
    /// The missed policy.
    pub missed: Missed,
    /// The tick lease.
    pub lease: Duration,
    /// The schedulers.
    pub schedulers: Vec<SchedulerPlan>,
    /// The chance that a send fails.
    pub send_failure: f64,
}

/// Daylight-saving transitions of 2026 (UTC, Unix seconds), by zone; UTC
/// has none (a run there starts at one of Paris's).
const TRANSITIONS: [(&str, i64); 8] = [
    // Paris: 2026-03-29T01:00Z forward, 2026-10-25T01:00Z back.
    ("Europe/Paris", 1_774_746_000),
    ("Europe/Paris", 1_792_890_000),
    // New York: 2026-03-08T07:00Z forward, 2026-11-01T06:00Z back.
    ("America/New_York", 1_772_953_200),
    ("America/New_York", 1_793_512_800),
    // Lord Howe (half an hour): 2026-04-04T15:00Z back, 2026-10-03T15:30Z
    // forward.
    ("Australia/Lord_Howe", 1_775_314_800),
    ("Australia/Lord_Howe", 1_790_955_000),
    ("UTC", 1_774_746_000),
    ("UTC", 1_792_890_000),
];

fn ms(r: &mut ChaCha8Rng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(r.gen_range(lo..=hi))
}

/// Generates the schedule scenario of `seed`.
pub fn generate(seed: u64) -> ScheduleScenario {
    let mut r = ChaCha8Rng::seed_from_u64(seed ^ 0x5C4E_D01E);
    let r = &mut r;
    let cron = match r.gen_range(0..5) {
        0 => CronKind::EverySecond,
        1 => CronKind::EveryMinute,
        2 => CronKind::Quarterly,
        3 => CronKind::Daily("0 30 2 * * *"),
        _ => CronKind::Daily("0 0 9 * * *"),
    };
    let (zone, transition) = *TRANSITIONS.choose(r).expect("a transition");
    let run = cron.run();
    // The transition falls within the run.
    let epoch = transition - r.gen_range(0..run.as_secs() as i64);
    let missed = match r.gen_range(0..5) {
        0 => Missed::Skip,
        1 => Missed::Latest,
        2 => Missed::Each(1),
        3 => Missed::Each(3),
        _ => Missed::Each(200),
    };
    let lease = *[
        Duration::from_secs(5),
        jobrail::DEFAULT_TICK_LEASE,
        Duration::from_secs(120),
    ]
    .choose(r)
    .expect("a lease");
    let tail = lease * 3 + Duration::from_secs(20);
    let n = r.gen_range(2..=5);
    let run_ms = run.as_millis() as u64;
    let schedulers = (0..n)
        .map(|_| {
            let poll = *[
                Duration::ZERO,
                Duration::from_millis(500),
                Duration::from_secs(1),
                Duration::from_secs(3),
            ]
            .choose(r)
            .expect("a poll");
            let mut lives = Vec::new();
            let mut at = ms(r, 0, run_ms / 4);
            loop {
                let up = ms(r, run_ms / 30, run_ms / 3);
                let end = at + up;
                if end >= run || lives.len() >= 6 {
                    lives.push(Life {
                        start: at,
                        death: None,
                    });
                    break;
                }
                let death = match r.gen_range(0..10) {
                    0..=3 => Death::Clean,
                    4..=6 => Death::BeforeSend,
                    _ => Death::AfterSend,
                };
                lives.push(Life {
                    start: at,
                    death: Some((end, death)),
                });
                // Down for a while: from a blink to a sixth of the run.
                at = end + ms(r, 0, run_ms / 6);
                if at >= run {
                    // Back for the tail.
                    at = run;
                }
            }
            SchedulerPlan { poll, lives }
        })
        .collect();
    let send_failure = if r.gen_bool(0.3) { 0.03 } else { 0.0 };
    ScheduleScenario {
        cron,
        zone,
        epoch,
        run,
        tail,
        missed,
        lease,
        schedulers,
        send_failure,
    }
}

/// One dispatch of a tick.
#[derive(Debug, Clone, Copy)]
struct Sent {
    tick: i64,
    at_ms: i64,
    life: usize,
}

/// One life as it ran.
#[derive(Debug, Clone, Copy)]
struct Ran {
    scheduler: usize,
    start_ms: i64,
    /// Its death, or the end of the run.
    end_ms: i64,
    /// Whole seconds: its `watching_since` and its grace.
    since: i64,
    grace: i64,
}

/// What a schedule run showed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleStats {
    /// Runs.
    pub runs: u32,
    /// Ticks dispatched.
    pub dispatched: u32,
    /// Passes of the rule.
    pub passes: u32,
    /// Deaths in a send (a tick left claimed).
    pub deaths_in_send: u32,
    /// Ticks fired by a firer that took over an earlier claim.
    pub taken_over: u32,
    /// `Held` answers.
    pub held: u32,
    /// Ticks dispatched twice (after a death between send and completion).
    pub twice: u32,
    /// Missed ticks the policies fired.
    pub missed_fired: u32,
    /// Ticks marked as fired before the schedule was first seen.
    pub skipped_first_seen: u32,
    /// Failed sends.
    pub send_failures: u32,
}

impl std::ops::AddAssign for ScheduleStats {
    fn add_assign(&mut self, o: Self) {
        self.runs += o.runs;
        self.dispatched += o.dispatched;
        self.passes += o.passes;
        self.deaths_in_send += o.deaths_in_send;
        self.taken_over += o.taken_over;
        self.held += o.held;
        self.twice += o.twice;
        self.missed_fired += o.missed_fired;
        self.skipped_first_seen += o.skipped_first_seen;
        self.send_failures += o.send_failures;
    }
}

/// The result of one schedule seed.
#[derive(Debug, Clone)]
pub struct ScheduleReport {
    /// The seed.
    pub seed: u64,
    /// The scenario.
    pub scenario: ScheduleScenario,
    /// What broke (invariant 16), if anything.
    pub violations: Vec<String>,
    /// What the run did.
    pub stats: ScheduleStats,
    /// The run's log (starts, deaths, dispatches, outcomes).
    pub log: Vec<String>,
}

impl ScheduleReport {
    /// Whether every invariant held.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The violations, the scenario and the log's start.
    pub fn details(&self) -> String {
        let mut out = format!("schedule seed {}: {:?}\n", self.seed, self.scenario);
        for v in &self.violations {
            out.push_str(&format!("  {v}\n"));
        }
        for line in self.log.iter().take(400) {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&format!(
            "replay: cargo run -p jobrail-simulation -- --schedule-seed {}\n",
            self.seed
        ));
        out
    }
}

/// A send's error: `certain` when it surely did not go out.
#[derive(Debug)]
struct SendError {
    certain: bool,
}

type SendFuture = Pin<Box<dyn Future<Output = Result<u64, SendError>>>>;

struct Running {
    firing: ScheduleFiring,
    life: usize,
    next_pass: Duration,
}

/// Runs schedule seed `seed` and checks invariant 16.
pub fn run_schedule_seed(seed: u64) -> ScheduleReport {
    let sc = generate(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xF1_2E_D7);
    let schedule = Schedule::raw("sim-schedule", "job0", "q0", sc.cron.expression())
        .time_zone(sc.zone)
        .missed(sc.missed)
        .lease(sc.lease)
        .build()
        .expect("a valid schedule");
    let clock = VirtualRuntime::new();
    let claims = MemoryClaims::with_clock(Arc::new(clock.clone()));
    let wall = |t: Duration| UNIX_EPOCH + Duration::from_secs(sc.epoch as u64) + t;
    let end = sc.run + sc.tail;
    let mut log: Vec<String> = Vec::new();
    let mut stats = ScheduleStats {
        runs: 1,
        ..ScheduleStats::default()
    };
    let mut sent: Vec<Sent> = Vec::new();
    let mut lives: Vec<Ran> = Vec::new();
    // Per tick: deaths in its send (time, after the job went out), failed sends.
    let mut deaths: BTreeMap<i64, Vec<(i64, bool)>> = BTreeMap::new();
    let mut failed: BTreeMap<i64, u32> = BTreeMap::new();
    let mut running: Vec<Option<Running>> = sc.schedulers.iter().map(|_| None).collect();
    let mut next_life: Vec<usize> = vec![0; sc.schedulers.len()];
    let mut current: Vec<Option<usize>> = vec![None; sc.schedulers.len()];
    let ties: Vec<u64> = sc.schedulers.iter().map(|_| rng.gen()).collect();
    let at_ms = |t: Duration| t.as_millis() as i64;
    loop {
        // The next event: a start, a clean death, or a pass.
        let mut best: Option<(Duration, u64, usize, u8)> = None;
        for (k, plan) in sc.schedulers.iter().enumerate() {
            let candidate = match &running[k] {
                Some(run) => {
                    let life = plan.lives[run.life];
                    match life.death {
                        Some((at, Death::Clean)) if at <= run.next_pass => (at, 0),
                        _ => (run.next_pass, 2),
                    }
                }
                None => match plan.lives.get(next_life[k]) {
                    Some(life) => (life.start, 1),
                    None => continue,
                },
            };
            let key = (candidate.0, ties[k], k, candidate.1);
            if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                best = Some(key);
            }
        }
        let Some((at, _, k, what)) = best else { break };
        if at > end {
            break;
        }
        let now = clock.elapsed();
        // A life planned to start while the last one had not died yet (a
        // death in a send waits for a send) starts when it can.
        let at = at.max(now);
        if at > now {
            clock.advance(at - now);
        }
        let plan = &sc.schedulers[k];
        match what {
            0 => {
                let run = running[k].take().expect("running");
                if let Some(i) = current[k].take() {
                    lives[i].end_ms = at_ms(at);
                }
                log.push(format!(
                    "{:>12.3}s s{k} dies between passes (life {})",
                    at.as_secs_f64(),
                    run.life
                ));
            }
            1 => {
                let life = next_life[k];
                next_life[k] += 1;
                let grace = plan.poll.max(jobrail::DEFAULT_GRACE);
                let firing = ScheduleFiring::new(schedule.clone(), wall(at)).grace(grace);
                running[k] = Some(Running {
                    firing,
                    life,
                    next_pass: at,
                });
                current[k] = Some(lives.len());
                lives.push(Ran {
                    scheduler: k,
                    start_ms: at_ms(at),
                    end_ms: at_ms(end),
                    since: sc.epoch + at.as_secs() as i64,
                    grace: grace.as_secs() as i64 + i64::from(grace.subsec_nanos() > 0),
                });
                log.push(format!(
                    "{:>12.3}s s{k} starts (life {life})",
                    at.as_secs_f64()
                ));
            }
            _ => {
                let run = running[k].as_mut().expect("running");
                let life = plan.lives[run.life];
                let armed = match life.death {
                    Some((d, how)) if d <= at && how != Death::Clean => Some(how),
                    _ => None,
                };
                let life_index = current[k].expect("a life");
                let died: RefCell<Option<(i64, bool)>> = RefCell::new(None);
                let pass_sent: RefCell<Vec<Sent>> = RefCell::new(Vec::new());
                let fails: RefCell<Vec<i64>> = RefCell::new(Vec::new());
                let rng_cell = RefCell::new(&mut rng);
                let send = |d: TickDispatch| -> SendFuture {
                    let tick = d.tick.unix_seconds();
                    if let Some(how) = armed {
                        let out = how == Death::AfterSend;
                        if out {
                            pass_sent.borrow_mut().push(Sent {
                                tick,
                                at_ms: at_ms(at),
                                life: life_index,
                            });
                        }
                        *died.borrow_mut() = Some((tick, out));
                        return Box::pin(std::future::pending());
                    }
                    let mut r = rng_cell.borrow_mut();
                    if sc.send_failure > 0.0 && r.gen_bool(sc.send_failure) {
                        fails.borrow_mut().push(tick);
                        let certain = r.gen_bool(0.5);
                        return Box::pin(std::future::ready(Err(SendError { certain })));
                    }
                    pass_sent.borrow_mut().push(Sent {
                        tick,
                        at_ms: at_ms(at),
                        life: life_index,
                    });
                    Box::pin(std::future::ready(Ok(tick as u64)))
                };
                let pass = run
                    .firing
                    .fire_due(&claims, wall(at), send, |e: &SendError| e.certain)
                    .now_or_never();
                stats.passes += 1;
                for s in pass_sent.take() {
                    log.push(format!(
                        "{:>12.3}s s{k} sends {}",
                        at.as_secs_f64(),
                        Tick::from_unix_seconds(s.tick)
                    ));
                    sent.push(s);
                }
                for t in fails.take() {
                    *failed.entry(t).or_default() += 1;
                    stats.send_failures += 1;
                }
                match pass {
                    None => {
                        let (tick, out) = died.take().expect("a death in the send");
                        deaths.entry(tick).or_default().push((at_ms(at), out));
                        stats.deaths_in_send += 1;
                        running[k] = None;
                        if let Some(i) = current[k].take() {
                            lives[i].end_ms = at_ms(at);
                        }
                        log.push(format!(
                            "{:>12.3}s s{k} dies in the send of {} ({})",
                            at.as_secs_f64(),
                            Tick::from_unix_seconds(tick),
                            if out {
                                "after it went out"
                            } else {
                                "before it went out"
                            }
                        ));
                    }
                    Some(report) => {
                        if report.first_seen {
                            log.push(format!(
                                "{:>12.3}s s{k} saw the schedule first",
                                at.as_secs_f64()
                            ));
                        }
                        if let Some(m) = report.missed {
                            log.push(format!(
                                "{:>12.3}s s{k} missed up to {} ({} selected)",
                                at.as_secs_f64(),
                                m.latest,
                                m.selected
                            ));
                        }
                        for t in &report.ticks {
                            match &t.outcome {
                                TickOutcome::Fired {
                                    taken_over: true, ..
                                } => stats.taken_over += 1,
                                TickOutcome::Held { .. } => stats.held += 1,
                                TickOutcome::SkippedBeforeFirstSeen => {
                                    stats.skipped_first_seen += 1
                                }
                                TickOutcome::FiredUnrecorded { error, .. } => log.push(format!(
                                    "{:>12.3}s s{k} {} fired unrecorded: {error}",
                                    at.as_secs_f64(),
                                    t.tick
                                )),
                                TickOutcome::Store(e) => log.push(format!(
                                    "{:>12.3}s s{k} {} store error: {e}",
                                    at.as_secs_f64(),
                                    t.tick
                                )),
                                TickOutcome::GivenUp => log.push(format!(
                                    "{:>12.3}s s{k} {} given up",
                                    at.as_secs_f64(),
                                    t.tick
                                )),
                                _ => {}
                            }
                        }
                        if armed.is_some() {
                            // Armed, but the pass sent nothing: it dies now.
                            running[k] = None;
                            if let Some(i) = current[k].take() {
                                lives[i].end_ms = at_ms(at);
                            }
                            log.push(format!(
                                "{:>12.3}s s{k} dies after a pass that sent nothing",
                                at.as_secs_f64()
                            ));
                        } else {
                            let run = running[k].as_mut().expect("running");
                            let wake = report.next_wake.map(|w| {
                                w.duration_since(wall(Duration::ZERO)).unwrap_or_default()
                            });
                            let latency = if plan.poll.is_zero() {
                                Duration::ZERO
                            } else {
                                ms(&mut rng, 0, plan.poll.as_millis() as u64)
                            };
                            run.next_pass = match wake {
                                Some(w) => w.max(at) + latency,
                                None => end + Duration::from_secs(1),
                            };
                        }
                    }
                }
            }
        }
    }
    // The store's record of each tick (`ClaimStore::state`, what the
    // schedules' listing reads), at the end.
    let first_start = lives.iter().map(|l| l.since).min().unwrap_or(i64::MAX);
    let mut states = BTreeMap::new();
    let all = schedule.ticks_between(Tick::from_unix_seconds(first_start).time(), wall(end));
    for t in all
        .iter()
        .copied()
        .chain(sent.iter().map(|s| Tick::from_unix_seconds(s.tick)))
    {
        let key = schedule.tick_key(&t).expect("a scheduled tick");
        let state = claims
            .state(&key)
            .now_or_never()
            .expect("the memory store answers at once")
            .expect("the memory store reads its keys");
        states.insert(t.unix_seconds(), state);
    }
    let mut violations = check(&sc, &schedule, &sent, &lives, &deaths, &failed, &mut stats);
    // 16g.
    for (&t, state) in &states {
        let dispatches = sent.iter().filter(|s| s.tick == t).count();
        let out_deaths = deaths
            .get(&t)
            .map_or(0, |d| d.iter().filter(|x| x.1).count());
        let recorded = dispatches > out_deaths;
        let done = *state == ClaimState::Done;
        if recorded != done {
            violations.push(format!(
                "(16g) tick {} reads {state:?} in the store after {dispatches} dispatches and {out_deaths} firer deaths between send and completion",
                Tick::from_unix_seconds(t)
            ));
        }
    }
    ScheduleReport {
        seed,
        scenario: sc,
        violations,
        stats,
        log,
    }
}

/// Invariant 16 (see the module's documentation).
fn check(
    sc: &ScheduleScenario,
    schedule: &Schedule,
    sent: &[Sent],
    lives: &[Ran],
    deaths: &BTreeMap<i64, Vec<(i64, bool)>>,
    failed: &BTreeMap<i64, u32>,
    stats: &mut ScheduleStats,
) -> Vec<String> {
    let mut v = Vec::new();
    let tick_ms = |t: i64| (t - sc.epoch) * 1000;
    let label = |t: i64| Tick::from_unix_seconds(t).to_string();
    let poll = sc
        .schedulers
        .iter()
        .map(|s| s.poll)
        .max()
        .unwrap_or_default()
        .as_millis() as i64;
    let lease = sc.lease.as_millis() as i64;
    let first_start = lives.iter().map(|l| l.since).min().unwrap_or(i64::MAX);
    let mut by_tick: BTreeMap<i64, Vec<&Sent>> = BTreeMap::new();
    for s in sent {
        by_tick.entry(s.tick).or_default().push(s);
    }
    stats.dispatched = sent.len() as u32;
    for (&t, ss) in &by_tick {
        // 16a.
        let out_deaths = deaths
            .get(&t)
            .map_or(0, |d| d.iter().filter(|x| x.1).count());
        if ss.len() > 1 {
            stats.twice += 1;
        }
        if ss.len() > 1 + out_deaths {
            v.push(format!(
                "(16a) tick {} dispatched {} times at {:?} ms with {out_deaths} firer deaths between send and completion",
                label(t),
                ss.len(),
                ss.iter().map(|s| s.at_ms).collect::<Vec<_>>()
            ));
        }
        // 16b.
        for s in ss {
            if s.at_ms < tick_ms(t) {
                v.push(format!(
                    "(16b) tick {} dispatched at {} ms, before its time {} ms",
                    label(t),
                    s.at_ms,
                    tick_ms(t)
                ));
            }
        }
        // 16c.
        if t <= first_start {
            v.push(format!(
                "(16c) tick {} dispatched, at or before the first scheduler's start {}",
                label(t),
                label(first_start)
            ));
        }
        // 16f: one of the expression's ticks.
        if schedule
            .next_after(Tick::from_unix_seconds(t - 1).time())
            .map(|x| x.unix_seconds())
            != Some(t)
        {
            v.push(format!(
                "(16f) tick {} dispatched is not one of `{}` in {}",
                label(t),
                schedule.cron(),
                sc.zone
            ));
        }
    }
    // 16e, the first half: what each life dispatched from before its start.
    for (i, life) in lives.iter().enumerate() {
        let cutoff = life.since - life.grace;
        let missed: Vec<i64> = sent
            .iter()
            .filter(|s| s.life == i && s.tick <= cutoff)
            .map(|s| s.tick)
            .collect();
        if missed.is_empty() {
            continue;
        }
        stats.missed_fired += missed.len() as u32;
        let allowed = selected(sc, schedule, life);
        for t in missed {
            if !allowed.contains(&t) {
                v.push(format!(
                    "(16e) s{} (started {}) dispatched the missed tick {} outside its {} selection {:?}",
                    life.scheduler,
                    label(life.since),
                    label(t),
                    sc.missed,
                    allowed.iter().map(|t| label(*t)).collect::<Vec<_>>()
                ));
            }
        }
    }
    // The ticks of the run, after the first start.
    let run_end = sc.epoch + sc.run.as_secs() as i64;
    let ticks: Vec<i64> = schedule
        .ticks_between(
            Tick::from_unix_seconds(first_start).time(),
            Tick::from_unix_seconds(run_end).time(),
        )
        .iter()
        .map(|t| t.unix_seconds())
        .collect();
    // 16f: spacing across the transition.
    for w in ticks.windows(2) {
        let gap = w[1] - w[0];
        let ok = match sc.cron.spacing() {
            Some(s) => gap == s,
            None => (22 * 3600..=26 * 3600).contains(&gap),
        };
        if !ok {
            v.push(format!(
                "(16f) `{}` in {}: ticks {} and {} are {gap} s apart",
                schedule.cron(),
                sc.zone,
                label(w[0]),
                label(w[1])
            ));
        }
    }
    // 16d and the second half of 16e: what must have been dispatched.
    for &t in &ticks {
        if failed.contains_key(&t) {
            continue;
        }
        let last_death = deaths
            .get(&t)
            .and_then(|d| d.iter().map(|x| x.0).max())
            .unwrap_or(i64::MIN);
        let slack = 2_000;
        let dispatched_by = |by: i64| {
            by_tick
                .get(&t)
                .is_some_and(|ss| ss.iter().any(|s| s.at_ms <= by))
        };
        let watch_deadline = (tick_ms(t) + poll).max(last_death) + lease + poll + slack;
        let watcher = lives
            .iter()
            .find(|l| l.start_ms <= tick_ms(t) && l.end_ms >= watch_deadline);
        if let Some(w) = watcher {
            if !dispatched_by(watch_deadline) {
                v.push(format!(
                    "(16d) tick {} came due while s{} was up (started {} ms, up until {} ms) and was not dispatched by {watch_deadline} ms (tick + poll {poll} ms, last firer death at {last_death} ms, lease {lease} ms): {:?}",
                    label(t),
                    w.scheduler,
                    w.start_ms,
                    w.end_ms,
                    by_tick.get(&t).map(|ss| ss.iter().map(|s| s.at_ms).collect::<Vec<_>>())
                ));
            }
            continue;
        }
        // A restarted life whose policy selects it, and that lives until
        // its claim (and a dead holder's lease) is settled.
        let catcher = lives.iter().find(|l| {
            l.start_ms > tick_ms(t)
                && selected(sc, schedule, l).contains(&t)
                && l.end_ms >= l.start_ms.max(last_death + lease) + poll + slack
        });
        if let Some(c) = catcher {
            if !by_tick.contains_key(&t) {
                v.push(format!(
                    "(16e) tick {} was missed, and s{} (started {}, up until {} ms) selects it under {}, but it was never dispatched",
                    label(t),
                    c.scheduler,
                    label(c.since),
                    c.end_ms,
                    sc.missed
                ));
            }
        }
    }
    v
}

/// The missed ticks `life`'s policy selects at its start: those at or
/// before its start less its grace (`Skip`: none; `Latest`: the latest,
/// unless a tick came due within the grace; `Each(n)`: the last `n`).
fn selected(sc: &ScheduleScenario, schedule: &Schedule, life: &Ran) -> Vec<i64> {
    let cutoff = Tick::from_unix_seconds(life.since - life.grace).time();
    let at = |t: SystemTime| Tick::at(t).unix_seconds();
    match sc.missed {
        Missed::Skip => Vec::new(),
        Missed::Latest => {
            let live = schedule
                .ticks_between(cutoff, Tick::from_unix_seconds(life.since).time())
                .len();
            if live > 0 {
                return Vec::new();
            }
            schedule
                .latest_at_or_before(cutoff)
                .map(|t| vec![t.unix_seconds()])
                .unwrap_or_default()
        }
        Missed::Each(n) => schedule
            .last_ticks(cutoff, n as usize)
            .iter()
            .map(|t| at(t.time()))
            .collect(),
    }
}
