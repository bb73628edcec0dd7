//! The invariants, checked against the trace after a run.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use jobrail::FailureKind;

use crate::model::{Abandon, ClaimAnswer, ClaimOp, Eff, Entry, Ev, Semantics, Settled, World};
use crate::scenario::{panics, Kind, Scenario, Step};
use crate::Backend;

/// How near the end of its invocation's work time a Cloudflare delivery may
/// settle and still be sure the budget changed nothing: tier one skips a
/// wait that would end past the deadline, and no tier-one wait in a scenario
/// exceeds 5 s (the default `tier_one_max_wait`; backoffs stop at 1 s).
const BUDGET_MARGIN: Duration = Duration::from_secs(6);

/// How one message ended, to compare two runs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fate {
    /// The last accepted settlement (`ack`, `reject`, `fail(kind)`,
    /// `retry`), or `dead-lettered`, or `none`.
    pub end: String,
    /// Deliveries.
    pub deliveries: u32,
    /// Handler executions that count (an execution cut short by a crash of
    /// its instance and run again does not).
    pub executions: u32,
    /// Failure records.
    pub records: u32,
}

impl fmt::Display for Fate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} after {} deliveries, {} executions, {} records",
            self.end, self.deliveries, self.executions, self.records
        )
    }
}

fn fate_of(entries: &[&Entry]) -> Fate {
    let mut fate = Fate {
        end: "none".into(),
        deliveries: 0,
        executions: 0,
        records: 0,
    };
    for e in entries {
        match &e.ev {
            Ev::Delivered { .. } => fate.deliveries += 1,
            Ev::Exec { .. } => fate.executions += 1,
            Ev::Interrupted { executions, .. } => fate.executions -= executions,
            Ev::Record { .. } => fate.records += 1,
            Ev::Accepted { settled, .. } => {
                fate.end = match settled {
                    Settled::Ack => "ack".into(),
                    Settled::Reject => "reject".into(),
                    Settled::Fail { kind, .. } => format!("fail({kind:?})"),
                    Settled::Retry { .. } => "retry".into(),
                }
            }
            Ev::Removed(how) if how == "dead-lettered" => fate.end = how.clone(),
            _ => {}
        }
    }
    fate
}

/// How message `n` ended in `world`.
pub fn fate(world: &World, n: u64) -> Fate {
    let st = world.lock();
    let entries: Vec<&Entry> = st.trace.iter().filter(|e| e.msg == Some(n)).collect();
    fate_of(&entries)
}

/// The messages invariant 11 compares with a run of each alone: those that
/// shared a Cloudflare batch with a message whose code panicked, and whose
/// own script never panics. A charging message is left out: its fate hangs
/// on the other messages of its key and on the claims crashes left behind
/// (invariant 13 holds it to the claim's rules instead).
pub fn alone_candidates(sc: &Scenario, world: &World) -> Vec<u64> {
    let st = world.lock();
    let mut mates = BTreeSet::new();
    for e in &st.trace {
        if let Ev::InstancePanic { mates: m, .. } = &e.ev {
            mates.extend(m.iter().copied());
        }
    }
    mates.retain(|n| {
        sc.msgs
            .iter()
            .any(|m| m.n == *n && m.key.is_none() && !m.script.iter().any(panics))
    });
    mates.into_iter().collect()
}

/// One broken invariant.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The invariant's number (1 to 14; 0 = the simulation itself).
    pub invariant: u8,
    /// The message concerned.
    pub msg: Option<u64>,
    /// What happened.
    pub text: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self
            .msg
            .map(|m| format!("m{m}"))
            .unwrap_or_else(|| "-".into());
        write!(f, "invariant {} [{m}]: {}", self.invariant, self.text)
    }
}

/// The result of one seed.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The backend simulated.
    pub backend: Backend,
    /// Violations found.
    pub violations: Vec<Violation>,
    /// The whole trace.
    pub trace: Vec<Entry>,
    /// Messages, deliveries and virtual time simulated.
    pub summary: String,
    /// The scenario, described.
    pub scenario: String,
    /// What the charging job's claims did (all zero without one).
    pub claims: ClaimStats,
    /// What the delayed dispatches did (all zero without one).
    pub delays: DelayStats,
}

/// What the delayed dispatches of one run did: evidence that the scenario
/// exercised invariant 15.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DelayStats {
    /// Messages dispatched with a delay (not zero).
    pub delayed: u32,
    /// Delays longer than the backend's longest leg.
    pub beyond_leg: u32,
    /// Steps (deliveries before the due time carried on).
    pub steps: u32,
    /// The most steps of one message.
    pub most_steps: u32,
    /// The longest delay, in seconds.
    pub longest_secs: u64,
    /// The latest a delayed message became deliverable after its due
    /// time, in milliseconds.
    pub latest_ms: u64,
}

impl std::ops::AddAssign for DelayStats {
    fn add_assign(&mut self, o: Self) {
        self.delayed += o.delayed;
        self.beyond_leg += o.beyond_leg;
        self.steps += o.steps;
        self.most_steps = self.most_steps.max(o.most_steps);
        self.longest_secs = self.longest_secs.max(o.longest_secs);
        self.latest_ms = self.latest_ms.max(o.latest_ms);
    }
}

/// What the charging job's claims did in one run: evidence that the
/// scenario exercised invariant 13.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimStats {
    /// Runs with a charging job (one run: 0 or 1).
    pub charging: u32,
    /// Charges (effects) in the ledger.
    pub effects: u32,
    /// Claims answered `Done` (a duplicate or a redelivery skipped).
    pub done: u32,
    /// Claims answered `Held`.
    pub held: u32,
    /// `Held` answers on a claim whose holder died (its lease ran out).
    pub held_by_dead: u32,
    /// Keys taken over by a new claim after a dead holder's lease ended.
    pub taken_over: u32,
    /// Failure records whose cause is a held claim (a held key at the cap).
    pub held_at_cap: u32,
}

impl std::ops::AddAssign for ClaimStats {
    fn add_assign(&mut self, o: Self) {
        self.charging += o.charging;
        self.effects += o.effects;
        self.done += o.done;
        self.held += o.held;
        self.held_by_dead += o.held_by_dead;
        self.taken_over += o.taken_over;
        self.held_at_cap += o.held_at_cap;
    }
}

impl Report {
    /// Whether every invariant held.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The command that replays this seed.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run -p jobrail-simulation --release -- --seed {} --backend {}",
            self.seed,
            self.backend.name()
        )
    }

    /// The invariants violated, sorted and deduplicated.
    pub fn invariants(&self) -> Vec<u8> {
        let mut v: Vec<u8> = self.violations.iter().map(|v| v.invariant).collect();
        v.sort();
        v.dedup();
        v
    }

    /// The trace of one message, plus the faults, consumer starts and
    /// panics of its batch-mates.
    pub fn trace_of(&self, msg: u64) -> String {
        let mut out = String::new();
        for e in &self.trace {
            let mate = matches!(&e.ev, Ev::InstancePanic { mates, .. } if mates.contains(&msg));
            if e.msg == Some(msg) || mate || (e.msg.is_none() && matches!(e.ev, Ev::Fault(_))) {
                out.push_str(&e.to_string());
                out.push('\n');
            }
        }
        out
    }

    /// The violations with the trace of each offending message.
    pub fn details(&self) -> String {
        let mut out = format!(
            "seed {} backend {}: {}\n{}\n",
            self.seed,
            self.backend.name(),
            self.summary,
            self.scenario
        );
        for v in &self.violations {
            out.push_str(&format!("  {v}\n"));
        }
        let mut shown = Vec::new();
        for v in &self.violations {
            if let Some(m) = v.msg {
                if !shown.contains(&m) && shown.len() < 3 {
                    shown.push(m);
                    out.push_str(&format!("--- trace of m{m} ---\n{}", self.trace_of(m)));
                }
            }
        }
        out.push_str(&format!("replay: {}\n", self.replay_command()));
        out
    }
}

#[derive(Default, Debug)]
struct D {
    id: u64,
    at: Duration,
    attempt: u32,
    execs: u32,
    last_step: String,
    last_eff: Option<Eff>,
    settle: Option<(Settled, bool, Duration, bool)>,
    abandoned: Option<Abandon>,
    record: bool,
    abandoned_after_record: bool,
    /// The failure record's error text.
    reason: Option<String>,
    /// The last execution found its key held by another claim.
    last_held: bool,
}

fn expected(eff: Eff, last_allowed: bool) -> &'static str {
    match eff {
        Eff::Ok => "ack",
        Eff::Permanent => "fail(permanent)",
        Eff::Reject => "reject",
        Eff::Cancelled => "retry(shutdown)",
        _ if last_allowed => "fail(attempts exhausted)",
        _ => "retry",
    }
}

fn matches(want: &str, eff: Eff, s: &Settled) -> bool {
    match (want, s) {
        ("ack", Settled::Ack) => true,
        ("fail(permanent)", Settled::Fail { kind, .. }) => *kind == FailureKind::Permanent,
        ("reject", Settled::Reject) => true,
        ("retry(shutdown)", Settled::Retry { shutdown, .. }) => *shutdown,
        ("fail(attempts exhausted)", Settled::Fail { kind, .. }) => {
            *kind == FailureKind::AttemptsExhausted
        }
        ("retry", Settled::Retry { delay, shutdown }) => {
            !*shutdown
                && match eff {
                    Eff::RetryAfter(d) if !d.is_zero() => delay.is_some_and(|x| x >= d),
                    _ => true,
                }
        }
        _ => false,
    }
}

/// When the run's faults happened that may hand a message back sooner than
/// a refused settlement's hold: crashes, restarts and lost connections (a
/// closed channel returns what it held), instance panics and lost
/// invocations at the edge (their marks are lost with them), by time, one
/// entry per time.
pub(crate) fn handing_back_faults(trace: &[Entry]) -> Vec<Duration> {
    let mut times: Vec<Duration> = trace
        .iter()
        .filter(|e| {
            matches!(
                e.ev,
                Ev::Fault(_)
                    | Ev::InstancePanic { .. }
                    | Ev::Abandoned {
                        reason: Abandon::Crash
                            | Abandon::ConnectionLost
                            | Abandon::InvocationAborted
                            | Abandon::WorkerKilled,
                        ..
                    }
            )
        })
        .map(|e| e.at)
        .collect();
    times.dedup();
    times
}

/// Checks every invariant for a finished run; `alone` holds how the
/// messages of [`alone_candidates`] end when each runs by itself.
pub fn check(
    seed: u64,
    backend: Backend,
    sc: &Scenario,
    world: &World,
    alone: &BTreeMap<u64, Fate>,
) -> Report {
    let st = world.lock();
    let mut v: Vec<Violation> = st
        .violations
        .iter()
        .map(|(m, i, t)| Violation {
            invariant: *i,
            msg: *m,
            text: t.clone(),
        })
        .collect();
    let mut per: BTreeMap<u64, Vec<&Entry>> = BTreeMap::new();
    for e in &st.trace {
        if let Some(m) = e.msg {
            per.entry(m).or_default().push(e);
        }
    }
    let mut push = |invariant: u8, msg: u64, text: String| {
        v.push(Violation {
            invariant,
            msg: Some(msg),
            text,
        })
    };
    let mut end_time = Duration::ZERO;
    for e in &st.trace {
        end_time = end_time.max(e.at);
    }
    let mut delays = DelayStats::default();
    let faults = handing_back_faults(&st.trace);
    let fault_between =
        |from: Duration, to: Duration| faults.iter().any(|t| *t >= from && *t <= to);
    let refused_hold = sc.sem.refused_hold();
    let nqueues = {
        let mut q: Vec<&String> = sc.jobs.iter().map(|j| &j.queue).collect();
        q.sort();
        q.dedup();
        q.len()
    };
    for plan in &sc.msgs {
        let n = plan.n;
        let job = &sc.jobs[plan.job];
        let entries = per.remove(&n).unwrap_or_default();
        let mut ds: Vec<D> = Vec::new();
        let mut idx: BTreeMap<u64, usize> = BTreeMap::new();
        let mut removed: Vec<String> = Vec::new();
        let mut records = 0;
        let mut total_execs = 0u32;
        for e in &entries {
            match &e.ev {
                Ev::Delivered {
                    delivery, attempt, ..
                } => {
                    idx.insert(*delivery, ds.len());
                    ds.push(D {
                        id: *delivery,
                        at: e.at,
                        attempt: *attempt,
                        ..D::default()
                    });
                }
                Ev::Exec { delivery, step, .. } => {
                    total_execs += 1;
                    if let Some(d) = delivery.and_then(|d| idx.get(&d)) {
                        ds[*d].execs += 1;
                        ds[*d].last_step = step.clone();
                        ds[*d].last_eff = None;
                        ds[*d].last_held = step.starts_with("Claim(Held");
                    }
                }
                Ev::Interrupted {
                    delivery,
                    executions,
                } => {
                    // Cut short by a batch-mate's crash: the delivery runs
                    // again from the start; these executions do not count.
                    total_execs -= executions;
                    if let Some(d) = idx.get(delivery) {
                        ds[*d].execs -= executions;
                        ds[*d].last_step.clear();
                        ds[*d].last_eff = None;
                        ds[*d].last_held = false;
                    }
                }
                Ev::ExecResult { delivery, eff } => {
                    if let Some(d) = delivery.and_then(|d| idx.get(&d)) {
                        ds[*d].last_eff = Some(*eff);
                    }
                }
                Ev::Accepted {
                    delivery,
                    settled,
                    shutting_down,
                } => {
                    if let Some(d) = idx.get(delivery) {
                        ds[*d].settle = Some((settled.clone(), true, e.at, *shutting_down));
                    }
                }
                Ev::Refused {
                    delivery,
                    settled,
                    shutting_down,
                    ..
                } => {
                    if let Some(d) = idx.get(delivery) {
                        ds[*d].settle = Some((settled.clone(), false, e.at, *shutting_down));
                    }
                }
                Ev::Abandoned { delivery, reason } => {
                    if let Some(d) = idx.get(delivery) {
                        ds[*d].abandoned = Some(*reason);
                        if ds[*d].record {
                            ds[*d].abandoned_after_record = true;
                        }
                    }
                }
                Ev::Record { delivery, reason } => {
                    records += 1;
                    if let Some(d) = idx.get(delivery) {
                        ds[*d].record = true;
                        ds[*d].reason = Some(reason.clone());
                    }
                }
                Ev::Removed(how) => removed.push(how.clone()),
                _ => {}
            }
        }
        let what = format!("{:?} message of {} (cap {})", plan.kind, job.name, job.cap);
        check_delay(sc, plan, &entries, &mut delays, &mut push);
        // 1. Ends exactly once; records.
        if removed.len() > 1 {
            push(
                1,
                n,
                format!("{what} removed {} times: {removed:?}", removed.len()),
            );
        }
        let dup_ok = ds.iter().filter(|d| d.abandoned_after_record).count();
        if records > 1 + dup_ok {
            push(1, n, format!("{what} has {records} failure records"));
        }
        // 9. Liveness.
        if removed.is_empty() {
            let state = match st.msgs.get(&n).map(|m| m.state) {
                None => "never dispatched".to_string(),
                Some(s) => format!("{s:?}"),
            };
            push(
                9,
                n,
                format!(
                    "{what} not terminal by the horizon (state {state}, {} deliveries; consumer concurrency {} for {} queues)",
                    ds.len(),
                    sc.concurrency,
                    nqueues
                ),
            );
        }
        // 4. Unexplained abandonment.
        for d in &ds {
            if d.abandoned == Some(Abandon::Unknown) {
                push(
                    4,
                    n,
                    format!(
                        "delivery {} (attempt {}) abandoned without settlement and without an injected fault: a delivery task died (last step {})",
                        d.id, d.attempt, d.last_step
                    ),
                );
            }
        }
        let injected_before = |i: usize| {
            ds[..i]
                .iter()
                .any(|d| d.abandoned.is_some_and(|a| a.injected()))
        };
        let returned_after_reject = |i: usize| {
            !world.capabilities().reject_drops
                && ds[..i]
                    .iter()
                    .any(|d| matches!(d.settle, Some((Settled::Reject, true, _, _))))
        };
        let counts_shutdowns = world.capabilities().counts_shutdown_returns;
        // 2. Execution bound.
        if plan.kind == Kind::Valid && job.cap != 0 {
            let s = ds
                .iter()
                .filter(|d| {
                    matches!(
                        d.settle,
                        Some((Settled::Retry { shutdown: true, .. }, true, _, _))
                    )
                })
                .count() as u32;
            let abandoned: u32 = ds
                .iter()
                .filter(|d| d.abandoned.is_some_and(|a| a.injected()))
                .map(|d| d.execs)
                .sum();
            let bound = job.tier_one * (job.cap + s + 1) + abandoned;
            if total_execs > bound {
                push(
                    2,
                    n,
                    format!(
                        "{what}: {total_execs} executions exceed the bound {bound} (N {} x (M {} + s {s} + 1) + {abandoned} abandoned)",
                        job.tier_one, job.cap
                    ),
                );
            }
            // 10. The crash bound: deliveries that ran the handler, crashed
            // ones included, stay within the cap plus the graceful-shutdown
            // returns (plus the one delivery of grace where those cannot be
            // counted), so a message that kills its worker every time ends.
            let ran = ds.iter().filter(|d| d.execs > 0).count() as u32;
            let grace = if counts_shutdowns {
                0
            } else {
                jobrail::SHUTDOWN_GRACE
            };
            if ran > job.cap + s + grace {
                push(
                    10,
                    n,
                    format!(
                        "{what}: {ran} deliveries ran the handler, beyond the crash bound of cap {} + {s} shutdown returns + {grace} grace",
                        job.cap
                    ),
                );
            }
        }
        // Nothing but the message's own script and policy shaped its fate:
        // no injected fault (a panic of a batch-mate is not one), no refused
        // settlement, no shutdown-rule retry, and at the edge no settlement
        // so near the end of the invocation's work time that the budget
        // could have cut tier one short.
        let undisturbed = ds.iter().all(|d| {
            d.abandoned.is_none_or(|a| a == Abandon::InvocationAborted)
                && !matches!(d.settle, Some((_, false, _, _)))
                && !matches!(
                    d.settle,
                    Some((Settled::Retry { shutdown: true, .. }, true, _, _))
                )
                && st
                    .cf_work_end
                    .get(&d.id)
                    .is_none_or(|end| d.settle.as_ref().is_none_or(|s| s.2 + BUDGET_MARGIN < *end))
        });
        // 11. A panic stays with its message: a message that never panics
        // settles as it would alone, whatever its batch-mates do (an attached
        // breaker is shared with them, so those jobs are left out).
        if let Some(want) = alone.get(&n) {
            if undisturbed && (plan.kind != Kind::Valid || job.breaker.is_none()) {
                let got = fate_of(&entries);
                if got != *want {
                    push(
                        11,
                        n,
                        format!(
                            "{what}, in a batch where another message panicked: {got}; run alone: {want}"
                        ),
                    );
                }
            }
        }
        // 12. A message that panics on every execution ends in one failure
        // record, on the delivery at its cap. Natively tier one retries a
        // panic within the delivery; at the edge the crash ends the
        // delivery's execution: one execution per delivery.
        let edge = backend == Backend::Cloudflare;
        let per_delivery = if edge { 1 } else { job.tier_one };
        // A charging message's execution that found its key done or held
        // ran no step, and did not panic: the premise fails.
        let skipped = entries
            .iter()
            .any(|e| matches!(&e.ev, Ev::Exec { step, .. } if step.starts_with("Claim(")));
        let always_panics = plan.kind == Kind::Valid
            && job.cap != 0
            && plan.script.len() as u32 >= job.cap * per_delivery
            && plan
                .script
                .iter()
                .all(|s| matches!(s, Step::PanicBefore | Step::PanicInside))
            && !skipped;
        if always_panics && undisturbed {
            let got = fate_of(&entries);
            let at_cap = ds.last().is_some_and(|d| {
                d.attempt == job.cap
                    && matches!(
                        d.settle,
                        Some((
                            Settled::Fail {
                                kind: FailureKind::AttemptsExhausted,
                                ..
                            },
                            true,
                            _,
                            _
                        ))
                    )
            });
            let executions_ok = !edge || (got.executions == job.cap && got.deliveries == job.cap);
            if got.records != 1 || !at_cap || !executions_ok {
                push(
                    12,
                    n,
                    format!(
                        "{what} panics on every execution ({} per delivery): {got}, last delivery attempt {}; want one record at attempt {}{}",
                        if edge { "one" } else { "tier one's" },
                        ds.last().map_or(0, |d| d.attempt),
                        job.cap,
                        if edge { format!(" after {} executions", job.cap) } else { String::new() }
                    ),
                );
            }
        }
        for (i, d) in ds.iter().enumerate() {
            let Some((settled, accepted, at, shutting)) = &d.settle else {
                continue;
            };
            // 3. Zero-execution failures.
            if let Settled::Fail { kind, executions } = settled {
                if *accepted && d.execs == 0 {
                    let rule = match plan.kind {
                        Kind::Malformed => *kind == FailureKind::MalformedEnvelope,
                        Kind::UnknownName => *kind == FailureKind::UnknownName,
                        Kind::Undecodable => *kind == FailureKind::UndecodablePayload,
                        Kind::Invalid => *kind == FailureKind::InvalidPayload,
                        // The crash bound: earlier deliveries ended without a
                        // settlement (an injected fault), or came back after a
                        // rejection the backend does not drop (SQS): both count.
                        Kind::Valid => {
                            *kind == FailureKind::AttemptsExhausted
                                && (injected_before(i) || returned_after_reject(i))
                        }
                    };
                    if !rule {
                        push(
                            3,
                            n,
                            format!(
                                "{what} failed ({kind:?}) on delivery {} (attempt {}) with zero executions (record says {executions}), no rule or injected fault explains it",
                                d.id, d.attempt
                            ),
                        );
                    }
                }
            }
            // 6. Retry delays.
            if let (
                Settled::Retry {
                    delay: Some(want), ..
                },
                true,
            ) = (settled, accepted)
            {
                if let Some(next) = ds.get(i + 1) {
                    // A next delivery before the settlement (a late
                    // settlement by a holder cut off) is as early as can be.
                    let gap = next.at.saturating_sub(*at);
                    if gap < *want {
                        push(
                            6,
                            n,
                            format!(
                                "retry of delivery {} requested {want:?} but delivery {} came {:?} later",
                                d.id,
                                next.id,
                                gap
                            ),
                        );
                    }
                }
            }
            // 14. A refused settlement is held as a lease would hold it:
            // the message's next delivery comes no sooner than the
            // backend's refused-settlement hold, unless a fault came
            // between (which may return it at once, as a crash does).
            // A delivery already lost to a fault (its connection, its
            // invocation) was handed back by that fault, not by the refusal.
            let lost = !matches!(
                d.abandoned,
                None | Some(Abandon::Refused | Abandon::Unsupported)
            );
            if !*accepted && !lost {
                // (A next delivery that began before the refusal was not
                // brought by it either.)
                if let Some((next, gap)) = ds
                    .get(i + 1)
                    .and_then(|next| Some((next, next.at.checked_sub(*at)?)))
                {
                    if gap < refused_hold && !fault_between(*at, next.at) {
                        push(
                            14,
                            n,
                            format!(
                                "settlement {settled:?} of delivery {} was refused and delivery {} came {gap:?} later, sooner than the hold of {refused_hold:?}",
                                d.id, next.id
                            ),
                        );
                    }
                }
            }
            // 7. Shutdown retries keep the last execution (where the backend
            // cannot count them, within the one delivery of grace).
            if let (Settled::Retry { shutdown: true, .. }, true) = (settled, accepted) {
                if let Some(next) = ds.get(i + 1) {
                    let within_grace = counts_shutdowns
                        || job.cap == 0
                        || next.attempt <= job.cap + jobrail::SHUTDOWN_GRACE;
                    if plan.kind == Kind::Valid
                        && within_grace
                        && next.execs == 0
                        && next.abandoned.is_none()
                        && next.settle.as_ref().is_none_or(|s| s.1)
                    {
                        push(
                            7,
                            n,
                            format!(
                                "after the graceful-shutdown retry of delivery {} (attempt {}), delivery {} (attempt {}) ran no execution and settled {:?}",
                                d.id,
                                d.attempt,
                                next.id,
                                next.attempt,
                                next.settle.as_ref().map(|s| &s.0)
                            ),
                        );
                    }
                }
            }
            // 8. The outcome table.
            if plan.kind == Kind::Valid && d.execs > 0 {
                let Some(eff) = d.last_eff else { continue };
                if d.last_step.starts_with("Hang") && eff == Eff::Ordinary && *shutting {
                    // A hang interrupted by shutdown may settle as the shutdown rule.
                }
                let last_allowed = job.cap != 0 && d.attempt >= job.cap;
                let want = expected(eff, last_allowed);
                let shutdown_ok = *shutting
                    && !matches!(eff, Eff::Ok | Eff::Permanent | Eff::Reject)
                    && matches!(settled, Settled::Retry { shutdown: true, .. });
                if !shutdown_ok && !matches(want, eff, settled) {
                    push(
                        8,
                        n,
                        format!(
                            "delivery {} (attempt {} of cap {}): last execution {} gave {eff:?}, settled as {settled:?}, expected {want}",
                            d.id, d.attempt, job.cap, d.last_step
                        ),
                    );
                }
            }
            // 13c. A delivery whose last execution found its key held fails
            // at the cap with the held claim as its cause (the retries
            // before it are held to the remaining lease under 8).
            if let (true, Settled::Fail { kind, .. }, true) = (d.last_held, settled, accepted) {
                let cause = d.reason.as_deref().unwrap_or_default();
                if *kind != FailureKind::AttemptsExhausted
                    || !cause.contains("is held by another worker")
                {
                    push(
                        13,
                        n,
                        format!(
                            "(13c) delivery {} (attempt {}) found its key held and failed as {kind:?} with the cause {cause:?}, not the held claim",
                            d.id, d.attempt
                        ),
                    );
                }
            }
        }
    }
    let claims = check_claims(sc, &st.trace, &st.ledger, &mut v);
    if st.deliveries > 20_000 {
        v.push(Violation {
            invariant: 9,
            msg: None,
            text: format!("runaway: {} deliveries", st.deliveries),
        });
    }
    let summary = format!(
        "{} messages, {} deliveries, {:.0}s virtual",
        sc.msgs.len(),
        st.deliveries,
        end_time.as_secs_f64()
    );
    let scenario = format!(
        "  jobs: {}\n  concurrency {}, queues {:?}, faults {:?}\n  charging {:?}",
        sc.jobs
            .iter()
            .map(|j| format!(
                "{}@{} cap {} t1 {} backoff {} timeout {:?} breaker {:?}",
                j.name, j.queue, j.cap, j.tier_one, j.backoff, j.timeout, j.breaker
            ))
            .collect::<Vec<_>>()
            .join("; "),
        sc.concurrency,
        {
            let mut q: Vec<&String> = sc.jobs.iter().map(|j| &j.queue).collect();
            q.sort();
            q.dedup();
            q
        },
        sc.faults,
        sc.charging
    );
    Report {
        seed,
        backend,
        violations: v,
        trace: st.trace.clone(),
        summary,
        scenario,
        claims,
        delays,
    }
}

/// Invariant 15, long delays, for one message: it never reaches a consumer
/// (delivered, executed, reported) before its due time; it becomes
/// deliverable within the backend's precision after it
/// ([`Semantics::delay_precision`]); a step comes only before the due time,
/// and the first delivery after the steps counts attempt 1 (a step counts
/// none and runs nothing); the dispatch and its steps stay within
/// [`Semantics::delay_messages_bound`]. A message without a delay never
/// steps. (That it is not lost, that it ends by the horizon, which runs
/// from the last due time, is invariant 9.)
fn check_delay(
    sc: &Scenario,
    plan: &crate::scenario::MsgPlan,
    entries: &[&Entry],
    stats: &mut DelayStats,
    push: &mut impl FnMut(u8, u64, String),
) {
    let n = plan.n;
    let delay = plan.delay.filter(|d| !d.is_zero());
    let steps: Vec<&Entry> = entries
        .iter()
        .copied()
        .filter(|e| matches!(e.ev, Ev::Step { .. }))
        .collect();
    let Some(delay) = delay else {
        if let Some(e) = steps.first() {
            push(
                15,
                n,
                format!(
                    "a message dispatched without a delay stepped at {:?}: {:?}",
                    e.at, e.ev
                ),
            );
        }
        return;
    };
    let due = plan.due();
    stats.delayed += 1;
    stats.steps += steps.len() as u32;
    stats.most_steps = stats.most_steps.max(steps.len() as u32);
    stats.longest_secs = stats.longest_secs.max(delay.as_secs());
    if sc.sem.longest_leg().is_some_and(|leg| delay > leg) {
        stats.beyond_leg += 1;
    }
    let sends: Vec<Duration> = entries
        .iter()
        .filter_map(|e| match e.ev {
            Ev::Delayed { available, .. } | Ev::Step { available, .. } => Some(available),
            _ => None,
        })
        .collect();
    if sends.is_empty() {
        // Never dispatched (the run ended first): invariant 9 says so.
        return;
    }
    // Never before the due time.
    if let Some(early) = entries.iter().find(|e| {
        e.at < due
            && matches!(
                e.ev,
                Ev::Delivered { .. } | Ev::Exec { .. } | Ev::Emitted { .. }
            )
    }) {
        push(
            15,
            n,
            format!("dispatched at {:?} with a delay of {delay:?}, due at {due:?}: {:?} at {:?}, before its due time", plan.at, early.ev, early.at),
        );
    }
    // Steps only before the due time.
    if let Some(late) = steps.iter().find(|e| e.at >= due) {
        push(
            15,
            n,
            format!(
                "stepped at {:?}, at or after its due time {due:?}: {:?}",
                late.at, late.ev
            ),
        );
    }
    // Deliverable within the backend's precision after the due time.
    let available = sends.iter().copied().max().unwrap_or_default();
    // A body that is not an envelope carries no due time: held whole, as
    // the backend rounds a plain delay (RabbitMQ up to a bucket).
    let raw = plan.kind == Kind::Malformed;
    let precision = if raw {
        let held = sc.sem.dispatch_hold(b"raw", delay);
        held.saturating_sub(delay) + Duration::from_millis(1)
    } else {
        sc.sem.delay_precision()
    };
    if !raw {
        stats.latest_ms = stats
            .latest_ms
            .max(available.saturating_sub(due).as_millis() as u64);
    }
    if available > due + precision {
        push(
            15,
            n,
            format!("due at {due:?} (a delay of {delay:?}) and deliverable only from {available:?}: later than the backend's precision of {precision:?}"),
        );
    }
    // A step counts no attempt.
    let first = entries.iter().find_map(|e| match e.ev {
        Ev::Delivered { attempt, .. } => Some(attempt),
        _ => None,
    });
    if first.is_some_and(|a| a != 1) {
        push(
            15,
            n,
            format!(
                "after {} steps its first delivery counted attempt {}, not 1",
                steps.len(),
                first.unwrap_or_default()
            ),
        );
    }
    // The messages a delay costs.
    let spent = sends.len() as u64;
    let bound = if raw {
        1
    } else {
        sc.sem.delay_messages_bound(delay)
    };
    if spent > bound {
        push(
            15,
            n,
            format!("a delay of {delay:?} cost {spent} messages (the dispatch and {} steps), more than the bound of {bound} (longest leg {:?})", steps.len(), sc.sem.longest_leg()),
        );
    }
}

/// A live claim in the model of the claim rules.
#[derive(Debug, Clone, Copy)]
struct Hold {
    fence: u64,
    until: Duration,
    msg: u64,
    /// `Held` answers it gave.
    held: u32,
}

/// A business key in the model of the claim rules.
#[derive(Debug, Default)]
struct Key {
    /// The latest fence given out.
    fence: u64,
    /// The latest claim, unless released or completed (it may have ended).
    hold: Option<Hold>,
    /// Completed: by which message, when.
    done: Option<(u64, Duration)>,
    /// Charges: message, fence, when.
    effects: Vec<(u64, u64, Duration)>,
}

/// Invariant 13, on the charging job: the claim operations of the trace
/// replayed against a model of the claim rules (fences grow by one; a key is
/// claimed only when not done and no lease is live; `Held` tells the live
/// lease's remaining time exactly; `Done` only after a completion; a
/// completion or release only by the live latest claim), the ledger of
/// charges, and every acknowledgement of a charging message.
fn check_claims(
    sc: &Scenario,
    trace: &[Entry],
    ledger: &BTreeMap<String, Vec<(u64, u64)>>,
    v: &mut Vec<Violation>,
) -> ClaimStats {
    let mut stats = ClaimStats::default();
    if sc.charging.is_none() {
        return stats;
    }
    stats.charging = 1;
    let mut push = |sub: &str, msg: Option<u64>, text: String| {
        v.push(Violation {
            invariant: 13,
            msg,
            text: format!("({sub}) {text}"),
        })
    };
    let key_of: BTreeMap<u64, &String> = sc
        .msgs
        .iter()
        .filter_map(|m| m.key.as_ref().map(|k| (m.n, k)))
        .collect();
    let mut keys: BTreeMap<&str, Key> = BTreeMap::new();
    // A holder that did not die gives its claim back the instant its
    // execution ends: completes it after a success, releases it after an
    // error or a panic (at the edge a panic aborts the instance: nothing
    // runs after it). By delivery: the claim its execution holds, and what
    // it owes once the execution ended.
    let edge = sc.sem == Semantics::Cloudflare;
    let mut holding: BTreeMap<u64, (String, u64)> = BTreeMap::new();
    let mut owed: BTreeMap<u64, (String, ClaimOp, Eff)> = BTreeMap::new();
    for e in trace {
        let (at, n) = (e.at, e.msg.unwrap_or_default());
        match &e.ev {
            Ev::Claim {
                delivery: Some(d),
                key,
                op,
                answer,
            } => {
                if let Some((k, want, eff)) = owed.remove(d) {
                    if (k.as_str(), want) != (key.as_str(), *op) {
                        push("13c", Some(n), format!("delivery {d}'s execution ended with {eff:?} and owed {want:?} of `{k}`; {op:?} of `{key}` came first"));
                    }
                }
                if let (ClaimOp::Claim(_), ClaimAnswer::Claimed(fence)) = (op, answer) {
                    holding.insert(*d, (key.clone(), *fence));
                }
            }
            Ev::ExecResult {
                delivery: Some(d),
                eff,
            } => {
                if let Some((key, fence)) = holding.remove(d) {
                    let want = match eff {
                        Eff::Ok => Some(ClaimOp::Complete(fence)),
                        Eff::Panic if edge => None,
                        _ => Some(ClaimOp::Release(fence)),
                    };
                    if let Some(want) = want {
                        owed.insert(*d, (key, want, *eff));
                    }
                }
            }
            Ev::Interrupted { delivery: d, .. } | Ev::Abandoned { delivery: d, .. } => {
                // Cut short (its instance crashed) or lost track of.
                holding.remove(d);
                owed.remove(d);
            }
            Ev::Exec {
                delivery: Some(d), ..
            }
            | Ev::Accepted { delivery: d, .. }
            | Ev::Refused { delivery: d, .. }
            | Ev::Record { delivery: d, .. } => {
                if let Some((key, want, eff)) = owed.remove(d) {
                    push("13c", Some(n), format!("delivery {d}'s execution ended with {eff:?} at {at:?} and never gave its claim of `{key}` back ({want:?} owed)"));
                }
            }
            _ => {}
        }
        match &e.ev {
            Ev::Claim {
                key, op, answer, ..
            } => {
                let k = keys.entry(key.as_str()).or_default();
                let live = k.hold.filter(|h| h.until > at);
                match (op, answer) {
                    (ClaimOp::Claim(lease), ClaimAnswer::Claimed(fence)) => {
                        if let Some((by, when)) = k.done {
                            push("13a", Some(n), format!("`{key}` claimed (fence {fence}) at {at:?}, after m{by} completed it at {when:?}"));
                        }
                        if let Some(h) = live {
                            push("13c", Some(n), format!("`{key}` claimed again (fence {fence}) at {at:?} while m{}'s claim (fence {}) runs until {:?}", h.msg, h.fence, h.until));
                        }
                        if *fence != k.fence + 1 {
                            push(
                                "13c",
                                Some(n),
                                format!(
                                    "`{key}` claimed with fence {fence} after fence {}",
                                    k.fence
                                ),
                            );
                        }
                        if let Some(dead) = k.hold.filter(|h| h.until <= at) {
                            // Its holder neither completed nor released it.
                            stats.taken_over += 1;
                            stats.held_by_dead += dead.held;
                        }
                        k.fence = *fence;
                        k.hold = Some(Hold {
                            fence: *fence,
                            until: at + *lease,
                            msg: n,
                            held: 0,
                        });
                    }
                    (ClaimOp::Claim(_), ClaimAnswer::Done) => {
                        stats.done += 1;
                        if k.done.is_none() {
                            push("13b", Some(n), format!("`{key}` answered done at {at:?} though no claim of it was completed"));
                        }
                    }
                    (ClaimOp::Claim(_), ClaimAnswer::Held(remaining)) => {
                        stats.held += 1;
                        match (live, k.done) {
                            (Some(h), None) if h.until - at == *remaining => {
                                if let Some(h) = k.hold.as_mut() {
                                    h.held += 1;
                                }
                            }
                            _ => push("13c", Some(n), format!("`{key}` answered held for {remaining:?} at {at:?}; the live claim: {live:?}, done: {:?}", k.done)),
                        }
                    }
                    (ClaimOp::Complete(fence), answer) => {
                        let accepted = live.is_some_and(|h| h.fence == *fence) && k.done.is_none();
                        let charged = k.effects.last().is_some_and(|c| c.1 == *fence && c.0 == n);
                        match answer {
                            ClaimAnswer::Ok if accepted && charged => {
                                k.done = Some((n, at));
                                k.hold = None;
                            }
                            ClaimAnswer::Ok => push("13a", Some(n), format!("`{key}` completed by fence {fence} at {at:?}: live claim {live:?}, done {:?}, charged under it: {charged}", k.done)),
                            _ => push("13a", Some(n), format!("the completion of `{key}` by fence {fence} at {at:?} answered {answer:?} after its charge (live claim {live:?}): the charge may happen again")),
                        }
                    }
                    (ClaimOp::Release(fence), answer) => {
                        let accepted = live.is_some_and(|h| h.fence == *fence) && k.done.is_none();
                        match (answer, accepted) {
                            (ClaimAnswer::Ok, true) => k.hold = None,
                            (ClaimAnswer::Lost, false) => {}
                            _ => push("13c", Some(n), format!("the release of `{key}` by fence {fence} at {at:?} answered {answer:?}; the live claim: {live:?}")),
                        }
                    }
                    (op, answer) => push(
                        "13",
                        Some(n),
                        format!("{op:?} of `{key}` at {at:?} answered {answer:?}"),
                    ),
                }
            }
            Ev::Effect { key, fence, .. } => {
                let k = keys.entry(key.as_str()).or_default();
                let live = k.hold.filter(|h| h.until > at);
                if !live.is_some_and(|h| h.fence == *fence && h.msg == n) {
                    push("13a", Some(n), format!("`{key}` charged at {at:?} under fence {fence}, not the live claim {live:?}"));
                }
                if let Some(first) = k.effects.first() {
                    push("13a", Some(n), format!("`{key}` charged again at {at:?} (fence {fence}); m{} charged it at {:?} (fence {})", first.0, first.2, first.1));
                }
                k.effects.push((n, *fence, at));
            }
            Ev::Record { reason, .. } if reason.contains("is held by another worker") => {
                stats.held_at_cap += 1;
            }
            Ev::Accepted {
                settled: Settled::Ack,
                ..
            } => {
                if let Some(key) = key_of.get(&n) {
                    let charges = keys.get(key.as_str()).map_or(0, |k| k.effects.len());
                    if charges != 1 {
                        push("13b", Some(n), format!("m{n} acknowledged as a success at {at:?} with {charges} charges of `{key}`"));
                    }
                }
            }
            _ => {}
        }
    }
    for (d, (key, want, eff)) in owed {
        push("13c", None, format!("delivery {d}'s execution ended with {eff:?} and never gave its claim of `{key}` back ({want:?} owed)"));
    }
    for (key, k) in &keys {
        stats.effects += k.effects.len() as u32;
        let booked = ledger.get(*key).map_or(0, Vec::len);
        if booked > 1 || booked != k.effects.len() {
            push(
                "13a",
                None,
                format!(
                    "`{key}` has {booked} charges in the ledger ({} in the trace)",
                    k.effects.len()
                ),
            );
        }
        if !k.effects.is_empty() && k.done.is_none() {
            push(
                "13b",
                None,
                format!("`{key}` was charged but never completed"),
            );
        }
    }
    stats
}
