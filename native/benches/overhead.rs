//! What the facade costs over doing the same work by hand.
//!
//! Two ratios, each against a baseline measured in the same run:
//!
//! - `rules`: `Registry::process` for a successful delivery (envelope decode,
//!   lookup, payload decode, tier-one executor, settlement decision, event
//!   preparation) against decoding the envelope and payload and calling the
//!   handler directly.
//! - `memory end to end`: dispatching and consuming N jobs through the memory
//!   driver and the consumer (concurrency 8) against a tokio channel feeding
//!   spawned handler tasks under an 8-permit semaphore.
//!
//! Run: `cargo bench -p jobrail-native --bench overhead` (prints medians of 5 rounds).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jobrail::{CancelToken, Envelope, Incoming, Job, JobContext, JobError, Registry, Runtime};
use jobrail_native::{Consumer, MemoryDriver, Producer, TokioRuntime};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Work {
    id: u64,
    name: String,
}

async fn handler(_: JobContext, work: Work) -> Result<(), JobError> {
    std::hint::black_box(work.id);
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn body(id: u64) -> Vec<u8> {
    Envelope::new("work", serde_json::json!({"id": id, "name": "report"})).encode()
}

async fn rules(n: u64) -> (Duration, Duration) {
    let job = Job::<Work>::builder("work").build().unwrap();
    let mut registry = Registry::new();
    registry.register(&job, handler).unwrap();
    let runtime: Arc<dyn Runtime> = Arc::new(TokioRuntime);
    let cancel = CancelToken::new();
    let bodies: Vec<Vec<u8>> = (0..n).map(body).collect();
    let ctx = JobContext::detached(runtime.clone());

    let start = Instant::now();
    for b in &bodies {
        let envelope = Envelope::decode(b).unwrap();
        let work: Work = serde_json::from_value(envelope.payload).unwrap();
        handler(ctx.clone(), work).await.unwrap();
    }
    let baseline = start.elapsed();

    let start = Instant::now();
    for b in &bodies {
        let delivery = Incoming {
            queue: "default",
            body: b,
            attempt: 1,
            shutdown_returns: None,
            deadline: None,
        };
        let processed = registry.process(delivery, &runtime, &cancel).await;
        registry.settled(&processed, Ok(()));
    }
    (baseline, start.elapsed())
}

async fn end_to_end(n: u64) -> (Duration, Duration) {
    // Baseline: a channel and spawned tasks under a semaphore.
    let start = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    for id in 0..n {
        tx.send(body(id)).unwrap();
    }
    drop(tx);
    let permits = Arc::new(tokio::sync::Semaphore::new(8));
    let done = Arc::new(AtomicU64::new(0));
    let ctx = JobContext::detached(Arc::new(TokioRuntime));
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(b) = rx.recv().await {
        let permit = permits.clone().acquire_owned().await.unwrap();
        let (done, ctx) = (done.clone(), ctx.clone());
        tasks.spawn(async move {
            let envelope = Envelope::decode(&b).unwrap();
            let work: Work = serde_json::from_value(envelope.payload).unwrap();
            handler(ctx, work).await.unwrap();
            done.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    assert_eq!(done.load(Ordering::Relaxed), n);
    let baseline = start.elapsed();

    // The facade: producer, memory driver, consumer.
    let start = Instant::now();
    let job = Job::<Work>::builder("work").queue("bench").build().unwrap();
    let driver = Arc::new(MemoryDriver::default());
    let producer = Producer::new(driver.clone());
    for id in 0..n {
        producer
            .dispatch(
                &job,
                &Work {
                    id,
                    name: "report".into(),
                },
            )
            .await
            .unwrap();
    }
    let mut registry = Registry::new();
    registry.register(&job, handler).unwrap();
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(8)
        .build()
        .spawn();
    while consumer.registry().stats().job("work").first_attempt < n {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    consumer.shutdown().await.unwrap();
    (baseline, start.elapsed())
}

#[tokio::main]
async fn main() {
    let rounds = 5;
    let (mut base, mut facade) = (vec![], vec![]);
    for _ in 0..rounds {
        let (b, f) = rules(50_000).await;
        base.push(b);
        facade.push(f);
    }
    let (b, f) = (median(base), median(facade));
    println!(
        "rules: 50000 deliveries: direct {:?}, Registry::process {:?}, ratio {:.2}",
        b,
        f,
        f.as_secs_f64() / b.as_secs_f64()
    );

    let (mut base, mut facade) = (vec![], vec![]);
    for _ in 0..rounds {
        let (b, f) = end_to_end(20_000).await;
        base.push(b);
        facade.push(f);
    }
    let (b, f) = (median(base), median(facade));
    println!(
        "memory end to end: 20000 jobs: channel+tasks {:?}, facade {:?}, ratio {:.2}",
        b,
        f,
        f.as_secs_f64() / b.as_secs_f64()
    );
}
