//! The job under Cloudflare Queues' delivery rules, natively and on a
//! virtual clock: `cargo test`, no wrangler, no waiting for backoff.
#![cfg(not(target_arch = "wasm32"))]

use jobrail::FailureKind;
use jobrail_edge::testing::{CloudflareQueues, MessageState};

use edge_worker::{job, jobs, WelcomeEmail, OPTIONS};

fn queues() -> CloudflareQueues {
    CloudflareQueues::new(include_str!("../wrangler.toml"), jobs, OPTIONS).unwrap()
}

fn email(address: &str) -> WelcomeEmail {
    WelcomeEmail {
        user_id: 7,
        address: address.into(),
    }
}

#[test]
fn a_welcome_email_is_sent_once() {
    let mut cf = queues();
    let id = cf.send(&job().unwrap(), &email("ada@example.com"));
    cf.run_until_idle();
    assert_eq!(cf.state(&id), &MessageState::Acked);
    assert_eq!(cf.message(&id).attempts(), [1]);
}

#[test]
fn a_bad_address_fails_at_once_with_a_failure_record() {
    let mut cf = queues();
    let id = cf.send(&job().unwrap(), &email("nobody"));
    cf.run_until_idle();
    assert_eq!(cf.message(&id).attempts(), [1]);
    let record = cf.message(&id).failure_record().expect("a failure record");
    assert_eq!(record.kind, FailureKind::Permanent);
    assert_eq!(cf.failure_records().len(), 1);
}
