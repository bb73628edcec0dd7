//! A user's own worker, as `tests/run` makes it: generated from
//! `templates/edge-worker`, this file in place of the template's
//! `src/lib.rs` (its job, `send-invoice` on `invoices`, instead of the
//! welcome email), the queues and the binding renamed in wrangler.toml. The
//! template's `src/routes.rs` is kept as it is: messages are sent through
//! its `POST /send` and the failure records read through its `/failures`.
//!
//! Besides jobrail-edge's own line per settlement, each settlement is logged
//! with the Worker's clock (`invoice-worker settled <ms> <event>`), so the
//! test can measure the gaps between deliveries.

use std::time::Duration;

use jobrail::{Job, JobContext, JobError, PolicyError, Registry, RegistryError};
use serde::{Deserialize, Serialize};

/// How the (simulated) mail server treats one invoice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MailServer {
    /// Accepts it.
    Up,
    /// Unavailable on deliveries 1 and 2, accepts it on delivery 3.
    DownTwice,
    /// Refuses the address: retrying cannot help.
    RefusesAddress,
    /// The invoice belongs to another tenant: dropped.
    OtherTenant,
}

/// The message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInvoice {
    /// The invoice number.
    pub invoice: u64,
    /// What the mail server does with it.
    pub mail_server: MailServer,
}

/// The job's queue.
pub const QUEUE: &str = "invoices";
/// The producer binding of [`QUEUE`]: `POST /send` and replays use it.
pub const SEND_BINDING: &str = "INVOICES";

/// The job: 3 deliveries, 1 s then 2 s apart.
pub fn job() -> Result<Job<SendInvoice>, PolicyError> {
    Job::<SendInvoice>::builder("send-invoice")
        .queue(QUEUE)
        .max_deliveries(3)
        .backoff(Duration::from_secs(1), 2.0, Duration::from_secs(10))
        .timeout(Duration::from_secs(10))
        .build()
}

/// The handler: deterministic in the payload and the delivery.
pub async fn handle(ctx: JobContext, send: SendInvoice) -> Result<(), JobError> {
    match send.mail_server {
        MailServer::Up => Ok(()),
        MailServer::DownTwice if ctx.attempt() <= 2 => {
            Err(JobError::new("mail server unavailable"))
        }
        MailServer::DownTwice => Ok(()),
        MailServer::RefusesAddress => Err(JobError::permanent(format!(
            "invoice {}: the mail server refuses the address",
            send.invoice
        ))),
        MailServer::OtherTenant => Err(JobError::reject(format!(
            "invoice {} belongs to another tenant",
            send.invoice
        ))),
    }
}

/// Every job this worker consumes, with its handler.
pub fn jobs() -> Result<Registry, RegistryError> {
    let mut registry = Registry::new();
    registry.register(&job()?, handle)?;
    #[cfg(target_arch = "wasm32")]
    registry.event_sink(std::sync::Arc::new(Stamped));
    Ok(registry)
}

/// Terminal failures are recorded on the queue of the `FAILED` binding.
pub const OPTIONS: jobrail_edge::Options = jobrail_edge::Options {
    failure_queue: Some("FAILED"),
    ..jobrail_edge::Options::DEFAULT
};

#[cfg(target_arch = "wasm32")]
mod routes;

jobrail_edge::consumer!(
    jobs,
    options = OPTIONS,
    other_queues = routes::keep_failures
);

/// Logs each settlement with the Worker's clock.
#[cfg(target_arch = "wasm32")]
struct Stamped;

#[cfg(target_arch = "wasm32")]
impl jobrail::EventSink for Stamped {
    fn emit(&self, event: &jobrail::Event) {
        let line = jobrail_edge::LogSink::line(event);
        let json = line.trim_start_matches("jobrail-edge settlement ");
        let at_ms = worker::Date::now().as_millis();
        worker::console_log!("invoice-worker settled {at_ms} {json}");
    }
}
