//! Postgres-queue behaviour beyond the shared suite, on the database at
//! `DATABASE_URL`: the schema is installed only on request and checked on
//! connect; a new job wakes an idle worker of another driver through
//! `NOTIFY`, not the poll; a dispatch in the caller's transaction exists
//! if and only if it commits; a completion in the handler's transaction
//! commits with the handler's writes, and is refused (so the writes roll
//! back) once the lease was taken over; a settlement whose lease was taken
//! over is refused and changes nothing.
//!
//! Run with `cargo test -p jobrail-conformance --features postgres --test postgres_extra`.
#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Job, JobContext, JobError, Registry, Settlement};
use jobrail_conformance::fixture::postgres_config;
use jobrail_conformance::harness::outgoing;
use jobrail_conformance::scenarios::Work;
use jobrail_native::{Consumer, Delivery, Driver, ErrorKind, Subscription};
use jobrail_postgres::tokio_postgres::{Client, NoTls};
use jobrail_postgres::{PgConfig, PgDriver, SCHEMA_VERSION};

fn url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

async fn client() -> Client {
    let (client, connection) = jobrail_postgres::tokio_postgres::connect(&url(), NoTls)
        .await
        .expect("Postgres at DATABASE_URL");
    tokio::spawn(connection);
    client
}

/// A schema of the test's own, dropped first.
async fn fresh_schema(client: &Client, name: &str) -> PgConfig {
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .await
        .unwrap();
    postgres_config(name)
}

async fn installed(client: &Client, name: &str) -> PgDriver {
    let config = fresh_schema(client, name).await;
    PgDriver::install(&config).await.unwrap();
    PgDriver::connect(config).await.unwrap()
}

async fn drop_schema(client: &Client, name: &str) {
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .await
        .unwrap();
}

async fn take(subscription: &mut Box<dyn Subscription>, within: Duration) -> Box<dyn Delivery> {
    tokio::time::timeout(within, subscription.next())
        .await
        .expect("a delivery in time")
        .expect("the subscription is open")
        .expect("a delivery")
}

async fn rows(client: &Client, schema: &str, queue: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM \"{schema}\".jobs WHERE queue = $1"),
            &[&queue],
        )
        .await
        .unwrap()
        .get(0)
}

/// `connect` refuses a schema that is not installed, naming the fix;
/// `install` reports what it found and changes nothing the second time;
/// a schema newer than the driver is refused by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_is_installed_on_request_and_checked_on_connect() {
    let admin = client().await;
    let schema = "pgx_install";
    let config = fresh_schema(&admin, schema).await;
    let err = PgDriver::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("PgDriver::install"), "{err}");
    assert!(
        err.to_string()
            .contains("jobrail --backend postgres install"),
        "{err}"
    );
    let exists: bool = admin
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!exists, "connect created nothing");

    assert_eq!(PgDriver::install(&config).await.unwrap(), 0, "found none");
    assert_eq!(
        PgDriver::install(&config).await.unwrap(),
        SCHEMA_VERSION,
        "current: nothing to do"
    );
    let driver = PgDriver::connect(config.clone()).await.unwrap();
    driver.stop().await.unwrap();

    admin
        .execute(
            &format!("INSERT INTO \"{schema}\".migrations (version) VALUES ($1)"),
            &[&(SCHEMA_VERSION + 1)],
        )
        .await
        .unwrap();
    for err in [
        PgDriver::connect(config.clone()).await.unwrap_err(),
        PgDriver::install(&config).await.unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.to_string().contains("newer than this driver"), "{err}");
    }
    drop_schema(&admin, schema).await;
}

/// With a poll interval of a minute, a job dispatched by another driver
/// (another worker process, say) reaches an idle subscription within
/// seconds: the notification woke it, not the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_job_wakes_an_idle_worker_of_another_driver() {
    let admin = client().await;
    let schema = "pgx_notify";
    let mut config = fresh_schema(&admin, schema).await;
    config.poll_interval = Duration::from_secs(60);
    PgDriver::install(&config).await.unwrap();
    let worker = PgDriver::connect(config.clone()).await.unwrap();
    let producer = PgDriver::connect(config).await.unwrap();
    let mut subscription = worker.subscribe("q", 4).await.unwrap();
    // The subscription's first fetch found nothing; it now waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    producer.send("q", outgoing("woken", None)).await.unwrap();
    let delivery = take(&mut subscription, Duration::from_secs(10)).await;
    assert_eq!(delivery.body(), outgoing("woken", None).body.as_slice());
    delivery.settle(&Settlement::Ack).await.unwrap();
    drop(subscription);
    worker.stop().await.unwrap();
    producer.stop().await.unwrap();
    drop_schema(&admin, schema).await;
}

/// `dispatch_in` inside a transaction that rolls back leaves no job; inside
/// one that commits, the job is delivered (and its commit's notification
/// wakes the worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_in_a_transaction_exists_only_if_it_commits() {
    let mut admin = client().await;
    let schema = "pgx_dispatch_in";
    let mut config = fresh_schema(&admin, schema).await;
    config.poll_interval = Duration::from_secs(60);
    PgDriver::install(&config).await.unwrap();
    let driver = PgDriver::connect(config).await.unwrap();
    let job = Job::<Work>::builder("in-tx").queue("tx").build().unwrap();
    let mut subscription = driver.subscribe("tx", 4).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let tx = admin.transaction().await.unwrap();
    driver
        .dispatch_in(&tx, &job, &Work { id: 1 })
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(rows(&admin, schema, "tx").await, 0, "rolled back: no job");

    let tx = admin.transaction().await.unwrap();
    let id = driver
        .dispatch_in(&tx, &job, &Work { id: 2 })
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), subscription.next())
            .await
            .is_err(),
        "nothing is delivered before the commit"
    );
    tx.commit().await.unwrap();
    let delivery = take(&mut subscription, Duration::from_secs(10)).await;
    let envelope = jobrail::Envelope::decode(delivery.body()).unwrap();
    assert_eq!(envelope.id, id);
    delivery.settle(&Settlement::Ack).await.unwrap();
    assert_eq!(rows(&admin, schema, "tx").await, 0);
    drop(subscription);
    driver.stop().await.unwrap();
    drop_schema(&admin, schema).await;
}

/// A handler that writes its effect and completes its delivery in one
/// transaction: the job is gone once the transaction commits and never
/// runs again, even though the handler then fails; a handler whose lease
/// was taken over before it completes is refused, rolls back, and leaves
/// no effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_in_the_handlers_transaction_commits_with_its_writes() {
    let admin = client().await;
    let schema = "pgx_complete_in";
    let driver = installed(&admin, schema).await;
    admin
        .batch_execute(&format!(
            "CREATE TABLE \"{schema}\".effects (job int PRIMARY KEY, attempt int NOT NULL)"
        ))
        .await
        .unwrap();
    let job = Job::<Work>::builder("effect")
        .queue("effects")
        .max_deliveries(5)
        .build()
        .unwrap();
    let db = Arc::new(tokio::sync::Mutex::new(client().await));
    let steal = Arc::new(client().await);
    let refused = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    {
        let (driver, db, steal, refused) =
            (driver.clone(), db.clone(), steal.clone(), refused.clone());
        registry
            .register(&job, move |ctx: JobContext, work: Work| {
                let (driver, db, steal, refused) =
                    (driver.clone(), db.clone(), steal.clone(), refused.clone());
                async move {
                    let mut client = db.lock().await;
                    let tx = client.transaction().await?;
                    tx.execute(
                        &format!("INSERT INTO \"{schema}\".effects VALUES ($1, $2)"),
                        &[&(work.id as i32), &(ctx.attempt() as i32)],
                    )
                    .await
                    ?;
                    if work.id == 2 && ctx.attempt() == 1 {
                        // Another worker takes the row over, as after an
                        // expired lease.
                        steal
                            .execute(
                                &format!(
                                    "UPDATE \"{schema}\".jobs SET lease = nextval('\"{schema}\".leases') \
                                     WHERE message_id = $1"
                                ),
                                &[&ctx.message_id()],
                            )
                            .await
                            ?;
                    }
                    match driver.complete_in(&tx, &ctx).await {
                        Ok(()) => {}
                        Err(err) => {
                            refused.lock().unwrap().push((work.id, err.kind()));
                            // Dropped: rolled back, with the effect.
                            return Err(JobError::new(err));
                        }
                    }
                    tx.commit().await?;
                    if work.id == 1 {
                        return Err(JobError::permanent("failing after the commit changes nothing"));
                    }
                    Ok(())
                }
            })
            .unwrap();
    }
    let producer = jobrail_native::Producer::new(Arc::new(driver.clone()));
    producer.dispatch(&job).send(&Work { id: 1 }).await.unwrap();
    producer.dispatch(&job).send(&Work { id: 2 }).await.unwrap();
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(1)
        .build()
        .spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let effects: i64 = admin
            .query_one(&format!("SELECT count(*) FROM \"{schema}\".effects"), &[])
            .await
            .unwrap()
            .get(0);
        if effects == 2 && rows(&admin, schema, "effects").await == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{effects} effects");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    consumer.shutdown().await.unwrap();
    let effects: Vec<(i32, i32)> = admin
        .query(
            &format!("SELECT job, attempt FROM \"{schema}\".effects ORDER BY job"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Job 1 once, at its first attempt, despite failing afterwards; job 2
    // once, at its second (the first was fenced and rolled back).
    assert_eq!(effects, [(1, 1), (2, 2)]);
    assert_eq!(*refused.lock().unwrap(), [(2, ErrorKind::NotAccepted)]);
    let failures: i64 = admin
        .query_one(&format!("SELECT count(*) FROM \"{schema}\".failures"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(failures, 0, "a completed job leaves no failure record");
    driver.stop().await.unwrap();
    drop_schema(&admin, schema).await;
}

/// A delivery whose row another delivery took over (its lease ended) has
/// each settlement refused, and the row stays as the new holder has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_after_the_lease_was_taken_over_is_refused() {
    let admin = client().await;
    let schema = "pgx_fenced";
    let driver = installed(&admin, schema).await;
    for (n, settlement) in [
        Settlement::Ack,
        Settlement::Reject,
        Settlement::Retry {
            delay: Some(Duration::ZERO),
            shutdown: false,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let queue = format!("fenced-{n}");
        driver.send(&queue, outgoing("x", None)).await.unwrap();
        let mut subscription = driver.subscribe(&queue, 1).await.unwrap();
        let delivery = take(&mut subscription, Duration::from_secs(10)).await;
        let lease: i64 = admin
            .query_one(
                &format!(
                    "UPDATE \"{schema}\".jobs SET lease = nextval('\"{schema}\".leases') \
                     WHERE queue = $1 RETURNING lease"
                ),
                &[&queue],
            )
            .await
            .unwrap()
            .get(0);
        let err = delivery.settle(&settlement).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
        assert!(err.to_string().contains("lease was taken over"), "{err}");
        let still: Option<i64> = admin
            .query_one(
                &format!("SELECT lease FROM \"{schema}\".jobs WHERE queue = $1"),
                &[&queue],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(still, Some(lease), "{} changed nothing", settlement.name());
        drop(subscription);
    }
    driver.stop().await.unwrap();
    drop_schema(&admin, schema).await;
}
