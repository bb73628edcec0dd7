//! Unique dispatch at the edge: the report worker's `POST /dispatch-unique`
//! sends a healthy report through `EdgeProducer::dispatch(..).unique(..)` on
//! `jobrail_edge::D1Claims`, the rule the native producer runs too
//! (`jobrail::dispatch_unique`). Requests racing on one key send one job,
//! and the worker's log shows that job ran once; another key is its own;
//! once the window ends the key sends again.
//!
//! Ignored by default: they need the worker under `wrangler dev` at
//! `EDGE_URL` with the bearer token `EDGE_TOKEN` (`tests/run` starts it and
//! runs them with `--ignored`). Each test uses its own keys and report ids,
//! so they may run in parallel with each other.

use jobrail_conformance::edge::{base, fresh, log, post, token};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long a dispatched report may take to show up settled in the log.
const PATIENCE: Duration = Duration::from_secs(60);

fn dispatch_unique(key: &str, window_ms: u64, report_id: u64) -> Value {
    post(
        "/dispatch-unique",
        json!({ "key": key, "window_ms": window_ms, "report_id": report_id }),
    )
}

/// The message id of a `{"dispatched": id}` answer.
fn dispatched(answer: &Value) -> String {
    answer["dispatched"]
        .as_str()
        .unwrap_or_else(|| panic!("expected a dispatch: {answer}"))
        .to_string()
}

/// The remaining window of a `{"duplicate": ms}` answer.
fn duplicate(answer: &Value) -> u64 {
    answer["duplicate"]
        .as_u64()
        .unwrap_or_else(|| panic!("expected a duplicate: {answer}"))
}

/// The log's outcome events for `report_id` (the worker's events carry
/// their payload): `(message id, attempt, outcome, executions)`.
fn runs_of(log: &[Value], report_id: u64) -> Vec<(String, u64, String, u64)> {
    log.iter()
        .filter_map(|entry| entry.get("event"))
        .filter(|event| event["payload"]["report_id"].as_u64() == Some(report_id))
        .map(|event| {
            (
                event["message_id"].as_str().unwrap_or_default().to_string(),
                event["attempt"].as_u64().unwrap_or(0),
                event["kind"]["event"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                event["executions"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// Waits until each report of `reports` has at least its number of events
/// in the log, lets strays (there should be none) arrive, and returns the
/// log then.
fn wait_runs(reports: &[(u64, usize)]) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let log = log();
        if reports.iter().all(|&(id, n)| runs_of(&log, id).len() >= n) {
            break;
        }
        if started.elapsed() > PATIENCE {
            let seen: Vec<_> = reports.iter().map(|&(id, _)| runs_of(&log, id)).collect();
            panic!("timed out waiting for the reports {reports:?} to run; seen: {seen:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    // The reports go to the `reports` queue, consumed in batches of up to
    // 4 within 1 s: a second message of one report would have landed by now.
    std::thread::sleep(Duration::from_secs(3));
    log()
}

/// The one run a healthy report should have: its message, on the first
/// attempt, succeeded with one execution.
fn one_run(id: &str) -> Vec<(String, u64, String, u64)> {
    vec![(id.to_string(), 1, "succeeded".to_string(), 1)]
}

/// Five requests with one key at the same moment: one sends the report,
/// four are duplicates within the window, and the report runs once. A
/// second key is independent; D1 holds the key under
/// `unique:<job name>:<key>`.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn concurrent_dispatches_of_one_key_send_one_job() {
    const WINDOW_MS: u64 = 60_000;
    let report = fresh();
    let key = format!("edge-unique:race:{report}");
    let start = Arc::new(Barrier::new(5));
    let racers: Vec<_> = (0..5)
        .map(|_| {
            let (key, start) = (key.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                dispatch_unique(&key, WINDOW_MS, report)
            })
        })
        .collect();
    let answers: Vec<Value> = racers
        .into_iter()
        .map(|racer| racer.join().expect("a racing request"))
        .collect();
    let sent: Vec<String> = answers
        .iter()
        .filter(|a| a.get("dispatched").is_some())
        .map(dispatched)
        .collect();
    assert_eq!(sent.len(), 1, "one request dispatched: {answers:?}");
    for answer in answers.iter().filter(|a| a.get("dispatched").is_none()) {
        let remaining = duplicate(answer);
        assert!(
            (WINDOW_MS / 2..=WINDOW_MS).contains(&remaining),
            "{remaining} ms of a {WINDOW_MS} ms window left: {answers:?}"
        );
    }

    // Another key, the same moment: its own window.
    let other_report = fresh();
    let other = dispatched(&dispatch_unique(
        &format!("{key}:other"),
        WINDOW_MS,
        other_report,
    ));
    assert_ne!(other, sent[0]);
    // The first key is still taken.
    duplicate(&dispatch_unique(&key, WINDOW_MS, report));

    // The key as D1 holds it: a claim on it is held for the window.
    let held = post(
        "/claims",
        json!({
            "op": "claim",
            "key": format!("unique:{}:{key}", report_job::NAME),
            "lease_ms": 1_000,
        }),
    );
    assert_eq!(held["claim"], "held", "{held}");

    let log = wait_runs(&[(report, 1), (other_report, 1)]);
    assert_eq!(runs_of(&log, report), one_run(&sent[0]), "the raced report");
    assert_eq!(
        runs_of(&log, other_report),
        one_run(&other),
        "the other key"
    );
}

/// With a 1.5 s window: a second request within it is a duplicate; once it
/// has ended, the key sends again, a new message, and each runs once.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn a_key_dispatches_again_after_its_window() {
    const WINDOW_MS: u64 = 1_500;
    let report = fresh();
    let key = format!("edge-unique:window:{report}");
    let sent_at = Instant::now();
    let first = dispatched(&dispatch_unique(&key, WINDOW_MS, report));
    let answered = Instant::now();
    let remaining = duplicate(&dispatch_unique(&key, WINDOW_MS, report));
    assert!(
        remaining <= WINDOW_MS,
        "{remaining} ms of a {WINDOW_MS} ms window left"
    );
    // The window began before the first answer: past it by then plus the
    // window (and a margin for the rounding of the database's clock).
    let ended = answered + Duration::from_millis(WINDOW_MS + 200);
    std::thread::sleep(ended.saturating_duration_since(Instant::now()));
    let second = dispatched(&dispatch_unique(&key, WINDOW_MS, report));
    assert_ne!(first, second, "a new message");
    assert!(sent_at.elapsed() >= Duration::from_millis(WINDOW_MS));

    let log = wait_runs(&[(report, 2)]);
    let mut runs = runs_of(&log, report);
    runs.sort();
    let mut expected = [one_run(&first), one_run(&second)].concat();
    expected.sort();
    assert_eq!(runs, expected, "each dispatch ran once");
}

/// A window the store refuses sends nothing; a malformed request is
/// refused with 400, one without the token with 401.
#[test]
#[ignore = "needs the report worker under wrangler dev (EDGE_URL, EDGE_TOKEN)"]
fn refused_windows_send_nothing() {
    let report = fresh();
    let key = format!("edge-unique:refused:{report}");
    let zero = dispatch_unique(&key, 0, report);
    assert_eq!(zero["error"], "invalid", "{zero}");
    // The refusal took nothing: the key dispatches at once.
    let sent = dispatched(&dispatch_unique(&key, 60_000, report));
    let log = wait_runs(&[(report, 1)]);
    assert_eq!(runs_of(&log, report), one_run(&sent));

    let status = |body: Value, token: Option<&str>| {
        let mut request = ureq::post(&format!("{}/dispatch-unique", base()));
        if let Some(token) = token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        match request.send_json(body) {
            Ok(response) => response.status(),
            Err(ureq::Error::Status(status, _)) => status,
            Err(e) => panic!("POST /dispatch-unique: {e}"),
        }
    };
    let token = token();
    for malformed in [
        json!({ "key": key, "report_id": report }),
        json!({ "key": key, "window_ms": -5, "report_id": report }),
        json!({ "window_ms": 1000, "report_id": report }),
    ] {
        assert_eq!(status(malformed.clone(), Some(&token)), 400, "{malformed}");
    }
    let fine = json!({ "key": key, "window_ms": 60_000, "report_id": report });
    assert_eq!(status(fine.clone(), None), 401);
    assert_eq!(status(fine, Some("wrong")), 401);
}
