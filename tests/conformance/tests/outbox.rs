//! The transactional outbox on Postgres (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`) and its relay, publishing to
//! the memory driver and, with their features, to RabbitMQ
//! (`RABBITMQ_URL`) and NATS (`NATS_URL`): committed jobs run, rolled-back
//! ones never exist, a relay killed between the broker's confirm and its
//! mark sends again (at least once, same message id), two relays share a
//! table without sending a row twice, refusals are recorded on the row.
//!
//! Each test has its own table and queues, and drops its tables at the end.
//!
//! Run with `cargo test -p jobrail-conformance --features postgres,rabbitmq --test outbox`.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{Job, JobContext, Registry};
use jobrail_conformance::scenarios::Work;
use jobrail_native::{
    Capabilities, Consumer, DispatchOptions, Driver, DriverError, ErrorKind, MemoryDriver,
    Outgoing, Producer, Subscription,
};
use jobrail_postgres::{Outbox, OutboxError, OutboxRelay, PgConnect, RelayPass};
use tokio::time::Instant;
use tokio_postgres::Client;

const MS: fn(u64) -> Duration = Duration::from_millis;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// How the relays connect: `DATABASE_URL`.
fn pg_connect() -> PgConnect {
    PgConnect::new(&database_url()).expect("DATABASE_URL parses")
}

/// A connection of the test's own.
async fn pg() -> Client {
    let (client, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Postgres at DATABASE_URL: {e}"));
    tokio::spawn(connection);
    client
}

/// `tag` with a random suffix: a name no other run uses.
fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let random = std::hash::RandomState::new().hash_one((nanos, std::process::id()));
    format!("{tag}_{:012x}", random & 0xffff_ffff_ffff)
}

/// An installed outbox table and a business table (`<name>_orders`),
/// both dropped when the test ends.
struct Tables {
    outbox: Outbox,
    orders: String,
}

impl Tables {
    async fn new(client: &Client, tag: &str) -> Self {
        let outbox = Outbox::with_table(unique(tag)).unwrap();
        outbox.install(client).await.unwrap();
        outbox.install(client).await.expect("install is idempotent");
        let orders = format!("{}_orders", outbox.table());
        client
            .batch_execute(&format!("CREATE TABLE {orders} (id integer PRIMARY KEY)"))
            .await
            .unwrap();
        Tables { outbox, orders }
    }

    fn name(&self) -> &str {
        self.outbox.table()
    }
}

impl Drop for Tables {
    fn drop(&mut self) {
        let sql = format!(
            "DROP TABLE IF EXISTS {}, {}",
            self.outbox.table(),
            self.orders
        );
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                if let Ok((client, connection)) =
                    tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await
                {
                    tokio::spawn(connection);
                    let _ = client.batch_execute(&sql).await;
                }
            })
        });
    }
}

/// One outbox row, as the test sees it.
#[derive(Debug, Clone)]
struct RowState {
    message_id: String,
    sent: bool,
    attempts: i32,
    last_error: Option<String>,
    /// Whether the row waits for a retry (`retry_at` in the future).
    waiting: bool,
}

async fn rows(client: &Client, table: &str) -> Vec<RowState> {
    client
        .query(
            &format!(
                "SELECT message_id, sent_at IS NOT NULL, attempts, last_error, \
                        coalesce(retry_at > clock_timestamp(), false) \
                 FROM {table} ORDER BY id"
            ),
            &[],
        )
        .await
        .unwrap()
        .into_iter()
        .map(|row| RowState {
            message_id: row.get(0),
            sent: row.get(1),
            attempts: row.get(2),
            last_error: row.get(3),
            waiting: row.get(4),
        })
        .collect()
}

async fn unsent(client: &Client, table: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE sent_at IS NULL"),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

fn work_job(queue: &str) -> Job<Work> {
    Job::<Work>::builder("outbox-work")
        .queue(queue)
        .build()
        .unwrap()
}

/// `(message id, work id)` of every run of the handler.
type Seen = Arc<Mutex<Vec<(String, u32)>>>;

/// A registry for `job` whose handler records each run.
fn recording(job: &Job<Work>) -> (Registry, Seen) {
    let seen: Seen = Arc::default();
    let mut registry = Registry::new();
    let record = seen.clone();
    registry
        .register(job, move |ctx: JobContext, work: Work| {
            let record = record.clone();
            async move {
                record
                    .lock()
                    .unwrap()
                    .push((ctx.message_id().to_owned(), work.id));
                Ok(())
            }
        })
        .unwrap();
    (registry, seen)
}

/// Waits until `seen` holds `count` runs (or panics after `bound`).
async fn wait_for_runs(seen: &Seen, count: usize, bound: Duration) {
    let deadline = Instant::now() + bound;
    while seen.lock().unwrap().len() < count {
        assert!(
            Instant::now() < deadline,
            "{} runs of {count} after {bound:?}",
            seen.lock().unwrap().len()
        );
        tokio::time::sleep(MS(20)).await;
    }
}

/// The memory driver, with what a test needs to watch or disturb: a size
/// limit, a pause in each batch (a slow broker), an answer of "may have
/// been accepted" for bodies holding `uncertain`, and a record of every
/// message it stored.
struct Probe {
    inner: MemoryDriver,
    limit: Option<usize>,
    pause: Duration,
    stored: Mutex<Vec<(String, Option<Duration>)>>,
}

impl Probe {
    fn new(limit: Option<usize>, pause: Duration) -> Arc<Self> {
        Arc::new(Probe {
            inner: MemoryDriver::default(),
            limit,
            pause,
            stored: Mutex::default(),
        })
    }

    fn stored_ids(&self) -> Vec<String> {
        self.stored
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect()
    }

    async fn store(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        if message.body.windows(9).any(|w| w == b"uncertain") {
            return Err(DriverError::new(
                "memory",
                ErrorKind::Uncertain,
                "the confirm never came (probe)",
            ));
        }
        let record = (message.id.clone(), message.delay);
        self.inner.send(queue, message).await?;
        self.stored.lock().unwrap().push(record);
        Ok(())
    }
}

#[async_trait]
impl Driver for Probe {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn capabilities(&self) -> Capabilities {
        let mut capabilities = self.inner.capabilities();
        capabilities.max_message_bytes = self.limit;
        capabilities
    }
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        tokio::time::sleep(self.pause).await;
        self.store(queue, message).await
    }
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        tokio::time::sleep(self.pause).await;
        let mut results = Vec::with_capacity(messages.len());
        for message in messages {
            results.push(self.store(queue, message).await);
        }
        results
    }
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.subscribe(queue, prefetch).await
    }
    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stop().await
    }
}

/// Jobs dispatched in a committed transaction, beside a business change,
/// reach `driver`'s queue through a running relay and each runs once; the
/// relay's later passes send nothing again.
async fn committed_jobs_run_once(driver: Arc<dyn Driver>, queue: &str) {
    let mut client = pg().await;
    let tables = Tables::new(&client, "outbox_commit").await;
    let job = work_job(queue);

    let tx = client.transaction().await.unwrap();
    let mut dispatched = Vec::new();
    for id in 1..=5u32 {
        tx.execute(
            &format!("INSERT INTO {} (id) VALUES ($1)", tables.orders),
            &[&(id as i32)],
        )
        .await
        .unwrap();
        dispatched.push(
            tables
                .outbox
                .dispatch(&tx, &job, &Work { id })
                .await
                .unwrap(),
        );
    }
    tx.commit().await.unwrap();
    let before = rows(&client, tables.name()).await;
    assert_eq!(
        before.iter().map(|r| &r.message_id).collect::<Vec<_>>(),
        dispatched.iter().collect::<Vec<_>>(),
        "one row per dispatch, in order"
    );
    assert!(before.iter().all(|r| !r.sent && r.attempts == 0));

    let relay = Arc::new(
        OutboxRelay::new(
            &pg_connect(),
            tables.outbox.clone(),
            Producer::new(driver.clone()),
        )
        .poll_interval(MS(50)),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let relay = relay.clone();
        async move {
            relay
                .run(async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    let (registry, seen) = recording(&job);
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    wait_for_runs(&seen, 5, Duration::from_secs(20)).await;
    // Several more passes of the relay: nothing is sent twice.
    tokio::time::sleep(MS(400)).await;
    let _ = stop.send(());
    running.await.unwrap();
    consumer.shutdown().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    let ids: BTreeSet<&String> = seen.iter().map(|(id, _)| id).collect();
    assert_eq!(seen.len(), 5, "each job ran once: {seen:?}");
    assert_eq!(ids, dispatched.iter().collect(), "under the dispatched ids");
    let works: BTreeSet<u32> = seen.iter().map(|(_, w)| *w).collect();
    assert_eq!(works, (1..=5).collect());
    let after = rows(&client, tables.name()).await;
    assert!(
        after
            .iter()
            .all(|r| r.sent && r.attempts == 1 && r.last_error.is_none()),
        "{after:?}"
    );
    driver.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_jobs_run_once_on_memory() {
    committed_jobs_run_once(Arc::new(MemoryDriver::default()), "outbox-commit").await;
}

#[cfg(feature = "rabbitmq")]
fn rabbitmq_url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A fixture on RabbitMQ that deletes its queues at the end.
#[cfg(feature = "rabbitmq")]
fn rabbitmq() -> jobrail_conformance::Fixture<jobrail_conformance::fixture::RabbitMq> {
    let mut config = jobrail_native::rabbitmq::RabbitConfig::new(rabbitmq_url());
    config.connection_name = "conformance-outbox".into();
    jobrail_conformance::Fixture::new(config)
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_jobs_run_once_on_rabbitmq() {
    let backend = rabbitmq();
    let queue = unique("outbox-commit");
    backend.delete_later(&queue);
    committed_jobs_run_once(Arc::new(backend.driver().await), &queue).await;
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_jobs_run_once_on_nats() {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let backend = jobrail_conformance::Fixture::<jobrail_conformance::fixture::Nats>::new(
        jobrail_native::nats::NatsConfig::new(url),
    );
    let queue = unique("outbox-commit");
    committed_jobs_run_once(Arc::new(backend.driver().await), &queue).await;
}

/// A rolled-back transaction leaves no row and no message: the relay's
/// passes find only what was committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_dispatches_nothing() {
    let mut client = pg().await;
    let tables = Tables::new(&client, "outbox_rollback").await;
    let driver = Arc::new(MemoryDriver::default());
    let job = work_job("outbox-rollback");

    let tx = client.transaction().await.unwrap();
    for id in 1..=3u32 {
        tx.execute(
            &format!("INSERT INTO {} (id) VALUES ($1)", tables.orders),
            &[&(id as i32)],
        )
        .await
        .unwrap();
        tables
            .outbox
            .dispatch(&tx, &job, &Work { id })
            .await
            .unwrap();
    }
    tx.rollback().await.unwrap();

    let relay = OutboxRelay::with_client(
        pg().await,
        tables.outbox.clone(),
        Producer::new(driver.clone()),
    );
    assert_eq!(relay.run_once().await.unwrap(), RelayPass::default());
    assert_eq!(driver.depth("outbox-rollback"), 0);
    assert!(rows(&client, tables.name()).await.is_empty());

    // The same relay publishes what is committed (a client in autocommit).
    let kept = tables
        .outbox
        .dispatch(&client, &job, &Work { id: 9 })
        .await
        .unwrap();
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed, pass.more), (1, 0, false));
    assert_eq!(driver.depth("outbox-rollback"), 1);
    let after = rows(&client, tables.name()).await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].message_id, kept);
    assert!(after[0].sent);
    let orders: i64 = client
        .query_one(&format!("SELECT count(*) FROM {}", tables.orders), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 0, "the business change rolled back with the jobs");
}

/// A relay killed after the broker confirmed its batch and before it
/// marked the rows: the rows stay unsent, the next relay sends them again
/// under the same message ids and marks them, and the consumer sees each
/// message twice (at least once, nothing lost, nothing left unsent).
#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_send_and_mark_sends_again() {
    let backend = rabbitmq();
    let queue = unique("outbox-crash");
    backend.delete_later(&queue);
    let driver = backend.driver().await;
    let client = pg().await;
    let tables = Tables::new(&client, "outbox_crash").await;
    let job = work_job(&queue);
    let mut dispatched = Vec::new();
    for id in 1..=4u32 {
        dispatched.push(
            tables
                .outbox
                .dispatch(&client, &job, &Work { id })
                .await
                .unwrap(),
        );
    }

    let mut crash = std::process::Command::new(env!("CARGO_BIN_EXE_outbox_relay_crash"));
    crash
        .args(["rabbitmq", tables.name()])
        .env("DATABASE_URL", database_url())
        .env("RABBITMQ_URL", rabbitmq_url())
        .stderr(std::process::Stdio::inherit());
    let output = tokio::task::spawn_blocking(move || crash.output().expect("run the crash relay"))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success() && stdout.contains("confirmed 4"),
        "the relay died after the confirm: {:?} {stdout}",
        output.status
    );
    let left = rows(&client, tables.name()).await;
    assert!(
        left.iter().all(|r| !r.sent && r.attempts == 0),
        "the marks rolled back: {left:?}"
    );
    assert_eq!(
        driver.ready_count(&queue).await.unwrap(),
        4,
        "the broker holds the first copies"
    );

    // The next relay: the dead session's locks go with it, perhaps only
    // after a moment; SKIP LOCKED passes over them until then.
    let relay = OutboxRelay::new(
        &pg_connect(),
        tables.outbox.clone(),
        Producer::new(Arc::new(driver.clone())),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sent = 0;
    while sent < 4 {
        assert!(Instant::now() < deadline, "{sent} of 4 sent again");
        let pass = relay.run_once().await.unwrap();
        assert_eq!(pass.failed, 0);
        sent += pass.sent;
        if sent < 4 {
            tokio::time::sleep(MS(100)).await;
        }
    }
    assert_eq!(sent, 4);
    assert_eq!(relay.run_once().await.unwrap(), RelayPass::default());
    let marked = rows(&client, tables.name()).await;
    assert!(
        marked.iter().all(|r| r.sent && r.attempts == 1),
        "{marked:?}"
    );

    let (registry, seen) = recording(&job);
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .build()
        .spawn();
    wait_for_runs(&seen, 8, Duration::from_secs(20)).await;
    tokio::time::sleep(MS(300)).await;
    consumer.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    let mut copies: BTreeMap<&String, usize> = BTreeMap::new();
    for (id, _) in &seen {
        *copies.entry(id).or_default() += 1;
    }
    assert_eq!(seen.len(), 8, "{seen:?}");
    assert_eq!(
        copies.keys().copied().collect::<BTreeSet<_>>(),
        dispatched.iter().collect()
    );
    assert!(
        copies.values().all(|n| *n == 2),
        "each id twice: {copies:?}"
    );
    assert_eq!(driver.ready_count(&queue).await.unwrap(), 0);
}

/// Two relays on one table at once, on a slow broker (each batch takes a
/// while, so their passes overlap): every row is sent exactly once, and
/// both relays send some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_send_each_row_once() {
    let client = pg().await;
    let tables = Tables::new(&client, "outbox_two").await;
    let probe = Probe::new(None, MS(20));
    let job = work_job("outbox-two");
    let mut dispatched = Vec::new();
    for id in 1..=120u32 {
        dispatched.push(
            tables
                .outbox
                .dispatch(&client, &job, &Work { id })
                .await
                .unwrap(),
        );
    }

    let drive = |relay: OutboxRelay| {
        let table = tables.name().to_owned();
        tokio::spawn(async move {
            let watch = pg().await;
            let mut sent = 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let pass = relay.run_once().await.unwrap();
                assert_eq!(pass.failed, 0);
                sent += pass.sent;
                if pass.sent == 0 {
                    if unsent(&watch, &table).await == 0 {
                        return sent;
                    }
                    assert!(Instant::now() < deadline, "rows left unsent");
                    tokio::time::sleep(MS(5)).await;
                }
            }
        })
    };
    let relay = |probe: &Arc<Probe>| {
        OutboxRelay::new(
            &pg_connect(),
            tables.outbox.clone(),
            Producer::new(probe.clone()),
        )
        .batch_size(10)
    };
    let first = drive(relay(&probe));
    let second = drive(relay(&probe));
    let (first, second) = (first.await.unwrap(), second.await.unwrap());

    assert_eq!(first + second, 120, "{first} + {second}");
    assert!(
        first > 0 && second > 0,
        "both relays sent: {first}, {second}"
    );
    let mut stored = probe.stored_ids();
    stored.sort();
    dispatched.sort();
    assert_eq!(stored, dispatched, "every row once, none twice");
    assert_eq!(probe.inner.depth("outbox-two"), 120);
    assert_eq!(unsent(&client, tables.name()).await, 0);
}

/// A payload that does not encode is refused at dispatch: nothing is
/// written, and the caller's transaction goes on unharmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encode_failure_is_refused_at_dispatch() {
    let mut client = pg().await;
    let tables = Tables::new(&client, "outbox_encode").await;
    let pairs = Job::<BTreeMap<(u8, u8), u8>>::builder("pairs")
        .queue("outbox-encode")
        .build()
        .unwrap();

    let tx = client.transaction().await.unwrap();
    tx.execute(
        &format!("INSERT INTO {} (id) VALUES (1)", tables.orders),
        &[],
    )
    .await
    .unwrap();
    let refused = tables
        .outbox
        .dispatch(&tx, &pairs, &BTreeMap::from([((1, 2), 3)]))
        .await;
    assert!(
        matches!(refused, Err(OutboxError::Encode(_))),
        "{refused:?}"
    );
    tables
        .outbox
        .dispatch(&tx, &pairs, &BTreeMap::new())
        .await
        .expect("an empty map encodes");
    tx.commit().await.expect("the transaction is still good");
    assert_eq!(rows(&client, tables.name()).await.len(), 1);
}

/// What the broker does not accept stays in the table: a message over the
/// size limit (certainly not accepted) and one whose confirm never came
/// (perhaps accepted) are left unsent with the attempt and the error
/// recorded, wait before their next attempt without holding up the rows
/// behind them, and are tried again; purging removes only sent rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_rows_stay_unsent_with_their_error() {
    let client = pg().await;
    let tables = Tables::new(&client, "outbox_refused").await;
    let probe = Probe::new(Some(400), Duration::ZERO);
    let queue = "outbox-refused";
    let work = work_job(queue);
    let note = Job::<String>::builder("note").queue(queue).build().unwrap();
    let big = tables
        .outbox
        .dispatch(&client, &note, &"x".repeat(1000))
        .await
        .unwrap();
    let flaky = tables
        .outbox
        .dispatch(&client, &note, &"uncertain".to_owned())
        .await
        .unwrap();
    let small = tables
        .outbox
        .dispatch(&client, &work, &Work { id: 1 })
        .await
        .unwrap();

    let relay = OutboxRelay::new(
        &pg_connect(),
        tables.outbox.clone(),
        Producer::new(probe.clone()),
    )
    .retry_wait(MS(500), MS(500));
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed), (1, 2), "{pass:?}");
    assert_eq!(probe.stored_ids(), vec![small.clone()]);
    let state = rows(&client, tables.name()).await;
    let by_id = |id: &str| state.iter().find(|r| r.message_id == id).unwrap().clone();
    let (big_row, flaky_row, small_row) = (by_id(&big), by_id(&flaky), by_id(&small));
    assert!(small_row.sent && small_row.last_error.is_none());
    for (row, says) in [(&big_row, "limit"), (&flaky_row, "confirm never came")] {
        assert!(!row.sent && row.attempts == 1 && row.waiting, "{row:?}");
        let error = row.last_error.as_deref().unwrap_or_default();
        assert!(error.contains(says), "{error}");
    }

    // Waiting: the next pass passes over them; a new row goes ahead.
    let later = tables
        .outbox
        .dispatch(&client, &work, &Work { id: 2 })
        .await
        .unwrap();
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed), (1, 0), "{pass:?}");
    assert_eq!(probe.stored_ids(), vec![small.clone(), later]);

    tokio::time::sleep(MS(600)).await;
    let pass = relay.run_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed), (0, 2), "{pass:?}");
    let state = rows(&client, tables.name()).await;
    let refused: Vec<&RowState> = state.iter().filter(|r| !r.sent).collect();
    assert_eq!(refused.len(), 2);
    assert!(refused.iter().all(|r| r.attempts == 2), "{refused:?}");

    assert_eq!(relay.purge_sent(Duration::ZERO).await.unwrap(), 2);
    let left: BTreeSet<String> = rows(&client, tables.name())
        .await
        .into_iter()
        .map(|r| r.message_id)
        .collect();
    assert_eq!(left, BTreeSet::from([big, flaky]), "unsent rows are kept");
}

/// A delay counts from the dispatch: the relay hands the broker what is
/// left of it; a job without one is sent without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_counts_from_the_dispatch() {
    let client = pg().await;
    let tables = Tables::new(&client, "outbox_delay").await;
    let probe = Probe::new(None, Duration::ZERO);
    let job = work_job("outbox-delay");
    let delayed = tables
        .outbox
        .dispatch_with(
            &client,
            &job,
            &Work { id: 1 },
            DispatchOptions {
                delay: Some(Duration::from_secs(10)),
                ..DispatchOptions::default()
            },
        )
        .await
        .unwrap();
    let now = tables
        .outbox
        .dispatch(&client, &job, &Work { id: 2 })
        .await
        .unwrap();
    tokio::time::sleep(MS(600)).await;
    let relay = OutboxRelay::new(
        &pg_connect(),
        tables.outbox.clone(),
        Producer::new(probe.clone()),
    );
    assert_eq!(relay.run_once().await.unwrap().sent, 2);
    let stored: BTreeMap<String, Option<Duration>> =
        probe.stored.lock().unwrap().iter().cloned().collect();
    assert_eq!(stored[&now], None);
    let left = stored[&delayed].expect("the delay is passed on");
    assert!(
        left >= Duration::from_secs(8) && left <= MS(9_450),
        "10 s less the 600 ms since the dispatch: {left:?}"
    );
    assert_eq!(
        probe.inner.ready("outbox-delay"),
        1,
        "the delayed one waits"
    );
}

/// A running relay whose database connection is cut (its session
/// terminated) logs the failed pass, reconnects and publishes what was
/// committed meanwhile; nothing is lost, nothing is sent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_reconnects_after_losing_its_connection() {
    let client = pg().await;
    let tables = Tables::new(&client, "outbox_reconnect").await;
    let probe = Probe::new(None, Duration::ZERO);
    let job = work_job("outbox-reconnect");
    let name = unique("relay");
    let url = format!(
        "{}{}application_name={name}",
        database_url(),
        if database_url().contains('?') {
            '&'
        } else {
            '?'
        }
    );
    let relay = Arc::new(
        OutboxRelay::new(
            &PgConnect::new(&url).unwrap(),
            tables.outbox.clone(),
            Producer::new(probe.clone()),
        )
        .poll_interval(MS(20)),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let relay = relay.clone();
        async move {
            relay
                .run(async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    let first = tables
        .outbox
        .dispatch(&client, &job, &Work { id: 1 })
        .await
        .unwrap();
    let wait_sent = |count: usize| {
        let probe = probe.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while probe.stored_ids().len() < count {
                assert!(Instant::now() < deadline, "{count} not sent");
                tokio::time::sleep(MS(20)).await;
            }
        }
    };
    wait_sent(1).await;
    // Cut the connection only once the mark is committed: cut between the
    // send and the mark, the row would rightly be sent again.
    let deadline = Instant::now() + Duration::from_secs(20);
    while unsent(&client, tables.name()).await > 0 {
        assert!(Instant::now() < deadline, "the first row is never marked");
        tokio::time::sleep(MS(10)).await;
    }

    let terminated: i64 = client
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1) AS t",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(terminated, 1, "the relay's session");
    let second = tables
        .outbox
        .dispatch(&client, &job, &Work { id: 2 })
        .await
        .unwrap();
    wait_sent(2).await;
    tokio::time::sleep(MS(200)).await;
    let _ = stop.send(());
    running.await.unwrap();

    assert_eq!(probe.stored_ids(), vec![first, second], "each once");
    assert_eq!(unsent(&client, tables.name()).await, 0);
}

/// Processes installing the same table at once all succeed (the install
/// takes an advisory lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_installs_agree() {
    let client = pg().await;
    for _ in 0..3 {
        let outbox = Outbox::with_table(unique("outbox_install")).unwrap();
        let mut installs = Vec::new();
        for _ in 0..4 {
            let outbox = outbox.clone();
            installs.push(tokio::spawn(async move {
                let client = pg().await;
                outbox.install(&client).await
            }));
        }
        for install in installs {
            let result = install.await.unwrap();
            assert!(result.is_ok(), "{result:?}");
        }
        client
            .batch_execute(&format!("DROP TABLE {}", outbox.table()))
            .await
            .unwrap();
    }
}
