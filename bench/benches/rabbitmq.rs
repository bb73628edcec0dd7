//! The RabbitMQ driver against lapin and against apalis-amqp, on the local
//! broker (`RABBITMQ_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! in interleaved rounds on the harness runtime's workers.
//!
//! Consumption, 20,000 no-op jobs per round (2,000 under `BENCH_QUICK=1`),
//! at-least-once (each message acked only after its handler), prefetch 64.
//! Every queue is a durable quorum queue filled with persistent messages
//! before the clock starts; each side's clock covers opening its channel (or
//! starting its worker), consuming everything and acking it, and stopping.
//!
//! - facade: a `Consumer` with concurrency 64 (prefetch 64) running a no-op
//!   handler, until every job is settled, then `shutdown`;
//! - lapin, ack awaited per message: one loop that decodes each envelope
//!   (one typed pass) and awaits its `basic.ack`;
//! - lapin, one `multiple` ack per run of 32: the same loop, awaiting one
//!   `basic.ack multiple=true` every 32 messages (and one for the rest);
//! - apalis-amqp 1.0 (apalis 1.0, lapin 4): a worker with prefetch 64 (at
//!   most 64 jobs in flight: the bench builds apalis without its `limit`
//!   layer, so the prefetch is the concurrency) running a no-op handler on
//!   the same jobs' payloads, until it stopped itself after the last one.
//!   apalis-amqp 1.0.0 panics unless its backend pushed a message first: one
//!   is pushed through it before the clock starts (and consumed with the
//!   rest).
//!
//! Dispatch, 5,000 persistent messages per round (500 quick), each
//! confirmed by the broker, to one quorum queue (purged between sides):
//!
//! - facade `Dispatch::send_batch` against lapin publishing the same kind
//!   of envelope (each encoded from its typed payload inside the clock, as
//!   the facade encodes its own, with its message id and persistent, as the
//!   facade publishes) one after another and then awaiting every confirm;
//! - facade `Producer::dispatch` from 32 tasks against lapin from 32 tasks,
//!   each publishing and awaiting its confirm on one shared channel.
//!
//! Run: `cargo bench -p jobrail-bench --features rabbitmq --bench rabbitmq`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::{TaskSink, WorkerBuilder, WorkerContext};
use apalis_amqp::AmqpBackend;
use futures_util::StreamExt;
use jobrail::{Job, Registry};
use jobrail_bench::work::{encode_by_hand, handler, job, payloads, TypedEnvelope, Work};
use jobrail_bench::{
    on_worker, reset_results, runtime, selected, size, time_on_worker, Comparison,
};
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Consumer, Driver, Producer};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const BENCH: &str = "rabbitmq";
const PREFETCH: u16 = 64;
const RUN: u64 = 32;
const TASKS: u64 = 32;

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn driver() -> RabbitDriver {
    let mut config = RabbitConfig::new(url()).failure_queue(None);
    config.connection_name = "bench-facade".into();
    RabbitDriver::connect(config).await.unwrap()
}

async fn lapin_connection() -> Connection {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    Connection::connect(&url(), properties).await.unwrap()
}

/// Fills `queue` (declared by the driver: a durable quorum queue) with `n`
/// jobs, outside any timing.
fn fill(rt: &tokio::runtime::Runtime, driver: &RabbitDriver, queue: &str, n: u64) {
    let (driver, job) = (driver.clone(), job(queue));
    on_worker(rt, async move {
        let producer = Producer::new(Arc::new(driver));
        let payloads = payloads(n);
        for chunk in payloads.chunks(5_000) {
            for result in producer.dispatch(&job).send_batch(chunk).await {
                result.unwrap();
            }
        }
    });
}

/// One facade consumption round of `n` jobs from `queue` (filled first).
fn facade_consume(
    rt: &tokio::runtime::Runtime,
    driver: &RabbitDriver,
    queue: &str,
    n: u64,
) -> Duration {
    fill(rt, driver, queue, n);
    let mut registry = Registry::new();
    registry.register(&job(queue), handler).unwrap();
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(usize::from(PREFETCH))
        .build();
    let stats = consumer.registry().stats().clone();
    let took = time_on_worker(rt, async move {
        let handle = consumer.spawn();
        while stats.job("work").first_attempt < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.shutdown().await.unwrap();
    });
    took
}

/// One lapin consumption round: a channel with prefetch 64, a loop that
/// decodes each envelope and acks every `run` messages (`multiple` when
/// `run > 1`), then the channel closed.
fn lapin_consume(
    rt: &tokio::runtime::Runtime,
    driver: &RabbitDriver,
    connection: &Arc<Connection>,
    queue: &str,
    n: u64,
    run: u64,
) -> Duration {
    fill(rt, driver, queue, n);
    let (connection, queue) = (connection.clone(), queue.to_string());
    time_on_worker(rt, async move {
        let channel = connection.create_channel().await.unwrap();
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = channel
            .basic_consume(
                &queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut unacked = 0;
        for i in 0..n {
            let delivery = consumer.next().await.unwrap().unwrap();
            let envelope: TypedEnvelope = serde_json::from_slice(&delivery.data).unwrap();
            std::hint::black_box(&envelope);
            unacked += 1;
            if unacked == run || i + 1 == n {
                channel
                    .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: run > 1 })
                    .await
                    .unwrap();
                unacked = 0;
            }
        }
        channel.close(200, "done").await.unwrap();
    })
}

static APALIS_DONE: AtomicU64 = AtomicU64::new(0);
static APALIS_TARGET: AtomicU64 = AtomicU64::new(u64::MAX);

async fn apalis_job(work: Work, worker: WorkerContext) {
    std::hint::black_box(&work);
    if APALIS_DONE.fetch_add(1, Ordering::SeqCst) + 1 == APALIS_TARGET.load(Ordering::SeqCst) {
        worker.stop().unwrap();
    }
}

/// Publishes `n` payloads (apalis's JSON) to `queue` with lapin,
/// persistent, confirmed.
async fn fill_raw(channel: &Channel, queue: &str, n: u64) {
    let mut confirms = Vec::with_capacity(n as usize);
    for work in payloads(n) {
        let body = serde_json::to_vec(&work).unwrap();
        confirms.push(
            channel
                .basic_publish(
                    "",
                    queue,
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
        );
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
}

fn quorum_arguments() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// One apalis round: the queue filled with `n` jobs, one more pushed through
/// the backend, then a worker with prefetch 64 until the last job ran.
fn apalis_consume(
    rt: &tokio::runtime::Runtime,
    publisher: &Channel,
    queue: &str,
    n: u64,
) -> Duration {
    let (publisher, queue) = (publisher.clone(), queue.to_string());
    let backend = on_worker(rt, async move {
        let mut config = apalis_amqp::Config::default()
            .queue(queue.clone())
            .prefetch_count(PREFETCH);
        // `x-queue-type = quorum` in lapin 4's field table (a type this
        // crate cannot name: built from its serde form).
        config.declare_arguments = serde_json::from_value(serde_json::json!({
            "x-queue-type": {"LongString": "quorum".bytes().collect::<Vec<u8>>()}
        }))
        .unwrap();
        // The same kind of queue as the other sides: durable quorum.
        publisher
            .queue_declare(
                &queue,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                quorum_arguments(),
            )
            .await
            .unwrap();
        let mut backend = AmqpBackend::<Work>::new_from_addr(url())
            .unwrap()
            .with_config(config);
        // Warms its connection pool; it also avoids apalis-amqp 1.0.0's
        // panic on a backend that never pushed.
        backend
            .push(Work {
                id: u64::MAX,
                name: "first".into(),
            })
            .await
            .unwrap();
        fill_raw(&publisher, &queue, n).await;
        backend
    });
    APALIS_DONE.store(0, Ordering::SeqCst);
    APALIS_TARGET.store(n + 1, Ordering::SeqCst);
    let took = time_on_worker(rt, async move {
        WorkerBuilder::new("bench-apalis")
            .backend(backend)
            .build(apalis_job)
            .run()
            .await
            .unwrap();
    });
    assert_eq!(APALIS_DONE.load(Ordering::SeqCst), n + 1);
    took
}

fn purge(rt: &tokio::runtime::Runtime, channel: &Channel, queue: &str) {
    let (channel, queue) = (channel.clone(), queue.to_string());
    on_worker(rt, async move {
        channel
            .queue_purge(&queue, QueuePurgeOptions::default())
            .await
            .unwrap();
    });
}

/// lapin: every message encoded and published (persistent, with its
/// message id, as the facade publishes), then every confirm awaited.
async fn lapin_publish_all(channel: Channel, queue: String, payloads: Arc<Vec<Work>>) {
    let mut confirms = Vec::with_capacity(payloads.len());
    for work in payloads.iter() {
        let (id, body) = encode_by_hand(work);
        confirms.push(
            channel
                .basic_publish(
                    "",
                    &queue,
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default()
                        .with_message_id(id.into())
                        .with_delivery_mode(2),
                )
                .await
                .unwrap(),
        );
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack());
    }
}

/// lapin from `TASKS` tasks: each publishes its share one at a time,
/// awaiting each confirm.
async fn lapin_publish_from_tasks(channel: Channel, queue: String, payloads: Arc<Vec<Work>>) {
    let mut tasks = vec![];
    for t in 0..TASKS as usize {
        let (channel, queue, payloads) = (channel.clone(), queue.clone(), payloads.clone());
        tasks.push(tokio::spawn(async move {
            for work in payloads.iter().skip(t).step_by(TASKS as usize) {
                let (id, body) = encode_by_hand(work);
                let confirm = channel
                    .basic_publish(
                        "",
                        &queue,
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default()
                            .with_message_id(id.into())
                            .with_delivery_mode(2),
                    )
                    .await
                    .unwrap();
                assert!(confirm.await.unwrap().is_ack());
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

async fn facade_dispatch_from_tasks(producer: Producer, job: Job<Work>, payloads: Arc<Vec<Work>>) {
    let mut tasks = vec![];
    for t in 0..TASKS as usize {
        let (producer, job, payloads) = (producer.clone(), job.clone(), payloads.clone());
        tasks.push(tokio::spawn(async move {
            for work in payloads.iter().skip(t).step_by(TASKS as usize) {
                producer.dispatch(&job).send(work).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let driver = on_worker(&rt, driver());
    let connection = Arc::new(on_worker(&rt, lapin_connection()));
    let publisher = {
        let connection = connection.clone();
        on_worker(&rt, async move {
            let channel = connection.create_channel().await.unwrap();
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            channel
        })
    };
    let suffix = jobrail_bench::unique("bench");
    let facade_queue = format!("{suffix}-facade");
    let lapin_queue = format!("{suffix}-lapin");
    let apalis_queue = format!("{suffix}-apalis");
    let dispatch_queue = format!("{suffix}-dispatch");
    let mut declared = vec![];

    let n = size(20_000);
    let work = format!("consume {n} no-op jobs, concurrency 64, prefetch 64");
    let name = |baseline: &str| format!("{work} vs {baseline}");

    let baseline = "lapin loop, ack awaited per message";
    if selected(&name(baseline)) {
        Comparison::new(BENCH, &work, baseline, n)
            .run(
                |_| lapin_consume(&rt, &driver, &connection, &lapin_queue, n, 1),
                |_| facade_consume(&rt, &driver, &facade_queue, n),
            )
            .report();
    }
    let baseline = "lapin loop, one `multiple` ack per run of 32";
    if selected(&name(baseline)) {
        Comparison::new(BENCH, &work, baseline, n)
            .target(1.05)
            .run(
                |_| lapin_consume(&rt, &driver, &connection, &lapin_queue, n, RUN),
                |_| facade_consume(&rt, &driver, &facade_queue, n),
            )
            .report();
    }
    let baseline = "apalis-amqp 1.0, prefetch (concurrency) 64";
    if selected(&name(baseline)) {
        Comparison::new(BENCH, &work, baseline, n)
            .target(0.9)
            .run(
                |_| apalis_consume(&rt, &publisher, &apalis_queue, n),
                |_| facade_consume(&rt, &driver, &facade_queue, n),
            )
            .report();
        declared.push(apalis_queue.clone());
    }

    let n = size(5_000);
    let payloads = Arc::new(payloads(n));
    let job = job(&dispatch_queue);
    let producer = Producer::new(Arc::new(driver.clone()));
    // Declared by the driver (quorum, durable) before either side publishes.
    {
        let driver = driver.clone();
        let queue = dispatch_queue.clone();
        on_worker(&rt, async move {
            driver.subscribe(&queue, 1).await.unwrap().close().await;
        });
    }
    let work = format!("dispatch {n} persistent confirmed messages");
    let baseline = "lapin, publish all then await every confirm";
    if selected(&format!("{work} batch vs {baseline}")) {
        Comparison::new(BENCH, &format!("{work}, `dispatch_batch`"), baseline, n)
            .target(1.1)
            .run(
                |_| {
                    let (channel, queue, payloads) =
                        (publisher.clone(), dispatch_queue.clone(), payloads.clone());
                    let took = time_on_worker(&rt, lapin_publish_all(channel, queue, payloads));
                    purge(&rt, &publisher, &dispatch_queue);
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
                    purge(&rt, &publisher, &dispatch_queue);
                    took
                },
            )
            .report();
    }
    let baseline = "lapin from 32 tasks, each confirm awaited";
    if selected(&format!("{work} from 32 tasks vs {baseline}")) {
        Comparison::new(
            BENCH,
            &format!("{work}, `dispatch` from 32 tasks"),
            baseline,
            n,
        )
        .run(
            |_| {
                let (channel, queue, payloads) =
                    (publisher.clone(), dispatch_queue.clone(), payloads.clone());
                let took = time_on_worker(&rt, lapin_publish_from_tasks(channel, queue, payloads));
                purge(&rt, &publisher, &dispatch_queue);
                took
            },
            |_| {
                let (producer, job, payloads) = (producer.clone(), job.clone(), payloads.clone());
                let took = time_on_worker(&rt, facade_dispatch_from_tasks(producer, job, payloads));
                purge(&rt, &publisher, &dispatch_queue);
                took
            },
        )
        .report();
    }

    // Clean up: the driver's queues, apalis's, then both connections.
    on_worker(&rt, async move {
        let mut queues = driver.declared_queues();
        queues.extend(declared);
        let _ = driver.delete_queues(&queues).await;
        driver.stop().await.unwrap();
        let _ = connection.close(200, "done").await;
    });
}
