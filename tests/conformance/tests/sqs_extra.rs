//! SQS-specific behaviour beyond the shared suite, against the emulator at
//! `SQS_ENDPOINT` (start it with `tests/sqs-emulator`): delays rounded up to
//! seconds, the 12-hour visibility cap, reject leaving the message to its
//! visibility timeout, visibility renewal for long handlers, redrive policies
//! below the attempt cap, the 900 s dispatch limit, released
//! and cancel-safe deliveries.
//!
//! Run with
//! `SQS_ENDPOINT=$(tests/sqs-emulator) cargo test -p queue-conformance --features sqs --test sqs_extra`.
#![cfg(feature = "sqs")]

use std::time::Duration;

use queue::{JobError, Registry, Settlement};
use queue_conformance::fixture::{Fixture, Sqs};
use queue_conformance::harness::Calls;
use queue_conformance::scenarios::Work;
use queue_conformance::{Backend, Harness};
use queue_native::sqs::aws_sdk_sqs::types::QueueAttributeName;
use queue_native::{Driver, ErrorKind, Outgoing, SqsConfig, SqsCredentials, SqsDriver};
use tokio::time::Instant;

const MS: fn(u64) -> Duration = Duration::from_millis;
const VISIBILITY: Duration = Duration::from_secs(2);

fn config() -> SqsConfig {
    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "SQS_ENDPOINT is not set: start the emulator with `tests/sqs-emulator` and export \
             SQS_ENDPOINT=<the URL it prints> (e.g. http://127.0.0.1:4517)"
        )
    });
    SqsConfig::new("us-east-1")
        .endpoint(endpoint)
        .credentials(SqsCredentials::fixed("test", "test"))
        .visibility_timeout(VISIBILITY)
        .wait_time(Duration::from_secs(1))
}

/// Queues created by its drivers (and those named with `delete_later`) are
/// deleted when it is dropped.
fn sqs() -> Fixture<Sqs> {
    Fixture::new(config())
}

fn outgoing(id: &str, delay: Option<Duration>) -> Outgoing {
    Outgoing {
        id: id.into(),
        body: format!("{{\"raw\":\"{id}\"}}").into_bytes(),
        delay,
    }
}

/// `queue`'s URL, asked of SQS directly.
async fn queue_url(driver: &SqsDriver, queue: &str) -> String {
    driver
        .client()
        .get_queue_url()
        .queue_name(queue)
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string()
}

/// Messages on `queue`: visible, in flight or delayed.
async fn messages_on(driver: &SqsDriver, queue: &str) -> u64 {
    let url = queue_url(driver, queue).await;
    let attributes = driver
        .client()
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .unwrap();
    let attributes = attributes.attributes().unwrap();
    [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        QueueAttributeName::ApproximateNumberOfMessagesDelayed,
    ]
    .iter()
    .map(|name| attributes[name].parse::<u64>().unwrap())
    .sum()
}

/// A retry-after of 1.2 s becomes a visibility of 2 s: the next delivery
/// waits at least 2 s, never 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_delay_rounds_up_to_whole_seconds() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-rounding").await;
    let job = h.job("rounding").retry(3).build().unwrap();
    let calls = Calls::default();
    let mut registry = Registry::new();
    registry
        .register(
            &job,
            calls.handler(|_, n| match n {
                1 => Err(JobError::retry_after("come back later", MS(1200))),
                _ => Ok(()),
            }),
        )
        .unwrap();
    let consumer = h.start(registry, 1);
    h.producer.dispatch(&job, &Work { id: 1 }).await.unwrap();
    h.events
        .wait_count(Duration::from_secs(20), "succeeded", 1)
        .await;
    assert_eq!(calls.attempts(), [1, 2]);
    let gap = calls.gaps()[0];
    assert!(gap >= MS(2000), "1.2 s rounds up to 2 s, waited {gap:?}");
    consumer.shutdown().await.unwrap();
}

/// A retry that would end more than 12 h after the receive is refused as
/// unsupported; the message is kept and comes back after its visibility.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_beyond_twelve_hours_is_refused_and_the_message_kept() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-12h").await;
    let driver = backend.driver().await;
    assert_eq!(
        driver.capabilities().max_retry_delay,
        Some(Duration::from_secs(12 * 3600))
    );
    driver.send(&h.queue, outgoing("m1", None)).await.unwrap();
    let mut subscription = driver.subscribe(&h.queue, 1).await.unwrap();
    let first = subscription.next().await.unwrap().unwrap();
    assert_eq!(first.attempt(), 1);
    let body = first.body().to_vec();
    let refused = first
        .settle(&Settlement::Retry {
            delay: Some(Duration::from_secs(12 * 3600 + 1)),
            shutdown: false,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    let refused_at = Instant::now();
    let again = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("the message comes back")
        .unwrap()
        .unwrap();
    assert_eq!(again.body(), body);
    assert_eq!(again.attempt(), 2);
    assert!(
        refused_at.elapsed() >= MS(500),
        "it came back when its visibility ended, not at once"
    );
    again.settle(&Settlement::Ack).await.unwrap();
}

/// Reject does not drop on SQS: the message comes back once its visibility
/// timeout ends, with a higher attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_message_comes_back_after_the_visibility_timeout() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-reject").await;
    assert!(!h.driver.capabilities().reject_drops);
    assert_eq!(h.driver.capabilities().redelivery_hint, VISIBILITY);
    let job = h.job("reject").retry(5).build().unwrap();
    let calls = Calls::default();
    let mut registry = Registry::new();
    registry
        .register(
            &job,
            calls.handler(|_, n| match n {
                1 => Err(JobError::reject("not now")),
                _ => Ok(()),
            }),
        )
        .unwrap();
    let consumer = h.start(registry, 1);
    h.producer.dispatch(&job, &Work { id: 1 }).await.unwrap();
    h.events
        .wait_count(Duration::from_secs(20), "succeeded", 1)
        .await;
    assert_eq!(h.events.names(), ["rejected", "succeeded"]);
    assert_eq!(calls.attempts(), [1, 2]);
    let gap = calls.gaps()[0];
    // The visibility started at the receive, just before the first call.
    assert!(gap >= MS(1500), "came back after {gap:?}");
    consumer.shutdown().await.unwrap();
    assert!(backend.failure_records(&h.queue).await.is_empty());
}

/// A handler running three visibility timeouts is executed once: the
/// driver keeps extending the message's visibility while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_handler_is_delivered_once_thanks_to_visibility_renewal() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-lease").await;
    let job = h.job("long").retry(5).build().unwrap();
    let calls = Calls::default();
    let c = calls.clone();
    let mut registry = Registry::new();
    registry
        .register(&job, move |ctx, _: Work| {
            c.record(&ctx);
            async {
                tokio::time::sleep(VISIBILITY * 3).await;
                Ok(())
            }
        })
        .unwrap();
    // Two slots: the consumer keeps polling while the handler runs.
    let consumer = h.start(registry, 2);
    h.producer.dispatch(&job, &Work { id: 1 }).await.unwrap();
    h.events
        .wait_count(Duration::from_secs(30), "succeeded", 1)
        .await;
    tokio::time::sleep(VISIBILITY + MS(1500)).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.attempts(), [1], "executed exactly once");
    assert_eq!(h.events.names(), ["succeeded"]);
    assert_eq!(messages_on(&backend.driver().await, &h.queue).await, 0);
}

/// A work queue whose redrive policy would dead-letter before the facade's
/// cap is refused as a configuration error; one at the cap is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_policy_below_the_cap_is_refused() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-redrive").await;
    let driver = backend.driver().await;
    let dlq = format!("{}-dlq", h.queue);
    let low = format!("{}-low", h.queue);
    let ok = format!("{}-ok", h.queue);
    for name in [&dlq, &low, &ok] {
        backend.delete_later(name.clone());
    }
    let client = driver.client();
    let dlq_url = client
        .create_queue()
        .queue_name(&dlq)
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let dlq_arn = client
        .get_queue_attributes()
        .queue_url(dlq_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone();
    for (name, max) in [(&low, 3), (&ok, 11)] {
        client
            .create_queue()
            .queue_name(name)
            .attributes(
                QueueAttributeName::RedrivePolicy,
                serde_json::json!({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
    }
    assert_eq!(driver.config().largest_attempt_cap, 10);

    let refused = driver.subscribe(&low, 4).await.err().expect("refused");
    assert_eq!(refused.kind(), ErrorKind::Config, "{refused}");
    assert!(
        refused.to_string().contains("maxReceiveCount 3"),
        "{refused}"
    );
    let refused = driver.send(&low, outgoing("m1", None)).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Config, "{refused}");

    driver.send(&ok, outgoing("m2", None)).await.unwrap();
    drop(driver.subscribe(&ok, 4).await.unwrap());

    // A lower cap accepts the low policy: a cap of 2 needs 3 receives (the
    // third records a message that crashed its worker every time).
    let mut lenient = config();
    lenient.largest_attempt_cap = 2;
    let lenient = backend.driver_with(lenient).await;
    lenient.send(&low, outgoing("m3", None)).await.unwrap();
}

/// DelaySeconds stops at 900 s: longer dispatch delays are unsupported,
/// 900 s (and anything that rounds up to it) is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_delay_above_900_seconds_is_unsupported() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-delay-cap").await;
    let driver = backend.driver().await;
    let err = driver
        .send(&h.queue, outgoing("late", Some(Duration::from_secs(901))))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    let err = driver
        .send(&h.queue, outgoing("late", Some(MS(900_001))))
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Unsupported,
        "900.001 s rounds up to 901 s"
    );
    driver
        .send(&h.queue, outgoing("ok", Some(MS(899_500))))
        .await
        .unwrap();
    driver
        .send(&h.queue, outgoing("ok", Some(Duration::from_secs(900))))
        .await
        .unwrap();
    assert_eq!(messages_on(&driver, &h.queue).await, 2);
}

/// A queue name SQS cannot have (`.`) is refused clearly, not mapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dotted_queue_names_are_refused() {
    let backend = sqs();
    let driver = backend.driver().await;
    let err = driver
        .send("reports.daily", outgoing("m", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string().contains("not a valid SQS queue name"),
        "{err}"
    );
    let err = driver.subscribe("reports.daily", 1).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
}

/// A delivery dropped unsettled is made visible again at once (its receive
/// count has risen), and a `next()` dropped mid-poll loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_deliveries_and_polls_lose_nothing() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-drop").await;
    let driver = backend.driver().await;
    let mut subscription = driver.subscribe(&h.queue, 1).await.unwrap();
    // A poll dropped while the long poll is in flight...
    assert!(tokio::time::timeout(MS(100), subscription.next())
        .await
        .is_err());
    // ...keeps its receive call: the message it gets is handed out next.
    driver.send(&h.queue, outgoing("m1", None)).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("delivered")
        .unwrap()
        .unwrap();
    assert_eq!(first.attempt(), 1);
    let dropped_at = Instant::now();
    drop(first);
    let again = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("redelivered")
        .unwrap()
        .unwrap();
    assert_eq!(again.attempt(), 2);
    assert!(
        dropped_at.elapsed() < VISIBILITY,
        "released at once, not after the visibility timeout ({:?})",
        dropped_at.elapsed()
    );
    again.settle(&Settlement::Ack).await.unwrap();
    assert_eq!(messages_on(&driver, &h.queue).await, 0);
}

/// What the fake SQS endpoint does with a `SendMessage`.
#[derive(Clone, Copy)]
enum OnSend {
    /// Read the request, then close the connection without an answer.
    Close,
    /// Read the request and never answer (until the server's own deadline).
    Hang,
}

/// A fake SQS endpoint on loopback that answers `GetQueueUrl` and
/// `GetQueueAttributes` and misbehaves on `SendMessage`. It stops accepting
/// after 30 s. Returns its URL.
fn fake_sqs(on_send: OnSend) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let queue_url = format!("{endpoint}/000000000000/fake");
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let Ok((stream, _)) = listener.accept() else {
                std::thread::sleep(MS(10));
                continue;
            };
            let queue_url = queue_url.clone();
            std::thread::spawn(move || {
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(30)))
                    .unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    let (mut target, mut length) = (String::new(), 0usize);
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("x-amz-target:") {
                            target = v.trim().to_string();
                        } else if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let answer = match target.as_str() {
                        "amazonsqs.getqueueurl" => format!("{{\"QueueUrl\":\"{queue_url}\"}}"),
                        "amazonsqs.getqueueattributes" => "{\"Attributes\":{}}".to_string(),
                        _ => match on_send {
                            OnSend::Close => return,
                            OnSend::Hang => {
                                std::thread::sleep(Duration::from_secs(5));
                                return;
                            }
                        },
                    };
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/x-amz-json-1.0\r\ncontent-length: {}\r\n\r\n{answer}",
                        answer.len()
                    );
                    if writer.write_all(response.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    endpoint
}

/// Dispatch errors say whether SQS may have the message: refused before
/// sending (no connection, or an error answer) is `NotAccepted`; a request
/// sent whose answer never comes (connection closed, timeout) is `Uncertain`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_errors_distinguish_not_accepted_from_uncertain() {
    let short = |endpoint: String| {
        let mut config = config();
        config.endpoint = Some(endpoint);
        config.operation_timeout = Duration::from_secs(1);
        config
    };
    // Nothing listens: nothing was sent.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let driver = SqsDriver::new(short(endpoint)).unwrap();
    let err = driver
        .send("anything", outgoing("m", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");

    // The request went out, the connection closed before an answer.
    let driver = SqsDriver::new(short(fake_sqs(OnSend::Close))).unwrap();
    let err = driver.send("fake", outgoing("m", None)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Uncertain, "{err}");

    // The request went out and no answer came in time.
    let driver = SqsDriver::new(short(fake_sqs(OnSend::Hang))).unwrap();
    let err = driver.send("fake", outgoing("m", None)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Uncertain, "{err}");

    // SQS answered with an error (the queue was deleted behind the driver's back).
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-refused").await;
    let driver = backend.driver().await;
    driver.send(&h.queue, outgoing("m1", None)).await.unwrap();
    delete_behind_the_drivers_back(&driver, &h.queue).await;
    let err = driver
        .send(&h.queue, outgoing("m2", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
}

/// A loopback port nothing listens on (bound, then released).
/// Deletes `queue` with the SDK directly, so `driver` still holds its URL.
async fn delete_behind_the_drivers_back(driver: &SqsDriver, queue: &str) {
    let url = queue_url(driver, queue).await;
    driver
        .client()
        .delete_queue()
        .queue_url(url)
        .send()
        .await
        .unwrap();
}

fn closed_endpoint() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    endpoint
}

/// A TCP relay to the emulator on a port of its own, closed (listener and
/// every connection) when its task set is dropped: an endpoint that goes
/// down after the driver has used it.
async fn relay_to_emulator() -> (String, tokio::task::JoinSet<()>) {
    let upstream = config()
        .endpoint
        .unwrap()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            connections.spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    (endpoint, tasks)
}

/// Five dispatches to `queue`, each `NotAccepted` well within the operation
/// timeout (not after the whole of it); returns their latencies.
async fn dispatch_while_down(driver: &SqsDriver, queue: &str) -> Vec<Duration> {
    let timeout = driver.config().operation_timeout;
    let mut latencies = Vec::new();
    for i in 0..5 {
        let started = Instant::now();
        let err = driver
            .send(queue, outgoing(&format!("down-{i}"), None))
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
        assert!(
            took < timeout / 2,
            "dispatch {i} took {took:?} to fail with the endpoint down; the operation timeout is {timeout:?}: {err}"
        );
        latencies.push(took);
    }
    latencies
}

/// With the endpoint down, a dispatch fails fast as `NotAccepted` (nothing
/// was sent), whether the driver never reached SQS or had resolved the
/// queue before the endpoint went away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_while_the_endpoint_is_down_fails_fast_as_not_accepted() {
    // Never reachable: the queue's URL cannot even be looked up.
    let mut down = config();
    down.endpoint = Some(closed_endpoint());
    let timeout = down.operation_timeout;
    let driver = SqsDriver::new(down).unwrap();
    let never = dispatch_while_down(&driver, "never-reached").await;
    println!("dispatch with nothing listening (operation timeout {timeout:?}): {never:?}");

    // Reachable at first (the queue's URL is known), then down.
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-down").await;
    let (endpoint, relay) = relay_to_emulator().await;
    let mut through_relay = config();
    through_relay.endpoint = Some(endpoint);
    let driver = SqsDriver::new(through_relay).unwrap();
    driver.send(&h.queue, outgoing("up", None)).await.unwrap();
    drop(relay);
    tokio::time::sleep(MS(100)).await;
    let later = dispatch_while_down(&driver, &h.queue).await;
    println!("dispatch after the endpoint went down: {later:?}");
    let direct = backend.driver().await;
    assert_eq!(
        messages_on(&direct, &h.queue).await,
        1,
        "only the dispatch made while up arrived"
    );
}

/// Connecting to an endpoint where nothing listens is a connection error
/// (retry later), not a configuration error (fix the settings).
#[tokio::test]
async fn connecting_with_nothing_listening_is_a_connection_error() {
    let mut down = config();
    down.endpoint = Some(closed_endpoint());
    let err = SqsDriver::connect(down).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
}

/// Every tracing line (the SDK's included, at every level) written after
/// [`start`](Self::start).
#[derive(Clone, Default)]
struct CapturedLogs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLogs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    /// Installs the capture as the process's subscriber (every thread, so
    /// the runtime's workers too; lines of other tests running meanwhile
    /// are captured as well, which only widens the check).
    fn start(&self) {
        let logs = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || logs.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other test of this binary installs a subscriber");
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The access key, the secret key, the session token and message bodies
/// appear in no tracing line (the SDK's own, at trace level, included) and
/// in no error's `Display` or `Debug`, on success and on every failure path:
/// nothing listening, a connection closed mid-request, no answer in time,
/// an error answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_and_payloads_stay_out_of_logs_and_errors() {
    const ACCESS_KEY: &str = "AKIAQUEUELEAKPROBE01";
    const SECRET_KEY: &str = "queueLeakProbeSecret/0123456789abcdefXYZ";
    const TOKEN: &str = "queueLeakProbeSessionToken0123456789";
    const PAYLOAD: &str = "queue-leak-probe-payload";
    let leaky = |endpoint: String| {
        let mut config = config();
        config.endpoint = Some(endpoint);
        config.operation_timeout = Duration::from_secs(1);
        config.credentials = SqsCredentials::Static {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: Some(TOKEN.into()),
        };
        config
    };
    let message = |id: &str| Outgoing {
        id: id.into(),
        body: format!("{{\"raw\":\"{PAYLOAD}\"}}").into_bytes(),
        delay: None,
    };
    let logs = CapturedLogs::default();
    logs.start();
    let mut errors = Vec::new();

    let err = SqsDriver::connect(leaky(closed_endpoint()))
        .await
        .unwrap_err();
    errors.push(err);
    let driver = SqsDriver::new(leaky(closed_endpoint())).unwrap();
    errors.push(driver.send("down", message("m1")).await.unwrap_err());
    for on_send in [OnSend::Close, OnSend::Hang] {
        let driver = SqsDriver::new(leaky(fake_sqs(on_send))).unwrap();
        errors.push(driver.send("fake", message("m2")).await.unwrap_err());
    }

    // The emulator: a whole round trip, then an error answer.
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-leak").await;
    let driver = SqsDriver::new(leaky(config().endpoint.unwrap())).unwrap();
    driver.send(&h.queue, message("m3")).await.unwrap();
    let mut subscription = driver.subscribe(&h.queue, 1).await.unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(10), subscription.next())
        .await
        .expect("delivered")
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(delivery.body()).contains(PAYLOAD));
    delivery.settle(&Settlement::Ack).await.unwrap();
    drop(subscription);
    delete_behind_the_drivers_back(&driver, &h.queue).await;
    errors.push(driver.send(&h.queue, message("m4")).await.unwrap_err());

    let logs = logs.text();
    assert!(
        logs.contains("SendMessage"),
        "the SDK's trace lines were captured"
    );
    let errors: Vec<String> = errors
        .iter()
        .flat_map(|e| [e.to_string(), format!("{e:?}")])
        .collect();
    for error in &errors {
        for secret in [ACCESS_KEY, SECRET_KEY, TOKEN, PAYLOAD] {
            assert!(!error.contains(secret), "`{secret}` in an error: {error}");
        }
    }
    // The secret key: nowhere, at any level, from any crate.
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains(SECRET_KEY)).collect();
    assert!(lines.is_empty(), "the secret key in {lines:#?}");
    // The rest: never in the driver's own lines, nor in any crate's lines
    // at info level or above (the SDK's debug and trace lines show the access
    // key id, and at trace the session token and request bodies; the module
    // documentation says to keep them off in production).
    let visible = |line: &&str| {
        line.contains(" queue_native")
            || [" INFO ", " WARN ", " ERROR "]
                .iter()
                .any(|level| line.contains(level))
    };
    for secret in [ACCESS_KEY, TOKEN, PAYLOAD] {
        let lines: Vec<&str> = logs
            .lines()
            .filter(visible)
            .filter(|l| l.contains(secret))
            .collect();
        assert!(lines.is_empty(), "`{secret}` in {lines:#?}");
    }
    println!(
        "{} log lines and {} error texts checked",
        logs.lines().count(),
        errors.len()
    );
}
