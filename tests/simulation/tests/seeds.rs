//! A fixed set of seeds for every backend, in bounded time (`tests/run` runs
//! it). A failure prints the command that replays the seed and the trace of
//! what happened to the offending message. A longer soak:
//! `cargo run -p jobrail-simulation --release -- --seeds 100000`.

use std::time::Instant;

use jobrail_simulation::{run_refusing, run_seed, Backend, ClaimStats};

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
        for seed in 0..SEEDS {
            let report = run_seed(seed, Some(backend));
            claims += report.claims;
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
