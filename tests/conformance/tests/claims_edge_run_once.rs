//! A handler's view of claims at the edge: the report worker's `POST
//! /claims/run-once` runs `jobrail::run_once` on `jobrail_edge::D1Claims`,
//! the same call as natively, with an effect that appends a row to a D1
//! table. Invocations racing on one key run the effect once. `POST
//! /claims/complete-with` completes a claim together with rows of that
//! table in one D1 batch (`D1Claims::complete_with`): a lost claim writes
//! none of them. Held claims count down on the database's clock.
//!
//! Ignored by default: they need the worker under `wrangler dev` at
//! `EDGE_URL` with the bearer token `EDGE_TOKEN` (`tests/run` starts it
//! and runs them with `--ignored`).

use jobrail_conformance::edge::{base, fresh, post, token};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A key no other run used (the worker's D1 persists between runs).
fn fresh_key(what: &str) -> String {
    format!("edge-run-once:{what}:{}", fresh())
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

/// One claim through `POST /claims`.
fn claim(key: &str, lease_ms: u64) -> Value {
    post(
        "/claims",
        json!({ "op": "claim", "key": key, "lease_ms": lease_ms }),
    )
}

/// `complete_with` through `POST /claims/complete-with`: `rows` effect
/// rows, and a failing statement after them when `fail`.
fn complete_with(key: &str, fence: u64, rows: u32, fail: bool) -> Value {
    post(
        "/claims/complete-with",
        json!({ "key": key, "fence": fence, "effects": rows, "fail": fail }),
    )
}

fn fence_of(answer: &Value) -> u64 {
    assert_eq!(answer["claim"], "claimed", "{answer}");
    answer["fence"].as_u64().expect("a fence")
}

/// A live claim commits its completion and every effect row at once; a
/// fence never given, a failing effect, or a second completion of the same
/// fence commits nothing, and only the first two leave the claim held.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn completion_with_effects_commits_both_or_neither() {
    let key = fresh_key("complete-with");
    let fence = fence_of(&claim(&key, 30_000));

    let stranger = complete_with(&key, fence + 1, 2, false);
    assert_eq!(stranger["error"], "lost", "{stranger}");
    assert!(effects(&key).is_empty(), "a lost claim wrote effects");

    // An effect that fails takes the completion down with it.
    let failed = complete_with(&key, fence, 2, true);
    assert_eq!(failed["error"], "store", "{failed}");
    assert!(
        failed["message"]
            .as_str()
            .is_some_and(|m| m.contains("claim_effects.fence")),
        "the effect's own error: {failed}"
    );
    assert!(effects(&key).is_empty(), "a failed batch wrote effects");
    let held = claim(&key, 30_000);
    assert_eq!(
        held["claim"], "held",
        "still held after the failure: {held}"
    );

    let done = complete_with(&key, fence, 2, false);
    assert_eq!(done, json!({ "ok": true, "inserted": 2 }));
    let recorded = effects(&key);
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    assert!(recorded.iter().all(|e| e["fence"].as_u64() == Some(fence)));
    assert_eq!(claim(&key, 30_000), json!({ "claim": "done" }));

    // The same completion again (a retry of a lost answer): nothing more.
    let again = complete_with(&key, fence, 2, false);
    assert_eq!(again["error"], "lost", "{again}");
    assert_eq!(effects(&key).len(), 2);
}

/// A claim whose lease ended, one a newer claim took over, and one never
/// given all answer `lost` and write no effect; the newer holder's
/// completion writes its own.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn a_lost_claim_writes_no_effect() {
    let key = fresh_key("complete-with-lost");
    let first = fence_of(&claim(&key, 300));
    std::thread::sleep(Duration::from_millis(800));
    let expired = complete_with(&key, first, 1, false);
    assert_eq!(expired["error"], "lost", "{expired}");
    assert!(effects(&key).is_empty(), "an expired claim wrote effects");

    // The key was not done: the next claim takes it with a higher fence,
    // and the old holder still cannot complete.
    let second = fence_of(&claim(&key, 30_000));
    assert!(second > first, "{second} after {first}");
    let stale = complete_with(&key, first, 1, false);
    assert_eq!(stale["error"], "lost", "{stale}");
    assert!(effects(&key).is_empty(), "a stale holder wrote effects");
    assert_eq!(
        complete_with(&key, second, 1, false),
        json!({ "ok": true, "inserted": 1 })
    );
    let recorded = effects(&key);
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0]["fence"].as_u64(), Some(second));

    // A key nobody claimed: lost, no effect, and no row left behind (its
    // first claim gets fence 1).
    let unclaimed = fresh_key("complete-with-unclaimed");
    let never = complete_with(&unclaimed, 1, 1, false);
    assert_eq!(never["error"], "lost", "{never}");
    assert!(effects(&unclaimed).is_empty());
    assert_eq!(fence_of(&claim(&unclaimed, 1_000)), 1);
}

/// A held claim's remaining time counts down with the lease: never more
/// than what was left when the request went out, never negative, and the
/// key is taken again once the lease has run out, not before.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn held_claims_count_down_on_the_databases_clock() {
    const LEASE_MS: u64 = 2_000;
    // The worker's database and this test read the same machine's clock;
    // allow for the rounding to milliseconds on each side.
    const TOLERANCE_MS: u64 = 5;
    let key = fresh_key("countdown");
    let sent = Instant::now();
    fence_of(&claim(&key, LEASE_MS));
    let claimed = Instant::now();
    let mut helds = 0;
    loop {
        let asked = Instant::now();
        let answer = claim(&key, LEASE_MS);
        let answered = Instant::now();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap();
        match answer["claim"].as_str() {
            Some("held") => {
                helds += 1;
                let remaining = answer["remaining_ms"].as_u64().expect("remaining_ms");
                // The lease began between `sent` and `claimed`, and this
                // claim ran between `asked` and `answered`.
                let most = LEASE_MS.saturating_sub(ms(asked - claimed));
                let least = LEASE_MS.saturating_sub(ms(answered - sent));
                assert!(
                    remaining <= most + TOLERANCE_MS && remaining + TOLERANCE_MS >= least,
                    "{remaining} ms left, expected {least}..={most}"
                );
            }
            Some("claimed") => {
                assert!(
                    ms(answered - sent) + TOLERANCE_MS >= LEASE_MS,
                    "taken again {} ms after a {LEASE_MS} ms lease began",
                    ms(answered - sent)
                );
                break;
            }
            _ => panic!("unexpected answer {answer}"),
        }
        assert!(
            asked - sent < Duration::from_secs(10),
            "the key was never taken again"
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    assert!(helds >= 5, "only {helds} answers while the lease ran");
}
