//! Rules in combination: a marker inside the crate's own breaker, shutdown
//! on the last allowed delivery, a panic before a handler's future, a breaker
//! attached to a job, what the events of poison messages carry. Each test
//! was written from the specification and failed before its fix.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_executor::block_on;
use jobrail::{
    BreakerConfig, BreakerState, CancelToken, CircuitBreaker, Envelope, FailureKind, Incoming, Job,
    JobBuilder, JobContext, JobError, Outcome, Permanent, Processed, Registry, Reject, RetryAfter,
    Runtime, Settlement, VirtualRuntime,
};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const S: fn(u64) -> Duration = Duration::from_secs;

#[derive(serde::Serialize, serde::Deserialize)]
struct Work {
    id: u32,
}

fn body(id: u32) -> Vec<u8> {
    Envelope::new("work", serde_json::json!({ "id": id })).encode()
}

fn deliver(
    registry: &Registry,
    runtime: &VirtualRuntime,
    body: &[u8],
    attempt: u32,
    shutdown_returns: Option<u32>,
) -> Processed {
    let runtime: Arc<dyn Runtime> = Arc::new(runtime.clone());
    let delivery = Incoming {
        queue: "q",
        body,
        attempt,
        shutdown_returns,
        deadline: None,
    };
    let processed = block_on(registry.process(delivery, &runtime, &CancelToken::new()));
    registry.settled(&processed, Ok(()));
    processed
}

fn failure_kind(p: &Processed) -> Option<FailureKind> {
    match &p.settlement {
        Settlement::Fail(record) => Some(record.kind),
        _ => None,
    }
}

fn breaker(runtime: &VirtualRuntime, threshold: u32) -> CircuitBreaker {
    let config = BreakerConfig {
        failure_threshold: threshold,
        cool_down: S(60),
    };
    CircuitBreaker::with_clock("upstream", config, Arc::new(runtime.clone())).unwrap()
}

// --- 1. markers through the crate's own breaker ---------------------------

#[test]
fn a_permanent_marker_inside_the_breaker_is_permanent() {
    let runtime = VirtualRuntime::new();
    let b = breaker(&runtime, 5);
    let err =
        block_on(b.call(|| async { Err::<(), _>(Permanent::new("report deleted")) })).unwrap_err();
    assert_eq!(JobError::from(err).outcome(), Outcome::Permanent);

    let err = block_on(b.call(|| async { Err::<(), _>(RetryAfter::new("rate limited", S(9))) }))
        .unwrap_err();
    assert_eq!(JobError::from(err).outcome(), Outcome::RetryAfter(S(9)));
}

#[test]
fn a_handler_returning_the_breakers_permanent_error_fails_at_once() {
    let runtime = VirtualRuntime::new();
    let b = breaker(&runtime, 5);
    let job = Job::<Work>::builder("work")
        .max_deliveries(3)
        .tier_one(3)
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let mut registry = Registry::new();
    let (c, b2) = (calls.clone(), b.clone());
    registry
        .register(&job, move |_: JobContext, _: Work| {
            let (c, b) = (c.clone(), b2.clone());
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                b.call(|| async { Err::<(), _>(Permanent::new("gone")) })
                    .await?;
                Ok(())
            }
        })
        .unwrap();
    let p = deliver(&registry, &runtime, &body(1), 1, Some(0));
    assert_eq!(failure_kind(&p), Some(FailureKind::Permanent));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no tier-one retry");
}

/// The crate's JobError markers survive the breaker too: `JobError` converts
/// from `BreakerError<JobError>` keeping the inner outcome.
#[test]
fn a_job_error_inside_the_breaker_keeps_its_outcome() {
    let runtime = VirtualRuntime::new();
    let b = breaker(&runtime, 5);
    let err =
        block_on(b.call(|| async { Err::<(), _>(JobError::reject("bad input")) })).unwrap_err();
    assert_eq!(JobError::from(err).outcome(), Outcome::Reject);
}

/// Which marker wins when one wraps another: the outermost, the decision
/// made last, closest to the handler's return.
#[test]
fn the_outermost_marker_wins() {
    let inner = Permanent::new("not found yet");
    let err = JobError::from(RetryAfter::new(inner, S(5)));
    assert_eq!(err.outcome(), Outcome::RetryAfter(S(5)));
    let err = JobError::from(Permanent::new(RetryAfter::new("rate limited", S(5))));
    assert_eq!(err.outcome(), Outcome::Permanent);
    let err = JobError::from(Reject::new(Permanent::new("x")));
    assert_eq!(err.outcome(), Outcome::Reject);
}

#[cfg(not(target_arch = "wasm32"))]
mod wrapped_markers {
    use super::*;
    use proptest::prelude::*;
    use std::error::Error as StdError;
    use std::fmt;

    #[derive(Debug)]
    struct Wrapper(jobrail::BoxError);
    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("while building the report")
        }
    }
    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(self.0.as_ref())
        }
    }

    #[derive(Debug, Clone)]
    enum Layer {
        User,
        Io,
        Breaker,
    }

    fn wrap(err: jobrail::BoxError, layer: &Layer, b: &CircuitBreaker) -> jobrail::BoxError {
        match layer {
            Layer::User => Box::new(Wrapper(err)),
            Layer::Io => Box::new(std::io::Error::other(err)),
            Layer::Breaker => {
                let e = block_on(b.call(|| async { Err::<(), _>(Wrapper(err)) })).unwrap_err();
                Box::new(e)
            }
        }
    }

    proptest! {
        #[test]
        fn markers_are_found_through_any_chain_of_wrappers(
            marker in 0u8..3,
            delay in 0u64..100,
            layers in proptest::collection::vec(
                prop_oneof![Just(Layer::User), Just(Layer::Io), Just(Layer::Breaker)],
                0..6,
            ),
        ) {
            let runtime = VirtualRuntime::new();
            // A high threshold: the breaker stays closed and runs every call.
            let b = breaker(&runtime, 1_000);
            let (mut err, want): (jobrail::BoxError, Outcome) = match marker {
                0 => (Box::new(Permanent::new("gone")), Outcome::Permanent),
                1 => (Box::new(RetryAfter::new("slow down", Duration::from_millis(delay))), Outcome::RetryAfter(Duration::from_millis(delay))),
                _ => (Box::new(Reject::without_cause()), Outcome::Reject),
            };
            for layer in &layers {
                err = wrap(err, layer, &b);
            }
            prop_assert_eq!(JobError::new(err).outcome(), want, "layers {:?}", layers);
        }
    }
}

// --- 2. shutdown on the last allowed delivery -------------------------------

fn counting(builder: JobBuilder<Work>) -> (Registry, Arc<AtomicU32>) {
    let job = builder.build().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let mut registry = Registry::new();
    registry
        .register(&job, move |_: JobContext, _: Work| {
            c.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .unwrap();
    (registry, calls)
}

#[test]
fn a_redelivery_after_a_shutdown_on_the_last_delivery_still_runs() {
    let runtime = VirtualRuntime::new();
    let (registry, calls) = counting(Job::<Work>::builder("work").max_deliveries(3));
    // Delivery 3 of 3 was handed back by a graceful shutdown; the backend
    // counted it (delivery 4 now) and, where it can, says so.
    for shutdown_returns in [Some(1), None] {
        let p = deliver(&registry, &runtime, &body(1), 4, shutdown_returns);
        assert_eq!(p.settlement, Settlement::Ack, "{shutdown_returns:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn a_crash_loop_still_ends_within_the_documented_bound() {
    let runtime = VirtualRuntime::new();
    let (registry, calls) = counting(Job::<Work>::builder("work").max_deliveries(3));
    // The backend counts shutdowns and saw none: delivery 4 follows crashes.
    let p = deliver(&registry, &runtime, &body(1), 4, Some(0));
    assert_eq!(failure_kind(&p), Some(FailureKind::AttemptsExhausted));
    // Two shutdowns were counted: delivery 5 still runs, 6 does not.
    assert_eq!(
        deliver(&registry, &runtime, &body(1), 5, Some(2)).settlement,
        Settlement::Ack
    );
    let p = deliver(&registry, &runtime, &body(1), 6, Some(2));
    assert_eq!(failure_kind(&p), Some(FailureKind::AttemptsExhausted));
    // A backend that cannot count shutdowns: one delivery of grace, then the end.
    let p = deliver(&registry, &runtime, &body(1), 5, None);
    assert_eq!(failure_kind(&p), Some(FailureKind::AttemptsExhausted));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// --- 3. a panic before the handler's future ---------------------------------

#[cfg(panic = "unwind")]
#[test]
fn a_panic_before_the_future_is_an_ordinary_error() {
    let runtime = VirtualRuntime::new();
    let job = Job::<Work>::builder("work")
        .max_deliveries(3)
        .backoff(S(2), 2.0, S(10))
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, work: Work| {
            if work.id == 7 {
                panic!("bad report {}", work.id);
            }
            async { Ok(()) }
        })
        .unwrap();
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        deliver(&registry, &runtime, &body(7), 1, Some(0))
    }))
    .expect("the panic must not escape Registry::process");
    assert_eq!(
        p.settlement,
        Settlement::Retry {
            delay: Some(S(2)),
            shutdown: false
        }
    );
    match &p.event.kind {
        jobrail::EventKind::Retried { error, .. } => {
            assert!(error.contains("bad report 7"), "{error}")
        }
        other => panic!("expected a retry, got {other:?}"),
    }
    assert_eq!(p.executions(), 1);
}

#[cfg(panic = "unwind")]
#[test]
fn a_panicking_validation_hook_or_backoff_is_an_ordinary_error() {
    let runtime = VirtualRuntime::new();
    let job = Job::<Work>::builder("work")
        .max_deliveries(3)
        .backoff_fn(|attempt| {
            if attempt == 3 {
                panic!("backoff exploded");
            }
            S(1)
        })
        .validate(|w: &Work| {
            if w.id == 9 {
                panic!("validator exploded");
            }
            Ok(())
        })
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, _: Work| async {
            Err::<(), _>(JobError::new("down"))
        })
        .unwrap();
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        deliver(&registry, &runtime, &body(9), 1, Some(0))
    }))
    .expect("a validator panic must not escape");
    assert!(matches!(p.settlement, Settlement::Retry { .. }), "{p:?}");
    assert_eq!(p.executions(), 0);
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        deliver(&registry, &runtime, &body(1), 2, Some(0))
    }))
    .expect("a backoff panic must not escape");
    match p.settlement {
        Settlement::Retry { delay, .. } => assert!(
            delay.is_some_and(|d| d >= S(1)),
            "a fallback delay, never a hot loop: {delay:?}"
        ),
        other => panic!("expected a retry, got {other:?}"),
    }
}

// --- 4. an attached breaker counts the job's executions ---------------------

#[test]
fn an_attached_breaker_opens_on_the_jobs_failures() {
    let runtime = VirtualRuntime::new();
    let b = breaker(&runtime, 2);
    let job = Job::<Work>::builder("work")
        .max_deliveries(4)
        .tier_one(3)
        .breaker(b.clone())
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let mut registry = Registry::new();
    registry
        .register(&job, move |_: JobContext, _: Work| {
            c.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(JobError::new("upstream down")) }
        })
        .unwrap();
    let per_delivery: Vec<u32> = (1..=3)
        .map(|attempt| deliver(&registry, &runtime, &body(1), attempt, Some(0)).executions())
        .collect();
    assert_eq!(b.state(), BreakerState::Open);
    assert_eq!(
        per_delivery,
        [2, 1, 1],
        "open after two failures, then one per delivery"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[test]
fn a_breaker_the_handler_feeds_itself_is_only_read() {
    let runtime = VirtualRuntime::new();
    let b = breaker(&runtime, 2);
    let job = Job::<Work>::builder("work")
        .max_deliveries(4)
        .tier_one(3)
        .breaker_fed_by_handler(b.clone())
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, _: Work| async {
            Err::<(), _>(JobError::new("not the dependency"))
        })
        .unwrap();
    let p = deliver(&registry, &runtime, &body(1), 1, Some(0));
    assert_eq!(p.executions(), 3);
    assert_eq!(b.state(), BreakerState::Closed);
    b.record_failure();
    b.record_failure();
    let p = deliver(&registry, &runtime, &body(1), 2, Some(0));
    assert_eq!(p.executions(), 1, "an open breaker still skips tier one");
}

// --- 6. poison events carry what is known ----------------------------------

#[test]
fn poison_and_unknown_name_events_name_the_job_and_message() {
    let runtime = VirtualRuntime::new();
    let (mut registry, _) = counting(Job::<Work>::builder("work").max_deliveries(3));
    registry.unknown_name_attempts(jobrail::UnknownNameAttempts::limited(1));
    let cases: Vec<(Vec<u8>, &str, FailureKind)> = vec![
        (
            Envelope::new("work", serde_json::json!({ "id": "seven" })).encode(),
            "work",
            FailureKind::UndecodablePayload,
        ),
        (
            Envelope::new("nobody", serde_json::json!({ "id": 7 })).encode(),
            "nobody",
            FailureKind::UnknownName,
        ),
        (
            br#"{"v":1,"id":"m-1","job":"work","payload":{"id":1}}"#.to_vec(),
            "work",
            FailureKind::MalformedEnvelope,
        ),
        (
            br#"{"v":9,"id":"m-1","job":"work","payload":{"id":1},"dispatched_at_ms":0}"#.to_vec(),
            "work",
            FailureKind::MalformedEnvelope,
        ),
    ];
    for (body, job, kind) in cases {
        let p = deliver(&registry, &runtime, &body, 1, Some(0));
        assert_eq!(failure_kind(&p), Some(kind));
        assert_eq!(&*p.event.job, job, "{kind:?}");
        assert!(!p.event.message_id.is_empty(), "{kind:?}");
        let Settlement::Fail(record) = &p.settlement else {
            unreachable!()
        };
        assert_eq!(record.job.as_deref(), Some(job), "{kind:?}");
        assert_eq!(
            record.message_id.as_deref(),
            Some(p.event.message_id.as_str())
        );
    }
}
