//! The NATS JetStream driver against async-nats, on the local server
//! (`NATS_URL`, default `nats://127.0.0.1:4222`), in interleaved rounds on
//! the harness runtime's workers.
//!
//! Consumption, 20,000 no-op jobs per round (2,000 under `BENCH_QUICK=1`),
//! at-least-once (each message acked only after its handler), 64 in flight.
//! Each side has its own work stream (work-queue retention, file storage)
//! and durable pull consumer, both declared by the driver, and filled with
//! the same envelopes before the clock starts; each side's clock covers
//! consuming everything and acknowledging it, and stopping.
//!
//! - facade: a `Consumer` with concurrency 64 (prefetch 64) running a no-op
//!   handler, until every job is settled, then `shutdown`;
//! - async-nats, double acks: a pull loop on the core client (one inbox,
//!   pull requests of 64 sent whenever 32 or fewer are still asked for, as
//!   `messages()` does; see `raw_consume` for why not `messages()` itself),
//!   each envelope decoded (one typed pass), its `+ACK` sent as a request
//!   the server answers (on the client's shared request inbox, the
//!   cheapest double ack async-nats offers), at most 64 unanswered at once;
//! - async-nats, plain acks: the same loop, each `+ACK` a plain publish;
//! - the driver alone (a subscription, each delivery acked from its own
//!   future, 64 at once, no `Consumer`) against the double-ack loop: the
//!   driver's share of the facade's time.
//!
//! Dispatch, 5,000 messages per round (500 quick), each confirmed by a
//! `PubAck`, to one work stream (purged between rounds):
//!
//! - facade `Dispatch::send_batch` against async-nats publishing the
//!   same kind of envelope bytes (each encoded from its typed payload
//!   inside the clock, as the facade encodes its own, with its
//!   `Nats-Msg-Id`) one after another, then awaiting every `PubAck`;
//! - facade `Producer::dispatch` from 32 tasks against async-nats from 32
//!   tasks, each publishing and awaiting its `PubAck`.
//!
//! Run: `cargo bench -p jobrail-bench --features nats --bench nats`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use jobrail::{Envelope, Job, JobContext, JobError, Registry};
use jobrail_bench::work::{encode_by_hand, job, payloads, TypedEnvelope, Work};
use jobrail_bench::{
    on_worker, reset_results, runtime, selected, size, time_on_worker, Comparison,
};
use jobrail_native::nats::{NatsConfig, NatsDriver};
use jobrail_native::{Consumer, Driver, Outgoing, Producer};

const BENCH: &str = "nats";
const IN_FLIGHT: usize = 64;
const TASKS: usize = 32;

/// Jobs the facade's handler ran in this round.
static HANDLED: AtomicU64 = AtomicU64::new(0);

async fn handler(_: JobContext, work: Work) -> Result<(), JobError> {
    std::hint::black_box(&work);
    HANDLED.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn config() -> NatsConfig {
    let mut config = NatsConfig::new(url());
    config.stream_prefix = "BENCH".into();
    config.subject_prefix = "bench".into();
    config.failure_subject = None;
    config.connection_name = "bench-facade".into();
    config
}

async fn driver() -> NatsDriver {
    NatsDriver::connect(config()).await.unwrap()
}

async fn raw_client() -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .name("bench-async-nats")
        .connect(url())
        .await
        .unwrap();
    jetstream::ContextBuilder::new()
        .max_ack_inflight(20_000)
        .build(client)
}

/// `n` envelopes of fresh ids, as the facade would publish them.
fn outgoing(n: u64) -> Vec<Outgoing> {
    payloads(n)
        .into_iter()
        .map(|work| {
            let envelope = Envelope::new("work", serde_json::to_value(work).unwrap());
            Outgoing {
                id: envelope.id.clone(),
                body: envelope.encode(),
                delay: None,
            }
        })
        .collect()
}

/// Fills `queue` (declared by the driver) with `n` jobs, outside any timing.
fn fill(rt: &tokio::runtime::Runtime, driver: &NatsDriver, queue: &str, n: u64) {
    let (driver, queue) = (driver.clone(), queue.to_string());
    on_worker(rt, async move {
        let messages = outgoing(n);
        for chunk in messages.chunks(5_000) {
            for result in driver.send_batch(&queue, chunk.to_vec()).await {
                result.unwrap();
            }
        }
        assert_eq!(driver.stored_count(&queue).await.unwrap(), n);
    });
}

/// One facade consumption round of `n` jobs from `queue` (filled first).
fn facade_consume(
    rt: &tokio::runtime::Runtime,
    driver: &NatsDriver,
    queue: &str,
    n: u64,
) -> Duration {
    fill(rt, driver, queue, n);
    let mut registry = Registry::new();
    registry.register(&job(queue), handler).unwrap();
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(IN_FLIGHT)
        .build();
    HANDLED.store(0, Ordering::SeqCst);
    let took = time_on_worker(rt, async move {
        let handle = consumer.spawn();
        while HANDLED.load(Ordering::Relaxed) < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.shutdown().await.unwrap();
    });
    let (driver, queue) = (driver.clone(), queue.to_string());
    let left = on_worker(
        rt,
        async move { driver.stored_count(&queue).await.unwrap() },
    );
    assert_eq!(left, 0, "the facade left messages behind");
    took
}

/// One round of the driver alone (no `Consumer`, no pipeline): a
/// subscription with prefetch 64, each delivery's envelope decoded (one
/// typed pass) and acked from its own task, at most 64 at once. What the
/// facade adds over this is the consumer's and the rules' share.
fn driver_consume(
    rt: &tokio::runtime::Runtime,
    driver: &NatsDriver,
    queue: &str,
    n: u64,
) -> Duration {
    fill(rt, driver, queue, n);
    let (driver, queue) = (driver.clone(), queue.to_string());
    time_on_worker(rt, async move {
        let mut subscription = driver.subscribe(&queue, IN_FLIGHT).await.unwrap();
        let mut settling = FuturesUnordered::new();
        let mut received = 0;
        while received < n {
            if settling.len() >= IN_FLIGHT {
                let settled: Result<(), jobrail_native::DriverError> =
                    settling.next().await.unwrap();
                settled.unwrap();
                continue;
            }
            tokio::select! {
                Some(settled) = settling.next(), if !settling.is_empty() => { settled.unwrap(); }
                delivery = subscription.next() => {
                    let delivery = delivery.unwrap().unwrap();
                    let envelope: TypedEnvelope = serde_json::from_slice(delivery.body()).unwrap();
                    std::hint::black_box(&envelope);
                    received += 1;
                    settling.push(async move { delivery.settle(&jobrail::Settlement::Ack).await });
                }
            }
        }
        while let Some(settled) = settling.next().await {
            settled.unwrap();
        }
        subscription.close().await;
    })
}

/// One async-nats consumption round, by hand on the core client: one inbox
/// subscription, pull requests of 64 sent whenever 32 or fewer are still
/// asked for (the batch and threshold of async-nats' `messages()`, whose
/// own count of pending messages can miss a batch when messages arrive
/// before it has counted the request, stalling until the request expires:
/// 30 s in some rounds here), each envelope decoded (one typed pass), its
/// ack double (a request the server answers, on the client's shared
/// request inbox, at most 64 unanswered at once) or plain.
fn raw_consume(
    rt: &tokio::runtime::Runtime,
    driver: &NatsDriver,
    js: &jetstream::Context,
    queue: &str,
    n: u64,
    double: bool,
) -> Duration {
    fill(rt, driver, queue, n);
    let client = js.client();
    let next = format!(
        "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
        driver.stream_name(queue),
        driver.config().consumer_name
    );
    let took = time_on_worker(rt, async move {
        let inbox = client.new_inbox();
        let mut replies = client.subscribe(inbox.clone()).await.unwrap();
        let request = format!(r#"{{"batch":{IN_FLIGHT},"expires":5000000000}}"#);
        let mut acks = FuturesUnordered::new();
        let (mut received, mut requested) = (0, 0);
        while received < n {
            if requested <= IN_FLIGHT / 2 {
                client
                    .publish_with_reply(next.clone(), inbox.clone(), request.clone().into())
                    .await
                    .unwrap();
                requested += IN_FLIGHT;
            }
            if acks.len() >= IN_FLIGHT {
                let answer: Result<async_nats::Message, async_nats::RequestError> =
                    acks.next().await.unwrap();
                answer.unwrap();
                continue;
            }
            tokio::select! {
                Some(answer) = acks.next(), if !acks.is_empty() => { answer.unwrap(); }
                message = replies.next() => {
                    let message = message.unwrap();
                    if message.status.is_some_and(|s| s != async_nats::StatusCode::OK) {
                        let pending = message
                            .headers
                            .as_ref()
                            .and_then(|h| h.get("Nats-Pending-Messages"))
                            .and_then(|v| v.as_str().parse::<usize>().ok())
                            .unwrap_or(IN_FLIGHT);
                        requested = requested.saturating_sub(pending);
                        continue;
                    }
                    requested = requested.saturating_sub(1);
                    let envelope: TypedEnvelope = serde_json::from_slice(&message.payload).unwrap();
                    std::hint::black_box(&envelope);
                    received += 1;
                    let reply = message.reply.unwrap();
                    if double {
                        let client = client.clone();
                        acks.push(async move { client.request(reply, AckKind::Ack.into()).await });
                    } else {
                        client.publish(reply, AckKind::Ack.into()).await.unwrap();
                    }
                }
            }
        }
        while let Some(answer) = acks.next().await {
            answer.unwrap();
        }
        client.flush().await.unwrap();
    });
    let (driver, queue) = (driver.clone(), queue.to_string());
    let left = on_worker(rt, async move {
        // Plain acks: the server may still be removing the last ones.
        for _ in 0..100 {
            if driver.stored_count(&queue).await.unwrap() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        driver.stored_count(&queue).await.unwrap()
    });
    assert_eq!(left, 0, "async-nats left messages behind");
    took
}

/// async-nats: every message encoded and published, then every `PubAck`
/// awaited.
async fn raw_publish_all(js: jetstream::Context, subject: String, payloads: Arc<Vec<Work>>) {
    let mut acks = Vec::with_capacity(payloads.len());
    for work in payloads.iter() {
        let (id, body) = encode_by_hand(work);
        let publish = PublishMessage::build().payload(body.into()).message_id(&id);
        acks.push(js.send_publish(subject.clone(), publish).await.unwrap());
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// async-nats from `TASKS` tasks: each publishes its share one at a time,
/// awaiting each `PubAck`.
async fn raw_publish_from_tasks(js: jetstream::Context, subject: String, payloads: Arc<Vec<Work>>) {
    let mut tasks = vec![];
    for t in 0..TASKS {
        let (js, subject, payloads) = (js.clone(), subject.clone(), payloads.clone());
        tasks.push(tokio::spawn(async move {
            for work in payloads.iter().skip(t).step_by(TASKS) {
                let (id, body) = encode_by_hand(work);
                let publish = PublishMessage::build().payload(body.into()).message_id(&id);
                js.send_publish(subject.clone(), publish)
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

async fn facade_dispatch_from_tasks(producer: Producer, job: Job<Work>, payloads: Arc<Vec<Work>>) {
    let mut tasks = vec![];
    for t in 0..TASKS {
        let (producer, job, payloads) = (producer.clone(), job.clone(), payloads.clone());
        tasks.push(tokio::spawn(async move {
            for work in payloads.iter().skip(t).step_by(TASKS) {
                producer.dispatch(&job).send(work).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

fn purge(rt: &tokio::runtime::Runtime, js: &jetstream::Context, stream: &str) {
    let (js, stream) = (js.clone(), stream.to_string());
    on_worker(rt, async move {
        js.get_stream(&stream).await.unwrap().purge().await.unwrap();
    });
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let driver = on_worker(&rt, driver());
    let js = on_worker(&rt, raw_client());
    let suffix = jobrail_bench::unique("bench");
    let facade_queue = format!("{suffix}-facade");
    let raw_queue = format!("{suffix}-raw");
    let dispatch_queue = format!("{suffix}-dispatch");

    let n = size(20_000);
    let work = format!("consume {n} no-op jobs, {IN_FLIGHT} in flight");
    let name = |baseline: &str| format!("{work} vs {baseline}");

    // A fresh stream (and consumer) per side and round, deleted after it:
    // no round sees pull requests another left open.
    let fresh = |queue: &str, round: usize, side: &str| format!("{queue}-{side}{round}");
    let drop_stream = |queue: String| {
        let (js, stream) = (js.clone(), driver.stream_name(&queue));
        on_worker(&rt, async move {
            let _ = js.delete_stream(&stream).await;
        });
    };
    let baseline =
        "async-nats pull loop (batches of 64 at half), double acks (requests), 64 in flight";
    if selected(&name(baseline)) {
        Comparison::new(BENCH, &work, baseline, n)
            .target(1.05)
            .run(
                |round| {
                    let queue = fresh(&raw_queue, round, "d");
                    let took = raw_consume(&rt, &driver, &js, &queue, n, true);
                    drop_stream(queue);
                    took
                },
                |round| {
                    let queue = fresh(&facade_queue, round, "d");
                    let took = facade_consume(&rt, &driver, &queue, n);
                    drop_stream(queue);
                    took
                },
            )
            .report();
    }
    let baseline = "async-nats pull loop (batches of 64 at half), plain acks, 64 in flight";
    if selected(&name(baseline)) {
        Comparison::new(BENCH, &work, baseline, n)
            .run(
                |round| {
                    let queue = fresh(&raw_queue, round, "p");
                    let took = raw_consume(&rt, &driver, &js, &queue, n, false);
                    drop_stream(queue);
                    took
                },
                |round| {
                    let queue = fresh(&facade_queue, round, "p");
                    let took = facade_consume(&rt, &driver, &queue, n);
                    drop_stream(queue);
                    took
                },
            )
            .report();
    }
    // Where the facade's time goes: the driver alone (subscription and
    // settlements, no consumer) against the same double-ack loop.
    let work_alone =
        format!("driver alone: subscription + ack settlements, {n} jobs, {IN_FLIGHT} in flight");
    let baseline =
        "async-nats pull loop (batches of 64 at half), double acks (requests), 64 in flight";
    if selected(&format!("{work_alone} vs {baseline}")) {
        Comparison::new(BENCH, &work_alone, baseline, n)
            .run(
                |round| {
                    let queue = fresh(&raw_queue, round, "a");
                    let took = raw_consume(&rt, &driver, &js, &queue, n, true);
                    drop_stream(queue);
                    took
                },
                |round| {
                    let queue = fresh(&facade_queue, round, "a");
                    let took = driver_consume(&rt, &driver, &queue, n);
                    drop_stream(queue);
                    took
                },
            )
            .report();
    }

    let n = size(5_000);
    let payloads = Arc::new(payloads(n));
    let job = job(&dispatch_queue);
    let producer = Producer::new(Arc::new(driver.clone()));
    let subject = driver.subject(&dispatch_queue);
    let stream = driver.stream_name(&dispatch_queue);
    // Declared by the driver before either side publishes.
    {
        let driver = driver.clone();
        let queue = dispatch_queue.clone();
        on_worker(&rt, async move {
            driver.subscribe(&queue, 1).await.unwrap().close().await;
        });
    }
    let work = format!("dispatch {n} messages, each `PubAck`ed");
    let baseline = "async-nats, publish all then await every `PubAck`";
    if selected(&format!("{work} batch vs {baseline}")) {
        Comparison::new(BENCH, &format!("{work}, `dispatch_batch`"), baseline, n)
            .target(1.1)
            .run(
                |_| {
                    let (js2, subject) = (js.clone(), subject.clone());
                    let took = time_on_worker(&rt, raw_publish_all(js2, subject, payloads.clone()));
                    purge(&rt, &js, &stream);
                    took
                },
                |_| {
                    let (producer, job, payloads) =
                        (producer.clone(), job.clone(), payloads.clone());
                    let took = time_on_worker(&rt, async move {
                        for result in producer.dispatch(&job).send_batch(&payloads).await {
                            result.unwrap();
                        }
                    });
                    purge(&rt, &js, &stream);
                    took
                },
            )
            .report();
    }
    let baseline = "async-nats from 32 tasks, each `PubAck` awaited";
    if selected(&format!("{work} from 32 tasks vs {baseline}")) {
        Comparison::new(
            BENCH,
            &format!("{work}, `dispatch` from 32 tasks"),
            baseline,
            n,
        )
        .run(
            |_| {
                let (js2, subject) = (js.clone(), subject.clone());
                let payloads = payloads.clone();
                let took = time_on_worker(&rt, raw_publish_from_tasks(js2, subject, payloads));
                purge(&rt, &js, &stream);
                took
            },
            |_| {
                let (producer, job, payloads) = (producer.clone(), job.clone(), payloads.clone());
                let took = time_on_worker(&rt, facade_dispatch_from_tasks(producer, job, payloads));
                purge(&rt, &js, &stream);
                took
            },
        )
        .report();
    }

    // Clean up: every stream the driver declared, then both connections.
    on_worker(&rt, async move {
        let _ = js.delete_stream(driver.stream_name(&dispatch_queue)).await;
        driver.stop().await.unwrap();
    });
}
