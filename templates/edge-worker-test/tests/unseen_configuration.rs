//! The worker started from a configuration its wrangler.toml check never
//! saw: `tests/run` runs the bundle it built under `wrangler dev` with
//! another configuration, outside the worker's directory and without the
//! build command, whose consumer would let the platform drop a message
//! (`max_retries = 1`, no dead-letter queue). The worker must not run its
//! handlers there: it hands every message back (for hours) and says why,
//! and nothing is dropped. Its `/failures` route is off, its secret unset.
//!
//! Ignored by default; `tests/run` sets `EDGE_URL`, `EDGE_TOKEN` (the
//! `SEND_TOKEN`) and `EDGE_LOG` (the `wrangler dev` output).
#![cfg(not(target_arch = "wasm32"))]

use std::time::{Duration, Instant};

use invoice_worker::{MailServer, SendInvoice};
use serde_json::Value;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set (tests/run sets it)"))
}

#[test]
#[ignore = "needs the worker under `wrangler dev` with an unchecked configuration (tests/run)"]
fn a_configuration_the_check_never_saw_runs_no_handler() {
    let (url, token, log_path) = (env("EDGE_URL"), env("EDGE_TOKEN"), env("EDGE_LOG"));
    // Off: the secret is not set in this configuration.
    match ureq::get(&format!("{url}/failures"))
        .set("Authorization", &format!("Bearer {token}"))
        .call()
    {
        Err(ureq::Error::Status(404, _)) => {}
        other => panic!("GET /failures without its secret set: {other:?}"),
    }
    let invoice = SendInvoice {
        invoice: 7,
        mail_server: MailServer::DownTwice,
    };
    let sent: Value = ureq::post(&format!("{url}/send"))
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(serde_json::to_value([invoice]).unwrap())
        .expect("POST /send")
        .into_json()
        .expect("the message ids");
    let id = sent["ids"][0].as_str().expect("an id").to_string();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let started = Instant::now();
    while !log().contains("never saw") {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the worker never refused the configuration:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Time for the platform to drop it, had the worker run the handler
    // (it fails twice, and this consumer allows two deliveries).
    std::thread::sleep(Duration::from_secs(6));
    let text = log();
    let refusal = text
        .lines()
        .find(|l| l.contains("never saw"))
        .expect("the refusal");
    assert!(refusal.contains("handed back"), "{refusal}");
    assert!(
        !text.contains("invoice-worker settled"),
        "a handler ran:\n{text}"
    );
    assert!(
        !text.contains("Dropped message"),
        "the platform dropped a message:\n{text}"
    );
    println!("message {id}: not run, handed back: {refusal}");
}
