//! RabbitMQ-specific behaviour beyond the shared suite, against a real broker
//! (`RABBITMQ_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`):
//! delay buckets, a worker killed mid-job, a worker stopped by SIGTERM, connections
//! closed by the broker, conflicting topology, dispatch delays above the
//! ladder, an outage, the consumer timeout. Refused retry delays, dropped
//! deliveries, the delivery limit and hidden credentials are scenarios of
//! the suite (`tests/rabbitmq.rs`).
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq --test rabbitmq_extra`.
#![cfg(feature = "rabbitmq")]

use std::process::{Command, Stdio};
use std::time::Duration;

use jobrail::{Registry, Settlement};
use jobrail_conformance::crash;
use jobrail_conformance::fixture::{Fixture, RabbitMq};
use jobrail_conformance::harness::{depth, outgoing, Calls};
use jobrail_conformance::scenarios::Work;
use jobrail_conformance::servers::Relay;
use jobrail_conformance::{Backend, Harness};
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Driver, ErrorKind};

const MS: fn(u64) -> Duration = Duration::from_millis;

/// `rabbitmqctl close_all_connections` hits every connection: the test that
/// runs it takes this for writing, the other broker tests for reading.
static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A fixture with its own bucket ladder; queues are deleted when it is dropped.
fn rabbit(buckets_ms: &[u64]) -> Fixture<RabbitMq> {
    let mut config = RabbitConfig::new(url()).delay_buckets(buckets_ms.iter().map(|ms| MS(*ms)));
    config.connection_name = "conformance-extra".into();
    config.refused_hold = MS(1000);
    Fixture::new(config)
}

/// A retry of 3 s on a 1 s / 2 s / 5 s ladder waits in the 5 s hold
/// queue: rounded up to the next bucket, never down to 2 s nor to the
/// nearest. (That no backend delivers a retry early is a scenario of the
/// suite.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_rounds_up_to_the_next_bucket() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[1000, 2000, 5000]);
    let h = Harness::new(&backend, "rmq-rounding").await;
    let driver = backend.driver().await;
    assert_eq!(driver.bucket_for(MS(3000)), Some(MS(5000)));
    assert_eq!(driver.bucket_for(MS(2000)), Some(MS(2000)));
    assert_eq!(driver.bucket_for(MS(1)), Some(MS(1000)));
    assert_eq!(driver.bucket_for(MS(5001)), None);

    driver.send(&h.queue, outgoing("m", None)).await.unwrap();
    let mut subscription = driver.subscribe(&h.queue, 1).await.unwrap();
    let first = subscription.next().await.unwrap().unwrap();
    let retried = tokio::time::Instant::now();
    first
        .settle(&Settlement::Retry {
            delay: Some(MS(3000)),
            shutdown: false,
        })
        .await
        .unwrap();
    let hold = RabbitDriver::hold_queue_name(&h.queue, MS(5000));
    assert!(
        driver.declared_queues().contains(&hold),
        "{:?}",
        driver.declared_queues()
    );
    let again = tokio::time::timeout(Duration::from_secs(20), subscription.next())
        .await
        .expect("back from the hold queue")
        .unwrap()
        .unwrap();
    let gap = retried.elapsed();
    assert_eq!(again.attempt(), 2);
    assert!(
        gap >= MS(4500),
        "3 s rounds up to the 5 s bucket, waited {gap:?}"
    );
    again.settle(&Settlement::Ack).await.unwrap();
}

/// The kill worker's command for `queue` (see `src/bin/rabbitmq_kill_worker.rs`).
fn kill_worker(queue: &str, job: &str, cap: u32) -> Command {
    let mut worker = Command::new(env!("CARGO_BIN_EXE_rabbitmq_kill_worker"));
    worker
        .args([queue, job, &cap.to_string()])
        .env("RABBITMQ_URL", url());
    worker
}

/// A worker SIGKILLed mid-job loses nothing: the broker redelivers the
/// message and the attempt count rises with each abandoned delivery, until
/// the cap turns an ordinary error into a terminal failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_loses_nothing_and_counts_the_attempt() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 1000]);
    crash::killed_worker_loses_nothing_and_counts_the_attempt(&backend, "rmq-kill", kill_worker)
        .await;
}

/// SIGTERM mid-job: the worker stops taking work, cancels the handler,
/// settles the interrupted delivery as a zero-delay retry, stops its driver
/// and exits 0; the next worker gets the message as attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_a_worker_down_gracefully() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 1000]);
    let h = Harness::new(&backend, "rmq-sigterm").await;
    let job = h.job("graceful").max_deliveries(3).build().unwrap();
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let queue = h.queue.clone();
    let (lines, success) = tokio::task::spawn_blocking(move || {
        crash::lines_after_sigterm(kill_worker(&queue, "graceful", 3))
    })
    .await
    .unwrap();
    assert_eq!(
        lines,
        ["attempt 1", "event retried shutdown=true", "stopped"]
    );
    assert!(
        success,
        "the worker exits successfully after a graceful shutdown"
    );

    let calls = Calls::default();
    let mut registry = Registry::new();
    registry
        .register(&job, calls.handler(|_, _| Ok(())))
        .unwrap();
    let consumer = h.start_on(backend.connect().await, registry).await;
    h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(calls.attempts(), [2], "the interrupted delivery counted");
    consumer.shutdown().await.unwrap();
}

/// Stopping the driver right after the last subscription and delivery
/// are dropped closes the connection cleanly. lapin closes a dropped
/// channel in the background; when that background close ran after the
/// connection began closing, it failed and took the connection down, and
/// `stop` returned "invalid channel state: Closing" (seen in CI under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn stop_right_after_dropping_a_subscription_succeeds() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 1000]);
    let h = Harness::new(&backend, "rmq-stop-race").await;
    for round in 0..5 {
        let driver = backend.driver().await;
        let queue = h.queue.clone();
        // On the runtime's only worker, lapin's background close cannot run
        // between the drop and `stop`: without the driver waiting for it,
        // it would run only once the connection is already closing.
        tokio::spawn(async move {
            driver
                .send(&queue, outgoing(&format!("m{round}"), None))
                .await
                .unwrap();
            let mut subscription = driver.subscribe(&queue, 1).await.unwrap();
            let delivery = subscription
                .next()
                .await
                .expect("a delivery")
                .expect("no error");
            // As a consumer shuts down: stop taking work, then settle what
            // is in flight; the delivery holds the channel's last handle.
            subscription.close().await;
            drop(subscription);
            delivery.settle(&Settlement::Ack).await.unwrap();
            driver
                .stop()
                .await
                .unwrap_or_else(|e| panic!("round {round}: stop failed: {e}"));
        })
        .await
        .unwrap();
    }
    let driver = backend.driver().await;
    assert_eq!(depth(&driver, &h.queue).await.ready, 0);
}

fn close_all_connections() {
    let status = Command::new("rabbitmqctl")
        .args(["close_all_connections", "test"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run rabbitmqctl");
    assert!(status.success(), "rabbitmqctl close_all_connections failed");
}

/// `rabbitmqctl close_all_connections` mid-test: the in-flight delivery's
/// settlement fails (its channel is gone; it is never acked on a new one),
/// the broker redelivers it with a higher attempt, the subscription
/// reconnects by itself and consumption resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_resumes_after_the_broker_closes_connections() {
    let _broker = BROKER.write().await;
    let backend = rabbit(&[100, 1000]);
    let run = crash::InterruptedJob::start(&backend, "rmq-reconnect").await;
    close_all_connections();
    // Only now does the slow handler return: rabbitmqctl can take longer
    // than a handler would have slept (a broker busy after the 100 MiB
    // scenario), and the ack would have gone out before the cut.
    run.release();

    // The slow delivery finishes after its channel died: settlement fails.
    let (event, error) = run
        .harness
        .events
        .wait_settlement_failure(run.harness.patience)
        .await;
    assert_eq!(event.attempt, 1);
    assert!(error.contains("connection error"), "{error}");

    // Meanwhile the subscription reconnects; new work flows again.
    run.consumption_resumes().await;
    assert_eq!(
        run.calls.attempts(),
        [1, 2],
        "the interrupted delivery came back as attempt 2"
    );
    run.finish().await;
}

/// A work queue that already exists with other arguments is a clear
/// configuration error, for dispatch and subscription alike, and the driver
/// stays usable for other queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_existing_queue_is_a_config_error() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 1000]);
    let h = Harness::new(&backend, "rmq-conflict").await;
    // Someone declared the queue with a delivery limit this driver does not set.
    let mut other = backend.config();
    other.delivery_limit = Some(50);
    let first = backend.driver_with(other).await;
    first.send(&h.queue, outgoing("a", None)).await.unwrap();

    let driver = backend.driver().await;
    let err = driver
        .send(&h.queue, outgoing("b", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains(&h.queue), "{err}");
    let err = match driver.subscribe(&h.queue, 1).await {
        Ok(_) => panic!("subscribing to a conflicting queue succeeded"),
        Err(e) => e,
    };
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    // The refused declare closed only its own channel.
    let fine = format!("{}-other", h.queue);
    driver.send(&fine, outgoing("c", None)).await.unwrap();
    assert_eq!(depth(&driver, &fine).await.ready, 1);
}

/// A dispatch delay above the largest bucket is refused as unsupported and
/// stores nothing; the largest bucket is also the longest retry delay
/// (a longer one keeps the message: a scenario of the suite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_delay_above_the_largest_bucket_is_refused() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 250]);
    let h = Harness::new(&backend, "rmq-too-long").await;
    let driver = backend.driver().await;
    assert_eq!(driver.capabilities().max_retry_delay, Some(MS(250)));
    let err = driver
        .send(&h.queue, outgoing("late", Some(Duration::from_secs(10))))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("largest delay bucket"), "{err}");
    assert_eq!(depth(&driver, &h.queue).await.ready, 0);
}

/// While the broker cannot be reached, every dispatch fails at once as not
/// accepted (none waits for the operation timeout); once it is reachable
/// again the driver reconnects on the next dispatch and the message is
/// consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_fails_fast_while_the_broker_is_unreachable() {
    let _broker = BROKER.read().await;
    let mut outage = Relay::start(Relay::address_of(&url())).await;
    let mut config = RabbitConfig::new(outage.url_for(&url())).delay_buckets([MS(100)]);
    config.connection_name = "conformance-outage".into();
    config.operation_timeout = Duration::from_secs(10);
    config.confirm_timeout = Duration::from_secs(10);
    let backend = Fixture::<RabbitMq>::new(config);
    let h = Harness::new(&backend, "rmq-outage").await;
    let job = h.job("outage").build().unwrap();
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();

    outage.go_down().await;
    let mut latencies = Vec::new();
    let mut first_uncertain = false;
    for i in 0..5 {
        let started = tokio::time::Instant::now();
        let err = h
            .producer
            .dispatch(&job)
            .send(&Work { id: 100 + i })
            .await
            .expect_err("a dispatch while the broker is unreachable succeeded");
        let took = started.elapsed();
        latencies.push(took);
        // The first publish may go out on the cut connection before the
        // client has read the reset: that one is truly uncertain.
        if i == 0 && err.kind() == ErrorKind::Uncertain {
            first_uncertain = true;
            println!("rabbitmq: the first dispatch after the cut was uncertain: {err}");
        } else {
            assert_eq!(err.kind(), ErrorKind::NotAccepted, "dispatch {i}: {err}");
        }
        assert!(!err.to_string().contains("guest:guest"), "{err}");
        assert!(
            took < Duration::from_secs(2),
            "dispatch {i} took {took:?} (operation timeout 10 s): {err}"
        );
    }
    println!("rabbitmq: dispatch latencies while the broker is unreachable: {latencies:?}");

    outage.come_back().await;
    h.producer
        .dispatch(&job)
        .send(&Work { id: 2 })
        .await
        .unwrap();
    // The messages accepted before and after the outage, and only those;
    // an uncertain dispatch 0 may have reached the broker, queued between
    // them (consume_ids sorts: [1, 100, 2] reads [1, 2, 100]).
    let driver = backend.driver().await;
    let queued = depth(&driver, &h.queue).await.ready;
    let expected: &[u32] = if first_uncertain && queued == 3 {
        &[1, 2, 100]
    } else {
        &[1, 2]
    };
    assert_eq!(
        queued as usize,
        expected.len(),
        "messages queued after the outage (dispatch 0 uncertain: {first_uncertain})"
    );
    assert_eq!(h.consume_ids(&job, expected.len()).await, expected);
    assert_eq!(depth(&driver, &h.queue).await.ready, 0);
}

/// A job that can hold a delivery longer than the broker's consumer timeout
/// (less a minute for its check) is refused when the consumer starts,
/// naming the job, its timeout and the setting; one that fits starts, and so
/// does a job without a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_longer_than_the_consumer_timeout_is_refused_at_start() {
    let _broker = BROKER.read().await;
    let mut config = RabbitConfig::new(url()).delay_buckets([MS(100)]);
    config.connection_name = "conformance-extra".into();
    config.consumer_timeout = Duration::from_secs(20 * 60);
    let backend = Fixture::<RabbitMq>::new(config);
    let h = Harness::new(&backend, "rmq-consumer-timeout").await;
    let handler = |_ctx, _work: Work| std::future::ready(Ok(()));

    // 3 x 7 min (plus tier-one waits) does not fit in 20 min - 1 min.
    let long = h
        .job("seven-minutes-thrice")
        .timeout(Duration::from_secs(7 * 60))
        .tier_one(3)
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry.register(&long, handler).unwrap();
    let err = h
        .start(registry, 1)
        .shutdown()
        .await
        .expect_err("a job longer than consumer_timeout started");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    let text = err.to_string();
    for part in ["seven-minutes-thrice", "420s", "consumer_timeout", "1200s"] {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }

    // One attempt of 6 min fits; so does a job with no timeout.
    let fits = h
        .job("six-minutes-once")
        .timeout(Duration::from_secs(6 * 60))
        .build()
        .unwrap();
    let unbounded = h
        .job("no-timeout")
        .queue(format!("{}-b", h.queue))
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry.register(&fits, handler).unwrap();
    registry.register(&unbounded, handler).unwrap();
    let consumer = h.start(registry, 1);
    h.producer
        .dispatch(&fits)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "succeeded", 1).await;
    consumer.shutdown().await.unwrap();

    // A consumer_timeout no larger than the margin leaves nothing to run in.
    let mut tiny = RabbitConfig::new(url());
    tiny.consumer_timeout = Duration::from_secs(60);
    let err = RabbitDriver::new(tiny).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("consumer_timeout"), "{err}");
}

/// The broker's own limit, as found: a 100 MiB body that is not an
/// envelope, published by lapin into a queue of a driver on RabbitMQ's
/// default `max_message_size` (128 MiB). Its record kept whole would be
/// larger than the broker takes (the body twice over, in the hex records
/// were written in; a third over, in base64), so it is cut to fit: it is
/// recorded once, with the body's length and digest, and the message is
/// gone, never refused and back every ten seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_body_near_the_brokers_limit_is_recorded_once() {
    let _broker = BROKER.read().await;
    let backend = rabbit(&[100, 1000]);
    let h = Harness::new(&backend, "rmq-poison-100mib").await;
    let driver = backend.driver().await;
    let limit = driver.config().max_message_bytes;
    assert_eq!(limit, jobrail_native::rabbitmq::DEFAULT_MAX_MESSAGE_BYTES);
    let body: Vec<u8> = (0..100u32 << 20).map(|i| (i % 241) as u8 | 0x80).collect();
    driver.inject_body(&h.queue, body.clone()).await.unwrap();
    let job = h.job("poison-100mib").build().unwrap();
    let mut registry = jobrail::Registry::new();
    registry
        .register(&job, |_: jobrail::JobContext, _: Work| async { Ok(()) })
        .unwrap();
    let consumer = h.start(registry, 1);
    h.events.wait_count(h.patience * 3, "failed", 1).await;
    consumer.shutdown().await.unwrap();
    assert!(h.events.settlement_failures().is_empty());
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    let t = records[0].truncated.as_ref().expect("cut to fit");
    assert_eq!(t.body_bytes, body.len() as u64);
    assert!(records[0].encode().len() <= limit);
    let kept = records[0].raw_body.as_ref().unwrap().to_bytes();
    assert_eq!(kept, body[..kept.len()]);
    assert!(kept.len() > 90 << 20, "{} bytes kept", kept.len());
}
