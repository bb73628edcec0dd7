//! SQS-specific behaviour beyond the shared suite, against the emulator at
//! `SQS_ENDPOINT` (start it with `tests/sqs-emulator`): the 900 s dispatch
//! limit, queue names, what a dispatch error says SQS may have, an endpoint
//! that goes down, credentials and payloads in the SDK's own log lines;
//! batch dispatch (`SendMessageBatch`: calls of ten, each message's own
//! result) and acks coalesced into `DeleteMessageBatch` (one entry refused
//! fails only its own settlement), on the emulator and on a fake endpoint
//! that counts the calls.
//! Delays rounded up, the 12-hour retry cap, reject, visibility renewal,
//! redrive policies, released deliveries and hidden credentials are
//! scenarios of the suite (`tests/sqs.rs`).
//!
//! Run with
//! `SQS_ENDPOINT=$(tests/sqs-emulator) cargo test -p jobrail-conformance --features sqs --test sqs_extra`.
#![cfg(feature = "sqs")]

use std::time::Duration;

use jobrail::Settlement;
use jobrail_conformance::fixture::{closed_address, sqs_emulator_config, Fixture, Sqs};
use jobrail_conformance::harness::{depth, held};
use jobrail_conformance::servers::Relay;
use jobrail_conformance::Harness;
use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};
use jobrail_native::{Driver, ErrorKind, Outgoing};
use tokio::time::Instant;

const MS: fn(u64) -> Duration = Duration::from_millis;

fn config() -> SqsConfig {
    sqs_emulator_config()
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
    assert_eq!(held(depth(&driver, &h.queue).await), 2);
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
    driver.delete_queue_keeping_url(&h.queue).await.unwrap();
    let err = driver
        .send(&h.queue, outgoing("m2", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
}

/// A loopback endpoint nothing listens on.
fn closed_endpoint() -> String {
    format!("http://{}", closed_address())
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
    let emulator = config().endpoint.unwrap();
    let relay = Relay::start(Relay::address_of(&emulator)).await;
    let mut through_relay = config();
    through_relay.endpoint = Some(relay.url_for(&emulator));
    let driver = SqsDriver::new(through_relay).unwrap();
    driver.send(&h.queue, outgoing("up", None)).await.unwrap();
    drop(relay);
    tokio::time::sleep(MS(100)).await;
    let later = dispatch_while_down(&driver, &h.queue).await;
    println!("dispatch after the endpoint went down: {later:?}");
    let direct = backend.driver().await;
    assert_eq!(
        held(depth(&direct, &h.queue).await),
        1,
        "only the dispatch made while up arrived"
    );
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
    const PAYLOAD: &str = "jobrail-leak-probe-payload";
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
    driver.delete_queue_keeping_url(&h.queue).await.unwrap();
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
        line.contains(" jobrail_native")
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

/// What the batch fake saw: each request's `X-Amz-Target` (lower case,
/// without the `amazonsqs.` prefix) and JSON body.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>;

/// A fake SQS endpoint for the batch calls: queues resolve to themselves;
/// the first `ReceiveMessage` answers ten messages (receipts `r0`..`r9`),
/// later ones nothing after 200 ms; `DeleteMessageBatch` refuses receipt
/// `r3` (`ReceiptHandleIsInvalid`, the sender's fault) and deletes the
/// rest; `SendMessageBatch` refuses bodies containing `refuse` (sender's
/// fault), fails those containing `server` on its own side (`SenderFault`
/// false) and stores the rest. Stops accepting after 30 s.
fn batch_fake() -> (String, Seen) {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    let seen: Seen = Arc::default();
    let received = Arc::new(AtomicBool::new(false));
    let (kept, base) = (seen.clone(), endpoint.clone());
    std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let Ok((stream, _)) = listener.accept() else {
                std::thread::sleep(MS(5));
                continue;
            };
            let (seen, received, base) = (kept.clone(), received.clone(), base.clone());
            std::thread::spawn(move || {
                stream.set_nonblocking(false).unwrap();
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
                            target = v.trim().trim_start_matches("amazonsqs.").to_string();
                        } else if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let request: serde_json::Value =
                        serde_json::from_slice(&body).unwrap_or_default();
                    seen.lock().unwrap().push((target.clone(), request.clone()));
                    let entries = || request["Entries"].as_array().cloned().unwrap_or_default();
                    let answer = match target.as_str() {
                        "getqueueurl" | "createqueue" => serde_json::json!({
                            "QueueUrl": format!("{base}/000000000000/{}", request["QueueName"].as_str().unwrap_or("q"))
                        }),
                        "getqueueattributes" => serde_json::json!({"Attributes": {}}),
                        "receivemessage" => {
                            if received.swap(true, Ordering::SeqCst) {
                                std::thread::sleep(MS(200));
                                serde_json::json!({"Messages": []})
                            } else {
                                let messages: Vec<_> = (0..10)
                                    .map(|i| {
                                        serde_json::json!({
                                            "MessageId": format!("m{i}"),
                                            "ReceiptHandle": format!("r{i}"),
                                            "MD5OfBody": "0",
                                            "Body": "{}",
                                            "Attributes": {"ApproximateReceiveCount": "1"},
                                        })
                                    })
                                    .collect();
                                serde_json::json!({"Messages": messages})
                            }
                        }
                        "deletemessagebatch" => {
                            let (mut ok, mut failed) = (vec![], vec![]);
                            for entry in entries() {
                                if entry["ReceiptHandle"] == "r3" {
                                    failed.push(serde_json::json!({
                                        "Id": entry["Id"], "SenderFault": true,
                                        "Code": "ReceiptHandleIsInvalid",
                                        "Message": "The input receipt handle is not a valid receipt handle.",
                                    }));
                                } else {
                                    ok.push(serde_json::json!({"Id": entry["Id"]}));
                                }
                            }
                            serde_json::json!({"Successful": ok, "Failed": failed})
                        }
                        "sendmessagebatch" => {
                            let (mut ok, mut failed) = (vec![], vec![]);
                            for entry in entries() {
                                let body = entry["MessageBody"].as_str().unwrap_or_default();
                                if body.contains("refuse") || body.contains("server") {
                                    failed.push(serde_json::json!({
                                        "Id": entry["Id"], "SenderFault": body.contains("refuse"),
                                        "Code": if body.contains("refuse") { "InvalidParameterValue" } else { "InternalError" },
                                    }));
                                } else {
                                    ok.push(serde_json::json!({
                                        "Id": entry["Id"], "MessageId": "m", "MD5OfMessageBody": "0",
                                    }));
                                }
                            }
                            serde_json::json!({"Successful": ok, "Failed": failed})
                        }
                        "sendmessage" => {
                            serde_json::json!({"MessageId": "m", "MD5OfMessageBody": "0"})
                        }
                        _ => serde_json::json!({}),
                    };
                    let answer = answer.to_string();
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
    (endpoint, seen)
}

/// How many requests of `target` the fake saw.
fn calls(seen: &Seen, target: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| t == target)
        .count()
}

fn fake_driver(endpoint: String) -> SqsDriver {
    let mut config = config();
    config.endpoint = Some(endpoint);
    config.operation_timeout = Duration::from_secs(5);
    SqsDriver::new(config).unwrap()
}

/// Acks are coalesced: ten deliveries acked together make one
/// `DeleteMessageBatch` call (no `DeleteMessage`), and the one entry SQS
/// refuses fails only its own settlement, as not accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_share_a_delete_batch_and_a_refused_entry_fails_alone() {
    let (endpoint, seen) = batch_fake();
    let driver = fake_driver(endpoint);
    let mut subscription = driver.subscribe("acks", 10).await.unwrap();
    let mut deliveries = Vec::new();
    for _ in 0..10 {
        deliveries.push(subscription.next().await.unwrap().unwrap());
    }
    let settled = futures_join(deliveries).await;
    for (i, result) in settled.iter().enumerate() {
        match (i, result) {
            (3, Err(e)) => {
                assert_eq!(e.kind(), ErrorKind::NotAccepted, "{e}");
                assert!(e.to_string().contains("ReceiptHandleIsInvalid"), "{e}");
            }
            (3, Ok(())) => panic!("the refused entry's ack succeeded"),
            (_, Err(e)) => panic!("ack {i} failed with its neighbour: {e}"),
            (_, Ok(())) => {}
        }
    }
    assert_eq!(calls(&seen, "deletemessage"), 0, "no single deletes");
    assert_eq!(
        calls(&seen, "deletemessagebatch"),
        1,
        "one batch for ten acks"
    );
    let deleted: usize = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| t == "deletemessagebatch")
        .map(|(_, body)| body["Entries"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(deleted, 10);
    drop(subscription);
}

/// Settles every delivery at once and returns the results in order.
async fn futures_join(
    deliveries: Vec<Box<dyn jobrail_native::Delivery>>,
) -> Vec<Result<(), jobrail_native::DriverError>> {
    let tasks: Vec<_> = deliveries
        .into_iter()
        .map(|d| tokio::spawn(async move { d.settle(&Settlement::Ack).await }))
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

/// A batch dispatch is `SendMessageBatch` calls of at most ten (no single
/// `SendMessage`), and each message gets its own entry's result: an entry
/// SQS refuses is not accepted, one SQS failed on its own side uncertain,
/// the others stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_dispatch_is_send_message_batch_with_per_message_results() {
    let (endpoint, seen) = batch_fake();
    let driver = fake_driver(endpoint);
    let messages: Vec<Outgoing> = (0..25)
        .map(|i| match i {
            7 => outgoing("refuse", None),
            18 => outgoing("server", None),
            _ => outgoing(&format!("ok{i}"), None),
        })
        .collect();
    let results = driver.send_batch("dispatch", messages).await;
    assert_eq!(results.len(), 25);
    for (i, result) in results.iter().enumerate() {
        match i {
            7 => assert_eq!(result.as_ref().unwrap_err().kind(), ErrorKind::NotAccepted),
            18 => assert_eq!(result.as_ref().unwrap_err().kind(), ErrorKind::Uncertain),
            _ => assert!(result.is_ok(), "message {i}: {result:?}"),
        }
    }
    assert_eq!(calls(&seen, "sendmessage"), 0, "no single sends");
    let sizes: Vec<usize> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| t == "sendmessagebatch")
        .map(|(_, body)| body["Entries"].as_array().map_or(0, Vec::len))
        .collect();
    let mut sorted = sizes.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![5, 10, 10], "calls of ten: {sizes:?}");
}

/// On the emulator: a batch with a message SQS refuses in the middle (a
/// binary body whose base64 text is over SQS's 1 MiB) and one the driver
/// refuses before any I/O (a 901 s delay) stores all the others, and each
/// message's result says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_dispatch_refuses_each_message_alone_on_the_emulator() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-batch-refused").await;
    let driver = backend.driver().await;
    let mut messages: Vec<Outgoing> = (0..12).map(|i| outgoing(&format!("ok{i}"), None)).collect();
    messages[4] = Outgoing {
        id: "binary".into(),
        // 1,066,668 characters of base64: over the 1 MiB SQS (and the
        // emulator) takes in a message. (The producer would refuse it
        // before any I/O; the driver leaves that to SQS.)
        body: vec![0xff; 800_000],
        delay: None,
    };
    messages[9] = outgoing("late", Some(Duration::from_secs(901)));
    let results = driver.send_batch(&h.queue, messages).await;
    for (i, result) in results.iter().enumerate() {
        match i {
            4 => assert_eq!(result.as_ref().unwrap_err().kind(), ErrorKind::NotAccepted),
            9 => assert_eq!(result.as_ref().unwrap_err().kind(), ErrorKind::Unsupported),
            _ => assert!(result.is_ok(), "message {i}: {result:?}"),
        }
    }
    assert_eq!(held(depth(&driver, &h.queue).await), 10);
}

/// On the emulator: 25 deliveries acked together (their deletes coalesced)
/// all succeed and leave the queue empty, nothing hidden or redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_deliveries_leave_the_queue_empty() {
    let backend = sqs();
    let h = Harness::new(&backend, "sqs-acks").await;
    let driver = backend.driver().await;
    let messages: Vec<Outgoing> = (0..25).map(|i| outgoing(&format!("a{i}"), None)).collect();
    for result in driver.send_batch(&h.queue, messages).await {
        result.unwrap();
    }
    let mut subscription = driver.subscribe(&h.queue, 25).await.unwrap();
    let mut deliveries = Vec::new();
    let mut bodies = std::collections::BTreeSet::new();
    while deliveries.len() < 25 {
        let delivery = subscription.next().await.unwrap().unwrap();
        assert!(bodies.insert(delivery.body().to_vec()), "delivered twice");
        deliveries.push(delivery);
    }
    for result in futures_join(deliveries).await {
        result.unwrap();
    }
    assert_eq!(held(depth(&driver, &h.queue).await), 0);
    drop(subscription);
}
