//! NATS-specific behaviour beyond the shared suite, against a real server
//! with JetStream (`NATS_URL`, default `nats://127.0.0.1:4222`): a worker
//! killed mid-job, conflicting topology, refused delayed dispatch, a lost
//! connection, a server outage. Lease renewal, dropped deliveries, MaxDeliver
//! and hidden credentials are scenarios of the suite (`tests/nats.rs`).
//!
//! Run with `cargo test -p jobrail-conformance --features nats --test nats_extra`.
#![cfg(feature = "nats")]

use std::process::Command;
use std::time::Duration;

use jobrail_conformance::crash;
use jobrail_conformance::fixture::{Fixture, Nats};
use jobrail_conformance::harness::outgoing;
use jobrail_conformance::scenarios::Work;
use jobrail_conformance::servers::{NatsServer, Relay};
use jobrail_conformance::{Backend, Harness};
use jobrail_native::nats::NatsConfig;
use jobrail_native::{DispatchOptions, Driver, ErrorKind};

const MS: fn(u64) -> Duration = Duration::from_millis;
const STREAM_PREFIX: &str = "EXTRA";
const SUBJECT_PREFIX: &str = "extra";

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A fixture with its own AckWait, through `url`; streams are deleted when
/// it is dropped.
fn nats_via(url: String, ack_wait: Duration) -> Fixture<Nats> {
    let mut config = NatsConfig::new(url).ack_wait(ack_wait);
    config.stream_prefix = STREAM_PREFIX.into();
    config.subject_prefix = SUBJECT_PREFIX.into();
    config.fetch_expiry = Duration::from_secs(2);
    // A publish lost with a cut connection is reported uncertain sooner.
    config.operation_timeout = Duration::from_secs(3);
    config.connection_name = "conformance-extra".into();
    Fixture::new(config)
}

fn nats(ack_wait: Duration) -> Fixture<Nats> {
    nats_via(url(), ack_wait)
}

/// The kill worker's command for `queue` (see `src/bin/nats_kill_worker.rs`).
fn kill_worker(queue: &str, job: &str, cap: u32, ack_wait: Duration) -> Command {
    let mut worker = Command::new(env!("CARGO_BIN_EXE_nats_kill_worker"));
    worker
        .args([
            queue,
            job,
            &cap.to_string(),
            STREAM_PREFIX,
            SUBJECT_PREFIX,
            &ack_wait.as_millis().to_string(),
        ])
        .env("NATS_URL", url());
    worker
}

/// A worker SIGKILLed mid-job loses nothing: once AckWait passes without a
/// lease renewal the server redelivers the message with a higher delivery
/// count, until the cap turns an ordinary error into a terminal failure;
/// the failed message leaves the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_loses_nothing_and_counts_the_attempt() {
    let ack_wait = Duration::from_secs(2);
    let backend = nats(ack_wait);
    let queue = crash::killed_worker_loses_nothing_and_counts_the_attempt(
        &backend,
        "nats-kill",
        move |queue, job, cap| kill_worker(queue, job, cap, ack_wait),
    )
    .await;
    let driver = backend.driver().await;
    assert_eq!(driver.stored_count(&queue).await.unwrap(), 0);
}

/// A stream or consumer that already exists with another configuration is
/// a clear configuration error, for dispatch and subscription alike; the
/// driver stays usable for other queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_existing_stream_or_consumer_is_a_config_error() {
    let backend = nats(Duration::from_secs(2));
    let h = Harness::new(&backend, "nats-conflict").await;

    // Someone made the stream for other subjects.
    let mut other = backend.config();
    other.subject_prefix = "someone-else".into();
    let first = backend.driver_with(other).await;
    first.send(&h.queue, outgoing("a", None)).await.unwrap();
    let driver = backend.driver().await;
    let err = driver
        .send(&h.queue, outgoing("b", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(
        err.to_string().contains(&driver.stream_name(&h.queue)),
        "{err}"
    );
    assert!(err.to_string().contains("subjects"), "{err}");
    let err = match driver.subscribe(&h.queue, 1).await {
        Ok(_) => panic!("subscribing to a conflicting stream succeeded"),
        Err(e) => e,
    };
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");

    // Someone made the consumer with another AckWait, or a MaxDeliver.
    let queue = format!("{}-consumer", h.queue);
    let other = backend.config().ack_wait(Duration::from_secs(45));
    let first = backend.driver_with(other).await;
    first.send(&queue, outgoing("c", None)).await.unwrap();
    let err = driver.send(&queue, outgoing("d", None)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("AckWait"), "{err}");
    let queue = format!("{}-limit", h.queue);
    let mut other = backend.config();
    other.max_deliver = Some(20);
    let first = backend.driver_with(other).await;
    first.send(&queue, outgoing("e", None)).await.unwrap();
    let err = match driver.subscribe(&queue, 1).await {
        Ok(_) => panic!("subscribing with a conflicting consumer succeeded"),
        Err(e) => e,
    };
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert!(err.to_string().contains("MaxDeliver 20"), "{err}");

    // Other queues are fine.
    let fine = format!("{}-other", h.queue);
    driver.send(&fine, outgoing("f", None)).await.unwrap();
    assert_eq!(driver.stored_count(&fine).await.unwrap(), 1);
}

/// A delayed dispatch is accepted, by the driver and the producer alike,
/// and kept out of the work stream until it is due (on the machine's 2.9
/// server, in the relay's hold stream: `native/tests/nats_delays.rs` covers
/// both mechanisms); a zero delay is no delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_dispatch_is_held_out_of_the_work_stream() {
    let backend = nats(Duration::from_secs(2));
    let h = Harness::new(&backend, "nats-delay").await;
    let driver = backend.driver().await;
    assert!(driver.capabilities().delayed_dispatch);
    assert_eq!(driver.capabilities().max_dispatch_delay, None);
    driver
        .send(&h.queue, outgoing("late", Some(MS(60_000))))
        .await
        .unwrap();
    let job = h.job("delayed").build().unwrap();
    h.producer
        .dispatch(&job)
        .options(DispatchOptions {
            delay: Some(MS(60_000)),
            ..Default::default()
        })
        .send(&Work { id: 1 })
        .await
        .unwrap();
    assert_eq!(driver.stored_count(&h.queue).await.unwrap(), 0);
    // A zero delay is no delay.
    driver
        .send(&h.queue, outgoing("now", Some(Duration::ZERO)))
        .await
        .unwrap();
    assert_eq!(driver.stored_count(&h.queue).await.unwrap(), 1);
}

/// The connection is lost mid-job: async-nats reconnects, the subscription
/// sends fresh pull requests and consumption resumes. A JetStream ack is not
/// tied to a connection, so the in-flight delivery (its lease renewed
/// across the reconnection) is still acknowledged and never redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_resumes_after_the_connection_is_lost() {
    let relay = Relay::start(Relay::address_of(&url())).await;
    let backend = nats_via(relay.url_for(&url()), Duration::from_secs(2));
    let run = crash::InterruptedJob::start(&backend, "nats-reconnect").await;
    relay.cut();
    // The handler returns a while after the cut, across the reconnection.
    tokio::time::sleep(MS(1500)).await;
    run.release();

    run.consumption_resumes().await;
    // Past AckWait: the slow delivery was acknowledged, not redelivered.
    tokio::time::sleep(MS(2500)).await;
    assert_eq!(run.calls.attempts(), [1]);
    assert!(run.harness.events.settlement_failures().is_empty());
    run.finish().await;
}

/// A private `nats-server` (see [`NatsServer`]) storing in a fresh temporary
/// directory, or `None` (after saying why) when none is installed, except
/// under `CI=true`, where a missing server fails the run.
async fn private_server() -> Option<(NatsServer, RemovedOnDrop)> {
    if NatsServer::binary().is_none() {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(
            !ci,
            "nats-server is not installed (not on PATH nor in /usr/sbin) and CI=true"
        );
        eprintln!("SKIPPED: nats-server is not installed (not on PATH nor in /usr/sbin)");
        return None;
    }
    let store = std::env::temp_dir().join(format!(
        "jobrail-nats-extra-{}-{}",
        std::process::id(),
        &jobrail::new_message_id()[..8]
    ));
    let server = NatsServer::start(&store, None).await.unwrap();
    Some((server, RemovedOnDrop(store)))
}

/// A directory removed when this is dropped.
struct RemovedOnDrop(std::path::PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// While the server is down, every dispatch fails at once as not accepted
/// (not only the first one: none waits for the operation timeout), and once
/// the server is back on the same port and store, dispatch works again and
/// the message is consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_fails_fast_while_the_server_is_down() {
    let Some((mut server, _store)) = private_server().await else {
        return;
    };
    let mut config = NatsConfig::new(server.url());
    config.stream_prefix = STREAM_PREFIX.into();
    config.subject_prefix = SUBJECT_PREFIX.into();
    config.operation_timeout = Duration::from_secs(10);
    config.max_reconnect_backoff = MS(500);
    config.connection_name = "conformance-outage".into();
    let backend = Fixture::<Nats>::new(config);
    let h = Harness::new(&backend, "nats-outage").await;
    let job = h.job("outage").build().unwrap();
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();

    server.kill();
    // The client notices the closed connection a moment after the kill (on
    // a loaded machine, after a dispatch or two): a dispatch written to the
    // socket before that may have gone out as far as the client knows, and
    // answers Uncertain, never Ok (the client may still write it once it
    // reconnects: see the end). Once noticed, every dispatch is refused at
    // once.
    let noticed = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut uncertain = 0;
    loop {
        let err = h
            .producer
            .dispatch(&job)
            .send(&Work { id: 50 + uncertain })
            .await
            .expect_err("a dispatch while the server is down succeeded");
        match err.kind() {
            ErrorKind::NotAccepted => break,
            ErrorKind::Uncertain if tokio::time::Instant::now() < noticed => uncertain += 1,
            _ => panic!("a dispatch while the server is down: {err}"),
        }
    }
    println!("nats: {uncertain} dispatch(es) uncertain before the client noticed the outage");
    let mut latencies = Vec::new();
    for i in 0..5 {
        let started = tokio::time::Instant::now();
        let err = h
            .producer
            .dispatch(&job)
            .send(&Work { id: 100 + i })
            .await
            .expect_err("a dispatch while the server is down succeeded");
        let took = started.elapsed();
        latencies.push(took);
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "dispatch {i}: {err}");
        assert!(
            took < Duration::from_secs(2),
            "dispatch {i} took {took:?} (operation timeout 10 s): {err}"
        );
    }
    println!("nats: dispatch latencies while the server is down: {latencies:?}");

    server.up().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match h.producer.dispatch(&job).send(&Work { id: 2 }).await {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "dispatch still fails 15 s after the server came back: {e}"
                );
                tokio::time::sleep(MS(100)).await;
            }
        }
    }
    // The messages accepted before and after the outage, and of those
    // answered Uncertain, any: the client keeps what it had not written
    // when the connection broke and writes it once it reconnects, so an
    // uncertain dispatch may be stored (what Uncertain says). None of those
    // refused as not accepted.
    let stored = backend.driver().await.stored_count(&h.queue).await.unwrap();
    let ids = h.consume_ids(&job, stored as usize).await;
    let (sure, maybe): (Vec<u32>, Vec<u32>) = ids.into_iter().partition(|id| *id < 50);
    assert_eq!(sure, [1, 2]);
    assert!(
        maybe.iter().all(|id| (50..50 + uncertain).contains(id)),
        "stored beside 1 and 2: {maybe:?} ({uncertain} uncertain from 50)"
    );
    assert_eq!(
        backend.driver().await.stored_count(&h.queue).await.unwrap(),
        0
    );
}

/// Under load, pull requests stay large: with a backlog already stored and
/// 64 handlers, each pull asks for at least half the window (32), so the
/// requests for N messages stay near N / 32 (the old one-request-at-a-time
/// subscription sent one per handful of free slots). Every message runs
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_requests_stay_large_under_load() {
    const N: usize = 2000;
    let backend = nats(Duration::from_secs(30));
    let driver = backend.driver().await;
    let h = Harness::on(
        &backend,
        std::sync::Arc::new(driver.clone()),
        Harness::queue_name("nats-pulls"),
    );
    let job = h.job("pulls").build().unwrap();
    let payloads: Vec<Work> = (0..N as u32).map(|id| Work { id }).collect();
    for result in h.producer.dispatch(&job).send_batch(&payloads).await {
        result.unwrap();
    }
    let before = driver.pull_requests_sent();
    let calls = jobrail_conformance::Calls::default();
    let mut registry = jobrail::Registry::new();
    registry
        .register(&job, calls.handler(|_, _| Ok(())))
        .unwrap();
    let consumer = h.start(registry, 64);
    h.events.wait_count(h.patience * 4, "succeeded", N).await;
    let pulls = driver.pull_requests_sent() - before;
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.count(), N, "each message ran once");
    assert!(
        pulls <= (N / 32 + 5) as u64,
        "{pulls} pull requests for {N} messages at 64 in flight"
    );
    assert_eq!(driver.stored_count(&h.queue).await.unwrap(), 0);
}

/// A batch whose middle message the server itself refuses (over the
/// stream's `max_msg_size`, below the driver's own limit) answers
/// `NotAccepted` for that one alone; the others are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_refusal_in_a_batch_is_that_message_alone() {
    let backend = nats(Duration::from_secs(30));
    let driver = backend.driver().await;
    let queue = Harness::queue_name("nats-batch-refused");
    driver.limit_stored_message_size(&queue, 512).await.unwrap();
    let mut big = outgoing("big", None);
    big.body = vec![b'x'; 2048];
    let results = driver
        .send_batch(
            &queue,
            vec![outgoing("first", None), big, outgoing("last", None)],
        )
        .await;
    assert_eq!(results.len(), 3, "one answer per message");
    assert!(results[0].is_ok(), "{:?}", results[0]);
    let err = results[1].as_ref().expect_err("the server stored it");
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    assert!(results[2].is_ok(), "{:?}", results[2]);
    assert_eq!(driver.stored_count(&queue).await.unwrap(), 2);
}

/// A failure record the server refuses (over the failure stream's
/// `max_msg_size`) is a refused settlement: the delivery is not `-NAK`ed,
/// which would bring it back at once, again and again; it comes back when
/// AckWait ends, and once the record fits it is recorded and gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_failure_record_waits_for_ack_wait() {
    let ack_wait = Duration::from_secs(2);
    let backend = nats(ack_wait);
    let h = Harness::new(&backend, "nats-record-refused").await;
    let driver = backend.driver().await;
    driver
        .limit_failure_record_size(&h.queue, 64)
        .await
        .unwrap();
    let job = h.job("record-refused").max_deliveries(5).build().unwrap();
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counter = runs.clone();
    let mut registry = jobrail::Registry::new();
    registry
        .register(&job, move |_: jobrail::JobContext, _: Work| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err(jobrail::JobError::permanent("no")) }
        })
        .unwrap();
    let consumer = h.start(registry, 1);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let (_, error) = h.events.wait_settlement_failure(h.patience).await;
    let refused_at = tokio::time::Instant::now();
    assert!(error.contains("refused the publish"), "{error}");
    let ran = || runs.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(ack_wait / 2 - MS(100)).await;
    assert_eq!(ran(), 1, "not handed back at once");
    driver
        .limit_failure_record_size(&h.queue, 1 << 20)
        .await
        .unwrap();
    h.events
        .wait_count(h.patience + ack_wait, "failed", 1)
        .await;
    assert!(
        refused_at.elapsed() >= ack_wait / 2,
        "{:?}",
        refused_at.elapsed()
    );
    assert_eq!(ran(), 2, "one redelivery, after AckWait");
    assert_eq!(backend.failure_records(&h.queue).await.len(), 1);
    consumer.shutdown().await.unwrap();
}

/// One lease ticker renews every delivery a subscription holds: four
/// handlers, started a third of AckWait apart, each run three AckWaits, and
/// none of their messages is redelivered (each ran once, at attempt 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lease_ticker_keeps_every_long_handler() {
    let hold = Duration::from_secs(1);
    let backend = nats(hold);
    let h = Harness::new(&backend, "nats-leases").await;
    let job = h.job("leases").max_deliveries(5).build().unwrap();
    let calls = jobrail_conformance::Calls::default();
    let c = calls.clone();
    let mut registry = jobrail::Registry::new();
    registry
        .register(&job, move |ctx, _: Work| {
            c.record(&ctx);
            async move {
                tokio::time::sleep(hold * 3).await;
                Ok(())
            }
        })
        .unwrap();
    // Spare slots: a redelivery would be taken while the first runs.
    let consumer = h.start(registry, 8);
    for id in 0..4 {
        h.producer.dispatch(&job).send(&Work { id }).await.unwrap();
        tokio::time::sleep(hold / 3).await;
    }
    h.events
        .wait_count(hold * 4 + h.patience, "succeeded", 4)
        .await;
    tokio::time::sleep(hold * 2).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.attempts(), [1, 1, 1, 1], "each executed exactly once");
    assert_eq!(h.events.names().len(), 4);
}

/// Runs `batches` concurrent `dispatch_batch` calls of `per_batch` messages
/// and `singles` tasks of single dispatches (`per_single` each) on one
/// driver: every call returns within a minute, every message is accepted
/// and stored exactly once.
async fn concurrent_dispatches(
    scenario: &str,
    batches: u32,
    per_batch: u32,
    singles: u32,
    per_single: u32,
) {
    let backend = nats(Duration::from_secs(30));
    let driver = backend.driver().await;
    let h = Harness::on(
        &backend,
        std::sync::Arc::new(driver.clone()),
        Harness::queue_name(scenario),
    );
    let job = h.job("concurrent").build().unwrap();
    // Declared once before, so every call goes straight to publishing.
    h.producer
        .dispatch(&job)
        .send(&Work { id: u32::MAX })
        .await
        .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for b in 0..batches {
        let (producer, job) = (h.producer.clone(), job.clone());
        tasks.spawn(async move {
            let payloads: Vec<Work> = (0..per_batch)
                .map(|i| Work {
                    id: b * per_batch + i,
                })
                .collect();
            for result in producer.dispatch(&job).send_batch(&payloads).await {
                result.expect("each message of a batch is stored");
            }
        });
    }
    for s in 0..singles {
        let (producer, job) = (h.producer.clone(), job.clone());
        tasks.spawn(async move {
            for i in 0..per_single {
                let id = 1_000_000 + s * per_single + i;
                producer.dispatch(&job).send(&Work { id }).await.unwrap();
            }
        });
    }
    let all = async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("every concurrent dispatch returns");
    let expected = u64::from(batches * per_batch + singles * per_single + 1);
    assert_eq!(driver.stored_count(&h.queue).await.unwrap(), expected);
}

/// Eight batches of 1,000 at once hold more unanswered publishes than the
/// client's 5,000: each batch keeps collecting its `PubAck`s while it waits
/// to publish, so all of them finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_batches_all_finish() {
    concurrent_dispatches("nats-batches-8", 8, 1000, 0, 0).await;
}

/// One batch of more messages than the client's 5,000 unanswered
/// publishes (a batch keeps all its `PubAck`s open): when the client makes
/// it wait for a permit, it awaits its own oldest acks, so it finishes; and
/// so do two such batches at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_larger_than_the_clients_permits_finish() {
    concurrent_dispatches("nats-batch-12k", 1, 12_000, 0, 0).await;
    concurrent_dispatches("nats-batches-2x7k", 2, 7_000, 0, 0).await;
}

/// Batches and 32 tasks of single dispatches at once all finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_and_single_dispatches_all_finish() {
    concurrent_dispatches("nats-batches-mixed", 8, 1000, 32, 50).await;
}

/// Drivers on separate connections declaring one new queue's stream at the
/// same instant all succeed: the server may answer the losers' create with
/// "subjects overlap" (the winner's stream already holds the subject)
/// rather than "name in use", and that is the same stream, not a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drivers_declaring_one_stream_at_once_all_succeed() {
    let backend = nats(Duration::from_secs(2));
    let h = Harness::new(&backend, "nats-declare-race").await;
    let mut drivers = Vec::new();
    for _ in 0..6 {
        drivers.push(backend.driver().await);
    }
    for round in 0..8 {
        let queue = format!("{}-{round}", h.queue);
        let mut sends = tokio::task::JoinSet::new();
        for (i, driver) in drivers.iter().enumerate() {
            let (driver, queue) = (driver.clone(), queue.clone());
            sends.spawn(async move { driver.send(&queue, outgoing(&format!("m{i}"), None)).await });
        }
        while let Some(sent) = sends.join_next().await {
            sent.unwrap()
                .unwrap_or_else(|e| panic!("round {round}: a concurrent declaration failed: {e}"));
        }
        assert_eq!(
            drivers[0].stored_count(&queue).await.unwrap(),
            drivers.len() as u64
        );
    }
}

/// Schedules on NATS: a scheduler that stops right after sending a tick's
/// job, before recording the tick fired, leaves the tick's claim held;
/// another scheduler takes the tick over when the lease ends and sends it
/// again, under the same message id (derived from the schedule and the
/// tick), and the work stream's duplicate window drops the copy: every
/// tick runs once, none is missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_sent_again_after_a_takeover_runs_once() {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use jobrail::testing::StopBeforeRecord;
    use jobrail::{Job, JobContext, MemoryClaims, Missed, Registry, Schedule, Tick};
    use jobrail_native::{Producer, Scheduler};

    let backend = nats(Duration::from_secs(5));
    let h = Harness::new(&backend, "nats-ticks").await;
    let job = Job::<String>::builder("tick")
        .queue(h.queue.clone())
        .build()
        .unwrap();
    let schedule = Schedule::builder("every-second", &job, "* * * * * *")
        .missed(Missed::Each(10))
        .lease(Duration::from_secs(1))
        .payload_fn(|tick: &Tick| tick.rfc3339())
        .build()
        .unwrap();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut registry = Registry::new();
    let seen = runs.clone();
    registry
        .register(&job, move |_ctx: JobContext, tick: String| {
            seen.lock().unwrap().push(tick);
            async { Ok(()) }
        })
        .unwrap();
    let consumer = h.start(registry, 4);

    let claims = MemoryClaims::default();
    let stuck = Scheduler::builder(
        h.producer.clone(),
        Arc::new(StopBeforeRecord::new(
            claims.clone(),
            &schedule,
            Tick::at(std::time::SystemTime::now()),
        )),
    )
    .schedule(schedule.clone())
    .poll(MS(100))
    .build()
    .unwrap()
    .spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while runs.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no tick ran in 10 s"
        );
        tokio::time::sleep(MS(20)).await;
    }
    stuck.abort();
    let healthy = Scheduler::builder(Producer::new(h.driver.clone()), Arc::new(claims))
        .schedule(schedule)
        .poll(MS(100))
        .build()
        .unwrap()
        .spawn();
    // Past the tick lease, and a poll.
    tokio::time::sleep(MS(2500)).await;
    healthy.shutdown().await;
    tokio::time::sleep(MS(500)).await;
    consumer.shutdown().await.unwrap();

    let mut per_tick: BTreeMap<i64, usize> = BTreeMap::new();
    for tick in runs.lock().unwrap().iter() {
        *per_tick
            .entry(Tick::parse(tick).expect("a tick").unix_seconds())
            .or_default() += 1;
    }
    assert!(per_tick.len() > 2, "ticks fired: {per_tick:?}");
    let twice: Vec<_> = per_tick.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "ticks not run once: {twice:?} of {per_tick:?}"
    );
    let (first, last) = (
        *per_tick.keys().next().unwrap(),
        *per_tick.keys().last().unwrap(),
    );
    assert_eq!(per_tick.len() as i64, last - first + 1, "{per_tick:?}");
}
