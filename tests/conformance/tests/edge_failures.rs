//! The edge's failure records: the report worker under `wrangler dev`, whose
//! failure keeper (`jobrail_edge::failures`) stores what arrives on
//! `reports-failed` in D1 (local under `wrangler dev`) and serves it under
//! `/failures`. Jobs are made to fail for good through `POST /dispatch`;
//! everything else goes through the operator routes, and what a replay did
//! is read from the worker's KV log and from the records it produced.
//!
//! Run like `edge.rs`: `--ignored --test-threads=1` against `EDGE_URL`, with
//! `EDGE_TOKEN` (the test routes' token) and the keeper's token
//! `EDGE_FAILURES_TOKEN` (the worker's `FAILURES_TOKEN`; `EDGE_TOKEN` when
//! unset). The tests share one store, so they must not overlap.

use jobrail_conformance::edge::{base, fresh, log, token};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

const PATIENCE: Duration = Duration::from_secs(60);

fn keeper_token() -> String {
    std::env::var("EDGE_FAILURES_TOKEN").unwrap_or_else(|_| token())
}

/// A request to the keeper's routes with `auth` as the bearer token (`None`:
/// no header): the status and the JSON answer.
fn call_as(method: &str, path: &str, auth: Option<&str>) -> (u16, Value) {
    let mut request = ureq::request(method, &format!("{}{path}", base()));
    if let Some(auth) = auth {
        request = request.set("Authorization", &format!("Bearer {auth}"));
    }
    let response = match request.call() {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let status = response.status();
    let text = response.into_string().expect("a body");
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

fn call(method: &str, path: &str) -> (u16, Value) {
    call_as(method, path, Some(&keeper_token()))
}

fn ok(method: &str, path: &str) -> Value {
    let (status, body) = call(method, path);
    assert_eq!(status, 200, "{method} {path}: {body}");
    body
}

fn dispatch(body: Value) -> Value {
    ureq::post(&format!("{}/dispatch", base()))
        .set("Authorization", &format!("Bearer {}", token()))
        .send_json(body)
        .unwrap_or_else(|e| panic!("POST /dispatch: {e}"))
        .into_json()
        .expect("JSON answer")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Dispatches reports that fail for good on their first delivery; returns
/// their message ids.
fn fail_reports(count: usize) -> Vec<String> {
    let reports: Vec<Value> = (0..count)
        .map(|_| json!({ "report_id": fresh(), "behaviour": "missing" }))
        .collect();
    dispatch(json!({ "reports": reports }))["reports"]
        .as_array()
        .expect("message ids")
        .iter()
        .map(|id| id.as_str().unwrap().to_string())
        .collect()
}

/// Every entry, page by page (`limit` a page), checking the pages chain.
fn all_entries(limit: u32) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            None => format!("/failures?limit={limit}"),
            Some(cursor) => format!("/failures?limit={limit}&after={cursor}"),
        };
        let page = ok("GET", &path);
        let got = page["entries"].as_array().expect("entries").clone();
        assert!(got.len() <= limit as usize, "{page}");
        entries.extend(got);
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => {
                assert_eq!(
                    page["total"].as_u64(),
                    Some(entries.len() as u64),
                    "the pages hold every entry once"
                );
                return entries;
            }
        }
    }
}

/// Waits until an entry satisfies `found` for each of `wanted` and returns them.
fn wait_entries(what: &str, wanted: usize, found: impl Fn(&Value) -> bool) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let matching: Vec<Value> = all_entries(50).into_iter().filter(|e| found(e)).collect();
        if matching.len() >= wanted {
            return matching;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "waited {PATIENCE:?} for {wanted} entries ({what}); found {}",
            matching.len()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn with_message(id: &str) -> impl Fn(&Value) -> bool + '_ {
    move |e| e["message_id"].as_str() == Some(id)
}

/// The outcome events of message `id` in the worker's log.
fn outcomes(id: &str) -> Vec<Value> {
    log()
        .into_iter()
        .filter_map(|e| e.get("event").cloned())
        .filter(|e| e["message_id"].as_str() == Some(id))
        .collect()
}

fn wait_outcome(id: &str) -> Vec<Value> {
    let started = Instant::now();
    loop {
        let events = outcomes(id);
        if !events.is_empty() {
            return events;
        }
        assert!(started.elapsed() < PATIENCE, "no outcome for `{id}`");
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn routes_need_the_operators_token() {
    assert_eq!(call_as("GET", "/failures", None).0, 401);
    assert_eq!(call_as("GET", "/failures", Some("wrong")).0, 401);
    assert_eq!(
        call_as("DELETE", "/failures?all=true", Some("wrong")).0,
        401
    );
    // A refused request does not say whether the route exists.
    assert_eq!(call_as("GET", "/failures/a/b/c", None).0, 401);
    assert_eq!(call("GET", "/failures/a/b/c").0, 404);
    assert_eq!(call("DELETE", "/failures").0, 400);
    assert_eq!(call("GET", "/failures?after=nope").0, 400);
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn failed_jobs_are_listed_oldest_first_and_shown() {
    let ids = fail_reports(3);
    for id in &ids {
        wait_entries("a failed report", 1, with_message(id));
    }
    // Pages of two chain through every entry, oldest first.
    let entries = all_entries(2);
    let times: Vec<u64> = entries
        .iter()
        .map(|e| e["failed_at_ms"].as_u64().unwrap())
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "oldest first: {times:?}"
    );
    for id in &ids {
        let entry = entries.iter().find(|e| with_message(id)(e)).unwrap();
        let record_id = entry["id"].as_str().unwrap();
        assert_eq!(entry["kind"], "permanent", "{entry}");
        assert_eq!(entry["queue"], "reports");
        assert_eq!(entry["poison"], Value::Null);
        assert_eq!(entry["record"]["envelope"]["id"], id.as_str());
        // By record id and by message id: the same entry.
        let by_record = ok("GET", &format!("/failures/{record_id}"));
        let by_message = ok("GET", &format!("/failures/{id}"));
        assert_eq!(by_record, by_message);
        assert_eq!(by_record["record"]["reason"], entry["record"]["reason"]);
    }
    let (status, body) = call("GET", "/failures/no-such-record");
    assert_eq!(status, 404, "{body}");
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn a_replay_runs_the_job_again_and_names_the_record() {
    let id = fail_reports(1).remove(0);
    let entry = wait_entries("a failed report", 1, with_message(&id)).remove(0);
    let record_id = entry["id"].as_str().unwrap().to_string();
    let replayed = ok("POST", &format!("/failures/{record_id}/replay"));
    let new_id = format!("replay-{record_id}");
    assert_eq!(
        replayed,
        json!({ "entry_id": record_id, "message_id": new_id, "queue": "reports" })
    );
    // The entry is gone, and a second replay finds nothing.
    assert_eq!(call("GET", &format!("/failures/{record_id}")).0, 404);
    assert_eq!(
        call("POST", &format!("/failures/{record_id}/replay")).0,
        404
    );
    // It ran again as a new message (attempts from 1), and failed again.
    let events = wait_outcome(&new_id);
    assert_eq!(events[0]["attempt"], 1, "{events:?}");
    // The new record's envelope names the one it was replayed from.
    let again = wait_entries("the replay's record", 1, with_message(&new_id)).remove(0);
    let metadata = &again["record"]["envelope"]["metadata"];
    assert_eq!(metadata["replay_of"], record_id.as_str(), "{again}");
    assert_eq!(metadata["replay_of_message"], id.as_str());
    let at: u64 = metadata["replayed_at_ms"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(at.abs_diff(now_ms()) < 120_000, "replayed_at_ms {at}");
    assert_eq!(
        again["record"]["envelope"]["payload"],
        entry["record"]["envelope"]["payload"]
    );
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn concurrent_replays_of_one_record_send_one_copy() {
    let id = fail_reports(1).remove(0);
    let entry = wait_entries("a failed report", 1, with_message(&id)).remove(0);
    let record_id = entry["id"].as_str().unwrap().to_string();
    let path = format!("/failures/{record_id}/replay");
    let barrier = std::sync::Barrier::new(8);
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    call("POST", &path).0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "exactly one replay sends: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 404),
        "{statuses:?}"
    );
    let new_id = format!("replay-{record_id}");
    wait_outcome(&new_id);
    wait_entries("the replay's record", 1, with_message(&new_id));
    // Time for a second copy, had one been sent, to run and be recorded.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(outcomes(&new_id).len(), 1, "one copy ran");
    let records: Vec<Value> = all_entries(50)
        .into_iter()
        .filter(|e| with_message(&new_id)(e))
        .collect();
    assert_eq!(records.len(), 1, "one copy failed: {records:?}");
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn poison_is_kept_refused_and_sent_only_when_forced() {
    // A malformed envelope: its record keeps the raw body.
    let raw = format!("{{not an envelope {}", fresh());
    dispatch(json!({ "raw": [raw.clone()] }));
    let is_raw = |raw: String| {
        move |e: &Value| e["record"]["raw_body"]["data"].as_str() == Some(raw.as_str())
    };
    let entry = wait_entries("the malformed message's record", 1, is_raw(raw.clone())).remove(0);
    assert_eq!(entry["kind"], "malformed_envelope", "{entry}");
    let entry_id = entry["id"].as_str().unwrap().to_string();
    let (status, refused) = call("POST", &format!("/failures/{entry_id}/replay"));
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused["error"].as_str().unwrap().contains("poison"),
        "{refused}"
    );
    // Refused: still there, and free for the forced replay.
    ok("GET", &format!("/failures/{entry_id}"));
    let forced = ok("POST", &format!("/failures/{entry_id}/replay?force=true"));
    assert_eq!(forced["queue"], "reports");
    // The same bytes went back to `reports` and failed the same way again.
    let again = wait_entries("the forced replay's record", 1, |e| {
        is_raw(raw.clone())(e) && e["id"].as_str() != Some(entry_id.as_str())
    });
    assert_eq!(again[0]["kind"], "malformed_envelope");

    // A body on the failure queue that is not a record at all is kept.
    let text = format!("not a record {}", fresh());
    dispatch(json!({ "failed_raw": [text.clone()] }));
    let is_text = |text: String| move |e: &Value| e["body"]["data"].as_str() == Some(text.as_str());
    let entry = wait_entries("the failure queue's stray body", 1, is_text(text.clone())).remove(0);
    assert_eq!(entry["record"], Value::Null, "{entry}");
    assert_eq!(entry["poison"], "the entry is not a failure record");
    let entry_id = entry["id"].as_str().unwrap().to_string();
    assert_eq!(call("POST", &format!("/failures/{entry_id}/replay")).0, 409);
    let (status, body) = call("POST", &format!("/failures/{entry_id}/replay?force=true"));
    assert_eq!(status, 422, "no queue named: {body}");
    let sent = ok(
        "POST",
        &format!("/failures/{entry_id}/replay?force=true&queue=reports"),
    );
    assert_eq!(sent["queue"], "reports");
    // Sent to `reports`, where it is not an envelope either.
    let record = wait_entries("the stray body's record", 1, is_raw(text)).remove(0);
    assert_eq!(record["kind"], "malformed_envelope");
    assert_eq!(call("GET", &format!("/failures/{entry_id}")).0, 404);
}

#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn purge_one_older_than_and_all() {
    let first = fail_reports(2);
    for id in &first {
        wait_entries("a failed report", 1, with_message(id));
    }
    std::thread::sleep(Duration::from_millis(50));
    let cut = now_ms();
    std::thread::sleep(Duration::from_millis(50));
    let later = fail_reports(2);
    for id in &later {
        wait_entries("a failed report", 1, with_message(id));
    }
    dispatch(json!({ "failed_raw": [format!("stray {}", fresh())] }));
    wait_entries("a stray body", 1, |e| e["record"].is_null());

    // One, by message id.
    assert_eq!(
        ok("DELETE", &format!("/failures/{}", later[0])),
        json!({ "purged": 1 })
    );
    assert_eq!(call("GET", &format!("/failures/{}", later[0])).0, 404);
    assert_eq!(call("DELETE", &format!("/failures/{}", later[0])).0, 404);

    // Older than the cut: the first two go (and older records of earlier
    // tests), the later one and entries that are not records stay.
    let before = all_entries(50);
    let older = before
        .iter()
        .filter(|e| !e["record"].is_null() && e["failed_at_ms"].as_u64().unwrap() < cut)
        .count() as u64;
    assert!(older >= 2, "{before:?}");
    assert_eq!(
        ok("DELETE", &format!("/failures?older_than_ms={cut}")),
        json!({ "purged": older })
    );
    let after = all_entries(50);
    for id in &first {
        assert!(!after.iter().any(with_message(id)), "{id} purged");
    }
    assert!(
        after.iter().any(with_message(&later[1])),
        "the later one stays"
    );
    assert!(
        after.iter().any(|e| e["record"].is_null()),
        "a stray body has no time: it stays"
    );

    // All.
    assert_eq!(
        ok("DELETE", "/failures?all=true"),
        json!({ "purged": after.len() })
    );
    let page = ok("GET", "/failures");
    assert_eq!(page["total"], 0, "{page}");
    assert_eq!(page["entries"], json!([]));
}

/// A body that is not an envelope, sent through the queue binding at the
/// platform's limit (128,000 bytes, escaped into a record a third larger),
/// fails once with a record cut to fit the failure queue: the body's first
/// bytes with its length and digest; one just under half the limit keeps
/// its record whole. Both reach the keeper; neither is refused or comes back.
#[test]
#[ignore = "needs the report worker under wrangler dev (tests/run)"]
fn poison_at_the_size_limit_keeps_a_record_that_fits() {
    let tag = format!("{{\"size-limit {}\": \"", fresh());
    let body = |n: usize| -> String { tag.chars().chain("\"q".chars().cycle()).take(n).collect() };
    let (small, large) = (body(60_000), body(jobrail_edge::MAX_MESSAGE_BYTES));
    assert_eq!(large.len(), jobrail_edge::MAX_MESSAGE_BYTES);
    dispatch(json!({ "raw": [small.clone(), large.clone()] }));
    // The body a record keeps, whichever encoding it chose.
    let kept = |e: &Value| -> Option<Vec<u8>> {
        serde_json::from_value::<jobrail::RawBody>(e["record"]["raw_body"].clone())
            .ok()
            .map(|raw| raw.to_bytes())
    };
    let mine = |e: &Value| kept(e).is_some_and(|bytes| bytes.starts_with(tag.as_bytes()));
    let entries = wait_entries("the two records", 2, mine);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        all_entries(50).into_iter().filter(|e| mine(e)).count(),
        2,
        "one record each, none repeated"
    );
    for entry in entries {
        let record = &entry["record"];
        assert_eq!(record["kind"], "malformed_envelope", "{entry}");
        let text = serde_json::to_string(record).unwrap();
        assert!(
            text.len() <= jobrail_edge::FAILURE_RECORD_BYTES,
            "a record of {} bytes",
            text.len()
        );
        let bytes = kept(&entry).unwrap();
        match record.get("truncated").filter(|t| !t.is_null()) {
            None => assert_eq!(bytes, small.as_bytes(), "kept whole"),
            Some(t) => {
                assert_eq!(t["body_bytes"], large.len(), "{t}");
                assert_eq!(t["kept_bytes"], bytes.len(), "{t}");
                assert!(large.as_bytes().starts_with(&bytes), "the prefix");
                assert!(bytes.len() > large.len() / 2, "{} kept", bytes.len());
                assert_eq!(t["body_sha256"].as_str().map(str::len), Some(64));
            }
        }
    }
}
