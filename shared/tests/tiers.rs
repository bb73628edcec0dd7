//! Deterministic tests of the two retry tiers: a virtual clock, no sleeping.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_executor::block_on;
use jobrail::{
    BoxFuture, BreakerConfig, CancelToken, CircuitBreaker, Clock, Envelope, FailureKind, Incoming,
    Instant, Job, JobBuilder, JobContext, JobError, Processed, Registry, Resolution, Runtime,
    Settlement, VirtualRuntime,
};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const MS: fn(u64) -> Duration = Duration::from_millis;

#[derive(serde::Serialize, serde::Deserialize)]
struct Work {
    id: u32,
}

struct Setup {
    registry: Registry,
    runtime: VirtualRuntime,
    executions: Arc<AtomicU32>,
}

fn setup<F>(builder: JobBuilder<Work>, outcome: F) -> Setup
where
    F: Fn(&JobContext, u32) -> Result<(), JobError> + Send + Sync + 'static,
{
    let job = builder.build().unwrap();
    let executions = Arc::new(AtomicU32::new(0));
    let e = executions.clone();
    let mut registry = Registry::new();
    registry
        .register(&job, move |ctx: JobContext, _: Work| {
            let n = e.fetch_add(1, Ordering::SeqCst) + 1;
            let result = outcome(&ctx, n);
            async move { result }
        })
        .unwrap();
    Setup {
        registry,
        runtime: VirtualRuntime::new(),
        executions,
    }
}

fn body(id: u32) -> Vec<u8> {
    Envelope::new("work", serde_json::json!({ "id": id })).encode()
}

impl Setup {
    fn deliver(&self, body: &[u8], attempt: u32) -> Processed {
        self.deliver_with(
            body,
            attempt,
            Arc::new(self.runtime.clone()),
            &CancelToken::new(),
            None,
        )
    }

    fn deliver_with(
        &self,
        body: &[u8],
        attempt: u32,
        runtime: Arc<dyn Runtime>,
        cancel: &CancelToken,
        deadline: Option<Instant>,
    ) -> Processed {
        let delivery = Incoming {
            queue: "q",
            body,
            attempt,
            shutdown_returns: None,
            deadline,
        };
        let processed = block_on(self.registry.process(delivery, &runtime, cancel));
        self.registry.settled(&processed, Ok(()));
        processed
    }

    fn executions(&self) -> u32 {
        self.executions.load(Ordering::SeqCst)
    }
}

fn three_by_three() -> JobBuilder<Work> {
    Job::<Work>::builder("work")
        .max_deliveries(3)
        .tier_one(3)
        .tier_one_backoff(MS(100), 2.0, MS(1000))
}

#[test]
fn always_failing_costs_n_times_m_executions() {
    let s = setup(three_by_three(), |_, _| Err(JobError::new("down")));
    let body = body(1);
    for attempt in 1..=2 {
        let p = s.deliver(&body, attempt);
        assert_eq!(
            p.settlement,
            Settlement::Retry {
                delay: None,
                shutdown: false
            }
        );
        assert_eq!(p.executions(), 3);
    }
    let p = s.deliver(&body, 3);
    assert!(
        matches!(&p.settlement, Settlement::Fail(record) if record.kind == FailureKind::AttemptsExhausted)
    );
    assert_eq!(s.executions(), 9);
    assert_eq!(
        s.runtime.sleeps(),
        [MS(100), MS(200)].repeat(3),
        "tier-one backoff between in-process attempts"
    );
    let stats = s.registry.stats().job("work");
    assert_eq!((stats.executions, stats.retried, stats.failed), (9, 2, 1));
    let Settlement::Fail(record) = &p.settlement else {
        panic!("expected a terminal failure, got {:?}", p.settlement)
    };
    assert_eq!((record.attempt, record.executions), (3, 3));
}

#[test]
fn success_on_in_process_attempt_two_is_tier_one() {
    let s = setup(three_by_three(), |ctx, _| {
        if ctx.in_process_attempt() == 1 {
            Err(JobError::new("blip"))
        } else {
            Ok(())
        }
    });
    let p = s.deliver(&body(1), 1);
    assert_eq!(p.settlement, Settlement::Ack);
    assert_eq!(s.executions(), 2);
    assert_eq!(
        p.event.kind,
        jobrail::EventKind::Succeeded {
            resolution: Resolution::TierOne { attempt: 2, of: 3 }
        }
    );
    let stats = s.registry.stats().job("work");
    assert_eq!(
        (stats.first_attempt, stats.tier_one, stats.tier_two),
        (0, 1, 0)
    );
}

#[test]
fn success_on_a_redelivery_is_tier_two() {
    let s = setup(three_by_three(), |ctx, _| {
        if ctx.attempt() < 2 {
            Err("x".into())
        } else {
            Ok(())
        }
    });
    s.deliver(&body(1), 1);
    let p = s.deliver(&body(1), 2);
    assert_eq!(
        p.event.kind,
        jobrail::EventKind::Succeeded {
            resolution: Resolution::TierTwo {
                delivery: 2,
                of: 3,
                in_process: 1
            }
        }
    );
    assert_eq!(s.registry.stats().job("work").tier_two, 1);
}

#[test]
fn open_breaker_makes_it_three_executions() {
    let runtime = VirtualRuntime::new();
    let breaker = CircuitBreaker::with_clock(
        "upstream",
        BreakerConfig {
            failure_threshold: 1,
            cool_down: Duration::from_secs(600),
        },
        Arc::new(runtime.clone()),
    )
    .unwrap();
    let job = three_by_three().breaker(breaker.clone()).build().unwrap();
    let upstream = Arc::new(AtomicU32::new(0));
    let executions = Arc::new(AtomicU32::new(0));
    let mut registry = Registry::new();
    let (u, e, b) = (upstream.clone(), executions.clone(), breaker.clone());
    registry
        .register(&job, move |_: JobContext, _: Work| {
            let (u, e, b) = (u.clone(), e.clone(), b.clone());
            async move {
                e.fetch_add(1, Ordering::SeqCst);
                b.call(|| async {
                    u.fetch_add(1, Ordering::SeqCst);
                    Err::<(), _>(std::io::Error::other("503"))
                })
                .await?;
                Ok(())
            }
        })
        .unwrap();
    let rt: Arc<dyn Runtime> = Arc::new(runtime.clone());
    let body = body(1);
    let mut last = None;
    for attempt in 1..=3 {
        let delivery = Incoming {
            queue: "q",
            body: &body,
            attempt,
            shutdown_returns: None,
            deadline: None,
        };
        last = Some(block_on(registry.process(
            delivery,
            &rt,
            &CancelToken::new(),
        )));
    }
    assert_eq!(
        executions.load(Ordering::SeqCst),
        3,
        "tier one skipped while the breaker is open"
    );
    assert_eq!(
        upstream.load(Ordering::SeqCst),
        1,
        "an open breaker does not run the operation"
    );
    assert!(
        matches!(&last.unwrap().settlement, Settlement::Fail(record) if record.kind == FailureKind::AttemptsExhausted)
    );
    assert!(runtime.sleeps().is_empty(), "no tier-one waits");
}

#[test]
fn validation_failure_costs_no_execution() {
    let builder = three_by_three().validate(|w: &Work| {
        if w.id == 0 {
            Err("id must be positive".into())
        } else {
            Ok(())
        }
    });
    let s = setup(builder, |_, _| Ok(()));
    let p = s.deliver(&body(0), 1);
    assert!(
        matches!(&p.settlement, Settlement::Fail(record) if record.kind == FailureKind::InvalidPayload)
    );
    assert_eq!(s.executions(), 0);
    assert_eq!(s.deliver(&body(1), 1).settlement, Settlement::Ack);
    assert_eq!(s.executions(), 1);
}

/// A runtime whose sleeps never finish, and which starts shutdown when one begins.
struct ShutdownDuringSleep {
    clock: VirtualRuntime,
    cancel: CancelToken,
}

impl Clock for ShutdownDuringSleep {
    fn now(&self) -> Instant {
        self.clock.now()
    }
}

impl Runtime for ShutdownDuringSleep {
    fn sleep(&self, _: Duration) -> BoxFuture<'static, ()> {
        self.cancel.cancel();
        Box::pin(std::future::pending())
    }
}

#[test]
fn shutdown_during_tier_one_backoff_is_a_zero_delay_retry() {
    let s = setup(three_by_three().max_deliveries(1), |_, _| {
        Err(JobError::new("blip"))
    });
    let cancel = CancelToken::new();
    let runtime = Arc::new(ShutdownDuringSleep {
        clock: VirtualRuntime::new(),
        cancel: cancel.clone(),
    });
    let p = s.deliver_with(&body(1), 1, runtime, &cancel, None);
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(Duration::ZERO),
            shutdown: true,
        },
        "cap of 1 skipped"
    );
    assert_eq!(s.executions(), 1);
}

#[test]
fn permanent_and_reject_skip_tier_one() {
    let s = setup(three_by_three(), |_, n| {
        if n == 1 {
            Err(JobError::permanent("no"))
        } else {
            Err(JobError::reject("no"))
        }
    });
    assert!(matches!(
        s.deliver(&body(1), 1).settlement,
        Settlement::Fail { .. }
    ));
    assert_eq!(s.deliver(&body(1), 1).settlement, Settlement::Reject);
    assert_eq!(s.executions(), 2);
}

#[test]
fn short_retry_after_stays_in_tier_one_long_goes_to_tier_two() {
    let builder = three_by_three().tier_one_max_wait(MS(500));
    let s = setup(builder, |ctx, _| match ctx.in_process_attempt() {
        1 => Err(JobError::retry_after("slow down", MS(300))),
        _ => Err(JobError::retry_after(
            "come back later",
            Duration::from_secs(60),
        )),
    });
    let p = s.deliver(&body(1), 1);
    assert_eq!(s.executions(), 2);
    assert_eq!(s.runtime.sleeps(), [MS(300)]);
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(Duration::from_secs(60)),
            shutdown: false,
        }
    );
}

#[test]
fn tier_one_never_sleeps_past_the_delivery_deadline() {
    let s = setup(three_by_three(), |_, _| Err(JobError::new("down")));
    let runtime: Arc<dyn Runtime> = Arc::new(s.runtime.clone());
    let deadline = s.runtime.now() + MS(150);
    let p = s.deliver_with(&body(1), 1, runtime, &CancelToken::new(), Some(deadline));
    assert_eq!(
        s.executions(),
        2,
        "100ms fits before the deadline, the next 200ms does not"
    );
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: None,
            shutdown: false
        }
    );
}

#[test]
fn each_execution_sees_its_own_timeout_capped_by_the_delivery_deadline() {
    let seen = Arc::new(std::sync::Mutex::new(vec![]));
    let sn = seen.clone();
    let builder = Job::<Work>::builder("work")
        .tier_one(2)
        .tier_one_backoff(MS(10), 1.0, MS(10))
        .timeout(MS(100));
    let s = setup(builder, move |ctx, _| {
        sn.lock().unwrap().push(ctx.remaining());
        Err("x".into())
    });
    let runtime: Arc<dyn Runtime> = Arc::new(s.runtime.clone());
    let deadline = s.runtime.now() + MS(50);
    s.deliver_with(
        &body(1),
        1,
        runtime.clone(),
        &CancelToken::new(),
        Some(deadline),
    );
    assert_eq!(seen.lock().unwrap()[0], Some(MS(50)));
    s.deliver_with(&body(1), 1, runtime, &CancelToken::new(), None);
    assert_eq!(seen.lock().unwrap()[2], Some(MS(100)));
}

#[test]
fn deferred_deliveries_retry_at_once_without_running() {
    let s = setup(three_by_three(), |_, _| Ok(()));
    let body = body(4);
    let p = s.registry.defer(
        Incoming {
            queue: "q",
            body: &body,
            attempt: 1,
            shutdown_returns: None,
            deadline: None,
        },
        "budget exhausted",
    );
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(Duration::ZERO),
            shutdown: true,
        }
    );
    assert_eq!(p.executions(), 0);
    assert_eq!(&*p.event.job, "work");
    assert!(matches!(
        p.event.kind,
        jobrail::EventKind::Retried { shutdown: true, .. }
    ));
    assert_eq!(s.executions(), 0);
}

#[test]
fn a_delivery_past_the_cap_fails_without_running() {
    // Deliveries 1..=4 each killed the worker before settling (4 is the one
    // delivery of grace a backend that cannot count graceful shutdowns
    // allows); the fifth arrives above the cap of 3.
    let s = setup(three_by_three(), |_, _| Ok(()));
    let p = s.deliver(&body(1), 5);
    assert!(
        matches!(&p.settlement, Settlement::Fail(record) if record.kind == FailureKind::AttemptsExhausted)
    );
    assert_eq!(s.executions(), 0);
    assert_eq!(
        s.deliver(&body(1), 3).settlement,
        Settlement::Ack,
        "the last allowed delivery still runs"
    );
}

#[test]
fn a_zero_backoff_retry_is_not_reported_as_shutdown() {
    let builder = Job::<Work>::builder("work")
        .max_deliveries(3)
        .backoff_fn(|_| Duration::ZERO);
    let s = setup(builder, |_, _| Err(JobError::new("x")));
    let p = s.deliver(&body(1), 1);
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(Duration::ZERO),
            shutdown: false,
        }
    );
    assert!(
        matches!(
            p.event.kind,
            jobrail::EventKind::Retried {
                shutdown: false,
                ..
            }
        ),
        "{:?}",
        p.event.kind
    );
}
