//! The test runner behind [`conformance_suite!`](crate::conformance_suite):
//! it asks the backend what it supports, registers the scenarios that apply
//! ([`crate::scenarios::registered`]) and runs them with libtest's command
//! line and report.
//!
//! The scenarios are chosen at run time because what a backend supports is
//! known only from its driver (a NATS server reports its size limit once
//! connected). A scenario a backend cannot run is not registered for it:
//! it is listed once, with the reason, under "not registered", and counts
//! neither as passed nor as ignored.
//!
//! The command line is a subset of libtest's: name filters, `--exact`,
//! `--skip NAME`, `--list`, `--test-threads N` (or `RUST_TEST_THREADS`),
//! `--ignored` (nothing is ignored, so nothing runs) and the output options
//! cargo passes (`--nocapture`, `--quiet`, `--color`...), which change
//! nothing: the scenarios' own output is never captured.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::harness::Backend;
use crate::scenarios::{self, Scenario};

/// A future a test runs to completion.
pub type TestFuture = Pin<Box<dyn Future<Output = ()>>>;

/// A test of one backend beyond the suite, run like a scenario but without
/// a backend (it builds what it needs).
pub type Extra = (&'static str, fn() -> TestFuture);

/// What one test runs.
enum Body {
    Scenario(Scenario),
    Extra(fn() -> TestFuture),
}

/// The command line.
struct Args {
    filters: Vec<String>,
    skip: Vec<String>,
    exact: bool,
    list: bool,
    ignored: bool,
    threads: usize,
}

impl Args {
    fn parse() -> Args {
        let mut args = Args {
            filters: Vec::new(),
            skip: Vec::new(),
            exact: false,
            list: false,
            ignored: false,
            threads: std::env::var("RUST_TEST_THREADS")
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
                }),
        };
        let mut words = std::env::args().skip(1);
        while let Some(word) = words.next() {
            let (flag, inline) = match word.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => {
                    (flag.to_string(), Some(value.to_string()))
                }
                _ => (word.clone(), None),
            };
            let mut value = |name: &str| {
                inline
                    .clone()
                    .or_else(|| words.next())
                    .unwrap_or_else(|| usage(&format!("{name} needs a value")))
            };
            match flag.as_str() {
                "--exact" => args.exact = true,
                "--list" => args.list = true,
                "--ignored" => args.ignored = true,
                "--include-ignored" | "--nocapture" | "--show-output" | "-q" | "--quiet" => {}
                "--skip" => args.skip.push(value("--skip")),
                "--test-threads" => {
                    args.threads = value("--test-threads")
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .unwrap_or_else(|| usage("--test-threads takes a positive number"));
                }
                "--color" | "--format" | "-Z" | "--logfile" => {
                    let given = value(&flag);
                    if flag == "--format" && given != "pretty" && given != "terse" {
                        usage("only the pretty and terse formats are supported");
                    }
                }
                _ if flag.starts_with('-') => usage(&format!("unsupported option `{flag}`")),
                _ => args.filters.push(word),
            }
        }
        args
    }

    fn selects(&self, name: &str) -> bool {
        let matches = |pattern: &String| {
            if self.exact {
                name == pattern
            } else {
                name.contains(pattern.as_str())
            }
        };
        (self.filters.is_empty() || self.filters.iter().any(matches))
            && !self.skip.iter().any(matches)
    }
}

fn usage(problem: &str) -> ! {
    eprintln!("error: {problem}");
    eprintln!("usage: [FILTER...] [--exact] [--skip NAME] [--list] [--test-threads N] [--ignored]");
    std::process::exit(101);
}

/// Runs the suite on the backend `make` builds (a fresh one per test), plus
/// `extra` tests, and exits: 0 when every test passed, 101 otherwise.
pub fn run<B, F, Fut>(make: F, extra: Vec<Extra>) -> !
where
    B: Backend + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = B> + 'static,
{
    let args = Args::parse();
    let (driver, choice) = runtime().block_on(async {
        let backend = make().await;
        let driver = backend.connect().await;
        let name = driver.name();
        let choice = scenarios::registered(&driver.capabilities(), &backend.hooks());
        drop(backend);
        (name, choice)
    });
    let mut tests: Vec<(&'static str, Body)> = choice
        .registered
        .into_iter()
        .map(|(name, scenario)| (name, Body::Scenario(scenario)))
        .chain(
            extra
                .into_iter()
                .map(|(name, test)| (name, Body::Extra(test))),
        )
        .collect();
    let total = tests.len();
    tests.retain(|(name, _)| args.selects(name) && !args.ignored);
    let filtered_out = total - tests.len();

    if args.list {
        for (name, _) in &tests {
            println!("{name}: test");
        }
        println!("\n{} tests, 0 benchmarks", tests.len());
        std::process::exit(0);
    }

    println!();
    for (name, reason) in &choice.not_registered {
        println!("not registered for the {driver} driver: {name} ({reason})");
    }
    println!("running {} tests", tests.len());
    let started = Instant::now();
    let make = Arc::new(make);
    let queue = Arc::new(Mutex::new(tests.into_iter()));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let passed = Arc::new(Mutex::new(0usize));
    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let (queue, failed, passed, make) =
                (queue.clone(), failed.clone(), passed.clone(), make.clone());
            std::thread::spawn(move || loop {
                let Some((name, body)) = queue.lock().unwrap().next() else {
                    return;
                };
                let make = make.clone();
                // A thread of its own, named after the test: a panic says
                // which test failed, and fails that test only.
                let outcome = std::thread::Builder::new()
                    .name(name.to_string())
                    .spawn(move || {
                        runtime().block_on(async move {
                            match body {
                                Body::Scenario(scenario) => {
                                    let backend = make().await;
                                    scenario(&backend).await;
                                }
                                Body::Extra(test) => test().await,
                            }
                        })
                    })
                    .expect("spawn a test thread")
                    .join();
                if outcome.is_ok() {
                    println!("test {name} ... ok");
                    *passed.lock().unwrap() += 1;
                } else {
                    println!("test {name} ... FAILED");
                    failed.lock().unwrap().push(name);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("a test worker");
    }
    let failed = failed.lock().unwrap().clone();
    let passed = *passed.lock().unwrap();
    if !failed.is_empty() {
        println!("\nfailures:");
        for name in &failed {
            println!("    {name}");
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; 0 ignored; 0 measured; {filtered_out} filtered out; finished in {:.2}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    std::process::exit(if failed.is_empty() { 0 } else { 101 });
}

/// The runtime of one test: the multi-threaded flavour with two workers,
/// as `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` builds
/// (a fixture's cleanup blocks in place, which needs it).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}
