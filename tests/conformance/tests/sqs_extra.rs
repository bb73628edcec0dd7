//! SQS-specific behaviour beyond the shared suite, against the emulator at
//! `SQS_ENDPOINT` (start it with `tests/sqs-emulator`): the 900 s dispatch
//! limit, queue names, what a dispatch error says SQS may have, an endpoint
//! that goes down, credentials and payloads in the SDK's own log lines.
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
