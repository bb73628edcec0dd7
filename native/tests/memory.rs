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

#[tokio::test(start_paused = true)]
async fn too_long_a_retry_is_refused_and_the_message_held_then_kept() {
    let hold = Duration::from_secs(5);
    let driver = MemoryDriver::new(MemoryConfig {
        max_retry_delay: Some(Duration::from_secs(1)),
        refused_hold: hold,
        ..MemoryConfig::default()
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
    assert!(err.to_string().contains("held for 5s"), "{err}");
    assert_eq!((driver.ready("q"), driver.depth("q")), (0, 1), "held");
    tokio::time::sleep(hold - Duration::from_millis(1)).await;
    assert_eq!(driver.ready("q"), 0);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let again = sub.next().await.unwrap().unwrap();
    assert_eq!(again.attempt(), 2);
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
    Producer::new(driver).dispatch(&job).send(&1).await.unwrap();
}

/// A registry of one job on `q` whose handler counts its executions and
/// fails as `outcome` says.
fn counted(
    job: &jobrail::Job<u32>,
    outcome: fn() -> jobrail::JobError,
) -> (jobrail::Registry, Arc<std::sync::atomic::AtomicU32>) {
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = runs.clone();
    let mut registry = jobrail::Registry::new();
    registry
        .register(job, move |_: jobrail::JobContext, _: u32| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move { Err(outcome()) }
        })
        .unwrap();
    (registry, runs)
}

/// A job whose declared backoff asks for more than the driver's longest
/// retry delay is refused when the consumer starts, naming the job, its
/// longest delay and the limit; so is an unknown-name delay beyond it. A
/// job whose longest delay fits starts.
#[tokio::test(start_paused = true)]
async fn a_backoff_beyond_the_longest_delay_is_refused_at_start() {
    let driver = Arc::new(MemoryDriver::new(MemoryConfig {
        max_retry_delay: Some(Duration::from_secs(1)),
        ..MemoryConfig::default()
    }));
    let too_long = jobrail::Job::<u32>::builder("slow-retries")
        .queue("q")
        .max_deliveries(5)
        .backoff(Duration::from_millis(200), 2.0, Duration::from_secs(10))
        .build()
        .unwrap();
    let (registry, runs) = counted(&too_long, || jobrail::JobError::new("no"));
    let started = jobrail_native::Consumer::builder(driver.clone(), registry)
        .build()
        .spawn();
    let err = started.shutdown().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    let text = err.to_string();
    for part in ["`slow-retries`", "1.6s", "1s"] {
        assert!(text.contains(part), "{part} in {text}");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);

    // 200 ms, 400 ms, 800 ms: within the limit.
    let fits = jobrail::Job::<u32>::builder("fits")
        .queue("q")
        .max_deliveries(4)
        .backoff(Duration::from_millis(200), 2.0, Duration::from_secs(10))
        .build()
        .unwrap();
    let (mut registry, _) = counted(&fits, || jobrail::JobError::new("no"));
    registry.unknown_name_retry_delay(Duration::from_secs(1));
    let consumer = jobrail_native::Consumer::builder(driver.clone(), registry)
        .build()
        .spawn();
    tokio::time::sleep(Duration::from_millis(50)).await;
    consumer.shutdown().await.unwrap();

    // The registry's unknown-name delay (30 s by default) is a retry too.
    let (mut registry, _) = counted(&fits, || jobrail::JobError::new("no"));
    registry.unknown_name_retry_delay(Duration::from_secs(30));
    let err = jobrail_native::Consumer::builder(driver.clone(), registry)
        .build()
        .spawn()
        .shutdown()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("unknown"), "{err}");

    // A refused settlement held for no time would loop: refused too.
    let (registry, _) = counted(&fits, || jobrail::JobError::new("no"));
    let no_hold = Arc::new(MemoryDriver::new(
        MemoryConfig::default().refused_hold(Duration::ZERO),
    ));
    let err = jobrail_native::Consumer::builder(no_hold, registry)
        .build()
        .spawn()
        .shutdown()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("refused_hold"), "{err}");
}

/// A delay chosen at run time (`retry_after` beyond the limit) cannot be
/// checked at start: the driver refuses that retry and holds the message
/// for its refused-settlement hold, as a broker's lease would, instead of
/// handing it straight back. Before: thousands of executions in 300 ms.
#[tokio::test(start_paused = true)]
async fn a_refused_retry_holds_the_message_instead_of_looping() {
    let hold = Duration::from_secs(30);
    let driver = Arc::new(MemoryDriver::new(MemoryConfig {
        max_retry_delay: Some(Duration::from_secs(1)),
        ..MemoryConfig::default()
    }));
    assert_eq!(driver.capabilities().refused_hold, hold, "the default hold");
    let job = jobrail::Job::<u32>::builder("waits")
        .queue("q")
        .max_deliveries(5)
        .build()
        .unwrap();
    let (mut registry, runs) = counted(&job, || {
        jobrail::JobError::retry_after("later", Duration::from_secs(10))
    });
    registry.unknown_name_retry_delay(Duration::from_secs(1));
    let consumer = jobrail_native::Consumer::builder(driver.clone(), registry)
        .build()
        .spawn();
    Producer::new(driver.clone())
        .dispatch(&job)
        .send(&1)
        .await
        .unwrap();
    let runs_after = |d: Duration| {
        let runs = runs.clone();
        async move {
            tokio::time::sleep(d).await;
            runs.load(std::sync::atomic::Ordering::SeqCst)
        }
    };
    assert_eq!(runs_after(Duration::from_millis(300)).await, 1);
    assert_eq!(
        runs_after(hold - Duration::from_millis(400)).await,
        1,
        "held for the hold"
    );
    assert_eq!(runs_after(Duration::from_millis(200)).await, 2);
    assert_eq!(driver.depth("q"), 1, "in flight or held, never lost");
    // Five deliveries take at least four holds, then the cap ends it.
    assert_eq!(runs_after(hold * 4).await, 5);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(driver.failure_records("q").len(), 1, "the cap recorded it");
    consumer.shutdown().await.unwrap();
}
