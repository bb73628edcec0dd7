//! SQS (the emulator at `SQS_ENDPOINT`) through the facade against raw
//! aws-sdk-sqs doing the same work.
//!
//! - consume: the queue filled (raw `SendMessageBatch`) before the clock
//!   starts, then emptied at concurrency 30, no-op jobs, at least once
//!   (each message deleted only after its handler). Baseline: the best raw
//!   loop, three tasks each `ReceiveMessage` (up to 10, long polling),
//!   decode and handle each message, then one `DeleteMessageBatch` of the
//!   handled ones; the round ends when every message is deleted. Facade: a
//!   `Consumer` (concurrency 30) on an `SqsDriver` until every job ran and
//!   settled (shut down after the last one). Target: at most 1.05x.
//! - dispatch: the same envelopes stored on an empty queue. Baseline: raw
//!   `SendMessageBatch` calls of 10, all in flight together. Facade:
//!   `Producer::dispatch_batch` (the driver's `send_batch`). Target: at
//!   most 1.1x.
//!
//! The emulator (moto) runs one request at a time, so the figures measure
//! mostly how many requests each side makes and how well it keeps the
//! emulator busy: compare ratios, not absolute speeds. The emulator's
//! cost per request grows with the messages a queue holds (it scans them
//! on every receive and delete), so the counts stay small: 500 messages per
//! round (50 under `BENCH_QUICK=1`); both sides on a tokio worker of the
//! harness runtime, in interleaved rounds; every round checks its queue
//! afterwards (empty after consuming, every message there after a dispatch).
//!
//! Run: `export SQS_ENDPOINT=$(tests/sqs-emulator); cargo bench -p jobrail-bench --features sqs --bench sqs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, QueueAttributeName, SendMessageBatchRequestEntry,
};
use aws_sdk_sqs::Client;
use futures_util::future::join_all;
use jobrail::{Envelope, JobContext, Registry, Runtime};
use jobrail_bench::work::{handler, job, payloads, TypedEnvelope, Work};
use jobrail_bench::{
    on_worker, reset_results, runtime, selected, size, time_on_worker, unique, Comparison,
};
use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};
use jobrail_native::{Consumer, Producer, TokioRuntime};
use tokio::sync::Notify;

const BENCH: &str = "sqs";
const CONCURRENCY: usize = 30;
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

fn driver() -> SqsDriver {
    let config = SqsConfig::new("us-east-1")
        .endpoint(endpoint())
        .credentials(SqsCredentials::fixed("test", "test"))
        .wait_time(WAIT);
    SqsDriver::new(config).expect("an SQS driver")
}

fn bodies(n: u64) -> Vec<String> {
    (0..n)
        .map(|id| {
            let body = Envelope::new("work", serde_json::json!({"id": id, "name": "report"}));
            String::from_utf8(body.encode()).unwrap()
        })
        .collect()
}

async fn queue_url(client: &Client, queue: &str) -> String {
    client
        .create_queue()
        .queue_name(queue)
        .send()
        .await
        .expect("CreateQueue")
        .queue_url()
        .expect("a queue URL")
        .to_string()
}

/// Raw `SendMessageBatch` of `bodies`, 10 per call, all calls in flight.
async fn send_all(client: &Client, url: &str, bodies: &[String]) {
    let calls = bodies.chunks(10).map(|chunk| {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, body)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(body)
                    .build()
                    .unwrap()
            })
            .collect();
        client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
    });
    for answer in join_all(calls).await {
        let answer = answer.expect("SendMessageBatch");
        assert!(answer.failed().is_empty(), "every entry stored");
    }
}

/// Messages ready plus in flight (the emulator counts exactly).
async fn held(client: &Client, url: &str) -> u64 {
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .expect("GetQueueAttributes");
    let attributes = answer.attributes().cloned().unwrap_or_default();
    [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
    ]
    .iter()
    .map(|name| {
        attributes
            .get(name)
            .map_or(0, |v| v.parse::<u64>().unwrap())
    })
    .sum()
}

/// One raw loop: receive up to 10, handle each, delete the handled ones in
/// one batch; until `deleted` reaches `n`.
async fn raw_loop(
    client: Client,
    url: String,
    n: u64,
    deleted: Arc<AtomicU64>,
    done: Arc<Notify>,
    ctx: JobContext,
) {
    while deleted.load(Ordering::Acquire) < n {
        let answer = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(WAIT.as_secs() as i32)
            .send()
            .await
            .expect("ReceiveMessage");
        let mut entries = Vec::new();
        for (i, message) in answer.messages().iter().enumerate() {
            let envelope: TypedEnvelope =
                serde_json::from_str(message.body().unwrap_or_default()).unwrap();
            std::hint::black_box((&envelope.id, &envelope.job, &envelope.metadata));
            handler(ctx.clone(), envelope.payload).await.unwrap();
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
        let count = entries.len() as u64;
        let answer = client
            .delete_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await
            .expect("DeleteMessageBatch");
        assert!(answer.failed().is_empty(), "every entry deleted");
        if deleted.fetch_add(count, Ordering::AcqRel) + count >= n {
            done.notify_one();
        }
    }
}

fn consume_baseline(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    url: &str,
    bodies: &Arc<Vec<String>>,
) -> Duration {
    let n = bodies.len() as u64;
    {
        let (client, url, bodies) = (client.clone(), url.to_string(), bodies.clone());
        on_worker(rt, async move { send_all(&client, &url, &bodies).await });
    }
    let (client2, url2) = (client.clone(), url.to_string());
    let took = on_worker(rt, async move {
        let (client, url) = (client2, url2);
        let started = Instant::now();
        let deleted = Arc::new(AtomicU64::new(0));
        let done = Arc::new(Notify::new());
        let ctx = JobContext::detached(Arc::new(TokioRuntime));
        let loops: Vec<_> = (0..CONCURRENCY / 10)
            .map(|_| {
                tokio::spawn(raw_loop(
                    client.clone(),
                    url.clone(),
                    n,
                    deleted.clone(),
                    done.clone(),
                    ctx.clone(),
                ))
            })
            .collect();
        done.notified().await;
        let took = started.elapsed();
        // Outside the timing: each loop's last long poll ends (on an empty
        // queue) before the next round fills it, so no poll left behind
        // takes (and hides) the next round's messages.
        for task in loops {
            task.await.unwrap();
        }
        took
    });
    let (client, url) = (client.clone(), url.to_string());
    assert_eq!(on_worker(rt, async move { held(&client, &url).await }), 0);
    took
}

fn consume_facade(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    driver: &SqsDriver,
    queue: &str,
    url: &str,
    bodies: &Arc<Vec<String>>,
) -> Duration {
    let n = bodies.len() as u64;
    {
        let (client, url, bodies) = (client.clone(), url.to_string(), bodies.clone());
        on_worker(rt, async move { send_all(&client, &url, &bodies).await });
    }
    let ran = Arc::new(AtomicU64::new(0));
    let all_ran = Arc::new(Notify::new());
    let mut registry = Registry::new();
    {
        let (ran, all_ran) = (ran.clone(), all_ran.clone());
        registry
            .register(&job(queue), move |ctx, work| {
                if ran.fetch_add(1, Ordering::AcqRel) + 1 == n {
                    all_ran.notify_one();
                }
                handler(ctx, work)
            })
            .unwrap();
    }
    let runtime: Arc<dyn Runtime> = Arc::new(TokioRuntime);
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(CONCURRENCY)
        .runtime(runtime)
        .build();
    let took = time_on_worker(rt, async move {
        let handle = consumer.spawn();
        all_ran.notified().await;
        // Joins the handlers' settlements (the last deletes).
        handle.shutdown().await.unwrap();
    });
    // The stopped subscription's long polls end within `WAIT` (on an empty
    // queue): let them, so none takes the next round's messages.
    std::thread::sleep(WAIT + Duration::from_millis(500));
    assert_eq!(ran.load(Ordering::Acquire), n, "every job ran once");
    let (client, url) = (client.clone(), url.to_string());
    assert_eq!(on_worker(rt, async move { held(&client, &url).await }), 0);
    took
}

/// A fresh queue for one dispatch round (PurgeQueue is allowed once a
/// minute), its URL known to `driver` too (outside the timing).
fn fresh_queue(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    driver: &SqsDriver,
) -> (String, String) {
    let queue = unique("bench-sqs-dispatch");
    let (client, driver, name) = (client.clone(), driver.clone(), queue.clone());
    let url = on_worker(rt, async move {
        let url = queue_url(&client, &name).await;
        use jobrail_native::Driver;
        driver.delivery_limit(&name).await.unwrap();
        url
    });
    (queue, url)
}

/// Checks that `n` messages are on the queue, then deletes it.
fn check_and_delete(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    queue: String,
    url: String,
    n: u64,
) {
    let client = client.clone();
    on_worker(rt, async move {
        assert_eq!(
            held(&client, &url).await,
            n,
            "every message stored on `{queue}`"
        );
        client
            .delete_queue()
            .queue_url(&url)
            .send()
            .await
            .expect("DeleteQueue");
    });
}

fn dispatch_baseline(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    driver: &SqsDriver,
    bodies: &Arc<Vec<String>>,
) -> Duration {
    let n = bodies.len() as u64;
    let (queue, url) = fresh_queue(rt, client, driver);
    let (client2, url2, bodies) = (client.clone(), url.clone(), bodies.clone());
    let took = time_on_worker(rt, async move {
        send_all(&client2, &url2, &bodies).await;
    });
    check_and_delete(rt, client, queue, url, n);
    took
}

fn dispatch_facade(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    driver: &SqsDriver,
    payloads: &Arc<Vec<Work>>,
) -> Duration {
    let n = payloads.len() as u64;
    let (queue, url) = fresh_queue(rt, client, driver);
    let producer = Producer::new(Arc::new(driver.clone()));
    let (job, payloads) = (job(&queue), payloads.clone());
    let took = time_on_worker(rt, async move {
        for result in producer.dispatch(&job).send_batch(&payloads).await {
            result.unwrap();
        }
    });
    check_and_delete(rt, client, queue, url, n);
    took
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let n = size(500);
    let client = client();
    let driver = driver();

    let work = format!("SQS consume, {n} no-op jobs, concurrency {CONCURRENCY}");
    if selected(&work) {
        let queue = unique("bench-sqs-consume");
        let url = {
            let (client, queue, driver) = (client.clone(), queue.clone(), driver.clone());
            on_worker(&rt, async move {
                let url = queue_url(&client, &queue).await;
                // Resolves (creates) the work and failure queues outside the timing.
                use jobrail_native::Driver;
                drop(driver.subscribe(&queue, 1).await.unwrap());
                url
            })
        };
        let bodies = Arc::new(bodies(n));
        Comparison::new(
            BENCH,
            &work,
            "aws-sdk-sqs, 3 loops: receive 10 (long poll), handle, DeleteMessageBatch",
            n,
        )
        .target(1.05)
        .run(
            |_| consume_baseline(&rt, &client, &url, &bodies),
            |_| consume_facade(&rt, &client, &driver, &queue, &url, &bodies),
        )
        .report();
        cleanup(&rt, &driver, &[queue]);
    }

    let work = format!("SQS dispatch, {n} messages in one batch");
    if selected(&work) {
        let bodies = Arc::new(bodies(n));
        let payloads = Arc::new(payloads(n));
        Comparison::new(
            BENCH,
            &work,
            "aws-sdk-sqs, SendMessageBatch of 10, all calls in flight",
            n,
        )
        .target(1.1)
        .run(
            |_| dispatch_baseline(&rt, &client, &driver, &bodies),
            |_| dispatch_facade(&rt, &client, &driver, &payloads),
        )
        .report();
    }
}

/// Deletes the bench's queues (and the failure queues the driver made).
fn cleanup(rt: &tokio::runtime::Runtime, driver: &SqsDriver, queues: &[String]) {
    let driver = driver.clone();
    let mut names: Vec<String> = queues.to_vec();
    names.extend(driver.created_queues());
    on_worker(rt, async move {
        let _ = driver.delete_queues(&names).await;
    });
}
