//! The Postgres driver against a hand-written tokio-postgres loop and
//! against apalis-postgres, on the local server (`POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`), in interleaved rounds on the
//! harness runtime's workers.
//!
//! Consumption, 20,000 no-op jobs per round (2,000 under `BENCH_QUICK=1`),
//! at-least-once (each job deleted, or marked done, only after its handler),
//! 64 jobs in flight. Every queue is filled before the clock starts (one
//! statement, or `send_batch` in runs of 5,000 for the facade); each side's
//! clock covers preparing its statements (or starting its worker), claiming
//! and running every job, settling it, and stopping. The server runs with
//! its defaults (`fsync` and `synchronous_commit` on), so every settlement
//! that commits on its own waits for the WAL flush.
//!
//! - facade: a `Consumer` with concurrency 64 on `PgDriver` (its tables in
//!   the schema `bench_jobrail`, installed afresh; its default settings:
//!   two statement connections and the listening one, against the raw
//!   side's 17 clients) running a no-op handler, until every job is
//!   settled, then `shutdown`. The driver batches its acknowledgements (one
//!   `DELETE` in flight, carrying every ack that arrived meanwhile) and
//!   waits up to 2 ms for a quarter of a fetch batch of free slots while
//!   deliveries are out, so it commits far less often than one delete per
//!   job;
//! - tokio-postgres loop: a table of its own (`bench_raw_jobs`: `id
//!   bigserial primary key, queue text, body bytea, run_at timestamptz
//!   default now()`, an index on `(queue, run_at, id)`). One task claims
//!   batches with `WITH picked AS (SELECT id ... ORDER BY run_at, id LIMIT
//!   $2 FOR UPDATE SKIP LOCKED) UPDATE ... SET run_at = now() + interval '30
//!   seconds' ... RETURNING id, body`, as many rows as it has free slots of
//!   64 (it waits for one, then takes every free one); each row runs in a
//!   task of its own that decodes the envelope (one typed pass), runs the
//!   no-op and awaits its own `DELETE ... WHERE id = $1`. Claims go through
//!   one client, deletes are pipelined over 16 more (`ACK_CLIENTS`: each
//!   delete commits on its own, and commits on different connections share
//!   WAL flushes; 16 ran about twice as fast as 4 and no slower than 32),
//!   each statement prepared once;
//! - apalis-postgres 1.0.0 (apalis 1.0 with its `limit` layer, sqlx 0.9): a
//!   `PostgresStorage` on a `PgPool` of sqlx's default size (10
//!   connections), its migrations run once (`PostgresStorage::setup`, schema
//!   `apalis`), `Config::default().queue(<round's queue>).batch_size(64)`
//!   (the other settings their defaults: tasks locked, results persisted,
//!   apalis's default polling), a worker with
//!   `.concurrency(64)` running a no-op handler on the same jobs' payloads
//!   (apalis's JSON, pushed with `queries::push_tasks`, one `UNNEST` insert)
//!   until it stopped itself after the last one. apalis settles in batches
//!   (one `UPDATE` for a run of results); after each round a query counts
//!   the jobs not marked `Done` and prints them on stderr (none so far:
//!   the worker flushes its results before `run` returns).
//!
//! Dispatch, 5,000 jobs per round (500 quick), each committed (the tables
//! truncated between sides):
//!
//! - facade `Dispatch::send_batch` against one raw `INSERT ... SELECT $1,
//!   unnest($2::bytea[])` of the same envelope bytes (encoded before the
//!   clock starts). No target: the issue sets none, and the facade encodes
//!   its 5,000 envelopes inside the clock (about 2 us each here) while the
//!   statement itself takes about 4 us a row, so the ratio mostly measures
//!   the encoding;
//! - facade `Producer::dispatch` from 32 tasks against raw single-row
//!   `INSERT`s from 32 tasks, each awaited, pipelined over the 16 clients.
//!
//! Run: `cargo bench -p jobrail-bench --features postgres --bench postgres`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::{TaskBuilder, WorkerBuilder, WorkerBuilderExt, WorkerContext};
use apalis_postgres::{PgPool, PgTask, PostgresStorage};
use jobrail::Envelope;
use jobrail_bench::work::{payloads, TypedEnvelope, Work};
use jobrail_bench::{
    on_worker, reset_results, runtime, selected, size, time_on_worker, unique, Comparison,
};
use tokio::sync::Semaphore;
use tokio_postgres::{Client, NoTls};

const BENCH: &str = "postgres";
const CONCURRENCY: usize = 64;
const TASKS: usize = 32;
const ACK_CLIENTS: usize = 16;
const RAW_TABLE: &str = "bench_raw_jobs";
const FACADE_SCHEMA: &str = "bench_jobrail";

fn url() -> String {
    std::env::var("POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
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

/// The raw side's clients: one that claims, `ACK_CLIENTS` that delete (and
/// insert, for dispatch).
struct Raw {
    claimer: Arc<Client>,
    ackers: Arc<Vec<Arc<Client>>>,
}

async fn raw_clients() -> Raw {
    let claimer = Arc::new(connect().await);
    let mut ackers = vec![];
    for _ in 0..ACK_CLIENTS {
        ackers.push(Arc::new(connect().await));
    }
    Raw {
        claimer,
        ackers: Arc::new(ackers),
    }
}

/// The raw side's table, created afresh.
async fn raw_setup(client: &Client) {
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {RAW_TABLE};
             CREATE TABLE {RAW_TABLE} (
                 id bigserial PRIMARY KEY,
                 queue text NOT NULL,
                 body bytea NOT NULL,
                 run_at timestamptz NOT NULL DEFAULT now()
             );
             CREATE INDEX {RAW_TABLE}_ready ON {RAW_TABLE} (queue, run_at, id);"
        ))
        .await
        .unwrap();
}

/// One statement inserting every body into `queue`.
async fn raw_insert_all(client: &Client, queue: &str, bodies: &[Vec<u8>]) {
    let inserted = client
        .execute(
            &format!("INSERT INTO {RAW_TABLE} (queue, body) SELECT $1, unnest($2::bytea[])"),
            &[&queue, &bodies],
        )
        .await
        .unwrap();
    assert_eq!(inserted, bodies.len() as u64);
}

async fn raw_truncate(client: &Client) {
    client
        .batch_execute(&format!("TRUNCATE {RAW_TABLE}"))
        .await
        .unwrap();
}

async fn raw_count(client: &Client) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM {RAW_TABLE}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// One raw consumption round of `n` jobs from `queue` (filled first): the
/// claim loop and a task per claimed row, at most `CONCURRENCY` at once.
fn raw_consume(rt: &tokio::runtime::Runtime, raw: &Raw, bodies: &Arc<Vec<Vec<u8>>>) -> Duration {
    let n = bodies.len() as u64;
    let queue = "bench-raw".to_string();
    {
        let (client, queue, bodies) = (raw.claimer.clone(), queue.clone(), bodies.clone());
        on_worker(rt, async move {
            raw_truncate(&client).await;
            raw_insert_all(&client, &queue, &bodies).await;
        });
    }
    let (claimer, ackers) = (raw.claimer.clone(), raw.ackers.clone());
    let took = time_on_worker(rt, async move {
        let claim = claimer
            .prepare(&format!(
                "WITH picked AS (
                     SELECT id FROM {RAW_TABLE}
                     WHERE queue = $1 AND run_at <= now()
                     ORDER BY run_at, id
                     LIMIT $2
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE {RAW_TABLE} AS t SET run_at = now() + interval '30 seconds'
                 FROM picked WHERE t.id = picked.id
                 RETURNING t.id, t.body"
            ))
            .await
            .unwrap();
        let mut deletes = vec![];
        for acker in ackers.iter() {
            deletes.push(
                acker
                    .prepare(&format!("DELETE FROM {RAW_TABLE} WHERE id = $1"))
                    .await
                    .unwrap(),
            );
        }
        let slots = Arc::new(Semaphore::new(CONCURRENCY));
        let (mut claimed, mut next) = (0u64, 0usize);
        while claimed < n {
            let mut permits = vec![slots.clone().acquire_owned().await.unwrap()];
            while permits.len() < CONCURRENCY {
                match slots.clone().try_acquire_owned() {
                    Ok(permit) => permits.push(permit),
                    Err(_) => break,
                }
            }
            let rows = claimer
                .query(&claim, &[&queue, &(permits.len() as i64)])
                .await
                .unwrap();
            assert!(
                !rows.is_empty(),
                "the table ran dry after {claimed} of {n} jobs"
            );
            claimed += rows.len() as u64;
            for row in rows {
                let permit = permits.pop().expect("no more rows than permits");
                let (acker, delete) = (ackers[next].clone(), deletes[next].clone());
                next = (next + 1) % ackers.len();
                tokio::spawn(async move {
                    let id: i64 = row.get(0);
                    let body: &[u8] = row.get(1);
                    let envelope: TypedEnvelope = serde_json::from_slice(body).unwrap();
                    std::hint::black_box(&envelope);
                    assert_eq!(acker.execute(&delete, &[&id]).await.unwrap(), 1);
                    drop(permit);
                });
            }
        }
        // Every task done: all its slots back.
        let _all = slots.acquire_many(CONCURRENCY as u32).await.unwrap();
    });
    let client = raw.claimer.clone();
    assert_eq!(on_worker(rt, async move { raw_count(&client).await }), 0);
    took
}

/// Raw dispatch: one statement for every body.
async fn raw_insert_batch(client: Arc<Client>, queue: String, bodies: Arc<Vec<Vec<u8>>>) {
    raw_insert_all(&client, &queue, &bodies).await;
}

/// Raw dispatch from `TASKS` tasks: each inserts its share one row at a
/// time, awaiting each, over the `ACK_CLIENTS` clients.
async fn raw_insert_from_tasks(
    ackers: Arc<Vec<Arc<Client>>>,
    queue: String,
    bodies: Arc<Vec<Vec<u8>>>,
) {
    let mut inserts = vec![];
    for client in ackers.iter() {
        inserts.push(
            client
                .prepare(&format!(
                    "INSERT INTO {RAW_TABLE} (queue, body) VALUES ($1, $2)"
                ))
                .await
                .unwrap(),
        );
    }
    let mut tasks = vec![];
    for t in 0..TASKS {
        let (client, insert) = (
            ackers[t % ackers.len()].clone(),
            inserts[t % ackers.len()].clone(),
        );
        let (queue, bodies) = (queue.clone(), bodies.clone());
        tasks.push(tokio::spawn(async move {
            for body in bodies.iter().skip(t).step_by(TASKS) {
                client.execute(&insert, &[&queue, body]).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

static APALIS_DONE: AtomicU64 = AtomicU64::new(0);
static APALIS_TARGET: AtomicU64 = AtomicU64::new(u64::MAX);

async fn apalis_job(work: Work, worker: WorkerContext) {
    std::hint::black_box(&work);
    if APALIS_DONE.fetch_add(1, Ordering::SeqCst) + 1 == APALIS_TARGET.load(Ordering::SeqCst) {
        worker.stop().unwrap();
    }
}

/// One apalis round: a queue of its own filled with `n` jobs (one `UNNEST`
/// insert), then a worker with concurrency 64 until the last job ran; its
/// rows deleted afterwards.
fn apalis_consume(
    rt: &tokio::runtime::Runtime,
    pool: &PgPool,
    client: &Arc<Client>,
    n: u64,
) -> Duration {
    let queue = unique("bench-apalis");
    let backend = {
        let (pool, queue) = (pool.clone(), queue.clone());
        on_worker(rt, async move {
            let tasks: Vec<PgTask> = payloads(n)
                .iter()
                .map(|work| TaskBuilder::new(serde_json::to_vec(work).unwrap()).build())
                .collect();
            let mut connection = pool.acquire().await.unwrap();
            apalis_postgres::queries::push_tasks(&mut *connection, &queue, tasks)
                .await
                .unwrap();
            let config = apalis_postgres::Config::default()
                .queue(&queue)
                .batch_size(CONCURRENCY);
            PostgresStorage::<Work>::new(&pool).with_config(config)
        })
    };
    APALIS_DONE.store(0, Ordering::SeqCst);
    APALIS_TARGET.store(n, Ordering::SeqCst);
    let worker = unique("bench-apalis-worker");
    let took = time_on_worker(rt, async move {
        WorkerBuilder::new(worker)
            .backend(backend)
            .concurrency(CONCURRENCY)
            .build(apalis_job)
            .run()
            .await
            .unwrap();
    });
    assert_eq!(APALIS_DONE.load(Ordering::SeqCst), n);
    let client = client.clone();
    on_worker(rt, async move {
        let open: i64 = client
            .query_one(
                "SELECT count(*) FROM apalis.jobs WHERE job_type = $1 AND status <> 'Done'",
                &[&queue],
            )
            .await
            .unwrap()
            .get(0);
        if open > 0 {
            eprintln!("apalis round: {open} of {n} jobs not marked Done when the worker stopped");
        }
        client
            .execute("DELETE FROM apalis.jobs WHERE job_type = $1", &[&queue])
            .await
            .unwrap();
    });
    took
}

/// The bodies the facade would write for `n` jobs.
fn bodies(n: u64) -> Vec<Vec<u8>> {
    payloads(n)
        .into_iter()
        .map(|work| Envelope::new("work", serde_json::to_value(work).unwrap()).encode())
        .collect()
}

/// Empties the facade's queue and failure tables, outside any timing.
async fn facade_truncate(client: &Client) {
    client
        .batch_execute(&format!(
            "TRUNCATE {FACADE_SCHEMA}.jobs, {FACADE_SCHEMA}.failures"
        ))
        .await
        .unwrap();
}

/// The facade side: `PgDriver` through `Producer` and `Consumer`.
mod facade {
    use super::*;
    use jobrail::{Job, Registry};
    use jobrail_bench::work::{handler, job};
    use jobrail_native::{Consumer, Producer};
    use jobrail_postgres::{PgConfig, PgDriver};

    /// The driver's settings: its defaults (two statement connections and
    /// the listening one) but for the schema.
    pub(crate) fn config() -> PgConfig {
        PgConfig::new(&url()).unwrap().schema(FACADE_SCHEMA)
    }

    /// The driver on a schema of its own, its tables created afresh.
    pub(crate) async fn driver(client: &Client) -> PgDriver {
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {FACADE_SCHEMA} CASCADE"))
            .await
            .unwrap();
        let config = config();
        PgDriver::install(&config).await.unwrap();
        PgDriver::connect(config).await.unwrap()
    }

    /// Fills `queue` with `n` jobs, outside any timing.
    fn fill(rt: &tokio::runtime::Runtime, driver: &PgDriver, queue: &str, n: u64) {
        let (driver, job) = (driver.clone(), job(queue));
        on_worker(rt, async move {
            let producer = Producer::new(Arc::new(driver));
            let payloads = payloads(n);
            for chunk in payloads.chunks(5_000) {
                for result in producer.dispatch(&job).send_batch(chunk).await {
                    result.unwrap();
                }
            }
        });
    }

    /// One facade consumption round of `n` jobs from `queue` (filled first).
    pub(crate) fn consume(
        rt: &tokio::runtime::Runtime,
        driver: &PgDriver,
        client: &Arc<Client>,
        queue: &str,
        n: u64,
    ) -> Duration {
        {
            let client = client.clone();
            on_worker(rt, async move { facade_truncate(&client).await });
        }
        fill(rt, driver, queue, n);
        let mut registry = Registry::new();
        registry.register(&job(queue), handler).unwrap();
        let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
            .concurrency(CONCURRENCY)
            .build();
        let stats = consumer.registry().stats().clone();
        time_on_worker(rt, async move {
            let handle = consumer.spawn();
            while stats.job("work").first_attempt < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            handle.shutdown().await.unwrap();
        })
    }

    pub(crate) async fn dispatch_from_tasks(
        producer: Producer,
        job: Job<Work>,
        payloads: Arc<Vec<Work>>,
    ) {
        let mut tasks = vec![];
        for t in 0..TASKS {
            let (producer, job, payloads) = (producer.clone(), job.clone(), payloads.clone());
            tasks.push(tokio::spawn(async move {
                for work in payloads.iter().skip(t).step_by(TASKS) {
                    producer.dispatch(&job).send(work).await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    }

    pub(crate) async fn dispatch_batch(
        producer: Producer,
        job: Job<Work>,
        payloads: Arc<Vec<Work>>,
    ) {
        for result in producer.dispatch(&job).send_batch(&payloads).await {
            result.unwrap();
        }
    }
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let raw = on_worker(&rt, raw_clients());
    let admin = Arc::new(on_worker(&rt, connect()));
    {
        let client = admin.clone();
        on_worker(&rt, async move { raw_setup(&client).await });
    }
    let pool = on_worker(&rt, async move {
        let pool = PgPool::connect(&url()).await.unwrap();
        PostgresStorage::setup(&pool).await.unwrap();
        pool
    });

    let n = size(20_000);
    let consume_bodies = Arc::new(bodies(n));
    let work = format!("consume {n} no-op jobs, concurrency 64");

    {
        let driver = {
            let client = admin.clone();
            on_worker(&rt, async move { facade::driver(&client).await })
        };
        let facade_queue = "bench-facade";
        let name = |baseline: &str| format!("{work} vs {baseline}");

        let baseline = "tokio-postgres loop, SKIP LOCKED claims, DELETE per job";
        if selected(&name(baseline)) {
            Comparison::new(BENCH, &work, baseline, n)
                .target(1.1)
                .run(
                    |_| raw_consume(&rt, &raw, &consume_bodies),
                    |_| facade::consume(&rt, &driver, &admin, facade_queue, n),
                )
                .report();
        }
        let baseline = "apalis-postgres 1.0, concurrency 64, batch 64";
        if selected(&name(baseline)) {
            Comparison::new(BENCH, &work, baseline, n)
                .target(0.8)
                .run(
                    |_| apalis_consume(&rt, &pool, &admin, n),
                    |_| facade::consume(&rt, &driver, &admin, facade_queue, n),
                )
                .report();
        }

        let n = size(5_000);
        let payloads = Arc::new(payloads(n));
        let encoded = Arc::new(bodies(n));
        let dispatch_queue = "bench-dispatch".to_string();
        let job = jobrail_bench::work::job(&dispatch_queue);
        let producer = jobrail_native::Producer::new(Arc::new(driver.clone()));
        let clear = |rt: &tokio::runtime::Runtime| {
            let client = admin.clone();
            on_worker(rt, async move {
                raw_truncate(&client).await;
                facade_truncate(&client).await;
            });
        };
        let work = format!("dispatch {n} committed jobs");
        let baseline = "one raw multi-row INSERT (unnest)";
        if selected(&format!("{work} batch vs {baseline}")) {
            Comparison::new(BENCH, &format!("{work}, `dispatch_batch`"), baseline, n)
                .run(
                    |_| {
                        let (client, queue, bodies) =
                            (raw.claimer.clone(), dispatch_queue.clone(), encoded.clone());
                        let took = time_on_worker(&rt, raw_insert_batch(client, queue, bodies));
                        clear(&rt);
                        took
                    },
                    |_| {
                        let (producer, job, payloads) =
                            (producer.clone(), job.clone(), payloads.clone());
                        let took =
                            time_on_worker(&rt, facade::dispatch_batch(producer, job, payloads));
                        clear(&rt);
                        took
                    },
                )
                .report();
        }
        let baseline = "raw INSERTs from 32 tasks, each awaited";
        if selected(&format!("{work} from 32 tasks vs {baseline}")) {
            Comparison::new(
                BENCH,
                &format!("{work}, `dispatch` from 32 tasks"),
                baseline,
                n,
            )
            .run(
                |_| {
                    let (ackers, queue, bodies) =
                        (raw.ackers.clone(), dispatch_queue.clone(), encoded.clone());
                    let took = time_on_worker(&rt, raw_insert_from_tasks(ackers, queue, bodies));
                    clear(&rt);
                    took
                },
                |_| {
                    let (producer, job, payloads) =
                        (producer.clone(), job.clone(), payloads.clone());
                    let took =
                        time_on_worker(&rt, facade::dispatch_from_tasks(producer, job, payloads));
                    clear(&rt);
                    took
                },
            )
            .report();
        }
        on_worker(&rt, async move {
            jobrail_native::Driver::stop(&driver).await.unwrap();
        });
    }

    // Clean up: the raw table, the facade's schema, apalis's pool.
    on_worker(&rt, async move {
        let _ = admin
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {RAW_TABLE}; DROP SCHEMA IF EXISTS {FACADE_SCHEMA} CASCADE"
            ))
            .await;
        pool.close().await;
    });
}
