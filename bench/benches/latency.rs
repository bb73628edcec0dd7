//! Latency under steady load: jobs dispatched at a fixed rate (2,000 a
//! second, then 10,000, for 20 s each) and the time from each dispatch to
//! its handler's start and to its acknowledged settlement, p50 / p99 /
//! p99.9, through the facade against the raw client doing the same on the
//! same broker, in the same run. Target (issue 30): the facade's p99 at
//! most 1.2x the raw client's plus 0.5 ms.
//!
//! Every job carries its dispatch time (nanoseconds since the process's
//! epoch, stamped just before its dispatch starts). The dispatcher is an
//! open loop: each millisecond it starts every dispatch that is due, each
//! awaited (confirmed) on a task of its own, as independent clients would
//! dispatch; so a slow confirm never holds back the next job. Both sides
//! run on the harness runtime's workers, one side at a time, in
//! interleaved rounds (the raw side first in even rounds), on a fresh
//! queue (or stream) each.
//!
//! - memory: the `MemoryDriver` under a `Consumer` (concurrency 64)
//!   against a tokio mpsc channel feeding spawned tasks (64 at once), each
//!   decoding its envelope in one typed pass and sending its ack to an ack
//!   task (the settlement);
//! - RabbitMQ: the driver (quorum queue, persistent messages, publisher
//!   confirms) under a `Consumer` (concurrency 64, prefetch 64) against
//!   lapin publishing persistent messages with their ids on a confirming
//!   channel, each confirm awaited, and consuming with prefetch 64, each
//!   delivery handled on its own task and its `basic.ack` awaited;
//! - NATS: the driver under a `Consumer` (64 in flight) against async-nats
//!   publishing with `Nats-Msg-Id`, each `PubAck` awaited, and a pull loop
//!   (batches of 64 asked for at half) whose acks are double (requests the
//!   server answers), at most 64 unanswered;
//! - SQS (the emulator): the driver under a `Consumer` (concurrency 30)
//!   against aws-sdk-sqs `SendMessage` per job and three loops of
//!   `ReceiveMessage` (up to 10, long polling) then one
//!   `DeleteMessageBatch` of the handled ones. The emulator serves one
//!   request at a time, so its rates are 50 and 150 jobs a second;
//! - Postgres: `PgDriver` under a `Consumer` (concurrency 64) against
//!   tokio-postgres: an `INSERT` per job, and a claim loop (`FOR UPDATE
//!   SKIP LOCKED`, up to the free slots of 64) that claims again at once
//!   after a claim that found rows and 1 ms after one that found none,
//!   each claimed row handled on its own task and deleted. (A `pg_notify`
//!   per insert, the textbook wake-up, does not hold 10,000 a second: the
//!   server serializes notifying commits. The driver sends one `NOTIFY`
//!   at a time for a queue, whatever the writes.)
//!
//! A run *held* its rate when the dispatcher kept within 5% of it and
//! every job was settled within 1 s of the last confirm.
//!
//! Environment: `BENCH_ROUNDS` (default 3 here), `BENCH_LATENCY_SECS`
//! (seconds per rate, default 20; 2 under `BENCH_QUICK=1`),
//! `BENCH_BACKENDS` (default `memory,rabbitmq,nats,sqs,postgres`),
//! `BENCH_ONLY` (a word of "<backend> <rate>/s"). A full run, with every
//! backend, draws `bench/plots/latency-<rate>.svg`.
//!
//! Run: `export SQS_ENDPOINT=$(tests/sqs-emulator); cargo bench -p jobrail-bench --all-features --bench latency`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use jobrail::{Event, EventKind, EventSink, Job, JobContext, JobError, Registry};
use jobrail_bench::latency::{
    paced, Latency, Recorder, SideRun, Stamped, StampedEnvelope, LATENCY_KIND,
};
use jobrail_bench::work::encode_by_hand;
use jobrail_bench::{append_result, on_worker, quick, reset_results, runtime, selected, unique};
use jobrail_native::{Consumer, Driver, Producer};
use tokio::sync::Semaphore;

const BENCH: &str = "latency";
const CONCURRENCY: usize = 64;
const GRACE: Duration = Duration::from_secs(1);
/// How long a consumer runs before the first dispatch (its subscription
/// open, as a running worker's is).
const WARM: Duration = Duration::from_millis(300);

fn rounds() -> usize {
    std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(3)
}

fn seconds() -> Duration {
    let default = if quick() { 2 } else { 20 };
    Duration::from_secs(
        std::env::var("BENCH_LATENCY_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &u64| n > 0)
            .unwrap_or(default),
    )
}

fn backends() -> Vec<String> {
    std::env::var("BENCH_BACKENDS")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| "memory,rabbitmq,nats,sqs,postgres".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect()
}

fn job(queue: &str) -> Job<Stamped> {
    Job::<Stamped>::builder("work")
        .queue(queue)
        .build()
        .expect("a valid job")
}

/// The facade's settlements, reported to the recorder by message id.
struct Settled(Arc<Recorder>);

impl EventSink for Settled {
    fn emit(&self, event: &Event) {
        if matches!(event.kind, EventKind::Succeeded { .. }) {
            self.0.settled_id(&event.message_id);
        }
    }
}

/// One facade run on `queue` of `driver`: a `Consumer` (concurrency
/// `concurrency`) whose handler records its start, the event sink its
/// settlement, and the paced dispatcher's `Producer::dispatch` calls.
async fn facade_run(
    driver: Arc<dyn Driver>,
    queue: String,
    concurrency: usize,
    rate: u64,
    duration: Duration,
) -> SideRun {
    let recorder = Recorder::new((rate * duration.as_secs()) as usize);
    let job = job(&queue);
    let mut registry = Registry::new();
    {
        let recorder = recorder.clone();
        registry
            .register(&job, move |ctx: JobContext, work: Stamped| {
                recorder.started_id(ctx.message_id(), work.sent_ns);
                std::future::ready(Ok::<(), JobError>(()))
            })
            .unwrap();
    }
    registry.event_sink(Arc::new(Settled(recorder.clone())));
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(concurrency)
        .build();
    let handle = consumer.spawn();
    tokio::time::sleep(WARM).await;
    let producer = Producer::new(driver);
    let run = paced(rate, duration, GRACE, recorder, move |work| {
        let (producer, job) = (producer.clone(), job.clone());
        async move {
            producer.dispatch(&job).send(&work).await.unwrap();
        }
    })
    .await;
    handle.shutdown().await.unwrap();
    run
}

/// Runs `rounds()` interleaved rounds of both sides at `rate` and reports
/// them (stdout and `latency.jsonl`).
fn compare(
    backend: &str,
    baseline: &str,
    rate: u64,
    mut raw: impl FnMut(usize) -> SideRun,
    mut facade: impl FnMut(usize) -> SideRun,
) -> Option<Latency> {
    if !selected(&format!("{backend} {rate}/s")) {
        return None;
    }
    let mut result = Latency {
        kind: LATENCY_KIND.into(),
        backend: backend.into(),
        baseline: baseline.into(),
        rate,
        seconds: seconds().as_secs(),
        raw: vec![],
        facade: vec![],
    };
    for round in 0..rounds() {
        if round % 2 == 0 {
            result.raw.push(raw(round));
            result.facade.push(facade(round));
        } else {
            result.facade.push(facade(round));
            result.raw.push(raw(round));
        }
        let (r, f) = (result.raw.last().unwrap(), result.facade.last().unwrap());
        eprintln!(
            "latency: {backend} {rate}/s round {round}: settled p99 raw {:.2} ms ({}), facade {:.2} ms ({})",
            r.settled.p99,
            if r.held { "held" } else { "NOT held" },
            f.settled.p99,
            if f.held { "held" } else { "NOT held" },
        );
    }
    println!("{}\n{}", Latency::header(), result.rows());
    append_result(BENCH, &result);
    Some(result)
}

mod memory {
    use super::*;
    use jobrail_native::MemoryDriver;

    pub(crate) async fn raw(rate: u64, duration: Duration) -> SideRun {
        let recorder = Recorder::new((rate * duration.as_secs()) as usize);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let (acks, mut acked) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let settler = {
            let recorder = recorder.clone();
            tokio::spawn(async move {
                while let Some(sent_ns) = acked.recv().await {
                    recorder.settled(sent_ns);
                }
            })
        };
        let consumer = {
            let recorder = recorder.clone();
            tokio::spawn(async move {
                let permits = Arc::new(Semaphore::new(CONCURRENCY));
                while let Some(body) = rx.recv().await {
                    let permit = permits.clone().acquire_owned().await.unwrap();
                    let (acks, recorder) = (acks.clone(), recorder.clone());
                    tokio::spawn(async move {
                        let envelope: StampedEnvelope = serde_json::from_slice(&body).unwrap();
                        recorder.started(envelope.payload.sent_ns);
                        std::hint::black_box((&envelope.id, &envelope.job));
                        acks.send(envelope.payload.sent_ns).unwrap();
                        drop(permit);
                    });
                }
            })
        };
        tokio::time::sleep(WARM).await;
        let run = paced(rate, duration, GRACE, recorder, move |work| {
            let tx = tx.clone();
            async move {
                let (_, body) = encode_by_hand(&work);
                tx.send(body).unwrap();
            }
        })
        .await;
        consumer.await.unwrap();
        settler.await.unwrap();
        run
    }

    pub(crate) fn run(rt: &tokio::runtime::Runtime, rates: &[u64], out: &mut Vec<Latency>) {
        let duration = seconds();
        for &rate in rates {
            out.extend(compare(
                "memory",
                "tokio mpsc + spawned tasks (64 at once) + ack task",
                rate,
                |_| on_worker(rt, raw(rate, duration)),
                |_| {
                    let driver: Arc<dyn Driver> = Arc::new(MemoryDriver::default());
                    on_worker(
                        rt,
                        facade_run(driver, "bench".into(), CONCURRENCY, rate, duration),
                    )
                },
            ));
        }
    }
}

mod rabbitmq {
    use super::*;
    use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    fn url() -> String {
        std::env::var("RABBITMQ_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
    }

    /// One raw run on `queue` (declared by the driver: quorum, durable).
    async fn raw(
        connection: Arc<Connection>,
        publisher: Channel,
        queue: String,
        rate: u64,
        duration: Duration,
    ) -> SideRun {
        let recorder = Recorder::new((rate * duration.as_secs()) as usize);
        let channel = connection.create_channel().await.unwrap();
        channel
            .basic_qos(CONCURRENCY as u16, BasicQosOptions::default())
            .await
            .unwrap();
        let mut deliveries = channel
            .basic_consume(
                &queue,
                "bench-latency",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let consumer = {
            let recorder = recorder.clone();
            tokio::spawn(async move {
                while let Some(delivery) = deliveries.next().await {
                    let Ok(delivery) = delivery else { break };
                    let recorder = recorder.clone();
                    tokio::spawn(async move {
                        let envelope: StampedEnvelope =
                            serde_json::from_slice(&delivery.data).unwrap();
                        recorder.started(envelope.payload.sent_ns);
                        std::hint::black_box((&envelope.id, &envelope.job));
                        delivery.ack(BasicAckOptions::default()).await.unwrap();
                        recorder.settled(envelope.payload.sent_ns);
                    });
                }
            })
        };
        tokio::time::sleep(WARM).await;
        let run = paced(rate, duration, GRACE, recorder, move |work| {
            let (publisher, queue) = (publisher.clone(), queue.clone());
            async move {
                let (id, body) = encode_by_hand(&work);
                publisher
                    .basic_publish(
                        "",
                        &queue,
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_message_id(id.into()),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        })
        .await;
        let _ = channel.close(200, "done").await;
        let _ = consumer.await;
        run
    }

    pub(crate) fn run(rt: &tokio::runtime::Runtime, rates: &[u64], out: &mut Vec<Latency>) {
        let duration = seconds();
        let driver = on_worker(rt, async {
            let mut config = RabbitConfig::new(url()).failure_queue(None);
            config.connection_name = "bench-facade".into();
            RabbitDriver::connect(config).await.unwrap()
        });
        let connection = Arc::new(on_worker(rt, async {
            let properties = ConnectionProperties::default()
                .with_executor(tokio_executor_trait::Tokio::current())
                .with_reactor(tokio_reactor_trait::Tokio);
            Connection::connect(&url(), properties).await.unwrap()
        }));
        let publisher = {
            let connection = connection.clone();
            on_worker(rt, async move {
                let channel = connection.create_channel().await.unwrap();
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                channel
            })
        };
        let suffix = unique("bench-latency");
        // A fresh queue per side and round, declared by the driver.
        let fresh = |side: &str, rate: u64, round: usize| {
            let queue = format!("{suffix}-{side}-{rate}-{round}");
            let (driver, name) = (driver.clone(), queue.clone());
            on_worker(rt, async move {
                driver.subscribe(&name, 1).await.unwrap().close().await;
            });
            queue
        };
        for &rate in rates {
            out.extend(compare(
                "RabbitMQ",
                "lapin: confirmed persistent publishes; prefetch 64, a task per delivery, each ack awaited",
                rate,
                |round| {
                    let queue = fresh("raw", rate, round);
                    on_worker(
                        rt,
                        raw(connection.clone(), publisher.clone(), queue, rate, duration),
                    )
                },
                |round| {
                    let queue = fresh("facade", rate, round);
                    let driver: Arc<dyn Driver> = Arc::new(driver.clone());
                    on_worker(rt, facade_run(driver, queue, CONCURRENCY, rate, duration))
                },
            ));
        }
        on_worker(rt, async move {
            let _ = driver.delete_queues(&driver.declared_queues()).await;
            driver.stop().await.unwrap();
            let _ = connection.close(200, "done").await;
        });
    }
}

mod nats {
    use super::*;
    use async_nats::jetstream::message::PublishMessage;
    use async_nats::jetstream::{self, AckKind};
    use jobrail_native::nats::{NatsConfig, NatsDriver};

    fn url() -> String {
        std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
    }

    /// One raw run on `queue`'s stream and durable consumer (declared by
    /// the driver).
    async fn raw(
        js: jetstream::Context,
        subject: String,
        next: String,
        rate: u64,
        duration: Duration,
    ) -> SideRun {
        let recorder = Recorder::new((rate * duration.as_secs()) as usize);
        let client = js.client();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::new(tokio::sync::Notify::new());
        let consumer = {
            let (recorder, stop, stopped) = (recorder.clone(), stop.clone(), stopped.clone());
            tokio::spawn(async move {
                let inbox = client.new_inbox();
                let mut replies = client.subscribe(inbox.clone()).await.unwrap();
                let request = format!(r#"{{"batch":{CONCURRENCY},"expires":5000000000}}"#);
                let mut acks = FuturesUnordered::new();
                let mut requested = 0;
                while !stop.load(Ordering::Acquire) {
                    if requested <= CONCURRENCY / 2 {
                        client
                            .publish_with_reply(next.clone(), inbox.clone(), request.clone().into())
                            .await
                            .unwrap();
                        requested += CONCURRENCY;
                    }
                    if acks.len() >= CONCURRENCY {
                        let sent_ns: u64 = acks.next().await.unwrap();
                        recorder.settled(sent_ns);
                        continue;
                    }
                    tokio::select! {
                        Some(sent_ns) = acks.next(), if !acks.is_empty() => recorder.settled(sent_ns),
                        _ = stopped.notified() => break,
                        message = replies.next() => {
                            let message = message.unwrap();
                            if message.status.is_some_and(|s| s != async_nats::StatusCode::OK) {
                                let pending = message
                                    .headers
                                    .as_ref()
                                    .and_then(|h| h.get("Nats-Pending-Messages"))
                                    .and_then(|v| v.as_str().parse::<usize>().ok())
                                    .unwrap_or(CONCURRENCY);
                                requested = requested.saturating_sub(pending);
                                continue;
                            }
                            requested = requested.saturating_sub(1);
                            let envelope: StampedEnvelope =
                                serde_json::from_slice(&message.payload).unwrap();
                            let sent_ns = envelope.payload.sent_ns;
                            recorder.started(sent_ns);
                            std::hint::black_box((&envelope.id, &envelope.job));
                            let (client, reply) = (client.clone(), message.reply.unwrap());
                            acks.push(async move {
                                client.request(reply, AckKind::Ack.into()).await.unwrap();
                                sent_ns
                            });
                        }
                    }
                }
                while let Some(sent_ns) = acks.next().await {
                    recorder.settled(sent_ns);
                }
            })
        };
        tokio::time::sleep(WARM).await;
        let run = paced(rate, duration, GRACE, recorder, move |work| {
            let (js, subject) = (js.clone(), subject.clone());
            async move {
                let (id, body) = encode_by_hand(&work);
                let publish = PublishMessage::build().payload(body.into()).message_id(&id);
                js.send_publish(subject, publish)
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        })
        .await;
        stop.store(true, Ordering::Release);
        stopped.notify_one();
        consumer.await.unwrap();
        run
    }

    pub(crate) fn run(rt: &tokio::runtime::Runtime, rates: &[u64], out: &mut Vec<Latency>) {
        let duration = seconds();
        let driver = on_worker(rt, async {
            let mut config = NatsConfig::new(url());
            config.stream_prefix = "BENCHLAT".into();
            config.subject_prefix = "benchlat".into();
            config.failure_subject = None;
            config.connection_name = "bench-facade".into();
            NatsDriver::connect(config).await.unwrap()
        });
        let js = on_worker(rt, async {
            let client = async_nats::ConnectOptions::new()
                .name("bench-async-nats")
                .connect(url())
                .await
                .unwrap();
            jetstream::ContextBuilder::new()
                .max_ack_inflight(20_000)
                .build(client)
        });
        let suffix = unique("lat");
        let fresh = |side: &str, rate: u64, round: usize| {
            let queue = format!("{suffix}-{side}-{rate}-{round}");
            let (driver, name) = (driver.clone(), queue.clone());
            on_worker(rt, async move {
                driver.subscribe(&name, 1).await.unwrap().close().await;
            });
            queue
        };
        let drop_stream = |queue: &str| {
            let (js, stream) = (js.clone(), driver.stream_name(queue));
            on_worker(rt, async move {
                let _ = js.delete_stream(&stream).await;
            });
        };
        for &rate in rates {
            out.extend(compare(
                "NATS",
                "async-nats: publishes with ids, each PubAck awaited; pull loop, 64 in flight, double acks",
                rate,
                |round| {
                    let queue = fresh("raw", rate, round);
                    let next = format!(
                        "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
                        driver.stream_name(&queue),
                        driver.config().consumer_name
                    );
                    let subject = driver.subject(&queue);
                    let run = on_worker(rt, raw(js.clone(), subject, next, rate, duration));
                    drop_stream(&queue);
                    run
                },
                |round| {
                    let queue = fresh("facade", rate, round);
                    let d: Arc<dyn Driver> = Arc::new(driver.clone());
                    let run = on_worker(rt, facade_run(d, queue.clone(), CONCURRENCY, rate, duration));
                    drop_stream(&queue);
                    run
                },
            ));
        }
        on_worker(rt, async move {
            driver.stop().await.unwrap();
        });
    }
}

mod sqs {
    use super::*;
    use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
    use aws_sdk_sqs::Client;
    use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};

    const FACADE_CONCURRENCY: usize = 30;
    const LOOPS: usize = 3;
    const WAIT: Duration = Duration::from_secs(1);

    fn endpoint() -> String {
        std::env::var("SQS_ENDPOINT")
            .expect("SQS_ENDPOINT is not set: export SQS_ENDPOINT=$(tests/sqs-emulator)")
    }

    fn client() -> Client {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
            .region(aws_sdk_sqs::config::Region::new("us-east-1"))
            .credentials_provider(aws_credential_types::Credentials::new(
                "test", "test", None, None, "bench",
            ))
            .http_client(http)
            .endpoint_url(endpoint())
            .build();
        Client::from_conf(config)
    }

    async fn receive_loop(
        client: Client,
        url: String,
        recorder: Arc<Recorder>,
        stop: Arc<AtomicBool>,
    ) {
        while !stop.load(Ordering::Acquire) {
            let answer = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .wait_time_seconds(WAIT.as_secs() as i32)
                .send()
                .await
                .expect("ReceiveMessage");
            let mut entries = Vec::new();
            let mut stamps = Vec::new();
            for (i, message) in answer.messages().iter().enumerate() {
                let envelope: StampedEnvelope =
                    serde_json::from_str(message.body().unwrap_or_default()).unwrap();
                recorder.started(envelope.payload.sent_ns);
                std::hint::black_box((&envelope.id, &envelope.job));
                stamps.push(envelope.payload.sent_ns);
                entries.push(
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(message.receipt_handle().unwrap())
                        .build()
                        .unwrap(),
                );
            }
            if entries.is_empty() {
                continue;
            }
            let answer = client
                .delete_message_batch()
                .queue_url(&url)
                .set_entries(Some(entries))
                .send()
                .await
                .expect("DeleteMessageBatch");
            assert!(answer.failed().is_empty(), "every entry deleted");
            for sent_ns in stamps {
                recorder.settled(sent_ns);
            }
        }
    }

    async fn raw(client: Client, url: String, rate: u64, duration: Duration) -> SideRun {
        let recorder = Recorder::new((rate * duration.as_secs()) as usize);
        let stop = Arc::new(AtomicBool::new(false));
        let loops: Vec<_> = (0..LOOPS)
            .map(|_| {
                tokio::spawn(receive_loop(
                    client.clone(),
                    url.clone(),
                    recorder.clone(),
                    stop.clone(),
                ))
            })
            .collect();
        tokio::time::sleep(WARM).await;
        let run = paced(rate, duration, GRACE, recorder, move |work| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let (_, body) = encode_by_hand(&work);
                client
                    .send_message()
                    .queue_url(&url)
                    .message_body(String::from_utf8(body).unwrap())
                    .send()
                    .await
                    .expect("SendMessage");
            }
        })
        .await;
        stop.store(true, Ordering::Release);
        for receiving in loops {
            receiving.await.unwrap();
        }
        run
    }

    pub(crate) fn run(rt: &tokio::runtime::Runtime, rates: &[u64], out: &mut Vec<Latency>) {
        let duration = seconds();
        let client = client();
        let driver = SqsDriver::new(
            SqsConfig::new("us-east-1")
                .endpoint(endpoint())
                .credentials(SqsCredentials::fixed("test", "test"))
                .wait_time(WAIT),
        )
        .expect("an SQS driver");
        let mut queues = vec![];
        let mut fresh = |side: &str| {
            let queue = unique(&format!("bench-latency-{side}"));
            let (client, driver, name) = (client.clone(), driver.clone(), queue.clone());
            let url = on_worker(rt, async move {
                let url = client
                    .create_queue()
                    .queue_name(&name)
                    .send()
                    .await
                    .expect("CreateQueue")
                    .queue_url()
                    .expect("a queue URL")
                    .to_string();
                driver.delivery_limit(&name).await.unwrap();
                url
            });
            queues.push(url.clone());
            (queue, url)
        };
        let mut made = vec![];
        for &rate in rates {
            let mut sides = vec![];
            for _ in 0..rounds() {
                sides.push((fresh("raw"), fresh("facade")));
            }
            made.push((rate, sides));
        }
        for (rate, sides) in made {
            out.extend(compare(
                "SQS (emulator)",
                "aws-sdk-sqs: SendMessage per job, awaited; 3 loops of ReceiveMessage (10, long polling) + DeleteMessageBatch",
                rate,
                |round| {
                    let (_, url) = sides[round].0.clone();
                    let run = on_worker(rt, raw(client.clone(), url, rate, duration));
                    // The stopped loops' long polls end within WAIT.
                    std::thread::sleep(WAIT);
                    run
                },
                |round| {
                    let (queue, _) = sides[round].1.clone();
                    let d: Arc<dyn Driver> = Arc::new(driver.clone());
                    let run = on_worker(
                        rt,
                        facade_run(d, queue, FACADE_CONCURRENCY, rate, duration),
                    );
                    std::thread::sleep(WAIT);
                    run
                },
            ));
        }
        on_worker(rt, async move {
            for url in queues {
                let _ = client.delete_queue().queue_url(&url).send().await;
            }
        });
    }
}

mod postgres {
    use super::*;
    use jobrail_postgres::{PgConfig, PgDriver};
    use tokio_postgres::{Client, NoTls};

    const RAW_TABLE: &str = "bench_latency_raw";
    /// How long the raw claim loop sleeps when it found nothing.
    const POLL: Duration = Duration::from_millis(1);
    const SCHEMA: &str = "bench_latency";
    const ACK_CLIENTS: usize = 8;

    fn url() -> String {
        std::env::var("POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }

    async fn connect() -> Client {
        let (client, connection) = tokio_postgres::connect(&url(), NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    async fn raw(rate: u64, duration: Duration) -> SideRun {
        let recorder = Recorder::new((rate * duration.as_secs()) as usize);
        let setup = connect().await;
        setup
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {RAW_TABLE};
                 CREATE TABLE {RAW_TABLE} (
                     id bigserial PRIMARY KEY,
                     queue text NOT NULL,
                     body bytea NOT NULL,
                     run_at timestamptz NOT NULL DEFAULT now()
                 );
                 CREATE INDEX {RAW_TABLE}_ready ON {RAW_TABLE} (queue, run_at, id);"
            ))
            .await
            .unwrap();
        let claimer = connect().await;
        let claim = claimer
            .prepare(&format!(
                "WITH picked AS (
                     SELECT id FROM {RAW_TABLE}
                     WHERE queue = $1 AND run_at <= now()
                     ORDER BY run_at, id
                     LIMIT $2
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE {RAW_TABLE} AS t SET run_at = now() + interval '30 seconds'
                 FROM picked WHERE t.id = picked.id
                 RETURNING t.id, t.body"
            ))
            .await
            .unwrap();
        let mut ackers = vec![];
        for _ in 0..ACK_CLIENTS {
            let client = connect().await;
            let delete = client
                .prepare(&format!("DELETE FROM {RAW_TABLE} WHERE id = $1"))
                .await
                .unwrap();
            let insert = client
                .prepare(&format!(
                    "INSERT INTO {RAW_TABLE} (queue, body) VALUES ($1, $2)"
                ))
                .await
                .unwrap();
            ackers.push((Arc::new(client), delete, insert));
        }
        let ackers = Arc::new(ackers);
        let stop = Arc::new(AtomicBool::new(false));
        let consumer = {
            let (recorder, ackers, stop) = (recorder.clone(), ackers.clone(), stop.clone());
            tokio::spawn(async move {
                let queue = "bench-raw".to_string();
                let slots = Arc::new(Semaphore::new(CONCURRENCY));
                let mut next = 0usize;
                while !stop.load(Ordering::Acquire) {
                    let mut permits = vec![slots.clone().acquire_owned().await.unwrap()];
                    while permits.len() < CONCURRENCY {
                        match slots.clone().try_acquire_owned() {
                            Ok(permit) => permits.push(permit),
                            Err(_) => break,
                        }
                    }
                    let rows = claimer
                        .query(&claim, &[&queue, &(permits.len() as i64)])
                        .await
                        .unwrap();
                    if rows.is_empty() {
                        drop(permits);
                        tokio::time::sleep(POLL).await;
                        continue;
                    }
                    for row in rows {
                        let permit = permits.pop().expect("no more rows than permits");
                        let (acker, recorder) = (ackers[next].clone(), recorder.clone());
                        next = (next + 1) % ACK_CLIENTS;
                        tokio::spawn(async move {
                            let id: i64 = row.get(0);
                            let body: &[u8] = row.get(1);
                            let envelope: StampedEnvelope = serde_json::from_slice(body).unwrap();
                            recorder.started(envelope.payload.sent_ns);
                            std::hint::black_box((&envelope.id, &envelope.job));
                            assert_eq!(acker.0.execute(&acker.1, &[&id]).await.unwrap(), 1);
                            recorder.settled(envelope.payload.sent_ns);
                            drop(permit);
                        });
                    }
                }
                let _all = slots.acquire_many(CONCURRENCY as u32).await.unwrap();
            })
        };
        tokio::time::sleep(WARM).await;
        let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let run = paced(rate, duration, GRACE, recorder, move |work| {
            let ackers = ackers.clone();
            let i = counter.fetch_add(1, Ordering::Relaxed) % ACK_CLIENTS;
            async move {
                let (_, body) = encode_by_hand(&work);
                let (client, _, insert) = &ackers[i];
                client
                    .execute(insert, &[&"bench-raw", &body])
                    .await
                    .unwrap();
            }
        })
        .await;
        stop.store(true, Ordering::Release);
        consumer.await.unwrap();
        setup
            .batch_execute(&format!("DROP TABLE IF EXISTS {RAW_TABLE}"))
            .await
            .unwrap();
        run
    }

    async fn facade(rate: u64, duration: Duration) -> SideRun {
        let setup = connect().await;
        setup
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await
            .unwrap();
        let config = PgConfig::new(&url()).unwrap().schema(SCHEMA);
        PgDriver::install(&config).await.unwrap();
        let driver = PgDriver::connect(config).await.unwrap();
        let d: Arc<dyn Driver> = Arc::new(driver.clone());
        let run = facade_run(d, "bench".into(), CONCURRENCY, rate, duration).await;
        driver.stop().await.unwrap();
        setup
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            .await
            .unwrap();
        run
    }

    pub(crate) fn run(rt: &tokio::runtime::Runtime, rates: &[u64], out: &mut Vec<Latency>) {
        let duration = seconds();
        for &rate in rates {
            out.extend(compare(
                "Postgres",
                "tokio-postgres: an INSERT per job; SKIP LOCKED claims polled every 1 ms when idle, a task per row, DELETE on ack",
                rate,
                |_| on_worker(rt, raw(rate, duration)),
                |_| on_worker(rt, facade(rate, duration)),
            ));
        }
    }
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    jobrail_bench::latency::epoch();
    let steady = [2_000, 10_000];
    let sqs_rates = [50, 150];
    let mut out = vec![];
    let chosen = backends();
    for backend in &chosen {
        match backend.as_str() {
            "memory" => memory::run(&rt, &steady, &mut out),
            "rabbitmq" => rabbitmq::run(&rt, &steady, &mut out),
            "nats" => nats::run(&rt, &steady, &mut out),
            "sqs" => sqs::run(&rt, &sqs_rates, &mut out),
            "postgres" => postgres::run(&rt, &steady, &mut out),
            other => panic!("BENCH_BACKENDS: unknown backend `{other}`"),
        }
    }
    let everything =
        chosen.len() == 5 && std::env::var("BENCH_ONLY").map_or(true, |v| v.is_empty()) && !quick();
    if everything {
        // One plot per step of load: the steady rate (SQS at its own).
        for (step, rate) in steady.iter().enumerate() {
            let series: Vec<_> = out
                .iter()
                .filter(|l| l.rate == *rate || l.rate == sqs_rates[step])
                .flat_map(|l| l.series())
                .collect();
            let path = jobrail_bench::workspace_root()
                .join("bench/plots")
                .join(format!("latency-{rate}.svg"));
            jobrail_bench::plot::lines_log(
                &path,
                &format!(
                    "Dispatch to settled, {rate} jobs/s (SQS emulator {} jobs/s)",
                    sqs_rates[step]
                ),
                "1 / (1 - percentile): 2 = p50, 100 = p99, 1000 = p99.9",
                "latency (ms)",
                &series,
            )
            .expect("draw the latency plot");
            eprintln!("latency: drew {}", path.display());
        }
    }
}
