//! Behaviour specific to the memory driver (the shared rules are covered by
//! the conformance suite).
#![cfg(feature = "memory")]

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Envelope, Failure, FailureKind, FailureRecord, Settlement};
use jobrail_native::{Driver, ErrorKind, MemoryConfig, MemoryDriver, Outgoing, Producer};

fn message() -> Outgoing {
    let envelope = Envelope::new("j", serde_json::json!(1));
    Outgoing {
        id: envelope.id.clone(),
        body: envelope.encode(),
        delay: None,
    }
}

#[tokio::test]
async fn stop_discards_pending_work_and_refuses_more() {
    let driver = MemoryDriver::default();
    driver.send("q", message()).await.unwrap();
    driver
        .send(
            "q",
            Outgoing {
                delay: Some(Duration::from_secs(60)),
                ..message()
            },
        )
        .await
        .unwrap();
    assert_eq!(driver.depth("q"), 2);

    let mut sub = driver.subscribe("q", 1).await.unwrap();
    let delivery = sub.next().await.unwrap().unwrap();
    driver.stop().await.unwrap();
    assert_eq!(driver.ready("q"), 0, "pending work is discarded");
    assert_eq!(
        driver.depth("q"),
        1,
        "only the delivery in hand remains, delayed work is gone"
    );

    let err = delivery
        .settle(&Settlement::Retry {
            delay: None,
            shutdown: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stopped, "no final retry after stop");
    assert_eq!(driver.depth("q"), 0);
    assert!(sub.next().await.is_none(), "subscriptions end");
    let err = driver.send("q", message()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stopped);
}

#[tokio::test]
async fn an_unsettled_delivery_returns_with_a_higher_count() {
    let driver = MemoryDriver::default();
    driver.send("q", message()).await.unwrap();
    let mut sub = driver.subscribe("q", 1).await.unwrap();
    let first = sub.next().await.unwrap().unwrap();
    assert_eq!(first.attempt(), 1);
    drop(first); // a crashed handler task
    let second = sub.next().await.unwrap().unwrap();
    assert_eq!(second.attempt(), 2);
    second.settle(&Settlement::Ack).await.unwrap();
    assert_eq!(driver.depth("q"), 0);
}

#[tokio::test]
async fn reject_drops_and_fail_keeps_a_record() {
    let driver = MemoryDriver::default();
    driver.send("q", message()).await.unwrap();
    driver.send("q", message()).await.unwrap();
    let mut sub = driver.subscribe("q", 1).await.unwrap();
    sub.next()
        .await
        .unwrap()
        .unwrap()
        .settle(&Settlement::Reject)
        .await
        .unwrap();
    let delivery = sub.next().await.unwrap().unwrap();
    let failure = Failure {
        kind: FailureKind::Permanent,
        message: "no".into(),
    };
    let envelope = Envelope::decode(delivery.body()).unwrap();
    let record = FailureRecord::build("q", &failure, 1, 1, Some(&envelope), delivery.body());
    delivery
        .settle(&Settlement::Fail(Box::new(record.clone())))
        .await
        .unwrap();
    assert_eq!(
        driver.depth("q"),
        0,
        "rejected and failed messages are gone"
    );
    assert_eq!(driver.failure_records("q"), [record]);
}

#[tokio::test]
async fn too_long_a_retry_is_refused_and_the_message_kept() {
    let driver = MemoryDriver::new(MemoryConfig {
        max_retry_delay: Some(Duration::from_secs(1)),
    });
    driver.send("q", message()).await.unwrap();
    let mut sub = driver.subscribe("q", 1).await.unwrap();
    let delivery = sub.next().await.unwrap().unwrap();
    let err = delivery
        .settle(&Settlement::Retry {
            delay: Some(Duration::from_secs(2)),
            shutdown: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert_eq!(driver.ready("q"), 1);
}

#[tokio::test]
async fn delayed_dispatch_is_refused_where_unsupported() {
    // The memory driver supports delays; a producer checks the capability
    // before sending, which the conformance suite exercises per driver.
    let driver: Arc<dyn Driver> = Arc::new(MemoryDriver::default());
    assert!(driver.capabilities().delayed_dispatch);
    let job = jobrail::Job::<u32>::builder("j")
        .queue("q")
        .build()
        .unwrap();
    Producer::new(driver).dispatch(&job, &1).await.unwrap();
}
