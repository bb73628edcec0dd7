//! The claim-store suite on the edge's D1 store (`jobrail_edge::D1Claims`),
//! through the report worker's test route `POST /claims` under `wrangler
//! dev` (`EDGE_URL`, with the bearer token `EDGE_TOKEN`, the worker's
//! `TEST_ROUTES_TOKEN`).
//!
//! [`EdgeClaims`] is a native [`ClaimStore`] whose every operation is one
//! HTTP request, so one invocation of the worker, which builds a
//! `D1Claims` from its `Env`, runs the operation and answers it as JSON.
//! Invocations share nothing but the D1 database: a handle the suite
//! opens is a new HTTP agent (its own connections), a worker "killed" mid
//! work is a handle dropped between requests, and a look "after a crash" is
//! simply a later invocation. The scenarios are the suite's, unchanged;
//! the clock that runs the leases is the database's (SQLite's, in the
//! local D1 of `wrangler dev`), as it is the D1 primary's when deployed.
//!
//! Without `EDGE_URL` every scenario is listed as ignored; `tests/run`
//! starts the worker and sets it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jobrail::{BoxFuture, Claim, ClaimError, ClaimStore};
use jobrail_conformance::claims::ClaimFixture;
use serde_json::{json, Value};

/// The claim store of the worker at `EDGE_URL`, over HTTP.
struct EdgeClaims {
    agent: ureq::Agent,
    url: String,
    token: String,
}

impl EdgeClaims {
    fn open() -> Self {
        let (base, token) = (
            jobrail_conformance::edge::base(),
            jobrail_conformance::edge::token(),
        );
        EdgeClaims {
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(30))
                .build(),
            url: format!("{}/claims", base.trim_end_matches('/')),
            token,
        }
    }

    /// Posts one operation; the worker's answer, or a store error when the
    /// request failed or was refused.
    fn call(&self, body: Value) -> BoxFuture<'static, Result<Value, ClaimError>> {
        let request = self
            .agent
            .post(&self.url)
            .set("Authorization", &format!("Bearer {}", self.token));
        Box::pin(async move {
            tokio::task::spawn_blocking(move || match request.send_json(body) {
                Ok(response) => response
                    .into_json::<Value>()
                    .map_err(|e| ClaimError::store(format!("POST /claims: not JSON: {e}"))),
                Err(ureq::Error::Status(status, response)) => Err(ClaimError::store(format!(
                    "POST /claims: HTTP {status}: {}",
                    response.into_string().unwrap_or_default()
                ))),
                Err(e) => Err(ClaimError::store(format!("POST /claims: {e}"))),
            })
            .await
            .map_err(|e| ClaimError::store(format!("the request's thread: {e}")))?
        })
    }

    /// Complete, release or extend: `{"ok": true}` or an error.
    fn fenced<'a>(
        &'a self,
        op: &'static str,
        key: &'a str,
        fence: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        let mut body = json!({ "op": op, "key": key, "fence": fence });
        if let Some(lease) = lease {
            body["lease_ms"] = json!(lease_ms(lease));
        }
        let answer = self.call(body);
        Box::pin(async move {
            let answer = answer.await?;
            if answer["ok"] == json!(true) {
                return Ok(());
            }
            Err(error(&answer, key, fence))
        })
    }
}

/// A lease in milliseconds, fractions kept (the worker validates the
/// lease exactly as a native store would).
fn lease_ms(lease: Duration) -> f64 {
    lease.as_secs_f64() * 1000.0
}

/// The error an answer carries (`{"error": "lost"|"invalid"|"store"}`).
fn error(answer: &Value, key: &str, fence: u64) -> ClaimError {
    let message = answer["message"].as_str().unwrap_or_default().to_string();
    match answer["error"].as_str() {
        Some("lost") => ClaimError::Lost {
            key: key.to_owned(),
            fence,
        },
        Some("invalid") => ClaimError::Invalid(message),
        Some("store") => ClaimError::store(message),
        _ => ClaimError::store(format!("unexpected answer from POST /claims: {answer}")),
    }
}

/// The claim an answer carries (`{"claim": "claimed"|"done"|"held"}`).
fn claim_of(answer: &Value) -> Option<Claim> {
    match answer["claim"].as_str()? {
        "claimed" => Some(Claim::Claimed {
            fence: answer["fence"].as_u64()?,
        }),
        "done" => Some(Claim::Done),
        "held" => Some(Claim::Held {
            remaining: Duration::from_millis(answer["remaining_ms"].as_u64()?),
        }),
        _ => None,
    }
}

impl ClaimStore for EdgeClaims {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        let answer = self.call(json!({ "op": "claim", "key": key, "lease_ms": lease_ms(lease) }));
        Box::pin(async move {
            let answer = answer.await?;
            claim_of(&answer).ok_or_else(|| error(&answer, key, 0))
        })
    }

    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.fenced("complete", key, fence, None)
    }

    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.fenced("release", key, fence, None)
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.fenced("extend", key, fence, Some(lease))
    }
}

/// Every handle a new agent on the same worker (and so the same D1).
struct Edge;

#[async_trait]
impl ClaimFixture for Edge {
    async fn open(&self) -> Arc<dyn ClaimStore> {
        Arc::new(EdgeClaims::open())
    }

    /// A round trip through `wrangler dev` and D1 on each side of a lease.
    fn slack(&self) -> Duration {
        Duration::from_millis(400)
    }
}

fn main() {
    jobrail_conformance::claims::run_unless_missing("EDGE_URL", || async { Edge })
}
