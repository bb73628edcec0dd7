//! The test queue (`jobrail::testing::TestQueue`) against the rules it
//! claims to follow, on generated policies and failure patterns: a message's
//! deliveries count from 1, a retry waits the backoff before the next
//! delivery (the clock reads the sum), a success ends it with the tier that
//! resolved it, the cap ends it with a failure record, and shared state
//! reaches every handler.
#![cfg(not(target_arch = "wasm32"))]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jobrail::testing::{MessageState, TestQueue};
use jobrail::{Backoff, FailureKind, Job, JobContext, JobError, Registry, Resolution, Settlement};
use proptest::prelude::*;

#[derive(serde::Serialize, serde::Deserialize)]
struct Work {
    /// The delivery on which the handler first succeeds.
    succeeds_on: u32,
}

/// Executions so far, shared through the registry's state.
#[derive(Default)]
struct Executions(AtomicU32);

fn declared(cap: Option<u32>, initial_ms: u64, multiplier: f64, max_ms: u64) -> Job<Work> {
    Job::<Work>::builder("work")
        .delivery_cap(cap)
        .backoff(
            Duration::from_millis(initial_ms),
            multiplier,
            Duration::from_millis(max_ms),
        )
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn deliveries_delays_and_outcomes_follow_the_policy(
        cap in proptest::option::of(1u32..7),
        succeeds_on in 1u32..9,
        initial_ms in 0u64..5_000,
        multiplier in 1.0f64..3.0,
        max_ms in 5_000u64..60_000,
    ) {
        let job = declared(cap, initial_ms, multiplier, max_ms);
        let mut registry = Registry::new();
        registry
            .register(&job, |ctx: JobContext, work: Work| async move {
                if ctx.attempt() < work.succeeds_on {
                    return Err(JobError::new("not yet"));
                }
                Ok(())
            })
            .unwrap();
        let mut queue = TestQueue::new(registry);
        let id = queue.send(&job, &Work { succeeds_on });
        queue.run_until_idle();
        let report = queue.message(&id);

        let last = match cap {
            Some(cap) => succeeds_on.min(cap),
            None => succeeds_on,
        };
        prop_assert_eq!(report.attempts(), (1..=last).collect::<Vec<_>>());
        prop_assert_eq!(
            report.deliveries.iter().map(|d| d.attempt).collect::<Vec<_>>(),
            (1..=last).collect::<Vec<_>>(),
            "each delivery reports the attempt it was delivered with"
        );
        prop_assert_eq!(report.executions(), last);
        let backoff = Backoff::exponential(
            Duration::from_millis(initial_ms),
            multiplier,
            Duration::from_millis(max_ms),
        );
        // A retry after delivery k asks for the delay before delivery k + 1.
        let delays: Vec<Option<Duration>> = (2..=last).map(|k| Some(backoff.delay(k))).collect();
        prop_assert_eq!(report.retry_delays(), delays.clone());
        let waited: Duration = delays.iter().flatten().sum();
        prop_assert_eq!(queue.now(), waited);
        for (delivery, next) in report.deliveries.iter().zip(report.deliveries.iter().skip(1)) {
            let Settlement::Retry { delay: Some(delay), .. } = delivery.settlement else {
                panic!("every delivery but the last is a retry: {delivery:?}");
            };
            prop_assert_eq!(next.delivered_at, delivery.settled_at + delay);
        }

        if succeeds_on <= last {
            prop_assert_eq!(&report.state, &MessageState::Acked);
            let resolution = if succeeds_on == 1 {
                Resolution::FirstAttempt
            } else {
                Resolution::TierTwo { delivery: succeeds_on, of: cap.unwrap_or(0), in_process: 1 }
            };
            prop_assert_eq!(report.resolution(), Some(resolution));
            prop_assert!(queue.failure_records().is_empty());
        } else {
            prop_assert_eq!(&report.state, &MessageState::Failed);
            prop_assert_eq!(report.resolution(), None);
            let record = report.failure_record().expect("a failure at the cap has a record");
            prop_assert_eq!(record.kind, FailureKind::AttemptsExhausted);
            prop_assert_eq!(record.attempt, last);
            prop_assert_eq!(queue.failure_records(), std::slice::from_ref(record));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Tier one inside tier two, with the count kept in the registry's
    /// state: each delivery runs up to `tier_one` executions, so the
    /// success on execution `n` comes in delivery `ceil(n / tier_one)`, at
    /// in-process attempt `n - (delivery - 1) * tier_one`; past the cap the
    /// message fails after `cap * tier_one` executions.
    #[test]
    fn tier_one_inside_the_cap(
        cap in proptest::option::of(1u32..5),
        tier_one in 1u32..4,
        succeeds_on_execution in 1u32..12,
    ) {
        let job = Job::<u32>::builder("work")
            .delivery_cap(cap)
            .backoff(Duration::from_secs(1), 1.0, Duration::from_secs(1))
            .tier_one(tier_one)
            .tier_one_backoff(Duration::ZERO, 1.0, Duration::ZERO)
            .build()
            .unwrap();
        let mut registry = Registry::new();
        registry.state(Executions::default());
        registry
            .register(&job, |ctx: JobContext, succeeds_on: u32| async move {
                let n = ctx.state::<Executions>()?.0.fetch_add(1, Ordering::SeqCst) + 1;
                if n < succeeds_on {
                    return Err(JobError::new("not yet"));
                }
                Ok(())
            })
            .unwrap();
        let mut queue = TestQueue::new(registry);
        let id = queue.send(&job, &succeeds_on_execution);
        queue.run_until_idle();
        let report = queue.message(&id);

        let delivery = succeeds_on_execution.div_ceil(tier_one);
        let in_process = succeeds_on_execution - (delivery - 1) * tier_one;
        let executions = queue.registry().state_of::<Executions>().unwrap().0.load(Ordering::SeqCst);
        prop_assert_eq!(report.executions(), executions);
        match cap {
            Some(cap) if delivery > cap => {
                prop_assert_eq!(&report.state, &MessageState::Failed);
                prop_assert_eq!(report.attempts().len() as u32, cap);
                prop_assert_eq!(executions, cap * tier_one);
                prop_assert_eq!(
                    report.failure_record().map(|r| r.kind),
                    Some(FailureKind::AttemptsExhausted)
                );
            }
            _ => {
                prop_assert_eq!(&report.state, &MessageState::Acked);
                prop_assert_eq!(report.attempts().len() as u32, delivery);
                prop_assert_eq!(executions, succeeds_on_execution);
                let expected = if delivery > 1 {
                    Resolution::TierTwo { delivery, of: cap.unwrap_or(0), in_process }
                } else if in_process > 1 {
                    Resolution::TierOne { attempt: in_process, of: tier_one }
                } else {
                    Resolution::FirstAttempt
                };
                prop_assert_eq!(report.resolution(), Some(expected));
            }
        }
    }
}

/// Messages are delivered in the order they become visible: a delayed send
/// waits for its time, and a retry goes behind what became visible first.
#[test]
fn deliveries_follow_visibility_then_send_order() {
    let job = declared(Some(2), 10_000, 1.0, 10_000);
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = Registry::new();
    let seen = order.clone();
    registry
        .register(&job, move |ctx: JobContext, work: Work| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((work.succeeds_on, ctx.attempt()));
                if ctx.attempt() < work.succeeds_on {
                    return Err(JobError::new("not yet"));
                }
                Ok(())
            }
        })
        .unwrap();
    let mut queue = TestQueue::new(registry);
    queue.send(&job, &Work { succeeds_on: 2 }); // retried 10 s later
    queue.send_after(&job, &Work { succeeds_on: 1 }, Duration::from_secs(5));
    queue.send_after(&job, &Work { succeeds_on: 1 }, Duration::from_secs(20));
    assert_eq!(queue.run_until_idle(), 4);
    assert_eq!(*order.lock().unwrap(), [(2, 1), (1, 1), (2, 2), (1, 1)]);
    assert_eq!(queue.now(), Duration::from_secs(20));
    assert_eq!(queue.pending(), 0);
}

/// A body no handler can run is settled by the rules as on any backend: not
/// an envelope, a failure record at once; an unknown name, retried after
/// the unknown-name delay.
#[test]
fn bodies_no_handler_can_run() {
    let mut registry = Registry::new();
    registry.unknown_name_retry_delay(Duration::from_secs(60));
    let mut queue = TestQueue::new(registry);
    let garbage = queue.send_raw("default", "not json");
    queue.run_next();
    assert_eq!(queue.state(&garbage), &MessageState::Failed);
    assert_eq!(
        queue.message(&garbage).failure_record().unwrap().kind,
        FailureKind::MalformedEnvelope
    );
    let stranger = Job::<u32>::builder("stranger").uncapped().build().unwrap();
    let unknown = queue.send(&stranger, &1);
    queue.run_next();
    assert_eq!(
        queue.message(&unknown).retry_delays(),
        [Some(Duration::from_secs(60))]
    );
    assert_eq!(queue.state(&unknown), &MessageState::Pending);
}

/// State given once to the registry reaches every handler by type; a type
/// it was not given is an ordinary error, retried by the policy.
#[test]
fn handlers_read_the_registry_state_by_type() {
    struct Calls(AtomicU32);
    let counted = Job::<u32>::builder("counted")
        .max_deliveries(1)
        .build()
        .unwrap();
    let missing = Job::<u32>::builder("missing")
        .max_deliveries(2)
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .state(Calls(AtomicU32::new(0)))
        .state(String::from("eu-west"));
    registry
        .register(&counted, |ctx: JobContext, _: u32| async move {
            assert_eq!(ctx.state::<String>()?, "eu-west");
            ctx.state::<Calls>()?.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
    registry
        .register(&missing, |ctx: JobContext, _: u32| async move {
            ctx.state::<u64>()?;
            Ok(())
        })
        .unwrap();
    let mut queue = TestQueue::new(registry);
    for n in 0..3 {
        queue.send(&counted, &n);
    }
    let failing = queue.send(&missing, &0);
    queue.run_until_idle();
    let calls = queue.registry().state_of::<Calls>().unwrap();
    assert_eq!(calls.0.load(Ordering::SeqCst), 3);
    let report = queue.message(&failing);
    assert_eq!(report.attempts(), [1, 2], "retried by its policy");
    let record = report.failure_record().unwrap();
    assert!(
        record.reason.contains("no state of type `u64`"),
        "{}",
        record.reason
    );
}

/// A job whose cap was never chosen is named by the registry's warnings;
/// one that chose a cap, or chose none, is not.
#[test]
fn an_unchosen_cap_is_a_warning() {
    let mut registry = Registry::new();
    for job in [
        Job::<u32>::builder("forgot").build().unwrap(),
        Job::<u32>::builder("capped")
            .max_deliveries(4)
            .build()
            .unwrap(),
        Job::<u32>::builder("endless").uncapped().build().unwrap(),
    ] {
        registry
            .register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
    }
    let warnings = registry.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("`forgot`") && warnings[0].contains(".uncapped()"));
}
