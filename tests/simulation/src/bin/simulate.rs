//! Soak and replay front end of the simulation.
//!
//! `simulate --seeds 1000 [--from 0] [--backend rabbit]` runs many seeds and
//! prints one line per failing seed and a summary; `simulate --seed S
//! [--backend B]` replays one seed and prints the offending messages' traces;
//! `--refusing` runs the seed with every settlement refused (the hot-loop
//! property, `run_refusing`); `simulate --schedule-seeds N [--from S]` runs
//! schedule seeds (`run_schedule_seed`), `--schedule-seed S` replays one and
//! prints its log.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use jobrail_simulation::{run_refusing, run_schedule_seed, run_seed, Backend, ClaimStats};

fn usage() -> ExitCode {
    eprintln!(
        "usage: simulate --seeds N [--from S] [--backend B] | --seed S [--backend B] [--trace] [--all] [--refusing] | --schedule-seeds N [--from S] | --schedule-seed S\n backends: memory rabbit sqs nats cloudflare postgres"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seeds: Option<u64> = None;
    let mut from = 0u64;
    let mut seed: Option<u64> = None;
    let mut backend: Option<Backend> = None;
    let mut full = false;
    let mut all = false;
    let mut refusing = false;
    let mut schedule_seed: Option<u64> = None;
    let mut schedule_seeds: Option<u64> = None;
    let mut i = 0;
    while i < args.len() {
        let val = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--seeds" => seeds = val.parse().ok(),
            "--from" => from = val.parse().unwrap_or(0),
            "--seed" => seed = val.parse().ok(),
            "--schedule-seed" => schedule_seed = val.parse().ok(),
            "--schedule-seeds" => schedule_seeds = val.parse().ok(),
            "--backend" => match Backend::parse(&val) {
                Some(b) => backend = Some(b),
                None => return usage(),
            },
            "--all" => {
                all = true;
                i += 1;
                continue;
            }
            "--trace" => {
                full = true;
                i += 1;
                continue;
            }
            "--refusing" => {
                refusing = true;
                i += 1;
                continue;
            }
            _ => return usage(),
        }
        i += 2;
    }
    if let Some(seed) = schedule_seed {
        let report = run_schedule_seed(seed);
        if report.ok() {
            println!("schedule seed {seed}: ok ({:?})", report.stats);
            if full {
                print!("{}", report.details());
            }
            return ExitCode::SUCCESS;
        }
        print!("{}", report.details());
        return ExitCode::FAILURE;
    }
    if let Some(n) = schedule_seeds {
        let started = Instant::now();
        let mut failing = 0;
        let mut stats = jobrail_simulation::ScheduleStats::default();
        for s in from..from + n {
            let report = run_schedule_seed(s);
            stats += report.stats;
            if !report.ok() {
                failing += 1;
                println!(
                    "FAIL schedule seed {s}: {}\n  replay: cargo run -p jobrail-simulation -- --schedule-seed {s}",
                    report.violations[0]
                );
            }
        }
        println!(
            "{n} schedule seeds from {from}: {failing} failing; {:.1}s\n  {stats:?}",
            started.elapsed().as_secs_f64()
        );
        return if failing > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }
    if let (Some(seed), true) = (seed, refusing) {
        let report = run_refusing(seed, backend.unwrap_or(Backend::Memory));
        print!("{}", report.details());
        return if report.violations.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if let Some(seed) = seed {
        let report = run_seed(seed, backend);
        if full {
            for e in &report.trace {
                println!("{e}");
            }
        }
        if report.ok() {
            println!(
                "seed {seed} backend {}: ok ({})",
                report.backend.name(),
                report.summary
            );
            return ExitCode::SUCCESS;
        }
        print!("{}", report.details());
        return ExitCode::FAILURE;
    }
    let Some(n) = seeds else { return usage() };
    let started = Instant::now();
    let mut failing = 0;
    let mut by_invariant: BTreeMap<u8, u64> = BTreeMap::new();
    let mut claims = ClaimStats::default();
    for s in from..from + n {
        let report = run_seed(s, backend);
        claims += report.claims;
        if !report.ok() {
            failing += 1;
            for inv in report.invariants() {
                *by_invariant.entry(inv).or_default() += 1;
            }
            let first = &report.violations[0];
            println!(
                "FAIL seed {s} {} invariants {:?}: {first}\n  replay: {}",
                report.backend.name(),
                report.invariants(),
                report.replay_command()
            );
            if all {
                for v in &report.violations {
                    println!("  V seed {s} {} {v}", report.backend.name());
                }
            }
        }
    }
    println!(
        "{n} seeds from {from}: {failing} failing; by invariant {by_invariant:?}; {:.1}s\n  claims: {claims:?}",
        started.elapsed().as_secs_f64()
    );
    if failing > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
