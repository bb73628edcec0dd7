//! The benchmark harness: every comparison runs the facade and its baseline
//! in the same process, on the same kind of tokio worker, in interleaved
//! rounds (the order alternates each round), and reports the median and the
//! range of each side and of the ratio (facade time / baseline time; below 1
//! the facade is faster).
//!
//! Results go to stdout as Markdown table rows and, one JSON object per line,
//! to `target/bench-results/<bench>.jsonl`, which `bench/run` gathers into
//! the tables of `BENCHMARKS.md`. The scale benchmark also draws its curves
//! as SVG into `bench/plots/`.
//!
//! Environment:
//! - `BENCH_ROUNDS`: rounds per comparison (default 7);
//! - `BENCH_QUICK=1`: a tenth of every message count, for a fast smoke run
//!   (figures from a quick run are not the published ones);
//! - `BENCH_ONLY=word`: run only the comparisons whose name contains `word`.

use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

pub mod history;
pub mod latency;
pub mod plot;
pub mod work;

/// Rounds per comparison (`BENCH_ROUNDS`, default 7).
pub fn rounds() -> usize {
    std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(7)
}

/// `n`, or a tenth of it (at least 1) under `BENCH_QUICK=1`.
pub fn size(n: u64) -> u64 {
    if quick() {
        (n / 10).max(1)
    } else {
        n
    }
}

/// Whether this is a quick smoke run (`BENCH_QUICK=1`).
pub fn quick() -> bool {
    std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// Whether the comparison `name` is selected (`BENCH_ONLY`).
pub fn selected(name: &str) -> bool {
    match std::env::var("BENCH_ONLY") {
        Ok(word) if !word.is_empty() => name.contains(&word),
        _ => true,
    }
}

/// The runtime both sides run on: tokio's multi-threaded scheduler with one
/// worker per core, as an application's `#[tokio::main]` would build.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Runs `work` on a worker thread of `runtime` (not on the thread that
/// blocks), and waits for it: both sides of a comparison go through here so
/// that neither gets the cheaper `block_on` thread.
pub fn on_worker<F>(runtime: &tokio::runtime::Runtime, work: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    runtime
        .block_on(async move { tokio::spawn(work).await })
        .expect("a benchmark round panicked")
}

/// Times `work` on a worker of `runtime`.
pub fn time_on_worker<F>(runtime: &tokio::runtime::Runtime, work: F) -> Duration
where
    F: Future<Output = ()> + Send + 'static,
{
    on_worker(runtime, async move {
        let started = Instant::now();
        work.await;
        started.elapsed()
    })
}

/// Median, minimum and maximum of a sample.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    /// The median (the upper one for an even count).
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (which must not be empty).
    pub fn of(values: &[f64]) -> Spread {
        assert!(!values.is_empty(), "a spread of nothing");
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Spread {
            median: sorted[sorted.len() / 2],
            min: sorted[0],
            max: sorted[sorted.len() - 1],
        }
    }
}

/// One comparison: the facade against a baseline doing the same work.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The benchmark (file) it belongs to: `pure`, `rabbitmq`...
    pub bench: String,
    /// The work, e.g. "consume 20,000 no-op jobs, concurrency 64".
    pub work: String,
    /// What the baseline is, e.g. "lapin, one `multiple` ack per run of 32".
    pub baseline: String,
    /// Messages (or operations) per round, for the per-message figures.
    pub count: u64,
    /// Seconds per round of the baseline.
    pub baseline_secs: Vec<f64>,
    /// Seconds per round of the facade.
    pub facade_secs: Vec<f64>,
    /// The target ratio, if the issue sets one (met when the median is at
    /// most this).
    pub target: Option<f64>,
}

impl Comparison {
    /// A comparison with no rounds yet.
    pub fn new(bench: &str, work: &str, baseline: &str, count: u64) -> Comparison {
        Comparison {
            bench: bench.into(),
            work: work.into(),
            baseline: baseline.into(),
            count,
            baseline_secs: vec![],
            facade_secs: vec![],
            target: None,
        }
    }

    /// Sets the target ratio.
    pub fn target(mut self, ratio: f64) -> Comparison {
        self.target = Some(ratio);
        self
    }

    /// Runs `rounds()` interleaved rounds, the baseline first in even rounds
    /// and the facade first in odd ones. Each closure runs one round and
    /// returns the time it measured (setup such as filling a queue stays out
    /// of it).
    pub fn run(
        mut self,
        mut baseline: impl FnMut(usize) -> Duration,
        mut facade: impl FnMut(usize) -> Duration,
    ) -> Comparison {
        for round in 0..rounds() {
            let (b, f) = if round % 2 == 0 {
                let b = baseline(round);
                (b, facade(round))
            } else {
                let f = facade(round);
                (baseline(round), f)
            };
            self.baseline_secs.push(b.as_secs_f64());
            self.facade_secs.push(f.as_secs_f64());
        }
        self
    }

    /// Ratios (facade / baseline) round by round.
    pub fn ratios(&self) -> Vec<f64> {
        self.facade_secs
            .iter()
            .zip(&self.baseline_secs)
            .map(|(f, b)| f / b)
            .collect()
    }

    /// Prints the Markdown row and appends the JSON line to
    /// `target/bench-results/<bench>.jsonl`.
    pub fn report(&self) {
        println!("{}", self.row());
        append_result(&self.bench, self);
    }

    /// The Markdown row: work | baseline | baseline median | facade median |
    /// ratio median (range) | target.
    pub fn row(&self) -> String {
        let b = Spread::of(&self.baseline_secs);
        let f = Spread::of(&self.facade_secs);
        let r = Spread::of(&self.ratios());
        let target = match self.target {
            Some(t) if r.median <= t => format!("<= {t}: met"),
            Some(t) => format!("<= {t}: NOT met"),
            None => "-".into(),
        };
        format!(
            "| {} | {} | {} | {} | {:.2} ({:.2} to {:.2}) | {} |",
            self.work,
            self.baseline,
            per_message(b.median, self.count),
            per_message(f.median, self.count),
            r.median,
            r.min,
            r.max,
            target
        )
    }
}

/// "12.3 ms (1.23 us/msg)" for a round of `count` messages taking `secs`.
pub fn per_message(secs: f64, count: u64) -> String {
    let each = secs / count.max(1) as f64;
    let total = if secs >= 1.0 {
        format!("{secs:.2} s")
    } else {
        format!("{:.1} ms", secs * 1e3)
    };
    let each = if each >= 1e-3 {
        format!("{:.2} ms", each * 1e3)
    } else if each >= 1e-6 {
        format!("{:.2} us", each * 1e6)
    } else {
        format!("{:.0} ns", each * 1e9)
    };
    format!("{total} ({each}/msg)")
}

/// A global allocator that counts allocations while counting is on
/// ([`count_allocations`]), for a bench that reports allocations per
/// message. Off, it costs one relaxed load per allocation. A bench opts in
/// with `#[global_allocator] static ALLOC: Counting = Counting;`.
pub struct Counting;

static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn counted() {
    use std::sync::atomic::Ordering::Relaxed;
    if COUNTING.load(Relaxed) {
        ALLOCATIONS.fetch_add(1, Relaxed);
    }
}

// SAFETY: every call is passed on to the system allocator unchanged.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        counted();
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        counted();
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        counted();
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

/// The allocations (reallocations included) made on every thread while
/// `work` runs, with its result. Counts only under the [`Counting`]
/// allocator; run it outside any timed section.
pub fn count_allocations<T>(work: impl FnOnce() -> T) -> (u64, T) {
    use std::sync::atomic::Ordering::SeqCst;
    ALLOCATIONS.store(0, SeqCst);
    COUNTING.store(true, SeqCst);
    let out = work();
    COUNTING.store(false, SeqCst);
    (ALLOCATIONS.load(SeqCst), out)
}

/// The line kind of allocations per message ([`Allocations`]).
pub const ALLOCATIONS_KIND: &str = "allocations";

/// Allocations per message of both sides of a comparison, counted in an
/// untimed pass ([`count_allocations`]).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Allocations {
    /// [`ALLOCATIONS_KIND`].
    pub kind: String,
    /// The comparison's work.
    pub work: String,
    /// The messages of the counted pass.
    pub count: u64,
    /// Allocations per message, baseline.
    pub baseline: f64,
    /// Allocations per message, facade.
    pub facade: f64,
}

impl Allocations {
    /// Allocations of `count` messages on each side.
    pub fn new(work: &str, count: u64, baseline: u64, facade: u64) -> Allocations {
        let each = |n: u64| n as f64 / count.max(1) as f64;
        Allocations {
            kind: ALLOCATIONS_KIND.into(),
            work: work.into(),
            count,
            baseline: each(baseline),
            facade: each(facade),
        }
    }

    /// The Markdown table's header.
    pub fn header() -> &'static str {
        "| work | messages counted | baseline allocations/msg | facade allocations/msg |\n|---|---|---|---|"
    }

    /// Its Markdown row.
    pub fn row(&self) -> String {
        format!(
            "| {} | {} | {:.2} | {:.2} |",
            self.work, self.count, self.baseline, self.facade
        )
    }

    /// Prints the row and appends the JSON line to `<bench>.jsonl`.
    pub fn report(&self, bench: &str) {
        println!("{}\n{}", Self::header(), self.row());
        append_result(bench, self);
    }
}

/// Where results and generated tables go: `<target dir>/bench-results`.
pub fn results_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let dir = target.join("bench-results");
    std::fs::create_dir_all(&dir).expect("create the results directory");
    dir
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the bench crate sits in the workspace")
        .to_path_buf()
}

/// Appends one JSON line to `target/bench-results/<bench>.jsonl`.
pub fn append_result(bench: &str, value: &impl Serialize) {
    let path = results_dir().join(format!("{bench}.jsonl"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("open the results file");
    let line = serde_json::to_string(value).expect("results serialize");
    writeln!(file, "{line}").expect("write the results file");
}

/// Starts a results file afresh (each bench calls it once at the start).
pub fn reset_results(bench: &str) {
    let _ = std::fs::remove_file(results_dir().join(format!("{bench}.jsonl")));
}

/// A short unique suffix for queue and stream names of one round.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{prefix}-{}-{:x}", std::process::id(), nanos & 0xffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_median_and_range() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 5.0, 4.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
    }

    #[test]
    fn rounds_alternate_and_ratios_follow() {
        let order = std::cell::RefCell::new(vec![]);
        let c = Comparison::new("t", "w", "b", 10).run(
            |r| {
                order.borrow_mut().push(('b', r));
                Duration::from_millis(10)
            },
            |r| {
                order.borrow_mut().push(('f', r));
                Duration::from_millis(20)
            },
        );
        let order = order.into_inner();
        assert_eq!(&order[..4], &[('b', 0), ('f', 0), ('f', 1), ('b', 1)]);
        assert!(c.ratios().iter().all(|r| (r - 2.0).abs() < 1e-9));
        assert!(c.row().contains("| 2.00 (2.00 to 2.00) |"));
    }
}
