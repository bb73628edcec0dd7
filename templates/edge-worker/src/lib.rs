//! A Cloudflare Queues consumer for one job, built on `jobrail` and
//! `jobrail-edge`. Replace the job and its handler with your own; the wiring
//! is the one `jobrail_edge::consumer!` line at the end.
//!
//! The consumer settings live in `wrangler.toml`. The macro embeds that file
//! and checks it against the jobs: when the Worker starts, and natively in
//! the test `wrangler_toml_fits_the_jobs`, which the build command runs
//! first, so a configuration that no longer fits the jobs never ships.
//!
//! `src/routes.rs` adds the Worker's HTTP routes, each off until its secret
//! is set: `POST /send` (through the producer binding [`SEND_BINDING`]) and
//! the failure records, kept in D1, under `/failures`.

use std::time::Duration;

use jobrail::{Job, JobContext, JobError, PolicyError, Registry, RegistryError};
use serde::{Deserialize, Serialize};

/// The message: what one welcome email needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WelcomeEmail {
    /// The account to welcome.
    pub user_id: u64,
    /// Where to send the email.
    pub address: String,
}

/// The job's queue (its consumer is in wrangler.toml).
pub const QUEUE: &str = "emails";
/// The producer binding of [`QUEUE`] (in wrangler.toml): `POST /send` and
/// replays of failure records send through it.
pub const SEND_BINDING: &str = "EMAILS";

/// The job: its name on the wire, its queue, and how it is retried
/// (5 deliveries, 10 s, 20 s, 40 s, 80 s apart).
pub fn job() -> Result<Job<WelcomeEmail>, PolicyError> {
    Job::<WelcomeEmail>::builder("send-welcome-email")
        .queue(QUEUE)
        .max_deliveries(5)
        .backoff(Duration::from_secs(10), 2.0, Duration::from_secs(600))
        .timeout(Duration::from_secs(30))
        .build()
}

/// The handler. `Ok(())` acknowledges the message. An error is retried by
/// the job's policy (`JobError::new`, or `JobError::retry_after` to choose
/// the delay), fails the message at once with a failure record
/// (`JobError::permanent`), or drops it (`JobError::reject`).
pub async fn handle(_ctx: JobContext, email: WelcomeEmail) -> Result<(), JobError> {
    if !email.address.contains('@') {
        return Err(JobError::permanent(format!(
            "user {}: `{}` is not an email address",
            email.user_id, email.address
        )));
    }
    // Send the email here (your mail provider's API); return its errors.
    Ok(())
}

/// Every job this worker consumes, with its handler.
pub fn jobs() -> Result<Registry, RegistryError> {
    let mut registry = Registry::new();
    registry.register(&job()?, handle)?;
    Ok(registry)
}

/// Terminal failures are recorded on the queue of the `FAILED` binding.
pub const OPTIONS: jobrail_edge::Options = jobrail_edge::Options {
    failure_queue: Some("FAILED"),
    ..jobrail_edge::Options::DEFAULT
};

#[cfg(target_arch = "wasm32")]
mod routes;

// The failure queue is consumed by the failure keeper (src/routes.rs).
jobrail_edge::consumer!(
    jobs,
    options = OPTIONS,
    other_queues = routes::keep_failures
);
