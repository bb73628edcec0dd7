//! Jobs for later on the memory driver: a delay of any length, held
//! natively (on tokio's paused clock) or in steps (on the real clock, with
//! short steps), counted message by message.
#![cfg(feature = "memory")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use jobrail::{Job, JobContext, Registry};
use jobrail_native::{
    Capabilities, Consumer, Driver, DriverError, ErrorKind, MemoryConfig, MemoryDriver, Outgoing,
    Producer, Subscription,
};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The memory driver, counting every message sent to it.
struct Counted {
    inner: MemoryDriver,
    sends: AtomicUsize,
}

#[async_trait]
impl Driver for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        self.inner.send(queue, message).await
    }
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.subscribe(queue, prefetch).await
    }
    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stop().await
    }
}

/// (payload, attempt, when) of each run.
type Runs = Arc<Mutex<Vec<(u32, u32, tokio::time::Instant)>>>;

/// A registry whose one job records each run.
fn recording(job: &Job<u32>) -> (Registry, Runs) {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let seen = runs.clone();
    let mut registry = Registry::new();
    registry
        .register(job, move |ctx: JobContext, n: u32| {
            seen.lock()
                .unwrap()
                .push((n, ctx.attempt(), tokio::time::Instant::now()));
            async { Ok(()) }
        })
        .unwrap();
    (registry, runs)
}

/// A job due in 30 days, held natively by the memory driver, runs within
/// 1 s of its time and not before (tokio's paused clock: the 30 days pass
/// at once).
#[tokio::test(start_paused = true)]
async fn a_job_due_in_thirty_days_runs_on_time() {
    let driver = Arc::new(MemoryDriver::default());
    let job = Job::<u32>::builder("in-thirty-days")
        .queue("later")
        .max_deliveries(3)
        .build()
        .unwrap();
    let (registry, runs) = recording(&job);
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    let start = tokio::time::Instant::now();
    Producer::new(driver.clone())
        .dispatch(&job)
        .delay(30 * DAY)
        .send(&1)
        .await
        .unwrap();
    tokio::time::sleep(30 * DAY - Duration::from_secs(1)).await;
    assert!(
        runs.lock().unwrap().is_empty(),
        "nothing ran a second early"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    consumer.shutdown().await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1, "it ran once");
    let after = runs[0].2 - start;
    assert!(
        after >= 30 * DAY && after <= 30 * DAY + Duration::from_secs(1),
        "ran after {after:?}"
    );
    assert_eq!(runs[0].1, 1);
}

/// A delay ten times the longest step costs at most ten messages (the
/// producer's first step and those sent on by the consumer), runs once at
/// attempt 1, and not before its time.
#[tokio::test]
async fn a_stepped_delay_costs_one_message_per_step() {
    let step = Duration::from_millis(100);
    let driver = Arc::new(Counted {
        inner: MemoryDriver::new(MemoryConfig::default().max_dispatch_delay(Some(step))),
        sends: AtomicUsize::new(0),
    });
    let job = Job::<u32>::builder("stepped")
        .queue("stepped")
        .max_deliveries(3)
        .build()
        .unwrap();
    let (registry, runs) = recording(&job);
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    let start = tokio::time::Instant::now();
    Producer::new(driver.clone())
        .dispatch(&job)
        .delay(step * 10)
        .send(&7)
        .await
        .unwrap();
    for _ in 0..100 {
        if !runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    consumer.shutdown().await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1, "it ran once: {runs:?}");
    assert!(runs[0].2 - start >= step * 10, "ran before its time");
    assert_eq!(runs[0].1, 1, "no step counted as an attempt");
    // One message per step, the last rest (under a step) waited out by the
    // consumer rather than sent on.
    let sends = driver.sends.load(Ordering::SeqCst);
    assert!((9..=10).contains(&sends), "{sends} messages for ten steps");
}

/// A raw body that is not an envelope cannot carry its due time: a delay
/// longer than one step is refused before anything is sent; a shorter one
/// is sent as it is.
#[tokio::test]
async fn a_raw_body_is_refused_a_delay_past_one_step() {
    let driver = Arc::new(MemoryDriver::new(
        MemoryConfig::default().max_dispatch_delay(Some(Duration::from_secs(1))),
    ));
    let producer = Producer::new(driver.clone());
    let err = producer
        .send_raw(
            "raw",
            "a".into(),
            b"not json".to_vec(),
            Some(Duration::from_secs(5)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(
        err.to_string().contains("cannot carry the due time"),
        "{err}"
    );
    assert_eq!(driver.depth("raw"), 0, "nothing was sent");
    producer
        .send_raw(
            "raw",
            "b".into(),
            b"not json".to_vec(),
            Some(Duration::from_millis(500)),
        )
        .await
        .unwrap();
    assert_eq!(driver.depth("raw"), 1);
}

/// A run-at time already past is now; one ahead is a delay.
#[tokio::test(start_paused = true)]
async fn a_run_at_time_past_is_now() {
    let driver = Arc::new(MemoryDriver::default());
    let job = Job::<u32>::builder("at").queue("at").build().unwrap();
    let producer = Producer::new(driver.clone());
    producer
        .dispatch(&job)
        .at(SystemTime::now() - Duration::from_secs(60))
        .send(&1)
        .await
        .unwrap();
    assert_eq!(driver.ready("at"), 1, "a time past is ready at once");
    producer
        .dispatch(&job)
        .at(SystemTime::now() + 3 * DAY)
        .send(&2)
        .await
        .unwrap();
    assert_eq!(driver.ready("at"), 1, "a time ahead waits");
    assert_eq!(driver.depth("at"), 2);
}
