//! The one pipeline every host calls: settle, then report only what the
//! backend accepted; a settlement that never finishes ends at the budget on
//! the injected clock; a handed-back delivery is settled and reported alike.

use std::sync::{Arc, Mutex};

use futures_executor::block_on;
use jobrail::{
    CancelToken, Envelope, ErrorKind, Event, EventKind, EventSink, Job, JobContext, Registry,
    Runtime, Settlement, SettlementError, VirtualRuntime, SETTLEMENT_BUDGET,
};

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[path = "support/handle.rs"]
mod support;

use support::{Answer, Handle};

#[derive(Default)]
struct Sink {
    emitted: Mutex<Vec<Event>>,
    failed: Mutex<Vec<(Event, ErrorKind)>>,
}

impl EventSink for Sink {
    fn emit(&self, event: &Event) {
        self.emitted.lock().unwrap().push(event.clone());
    }
    fn settlement_failed(&self, event: &Event, error: &SettlementError) {
        self.failed
            .lock()
            .unwrap()
            .push((event.clone(), error.kind()));
    }
}

fn setup() -> (Registry, Arc<Sink>) {
    let job = Job::<u32>::builder("work")
        .max_deliveries(3)
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, _: u32| async { Ok(()) })
        .unwrap();
    let sink = Arc::new(Sink::default());
    registry.event_sink(sink.clone());
    (registry, sink)
}

fn handle(answer: Answer) -> (Handle, Arc<Mutex<Vec<Settlement>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let body = Envelope::new("work", serde_json::json!(7)).encode();
    (Handle::new(body, &seen).answering(answer), seen)
}

#[test]
fn only_accepted_settlements_are_reported() {
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let (registry, sink) = setup();
    let (h, seen) = handle(Answer::Accept);
    let delivered = block_on(registry.deliver("q", h, &runtime, &CancelToken::new()));
    assert!(delivered.outcome.is_ok());
    assert_eq!(*seen.lock().unwrap(), [Settlement::Ack]);
    assert_eq!(sink.emitted.lock().unwrap().len(), 1);
    assert_eq!(registry.stats().job("work").first_attempt, 1);

    let (h, _) = handle(Answer::Refuse);
    let delivered = block_on(registry.deliver("q", h, &runtime, &CancelToken::new()));
    assert_eq!(
        delivered.outcome.unwrap_err().kind(),
        ErrorKind::NotAccepted
    );
    assert_eq!(sink.emitted.lock().unwrap().len(), 1, "no outcome event");
    let failed = sink.failed.lock().unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(
        failed[0].1,
        ErrorKind::NotAccepted,
        "the kind reaches the sink"
    );
    let stats = registry.stats().job("work");
    assert_eq!((stats.first_attempt, stats.settlement_errors), (1, 1));
}

#[test]
fn a_settlement_that_never_finishes_ends_at_the_budget() {
    let clock = VirtualRuntime::new();
    let runtime: Arc<dyn Runtime> = Arc::new(clock.clone());
    let (registry, sink) = setup();
    let (h, _) = handle(Answer::Hang);
    let delivered = block_on(registry.deliver("q", h, &runtime, &CancelToken::new()));
    let err = delivered.outcome.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Uncertain, "{err}");
    assert_eq!(
        clock.sleeps(),
        [SETTLEMENT_BUDGET],
        "measured on the injected clock"
    );
    assert!(sink.emitted.lock().unwrap().is_empty());
}

#[test]
fn a_handed_back_delivery_is_settled_and_reported_like_any_other() {
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let (registry, sink) = setup();
    let (h, seen) = handle(Answer::Accept);
    let delivered = block_on(registry.hand_back("q", h, "budget ran out", &runtime));
    assert!(delivered.outcome.is_ok());
    assert_eq!(
        *seen.lock().unwrap(),
        [Settlement::Retry {
            delay: Some(std::time::Duration::ZERO),
            shutdown: true
        }]
    );
    let emitted = sink.emitted.lock().unwrap();
    assert!(
        matches!(&emitted[0].kind, EventKind::Retried { shutdown: true, error, .. } if error == "budget ran out"),
        "{emitted:?}"
    );
    assert_eq!(emitted[0].executions, 0);
    assert_eq!(registry.stats().job("work").retried, 1);
}

/// Where a panic aborts the host (wasm32), the host settles the delivery
/// after the fact with `settle_crashed`; where panics unwind, `deliver`
/// catches the panic itself. For a job without tier one both must settle
/// every delivery the same way: same settlement, same event, one execution.
#[cfg(panic = "unwind")]
#[test]
fn a_crashed_execution_settles_like_a_caught_panic() {
    use std::time::Duration;
    let job = Job::<u32>::builder("boom")
        .max_deliveries(3)
        .backoff(Duration::from_secs(1), 2.0, Duration::from_secs(10))
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, n: u32| async move {
            panic!("renderer bug {n}");
        })
        .unwrap();
    let sink = Arc::new(Sink::default());
    registry.event_sink(sink.clone());
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let body = Envelope::new("boom", serde_json::json!(7)).encode();
    for attempt in 1..=4 {
        let (caught, crashed) = (Arc::default(), Arc::default());
        let handle =
            |seen: &Arc<Mutex<Vec<Settlement>>>| Handle::new(body.clone(), seen).at(attempt);
        let native =
            block_on(registry.deliver("q", handle(&caught), &runtime, &CancelToken::new()));
        let edge =
            block_on(registry.settle_crashed("q", handle(&crashed), "renderer bug 7", &runtime));
        let (native_seen, edge_seen) = (caught.lock().unwrap(), crashed.lock().unwrap());
        match (&native_seen[0], &edge_seen[0]) {
            (Settlement::Fail(a), Settlement::Fail(b)) => {
                assert_eq!(a.kind, b.kind, "attempt {attempt}");
                assert_eq!(a.attempt, b.attempt);
                assert_eq!(a.executions, 1);
                assert_eq!(b.executions, 1);
            }
            (a, b) => assert_eq!(a, b, "attempt {attempt}"),
        }
        assert_eq!(
            native.processed.event.kind.name(),
            edge.processed.event.kind.name()
        );
        assert_eq!(
            native.processed.event.executions,
            edge.processed.event.executions
        );
        assert_eq!(edge.processed.event.executions, 1, "attempt {attempt}");
    }
    assert!(
        matches!(
            sink.emitted.lock().unwrap().last().unwrap(),
            Event {
                kind: EventKind::Failed { .. },
                ..
            }
        ),
        "the cap ends it"
    );
}

/// A crash blamed on a body that is not a known job's envelope settles as
/// delivering it would: a malformed body fails at once with its record, an
/// unknown name is retried by the unknown-name rule and fails with its
/// record at the cap. Nothing runs. (`tests/decoder.rs` checks the same on
/// generated bodies and attempts.)
#[test]
fn a_crash_on_a_body_it_cannot_run_settles_as_delivery_would() {
    use jobrail::FailureKind;
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let (registry, _sink) = setup();
    let unknown = Envelope::new("nobody", serde_json::json!(1)).encode();
    for (body, attempt, expected) in [
        (
            b"not an envelope".to_vec(),
            1,
            Some(FailureKind::MalformedEnvelope),
        ),
        (unknown.clone(), 1, None),
        (unknown, 10, Some(FailureKind::UnknownName)),
    ] {
        let seen = Arc::default();
        let handle = Handle::new(body.clone(), &seen).at(attempt);
        let crashed = block_on(registry.settle_crashed("q", handle, "boom", &runtime));
        let delivered = Arc::default();
        let handle = Handle::new(body, &delivered).at(attempt);
        block_on(registry.deliver("q", handle, &runtime, &CancelToken::new()));
        let (seen, delivered) = (seen.lock().unwrap(), delivered.lock().unwrap());
        match (expected, &seen[0], &delivered[0]) {
            (Some(kind), Settlement::Fail(record), Settlement::Fail(same)) => {
                assert_eq!((record.kind, same.kind), (kind, kind));
                assert_eq!(record.reason, same.reason);
            }
            (None, retry @ Settlement::Retry { .. }, same) => assert_eq!(retry, same),
            (expected, seen, _) => panic!("expected {expected:?}, settled with {seen:?}"),
        }
        assert_eq!(crashed.processed.event.executions, 0);
    }
}

/// A crashed execution counts on the job's attached breaker, as a caught
/// panic does.
#[test]
fn a_crashed_execution_counts_on_the_attached_breaker() {
    use jobrail::{BreakerConfig, CircuitBreaker};
    let runtime = VirtualRuntime::new();
    let breaker = CircuitBreaker::with_clock(
        "upstream",
        BreakerConfig {
            failure_threshold: 1,
            cool_down: std::time::Duration::from_secs(60),
        },
        Arc::new(runtime.clone()),
    )
    .unwrap();
    let job = Job::<u32>::builder("boom")
        .max_deliveries(3)
        .breaker(breaker.clone())
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, _: u32| async { Ok(()) })
        .unwrap();
    let runtime: Arc<dyn Runtime> = Arc::new(runtime);
    let handle = Handle::new(
        Envelope::new("boom", serde_json::json!(1)).encode(),
        &Arc::default(),
    );
    assert!(!breaker.is_open());
    block_on(registry.settle_crashed("q", handle, "boom", &runtime));
    assert!(
        breaker.is_open(),
        "the crash is one failure of the dependency"
    );
}

/// Job names that come from message bodies cannot grow the counters without
/// bound: deliveries for names no handler is registered for (unknown names,
/// malformed envelopes) are counted under one entry,
/// [`jobrail::UNREGISTERED_JOBS`], whatever name they carry.
#[test]
fn counters_for_unregistered_names_stay_one_entry() {
    let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
    let (registry, sink) = setup();
    for i in 0..500 {
        let body = if i % 2 == 0 {
            Envelope::new(format!("stranger-{i}"), serde_json::json!(i)).encode()
        } else {
            format!("not an envelope {i}").into_bytes()
        };
        let h = Handle::new(body, &Arc::default());
        let delivered = block_on(registry.deliver("q", h, &runtime, &CancelToken::new()));
        assert!(delivered.outcome.is_ok());
    }
    let (h, _) = handle(Answer::Accept);
    block_on(registry.deliver("q", h, &runtime, &CancelToken::new()));
    let stats = registry.stats().snapshot();
    assert_eq!(
        stats.keys().map(String::as_str).collect::<Vec<_>>(),
        [jobrail::UNREGISTERED_JOBS, "work"],
        "one entry for every unregistered name, one per job"
    );
    let unregistered = &stats[jobrail::UNREGISTERED_JOBS];
    assert_eq!(
        unregistered.retried + unregistered.failed,
        500,
        "each unregistered delivery is still counted"
    );
    assert_eq!(stats["work"].first_attempt, 1);
    // The events keep the name the message carried.
    let emitted = sink.emitted.lock().unwrap();
    assert!(emitted.iter().any(|e| &*e.job == "stranger-0"));
}
