//! The test runner behind [`conformance_suite!`](crate::conformance_suite):
//! it asks the backend what it supports, registers the scenarios that apply
//! ([`crate::scenarios::registered`]) and hands them to `libtest-mimic`, which
//! gives the test binary libtest's command line (name filter, `--exact`,
//! `--skip`, `--list`, `--test-threads`...) and report.
//!
//! The scenarios are chosen at run time because what a backend supports is
//! known only from its driver (a NATS server reports its size limit once
//! connected). A scenario a backend cannot run is not registered for it: it
//! is not a test of this binary (not listed, neither passed nor ignored, and
//! `--ignored` cannot force it), and the report names it once, with the
//! reason, under "not registered".

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use libtest_mimic::{Arguments, FormatSetting, Trial};

use crate::harness::Backend;
use crate::scenarios;

/// A future a test runs to completion.
pub type TestFuture = Pin<Box<dyn Future<Output = ()>>>;

/// A test of one backend beyond the suite, run like a scenario but without
/// a backend (it builds what it needs).
pub type Extra = (&'static str, fn() -> TestFuture);

/// Runs the suite on the backend `make` builds (a fresh one per test), plus
/// `extra` tests, and exits: 0 when every test passed, 101 otherwise.
pub fn run<B, F, Fut>(make: F, extra: Vec<Extra>) -> !
where
    B: Backend + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = B> + 'static,
{
    let mut args = Arguments::from_args();
    // libtest reads the thread count from the environment too.
    args.test_threads = args
        .test_threads
        .or_else(|| std::env::var("RUST_TEST_THREADS").ok()?.parse().ok());
    let (driver, choice) = runtime().block_on(async {
        let backend = make().await;
        let driver = backend.connect().await;
        let choice = scenarios::registered(driver.as_ref(), &backend.hooks());
        (driver.name(), choice)
    });
    // Not in a list or in JSON, which tools read.
    let json = matches!(args.format, Some(FormatSetting::Json));
    if !args.list && !json && !choice.not_registered.is_empty() {
        println!();
        for (name, reason) in &choice.not_registered {
            println!("not registered for the {driver} driver: {name} ({reason})");
        }
    }
    let make = Arc::new(make);
    let scenarios = choice.registered.into_iter().map(|(name, scenario)| {
        let make = make.clone();
        trial(name, move || async move {
            let backend = make().await;
            scenario(&backend).await;
        })
    });
    let extra = extra.into_iter().map(|(name, test)| trial(name, test));
    libtest_mimic::run(&args, scenarios.chain(extra).collect()).exit()
}

/// Runs `trials` with libtest's command line and report, and exits.
pub(crate) fn run_trials(trials: Vec<Trial>) -> ! {
    let mut args = Arguments::from_args();
    args.test_threads = args
        .test_threads
        .or_else(|| std::env::var("RUST_TEST_THREADS").ok()?.parse().ok());
    libtest_mimic::run(&args, trials).exit()
}

/// A test running `test` on a runtime of its own, in a thread named after
/// the test (as libtest names it), so that a panic message says which test
/// it comes from. The panic fails this test only.
pub(crate) fn trial<T, Fut>(name: &'static str, test: T) -> Trial
where
    T: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    Trial::test(name, move || {
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || runtime().block_on(test()))
            .expect("spawn a test thread")
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok(())
    })
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
