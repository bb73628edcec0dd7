//! A user's own worker, as `tests/run` makes it: generated from
//! `templates/edge-worker`, the template's job replaced with this one
//! (`send-invoice`), the queues renamed in wrangler.toml, and, for the test
//! only, two routes the template does not have: `GET /health` and
//! `POST /send`, which enqueues invoices through the `INVOICES` producer
//! binding. `/send` is off unless the secret `TEST_ROUTES_TOKEN` is set and
//! the request carries it as a bearer token, as in the report worker.
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

/// The job: 3 deliveries, 1 s then 2 s apart.
pub fn job() -> Result<Job<SendInvoice>, PolicyError> {
    Job::<SendInvoice>::builder("send-invoice")
        .queue("invoices")
        .retry(3)
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
    registry.event_sink(std::sync::Arc::new(test_routes::Stamped));
    Ok(registry)
}

/// Terminal failures are recorded on the queue of the `FAILED` binding.
pub const OPTIONS: jobrail_edge::Options = jobrail_edge::Options {
    failure_queue: Some("FAILED"),
    ..jobrail_edge::Options::DEFAULT
};

jobrail_edge::consumer!(jobs, options = OPTIONS);

/// The test's additions: the routes and the timed settlement log.
#[cfg(target_arch = "wasm32")]
mod test_routes {
    use jobrail::{Event, EventSink};
    use jobrail_edge::EdgeProducer;
    use worker::{event, Context, Env, Request, Response, Result};

    use crate::SendInvoice;

    /// Logs each settlement with the Worker's clock.
    pub(crate) struct Stamped;

    impl EventSink for Stamped {
        fn emit(&self, event: &Event) {
            let line = jobrail_edge::LogSink::line(event);
            let json = line.trim_start_matches("jobrail-edge settlement ");
            let at_ms = worker::Date::now().as_millis();
            worker::console_log!("invoice-worker settled {at_ms} {json}");
        }
    }

    fn authorized(req: &Request, env: &Env) -> bool {
        let Ok(secret) = env.secret("TEST_ROUTES_TOKEN") else {
            return false;
        };
        let secret = secret.to_string();
        let given = req
            .headers()
            .get("Authorization")
            .ok()
            .flatten()
            .unwrap_or_default();
        let expected = format!("Bearer {secret}");
        !secret.is_empty()
            && given.len() == expected.len()
            && given
                .bytes()
                .zip(expected.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    async fn send(mut req: Request, env: &Env) -> Result<Response> {
        let invoices: Vec<SendInvoice> = req.json().await?;
        let fail = |e: jobrail_edge::EdgeError| worker::Error::RustError(e.to_string());
        let job = crate::job().map_err(|e| worker::Error::RustError(e.to_string()))?;
        let ids = EdgeProducer::from_env(env, "INVOICES")
            .map_err(fail)?
            .dispatch_batch(&job, &invoices)
            .await
            .map_err(fail)?;
        Response::from_json(&ids)
    }

    #[event(fetch)]
    async fn fetch(req: Request, env: Env, _ctx: Context) -> Result<Response> {
        match (req.method(), req.path().as_str()) {
            (worker::Method::Get, "/health") => Response::ok("ok"),
            (worker::Method::Post, "/send") if authorized(&req, &env) => send(req, &env).await,
            (worker::Method::Post, "/send") => Response::error("unauthorized", 401),
            _ => Response::error("not found", 404),
        }
    }
}
