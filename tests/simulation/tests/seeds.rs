//! A fixed set of seeds for every backend, in bounded time (`tests/run` runs
//! it). A failure prints the command that replays the seed and the trace of
//! what happened to the offending message. A longer soak:
//! `cargo run -p jobrail-simulation --release -- --seeds 100000`.

use std::time::Instant;

use jobrail_simulation::{run_seed, Backend};

/// Seeds per backend (a debug build on 2 cores: about 40 s in all).
const SEEDS: u64 = 1500;

#[test]
fn fixed_seeds_hold_every_invariant() {
    let started = Instant::now();
    let mut failures = Vec::new();
    for backend in Backend::ALL {
        let t = Instant::now();
        let mut failing = 0;
        for seed in 0..SEEDS {
            let report = run_seed(seed, Some(backend));
            if !report.ok() {
                failing += 1;
                if failures.len() < 5 {
                    failures.push(report.details());
                }
            }
        }
        println!(
            "{}: {SEEDS} seeds, {failing} failing, {:.2}s",
            backend.name(),
            t.elapsed().as_secs_f64()
        );
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
    // Seed 29 at the edge: a panic resumed, an execution cut short, a worker killed.
    for (seed, backend) in [(7, Backend::Rabbit), (29, Backend::Cloudflare)] {
        let a = run_seed(seed, Some(backend));
        let b = run_seed(seed, Some(backend));
        assert_eq!(text(&a), text(&b), "seed {seed} on {}", backend.name());
    }
}
