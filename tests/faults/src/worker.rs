//! The worker process: consumes one queue and records effects in the
//! ledger.
//!
//! Ledger lines (one `write` each, on a file opened with `O_APPEND`, so
//! lines from concurrent processes never interleave):
//!
//! - `<business id> <pid>`: the handler's effect, written once per
//!   execution that completed (so a business id written twice is a
//!   duplicate execution);
//! - `start <business id> <pid>`: the `abort` handler started on a delivery;
//! - `deliver`, `skip`, `held` and `lost` lines of the `charge` handler,
//!   whose effects are rows of a Postgres table instead (see
//!   [`crate::charge`]).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use jobrail::{Job, JobContext, JobError, Registry};
use jobrail_native::Consumer;
use serde::{Deserialize, Serialize};

use crate::backend::{Conn, Kind, Target};

/// The job's name on every queue of the suite.
pub(crate) const JOB: &str = "fault-item";

/// The payload: a business id and the run's marker (which must never reach
/// a log).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Item {
    /// The business id the ledger is keyed by.
    pub(crate) id: u64,
    /// The run's payload marker.
    pub(crate) marker: String,
}

/// What the handler does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Sleeps 0–20 ms, appends `<id> <pid>` to the ledger, succeeds.
    Effect,
    /// Appends `start <id> <pid>`, then aborts the process.
    Abort,
    /// Sleeps `--slow-ms`, then records its effect as `effect` does.
    Slow,
    /// Charges the id once through a Postgres claim (feature `postgres`):
    /// see [`crate::charge`].
    Charge,
    /// Charges the id once through transactional completion on the
    /// Postgres queue (`PgDriver::complete_in`, feature `postgres-queue`),
    /// with no claim: see [`crate::charge`].
    ChargeTx,
}

/// `jobrail-faults worker`: consumes one queue until killed or SIGTERM.
#[derive(Args, Debug, Clone)]
pub(crate) struct WorkerArgs {
    /// The backend (its URL and keys come from the orchestrator's environment).
    #[arg(long, value_enum)]
    pub(crate) backend: Kind,
    /// The queue to consume.
    #[arg(long)]
    pub(crate) queue: String,
    /// What the handler does.
    #[arg(long, value_enum)]
    pub(crate) mode: Mode,
    /// The ledger file.
    #[arg(long)]
    pub(crate) ledger: PathBuf,
    /// Deliveries handled at once.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: usize,
    /// The job's attempt cap.
    #[arg(long, default_value_t = 10)]
    pub(crate) cap: u32,
    /// NATS AckWait / SQS visibility timeout, in ms.
    #[arg(long, default_value_t = 3000)]
    pub(crate) lease_ms: u64,
    /// The job's timeout, in ms.
    #[arg(long, default_value_t = 60_000)]
    pub(crate) timeout_ms: u64,
    /// How long the `slow` handler runs, in ms.
    #[arg(long, default_value_t = 6000)]
    pub(crate) slow_ms: u64,
    /// A business id whose first delivery panics in the handler.
    #[arg(long)]
    pub(crate) panic_id: Option<u64>,
    /// The claim table of the `charge` handler.
    #[arg(long)]
    pub(crate) claims_table: Option<String>,
    /// The ledger table of the `charge` handler.
    #[arg(long)]
    pub(crate) ledger_table: Option<String>,
}

/// The job every process of the suite declares.
pub(crate) fn job(queue: &str, cap: u32, timeout: Duration) -> Job<Item> {
    Job::<Item>::builder(JOB)
        .queue(queue)
        .delivery_cap((cap > 0).then_some(cap))
        .timeout(timeout)
        .build()
        .expect("the suite's job is valid")
}

/// Appends `line` to the ledger in one write.
pub(crate) fn append(ledger: &File, line: &str) {
    let mut file = ledger;
    file.write_all(line.as_bytes())
        .expect("append to the ledger");
}

/// Opens `path` for appending (creating it).
pub(crate) fn open_ledger(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open the ledger {}: {e}", path.display()))
}

/// Runs the worker until SIGTERM (or a kill).
pub(crate) async fn run(args: WorkerArgs) -> Result<(), Box<dyn std::error::Error>> {
    let target = Target::from_env(args.backend, Duration::from_millis(args.lease_ms));
    let conn = Conn::connect(&target).await?;
    let driver = conn.driver();
    let ledger = Arc::new(open_ledger(&args.ledger));
    let pid = std::process::id();
    let job = job(
        &args.queue,
        args.cap,
        Duration::from_millis(args.timeout_ms),
    );
    let mode = args.mode;
    let mut registry = Registry::new();
    if matches!(mode, Mode::Charge | Mode::ChargeTx) {
        register_charge(&mut registry, &job, ledger, &args, &conn).await?;
    } else {
        register_effects(&mut registry, &job, ledger, &args)?;
    }
    tracing::info!(queue = %args.queue, mode = ?mode, pid, "worker consuming");
    Consumer::builder(driver.clone(), registry)
        .concurrency(args.concurrency)
        .build()
        .run_until_signal()
        .await?;
    driver.stop().await?;
    tracing::info!(pid, "worker stopped");
    Ok(())
}

/// Registers the `effect`, `abort` and `slow` handlers.
fn register_effects(
    registry: &mut Registry,
    job: &Job<Item>,
    ledger: Arc<File>,
    args: &WorkerArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    static PANICKED: AtomicBool = AtomicBool::new(false);
    let pid = std::process::id();
    let mode = args.mode;
    let slow = Duration::from_millis(args.slow_ms);
    let panic_id = args.panic_id;
    registry.register(job, move |ctx: JobContext, item: Item| {
        let ledger = ledger.clone();
        async move {
            match mode {
                Mode::Abort => {
                    append(&ledger, &format!("start {} {pid}\n", item.id));
                    std::process::abort();
                }
                Mode::Effect => {
                    if panic_id == Some(item.id)
                        && ctx.attempt() == 1
                        && !PANICKED.swap(true, Ordering::SeqCst)
                    {
                        panic!("injected handler panic for business id {}", item.id);
                    }
                    let pause = Duration::from_millis(fastrand::u64(0..=20));
                    tokio::time::sleep(pause).await;
                }
                Mode::Slow => tokio::time::sleep(slow).await,
                Mode::Charge | Mode::ChargeTx => {
                    unreachable!("the charge handlers are registered apart")
                }
            }
            append(&ledger, &format!("{} {pid}\n", item.id));
            Ok::<(), JobError>(())
        }
    })?;
    Ok(())
}

/// Registers the `charge` handler on the tables the orchestrator named.
#[cfg(feature = "postgres")]
async fn register_charge(
    registry: &mut Registry,
    job: &Job<Item>,
    ledger: Arc<File>,
    args: &WorkerArgs,
    conn: &Conn,
) -> Result<(), Box<dyn std::error::Error>> {
    if args.mode == Mode::ChargeTx {
        return register_charge_tx(registry, job, ledger, args, conn).await;
    }
    let (Some(claims), Some(table)) = (&args.claims_table, &args.ledger_table) else {
        return Err("the charge handler needs --claims-table and --ledger-table".into());
    };
    let tables = crate::charge::Tables {
        claims: claims.clone(),
        ledger: table.clone(),
    };
    crate::charge::register(registry, job, ledger, &tables, args.concurrency).await
}

/// Without Postgres there is no charge handler.
#[cfg(not(feature = "postgres"))]
async fn register_charge(
    _registry: &mut Registry,
    _job: &Job<Item>,
    _ledger: Arc<File>,
    _args: &WorkerArgs,
    _conn: &Conn,
) -> Result<(), Box<dyn std::error::Error>> {
    Err("this build has no Postgres: build jobrail-faults with `--features postgres`".into())
}

/// Registers the transactional `charge-tx` handler on the Postgres queue's
/// database.
#[cfg(feature = "postgres-queue")]
async fn register_charge_tx(
    registry: &mut Registry,
    job: &Job<Item>,
    ledger: Arc<File>,
    args: &WorkerArgs,
    conn: &Conn,
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(table) = &args.ledger_table else {
        return Err("the charge-tx handler needs --ledger-table".into());
    };
    let Conn::Postgres(driver) = conn else {
        return Err("the charge-tx handler runs on the Postgres queue (--backend postgres)".into());
    };
    crate::charge::register_tx(
        registry,
        job,
        ledger,
        table,
        driver.clone(),
        args.concurrency,
    )
    .await
}

/// Without the Postgres queue there is no transactional charge handler.
#[cfg(all(feature = "postgres", not(feature = "postgres-queue")))]
async fn register_charge_tx(
    _registry: &mut Registry,
    _job: &Job<Item>,
    _ledger: Arc<File>,
    _args: &WorkerArgs,
    _conn: &Conn,
) -> Result<(), Box<dyn std::error::Error>> {
    Err(
        "this build has no Postgres queue: build jobrail-faults with `--features postgres-queue`"
            .into(),
    )
}
