//! Schedulers on the memory driver and one in-process claim store, on
//! tokio's paused clock: each tick dispatched once across schedulers, a
//! dead holder's tick taken over, missed ticks after a downtime, and the
//! overlap guard.

#![cfg(feature = "memory")]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{
    BoxFuture, Claim, ClaimError, ClaimState, ClaimStore, Envelope, Job, JobContext, MemoryClaims,
    Missed, Overlap, Registry, Schedule, SystemTime, Tick, TICK_METADATA,
};
use jobrail_native::{Consumer, Driver, MemoryDriver, Producer, Scheduler, TokioRuntime};

fn at(text: &str) -> SystemTime {
    Tick::parse(text).unwrap().time()
}

fn claims() -> Arc<MemoryClaims> {
    Arc::new(MemoryClaims::with_clock(Arc::new(TokioRuntime)))
}

fn job() -> Job<()> {
    Job::<()>::builder("tick-job")
        .queue("ticks")
        .build()
        .unwrap()
}

/// Every message on `queue`: its tick label and when (virtual) it was taken.
async fn drain(driver: &MemoryDriver, queue: &str) -> Vec<String> {
    let ready = driver.ready(queue);
    let mut ticks = Vec::new();
    if ready == 0 {
        return ticks;
    }
    let mut sub = driver.subscribe(queue, ready).await.unwrap();
    for _ in 0..ready {
        let delivery = sub.next().await.unwrap().unwrap();
        let envelope = Envelope::decode(delivery.body()).unwrap();
        ticks.push(envelope.metadata[TICK_METADATA].clone());
        delivery.settle(&jobrail::Settlement::Ack).await.unwrap();
    }
    ticks.sort();
    ticks
}

fn seconds(from: &str, count: i64) -> Vec<String> {
    let start = Tick::parse(from).unwrap().unix_seconds();
    (0..count)
        .map(|i| Tick::from_unix_seconds(start + i).rfc3339())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn three_schedulers_dispatch_each_tick_once() {
    let driver = Arc::new(MemoryDriver::default());
    let store = claims();
    let schedule = Schedule::builder("every-second", &job(), "* * * * * *")
        .missed(Missed::Each(10))
        .build()
        .unwrap();
    let epoch = at("2026-01-01T00:00:00Z") + Duration::from_millis(500);
    let running: Vec<_> = (0..3)
        .map(|_| {
            Scheduler::builder(Producer::new(driver.clone()), store.clone())
                .schedule(schedule.clone())
                .epoch(epoch)
                .build()
                .unwrap()
                .spawn()
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(100)).await;
    for r in running {
        r.shutdown().await;
    }
    let ticks = drain(&driver, "ticks").await;
    assert_eq!(ticks, seconds("2026-01-01T00:00:01Z", 100));
}

/// A store that, for one key, takes the claim and then never answers: the
/// scheduler holding it is as good as dead.
struct DiesOn {
    inner: Arc<MemoryClaims>,
    key: String,
}

impl ClaimStore for DiesOn {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        if key == self.key {
            return Box::pin(async move {
                let _ = self.inner.claim(key, lease).await;
                std::future::pending().await
            });
        }
        self.inner.claim(key, lease)
    }
    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.inner.complete(key, fence)
    }
    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.inner.release(key, fence)
    }
    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        self.inner.extend(key, fence, lease)
    }
    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        self.inner.state(key)
    }
}

/// Records when (on the scheduler's wall clock) each tick was sent.
struct Timed {
    inner: Arc<MemoryDriver>,
    epoch: SystemTime,
    start: tokio::time::Instant,
    sent: Mutex<BTreeMap<String, Vec<SystemTime>>>,
}

#[async_trait::async_trait]
impl Driver for Timed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> jobrail_native::Capabilities {
        self.inner.capabilities()
    }
    async fn send(
        &self,
        queue: &str,
        message: jobrail_native::Outgoing,
    ) -> Result<(), jobrail_native::DriverError> {
        let envelope = Envelope::decode(&message.body).unwrap();
        let now = self.epoch + (tokio::time::Instant::now() - self.start);
        self.sent
            .lock()
            .unwrap()
            .entry(envelope.metadata[TICK_METADATA].clone())
            .or_default()
            .push(now);
        self.inner.send(queue, message).await
    }
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn jobrail_native::Subscription>, jobrail_native::DriverError> {
        self.inner.subscribe(queue, prefetch).await
    }
    async fn stop(&self) -> Result<(), jobrail_native::DriverError> {
        self.inner.stop().await
    }
}

#[tokio::test(start_paused = true)]
async fn a_dead_schedulers_tick_is_taken_over_within_the_lease_and_a_poll() {
    let store = claims();
    let schedule = Schedule::builder("every-second", &job(), "* * * * * *")
        .missed(Missed::Each(100))
        .lease(Duration::from_secs(5))
        .build()
        .unwrap();
    let epoch = at("2026-01-01T00:00:00Z") + Duration::from_millis(500);
    let driver = Arc::new(Timed {
        inner: Arc::new(MemoryDriver::default()),
        epoch,
        start: tokio::time::Instant::now(),
        sent: Mutex::default(),
    });
    let doomed_tick = Tick::parse("2026-01-01T00:00:30Z").unwrap();
    let doomed_store = Arc::new(DiesOn {
        inner: store.clone(),
        key: schedule.tick_key(&doomed_tick).unwrap(),
    });
    let build = |claims: Arc<dyn ClaimStore>| {
        Scheduler::builder(Producer::new(driver.clone()), claims)
            .schedule(schedule.clone())
            .epoch(epoch)
            .build()
            .unwrap()
    };
    // The doomed scheduler starts first so that it wins the races.
    let doomed = build(doomed_store).spawn();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let survivor = build(store.clone()).spawn();
    tokio::time::sleep(Duration::from_secs(45)).await;
    doomed.abort();
    tokio::time::sleep(Duration::from_secs(55)).await;
    survivor.shutdown().await;
    let sent = driver.sent.lock().unwrap().clone();
    let labels: Vec<String> = sent.keys().cloned().collect();
    assert_eq!(
        labels,
        seconds("2026-01-01T00:00:01Z", 100),
        "no tick missed"
    );
    for (tick, times) in &sent {
        assert_eq!(times.len(), 1, "{tick} sent {} times", times.len());
    }
    let late = sent[&doomed_tick.rfc3339()][0]
        .duration_since(doomed_tick.time())
        .unwrap();
    let bound = schedule.lease() + jobrail_native::DEFAULT_POLL;
    assert!(
        late >= schedule.lease() - Duration::from_secs(1) && late <= bound,
        "taken over {late:?} after the tick (bound {bound:?})"
    );
    assert_eq!(
        store
            .state(&schedule.tick_key(&doomed_tick).unwrap())
            .await
            .unwrap(),
        ClaimState::Done
    );
}

#[tokio::test(start_paused = true)]
async fn missed_ticks_after_a_downtime_follow_the_policy() {
    for (missed, expected) in [
        (Missed::Skip, vec![]),
        (Missed::Latest, vec!["2026-01-01T00:10:00Z".to_string()]),
        (
            Missed::Each(3),
            vec![
                "2026-01-01T00:08:00Z".to_string(),
                "2026-01-01T00:09:00Z".to_string(),
                "2026-01-01T00:10:00Z".to_string(),
            ],
        ),
    ] {
        let driver = Arc::new(MemoryDriver::default());
        let store = claims();
        let schedule = Schedule::builder("minutely", &job(), "0 * * * * *")
            .missed(missed)
            .build()
            .unwrap();
        let epoch = at("2026-01-01T00:00:30Z");
        let start = tokio::time::Instant::now();
        let scheduler = |epoch: SystemTime| {
            Scheduler::builder(Producer::new(driver.clone()), store.clone())
                .schedule(schedule.clone())
                .epoch(epoch)
                .build()
                .unwrap()
        };
        let first = scheduler(epoch).spawn();
        tokio::time::sleep(Duration::from_secs(120)).await;
        first.shutdown().await;
        assert_eq!(
            drain(&driver, "ticks").await,
            ["2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"]
        );
        // Down until 00:10:30; then one scheduler comes back.
        tokio::time::sleep(Duration::from_secs(480)).await;
        let back_at = epoch + (tokio::time::Instant::now() - start);
        assert_eq!(back_at, at("2026-01-01T00:10:30Z"));
        let back = scheduler(back_at).spawn();
        tokio::time::sleep(Duration::from_secs(10)).await;
        back.shutdown().await;
        assert_eq!(drain(&driver, "ticks").await, expected, "{missed:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn overlap_skip_never_runs_two_ticks_jobs_at_once() {
    let driver = Arc::new(MemoryDriver::default());
    let store = claims();
    let job = job();
    let schedule = Schedule::builder("slow", &job, "* * * * * *")
        .overlap(Overlap::Skip)
        .build()
        .unwrap();
    let scheduler = Scheduler::builder(Producer::new(driver.clone()), store.clone())
        .schedule(schedule.clone())
        .epoch(at("2026-01-01T00:00:00Z") + Duration::from_millis(500))
        .build()
        .unwrap();
    let guard = scheduler.overlap_guard();
    let active = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let mut registry = Registry::new();
    {
        let (active, most, runs) = (active.clone(), most.clone(), runs.clone());
        registry
            .register(&job, move |_ctx: JobContext, ()| {
                let (active, most, runs) = (active.clone(), most.clone(), runs.clone());
                async move {
                    let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    active.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .unwrap();
    }
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(4)
        .overlap_guard(guard)
        .build()
        .spawn();
    let scheduler = scheduler.spawn();
    tokio::time::sleep(Duration::from_secs(30)).await;
    scheduler.shutdown().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(most.load(Ordering::SeqCst), 1, "never two at once");
    let runs = runs.load(Ordering::SeqCst);
    // 30 ticks; each run takes 2.5 s, so about one tick in three runs.
    assert!((8..=12).contains(&runs), "{runs} runs");
    assert_eq!(driver.depth("ticks"), 0, "the skipped ones were settled");
    assert_eq!(
        store.state(&schedule.running_key()).await.unwrap(),
        ClaimState::Free,
        "released after the last run"
    );
}
