//! A fixed set of seeds for every backend, in bounded time (`tests/run` runs
//! it). A failure prints the command that replays the seed and the trace of
//! what happened to the offending message. A longer soak:
//! `cargo run -p jobrail-simulation --release -- --seeds 100000`; of the
//! schedules: `cargo run -p jobrail-simulation --release -- --schedule-seeds 10000`.

use std::time::Instant;

use jobrail_simulation::{
    run_refusing, run_schedule_seed, run_seed, Backend, ClaimStats, DelayStats, ScheduleStats,
};

/// Seeds per backend (a debug build on 2 cores: about a minute in all).
const SEEDS: u64 = 1500;

#[test]
fn fixed_seeds_hold_every_invariant() {
    let started = Instant::now();
    let mut failures = Vec::new();
    for backend in Backend::ALL {
        let t = Instant::now();
        let mut failing = 0;
        let mut claims = ClaimStats::default();
        let mut delays = DelayStats::default();
        for seed in 0..SEEDS {
            let report = run_seed(seed, Some(backend));
            claims += report.claims;
            delays += report.delays;
            if !report.ok() {
                failing += 1;
                if failures.len() < 5 {
                    failures.push(report.details());
                }
            }
        }
        println!(
            "{}: {SEEDS} seeds, {failing} failing, {:.2}s; claims: {} seeds charging, {} charges, {} done, {} held ({} by a dead holder), {} keys taken over, {} held at the cap",
            backend.name(),
            t.elapsed().as_secs_f64(),
            claims.charging,
            claims.effects,
            claims.done,
            claims.held,
            claims.held_by_dead,
            claims.taken_over,
            claims.held_at_cap
        );
        println!(
            "{}: delays: {} delayed messages ({} beyond the longest leg, the longest {} s), {} steps (at most {} of one message), deliverable at most {} ms after due",
            backend.name(),
            delays.delayed,
            delays.beyond_leg,
            delays.longest_secs,
            delays.steps,
            delays.most_steps,
            delays.latest_ms
        );
        // Invariant 15 must have something to hold: delays everywhere, and
        // steps where a leg is shorter than the longest delay drawn.
        let stepping = !matches!(backend, Backend::Memory | Backend::Nats | Backend::Postgres);
        if delays.delayed == 0
            || delays.longest_secs < 7 * 86_400 && backend != Backend::Sqs
            || stepping && (delays.steps == 0 || delays.beyond_leg == 0)
        {
            failures.push(format!(
                "{}: the fixed seeds do not exercise long delays: {delays:?}",
                backend.name()
            ));
        }
        // Invariant 13 must have something to hold: charges, duplicates
        // skipped, keys held, and keys held by dead holders then taken over.
        let ClaimStats {
            charging,
            effects,
            done,
            held,
            held_by_dead,
            taken_over,
            held_at_cap,
        } = claims;
        let evidence = [
            charging,
            effects,
            done,
            held,
            held_by_dead,
            taken_over,
            held_at_cap,
        ];
        if evidence.contains(&0) {
            failures.push(format!(
                "{}: the fixed seeds do not exercise the claims: {claims:?}",
                backend.name()
            ));
        }
    }
    println!("total {:.2}s", started.elapsed().as_secs_f64());
    if !failures.is_empty() {
        for f in &failures {
            println!("{f}");
        }
        panic!(
            "{} or more seeds violated invariants (replay commands above)",
            failures.len()
        );
    }
}

#[test]
fn a_seed_replays_identically() {
    let text = |r: &jobrail_simulation::Report| {
        r.trace
            .iter()
            .map(|e| format!("{} {:?} {:?} {:?}", e.seq, e.at, e.msg, e.ev))
            .collect::<Vec<_>>()
    };
    // Seed 29 at the edge: a panic resumed, an execution cut short, a worker
    // killed. Seeds 44 on RabbitMQ and 70 at the edge charge: duplicates
    // skipped, keys held, a crashed holder's lease waited out.
    for (seed, backend) in [
        (7, Backend::Rabbit),
        (29, Backend::Cloudflare),
        (44, Backend::Rabbit),
        (70, Backend::Cloudflare),
    ] {
        let a = run_seed(seed, Some(backend));
        let b = run_seed(seed, Some(backend));
        assert_eq!(text(&a), text(&b), "seed {seed} on {}", backend.name());
    }
    // The first seed on each stepping backend whose delays take steps.
    for backend in [Backend::Rabbit, Backend::Sqs, Backend::Cloudflare] {
        let (seed, a) = (0..)
            .map(|seed| (seed, run_seed(seed, Some(backend))))
            .find(|(_, r)| r.delays.steps > 0)
            .expect("a seed with steps");
        let b = run_seed(seed, Some(backend));
        assert_eq!(text(&a), text(&b), "seed {seed} on {}", backend.name());
    }
    // A schedule seed whose firers die in sends.
    let (seed, a) = (0..)
        .map(|seed| (seed, run_schedule_seed(seed)))
        .find(|(_, r)| r.stats.deaths_in_send > 0 && r.stats.twice > 0)
        .expect("a schedule seed with deaths");
    assert_eq!(a.log, run_schedule_seed(seed).log, "schedule seed {seed}");
}

/// Seeds per backend for the hot-loop property.
const REFUSING_SEEDS: u64 = 60;

/// With every settlement refused, no backend model runs a message faster
/// than its refused-settlement hold allows (see `run_refusing`): generated
/// scenarios, every backend.
#[test]
fn every_settlement_refused_never_loops() {
    let mut failures = Vec::new();
    for backend in Backend::ALL {
        let t = Instant::now();
        let (mut refused, mut worst) = (0, 0.0f64);
        for seed in 0..REFUSING_SEEDS {
            let report = run_refusing(seed, backend);
            refused += report.refused;
            worst = worst.max(report.worst_per_hour);
            for v in report.violations.iter().take(3) {
                failures.push(format!("{} seed {seed}: {v}", backend.name()));
            }
        }
        println!(
            "{}: {REFUSING_SEEDS} seeds with every settlement refused: {refused} refusals, at most {worst:.0} executions of one message per hour, {:.2}s",
            backend.name(),
            t.elapsed().as_secs_f64()
        );
        assert!(refused > 0, "{}: nothing was refused", backend.name());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Schedule seeds (invariant 16, `jobrail_simulation::schedule`).
const SCHEDULE_SEEDS: u64 = 800;

/// Several schedulers crashing and restarting on one claim store, each
/// running the real firing rule on virtual time: every tick at most once
/// (but for a firer's death between send and completion), never early,
/// nothing before first seen, watched ticks taken over within the lease
/// and the poll, missed ticks by the policy.
#[test]
fn schedules_fire_each_tick_once() {
    let t = Instant::now();
    let mut failures = Vec::new();
    let mut stats = ScheduleStats::default();
    for seed in 0..SCHEDULE_SEEDS {
        let report = run_schedule_seed(seed);
        stats += report.stats;
        if !report.ok() && failures.len() < 3 {
            failures.push(report.details());
        }
    }
    println!(
        "schedules: {SCHEDULE_SEEDS} seeds, {:.2}s: {stats:?}",
        t.elapsed().as_secs_f64()
    );
    let ScheduleStats {
        deaths_in_send,
        taken_over,
        held,
        twice,
        missed_fired,
        skipped_first_seen,
        send_failures,
        ..
    } = stats;
    let evidence = [
        deaths_in_send,
        taken_over,
        held,
        twice,
        missed_fired,
        skipped_first_seen,
        send_failures,
    ];
    assert!(
        !evidence.contains(&0),
        "the schedule seeds do not exercise the rule: {stats:?}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
