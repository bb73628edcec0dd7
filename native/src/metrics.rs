//! Metrics the native consumer adds to the rules' own: queue depths
//! ([`describe_metrics`], [`ConsumerBuilder::queue_depth_every`]).
//!
//! The rules (`jobrail`) record deliveries, outcomes, executions, tier
//! resolutions, handler and settlement latencies and breaker states where
//! each is decided. How many messages wait in a queue is known only to the
//! backend, so the consumer asks it at an interval, through the driver's
//! [`Admin::depth`](crate::Admin::depth), and only when the driver has one
//! ([`Driver::admin`]) and the application asked for it: each poll is a
//! request to the backend, which a worker should not make unasked.
//!
//! [`ConsumerBuilder::queue_depth_every`]: crate::ConsumerBuilder::queue_depth_every

use std::sync::Arc;
use std::time::Duration;

use ::metrics::{describe_counter, describe_gauge, gauge, Unit};
use tracing::warn;

use crate::driver::Driver;
use crate::failures::QueueDepth;

/// The gauge of a queue's depth.
pub(crate) const QUEUE_DEPTH: &str = "jobrail_queue_depth";

/// Schedule ticks acted on by this worker, by schedule and outcome.
pub(crate) const SCHEDULE_TICKS: &str = "jobrail_schedule_ticks_total";

/// How long the last poll, made when a consumer stops, may take.
const LAST_POLL_BUDGET: Duration = Duration::from_secs(5);

/// Registers the name, unit and meaning of every metric a native worker
/// records with the installed recorder: the rules' metrics
/// ([`jobrail::describe_metrics`], whose table lists them) and the one the
/// consumer adds:
///
/// | name | type | labels | meaning |
/// |---|---|---|---|
/// | `jobrail_queue_depth` | gauge | `queue`, `state` | Messages in a queue as the backend last reported them, by `state`: `ready` (deliverable now), `in_flight` (delivered, not yet settled) and `delayed` (waiting out a delay), each only where the backend reports it. Polled by a consumer built with [`queue_depth_every`](crate::ConsumerBuilder::queue_depth_every) on a driver with [`Driver::admin`], and once more when it stops. |
///
/// | `jobrail_schedule_ticks_total` | counter | `schedule`, `outcome` | Ticks this worker's [`Scheduler`](crate::Scheduler) or [`OverlapGuard`](crate::OverlapGuard) acted on, by `outcome`: `fired`, `taken_over` (fired after another scheduler's claim ended), `fired_unrecorded`, `skipped_first_seen`, `send_failed`, `payload_failed`, `store_error`, `given_up`, `overlap_skipped`. |
///
/// Call it once after installing a recorder; recording works without it.
pub fn describe_metrics() {
    jobrail::describe_metrics();
    describe_gauge!(
        QUEUE_DEPTH,
        Unit::Count,
        "Messages in a queue as the backend last reported them, by state (ready, in_flight, delayed)."
    );
    describe_counter!(
        SCHEDULE_TICKS,
        Unit::Count,
        "Schedule ticks this worker acted on, by schedule and outcome."
    );
}

/// Records `queue`'s depth.
fn record(queue: &str, depth: QueueDepth) {
    let states = [
        ("ready", Some(depth.ready)),
        ("in_flight", depth.in_flight),
        ("delayed", depth.delayed),
    ];
    for (state, value) in states {
        if let Some(value) = value {
            gauge!(QUEUE_DEPTH, "queue" => queue.to_string(), "state" => state).set(value as f64);
        }
    }
}

/// Asks the backend for each queue's depth once and records it; a failure
/// is logged and leaves that queue's gauges as they were.
async fn poll(driver: &Arc<dyn Driver>, queues: &[String]) {
    let Some(admin) = driver.admin() else {
        return;
    };
    for queue in queues {
        match admin.depth(queue).await {
            Ok(depth) => record(queue, depth),
            Err(e) => warn!(queue = %queue, "queue depth not read: {e}"),
        }
    }
}

/// The consumer's depth poller: polls at once, then every interval, until
/// [`DepthPoller::finish`].
pub(crate) struct DepthPoller {
    driver: Arc<dyn Driver>,
    queues: Arc<[String]>,
    task: tokio::task::JoinHandle<()>,
}

impl DepthPoller {
    /// Starts polling `queues` on `driver` every `every`; `None` when the
    /// driver reports no depths.
    pub(crate) fn start(
        driver: &Arc<dyn Driver>,
        queues: Vec<String>,
        every: Duration,
    ) -> Option<Self> {
        driver.admin()?;
        let queues: Arc<[String]> = queues.into();
        let task = tokio::spawn({
            let (driver, queues) = (driver.clone(), queues.clone());
            async move {
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    poll(&driver, &queues).await;
                }
            }
        });
        Some(DepthPoller {
            driver: driver.clone(),
            queues,
            task,
        })
    }

    /// Stops polling, then polls once more (within a few seconds), so the
    /// gauges show the queues as the consumer left them.
    pub(crate) async fn finish(self) {
        self.task.abort();
        let _ = self.task.await;
        if tokio::time::timeout(LAST_POLL_BUDGET, poll(&self.driver, &self.queues))
            .await
            .is_err()
        {
            warn!("the last queue depth poll did not finish within {LAST_POLL_BUDGET:?}");
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::Mutex;

    use ::metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
        Recorder, SharedString,
    };
    use jobrail::{
        BreakerConfig, CircuitBreaker, Envelope, Job, JobContext, JobError, Registry,
        UnknownNameAttempts, VirtualRuntime, UNREGISTERED_JOBS,
    };
    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::{Consumer, MemoryDriver, Producer};

    /// Every value recorded, keyed by name and sorted labels
    /// (`name{a=x,b=y}`): a counter's total, a gauge's last value, a
    /// histogram's number of samples.
    type Values = Arc<Mutex<BTreeMap<String, f64>>>;

    /// A recorder that keeps [`Values`] (nothing is reset by reading).
    #[derive(Default)]
    struct Recorded {
        values: Values,
    }

    impl Recorded {
        fn values(&self) -> BTreeMap<String, f64> {
            self.values.lock().unwrap().clone()
        }

        fn get(&self, name: &str) -> Option<f64> {
            self.values.lock().unwrap().get(name).copied()
        }

        fn handle(&self, key: &Key) -> Arc<Value> {
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            Arc::new(Value {
                name: format!("{}{{{}}}", key.name(), labels.join(",")),
                values: self.values.clone(),
            })
        }
    }

    struct Value {
        name: String,
        values: Values,
    }

    impl Value {
        fn update(&self, f: impl FnOnce(&mut f64)) {
            f(self
                .values
                .lock()
                .unwrap()
                .entry(self.name.clone())
                .or_default());
        }
    }

    impl CounterFn for Value {
        fn increment(&self, value: u64) {
            self.update(|v| *v += value as f64);
        }
        fn absolute(&self, value: u64) {
            self.update(|v| *v = value as f64);
        }
    }

    impl GaugeFn for Value {
        fn increment(&self, value: f64) {
            self.update(|v| *v += value);
        }
        fn decrement(&self, value: f64) {
            self.update(|v| *v -= value);
        }
        fn set(&self, value: f64) {
            self.update(|v| *v = value);
        }
    }

    impl HistogramFn for Value {
        fn record(&self, _value: f64) {
            self.update(|v| *v += 1.0);
        }
    }

    impl Recorder for Recorded {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.handle(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.handle(key))
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.handle(key))
        }
    }

    #[derive(Serialize, Deserialize)]
    struct Work {
        id: u64,
        /// Executions that fail before one succeeds (`u32::MAX`: never).
        failures: u32,
        permanent: bool,
    }

    const QUEUE: &str = "metered";
    const JOB: &str = "metered-work";

    /// A known sequence of deliveries on the memory driver gives exact
    /// counts: two tier-one executions per delivery, three deliveries.
    #[tokio::test(start_paused = true)]
    async fn a_known_run_records_exact_counts() {
        let recorder = Recorded::default();
        let _local = ::metrics::set_default_local_recorder(&recorder);

        let job = Job::<Work>::builder(JOB)
            .queue(QUEUE)
            .max_deliveries(3)
            .backoff(Duration::from_millis(10), 1.0, Duration::from_millis(10))
            .tier_one(2)
            .tier_one_backoff(Duration::from_millis(1), 1.0, Duration::from_millis(1))
            .build()
            .unwrap();
        let executed: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
        let mut registry = Registry::new();
        registry
            .unknown_name_attempts(UnknownNameAttempts::limited(2))
            .unknown_name_retry_delay(Duration::from_millis(10));
        let seen = executed.clone();
        registry
            .register(&job, move |_ctx: JobContext, work: Work| {
                let run = {
                    let mut seen = seen.lock().unwrap();
                    let n = seen.entry(work.id).or_default();
                    *n += 1;
                    *n
                };
                async move {
                    if work.permanent {
                        Err(JobError::permanent("refused"))
                    } else if run > work.failures {
                        Ok(())
                    } else {
                        Err(JobError::new("flaky"))
                    }
                }
            })
            .unwrap();

        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let works = [
            // First attempt.
            (1, 0, false),
            // Tier one: fails once, then succeeds in the same delivery.
            (2, 1, false),
            // Permanent on the first execution.
            (3, 0, true),
            // Always fails: 2 executions x 3 deliveries, then exhausted.
            (4, u32::MAX, false),
            // Tier two: fails both executions of delivery 1, then once more.
            (5, 3, false),
        ];
        for (id, failures, permanent) in works {
            let work = Work {
                id,
                failures,
                permanent,
            };
            producer.dispatch(&job).send(&work).await.unwrap();
        }
        let unknown = Envelope::new("nobody-handles-this", serde_json::json!({}));
        producer
            .send_raw(QUEUE, unknown.id.clone(), unknown.encode(), None)
            .await
            .unwrap();
        producer
            .send_raw(QUEUE, "raw".into(), b"not json".to_vec(), None)
            .await
            .unwrap();

        let consumer = Consumer::builder(driver.clone(), registry)
            .concurrency(4)
            .queue_depth_every(Duration::from_millis(50))
            .build()
            .spawn();
        let stats = consumer.registry().stats().clone();
        let terminal = |name: &str| {
            let s = stats.job(name);
            s.succeeded() + s.failed + s.rejected
        };
        for _ in 0..10_000 {
            if terminal(JOB) == 5 && terminal(UNREGISTERED_JOBS) == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        consumer.shutdown().await.unwrap();

        let got = recorder.values();
        let job = |rest: &str| format!("job={JOB},queue={QUEUE}{rest}");
        let other = |rest: &str| format!("job={UNREGISTERED_JOBS},queue={QUEUE}{rest}");
        let mut want: BTreeMap<String, f64> = BTreeMap::new();
        let mut put = |name: &str, labels: String, value: f64| {
            let mut labels: Vec<&str> = labels.split(',').collect();
            labels.sort();
            want.insert(format!("{name}{{{}}}", labels.join(",")), value);
        };
        put("jobrail_deliveries_total", job(""), 8.0);
        put("jobrail_deliveries_total", other(""), 3.0);
        put("jobrail_outcomes_total", job(",outcome=succeeded"), 3.0);
        put("jobrail_outcomes_total", job(",outcome=retried"), 3.0);
        put("jobrail_outcomes_total", job(",outcome=failed"), 2.0);
        put("jobrail_outcomes_total", other(",outcome=retried"), 1.0);
        put("jobrail_outcomes_total", other(",outcome=failed"), 2.0);
        put("jobrail_failures_total", job(",kind=permanent"), 1.0);
        put(
            "jobrail_failures_total",
            job(",kind=attempts_exhausted"),
            1.0,
        );
        put("jobrail_failures_total", other(",kind=unknown_name"), 1.0);
        put(
            "jobrail_failures_total",
            other(",kind=malformed_envelope"),
            1.0,
        );
        put("jobrail_resolutions_total", job(",tier=first_attempt"), 1.0);
        put("jobrail_resolutions_total", job(",tier=tier_one"), 1.0);
        put("jobrail_resolutions_total", job(",tier=tier_two"), 1.0);
        put("jobrail_executions_total", job(",result=ok"), 3.0);
        put("jobrail_executions_total", job(",result=error"), 11.0);
        put("jobrail_handler_duration_seconds", job(",result=ok"), 3.0);
        put(
            "jobrail_handler_duration_seconds",
            job(",result=error"),
            11.0,
        );
        put(
            "jobrail_settlement_duration_seconds",
            job(",settlement=ack"),
            3.0,
        );
        put(
            "jobrail_settlement_duration_seconds",
            job(",settlement=retry"),
            3.0,
        );
        put(
            "jobrail_settlement_duration_seconds",
            job(",settlement=fail"),
            2.0,
        );
        put(
            "jobrail_settlement_duration_seconds",
            other(",settlement=retry"),
            1.0,
        );
        put(
            "jobrail_settlement_duration_seconds",
            other(",settlement=fail"),
            2.0,
        );
        for state in ["ready", "in_flight", "delayed"] {
            put(
                "jobrail_queue_depth",
                format!("queue={QUEUE},state={state}"),
                0.0,
            );
        }
        assert_eq!(got, want);
        assert_eq!(executed.lock().unwrap().values().sum::<u32>(), 14);
    }

    /// The depth gauge reads what the backend holds when the consumer
    /// stops, and nothing is polled unless asked for.
    #[tokio::test(start_paused = true)]
    async fn depth_is_polled_only_when_asked() {
        let recorder = Recorded::default();
        let _local = ::metrics::set_default_local_recorder(&recorder);
        let job = Job::<Work>::builder(JOB).queue("waiting").build().unwrap();
        let other = Job::<Work>::builder("elsewhere")
            .queue("consumed")
            .build()
            .unwrap();
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        for id in 0..3 {
            let work = Work {
                id,
                failures: 0,
                permanent: false,
            };
            producer.dispatch(&job).send(&work).await.unwrap();
        }
        let registry = |depth: Option<Duration>| {
            let mut registry = Registry::new();
            registry
                .register(&other, |_ctx: JobContext, _work: Work| async { Ok(()) })
                .unwrap();
            let builder = Consumer::builder(driver.clone(), registry);
            match depth {
                Some(every) => builder.queue_depth_every(every),
                None => builder,
            }
        };
        // The consumer polls its own queues: `waiting` is not one of them.
        registry(Some(Duration::from_secs(1)))
            .build()
            .spawn()
            .shutdown()
            .await
            .unwrap();
        let got = recorder.values();
        assert_eq!(
            got.get("jobrail_queue_depth{queue=consumed,state=ready}"),
            Some(&0.0)
        );
        assert!(!got.keys().any(|k| k.contains("queue=waiting")), "{got:?}");

        let mut registry = Registry::new();
        registry
            .register(&job, |_ctx: JobContext, _work: Work| async { Ok(()) })
            .unwrap();
        let recorder = Recorded::default();
        let _local = ::metrics::set_default_local_recorder(&recorder);
        // Not asked: no depth, although the driver reports one.
        let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
        while driver.depth("waiting") > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        consumer.shutdown().await.unwrap();
        let got = recorder.values();
        assert!(!got.keys().any(|k| k.starts_with(QUEUE_DEPTH)), "{got:?}");
        assert_eq!(
            got.get("jobrail_deliveries_total{job=metered-work,queue=waiting}"),
            Some(&3.0)
        );
    }

    /// A breaker's gauge follows its state; each change is counted once.
    #[test]
    fn breaker_state_is_a_gauge() {
        let recorder = Recorded::default();
        let _local = ::metrics::set_default_local_recorder(&recorder);
        let clock = VirtualRuntime::new();
        let config = BreakerConfig {
            failure_threshold: 2,
            cool_down: Duration::from_secs(10),
        };
        let breaker =
            CircuitBreaker::with_clock("mail-api", config, Arc::new(clock.clone())).unwrap();
        let state = |recorder: &Recorded| recorder.get("jobrail_breaker_state{breaker=mail-api}");
        assert_eq!(state(&recorder), Some(0.0));
        breaker.record_failure();
        assert_eq!(state(&recorder), Some(0.0), "one failure of two");
        breaker.record_failure();
        assert_eq!(state(&recorder), Some(1.0));
        breaker.record_failure();
        assert!(breaker.acquire().is_err());
        clock.advance(Duration::from_secs(10));
        breaker.acquire().unwrap();
        assert_eq!(state(&recorder), Some(2.0));
        breaker.record_failure();
        assert_eq!(state(&recorder), Some(1.0), "a failed probe reopens");
        clock.advance(Duration::from_secs(10));
        breaker.acquire().unwrap();
        breaker.record_success();
        breaker.record_success();
        assert_eq!(state(&recorder), Some(0.0));
        let got = recorder.values();
        let transitions = |to: &str| {
            got.get(&format!(
                "jobrail_breaker_transitions_total{{breaker=mail-api,to={to}}}"
            ))
            .copied()
        };
        assert_eq!(transitions("open"), Some(2.0));
        assert_eq!(transitions("half_open"), Some(2.0));
        assert_eq!(transitions("closed"), Some(1.0));
    }
}
