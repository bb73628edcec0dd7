//! One scenario, two ways: natively under `jobrail_edge::testing` (Cloudflare
//! Queues' rules on a virtual clock) and on this worker under
//! `wrangler dev`. Per message, the settlements must be the same: the
//! attempts, the outcome of each, the handler executions, and each retry's
//! delay in whole seconds (as the platform takes `delaySeconds`). Under
//! `wrangler dev`, each redelivery must also come no sooner than the delay
//! asked for.
//!
//! The edge half is ignored by default; `tests/run` starts the worker and
//! runs it with `EDGE_URL` (the worker), `EDGE_TOKEN` (its `SEND_TOKEN` and
//! `FAILURES_TOKEN`, the secrets of the template's routes) and `EDGE_LOG`
//! (the `wrangler dev` output, where the settlement lines are read). The
//! messages go in through the worker's own `POST /send`, and the permanent
//! failure's record is read back through its own `/failures`.
#![cfg(not(target_arch = "wasm32"))]

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jobrail_edge::testing::CloudflareQueues;
use serde_json::Value;

use invoice_worker::{job, jobs, MailServer, SendInvoice, OPTIONS};

const PATIENCE: Duration = Duration::from_secs(90);

/// The messages, in the order they are sent.
fn scenario() -> Vec<SendInvoice> {
    [
        MailServer::Up,
        MailServer::DownTwice,
        MailServer::RefusesAddress,
        MailServer::OtherTenant,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, mail_server)| SendInvoice {
        invoice: 1000 + i as u64,
        mail_server,
    })
    .collect()
}

/// One accepted settlement, as compared.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Settlement {
    attempt: u64,
    outcome: String,
    executions: u64,
    /// A retry's delay, rounded up to whole seconds.
    retry_delay_s: Option<u64>,
}

impl Settlement {
    /// From an event's JSON (`jobrail::Event`, as the edge logs it).
    fn of(event: &Value) -> Settlement {
        let kind = &event["kind"];
        let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
        let (outcome, retry_delay_s) = match kind["event"].as_str().unwrap_or_default() {
            "succeeded" => (
                format!("succeeded:{}", text(&kind["resolution"]["tier"])),
                None,
            ),
            "retried" => {
                let delay = &kind["delay"];
                let nanos = delay["secs"].as_u64().unwrap_or(0) * 1_000_000_000
                    + delay["nanos"].as_u64().unwrap_or(0);
                ("retried".to_string(), Some(nanos.div_ceil(1_000_000_000)))
            }
            "failed" => (format!("failed:{}", text(&kind["failure"]["kind"])), None),
            other => (other.to_string(), None),
        };
        Settlement {
            attempt: event["attempt"].as_u64().unwrap_or(0),
            outcome,
            executions: event["executions"].as_u64().unwrap_or(0),
            retry_delay_s,
        }
    }

    fn is_terminal(&self) -> bool {
        self.outcome != "retried"
    }
}

/// The scenario under the native harness: settlements per message, in
/// scenario order.
fn native() -> Vec<Vec<Settlement>> {
    let mut cf = CloudflareQueues::new(include_str!("../wrangler.toml"), jobs, OPTIONS).unwrap();
    let job = job().unwrap();
    let ids: Vec<String> = scenario().iter().map(|s| cf.send(&job, s)).collect();
    cf.run_until_idle();
    ids.iter()
        .map(|id| {
            let message = cf.message(id);
            let settlements: Vec<Settlement> = message
                .events()
                .filter(|e| e.refused.is_none())
                .map(|e| Settlement::of(&serde_json::to_value(&e.event).unwrap()))
                .collect();
            // The delays the harness asked the platform for are the events'.
            let asked: Vec<Option<u64>> = message
                .retry_delays()
                .into_iter()
                .map(|d| d.map(u64::from))
                .collect();
            let logged: Vec<Option<u64>> = settlements
                .iter()
                .filter(|s| !s.is_terminal())
                .map(|s| s.retry_delay_s)
                .collect();
            assert_eq!(asked, logged, "message {id}");
            settlements
        })
        .collect()
}

#[test]
fn the_scenario_settles_natively_as_the_job_says() {
    let got = native();
    let s = |attempt, outcome: &str, retry_delay_s| Settlement {
        attempt,
        outcome: outcome.to_string(),
        executions: 1,
        retry_delay_s,
    };
    assert_eq!(
        got,
        vec![
            vec![s(1, "succeeded:first_attempt", None)],
            vec![
                s(1, "retried", Some(1)),
                s(2, "retried", Some(2)),
                s(3, "succeeded:tier_two", None),
            ],
            vec![s(1, "failed:permanent", None)],
            vec![s(1, "rejected", None)],
        ]
    );
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set (tests/run sets it)"))
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// What the worker logged for each message so far: jobrail-edge's own
/// settlement lines, and this worker's timed ones (ms, settlement).
#[derive(Default)]
struct EdgeLog {
    settled: BTreeMap<String, Vec<Settlement>>,
    timed: BTreeMap<String, Vec<(u64, Settlement)>>,
}

fn read_log(path: &str) -> EdgeLog {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut log = EdgeLog::default();
    // Only whole lines: the last one may still be being written.
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    for line in complete.lines() {
        if let Some(json) = line.strip_prefix("jobrail-edge settlement ") {
            if let Ok(event) = serde_json::from_str::<Value>(json) {
                let id = event["message_id"].as_str().unwrap_or_default().to_string();
                log.settled
                    .entry(id)
                    .or_default()
                    .push(Settlement::of(&event));
            }
        } else if let Some(rest) = line.strip_prefix("invoice-worker settled ") {
            let (at, json) = rest.split_once(' ').unwrap_or_default();
            if let (Ok(at), Ok(event)) = (at.parse::<u64>(), serde_json::from_str::<Value>(json)) {
                let id = event["message_id"].as_str().unwrap_or_default().to_string();
                log.timed
                    .entry(id)
                    .or_default()
                    .push((at, Settlement::of(&event)));
            }
        }
    }
    log
}

#[test]
#[ignore = "needs the worker under `wrangler dev` (tests/run)"]
fn the_same_scenario_settles_the_same_under_wrangler_dev() {
    let expected = native();
    let (url, token, log_path) = (env("EDGE_URL"), env("EDGE_TOKEN"), env("EDGE_LOG"));
    let started_ms: Option<u128> = std::env::var("TEMPLATE_STARTED_MS")
        .ok()
        .and_then(|t| t.parse().ok());

    let body = serde_json::to_value(scenario()).unwrap();
    match ureq::post(&format!("{url}/send")).send_json(body.clone()) {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("POST /send without the token: {other:?}"),
    }
    let sent: Value = ureq::post(&format!("{url}/send"))
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(body)
        .expect("POST /send")
        .into_json()
        .expect("the message ids");
    let ids: Vec<String> = serde_json::from_value(sent["ids"].clone()).expect("ids");
    assert_eq!(ids.len(), expected.len());

    let started = Instant::now();
    let mut first_retry_seen = None;
    let log = loop {
        let log = read_log(&log_path);
        let retried = ids.iter().any(|id| {
            log.settled
                .get(id)
                .is_some_and(|s| s.iter().any(|s| !s.is_terminal()))
        });
        if retried && first_retry_seen.is_none() {
            first_retry_seen = Some(now_ms());
        }
        let done = ids.iter().all(|id| {
            let settled = log
                .settled
                .get(id)
                .is_some_and(|s| s.iter().any(Settlement::is_terminal));
            let timed = log
                .timed
                .get(id)
                .is_some_and(|s| s.iter().any(|(_, s)| s.is_terminal()));
            settled && timed
        });
        if done {
            break log;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "no terminal outcome for every message within {PATIENCE:?}; so far: {:#?}",
            ids.iter().map(|id| log.settled.get(id)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    };

    for ((id, want), sent) in ids.iter().zip(&expected).zip(scenario()) {
        let got = &log.settled[id];
        assert_eq!(
            got, want,
            "{sent:?} ({id}): wrangler dev vs the native harness"
        );
        let timed: Vec<&Settlement> = log.timed[id].iter().map(|(_, s)| s).collect();
        assert_eq!(
            timed,
            want.iter().collect::<Vec<_>>(),
            "{id}: the timed log"
        );
        for pair in log.timed[id].windows(2) {
            let ((at, before), (next_at, _)) = (&pair[0], &pair[1]);
            let delay_ms = before.retry_delay_s.expect("a redelivery follows a retry") * 1000;
            let gap = next_at - at;
            println!(
                "invoice {} attempt {} -> {}: asked {delay_ms} ms, redelivered after {gap} ms",
                sent.invoice,
                before.attempt,
                before.attempt + 1
            );
            assert!(
                gap >= delay_ms,
                "{id}: redelivered after {gap} ms, asked {delay_ms} ms"
            );
        }
    }
    println!(
        "wrangler dev settled the scenario as the native harness did ({} messages, {:.1} s)",
        ids.len(),
        started.elapsed().as_secs_f64()
    );
    failure_records_through_the_workers_own_routes(&url, &token, &ids);
    if let (Some(t0), Some(seen)) = (started_ms, first_retry_seen) {
        println!(
            "template to first retry observed: {:.1} s",
            (seen - t0) as f64 / 1000.0
        );
    }
}

/// The permanent failure's record, kept by the template's failure keeper in
/// D1, read through the worker's own `/failures` routes: listed, shown by
/// its message id; the routes refuse a request without the token.
fn failure_records_through_the_workers_own_routes(url: &str, token: &str, ids: &[String]) {
    let refused = scenario()
        .iter()
        .position(|s| s.mail_server == MailServer::RefusesAddress)
        .expect("one refused address");
    let get = |path: &str| -> Value {
        ureq::get(&format!("{url}{path}"))
            .set("Authorization", &format!("Bearer {token}"))
            .call()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .into_json()
            .expect("JSON")
    };
    let started = Instant::now();
    let listed = loop {
        let page = get("/failures?limit=100");
        let entries = page["entries"].as_array().cloned().unwrap_or_default();
        if let Some(entry) = entries
            .into_iter()
            .find(|e| e["message_id"].as_str() == Some(ids[refused].as_str()))
        {
            break entry;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "the refused invoice's record never reached /failures: {page}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(listed["kind"], "permanent", "{listed}");
    assert_eq!(listed["job"], "send-invoice", "{listed}");
    let shown = get(&format!("/failures/{}", ids[refused]));
    assert_eq!(shown["id"], listed["id"], "{shown}");
    assert!(
        shown["record"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("refuses the address")),
        "{shown}"
    );
    match ureq::get(&format!("{url}/failures")).call() {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("GET /failures without the token: {other:?}"),
    }
    println!(
        "the failure record of {} read through the worker's own /failures",
        ids[refused]
    );
}
