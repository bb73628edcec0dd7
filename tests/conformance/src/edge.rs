//! Talking to the report worker under `wrangler dev` from the edge tests
//! (`tests/edge*.rs`, `tests/claims_edge*.rs`): its address (`EDGE_URL`),
//! the test routes' bearer token (`EDGE_TOKEN`, the worker's
//! `TEST_ROUTES_TOKEN`), JSON requests, the worker's log, and ids no earlier
//! run used (the worker's KV log and D1 persist between runs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// The worker's base URL.
pub fn base() -> String {
    std::env::var("EDGE_URL")
        .expect("EDGE_URL names the worker under `wrangler dev` (tests/run sets it)")
}

/// The test routes' token.
pub fn token() -> String {
    std::env::var("EDGE_TOKEN")
        .expect("EDGE_TOKEN is the worker's TEST_ROUTES_TOKEN (tests/run sets both)")
}

/// Posts `body` to the test route `path` with the token; the JSON answer
/// (panics on a transport error or an error status).
pub fn post(path: &str, body: Value) -> Value {
    ureq::post(&format!("{}{path}", base()))
        .set("Authorization", &format!("Bearer {}", token()))
        .send_json(body)
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
        .into_json()
        .expect("JSON answer")
}

/// The worker's log (`GET /log`): every accepted outcome and failure
/// record, oldest first.
pub fn log() -> Vec<Value> {
    ureq::get(&format!("{}/log", base()))
        .set("Authorization", &format!("Bearer {}", token()))
        .call()
        .expect("GET /log")
        .into_json()
        .expect("JSON log")
}

/// Microseconds since the epoch, never the same twice in this process: a
/// report id or key no earlier run used.
pub fn fresh() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros() as u64;
    let previous = LAST
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
            Some(now.max(last + 1))
        })
        .expect("the update always answers");
    now.max(previous + 1)
}
