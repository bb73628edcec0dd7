//! The RabbitMQ driver's failure store and admin interface beyond the shared
//! failure scenarios, against a real broker (`RABBITMQ_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): what a live claim hides and
//! gives back (released, dropped), removal by ids around a claim, scans one
//! after another seeing every entry, the depth with hold queues, deleting a
//! queue twice and using it again, a driver without failure queues, and a
//! queue never declared (its failures are read without declaring anything).
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq --test rabbitmq_failure_store`.
#![cfg(feature = "rabbitmq")]

use std::time::Duration;

use jobrail::{Envelope, Failure, FailureKind, FailureRecord};
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Admin, Driver, ErrorKind, FailureStore, Outgoing};

fn config() -> RabbitConfig {
    let url = std::env::var("RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let mut config = RabbitConfig::new(url);
    config.connection_name = "conformance-failure-store".into();
    config
}

/// A queue name no other run uses.
fn queue(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("failure-store-{tag}-{nanos}")
}

fn record(queue: &str, n: u32) -> FailureRecord {
    let envelope = Envelope::new("job", serde_json::json!(n));
    let failure = Failure {
        kind: FailureKind::Permanent,
        message: format!("boom {n}"),
    };
    FailureRecord::build(queue, &failure, 1, 1, Some(&envelope), &envelope.encode())
}

/// `n` records in `q`'s failure queue, in that order.
async fn filled(driver: &RabbitDriver, q: &str, n: u32) -> Vec<FailureRecord> {
    let records: Vec<_> = (0..n).map(|i| record(q, i)).collect();
    for r in &records {
        driver.inject_failure_body(q, r.encode()).await.unwrap();
    }
    records
}

async fn ids(driver: &RabbitDriver, q: &str) -> Vec<String> {
    let entries = driver.read_failures(q).await.unwrap();
    entries.into_iter().map(|e| e.id).collect()
}

fn message(id: &str, delay: Option<Duration>) -> Outgoing {
    Outgoing {
        id: id.into(),
        body: b"{}".to_vec(),
        delay,
    }
}

#[tokio::test]
async fn a_claim_hides_its_entry_until_removed_released_or_dropped() {
    let driver = RabbitDriver::connect(config()).await.unwrap();
    let q = queue("claim");
    let records = filled(&driver, &q, 3).await;
    driver
        .inject_failure_body(&q, b"not a record".to_vec())
        .await
        .unwrap();
    let all = ids(&driver, &q).await;
    assert_eq!(all.len(), 4);
    assert_eq!(ids(&driver, &q).await, all, "a list consumes nothing");
    let kept: Vec<_> = driver
        .read_failures(&q)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| e.record)
        .collect();
    assert_eq!(kept, records);

    let claim = driver.claim_failure(&q, &records[1].id).await.unwrap();
    let claim = claim.expect("the entry is there");
    assert_eq!(claim.entry().id, records[1].id);
    assert!(driver
        .claim_failure(&q, &records[1].id)
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        ids(&driver, &q).await.len(),
        3,
        "lists miss a claimed entry"
    );
    let held = [records[1].id.clone()];
    assert_eq!(driver.remove_failures(&q, &held).await.unwrap(), 0);
    claim.release().await.unwrap();
    assert_eq!(ids(&driver, &q).await.len(), 4, "released");

    let claim = driver.claim_failure(&q, &records[0].id).await.unwrap();
    drop(claim.expect("the entry is there"));
    let mut back = Vec::new();
    for _ in 0..100 {
        back = ids(&driver, &q).await;
        if back.len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        back.contains(&records[0].id),
        "a dropped claim gives its entry back"
    );

    let claim = driver.claim_failure(&q, &records[2].id).await.unwrap();
    claim.unwrap().remove().await.unwrap();
    let left = ids(&driver, &q).await;
    let expected: Vec<_> = all
        .iter()
        .filter(|id| **id != records[2].id)
        .cloned()
        .collect();
    let mut sorted = left.clone();
    sorted.sort();
    let mut expected_sorted = expected;
    expected_sorted.sort();
    assert_eq!(sorted, expected_sorted, "exactly the claimed entry went");

    let poison = all[3].clone();
    let removed = driver
        .remove_failures(&q, &[poison.clone(), "no-such-entry".into()])
        .await
        .unwrap();
    assert_eq!(removed, 1);
    assert!(!ids(&driver, &q).await.contains(&poison));
    driver.delete_queue(&q).await.unwrap();
    driver.stop().await.unwrap();
}

/// Every scan gives back what it took before the next one starts: a claim
/// right after a list (or another claim) finds its entry.
/// Removing 1,500 entries by id, then holding the rest and removing them:
/// a read right after each finds none of them (RabbitMQ's quorum queues
/// give back `basic.get` deliveries acked just before their channel closes
/// unless the channel waits: a bulk replay of 10,000 once left hundreds).
#[tokio::test]
async fn entries_removed_in_bulk_are_gone_at_the_next_read() {
    let driver = RabbitDriver::connect(config()).await.unwrap();
    let q = queue("bulk-remove");
    filled(&driver, &q, 2000).await;
    let first: Vec<String> = ids(&driver, &q).await.into_iter().take(1500).collect();
    assert_eq!(driver.remove_failures(&q, &first).await.unwrap(), 1500);
    let left = ids(&driver, &q).await;
    assert_eq!(left.len(), 500, "removed entries came back");
    let held = driver
        .hold_all(&q)
        .await
        .unwrap()
        .expect("RabbitMQ holds its failure queue");
    assert_eq!(held.entries().len(), 500);
    assert_eq!(held.finish(&left).await.unwrap(), 500);
    assert!(
        ids(&driver, &q).await.is_empty(),
        "held entries removed came back"
    );
    driver.admin().unwrap().delete_queue(&q).await.unwrap();
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn scans_one_after_another_see_every_entry() {
    let driver = RabbitDriver::connect(config()).await.unwrap();
    let q = queue("scans");
    let records = filled(&driver, &q, 10).await;
    for _ in 0..2 {
        for r in &records {
            assert_eq!(ids(&driver, &q).await.len(), 10);
            let claim = driver.claim_failure(&q, &r.id).await.unwrap();
            claim.expect("found").release().await.unwrap();
        }
    }
    driver.delete_queue(&q).await.unwrap();
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn depth_counts_hold_queues_and_delete_queue_forgets() {
    let driver = RabbitDriver::connect(config()).await.unwrap();
    let q = queue("depth");
    let missing = driver.depth(&q).await.unwrap();
    assert_eq!((missing.ready, missing.delayed), (0, Some(0)));
    driver.send(&q, message("a", None)).await.unwrap();
    driver.send(&q, message("b", None)).await.unwrap();
    let later = Some(Duration::from_secs(60));
    driver.send(&q, message("c", later)).await.unwrap();
    let depth = driver.depth(&q).await.unwrap();
    assert_eq!(
        (depth.ready, depth.in_flight, depth.delayed),
        (2, None, Some(1))
    );
    driver.inject_failure_body(&q, b"x".to_vec()).await.unwrap();

    driver.delete_queue(&q).await.unwrap();
    driver.delete_queue(&q).await.unwrap();
    assert!(
        driver.declared_queues().is_empty(),
        "{:?}",
        driver.declared_queues()
    );
    let gone = driver.ready_count(&q).await.unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::Connection, "{gone}");
    // Used again: declared again.
    assert!(driver.read_failures(&q).await.unwrap().is_empty());
    driver.send(&q, message("d", None)).await.unwrap();
    assert_eq!(driver.depth(&q).await.unwrap().ready, 1);
    driver.delete_queue(&q).await.unwrap();
    driver.stop().await.unwrap();
}

#[tokio::test]
async fn without_failure_queues_the_store_is_a_config_error() {
    let driver = RabbitDriver::connect(config().failure_queue(None))
        .await
        .unwrap();
    let q = queue("none");
    let err = driver.read_failures(&q).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains(&format!("`{q}`")), "{err}");
    let err = driver.claim_failure(&q, "x").await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Config);
    let err = driver
        .inject_failure_body(&q, b"x".to_vec())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    driver.stop().await.unwrap();
}

/// An operator who mistypes a queue name must not leave a queue behind:
/// reading, claiming and purging the failures of a queue never declared
/// answer "nothing there" and declare nothing.
#[tokio::test]
async fn a_queue_never_declared_has_no_failures_and_gets_no_failure_queue() {
    let driver = RabbitDriver::connect(config()).await.unwrap();
    let q = queue("typo");
    assert!(driver.read_failures(&q).await.unwrap().is_empty());
    assert!(driver.claim_failure(&q, "x").await.unwrap().is_none());
    assert_eq!(driver.remove_failures(&q, &["x".into()]).await.unwrap(), 0);
    let failed = driver.failure_queue_name(&q).unwrap();
    let err = driver.ready_count(&failed).await.unwrap_err();
    assert!(err.to_string().contains("NOT_FOUND"), "{err}");
    driver.stop().await.unwrap();
}
