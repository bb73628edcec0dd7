//! The consumer's shutdown order, observed through a driver that records
//! when its subscription is closed.
#![cfg(feature = "memory")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use jobrail::{Job, JobContext, Registry};
use jobrail_native::{
    Capabilities, Consumer, Delivery, Driver, DriverError, MemoryDriver, Outgoing, Producer,
    Subscription,
};

/// The memory driver, with subscriptions that remember being closed.
struct Recording {
    inner: MemoryDriver,
    closed: Arc<AtomicBool>,
}

struct RecordingSubscription {
    inner: Box<dyn Subscription>,
    closed: Arc<AtomicBool>,
}

#[async_trait]
impl Subscription for RecordingSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        self.inner.next().await
    }
    async fn close(&mut self) {
        self.closed.store(true, Ordering::SeqCst);
    }
}

#[async_trait]
impl Driver for Recording {
    fn name(&self) -> &'static str {
        "recording"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.send(queue, message).await
    }
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        let inner = self.inner.subscribe(queue, prefetch).await?;
        Ok(Box::new(RecordingSubscription {
            inner,
            closed: self.closed.clone(),
        }))
    }
    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stop().await
    }
}

/// Shutdown closes subscriptions before it cancels handlers, so a broker that
/// pushes cannot hand the closing consumer a message freed by a settlement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_intake_before_cancelling_handlers() {
    let closed = Arc::new(AtomicBool::new(false));
    let driver = Arc::new(Recording {
        inner: MemoryDriver::default(),
        closed: closed.clone(),
    });
    let job = Job::<u32>::builder("wait").queue("q").build().unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let seen_when_cancelled = Arc::new(Mutex::new(None));
    let (s, seen, flag) = (started.clone(), seen_when_cancelled.clone(), closed.clone());
    let mut registry = Registry::new();
    registry
        .register(&job, move |ctx: JobContext, _: u32| {
            let (s, seen, flag) = (s.clone(), seen.clone(), flag.clone());
            async move {
                s.notify_one();
                let cancelled = ctx.cancelled().await;
                *seen.lock().unwrap() = Some(flag.load(Ordering::SeqCst));
                Err(cancelled.into())
            }
        })
        .unwrap();
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(1)
        .build()
        .spawn();
    Producer::new(driver.clone())
        .dispatch(&job)
        .send(&1)
        .await
        .unwrap();
    started.notified().await;
    consumer.shutdown().await.unwrap();
    assert_eq!(
        *seen_when_cancelled.lock().unwrap(),
        Some(true),
        "intake was closed first"
    );
    assert_eq!(
        driver.inner.ready("q"),
        1,
        "the interrupted job went back to the queue"
    );
}

/// Runs `jobs` (job, messages) on one consumer with `concurrency` slots and
/// returns how many handler executions happened within `patience`.
async fn served(jobs: &[(&str, u32)], concurrency: usize) -> (usize, usize) {
    let driver = Arc::new(MemoryDriver::default());
    let producer = Producer::new(driver.clone());
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut registry = Registry::new();
    let mut total = 0;
    for (name, count) in jobs {
        let job = Job::<u32>::builder(*name).queue(*name).build().unwrap();
        let r = ran.clone();
        registry
            .register(&job, move |_: JobContext, _: u32| {
                r.fetch_add(1, Ordering::SeqCst);
                async { Ok(()) }
            })
            .unwrap();
        for n in 0..*count {
            producer.dispatch(&job).send(&n).await.unwrap();
        }
        total += *count as usize;
    }
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(concurrency)
        .build()
        .spawn();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while ran.load(Ordering::SeqCst) < total && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    consumer.shutdown().await.unwrap();
    (ran.load(Ordering::SeqCst), total)
}

/// An idle queue must not hold a slot of the shared limit while it waits:
/// every queue is served at any concurrency of at least 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_queue_is_served_below_one_slot_per_queue() {
    let (ran, total) = served(&[("a", 1), ("b", 20)], 1).await;
    assert_eq!(ran, total, "concurrency 1 over a busy and a drained queue");
    let (ran, total) = served(&[("idle-1", 0), ("idle-2", 0), ("busy", 20)], 2).await;
    assert_eq!(
        ran, total,
        "concurrency 2 over two idle queues and a busy one"
    );
}
