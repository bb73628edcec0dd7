//! How the facade's consume throughput scales with the work, on every
//! backend: no-op jobs, at-least-once (each delivery is acknowledged only
//! after its handler returned), through `Consumer` exactly as an application
//! runs it.
//!
//! Two sweeps per backend:
//!
//! - backlog, at concurrency 64: 1,000, 10,000 and 200,000 messages waiting
//!   in the queue before the consumer starts (the SQS emulator: 100, 250
//!   and 500, see below);
//! - concurrency, with a 10,000-message backlog (SQS: 250): 1, 8, 64 and
//!   256 deliveries handled at once (the consumer's prefetch is the same).
//!
//! The point at backlog 10,000 and concurrency 64 belongs to both sweeps and
//! is measured once.
//!
//! Each round of each point runs on a fresh queue (or stream), filled with
//! `Producer::dispatch_batch` in chunks of 1,000, one after another
//! outside the timing, by a driver connected for that round alone; the
//! queue, its failure queue and the driver go away after it. The time runs
//! from the consumer's spawn (its subscribe included) until the registry's
//! counters show every job settled, that is acknowledged to the backend: the
//! handler counts the jobs it ran, and once the last has run the clock waits,
//! yielding, for the last settlements. The time to the first handler call
//! (the start-up: subscribe, the first pull or push) is recorded apart.
//!
//! Rounds: `rounds()` (default 7) per point, in sweeps that visit every
//! point of a backend once per round, in reverse order every other round, so
//! a noisy moment of the machine spreads over the points instead of bending
//! one; the 200,000 backlog takes part in the first 3 rounds only (each of
//! its rounds fills and drains 200,000 persistent messages). The SQS
//! emulator (moto behind one lock, one request at a time in Python, each
//! receive and delete scanning the queue's messages, so a request costs more
//! the longer the queue) takes minutes for a few thousand messages, so its
//! backlogs stop at 500 and its points run 3 rounds at most: what it
//! measures is the emulator, not SQS.
//!
//! Output: a Markdown table on stdout (messages/s and us/msg, median and
//! min-max), one JSON line per point in `target/bench-results/scale.jsonl`,
//! and the curves as SVG: `bench/plots/scale-backlog.svg`,
//! `bench/plots/scale-concurrency.svg` (throughput, both axes log) and
//! `bench/plots/scale-cost.svg` (us/msg against the backlog).
//!
//! Environment, besides the harness's `BENCH_ROUNDS`, `BENCH_QUICK` (a tenth
//! of every backlog) and `BENCH_ONLY` (points whose name, e.g. `scale nats
//! backlog 10000 concurrency 64`, contains the word):
//! - `BENCH_BACKENDS=memory,rabbitmq,nats,sqs` (the default: all four);
//! - `RABBITMQ_URL`, `NATS_URL`, `SQS_ENDPOINT` (start the emulator with
//!   `tests/sqs-emulator`; `bench/run` does).
//!
//! Run: `cargo bench -p jobrail-bench --all-features --bench scale`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use jobrail::{Job, JobContext, JobError, Registry};
use jobrail_bench::plot::{self, Series};
use jobrail_bench::{append_result, quick, reset_results, rounds, selected, size, unique, Spread};
use jobrail_native::nats::{NatsConfig, NatsDriver};
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};
use jobrail_native::{Consumer, Driver, MemoryDriver, Producer};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

const BENCH: &str = "scale";
const JOB: &str = "scale";
/// Messages per `dispatch_batch` call when filling a queue.
const CHUNK: usize = 1_000;
/// `dispatch_batch` calls in flight at once when filling a queue
/// (`SCALE_FILLERS` overrides it). One: each batch is already pipelined by
/// the driver, and with 4 or 8 batches at once the NATS driver's batch
/// dispatch at the time of writing sometimes never returned (8 batches of
/// 1,000 hold more than the 5,000 PubAck permits async-nats's context
/// lends, each waiting for permits only the others would release; 4
/// stalled too, once in a few rounds).
const FILLERS: usize = 1;
/// Rounds of the 200,000 backlog (and of every SQS point) at most.
const FEW_ROUNDS: usize = 3;
/// A point that has not settled everything by then is broken, not slow.
const GIVE_UP: Duration = Duration::from_secs(300);

#[derive(Serialize, Deserialize)]
struct Work {
    id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Memory,
    Rabbit,
    Nats,
    Sqs,
}

impl Backend {
    const ALL: [Backend; 4] = [
        Backend::Memory,
        Backend::Rabbit,
        Backend::Nats,
        Backend::Sqs,
    ];

    /// The name `BENCH_BACKENDS` and the results use.
    fn key(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Rabbit => "rabbitmq",
            Backend::Nats => "nats",
            Backend::Sqs => "sqs",
        }
    }

    /// The name on the plots and in the table.
    fn label(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Rabbit => "RabbitMQ",
            Backend::Nats => "NATS JetStream",
            Backend::Sqs => "SQS (moto emulator)",
        }
    }

    /// The backlogs of the backlog sweep.
    fn backlogs(self) -> Vec<u64> {
        match self {
            Backend::Sqs => vec![size(100), size(250), size(500)],
            _ => vec![size(1_000), size(10_000), size(200_000)],
        }
    }

    /// The backlog of the concurrency sweep.
    fn sweep_backlog(self) -> u64 {
        match self {
            Backend::Sqs => size(250),
            _ => size(10_000),
        }
    }

    /// Rounds of a point with `backlog` messages.
    fn rounds_for(self, backlog: u64) -> usize {
        if self == Backend::Sqs || backlog >= size(200_000) {
            rounds().min(FEW_ROUNDS)
        } else {
            rounds()
        }
    }
}

/// The backends `BENCH_BACKENDS` names (default all).
fn backends() -> Vec<Backend> {
    match std::env::var("BENCH_BACKENDS") {
        Ok(list) if !list.trim().is_empty() => {
            let wanted: Vec<String> = list
                .split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .collect();
            for word in &wanted {
                assert!(
                    Backend::ALL.iter().any(|b| b.key() == word),
                    "BENCH_BACKENDS: unknown backend `{word}` (memory, rabbitmq, nats, sqs)"
                );
            }
            Backend::ALL
                .into_iter()
                .filter(|b| wanted.iter().any(|w| w == b.key()))
                .collect()
        }
        _ => Backend::ALL.to_vec(),
    }
}

const CONCURRENCY_SWEEP: [usize; 4] = [1, 8, 64, 256];
const BACKLOG_CONCURRENCY: usize = 64;

/// One point of a sweep and its rounds.
#[derive(Debug, Clone, Serialize)]
struct Point {
    /// Always "scale-point" (`bench/run`'s tables tell the kinds apart).
    kind: &'static str,
    backend: &'static str,
    /// The sweeps it belongs to: "backlog", "concurrency" or both.
    sweeps: Vec<&'static str>,
    backlog: u64,
    concurrency: usize,
    /// Seconds from the consumer's spawn to the last settlement, per round.
    secs: Vec<f64>,
    /// Seconds from the consumer's spawn to the first handler call.
    startup_secs: Vec<f64>,
    /// Messages per second (backlog / secs).
    msgs_per_sec: Option<Spread>,
    /// Microseconds per message (secs / backlog).
    us_per_msg: Option<Spread>,
    /// Milliseconds to the first handler call.
    startup_ms: Option<Spread>,
    quick: bool,
}

impl Point {
    fn new(backend: Backend, backlog: u64, concurrency: usize) -> Point {
        let mut sweeps = vec![];
        if concurrency == BACKLOG_CONCURRENCY {
            sweeps.push("backlog");
        }
        if backlog == backend.sweep_backlog() {
            sweeps.push("concurrency");
        }
        Point {
            kind: "scale-point",
            backend: backend.key(),
            sweeps,
            backlog,
            concurrency,
            secs: vec![],
            startup_secs: vec![],
            msgs_per_sec: None,
            us_per_msg: None,
            startup_ms: None,
            quick: quick(),
        }
    }

    fn name(&self) -> String {
        format!(
            "scale {} backlog {} concurrency {}",
            self.backend, self.backlog, self.concurrency
        )
    }

    fn finish(&mut self) {
        if self.secs.is_empty() {
            return;
        }
        let n = self.backlog as f64;
        let rates: Vec<f64> = self.secs.iter().map(|s| n / s).collect();
        let costs: Vec<f64> = self.secs.iter().map(|s| s / n * 1e6).collect();
        let startup: Vec<f64> = self.startup_secs.iter().map(|s| s * 1e3).collect();
        self.msgs_per_sec = Some(Spread::of(&rates));
        self.us_per_msg = Some(Spread::of(&costs));
        self.startup_ms = Some(Spread::of(&startup));
    }

    fn row(&self, label: &str) -> String {
        let (Some(r), Some(c), Some(s)) = (self.msgs_per_sec, self.us_per_msg, self.startup_ms)
        else {
            return String::new();
        };
        format!(
            "| {label} | {} | {} | {:.0} ({:.0} to {:.0}) | {:.2} ({:.2} to {:.2}) | {:.1} | {} |",
            self.backlog,
            self.concurrency,
            r.median,
            r.min,
            r.max,
            c.median,
            c.min,
            c.max,
            s.median,
            self.secs.len()
        )
    }
}

/// A driver connected for one round, of the concrete type its cleanup needs.
enum Connection {
    Memory(Arc<MemoryDriver>),
    Rabbit(Arc<RabbitDriver>),
    Nats(Arc<NatsDriver>),
    Sqs(Arc<SqsDriver>),
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

impl Connection {
    async fn open(backend: Backend) -> Connection {
        match backend {
            Backend::Memory => Connection::Memory(Arc::new(MemoryDriver::default())),
            Backend::Rabbit => {
                let url = env_or("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
                let driver = RabbitDriver::connect(RabbitConfig::new(url))
                    .await
                    .expect("RabbitMQ at RABBITMQ_URL (bench/run starts it)");
                Connection::Rabbit(Arc::new(driver))
            }
            Backend::Nats => {
                let url = env_or("NATS_URL", "nats://127.0.0.1:4222");
                let driver = NatsDriver::connect(NatsConfig::new(url))
                    .await
                    .expect("NATS JetStream at NATS_URL (bench/run starts it)");
                Connection::Nats(Arc::new(driver))
            }
            Backend::Sqs => {
                let endpoint = std::env::var("SQS_ENDPOINT").expect(
                    "SQS_ENDPOINT is not set: start the emulator with \
                     `export SQS_ENDPOINT=$(tests/sqs-emulator)` (bench/run does)",
                );
                // Short long polls, so a stopping consumer is not held up
                // by one; the default visibility timeout (30 s) is far
                // longer than any delivery here.
                let config = SqsConfig::new("us-east-1")
                    .endpoint(endpoint)
                    .credentials(SqsCredentials::fixed("test", "test"))
                    .wait_time(Duration::from_secs(1));
                let driver = SqsDriver::connect(config)
                    .await
                    .expect("the SQS emulator at SQS_ENDPOINT");
                Connection::Sqs(Arc::new(driver))
            }
        }
    }

    fn driver(&self) -> Arc<dyn Driver> {
        match self {
            Connection::Memory(d) => d.clone(),
            Connection::Rabbit(d) => d.clone(),
            Connection::Nats(d) => d.clone(),
            Connection::Sqs(d) => d.clone(),
        }
    }

    /// Deletes what the round created (queues, streams), stops the driver.
    async fn close(self) {
        let cleaned = match &self {
            Connection::Memory(_) => Ok(()),
            Connection::Rabbit(d) => d.delete_queues(&d.declared_queues()).await,
            Connection::Nats(d) => d.delete_streams(&d.declared_streams()).await,
            Connection::Sqs(d) => d.delete_queues(&d.created_queues()).await,
        };
        if let Err(e) = cleaned {
            eprintln!("scale: cleaning up after a round: {e}");
        }
        if let Err(e) = self.driver().stop().await {
            eprintln!("scale: stopping a driver: {e}");
        }
    }
}

/// Puts `backlog` jobs on `job`'s queue, `CHUNK` per batch, `FILLERS`
/// batches at a time.
async fn fill(driver: Arc<dyn Driver>, job: &Job<Work>, backlog: u64) {
    let producer = Producer::new(driver);
    let fillers = std::env::var("SCALE_FILLERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FILLERS);
    let permits = Arc::new(tokio::sync::Semaphore::new(fillers));
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0;
    while next < backlog {
        let end = (next + CHUNK as u64).min(backlog);
        let chunk: Vec<Work> = (next..end).map(|id| Work { id }).collect();
        next = end;
        let permit = permits.clone().acquire_owned().await.unwrap();
        let (producer, job) = (producer.clone(), job.clone());
        tasks.spawn(async move {
            let results = producer.dispatch(&job).send_batch(&chunk).await;
            drop(permit);
            results
        });
    }
    while let Some(results) = tasks.join_next().await {
        for result in results.expect("a filling task panicked") {
            if let Err(e) = result {
                panic!("scale: filling the queue: {e}");
            }
        }
    }
}

/// Awaits `work`, a phase of a round, or panics naming it after `GIVE_UP`:
/// a hung broker call fails the run instead of stalling it.
async fn phase<F: std::future::Future>(backend: Backend, what: &str, work: F) -> F::Output {
    match tokio::time::timeout(GIVE_UP, work).await {
        Ok(out) => out,
        Err(_) => panic!("scale: {}: {what} took over {GIVE_UP:?}", backend.key()),
    }
}

/// What one round measured.
struct Measured {
    total: Duration,
    startup: Duration,
}

/// One round of a point: a fresh queue holding `backlog` jobs, consumed at
/// `concurrency` until every job settled.
async fn round(backend: Backend, backlog: u64, concurrency: usize) -> Measured {
    let connection = phase(backend, "connecting", Connection::open(backend)).await;
    let queue = unique(&format!("scale-{}", backend.key()));
    let job = Job::<Work>::builder(JOB).queue(&queue).build().unwrap();
    phase(
        backend,
        "filling the queue",
        fill(connection.driver(), &job, backlog),
    )
    .await;

    let ran = Arc::new(AtomicU64::new(0));
    let all_ran = Arc::new(Notify::new());
    let first = Arc::new(OnceLock::<Instant>::new());
    let mut registry = Registry::new();
    {
        let (ran, all_ran, first) = (ran.clone(), all_ran.clone(), first.clone());
        registry
            .register(&job, move |_: JobContext, work: Work| {
                std::hint::black_box(work.id);
                let n = ran.fetch_add(1, Ordering::Relaxed) + 1;
                if n == 1 {
                    let _ = first.set(Instant::now());
                }
                if n == backlog {
                    all_ran.notify_one();
                }
                async { Ok::<(), JobError>(()) }
            })
            .unwrap();
    }

    let started = Instant::now();
    let consumer = Consumer::builder(connection.driver(), registry)
        .concurrency(concurrency)
        .build()
        .spawn();
    if tokio::time::timeout(GIVE_UP, all_ran.notified())
        .await
        .is_err()
    {
        panic!(
            "scale: {} ran {} of {backlog} jobs in {GIVE_UP:?}",
            backend.key(),
            ran.load(Ordering::Relaxed)
        );
    }
    // Every handler has returned: wait for the last settlements (at most
    // `concurrency` of them), yielding rather than sleeping so the clock
    // stops within microseconds of the last.
    while consumer.registry().stats().job(JOB).succeeded() < backlog {
        if started.elapsed() > GIVE_UP {
            panic!("scale: {} did not settle every job", backend.key());
        }
        tokio::task::yield_now().await;
    }
    let total = started.elapsed();
    let startup = first.get().map_or(total, |t| t.duration_since(started));
    phase(backend, "stopping the consumer", consumer.shutdown())
        .await
        .expect("the consumer stops");
    phase(backend, "cleaning up", connection.close()).await;
    Measured { total, startup }
}

/// Every point of `backend`'s two sweeps that `BENCH_ONLY` selects.
fn points(backend: Backend) -> Vec<Point> {
    let mut points: Vec<Point> = backend
        .backlogs()
        .into_iter()
        .map(|b| Point::new(backend, b, BACKLOG_CONCURRENCY))
        .collect();
    let sweep = backend.sweep_backlog();
    for c in CONCURRENCY_SWEEP {
        if !points
            .iter()
            .any(|p| p.backlog == sweep && p.concurrency == c)
        {
            points.push(Point::new(backend, sweep, c));
        }
    }
    points.retain(|p| selected(&p.name()));
    points
}

/// Runs `backend`'s points, round by round.
fn sweep(runtime: &tokio::runtime::Runtime, backend: Backend) -> Vec<Point> {
    let mut points = points(backend);
    let most = points
        .iter()
        .map(|p| backend.rounds_for(p.backlog))
        .max()
        .unwrap_or(0);
    for r in 0..most {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..points.len()).collect()
        } else {
            (0..points.len()).rev().collect()
        };
        for i in order {
            let point = &mut points[i];
            if r >= backend.rounds_for(point.backlog) {
                continue;
            }
            let (backlog, concurrency) = (point.backlog, point.concurrency);
            let measured = jobrail_bench::on_worker(runtime, round(backend, backlog, concurrency));
            eprintln!(
                "{} round {}: {:.0} msg/s ({:.1} ms start-up)",
                point.name(),
                r + 1,
                backlog as f64 / measured.total.as_secs_f64(),
                measured.startup.as_secs_f64() * 1e3
            );
            point.secs.push(measured.total.as_secs_f64());
            point.startup_secs.push(measured.startup.as_secs_f64());
        }
    }
    for point in &mut points {
        point.finish();
    }
    points
}

/// One curve per backend: y of each point of `sweep`, against `x`.
fn curves(
    results: &[(Backend, Vec<Point>)],
    sweep: &str,
    x: impl Fn(&Point) -> f64,
    y: impl Fn(&Point) -> Option<Spread>,
) -> Vec<Series> {
    results
        .iter()
        .filter_map(|(backend, points)| {
            let mut line: Vec<(f64, Spread)> = points
                .iter()
                .filter(|p| p.sweeps.contains(&sweep))
                .filter_map(|p| Some((x(p), y(p)?)))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!line.is_empty()).then(|| Series {
                name: backend.label().into(),
                points: line,
            })
        })
        .collect()
}

fn draw(results: &[(Backend, Vec<Point>)]) {
    let dir = jobrail_bench::workspace_root().join("bench").join("plots");
    std::fs::create_dir_all(&dir).expect("create bench/plots");
    let quick = if quick() { " (BENCH_QUICK)" } else { "" };
    let backlog = |p: &Point| p.backlog as f64;
    let concurrency = |p: &Point| p.concurrency as f64;
    let rate = |p: &Point| p.msgs_per_sec;
    let cost = |p: &Point| p.us_per_msg;
    let plots = [
        (
            "scale-backlog.svg",
            format!("Consume throughput by backlog, concurrency 64{quick}"),
            "messages in the queue when the consumer starts",
            "messages/s",
            curves(results, "backlog", backlog, rate),
        ),
        (
            "scale-concurrency.svg",
            format!("Consume throughput by concurrency, 10k backlog (SQS 250){quick}"),
            "concurrency (= prefetch)",
            "messages/s",
            curves(results, "concurrency", concurrency, rate),
        ),
        (
            "scale-cost.svg",
            format!("Cost per message by backlog, concurrency 64{quick}"),
            "messages in the queue when the consumer starts",
            "us per message",
            curves(results, "backlog", backlog, cost),
        ),
    ];
    for (file, title, x_label, y_label, series) in plots {
        if series.is_empty() {
            continue;
        }
        let path = dir.join(file);
        match plot::lines_log(&path, &title, x_label, y_label, &series) {
            Ok(()) => println!("plot: {}", path.display()),
            Err(e) => eprintln!("scale: drawing {}: {e}", path.display()),
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter word would go to BENCH_ONLY.
    let runtime = jobrail_bench::runtime();
    reset_results(BENCH);
    let mut results = vec![];
    println!();
    println!(
        "| backend | backlog | concurrency | messages/s median (min to max) | us/msg median (min to max) | start-up ms | rounds |"
    );
    println!("|---|---|---|---|---|---|---|");
    for backend in backends() {
        let points = sweep(&runtime, backend);
        for point in &points {
            println!("{}", point.row(backend.label()));
            append_result(BENCH, point);
        }
        results.push((backend, points));
    }
    draw(&results);
}
