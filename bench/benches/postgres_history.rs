//! The Postgres driver as its history grows: 1,000,000 no-op jobs (100,000
//! under `BENCH_QUICK=1`) through one `PgDriver`, in 20 equal chunks. The
//! target is a flat line: a finished job's row is deleted, so the hot table
//! and its indexes should hold only what is still to do (plus what vacuum
//! has not yet reclaimed), and a chunk late in the history should run as
//! fast as the first.
//!
//! The server: by default a private one the bench starts for itself
//! (`jobrail_conformance::servers::PgServer`: `initdb` into a temporary directory, the
//! stock configuration, so autovacuum on and fsync on, a free port of
//! 127.0.0.1), stopped and removed at the end. The machine's shared server
//! (127.0.0.1:5432) is not used: its CI configuration has autovacuum off,
//! and the issue asks for the figures with autovacuum on. `BENCH_PG_URL`
//! runs against a given server instead; the settings line then says
//! whether autovacuum is on there (with it off nothing vacuums the table,
//! and a warning says so). The bench never changes a server's settings.
//!
//! Shape: the schema `bench_history` is dropped and installed afresh; one
//! driver (its defaults but for the schema and `connections = 17`, as in the
//! `postgres` bench) serves the whole run, as a long-lived worker would. Each
//! chunk:
//!
//! 1. dispatch: `send_batch` in runs of 5,000 until the chunk (50,000 jobs)
//!    is in the table, timed on its own (the dispatch column);
//! 2. consume: a fresh `Consumer` (concurrency 64, the no-op handler) on that
//!    driver, timed from its spawn until every job of the chunk has run and
//!    `shutdown` returned (the consume column, the figure to watch); the
//!    table is then checked to hold no live row;
//! 3. once the statistics have caught up (`pg_stat_user_tables` counting
//!    every insert and delete so far: a backend that flushed its counters
//!    less than a second ago flushes them next only when it runs again or
//!    10 s later, so this waits up to about 10 s, outside every clock), a
//!    read of `pg_stat_user_tables` (live and dead tuples, autovacuums and
//!    their last time, manual vacuums) and of the sizes of `jobs`, its
//!    indexes `jobs_fetch` and `jobs_pkey`, and all of it
//!    (`pg_total_relation_size`). A sampler reads `n_dead_tup` and
//!    `autovacuum_count` every 500 ms meanwhile, for the peak within the
//!    chunk, and notes each autovacuum of `jobs` on stderr as it shows.
//!
//! Why chunks rather than a steady state (a producer keeping jobs ahead of a
//! running consumer): every chunk does the same work from the same state (a
//! backlog of 50,000, drained to zero), so the only thing that differs from
//! the first chunk to the last is the history behind it, and the consumer's
//! clock is not shared with a producer on the same two cores. What it does
//! not show is a table that never empties; the dead tuples left behind by a
//! chunk are there when the next one starts unless autovacuum reclaimed
//! them, which is the case that matters for the fetch (an index scan from
//! the oldest run time).
//!
//! Results: a Markdown table on stdout, one JSON line per chunk (and one for
//! the settings) in `target/bench-results/postgres_history.jsonl` (which
//! `tables` renders the same way), and the consume curve (x, jobs done, on
//! the plot helper's log scale; y linear from 0) in
//! `bench/plots/postgres-history.svg`.
//!
//! Run: `cargo bench -p jobrail-bench --features postgres --bench
//! postgres_history`.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use jobrail::Registry;
use jobrail_bench::history::{
    header, kib, row, Chunk, Settings, TableState, CHUNK_KIND, SETTINGS_KIND,
};
use jobrail_bench::plot::{self, Series};
use jobrail_bench::work::{handler, job, payloads};
use jobrail_bench::{append_result, on_worker, quick, reset_results, runtime, size, Spread};
use jobrail_conformance::servers::PgServer;
use jobrail_native::{Consumer, Producer};
use jobrail_postgres::{PgConfig, PgDriver};
use tokio_postgres::{Client, NoTls};

const BENCH: &str = "postgres_history";
const SCHEMA: &str = "bench_history";
const QUEUE: &str = "bench-history";
const CONCURRENCY: usize = 64;
const CHUNKS: u64 = 20;
const DISPATCH_RUN: usize = 5_000;

/// The server's URL: the private server's, or `BENCH_PG_URL`.
static URL: OnceLock<String> = OnceLock::new();

fn url() -> String {
    URL.get().expect("the server's URL is set").clone()
}

/// A tokio-postgres client, its connection driven by a task of its own.
async fn connect() -> Client {
    let (client, connection) = tokio_postgres::connect(&url(), NoTls).await.unwrap();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("postgres connection: {e}");
        }
    });
    client
}

async fn setting(client: &Client, name: &str) -> String {
    client
        .query_one("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

async fn show(client: &Client, name: &str) -> String {
    client
        .simple_query(&format!("SHOW {name}"))
        .await
        .unwrap()
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        })
        .unwrap_or_default()
}

async fn settings(client: &Client, server: &str, jobs: u64) -> Settings {
    let num = |s: String| s.parse::<f64>().unwrap_or(0.0);
    let cost_limit = num(setting(client, "autovacuum_vacuum_cost_limit").await);
    let cost_limit = if cost_limit < 0.0 {
        num(setting(client, "vacuum_cost_limit").await)
    } else {
        cost_limit
    };
    Settings {
        kind: SETTINGS_KIND.into(),
        server: server.into(),
        server_version: show(client, "server_version").await,
        autovacuum: show(client, "autovacuum").await,
        fsync: show(client, "fsync").await,
        naptime: show(client, "autovacuum_naptime").await,
        max_workers: num(setting(client, "autovacuum_max_workers").await),
        vacuum_scale_factor: num(setting(client, "autovacuum_vacuum_scale_factor").await),
        vacuum_threshold: num(setting(client, "autovacuum_vacuum_threshold").await),
        insert_scale_factor: num(setting(client, "autovacuum_vacuum_insert_scale_factor").await),
        insert_threshold: num(setting(client, "autovacuum_vacuum_insert_threshold").await),
        analyze_scale_factor: num(setting(client, "autovacuum_analyze_scale_factor").await),
        analyze_threshold: num(setting(client, "autovacuum_analyze_threshold").await),
        cost_delay_ms: num(setting(client, "autovacuum_vacuum_cost_delay").await),
        cost_limit,
        quick: quick(),
        jobs,
        chunks: CHUNKS,
    }
}

async fn table_state(client: &Client) -> TableState {
    client
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    let row = client
        .query_one(
            &format!(
                "SELECT n_live_tup, n_dead_tup, autovacuum_count, last_autovacuum::text,
                        autoanalyze_count, vacuum_count, last_vacuum::text,
                        pg_relation_size('{SCHEMA}.jobs'),
                        pg_relation_size('{SCHEMA}.jobs_fetch'),
                        pg_relation_size('{SCHEMA}.jobs_pkey'),
                        pg_total_relation_size('{SCHEMA}.jobs')
                 FROM pg_stat_user_tables WHERE schemaname = '{SCHEMA}' AND relname = 'jobs'"
            ),
            &[],
        )
        .await
        .unwrap();
    TableState {
        n_live_tup: row.get(0),
        n_dead_tup: row.get(1),
        autovacuum_count: row.get(2),
        last_autovacuum: row.get(3),
        autoanalyze_count: row.get(4),
        vacuum_count: row.get(5),
        last_vacuum: row.get(6),
        table_bytes: row.get(7),
        fetch_index_bytes: row.get(8),
        pkey_bytes: row.get(9),
        total_bytes: row.get(10),
    }
}

/// Waits until the statistics count `done` inserts and deletes of the jobs
/// table (at most 15 s; a warning on stderr after that).
async fn stats_caught_up(client: &Client, done: u64) {
    let started = Instant::now();
    loop {
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        let row = client
            .query_one(
                "SELECT n_tup_ins, n_tup_del FROM pg_stat_user_tables
                 WHERE schemaname = $1 AND relname = 'jobs'",
                &[&SCHEMA],
            )
            .await
            .unwrap();
        let (inserted, deleted): (i64, i64) = (row.get(0), row.get(1));
        if inserted as u64 >= done && deleted as u64 >= done {
            return;
        }
        if started.elapsed() > Duration::from_secs(15) {
            eprintln!("statistics still behind after 15 s: {inserted} inserts, {deleted} deletes of {done}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads `n_dead_tup` every 500 ms into `peak` (the highest since it was
/// last reset), and notes on stderr each autovacuum of the table as
/// `autovacuum_count` shows it, until `stop`.
async fn sample(peak: Arc<AtomicI64>, stop: Arc<AtomicBool>, started: Instant) {
    let client = connect().await;
    let mut autovacuums = 0;
    while !stop.load(Ordering::SeqCst) {
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        let row = client
            .query_one(
                "SELECT n_dead_tup, autovacuum_count, n_tup_del FROM pg_stat_user_tables
                 WHERE schemaname = $1 AND relname = 'jobs'",
                &[&SCHEMA],
            )
            .await
            .unwrap();
        let (dead, count, deleted): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        peak.fetch_max(dead, Ordering::SeqCst);
        if count > autovacuums {
            autovacuums = count;
            eprintln!(
                "autovacuum #{count} of jobs seen at {:.0} s ({deleted} jobs deleted so far; n_dead_tup now {dead})",
                started.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Dispatches `n` jobs in runs of `DISPATCH_RUN`, each one `send_batch`.
async fn dispatch(driver: PgDriver, n: u64) {
    let producer = Producer::new(Arc::new(driver));
    let job = job(QUEUE);
    for run in payloads(n).chunks(DISPATCH_RUN) {
        for result in producer.dispatch(&job).send_batch(run).await {
            result.unwrap();
        }
    }
}

/// Runs a fresh consumer on `driver` until `n` jobs ran, then shuts it down.
async fn consume(driver: PgDriver, n: u64) {
    let mut registry = Registry::new();
    registry.register(&job(QUEUE), handler).unwrap();
    let consumer = Consumer::builder(Arc::new(driver), registry)
        .concurrency(CONCURRENCY)
        .build();
    let stats = consumer.registry().stats().clone();
    let handle = consumer.spawn();
    while stats.job("work").first_attempt < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    handle.shutdown().await.unwrap();
}

fn timed<F>(rt: &tokio::runtime::Runtime, work: F) -> f64
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    on_worker(rt, async move {
        let started = Instant::now();
        work.await;
        started.elapsed().as_secs_f64()
    })
}

fn main() {
    reset_results(BENCH);
    let run_started = Instant::now();
    // The server: `BENCH_PG_URL`, or a private one with its defaults.
    let (private, server) = match std::env::var("BENCH_PG_URL") {
        Ok(given) if !given.is_empty() => {
            URL.set(given).unwrap();
            (None, "given (BENCH_PG_URL)")
        }
        _ => {
            let dir = std::env::temp_dir()
                .join(format!("jobrail-bench-history-pg-{}", std::process::id()));
            let pg = PgServer::start(&dir, &[])
                .unwrap_or_else(|e| panic!("starting the private Postgres server: {e}"));
            println!(
                "private Postgres server on 127.0.0.1:{} (its defaults), in {}",
                pg.port,
                pg.dir().display()
            );
            URL.set(pg.url()).unwrap();
            (Some(pg), "private")
        }
    };
    let rt = runtime();
    let admin = Arc::new(on_worker(&rt, connect()));
    let total = size(1_000_000);
    let per_chunk = total / CHUNKS;

    let s = {
        let client = admin.clone();
        on_worker(&rt, async move { settings(&client, server, total).await })
    };
    println!("{}", s.line());
    if s.autovacuum != "on" {
        eprintln!(
            "warning: autovacuum is {} on this server: nothing vacuums the table during the run",
            s.autovacuum
        );
    }
    append_result(BENCH, &s);

    let driver = {
        let client = admin.clone();
        on_worker(&rt, async move {
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
                .await
                .unwrap();
            let mut config = PgConfig::new(&url()).unwrap().schema(SCHEMA);
            config.connections = 17;
            PgDriver::install(&config).await.unwrap();
            PgDriver::connect(config).await.unwrap()
        })
    };

    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicI64::new(0));
    let sampler = rt.spawn(sample(peak.clone(), stop.clone(), run_started));

    let start = {
        let client = admin.clone();
        on_worker(&rt, async move { table_state(&client).await })
    };
    println!(
        "\n{total} jobs in {CHUNKS} chunks of {per_chunk}, concurrency {CONCURRENCY}; at the start: \
         jobs {}, jobs_fetch {}, jobs_pkey {}, total {}\n",
        kib(start.table_bytes),
        kib(start.fetch_index_bytes),
        kib(start.pkey_bytes),
        kib(start.total_bytes)
    );
    println!("{}", header());

    let mut chunks: Vec<Chunk> = vec![];
    let mut autovacuums = start.autovacuum_count;
    for chunk in 1..=CHUNKS {
        peak.store(0, Ordering::SeqCst);
        let dispatch_secs = timed(&rt, dispatch(driver.clone(), per_chunk));
        let consume_secs = timed(&rt, consume(driver.clone(), per_chunk));
        let client = admin.clone();
        let done = chunk * per_chunk;
        let state = on_worker(&rt, async move {
            let live: i64 = client
                .query_one(&format!("SELECT count(*) FROM {SCHEMA}.jobs"), &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(live, 0, "rows left after the chunk");
            stats_caught_up(&client, done).await;
            table_state(&client).await
        });
        let c = Chunk {
            kind: CHUNK_KIND.into(),
            server: server.into(),
            quick: quick(),
            chunk,
            jobs: per_chunk,
            done,
            dispatch_secs,
            dispatch_per_sec: per_chunk as f64 / dispatch_secs,
            consume_secs,
            jobs_per_sec: per_chunk as f64 / consume_secs,
            peak_dead_tup: peak.load(Ordering::SeqCst).max(state.n_dead_tup),
            autovacuums_in_chunk: state.autovacuum_count - autovacuums,
            state,
        };
        autovacuums = c.state.autovacuum_count;
        println!("{}", row(&c));
        append_result(BENCH, &c);
        chunks.push(c);
    }
    stop.store(true, Ordering::SeqCst);
    rt.block_on(sampler).unwrap();

    let (first, last) = (&chunks[0], &chunks[chunks.len() - 1]);
    let max_dead = chunks.iter().map(|c| c.peak_dead_tup).max().unwrap_or(0);
    let max_total = chunks
        .iter()
        .map(|c| c.state.total_bytes)
        .max()
        .unwrap_or(0);
    let rates: Vec<f64> = chunks.iter().map(|c| c.jobs_per_sec).collect();
    let spread = Spread::of(&rates);
    println!(
        "\nconsume jobs/s: first chunk {:.0}, last {:.0}, last/first {:.2}; median {:.0} ({:.0} to {:.0}); \
         peak dead tuples {max_dead}; autovacuums of jobs {} (autoanalyzes {}), manual vacuums {}; \
         jobs table {} -> {}, jobs_fetch {} -> {}, jobs_pkey {} -> {}, total {} -> {} (at most {}); \
         elapsed {:.0} s",
        first.jobs_per_sec,
        last.jobs_per_sec,
        last.jobs_per_sec / first.jobs_per_sec,
        spread.median,
        spread.min,
        spread.max,
        last.state.autovacuum_count,
        last.state.autoanalyze_count,
        last.state.vacuum_count,
        kib(start.table_bytes),
        kib(last.state.table_bytes),
        kib(start.fetch_index_bytes),
        kib(last.state.fetch_index_bytes),
        kib(start.pkey_bytes),
        kib(last.state.pkey_bytes),
        kib(start.total_bytes),
        kib(last.state.total_bytes),
        kib(max_total),
        run_started.elapsed().as_secs_f64()
    );

    let point = |c: &Chunk, y: f64| {
        (
            c.done as f64,
            Spread {
                median: y,
                min: y,
                max: y,
            },
        )
    };
    // Consume only: dispatch runs some twenty times faster, and on one
    // linear axis from 0 it would flatten the curve that matters.
    let series = [Series {
        name: "consume (concurrency 64)".into(),
        points: chunks.iter().map(|c| point(c, c.jobs_per_sec)).collect(),
    }];
    let dir = jobrail_bench::workspace_root().join("bench").join("plots");
    std::fs::create_dir_all(&dir).expect("create bench/plots");
    let path = dir.join("postgres-history.svg");
    let title = format!(
        "Postgres: consume jobs/s by jobs done, chunks of {per_chunk}{}",
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    match plot::lines(&path, &title, "jobs done (history)", "jobs/s", &series) {
        Ok(()) => println!("plot: {}", path.display()),
        Err(e) => eprintln!("plot {}: {e}", path.display()),
    }

    on_worker(&rt, async move {
        jobrail_native::Driver::stop(&driver).await.unwrap();
        let _ = admin
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await;
    });
    drop(rt);
    if let Some(pg) = private {
        match pg.stop() {
            Ok(()) => println!("private Postgres server stopped and removed"),
            Err(e) => eprintln!("stopping the private Postgres server: {e}"),
        }
    }
}
