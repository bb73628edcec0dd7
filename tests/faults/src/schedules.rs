//! Schedulers under kills (`jobrail-faults schedules`): three schedulers on
//! one claim store fire a schedule every second while they are killed and
//! restarted at random; every tick must run its job once.
//!
//! Per store, at the same time:
//!
//! - **memory**: three [`Scheduler`]s in this process on one
//!   [`MemoryClaims`], sending to one [`MemoryDriver`]; a kill aborts a
//!   scheduler's task (no cleanup, as a process kill).
//! - **postgres** / **redis**: three worker processes (this executable with
//!   `schedule-worker`), each a [`Scheduler`] on [`PgClaims`] (a table of
//!   the run's own) or `RedisClaims` (a key prefix of the run's own); a
//!   kill is SIGKILL. On Postgres the jobs go to a Postgres queue
//!   ([`PgDriver`], a schema of the run's own) in the claims' database,
//!   and each tick's job and its record commit in one transaction
//!   (`PgTicks`). On Redis the jobs go to NATS (a stream of the run's
//!   own): the job is sent, then the claim completed, and a tick sent
//!   again by the scheduler that took it over from one killed between the
//!   two carries the same message id, which the stream's duplicate window
//!   drops.
//!
//! The orchestrator consumes each store's queue itself (never killed) and
//! records every execution's tick (`jobrail-tick`) and message id. Kills
//! come every 0.5–2 s: one random scheduler, restarted after 0–1.5 s; every
//! fifth kill takes all three down for 2.5 s, so that ticks come due while
//! no scheduler runs and the restart must fire them (`Missed::Each`). The
//! tick lease is 2 s, so a tick whose firer died is taken over 2 s later.
//!
//! After the kill window every scheduler is left to run 6 s, then stopped.
//! Every tick from the first fired to the end of the kill window must have
//! run exactly once: *missed* ticks (none) and *duplicated* ticks (none:
//! a tick run twice, or dispatched twice under two message ids) are
//! counted, with the latest a tick ran after its time.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use clap::{Args, ValueEnum};
use jobrail::{ClaimStore, Job, JobContext, MemoryClaims, Missed, Registry, Schedule, Tick};
use jobrail_native::{Consumer, Driver, MemoryDriver, Producer, Scheduler};

/// The claim stores the schedulers share.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    /// `jobrail::MemoryClaims`, three schedulers in one process.
    Memory,
    /// `jobrail_postgres::PgClaims`, three processes.
    Postgres,
    /// `jobrail_redis::RedisClaims`, three processes, the jobs on NATS.
    Redis,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Postgres => "postgres",
            Store::Redis => "redis",
        }
    }
}

/// `jobrail-faults schedules`.
#[derive(Args, Debug)]
pub(crate) struct SchedulesArgs {
    /// The claim stores, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "memory,postgres,redis")]
    store: Vec<Store>,
    /// Seconds of kills (a tick a second).
    #[arg(long, default_value_t = 66)]
    seconds: u64,
}

/// `jobrail-faults schedule-worker` (started by `schedules`).
#[derive(Args, Debug)]
pub(crate) struct ScheduleWorkerArgs {
    /// The claim store.
    #[arg(long)]
    store: Store,
    /// The run's id (names its table, key prefix, schema and queue).
    #[arg(long)]
    run: String,
}

/// The tick lease: how long a dead firer's tick waits for another.
const TICK_LEASE: Duration = Duration::from_secs(2);
/// How far back a restarted scheduler fires missed ticks.
const EACH: u32 = 30;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn job(run: &str, store: Store) -> Job<String> {
    Job::<String>::builder("tick")
        .queue(format!("ticks-{run}-{}", store.name()))
        .max_deliveries(5)
        .build()
        .expect("a valid job")
}

fn schedule(run: &str, store: Store) -> Schedule {
    Schedule::builder(
        format!("kill-{}", store.name()),
        &job(run, store),
        "* * * * * *",
    )
    .missed(Missed::Each(EACH))
    .lease(TICK_LEASE)
    .payload_fn(|tick: &Tick| tick.rfc3339())
    .build()
    .expect("a valid schedule")
}

fn database_url() -> String {
    crate::charge::database_url()
}

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The NATS driver of a run's Redis store: a stream prefix of its own.
async fn nats_driver(run: &str) -> Result<jobrail_native::nats::NatsDriver, Error> {
    let mut config = jobrail_native::nats::NatsConfig::new(nats_url());
    config.stream_prefix = format!("FSCHED{}", run.to_uppercase());
    config.subject_prefix = format!("fsched{run}");
    config.connection_name = "jobrail-faults-schedules".into();
    Ok(jobrail_native::nats::NatsDriver::connect(config).await?)
}

fn schema(run: &str) -> String {
    format!("faults_sched_{run}")
}

fn pg_config(run: &str) -> Result<jobrail_postgres::PgConfig, Error> {
    let mut config = jobrail_postgres::PgConfig::new(&database_url())?
        .schema(schema(run))
        .lease(Duration::from_secs(5));
    config.poll_interval = Duration::from_millis(500);
    Ok(config)
}

async fn claims(run: &str, store: Store) -> Result<Arc<dyn ClaimStore>, Error> {
    Ok(match store {
        Store::Memory => Arc::new(MemoryClaims::new()),
        Store::Postgres => Arc::new(pg_claims(run).await?),
        Store::Redis => Arc::new(
            jobrail_redis::RedisClaims::connect(&redis_url())
                .await?
                .with_prefix(format!("jobrail-faults:{run}:")),
        ),
    })
}

async fn pg_claims(run: &str) -> Result<jobrail_postgres::PgClaims, Error> {
    Ok(jobrail_postgres::PgClaims::connect_with_table(
        &database_url(),
        &format!("{}.claims", schema(run)),
    )
    .await?)
}

/// One scheduler process: fires the store's schedule until killed.
pub(crate) async fn worker(args: ScheduleWorkerArgs) -> Result<(), Error> {
    let claims = claims(&args.run, args.store).await?;
    let builder = if args.store == Store::Postgres {
        let driver = jobrail_postgres::PgDriver::connect(pg_config(&args.run)?).await?;
        // The claims and the queue share the database: each tick's job and
        // its record commit in one transaction.
        Scheduler::builder(Producer::new(Arc::new(driver.clone())), claims).sink(Arc::new(
            jobrail_postgres::PgTicks::new(driver, pg_claims(&args.run).await?),
        ))
    } else {
        Scheduler::builder(
            Producer::new(Arc::new(nats_driver(&args.run).await?)),
            claims,
        )
    };
    let builder = builder
        .schedule(schedule(&args.run, args.store))
        .poll(Duration::from_millis(250));
    let scheduler = builder.build()?;
    let cancel = jobrail::CancelToken::new();
    scheduler.run(cancel).await;
    Ok(())
}

/// Each execution: the tick, the message id, when it ran.
type Runs = Arc<Mutex<Vec<(String, String, SystemTime)>>>;

/// What one store's run found.
struct Found {
    store: Store,
    ticks: usize,
    missed: Vec<String>,
    duplicated: Vec<String>,
    kills: usize,
    outages: usize,
    latest: Duration,
}

/// Runs every store's test at once; prints the table; `Ok(false)` on a
/// missed or duplicated tick.
pub(crate) async fn run(args: SchedulesArgs) -> Result<bool, Error> {
    let run = format!("{:08x}", fastrand::u32(..));
    let needs_pg = args.store.iter().any(|s| *s != Store::Memory);
    if needs_pg {
        jobrail_postgres::PgDriver::install(&pg_config(&run)?).await?;
    }
    let window = Duration::from_secs(args.seconds);
    let tests = args.store.iter().map(|store| one(&run, *store, window));
    let results = futures_util::future::join_all(tests).await;
    if needs_pg {
        drop_schema(&run).await;
    }
    println!("\n| claim store | ticks in the window | missed | duplicated | kills | all down | latest run after its tick |");
    println!("|---|---|---|---|---|---|---|");
    let mut ok = true;
    for result in results {
        let found = result?;
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.2} s |",
            found.store.name(),
            found.ticks,
            found.missed.len(),
            found.duplicated.len(),
            found.kills,
            found.outages,
            found.latest.as_secs_f64()
        );
        if !found.missed.is_empty() {
            eprintln!("{}: missed ticks {:?}", found.store.name(), found.missed);
            ok = false;
        }
        if !found.duplicated.is_empty() {
            eprintln!(
                "{}: duplicated ticks {:?}",
                found.store.name(),
                found.duplicated
            );
            ok = false;
        }
        if found.ticks < 60 {
            eprintln!(
                "{}: only {} ticks in the window",
                found.store.name(),
                found.ticks
            );
            ok = false;
        }
    }
    Ok(ok)
}

async fn drop_schema(run: &str) {
    let Ok((client, connection)) = jobrail_postgres::tokio_postgres::connect(
        &database_url(),
        jobrail_postgres::tokio_postgres::NoTls,
    )
    .await
    else {
        return;
    };
    let task = tokio::spawn(connection);
    let _ = client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", schema(run)))
        .await;
    drop(client);
    let _ = task.await;
}

/// The schedulers of one store: tasks in this process, or processes.
enum Firers {
    Tasks {
        producer: Producer,
        claims: Arc<dyn ClaimStore>,
        handles: Vec<Option<jobrail_native::SchedulerHandle>>,
    },
    Processes(Vec<Option<Child>>),
}

impl Firers {
    fn start(&mut self, i: usize, run: &str, store: Store) -> Result<(), Error> {
        match self {
            Firers::Tasks {
                producer,
                claims,
                handles,
            } => {
                let scheduler = Scheduler::builder(producer.clone(), claims.clone())
                    .schedule(schedule(run, store))
                    .poll(Duration::from_millis(250))
                    .build()?;
                handles[i] = Some(scheduler.spawn());
            }
            Firers::Processes(children) => {
                let child = Command::new(std::env::current_exe()?)
                    .args(["schedule-worker", "--store", store.name(), "--run", run])
                    .env("RUST_LOG", "warn")
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()?;
                children[i] = Some(child);
            }
        }
        Ok(())
    }

    fn kill(&mut self, i: usize) {
        match self {
            Firers::Tasks { handles, .. } => {
                if let Some(handle) = handles[i].take() {
                    handle.abort();
                }
            }
            Firers::Processes(children) => {
                if let Some(mut child) = children[i].take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
    }

    fn is_up(&self, i: usize) -> bool {
        match self {
            Firers::Tasks { handles, .. } => handles[i].is_some(),
            Firers::Processes(children) => children[i].is_some(),
        }
    }

    async fn stop(&mut self) {
        match self {
            Firers::Tasks { handles, .. } => {
                for handle in handles.iter_mut() {
                    if let Some(handle) = handle.take() {
                        handle.shutdown().await;
                    }
                }
            }
            Firers::Processes(_) => {
                for i in 0..3 {
                    self.kill(i);
                }
            }
        }
    }
}

async fn one(run: &str, store: Store, window: Duration) -> Result<Found, Error> {
    let job = job(run, store);
    let mut nats = None;
    let driver: Arc<dyn Driver> = match store {
        Store::Memory => Arc::new(MemoryDriver::default()),
        Store::Postgres => Arc::new(jobrail_postgres::PgDriver::connect(pg_config(run)?).await?),
        Store::Redis => {
            let driver = nats_driver(run).await?;
            nats = Some(driver.clone());
            Arc::new(driver)
        }
    };
    let runs: Runs = Arc::default();
    let mut registry = Registry::new();
    let seen = runs.clone();
    registry.register(&job, move |ctx: JobContext, tick: String| {
        seen.lock()
            .unwrap()
            .push((tick, ctx.message_id().to_string(), SystemTime::now()));
        async { Ok(()) }
    })?;
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(4)
        .build()
        .spawn();
    let mut firers = match store {
        Store::Memory => Firers::Tasks {
            producer: Producer::new(driver.clone()),
            claims: claims(run, store).await?,
            handles: vec![None, None, None],
        },
        _ => {
            // The claims table exists before three processes race to it.
            drop(claims(run, store).await?);
            Firers::Processes(vec![None, None, None])
        }
    };
    for i in 0..3 {
        firers.start(i, run, store)?;
    }
    let started = SystemTime::now();
    let mut kills = 0;
    let mut outages = 0;
    let mut down: Vec<(usize, tokio::time::Instant)> = Vec::new();
    let end = tokio::time::Instant::now() + window;
    let mut next_kill =
        tokio::time::Instant::now() + Duration::from_millis(fastrand::u64(500..2000));
    while tokio::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = tokio::time::Instant::now();
        down.retain(|(i, at)| {
            if *at <= now {
                firers.start(*i, run, store).expect("a scheduler restarts");
                false
            } else {
                true
            }
        });
        if now >= next_kill {
            kills += 1;
            if kills % 5 == 0 {
                outages += 1;
                for i in 0..3 {
                    if firers.is_up(i) {
                        firers.kill(i);
                        down.push((i, now + Duration::from_millis(2500)));
                    }
                }
            } else {
                let up: Vec<usize> = (0..3).filter(|i| firers.is_up(*i)).collect();
                if let Some(&i) = up.get(fastrand::usize(..up.len().max(1))) {
                    firers.kill(i);
                    down.push((i, now + Duration::from_millis(fastrand::u64(0..1500))));
                }
            }
            next_kill = now + Duration::from_millis(fastrand::u64(500..2000));
        }
    }
    let window_end = SystemTime::now();
    for (i, _) in down.drain(..) {
        firers.start(i, run, store)?;
    }
    // Long enough for a tick taken at the very end to be taken over.
    tokio::time::sleep(TICK_LEASE * 3).await;
    firers.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    consumer.shutdown().await?;
    if let Some(nats) = &nats {
        // The run's stream, declared by the consumer and the schedulers.
        nats.delete_streams(&nats.declared_streams()).await?;
    }
    driver.stop().await?;

    let runs = runs.lock().unwrap().clone();
    let mut by_tick: BTreeMap<i64, Vec<(String, SystemTime)>> = BTreeMap::new();
    for (tick, id, at) in runs {
        let tick =
            Tick::parse(&tick).ok_or_else(|| format!("a payload that is no tick: {tick}"))?;
        by_tick
            .entry(tick.unix_seconds())
            .or_default()
            .push((id, at));
    }
    let first = by_tick.keys().next().copied().ok_or("no tick ran at all")?;
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    };
    // The first tick can come due only after the first scheduler started.
    if first < secs(started) {
        return Err(format!("tick {first} ran, due before any scheduler started").into());
    }
    let last = secs(window_end);
    let mut missed = Vec::new();
    let mut duplicated = Vec::new();
    let mut latest = Duration::ZERO;
    for t in first..=last {
        let label = Tick::from_unix_seconds(t).rfc3339();
        match by_tick.get(&t) {
            None => missed.push(label),
            Some(execs) => {
                if execs.len() > 1 {
                    duplicated.push(label);
                }
                let due = Tick::from_unix_seconds(t).time();
                for (_, at) in execs {
                    latest = latest.max(at.duration_since(due).unwrap_or_default());
                }
            }
        }
    }
    Ok(Found {
        store,
        ticks: (last - first + 1) as usize,
        missed,
        duplicated,
        kills,
        outages,
        latest,
    })
}
