//! The RabbitMQ driver's throughput paths keep the settlement guarantees,
//! against a real broker (`RABBITMQ_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`):
//!
//! - ack runs: a `basic.ack multiple=true` never acknowledges a delivery
//!   still running, nacked (dropped unsettled) or retried; acks behind a
//!   running delivery are written within the gap wait, or at once when half
//!   the prefetch waits; closing the
//!   subscription or stopping the driver writes the acks still waiting;
//! - batch dispatch: one answer per message, a broker nack in the middle of
//!   a batch (a queue full under `x-overflow = reject-publish`, set by a
//!   policy) is `NotAccepted` for exactly the refused messages.
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq --test rabbitmq_throughput`.
#![cfg(feature = "rabbitmq")]

use std::process::{Command, Stdio};
use std::time::Duration;

use jobrail::Settlement;
use jobrail_conformance::fixture::{Fixture, RabbitMq};
use jobrail_conformance::harness::{depth, outgoing};
use jobrail_conformance::Harness;
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Delivery, Driver, ErrorKind, Subscription};

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn config(gap_wait: Duration) -> RabbitConfig {
    let mut config = RabbitConfig::new(url()).failure_queue(None);
    config.connection_name = "conformance-throughput".into();
    config.ack_gap_wait = gap_wait;
    config
}

/// Sends `ids` to `queue`, one by one.
async fn send(driver: &RabbitDriver, queue: &str, ids: &[&str]) {
    for id in ids {
        driver.send(queue, outgoing(id, None)).await.unwrap();
    }
}

/// The next delivery of `subscription`.
async fn take(subscription: &mut Box<dyn Subscription>) -> Box<dyn Delivery> {
    tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("a delivery in time")
        .expect("the subscription is open")
        .expect("no error")
}

/// What comes back on a fresh subscription within `wait`: attempts of the
/// deliveries, all acked.
async fn drain(driver: &RabbitDriver, queue: &str, wait: Duration) -> Vec<u32> {
    let mut subscription = driver.subscribe(queue, 16).await.unwrap();
    let mut attempts = vec![];
    while let Ok(Some(Ok(delivery))) = tokio::time::timeout(wait, subscription.next()).await {
        attempts.push(delivery.attempt());
        delivery.settle(&Settlement::Ack).await.unwrap();
    }
    subscription.close().await;
    attempts
}

/// Three deliveries; the second and third are acked while the first still
/// runs. Their acks are written at once (with prefetch 3, one waiting ack
/// is half the window), not held until the first settles, and they never
/// cover the first: once the driver stops
/// with the first unsettled, its message (and only it) comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_behind_a_running_delivery_never_cover_it() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_millis(50)));
    let h = Harness::new(&backend, "rmq-runs-running").await;
    let driver = backend.driver().await;
    send(&driver, &h.queue, &["m1", "m2", "m3"]).await;
    let mut subscription = driver.subscribe(&h.queue, 3).await.unwrap();
    let first = take(&mut subscription).await;
    let second = take(&mut subscription).await;
    let third = take(&mut subscription).await;
    let acked = tokio::time::timeout(Duration::from_secs(2), async {
        let (a, b) = tokio::join!(
            second.settle(&Settlement::Ack),
            third.settle(&Settlement::Ack)
        );
        a.and(b)
    })
    .await
    .expect("acks behind a running delivery are written within the gap wait");
    acked.unwrap();
    // The first is still running when the driver stops.
    driver.stop().await.unwrap();
    drop(first);
    drop(subscription);

    let again = backend.driver().await;
    let back = drain(&again, &h.queue, Duration::from_secs(2)).await;
    assert_eq!(back, [2], "only the running delivery comes back");
}

/// The later delivery is acked first; the earlier is then returned (dropped
/// unsettled: a nack with requeue) or retried. The ack run must not swallow
/// it: the earlier message comes back, the later does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multiple_ack_never_covers_a_nacked_or_retried_delivery() {
    // A long gap wait: the later ack waits for the earlier delivery's
    // settlement, so both land in one turn of the ack writer.
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_secs(30)));
    let h = Harness::new(&backend, "rmq-runs-nack").await;
    let driver = backend.driver().await;
    for earlier_settles_by in ["drop", "retry"] {
        send(&driver, &h.queue, &["early", "late"]).await;
        // A prefetch of 16: up to 8 acks may wait behind a running delivery.
        let mut subscription = driver.subscribe(&h.queue, 16).await.unwrap();
        let early = take(&mut subscription).await;
        let late = take(&mut subscription).await;
        let late_ack = tokio::spawn(async move { late.settle(&Settlement::Ack).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!late_ack.is_finished(), "the later ack waits for the run");
        match earlier_settles_by {
            "drop" => drop(early),
            _ => early
                .settle(&Settlement::Retry {
                    delay: None,
                    shutdown: false,
                })
                .await
                .unwrap(),
        }
        tokio::time::timeout(Duration::from_secs(5), late_ack)
            .await
            .expect("the later ack is written once the earlier settled")
            .unwrap()
            .unwrap();
        // The earlier message is back (attempt 2), and only it.
        let back = take(&mut subscription).await;
        assert_eq!(back.attempt(), 2, "{earlier_settles_by}");
        back.settle(&Settlement::Ack).await.unwrap();
        subscription.close().await;
        drop(subscription);
        let rest = drain(&driver, &h.queue, Duration::from_millis(500)).await;
        assert!(rest.is_empty(), "{earlier_settles_by}: {rest:?}");
    }
}

/// An ack waiting behind a running delivery (a gap wait far longer than the
/// test) is written when the driver stops, before the connection closes:
/// the settled message does not come back, even though the settling task
/// was cancelled; the running one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_writes_the_acks_still_waiting() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_secs(60)));
    let h = Harness::new(&backend, "rmq-runs-stop").await;
    let driver = backend.driver().await;
    send(&driver, &h.queue, &["m1", "m2"]).await;
    // A prefetch of 16: up to 8 acks may wait behind a running delivery.
    let mut subscription = driver.subscribe(&h.queue, 16).await.unwrap();
    let first = take(&mut subscription).await;
    let second = take(&mut subscription).await;
    let ack = tokio::spawn(async move { second.settle(&Settlement::Ack).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !ack.is_finished(),
        "the ack waits behind the running delivery"
    );
    ack.abort();
    tokio::time::timeout(Duration::from_secs(10), driver.stop())
        .await
        .expect("stop does not wait for the gap")
        .unwrap();
    drop(first);
    drop(subscription);

    let again = backend.driver().await;
    assert_eq!(drain(&again, &h.queue, Duration::from_secs(2)).await, [2]);
}

/// Closing the subscription (as a consumer's shutdown does) writes the acks
/// waiting behind a running delivery at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_subscription_writes_the_acks_still_waiting() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_secs(60)));
    let h = Harness::new(&backend, "rmq-runs-close").await;
    let driver = backend.driver().await;
    send(&driver, &h.queue, &["m1", "m2"]).await;
    // A prefetch of 16: up to 8 acks may wait behind a running delivery.
    let mut subscription = driver.subscribe(&h.queue, 16).await.unwrap();
    let first = take(&mut subscription).await;
    let second = take(&mut subscription).await;
    let ack = tokio::spawn(async move { second.settle(&Settlement::Ack).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !ack.is_finished(),
        "the ack waits behind the running delivery"
    );
    subscription.close().await;
    tokio::time::timeout(Duration::from_secs(5), ack)
        .await
        .expect("close writes the waiting ack")
        .unwrap()
        .unwrap();
    first.settle(&Settlement::Ack).await.unwrap();
    drop(subscription);
    assert!(drain(&driver, &h.queue, Duration::from_millis(500))
        .await
        .is_empty());
}

/// Many concurrent settlements of all kinds on one channel: every ack is
/// written, nothing acked comes back, every requeued message does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_settlements_on_one_channel_keep_their_kinds() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_millis(5)));
    let h = Harness::new(&backend, "rmq-runs-mixed").await;
    let driver = backend.driver().await;
    let ids: Vec<String> = (0..60).map(|i| format!("m{i}")).collect();
    let results = driver
        .send_batch(&h.queue, ids.iter().map(|id| outgoing(id, None)).collect())
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let mut subscription = driver.subscribe(&h.queue, 60).await.unwrap();
    let mut tasks = vec![];
    for i in 0..60u64 {
        let delivery = take(&mut subscription).await;
        tasks.push(tokio::spawn(async move {
            // Out of order on purpose.
            tokio::time::sleep(Duration::from_millis((i * 7919) % 23)).await;
            match i % 5 {
                0 => drop(delivery),
                1 => delivery.settle(&Settlement::Reject).await.unwrap(),
                _ => delivery.settle(&Settlement::Ack).await.unwrap(),
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    subscription.close().await;
    drop(subscription);
    let back = drain(&driver, &h.queue, Duration::from_secs(1)).await;
    // The dropped ones may have come back to the first subscription too
    // (and returned again when it closed): at least their second delivery.
    assert_eq!(
        back.len(),
        12,
        "the 12 dropped messages, and only they: {back:?}"
    );
    assert!(back.iter().all(|a| *a >= 2), "{back:?}");
}

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

/// A batch into a full queue that refuses more (`max-length` 1 and
/// `x-overflow = reject-publish`, set by a policy): the broker nacks the
/// work-queue message in the middle, which is `NotAccepted`, while the
/// delayed ones around it go to their hold queue and are confirmed.
/// Answers come one per message, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reports_the_broker_nack_of_a_message_in_its_middle() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_millis(5)));
    let h = Harness::new(&backend, "rmq-batch-nack").await;
    let policy = format!("limit-{}", h.queue);
    rabbitmqctl(&[
        "set_policy",
        "--apply-to",
        "queues",
        &policy,
        &format!("^{}$", h.queue),
        r#"{"max-length":1,"overflow":"reject-publish"}"#,
    ]);
    struct Cleanup(String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = Command::new("rabbitmqctl")
                .args(["clear_policy", &self.0])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    let _cleanup = Cleanup(policy);
    let driver = backend.driver().await;
    // Fill the queue; the broker flips it to refusing publishes on its own
    // time (quorum queues tell the publishing channel asynchronously).
    driver.send(&h.queue, outgoing("full", None)).await.unwrap();
    let _ = driver.send(&h.queue, outgoing("over", None)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = Some(Duration::from_secs(1));
    let batch = vec![
        outgoing("before", later),
        outgoing("refused", None),
        outgoing("after", later),
    ];
    let results = driver.send_batch(&h.queue, batch).await;
    let kinds: Vec<Option<ErrorKind>> = results
        .iter()
        .map(|r| r.as_ref().err().map(|e| e.kind()))
        .collect();
    assert_eq!(
        kinds,
        [None, Some(ErrorKind::NotAccepted), None],
        "{results:?}"
    );
    let refused = results[1].as_ref().unwrap_err().to_string();
    assert!(refused.contains("nack"), "{refused}");
}

/// An empty batch sends nothing and answers nothing; a batch for a stopped
/// driver answers `Stopped` for each message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_once_per_message() {
    let backend = Fixture::<RabbitMq>::new(config(Duration::from_millis(5)));
    let h = Harness::new(&backend, "rmq-batch-count").await;
    let driver = backend.driver().await;
    assert!(driver.send_batch(&h.queue, vec![]).await.is_empty());
    let ids: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
    let results = driver
        .send_batch(&h.queue, ids.iter().map(|id| outgoing(id, None)).collect())
        .await;
    assert_eq!(results.len(), 100);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(depth(&driver, &h.queue).await.ready, 100);
    driver.stop().await.unwrap();
    let results = driver
        .send_batch(&h.queue, vec![outgoing("x", None), outgoing("y", None)])
        .await;
    assert_eq!(results.len(), 2);
    assert!(
        results
            .iter()
            .all(|r| r.as_ref().is_err_and(|e| e.kind() == ErrorKind::Stopped)),
        "{results:?}"
    );
}
