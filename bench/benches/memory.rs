//! The memory driver with the consumer against the same pipeline by hand.
//!
//! - baseline: a tokio mpsc channel, filled before the clock starts, feeding
//!   spawned tasks (at most 64 in flight, a semaphore's permits) that each
//!   decode the envelope with its payload in one typed pass, call the
//!   handler, then send an ack over an ack channel to a task that counts
//!   them (the ack channel stands for the settlement); the round ends when
//!   the counter has seen every ack;
//! - facade: a `MemoryDriver` filled before the clock starts, with one
//!   `Dispatch::send_batch` (the first row) or one `Dispatch::send` per job
//!   (the second), then a `Consumer` (concurrency 64) started, left to
//!   settle every message (the queue's depth, ready plus in flight, back at
//!   zero) and shut down.
//!
//! 200,000 no-op jobs per round (20,000 under `BENCH_QUICK=1`), both sides
//! on a tokio worker of the harness runtime in interleaved rounds. Target
//! (issue 30): at most 1.1x the baseline, however the queue was filled.
//!
//! Run: `cargo bench -p jobrail-bench --bench memory`.

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Envelope, JobContext, Registry, Runtime};
use jobrail_bench::work::{self, handler, payloads, TypedEnvelope, Work};
use jobrail_bench::{reset_results, runtime, selected, size, time_on_worker, Comparison};
use jobrail_native::{Consumer, MemoryDriver, Producer, TokioRuntime};

const BENCH: &str = "memory";
const CONCURRENCY: usize = 64;
const QUEUE: &str = "bench";

fn job() -> jobrail::Job<Work> {
    work::job(QUEUE)
}

/// One baseline round: the channel is filled outside the timing.
fn baseline(rt: &tokio::runtime::Runtime, n: u64) -> Duration {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    for id in 0..n {
        let body = Envelope::new("work", serde_json::json!({"id": id, "name": "report"})).encode();
        tx.send(body).unwrap();
    }
    drop(tx);
    let ctx = JobContext::detached(Arc::new(TokioRuntime));
    time_on_worker(rt, async move {
        let mut rx = rx;
        let (acks, mut acked) = tokio::sync::mpsc::unbounded_channel::<()>();
        let counter = tokio::spawn(async move {
            let mut count = 0u64;
            while count < n {
                acked.recv().await.expect("every ack arrives");
                count += 1;
            }
        });
        let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
        while let Some(body) = rx.recv().await {
            let permit = permits.clone().acquire_owned().await.unwrap();
            let (acks, ctx) = (acks.clone(), ctx.clone());
            tokio::spawn(async move {
                let envelope: TypedEnvelope = serde_json::from_slice(&body).unwrap();
                std::hint::black_box((&envelope.id, &envelope.job, &envelope.metadata));
                handler(ctx, envelope.payload).await.unwrap();
                acks.send(()).unwrap();
                drop(permit);
            });
        }
        counter.await.unwrap();
    })
}

/// How the facade's queue is filled before the clock.
#[derive(Clone, Copy, PartialEq)]
enum Fill {
    /// One `Dispatch::send_batch` of every job.
    Batch,
    /// One `Dispatch::send` per job.
    OneByOne,
}

/// One facade round: the driver is filled outside the timing.
fn facade(rt: &tokio::runtime::Runtime, n: u64, payloads: &Arc<Vec<Work>>, fill: Fill) -> Duration {
    let driver = MemoryDriver::default();
    let job = job();
    {
        let (driver, job, payloads) = (driver.clone(), job.clone(), payloads.clone());
        jobrail_bench::on_worker(rt, async move {
            let producer = Producer::new(Arc::new(driver));
            if fill == Fill::Batch {
                for result in producer.dispatch(&job).send_batch(&payloads).await {
                    result.unwrap();
                }
            } else {
                for work in payloads.iter() {
                    producer.dispatch(&job).send(work).await.unwrap();
                }
            }
        });
    }
    assert_eq!(driver.ready(QUEUE), n as usize, "the queue is filled");
    let mut registry = Registry::new();
    registry.register(&job, handler).unwrap();
    let runtime: Arc<dyn Runtime> = Arc::new(TokioRuntime);
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(CONCURRENCY)
        .runtime(runtime)
        .build();
    let stats = consumer.registry().stats().clone();
    let waiting = driver.clone();
    let took = time_on_worker(rt, async move {
        let handle = consumer.spawn();
        while waiting.depth(QUEUE) > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handle.shutdown().await.unwrap();
    });
    assert_eq!(stats.job("work").first_attempt, n, "every job ran once");
    took
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let n = size(200_000);
    let payloads = Arc::new(payloads(n));
    let baseline_work = "tokio mpsc + spawned tasks (64 in flight) + ack channel";
    for (fill, filled) in [
        (Fill::Batch, "filled by `send_batch`"),
        (Fill::OneByOne, "filled one `send` at a time"),
    ] {
        let work = format!(
            "memory driver + consumer, {n} no-op jobs, concurrency {CONCURRENCY}, {filled}"
        );
        if !selected(&work) {
            continue;
        }
        Comparison::new(BENCH, &work, baseline_work, n)
            .target(1.1)
            .run(|_| baseline(&rt, n), |_| facade(&rt, n, &payloads, fill))
            .report();
    }
}
