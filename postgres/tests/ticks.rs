//! Schedules on Postgres: a scheduler that stops right after sending a
//! tick's job, before recording the tick fired (as a kill there would),
//! leaves the tick unrecorded, and another scheduler sends it again when
//! its lease ends; with [`PgTicks`] the job and the record commit together
//! and the tick is sent once. Needs Postgres at `DATABASE_URL` (default
//! postgres://postgres@127.0.0.1:5432/test); skipped, loudly, when it is
//! not reachable and `CI` is not set.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::testing::StopBeforeRecord;
use jobrail::{Job, JobContext, Missed, Registry, Schedule, Tick};
use jobrail_native::{Consumer, Driver, Producer, Scheduler};
use jobrail_postgres::{PgClaims, PgConfig, PgDriver, PgTicks};

fn url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Runs a scheduler on a claim store stuck before its records (with or
/// without a [`PgTicks`] sink) until a tick's job ran, stops it, runs a
/// healthy scheduler past the tick lease, and answers how many times each
/// tick's job ran (`None`: Postgres is not reachable, outside CI).
async fn runs_per_tick(sink: bool) -> Option<BTreeMap<i64, usize>> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("info")
        .with_test_writer()
        .try_init();
    let schema = format!(
        "ticks_test_{}_{}_{}",
        std::process::id(),
        sink,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    );
    let mut config = PgConfig::new(&url()).unwrap().schema(&schema);
    config.poll_interval = Duration::from_millis(100);
    if let Err(e) = PgDriver::install(&config).await {
        if std::env::var_os("CI").is_none() {
            eprintln!("SKIPPED: Postgres not reachable at {}: {e}", url());
            return None;
        }
        panic!("Postgres not reachable: {e}");
    }
    let driver = PgDriver::connect(config).await.unwrap();
    let claims = PgClaims::connect_with_table(&url(), &format!("{schema}.claims"))
        .await
        .unwrap();
    let job = Job::<String>::builder("tick")
        .queue("ticks")
        .build()
        .unwrap();
    let schedule = Schedule::builder("every-second", &job, "* * * * * *")
        .missed(Missed::Each(10))
        .lease(Duration::from_secs(1))
        .payload_fn(|tick: &Tick| tick.rfc3339())
        .build()
        .unwrap();

    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut registry = Registry::new();
    let seen = runs.clone();
    registry
        .register(&job, move |_ctx: JobContext, tick: String| {
            seen.lock().unwrap().push(tick);
            async { Ok(()) }
        })
        .unwrap();
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .build()
        .spawn();

    let producer = Producer::new(Arc::new(driver.clone()));
    let mut stuck = Scheduler::builder(
        producer.clone(),
        Arc::new(StopBeforeRecord::new(
            claims.clone(),
            &schedule,
            Tick::at(std::time::SystemTime::now()),
        )),
    )
    .schedule(schedule.clone())
    .poll(Duration::from_millis(100));
    if sink {
        stuck = stuck.sink(Arc::new(PgTicks::new(driver.clone(), claims.clone())));
    }
    let stuck = stuck.build().unwrap().spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while runs.lock().unwrap().is_empty() {
        if tokio::time::Instant::now() >= deadline {
            let (client, conn) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let jobs = client
                .query_one(&format!("SELECT count(*) FROM \"{schema}\".jobs"), &[])
                .await
                .map(|row| row.get::<_, i64>(0));
            panic!("no tick ran in 10 s (jobs in the queue: {jobs:?})");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stuck.abort();
    let healthy = Scheduler::builder(producer, Arc::new(claims))
        .schedule(schedule)
        .poll(Duration::from_millis(100))
        .build()
        .unwrap()
        .spawn();
    // Past the tick lease, and a poll.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    healthy.shutdown().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    consumer.shutdown().await.unwrap();
    driver.stop().await.unwrap();

    let mut per_tick = BTreeMap::new();
    for tick in runs.lock().unwrap().iter() {
        let tick = Tick::parse(tick).expect("a tick").unix_seconds();
        *per_tick.entry(tick).or_insert(0) += 1;
    }
    if let Ok((client, conn)) = tokio_postgres::connect(&url(), tokio_postgres::NoTls).await {
        tokio::spawn(conn);
        let _ = client
            .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await;
    }
    Some(per_tick)
}

#[tokio::test]
async fn without_a_sink_a_scheduler_stopped_before_its_record_has_its_tick_sent_twice() {
    let Some(per_tick) = runs_per_tick(false).await else {
        return;
    };
    // The stuck scheduler sent its first tick and hung recording it; the
    // healthy one claimed that tick when the lease ended and sent it again.
    let first = *per_tick.keys().next().unwrap();
    assert_eq!(per_tick[&first], 2, "{per_tick:?}");
    assert!(
        per_tick.len() > 2,
        "the healthy scheduler fired: {per_tick:?}"
    );
}

#[tokio::test]
async fn with_pg_ticks_every_tick_is_sent_once_whoever_stops() {
    let Some(per_tick) = runs_per_tick(true).await else {
        return;
    };
    assert!(per_tick.len() > 2, "ticks fired: {per_tick:?}");
    let twice: Vec<_> = per_tick.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "ticks not run once: {twice:?} of {per_tick:?}"
    );
    // No tick missed between the first and the last.
    let (first, last) = (
        *per_tick.keys().next().unwrap(),
        *per_tick.keys().last().unwrap(),
    );
    assert_eq!(per_tick.len() as i64, last - first + 1, "{per_tick:?}");
}
