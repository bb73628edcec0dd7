//! The fault suite: the native drivers under process kills, broker
//! restarts, crash loops and slow handlers, proving that nothing is lost
//! (and, with a claim on Postgres, that a charge happens exactly once).
//!
//! One binary, two subcommands. `run` is the orchestrator: it dispatches
//! jobs whose payload is a business id (plus a marker string that must
//! never reach a log), starts worker processes (this same executable with
//! `worker`), injects the faults, and waits until every dispatched id is
//! accounted for: in the ledger (a file the workers append
//! `<business id> <pid>` to, one write per effect, `O_APPEND`) or in a
//! failure record on the backend. Then it prints a Markdown table and
//! writes it to `target/faults/report.md`; it exits non-zero on any loss,
//! leak or broken expectation.
//!
//! ```text
//! cargo run -p jobrail-faults --features nats -- run --backend nats --fault kill
//! cargo run -p jobrail-faults --features "postgres rabbitmq nats sqs" -- run   # everything
//! cargo run -p jobrail-faults --features "postgres rabbitmq nats" -- run --fault charge
//! cargo run -p jobrail-faults --features postgres-queue -- run --backend postgres
//! sudo -E cargo run -p jobrail-faults --features "postgres-queue rabbitmq nats sqs" -- \
//!   run --backend rabbitmq,nats,sqs,postgres --fault partition,isolate,slow-link,half-open
//! ```
//!
//! Connections: RabbitMQ on 127.0.0.1:5672 (`FAULTS_RABBITMQ_PORT`
//! overrides; `rabbitmqctl` must work), NATS at `NATS_URL` (default
//! `nats://127.0.0.1:4222`), SQS at `SQS_ENDPOINT` (`tests/sqs-emulator`).
//! Every queue is new for the run (`faults-<run>-<driver>-<fault>`) and is
//! deleted at the end. The charge fault (feature `postgres`) uses Postgres at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), in
//! tables of its own (`faults_<run>_<driver>_claims` and `..._ledger`),
//! dropped at the end.
//!
//! The Postgres queue (`--backend postgres`, feature `postgres-queue`:
//! `jobrail_postgres::PgDriver`) uses the same database, in a schema of the
//! run's own (`faults_<run>`, installed with `PgDriver::install`, dropped
//! at the end); a random password goes in its URL when `DATABASE_URL` has
//! none (trust authentication never sends it; no log may show it). The
//! workers' connections carry the application name `faults_<run>_worker`,
//! the orchestrator's `faults_<run>_orchestrator`. Its job counts are
//! smaller (`--pg-jobs` 2,000, `--pg-charges` 500) so that the fault step
//! stays short on two cores shared with the server.
//!
//! # The faults
//!
//! - **kill load** (`--fault kill`): 5,000 jobs (300 on SQS, whose emulator
//!   is slow), dispatched at a steady pace over the kill window while three
//!   workers with concurrency 8 consume them (the handler sleeps 0–20 ms
//!   before its effect, so kills land mid-job); a random worker is SIGKILLed
//!   every 0.7–1.5 s and restarted at once, six times (only kills that land
//!   while work remains count; a shortfall is noted in the row). Leases
//!   (NATS AckWait, SQS visibility, the Postgres queue's lease) are 3 s so
//!   killed work returns quickly.
//!   Each worker's handler panics on the first delivery of business id 1
//!   (the facade catches it; the job is retried).
//!   Duplicates are expected (at-least-once: an effect written but not yet
//!   acknowledged is done again); losses are not.
//! - **broker restart** (`--fault restart`): one worker (concurrency 4)
//!   consumes 600 jobs; after 100 effects the broker goes away: a private
//!   `nats-server` (SIGTERM, then started again on the same port and store),
//!   or a private RabbitMQ node (`rabbitmqctl stop_app` / `start_app`). The
//!   shared brokers are never restarted (with `FAULTS_SHARED_BROKER=1`, the
//!   shared RabbitMQ node is used if a private node cannot start). Postgres
//!   queue: a private server (`initdb` into a temporary directory, trust
//!   authentication, a free port, run as the `postgres` user when the suite
//!   runs as root) with the run's schema, stopped with `pg_ctl stop -m
//!   immediate` (recovery from the WAL at the next start) and started again;
//!   its directory is removed at the end and its log scanned with the
//!   others. The shared server on 5432 is never restarted. During
//!   the outage five dispatches are timed (error kind and latency). SQS: the
//!   emulator keeps its state in memory, so instead five dispatches go to a
//!   closed loopback port; memory: five dispatches after the driver stopped.
//! - **crash loop** (`--fault crash`): three jobs capped at 2 attempts whose
//!   handler writes `start <id> <pid>` and aborts the process on every
//!   delivery; the worker is restarted whenever it dies until each job has a
//!   failure record (120 s / 80 restarts at most, else the suite says the
//!   loop did not end). The facade's crash bound ends it: a delivery whose
//!   attempt is past cap + allowance (0 where the driver counts graceful
//!   shutdown returns, else `SHUTDOWN_GRACE`) is recorded without running.
//! - **connections terminated** (`--fault terminate`, Postgres queue only;
//!   no row for the others): three workers (concurrency 8) consume
//!   `--pg-jobs` jobs dispatched over 6 s while every 0.5 s the orchestrator
//!   terminates every backend of the workers (`pg_terminate_backend` on
//!   their application name; its own connection is spared): fetches,
//!   settlements, lease renewals and the listening connection are cut.
//!   Nothing may be lost and no worker may exit. Recovery: from the last
//!   round that terminated a connection until every id is accounted for.
//! - **slow handler** (`--fault slow`, NATS, SQS and the Postgres queue): five jobs whose
//!   handler runs three leases (lease 2 s, handler 6 s); the driver must
//!   renew the lease, so each job runs once.
//! - **exactly-once charge** (`--fault charge`, feature `postgres`; in the
//!   default set when built with it): the kill-load scenario with 1,000
//!   jobs (150 on SQS) and five kills, whose handler charges an account
//!   once: it appends `deliver <id> <pid>` to the ledger file, claims
//!   `charge:<id>` for 2 s on Postgres (`PgClaims`), and in one transaction
//!   inserts the charge into the ledger table and completes the claim
//!   (`complete_in`), sleeping 0–20 ms before the claim, inside the
//!   transaction and after the commit, so kills land at each step (a kill
//!   after the commit redelivers a charge that is done). A claim found
//!   done or held appends `skip` or `held`; a completion too late appends
//!   `lost` and rolls back. The run waits until every id has a row or a
//!   failure record; an id with two rows (a duplicate charge) or with none
//!   (a loss) fails it, and so does a run where no delivery repeated
//!   although kills landed (redelivery was not exercised). Every charged
//!   key must then answer done to a new claim. On the Postgres queue the
//!   charge has no claim: the handler inserts the charge row and completes
//!   its job (`PgDriver::complete_in`, fenced by the delivery's lease) in
//!   one transaction, then commits (500 charges); a completion refused
//!   (lease taken over) appends `lost` and rolls back. The same checks
//!   hold (no id charged twice, none lost, deliveries repeated), and at the
//!   end no job may be left in the queue.
//! - **partitions** (`--fault partition,isolate,slow-link,half-open`,
//!   feature `postgres`, root): three workers and a dispatcher in network
//!   namespaces of their own, reaching the servers through the suite's
//!   forwarder on the host end of their veth pairs ([`netns`]); a clean
//!   partition, one worker cut off, a slow link, half-open connections,
//!   with the exactly-once charge as the handler. See `run/partition.rs`.
//! - **secrets** (always): workers log at debug level to
//!   `target/faults/logs/`, the orchestrator too (`orchestrator.log`); the
//!   RabbitMQ user is created for the run with a random password, the NATS
//!   URL carries `faults:<random password>@`, SQS gets random static keys;
//!   each driver also fails to connect (or dispatch) through a closed port
//!   with those credentials, logged at error level. At the end every log line
//!   is searched for the payload marker and the credentials: a hit fails the
//!   run and is printed with the secret masked.
//!
//! # The figures
//!
//! - *dispatched*: business ids the backend accepted;
//! - *executed (distinct)*: of those, ids with at least one effect in the
//!   ledger (exactly-once charge: a row in the ledger table);
//! - *duplicates*: effects beyond the first, summed over ids; exactly-once
//!   charge: deliveries beyond one per id (expected) / charge rows beyond
//!   one per id (must be 0);
//! - *lost*: accepted ids with neither an effect nor a failure record (must be 0);
//! - *failure records*: records on the failure queue of the run's queue;
//! - *recovery*: kill load, from the last kill until every id is accounted
//!   for; broker restart, from the broker being back until the first new
//!   effect; crash loop, from the first start until the last failure record;
//!   slow handler, from the dispatch until every effect; exactly-once
//!   charge, from the last kill until every id has a charge row or a
//!   failure record.

mod backend;
mod charge;
// The partition faults need Postgres (the charge); without it only the
// namespace checks of `run` use this.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
mod netns;
mod nodes;
mod run;
#[cfg(all(feature = "postgres-queue", feature = "redis", feature = "nats"))]
mod schedules;
mod worker;

use clap::{Parser, Subcommand};

/// The fault suite.
#[derive(Parser, Debug)]
#[command(
    name = "jobrail-faults",
    about = "Fault injection against the native queue drivers"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Consume one queue, recording effects in a ledger (started by `run`).
    Worker(worker::WorkerArgs),
    /// Run the suite and print the report.
    Run(run::RunArgs),
    /// Three schedulers on one claim store, killed and restarted at random
    /// while a schedule fires every second: every tick must run once
    /// (features `postgres-queue` and `redis`).
    #[cfg(all(feature = "postgres-queue", feature = "redis", feature = "nats"))]
    Schedules(schedules::SchedulesArgs),
    /// Dispatches business ids at a pace, repeating each until accepted
    /// (started by the partition faults, in a namespace; feature `postgres`).
    #[cfg(feature = "postgres")]
    Dispatcher(run::DispatcherArgs),
    /// One scheduler process (started by `schedules`).
    #[cfg(all(feature = "postgres-queue", feature = "redis", feature = "nats"))]
    ScheduleWorker(schedules::ScheduleWorkerArgs),
}

/// Runs a child process's work (a worker, the dispatcher, a scheduler)
/// with its log on stderr at `default` level unless `RUST_LOG` says
/// otherwise: exit code 0, or 1 after logging `failed` with the error.
fn child<E: std::fmt::Display>(
    runtime: &tokio::runtime::Runtime,
    default: &str,
    failed: &str,
    work: impl std::future::Future<Output = Result<(), E>>,
) -> i32 {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    match runtime.block_on(work) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!(error = %e, "{failed}");
            1
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = match cli.command {
        Cmd::Worker(args) => child(&runtime, "debug", "worker failed", worker::run(args)),
        #[cfg(feature = "postgres")]
        Cmd::Dispatcher(args) => child(
            &runtime,
            "debug",
            "dispatcher failed",
            run::dispatcher(args),
        ),
        #[cfg(all(feature = "postgres-queue", feature = "redis", feature = "nats"))]
        Cmd::ScheduleWorker(args) => child(
            &runtime,
            "warn",
            "schedule worker failed",
            schedules::worker(args),
        ),
        #[cfg(all(feature = "postgres-queue", feature = "redis", feature = "nats"))]
        Cmd::Schedules(args) => match runtime.block_on(schedules::run(args)) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(e) => {
                eprintln!("jobrail-faults schedules: {e}");
                2
            }
        },
        Cmd::Run(args) => match runtime.block_on(run::run(args)) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(e) => {
                eprintln!("jobrail-faults: {e}");
                2
            }
        },
    };
    drop(runtime);
    std::process::exit(code);
}
