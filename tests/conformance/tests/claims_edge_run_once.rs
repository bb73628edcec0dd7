//! A handler's view of claims at the edge: the report worker's `POST
//! /claims/run-once` runs `jobrail::run_once` on `jobrail_edge::D1Claims`,
//! the same call as natively, with an effect that appends a row to a D1
//! table. Invocations racing on one key run the effect once.
//!
//! Ignored by default: they need the worker under `wrangler dev` at
//! `EDGE_URL` with the bearer token `EDGE_TOKEN` (`tests/run` starts it
//! and runs them with `--ignored`).

use std::time::Duration;

use serde_json::{json, Value};

fn base() -> String {
    std::env::var("EDGE_URL")
        .expect("EDGE_URL names the worker under `wrangler dev` (tests/run sets it)")
}

fn token() -> String {
    std::env::var("EDGE_TOKEN")
        .expect("EDGE_TOKEN is the worker's TEST_ROUTES_TOKEN (tests/run sets both)")
}

fn post(path: &str, body: Value) -> Value {
    ureq::post(&format!("{}{path}", base()))
        .set("Authorization", &format!("Bearer {}", token()))
        .send_json(body)
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
        .into_json()
        .expect("JSON answer")
}

/// A key no other run used (the worker's D1 persists between runs).
fn fresh_key(what: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    format!("edge-run-once:{what}:{}", now.as_nanos())
}

fn effects(key: &str) -> Vec<Value> {
    let answer: Value = ureq::get(&format!("{}/claims/effects", base()))
        .query("key", key)
        .set("Authorization", &format!("Bearer {}", token()))
        .call()
        .expect("GET /claims/effects")
        .into_json()
        .expect("JSON answer");
    answer["effects"].as_array().cloned().unwrap_or_default()
}

/// Eight invocations run one effect (300 ms of work) through `run_once`
/// at the same moment, each retrying as the claim asks: one runs it, the
/// others end `already_done`, and D1 holds one effect, under the winner's
/// fence.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn racing_invocations_run_the_effect_once() {
    let key = fresh_key("race");
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let key = key.clone();
            std::thread::spawn(move || {
                let mut retries = 0;
                loop {
                    let answer = post(
                        "/claims/run-once",
                        json!({ "key": key, "lease_ms": 30_000, "work_ms": 300 }),
                    );
                    match answer["once"].as_str() {
                        Some("ran") | Some("already_done") => return (answer, retries),
                        Some("retry") => {
                            let delay = answer["retry_after_ms"].as_u64().expect("a delay");
                            assert!(
                                (1..=31_000).contains(&delay),
                                "retry after {delay} ms: {answer}"
                            );
                            retries += 1;
                            // The holder finishes in about 300 ms: poll faster than the lease.
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        _ => panic!("unexpected answer {answer}"),
                    }
                }
            })
        })
        .collect();
    let mut ran = Vec::new();
    let mut retried = 0;
    for worker in workers {
        let (answer, retries) = worker.join().expect("a worker thread");
        retried += retries;
        if answer["once"] == "ran" {
            ran.push(answer["fence"].as_u64().expect("the winner's fence"));
        }
    }
    assert_eq!(
        ran.len(),
        1,
        "exactly one invocation ran the effect: {ran:?}"
    );
    assert!(retried > 0, "the racing invocations saw the key held");
    let recorded = effects(&key);
    assert_eq!(recorded.len(), 1, "one effect in D1: {recorded:?}");
    assert_eq!(recorded[0]["fence"].as_u64(), Some(ran[0]));
    // A redelivery, long after: nothing runs.
    let again = post(
        "/claims/run-once",
        json!({ "key": key, "lease_ms": 30_000, "work_ms": 0 }),
    );
    assert_eq!(again["once"], "already_done", "{again}");
    assert_eq!(effects(&key).len(), 1);
}

/// The claims route answers every claim and error with status 200, refuses
/// malformed requests with 400, and requests without the token with 401.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn the_claims_route_answers_and_refuses() {
    let key = fresh_key("route");
    let claimed = post(
        "/claims",
        json!({ "op": "claim", "key": key, "lease_ms": 30_000 }),
    );
    assert_eq!(claimed["claim"], "claimed", "{claimed}");
    let fence = claimed["fence"].as_u64().expect("a fence");
    let held = post(
        "/claims",
        json!({ "op": "claim", "key": key, "lease_ms": 30_000 }),
    );
    assert_eq!(held["claim"], "held", "{held}");
    let remaining = held["remaining_ms"].as_u64().expect("remaining_ms");
    assert!(
        (20_000..=30_000).contains(&remaining),
        "{remaining} ms left"
    );
    let lost = post(
        "/claims",
        json!({ "op": "complete", "key": key, "fence": fence + 1 }),
    );
    assert_eq!(lost["error"], "lost", "{lost}");
    let invalid = post(
        "/claims",
        json!({ "op": "claim", "key": "", "lease_ms": 1000 }),
    );
    assert_eq!(invalid["error"], "invalid", "{invalid}");
    let done = post(
        "/claims",
        json!({ "op": "complete", "key": key, "fence": fence }),
    );
    assert_eq!(done, json!({ "ok": true }));
    let after = post(
        "/claims",
        json!({ "op": "claim", "key": key, "lease_ms": 1 }),
    );
    assert_eq!(after, json!({ "claim": "done" }));

    let status = |body: Value, token: Option<&str>| {
        let mut request = ureq::post(&format!("{}/claims", base()));
        if let Some(token) = token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        match request.send_json(body) {
            Ok(response) => response.status(),
            Err(ureq::Error::Status(status, _)) => status,
            Err(e) => panic!("POST /claims: {e}"),
        }
    };
    let token = token();
    for malformed in [
        json!({ "op": "claim", "key": key }),
        json!({ "op": "claim", "key": key, "lease_ms": -5 }),
        json!({ "op": "complete", "key": key }),
        json!({ "op": "steal", "key": key }),
        json!({ "key": key }),
    ] {
        assert_eq!(status(malformed.clone(), Some(&token)), 400, "{malformed}");
    }
    let fine = json!({ "op": "claim", "key": key, "lease_ms": 1000 });
    assert_eq!(status(fine.clone(), None), 401);
    assert_eq!(status(fine.clone(), Some("wrong")), 401);
    assert_eq!(status(fine, Some(&token)), 200);
}
