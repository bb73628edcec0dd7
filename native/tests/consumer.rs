//! The consumer's shutdown order, observed through a driver that records
//! when its subscription is closed.
#![cfg(feature = "memory")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use queue::{Job, JobContext, Registry};
use queue_native::{
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
        .dispatch(&job, &1)
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
