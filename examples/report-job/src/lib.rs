//! The report job of the quick start, written once.
//!
//! The same declaration and handler are compiled into the native quick start
//! (`cargo run -p jobrail-native --example quickstart`) and into the edge worker,
//! so both settle the same message the same way. The handler simulates a
//! report service whose behaviour each payload chooses, so a demo (and a
//! test) can show every path deterministically.

use std::time::Duration;

use jobrail::{Job, JobContext, JobError, PolicyError};
use serde::{Deserialize, Serialize};

/// The job's name on the wire.
pub const NAME: &str = "build-report";
/// The queue it travels on.
pub const QUEUE: &str = "reports";

/// How the simulated report service behaves for one report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Behaviour {
    /// Works first time.
    Healthy,
    /// A network blip: the first in-process attempt fails, the retry works.
    Blip,
    /// The worker's first delivery keeps failing (a bad host): the broker's
    /// redelivery succeeds.
    BadHost,
    /// The upstream asks to be retried later (rate limit) once.
    RateLimited,
    /// The source record is gone: retrying cannot help.
    Missing,
    /// Always fails: exhausts both tiers.
    Broken,
    /// The report belongs to another tenant: reject it.
    Rejected,
    /// A bug panics on the first delivery; the redelivery works.
    Panics,
    /// A bug panics on every delivery (the process or instance dies each time).
    AlwaysPanics,
    /// The renderer takes two seconds (bounded by the execution's deadline).
    Slow,
}

/// Build one report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildReport {
    /// The report's business id (use it for idempotency).
    pub report_id: u64,
    /// How the simulated upstream behaves.
    pub behaviour: Behaviour,
}

/// The job declaration: 3 deliveries, each with up to 3 in-process attempts.
pub fn job() -> Result<Job<BuildReport>, PolicyError> {
    Job::<BuildReport>::builder(NAME)
        .queue(QUEUE)
        .max_deliveries(3)
        .backoff(Duration::from_secs(1), 2.0, Duration::from_secs(10))
        .tier_one(3)
        .tier_one_backoff(Duration::from_millis(50), 2.0, Duration::from_millis(200))
        .tier_one_max_wait(Duration::from_millis(500))
        .timeout(Duration::from_secs(10))
        .validate(|r: &BuildReport| {
            if r.report_id == 0 {
                Err("report_id must be positive".into())
            } else {
                Ok(())
            }
        })
        .build()
}

/// The handler. Deterministic in the delivery and in-process attempt, so the
/// same message settles the same way on every backend.
pub async fn handle(ctx: JobContext, report: BuildReport) -> Result<(), JobError> {
    match report.behaviour {
        Behaviour::Healthy => Ok(()),
        Behaviour::Blip if ctx.in_process_attempt() == 1 => {
            Err(JobError::new("connection reset by upstream"))
        }
        Behaviour::Blip => Ok(()),
        Behaviour::BadHost if ctx.attempt() == 1 => {
            Err(JobError::new("local disk full on this host"))
        }
        Behaviour::BadHost => Ok(()),
        Behaviour::RateLimited if ctx.attempt() == 1 => Err(JobError::retry_after(
            "upstream rate limit",
            Duration::from_secs(1),
        )),
        Behaviour::RateLimited => Ok(()),
        Behaviour::Missing => Err(JobError::permanent(format!(
            "report {} no longer exists",
            report.report_id
        ))),
        Behaviour::Broken => Err(JobError::new("report renderer crashed")),
        Behaviour::Rejected => Err(JobError::reject(format!(
            "report {} belongs to another tenant",
            report.report_id
        ))),
        Behaviour::Panics if ctx.attempt() == 1 => {
            panic!("renderer bug on report {}", report.report_id)
        }
        Behaviour::Panics => Ok(()),
        Behaviour::AlwaysPanics => panic!("renderer bug on report {}", report.report_id),
        Behaviour::Slow => {
            // Two seconds of rendering, cut short by the deadline (the report
            // is built with what was done by then); shutdown hands it back.
            match ctx.sleep(Duration::from_secs(2)).await {
                Err(interrupted) if interrupted.is_cancelled() => Err(interrupted.into()),
                _ => Ok(()),
            }
        }
    }
}
