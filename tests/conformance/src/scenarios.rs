//! The scenarios. Each takes a backend, owns a fresh queue, and checks what
//! the backend actually did (events after acceptance, failure records, the
//! attempts and times the handler saw), not what a log line claims.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{
    BreakerConfig, CircuitBreaker, Envelope, Event, EventKind, FailureKind, Job, JobBuilder,
    JobContext, JobError, Permanent, RawBody, Registry, Resolution, UnknownNameAttempts,
};
use jobrail_native::{DispatchOptions, Driver, ErrorKind};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::failures::*;
use crate::gated::*;
use crate::harness::{Backend, Calls, Harness, Hooks};

/// A scenario: an async function of a backend.
pub type Scenario = for<'a> fn(&'a dyn Backend) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// The scenarios chosen for a backend, and those left out with the reason.
#[derive(Default)]
pub struct Choice {
    /// The scenarios to run, by name.
    pub registered: Vec<(&'static str, Scenario)>,
    /// The scenarios the backend cannot run, by name, with why.
    pub not_registered: Vec<(&'static str, &'static str)>,
}

impl Choice {
    /// Registers `scenarios` if `supported`, or notes them with `reason`.
    fn when(
        &mut self,
        supported: bool,
        reason: &'static str,
        scenarios: &[(&'static str, Scenario)],
    ) {
        if supported {
            self.registered.extend_from_slice(scenarios);
        } else {
            self.not_registered
                .extend(scenarios.iter().map(|(name, _)| (*name, reason)));
        }
    }
}

/// `(name, scenario)` for each scenario function named.
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        [$((stringify!($name), (|backend| Box::pin($name(backend))) as Scenario)),*]
    };
}

/// The scenarios a backend with `driver` (its capabilities, whether it
/// keeps a failure store) and `hooks` runs, as opendal's behaviour tests
/// are registered: every backend runs the core ones; a scenario that needs
/// a capability or a set-up is registered only where it is there, never
/// run to pass vacuously.
pub fn registered(driver: &dyn Driver, hooks: &Hooks) -> Choice {
    let capabilities = &driver.capabilities();
    let mut choice = Choice::default();
    choice.when(
        true,
        "",
        &scenarios![
            ack_on_success,
            ordinary_error_retries_then_succeeds,
            attempt_cap_ends_in_failure_record,
            exponential_backoff_delays_are_lower_bounds,
            custom_backoff_delays_are_lower_bounds,
            retry_after_overrides_backoff,
            retry_after_obeys_the_cap,
            permanent_fails_at_once,
            permanent_without_cause_is_a_failure,
            reject_is_not_retried_by_the_facade,
            undecodable_payload_fails_at_once_with_raw_body,
            malformed_envelope_fails_with_raw_body,
            unknown_name_retries_then_fails,
            panic_is_an_ordinary_error,
            timeout_deadline_is_visible_and_late_success_acks,
            shutdown_retries_interrupted_work_without_loss,
            shutdown_skips_the_cap,
            repeated_shutdowns_at_the_cap,
            shutdown_keeps_the_backlog,
            stopped_consumer_spends_nothing_sent_after,
            failed_event_follows_the_record,
            delayed_dispatch,
            concurrency_limit_is_respected,
            many_messages_nothing_lost,
            tier_one_times_tier_two_executions,
            tier_one_success_is_acked_on_first_delivery,
            open_breaker_skips_tier_one,
            validation_failure_costs_no_execution,
            shutdown_during_tier_one_backoff_retries_at_once,
            batch_dispatch_runs_each_message_once,
            delayed_batch_dispatch,
        ],
    );
    choice.when(
        capabilities.delayed_dispatch,
        "the driver cannot delay a dispatch (delayed_dispatch)",
        &scenarios![
            long_delay_fires_on_time,
            long_delay_survives_a_worker_restart
        ],
    );
    choice.when(
        capabilities.max_message_bytes.is_some(),
        "the driver reports no size limit (max_message_bytes)",
        &scenarios![
            oversize_dispatch_is_refused_before_io,
            body_at_the_limit_round_trips,
            oversize_message_in_a_batch_is_refused_alone
        ],
    );
    choice.when(
        capabilities.max_retry_delay.is_some(),
        "the driver accepts any retry delay (no max_retry_delay)",
        &scenarios![
            settlement_failure_emits_no_outcome_and_keeps_the_message,
            refused_retry_delay_keeps_the_message,
        ],
    );
    let longest = OFF_GRID_DELAYS.iter().max().copied().unwrap_or_default();
    choice.when(
        capabilities
            .max_retry_delay
            .is_none_or(|max| max >= longest),
        "the driver's max_retry_delay is below the delays the scenario requests",
        &scenarios![retry_delays_are_never_rounded_down],
    );
    choice.when(
        capabilities.counts_abandoned_deliveries,
        "the driver does not count abandoned deliveries (counts_abandoned_deliveries)",
        &scenarios![abandoned_delivery_returns_with_a_higher_attempt],
    );
    choice.when(
        hooks.short_hold,
        "deliveries are not held for a time (no Backend::short_hold)",
        &scenarios![long_handler_keeps_its_delivery],
    );
    choice.when(
        hooks.delivery_limit,
        "the backend has no delivery limit of its own (no Backend::delivery_limited)",
        &scenarios![delivery_limit_is_checked_at_start],
    );
    let failure_store = driver.failure_store().is_some();
    choice.when(
        failure_store,
        "the driver keeps no failure store (Driver::failure_store)",
        &scenarios![
            failures_list_pages_oldest_first,
            failures_show_by_message_or_entry_id,
            failures_replay_runs_again_with_a_fresh_attempt_count,
            failures_replay_twice_sends_one_copy,
            failures_bulk_replay_and_purge_by_ids,
            failures_concurrent_replays_send_one_copy,
            failures_replay_while_a_worker_consumes,
            failures_poison_replay_is_refused_unless_forced,
            failures_purge_one_older_than_all,
            failures_replayed_message_that_fails_again,
        ],
    );
    choice.when(
        failure_store && hooks.inject_failure_body,
        "nothing can be put among the failures by hand (no Backend::inject_failure_body)",
        &scenarios![failures_entries_that_are_not_records],
    );
    choice.when(
        failure_store && hooks.inject_body,
        "no body can be put on a work queue by hand (no Backend::inject_body)",
        &scenarios![poison_bodies_about_the_size_limit_keep_a_record_that_fits],
    );
    choice.when(
        hooks.unreachable,
        "the configuration holds no secret (no Backend::unreachable)",
        &scenarios![unreachable_backend_hides_its_secrets],
    );
    choice
}

/// The payload every scenario dispatches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Work {
    /// An application-level id.
    pub id: u32,
}

const MS: fn(u64) -> Duration = Duration::from_millis;

fn registry_with<F, Fut>(job: &Job<Work>, handler: F) -> Registry
where
    F: Fn(JobContext, Work) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), JobError>> + Send + 'static,
{
    let mut registry = Registry::new();
    registry.register(job, handler).unwrap();
    registry
}

fn failure_of(event: &Event) -> FailureKind {
    match &event.kind {
        EventKind::Failed { failure } => failure.kind,
        other => panic!("expected a failed event, got {other:?}"),
    }
}

fn last(events: &[Event]) -> &Event {
    events.last().expect("at least one event")
}

/// `Ok(())` is acknowledged; the success is counted as a first-attempt resolution.
pub async fn ack_on_success(backend: &dyn Backend) {
    let h = Harness::new(backend, "ack").await;
    let job = h.job("ack").max_deliveries(3).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 2);
    let id = h
        .producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].message_id, id);
    assert_eq!(events[0].attempt, 1);
    assert_eq!(
        events[0].kind,
        EventKind::Succeeded {
            resolution: Resolution::FirstAttempt
        }
    );
    assert_eq!(consumer.registry().stats().job("ack").first_attempt, 1);
    // Once the backend's own redelivery time has passed, still nothing.
    tokio::time::sleep(h.driver.capabilities().redelivery_hint + MS(500)).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(
        calls.count(),
        1,
        "an acknowledged message is not redelivered"
    );
    assert_eq!(h.events.names(), ["succeeded"]);
    assert!(backend.failure_records(&h.queue).await.is_empty());
}

/// An ordinary error is retried; attempts rise by one per delivery.
pub async fn ordinary_error_retries_then_succeeds(backend: &dyn Backend) {
    let h = Harness::new(backend, "ordinary").await;
    let job = h.job("ordinary").max_deliveries(5).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|ctx, _| match ctx.attempt() {
                1 | 2 => Err(JobError::new("transient")),
                _ => Ok(()),
            }),
        ),
        // One at a time: with two slots a zero-delay retry can be redelivered
        // and settled before the first retry's event is emitted.
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(h.events.names(), ["retried", "retried", "succeeded"]);
    assert_eq!(calls.attempts(), [1, 2, 3]);
    assert_eq!(
        last(&events).kind,
        EventKind::Succeeded {
            resolution: Resolution::TierTwo {
                delivery: 3,
                of: 5,
                in_process: 1
            }
        }
    );
    let stats = consumer.registry().stats().job("ordinary");
    assert_eq!((stats.tier_two, stats.retried), (1, 2));
    consumer.shutdown().await.unwrap();
}

/// At the attempt cap an ordinary error becomes a terminal failure with a record.
pub async fn attempt_cap_ends_in_failure_record(backend: &dyn Backend) {
    let h = Harness::new(backend, "cap").await;
    let job = h
        .job("cap")
        .max_deliveries(3)
        .backoff(MS(20), 1.0, MS(20))
        .build()
        .unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|_, _| Err(JobError::new("always broken"))),
        ),
        // One at a time, so events arrive in delivery order.
        1,
    );
    let id = h
        .producer
        .dispatch(&job)
        .send(&Work { id: 9 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(h.events.names(), ["retried", "retried", "failed"]);
    assert_eq!(failure_of(last(&events)), FailureKind::AttemptsExhausted);
    assert_eq!(calls.attempts(), [1, 2, 3]);
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_eq!(record.kind, FailureKind::AttemptsExhausted);
    assert_eq!(record.message_id.as_deref(), Some(id.as_str()));
    assert_eq!(record.attempt, 3);
    assert!(record.reason.contains("always broken"), "{}", record.reason);
    assert_eq!(record.envelope.as_ref().unwrap().payload["id"], 9);
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.count(), 3);
}

async fn observe_schedule(
    backend: &dyn Backend,
    name: &str,
    builder: JobBuilder<Work>,
    want: &[Duration],
) {
    let h = Harness::new(backend, name).await;
    let attempts = want.len() as u32 + 1;
    let job = builder
        .queue(h.queue.clone())
        .max_deliveries(attempts)
        .build()
        .unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(&job, calls.handler(|_, _| Err(JobError::new("fails")))),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "failed", 1).await;
    let requested: Vec<_> = h
        .events
        .all()
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Retried { delay, .. } => delay,
            _ => None,
        })
        .collect();
    assert_eq!(requested, want, "requested delays");
    let gaps = calls.gaps();
    assert_eq!(gaps.len(), want.len());
    for (gap, want) in gaps.iter().zip(want) {
        assert!(
            gap >= want,
            "observed gap {gap:?} is shorter than the requested {want:?}"
        );
    }
    consumer.shutdown().await.unwrap();
}

/// `backoff(initial, multiplier, max)` delays are requested exactly and honoured as lower bounds.
pub async fn exponential_backoff_delays_are_lower_bounds(backend: &dyn Backend) {
    let builder = Job::<Work>::builder("exp").backoff(MS(100), 2.0, MS(300));
    observe_schedule(backend, "exp", builder, &[MS(100), MS(200), MS(300)]).await;
}

/// `backoff_fn` delays are requested exactly and honoured as lower bounds.
pub async fn custom_backoff_delays_are_lower_bounds(backend: &dyn Backend) {
    let builder = Job::<Work>::builder("custom").backoff_fn(|a| MS(50) * (a - 1));
    observe_schedule(backend, "custom", builder, &[MS(50), MS(100), MS(150)]).await;
}

/// A retry-after delay replaces the backoff.
pub async fn retry_after_overrides_backoff(backend: &dyn Backend) {
    let h = Harness::new(backend, "retry-after").await;
    let job = h
        .job("retry-after")
        .max_deliveries(3)
        .backoff(MS(10), 1.0, MS(10))
        .build()
        .unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|ctx, _| match ctx.attempt() {
                1 => Err(JobError::retry_after("rate limited", MS(400))),
                _ => Ok(()),
            }),
        ),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    match &events[0].kind {
        EventKind::Retried {
            delay,
            error,
            shutdown,
        } => {
            assert_eq!(*delay, Some(MS(400)));
            assert!(error.contains("rate limited"), "{error}");
            assert!(!shutdown);
        }
        other => panic!("expected retried, got {other:?}"),
    }
    assert!(calls.gaps()[0] >= MS(400), "gap {:?}", calls.gaps());
    consumer.shutdown().await.unwrap();
}

/// A retry-after is still subject to the attempt cap.
pub async fn retry_after_obeys_the_cap(backend: &dyn Backend) {
    let h = Harness::new(backend, "retry-after-cap").await;
    let job = h.job("retry-after-cap").max_deliveries(2).build().unwrap();
    let consumer = h.start(
        registry_with(&job, |_, _| async {
            Err(JobError::retry_after("busy", MS(20)))
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(h.events.names(), ["retried", "failed"]);
    assert_eq!(failure_of(last(&events)), FailureKind::AttemptsExhausted);
    assert_eq!(last(&events).attempt, 2);
    consumer.shutdown().await.unwrap();
}

/// A permanent error fails at once, whatever attempts remain; the cause is kept.
pub async fn permanent_fails_at_once(backend: &dyn Backend) {
    let h = Harness::new(backend, "permanent").await;
    let job = h.job("permanent").max_deliveries(5).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|_, _| Err(JobError::permanent("report source deleted"))),
        ),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(h.events.names(), ["failed"]);
    assert_eq!(failure_of(&events[0]), FailureKind::Permanent);
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    assert!(
        records[0].reason.contains("report source deleted"),
        "{}",
        records[0].reason
    );
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.count(), 1);
}

/// `Permanent` with no cause is a terminal failure, not a success.
pub async fn permanent_without_cause_is_a_failure(backend: &dyn Backend) {
    let h = Harness::new(backend, "permanent-bare").await;
    let job = h.job("permanent-bare").max_deliveries(5).build().unwrap();
    let consumer = h.start(
        registry_with(&job, |_, _| async {
            Err(Permanent::without_cause().into())
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(failure_of(&events[0]), FailureKind::Permanent);
    assert_eq!(
        consumer
            .registry()
            .stats()
            .job("permanent-bare")
            .succeeded(),
        0
    );
    consumer.shutdown().await.unwrap();
}

/// Reject: no facade retry, no failure record; the backend's own policy
/// decides, as its `reject_drops` says: the message is dropped, or it is
/// left to come back once the backend's redelivery time
/// (`redelivery_hint`) has passed, with a higher attempt.
pub async fn reject_is_not_retried_by_the_facade(backend: &dyn Backend) {
    let h = Harness::new(backend, "reject").await;
    let capabilities = h.driver.capabilities();
    let hint = capabilities.redelivery_hint;
    let job = h.job("reject").max_deliveries(5).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|_, n| match n {
                1 => Err(JobError::reject("not for us")),
                _ => Ok(()),
            }),
        ),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "rejected", 1).await;
    assert_eq!(
        events[0].kind,
        EventKind::Rejected {
            error: "rejected: not for us".into()
        }
    );
    if capabilities.reject_drops {
        tokio::time::sleep(hint + MS(500)).await;
        assert_eq!(
            calls.count(),
            1,
            "a rejected message is dropped by this backend"
        );
        assert_eq!(h.events.names(), ["rejected"]);
    } else {
        h.events
            .wait_count(hint * 2 + h.patience, "succeeded", 1)
            .await;
        assert_eq!(h.events.names(), ["rejected", "succeeded"]);
        assert_eq!(
            calls.attempts(),
            [1, 2],
            "left to the backend, it came back"
        );
        // The backend's time ran from the receive, just before the handler.
        let gap = calls.gaps()[0];
        assert!(
            gap >= hint * 3 / 4,
            "came back after {gap:?}, before the backend's redelivery time of {hint:?}"
        );
    }
    assert!(
        backend.failure_records(&h.queue).await.is_empty(),
        "reject is not a facade failure"
    );
    consumer.shutdown().await.unwrap();
}

/// A payload that does not decode fails at once, with the raw body kept and no execution.
pub async fn undecodable_payload_fails_at_once_with_raw_body(backend: &dyn Backend) {
    let h = Harness::new(backend, "poison").await;
    let job = h.job("poison").max_deliveries(5).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 1);
    let envelope = Envelope::new("poison", serde_json::json!({"id": "not a number"}));
    h.producer
        .send_raw(&h.queue, envelope.id.clone(), envelope.encode(), None)
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(failure_of(&events[0]), FailureKind::UndecodablePayload);
    assert_eq!(events[0].executions, 0);
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].raw_body.as_ref().unwrap().to_bytes(),
        envelope.encode()
    );
    assert_eq!(records[0].message_id.as_deref(), Some(envelope.id.as_str()));
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.count(), 0);
}

/// A body that is not an envelope fails with the exact bytes kept.
pub async fn malformed_envelope_fails_with_raw_body(backend: &dyn Backend) {
    let h = Harness::new(backend, "malformed").await;
    let job = h.job("malformed").max_deliveries(5).build().unwrap();
    let consumer = h.start(registry_with(&job, |_, _| async { Ok(()) }), 1);
    let body = vec![0xff, b'{', b'x', 0x00];
    h.producer
        .send_raw(&h.queue, "raw-1".into(), body.clone(), None)
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(failure_of(&events[0]), FailureKind::MalformedEnvelope);
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    // Not UTF-8: base64, a third larger than the body (not hex, twice).
    assert!(matches!(records[0].raw_body, Some(RawBody::Base64(_))));
    assert_eq!(records[0].raw_body.as_ref().unwrap().to_bytes(), body);
    // Nothing comes back once the backend's own redelivery timing has passed,
    // and reading the records did not consume them.
    tokio::time::sleep(h.driver.capabilities().redelivery_hint + MS(300)).await;
    assert_eq!(
        h.events.names(),
        ["failed"],
        "a failed message is not redelivered"
    );
    assert_eq!(backend.failure_records(&h.queue).await.len(), 1);
    consumer.shutdown().await.unwrap();
}

/// Bodies that are not envelopes, put on the queue by the backend's own
/// client at sizes about its size limit (half of it, the limit, one byte
/// over it where the backend itself takes that), each fail once with one
/// failure record that fits where records are kept: whole while it fits,
/// otherwise the body's first bytes with its length and SHA-256 digest.
/// None is refused, none comes back. A backend without a limit keeps a
/// 4 MiB body's record whole.
pub async fn poison_bodies_about_the_size_limit_keep_a_record_that_fits(backend: &dyn Backend) {
    let h = Harness::new(backend, "poison-size").await;
    let limit = h.driver.capabilities().max_message_bytes;
    let job = h.job("poison-size").max_deliveries(5).build().unwrap();
    // Unterminated JSON whose quotes JSON escapes: text a third of a byte
    // larger in a record, so a record at the limit does not fit whole.
    let body =
        |n: usize| -> Vec<u8> { b"{\"say\": \"\"".iter().cycle().take(n).copied().collect() };
    let sizes = match limit {
        Some(limit) => vec![limit / 2, limit, limit + 1],
        None => vec![4 << 20],
    };
    let mut sent = Vec::new();
    for &n in &sizes {
        match backend.inject_body(&h.queue, body(n)).await {
            Ok(()) => sent.push(n),
            // Over the backend's own limit too: nothing to test there.
            Err(e) if n > limit.unwrap_or(usize::MAX) => {
                println!("a body of {n} bytes is over the backend's own limit: {e}")
            }
            Err(e) => panic!("injecting a body of {n} bytes: {e}"),
        }
    }
    let consumer = h.start(registry_with(&job, |_, _| async { Ok(()) }), 1);
    let events = h
        .events
        .wait_count(h.patience * 2, "failed", sent.len())
        .await;
    assert!(
        events
            .iter()
            .all(|e| failure_of(e) == FailureKind::MalformedEnvelope),
        "{events:?}"
    );
    // Nothing refused, nothing back.
    tokio::time::sleep(h.driver.capabilities().redelivery_hint + MS(300)).await;
    let refused = h.events.settlement_failures();
    assert!(refused.is_empty(), "a record was refused: {refused:?}");
    let mut records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), sent.len(), "one record per body, once");
    consumer.shutdown().await.unwrap();
    records.sort_by_key(|r| r.truncated.as_ref().map_or(0, |t| t.body_bytes));
    for (record, &n) in records.iter().zip(&sent) {
        let whole = body(n);
        assert_eq!(record.attempt, 1, "failed on its first delivery");
        let encoded = record.encode();
        if let Some(limit) = limit {
            assert!(
                encoded.len() <= limit,
                "a record of {} bytes over {limit}",
                encoded.len()
            );
        }
        let kept = record.raw_body.as_ref().expect("a raw body").to_bytes();
        match &record.truncated {
            None => assert_eq!(kept, whole, "kept whole ({n} bytes)"),
            Some(t) => {
                assert!(
                    n >= limit.unwrap_or(usize::MAX),
                    "a body of {n} bytes was cut"
                );
                assert_eq!(t.body_bytes, n as u64);
                assert_eq!(t.kept_bytes, kept.len() as u64);
                assert_eq!(kept, whole[..kept.len()], "the prefix, byte for byte");
                assert!(kept.len() > n / 2, "{} of {n} bytes kept", kept.len());
                assert_eq!(t.body_sha256.len(), 64);
            }
        }
    }
    if let Some(limit) = limit {
        assert!(
            records.iter().filter(|r| r.truncated.is_some()).count()
                == sent.iter().filter(|&&n| n >= limit).count(),
            "the bodies at and over the limit were cut, the one below kept whole"
        );
    }
}

/// An unknown job name is retried until the delivery count reaches the cap, then fails.
pub async fn unknown_name_retries_then_fails(backend: &dyn Backend) {
    let h = Harness::new(backend, "unknown").await;
    let job = h.job("known").build().unwrap();
    let mut registry = registry_with(&job, |_, _| async { Ok(()) });
    registry
        .unknown_name_attempts(UnknownNameAttempts::limited(3))
        .unknown_name_retry_delay(MS(50));
    let consumer = h.start(registry, 1);
    let envelope = Envelope::new("from-the-future", serde_json::json!({"id": 1}));
    h.producer
        .send_raw(&h.queue, envelope.id.clone(), envelope.encode(), None)
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    // Every delivery below the cap is retried after the unknown-name delay.
    // A retry the broker took but did not confirm in time (NATS answers a
    // double-acked -NAK; its answer can be late) is reported as a settlement
    // failure instead of a `retried` event: the broker counted the delivery
    // all the same, so it counts here too.
    let refused = h.events.settlement_failures();
    let mut retried: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind.name() == "retried")
        .chain(refused.iter().map(|(e, _)| e))
        .collect();
    retried.sort_by_key(|e| e.attempt);
    let seen = || format!("events {events:?}, settlement failures {refused:?}");
    assert_eq!(
        retried.iter().map(|e| e.attempt).collect::<Vec<_>>(),
        [1, 2],
        "{}",
        seen()
    );
    assert!(
        retried
            .iter()
            .all(|e| matches!(e.kind, EventKind::Retried { delay: Some(d), .. } if d == MS(50))),
        "{}",
        seen()
    );
    let failed: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind.name() == "failed")
        .collect();
    assert_eq!(failed.len(), 1, "{}", seen());
    assert_eq!(failure_of(failed[0]), FailureKind::UnknownName);
    assert_eq!(failed[0].attempt, 3, "{}", seen());
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].job.as_deref(), Some("from-the-future"));
    consumer.shutdown().await.unwrap();
}

/// A panic is an ordinary error carrying the panic message; the worker survives.
pub async fn panic_is_an_ordinary_error(backend: &dyn Backend) {
    let h = Harness::new(backend, "panic").await;
    let job = h.job("panic").max_deliveries(3).build().unwrap();
    let consumer = h.start(
        registry_with(&job, |ctx, _| async move {
            if ctx.attempt() == 1 {
                panic!("kaboom in handler");
            }
            Ok(())
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    match &events[0].kind {
        EventKind::Retried { error, .. } => {
            assert!(error.contains("kaboom in handler"), "{error}");
            assert!(error.contains("panicked"), "{error}");
        }
        other => panic!("expected retried, got {other:?}"),
    }
    consumer.shutdown().await.unwrap();
}

/// The timeout is visible as a deadline; returning `Ok` after it still acknowledges.
pub async fn timeout_deadline_is_visible_and_late_success_acks(backend: &dyn Backend) {
    let h = Harness::new(backend, "timeout").await;
    let job = h
        .job("timeout")
        .max_deliveries(2)
        .timeout(MS(150))
        .build()
        .unwrap();
    let seen = Arc::new(Mutex::new(None));
    let s = seen.clone();
    let consumer = h.start(
        registry_with(&job, move |ctx, _| {
            let s = s.clone();
            async move {
                let remaining = ctx.remaining();
                tokio::time::sleep(MS(250)).await;
                *s.lock().unwrap() = Some((remaining, ctx.check_deadline().is_err()));
                Ok(())
            }
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "succeeded", 1).await;
    let (remaining, expired) = seen.lock().unwrap().expect("handler ran");
    let remaining = remaining.expect("a deadline is set");
    assert!(
        remaining <= MS(150) && remaining > Duration::ZERO,
        "{remaining:?}"
    );
    assert!(expired, "the deadline had passed when the handler returned");
    assert_eq!(h.events.names(), ["succeeded"]);
    consumer.shutdown().await.unwrap();
}

fn cancelled_handler(
    started: Arc<tokio::sync::Notify>,
) -> impl Fn(JobContext, Work) -> futures_like::Fut + Send + Sync + 'static {
    move |ctx, _| {
        let started = started.clone();
        Box::pin(async move {
            started.notify_one();
            Err(ctx.cancelled().await.into())
        })
    }
}

mod futures_like {
    pub(super) type Fut =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), jobrail::JobError>> + Send>>;
}

/// Shutdown cancels the handler; its cancellation error is a zero-delay retry
/// and the message is handled by the next worker, attempt count not discounted.
pub async fn shutdown_retries_interrupted_work_without_loss(backend: &dyn Backend) {
    let h = Harness::new(backend, "shutdown").await;
    // A backoff long enough that a retry by it would show (at most the
    // backend's longest delay, which a consumer checks at start).
    let long = h
        .driver
        .capabilities()
        .max_retry_delay
        .map_or(Duration::from_secs(60), |max| {
            max.min(Duration::from_secs(60))
        });
    let job = h
        .job("shutdown")
        .max_deliveries(5)
        .backoff(long, 1.0, Duration::ZERO)
        .build()
        .unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let consumer = h.start(registry_with(&job, cancelled_handler(started.clone())), 1);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    tokio::time::timeout(h.patience, started.notified())
        .await
        .expect("handler started");
    consumer.shutdown().await.unwrap();
    let events = h.events.all();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        events[0].kind,
        EventKind::Retried {
            delay: Some(Duration::ZERO),
            error: "consumer cancelled".into(),
            shutdown: true
        }
    );

    let calls = Calls::default();
    let next = h
        .start_on(
            backend.connect().await,
            registry_with(&job, calls.handler(|_, _| Ok(()))),
        )
        .await;
    h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(
        calls.attempts(),
        [2],
        "the interrupted delivery still counts"
    );
    next.shutdown().await.unwrap();
}

/// The shutdown retry skips the cap, but the count still rises: the next
/// ordinary failure exhausts it.
pub async fn shutdown_skips_the_cap(backend: &dyn Backend) {
    let h = Harness::new(backend, "shutdown-cap").await;
    let job = h.job("shutdown-cap").max_deliveries(1).build().unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let consumer = h.start(registry_with(&job, cancelled_handler(started.clone())), 1);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    tokio::time::timeout(h.patience, started.notified())
        .await
        .expect("handler started");
    consumer.shutdown().await.unwrap();
    assert_eq!(
        h.events.names(),
        ["retried"],
        "at the cap, shutdown still retries"
    );

    let next = h
        .start_on(
            backend.connect().await,
            registry_with(&job, |_, _| async { Err(JobError::new("still broken")) }),
        )
        .await;
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(failure_of(last(&events)), FailureKind::AttemptsExhausted);
    assert_eq!(last(&events).attempt, 2);
    assert_eq!(
        last(&events).executions,
        1,
        "the redelivery after a shutdown on the last allowed delivery runs"
    );
    next.shutdown().await.unwrap();
}

/// Graceful shutdowns at the cap, twice in a row. Where the backend counts
/// graceful-shutdown returns, each redelivery runs and the third delivery
/// succeeds; where it cannot, the rules allow one delivery of grace, so the
/// third fails without running (the documented crash bound).
pub async fn repeated_shutdowns_at_the_cap(backend: &dyn Backend) {
    let h = Harness::new(backend, "shutdown-twice").await;
    let job = h.job("shutdown-twice").max_deliveries(1).build().unwrap();
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    for round in 1..=2 {
        let started = Arc::new(tokio::sync::Notify::new());
        let consumer = h.start(registry_with(&job, cancelled_handler(started.clone())), 1);
        tokio::time::timeout(h.patience, started.notified())
            .await
            .expect("handler started");
        consumer.shutdown().await.unwrap();
        h.events.wait_count(h.patience, "retried", round).await;
    }
    let calls = Calls::default();
    let last_one = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 1);
    if h.driver.capabilities().counts_shutdown_returns {
        let events = h.events.wait_count(h.patience, "succeeded", 1).await;
        assert_eq!(last(&events).attempt, 3);
        assert_eq!(calls.count(), 1);
    } else {
        let events = h.events.wait_count(h.patience, "failed", 1).await;
        assert_eq!(failure_of(last(&events)), FailureKind::AttemptsExhausted);
        assert_eq!((last(&events).attempt, calls.count()), (3, 0));
    }
    last_one.shutdown().await.unwrap();
}

/// A settlement the backend refuses emits no outcome event and loses nothing.
pub async fn settlement_failure_emits_no_outcome_and_keeps_the_message(backend: &dyn Backend) {
    let h = Harness::new(backend, "settle-fail").await;
    let max = h
        .driver
        .capabilities()
        .max_retry_delay
        .expect("registered only for backends with a maximum retry delay");
    let job = h.job("settle-fail").max_deliveries(5).build().unwrap();
    let too_long = max + Duration::from_secs(1);
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(move |_, n| match n {
                1 => Err(JobError::retry_after("wait too long", too_long)),
                _ => Ok(()),
            }),
        ),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let (event, error) = h.events.wait_settlement_failure(h.patience).await;
    let refused_at = Instant::now();
    assert!(matches!(event.kind, EventKind::Retried { .. }), "{event:?}");
    assert!(error.contains("unsupported"), "{error}");
    let refused_hold = h.driver.capabilities().refused_hold;
    h.events
        .wait_count(h.patience + refused_hold * 2, "succeeded", 1)
        .await;
    assert!(
        refused_at.elapsed() >= refused_hold,
        "redelivered {:?} after the refusal, sooner than the hold of {refused_hold:?}",
        refused_at.elapsed()
    );
    assert_eq!(
        h.events.names(),
        ["succeeded"],
        "the refused retry emitted no outcome event"
    );
    assert_eq!(
        consumer
            .registry()
            .stats()
            .job("settle-fail")
            .settlement_errors,
        1
    );
    assert!(
        calls.attempts()[1] >= 2,
        "redelivered: {:?}",
        calls.attempts()
    );
    consumer.shutdown().await.unwrap();
}

/// `failed` is emitted only once the failure record has been transferred.
pub async fn failed_event_follows_the_record(backend: &dyn Backend) {
    let h = Harness::new(backend, "failed-order").await;
    let job = h.job("failed-order").max_deliveries(2).build().unwrap();
    let consumer = h.start(
        registry_with(&job, |_, _| async { Err(JobError::new("nope")) }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "failed", 1).await;
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1, "the record exists when `failed` is seen");
    assert_eq!(h.events.names(), ["retried", "failed"]);
    consumer.shutdown().await.unwrap();
}

/// A delayed dispatch is not delivered before its delay, or is refused clearly.
pub async fn delayed_dispatch(backend: &dyn Backend) {
    let h = Harness::new(backend, "delayed").await;
    let job = h.job("delayed").build().unwrap();
    let options = DispatchOptions {
        delay: Some(MS(300)),
        ..Default::default()
    };
    if !h.driver.capabilities().delayed_dispatch {
        let err = h
            .producer
            .dispatch(&job)
            .options(options)
            .send(&Work { id: 1 })
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        return;
    }
    let calls = Calls::default();
    let consumer = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 1);
    let sent = Instant::now();
    h.producer
        .dispatch(&job)
        .options(options)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "succeeded", 1).await;
    let ran = calls.times()[0];
    assert!(ran - sent >= MS(300), "delivered after {:?}", ran - sent);
    consumer.shutdown().await.unwrap();
}

/// A delay past what the backend holds in one message, when it has such a
/// limit ([`Capabilities::max_dispatch_delay`](jobrail_native::Capabilities::max_dispatch_delay)):
/// two of the longest legs and some; 2.3 s where it holds any delay (the
/// fixtures keep the legs short, so the steps are real).
fn long_delay(driver: &dyn Driver) -> Duration {
    match driver.capabilities().max_dispatch_delay {
        Some(longest) => longest * 2 + MS(300),
        None => MS(2300),
    }
}

/// How late a delayed job may run and still be on time, in the suite: the
/// rule is within 1 s of its due time; the suite allows scheduling noise on
/// a loaded machine on top.
const LATENESS: Duration = Duration::from_millis(2000);

/// A delay of any length: jobs delayed past what one message holds run
/// once each, not before their time and soon after it, at attempt 1, with
/// no event for the steps that carried them (no outcome, no retry). Ten
/// jobs, their delays 137 ms apart so that they meet the backend's
/// rounding at different points; the lateness of each is printed (the
/// precision the guide states per backend).
pub async fn long_delay_fires_on_time(backend: &dyn Backend) {
    const JOBS: u32 = 10;
    let h = Harness::new(backend, "long-delay").await;
    let job = h.job("long-delay").build().unwrap();
    let base = long_delay(h.driver.as_ref());
    let delay_of = |id: u32| base + MS(137) * id;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    let consumer = h.start(
        registry_with(&job, move |ctx: JobContext, work: Work| {
            seen.lock()
                .unwrap()
                .push((work.id, ctx.attempt(), Instant::now()));
            async { Ok(()) }
        }),
        4,
    );
    let mut sent = Vec::new();
    for id in 0..JOBS {
        sent.push(Instant::now());
        h.producer
            .dispatch(&job)
            .delay(delay_of(id))
            .send(&Work { id })
            .await
            .unwrap();
    }
    h.events
        .wait_count(h.patience + delay_of(JOBS), "succeeded", JOBS as usize)
        .await;
    // Room for a second copy to show itself.
    tokio::time::sleep(MS(500)).await;
    consumer.shutdown().await.unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), JOBS as usize, "each job ran once: {calls:?}");
    let mut late = Vec::new();
    for (id, attempt, ran) in calls {
        let delay = delay_of(id);
        let after = ran - sent[id as usize];
        assert!(
            after >= delay,
            "job {id} ran {after:?} after dispatch, before its {delay:?}"
        );
        assert!(
            after <= delay + LATENESS,
            "job {id} ran {:?} after its due time",
            after - delay
        );
        assert_eq!(
            attempt,
            1,
            "job {id}: no step counted as an attempt (ran {:?} late)",
            after - delay
        );
        late.push(after - delay);
    }
    assert_eq!(
        h.events.names(),
        vec!["succeeded"; JOBS as usize],
        "the steps emit nothing"
    );
    late.sort();
    eprintln!(
        "delays of {base:?} to {:?} on {}: ran {:?} to {:?} after their due time (median {:?})",
        delay_of(JOBS - 1),
        h.driver.name(),
        late[0],
        late[late.len() - 1],
        late[late.len() / 2]
    );
}

/// A long delay survives a worker restart: the consumer that held the
/// job's steps stops half way, another starts, and the job runs once, not
/// before its time.
pub async fn long_delay_survives_a_worker_restart(backend: &dyn Backend) {
    let h = Harness::new(backend, "long-delay-restart").await;
    let job = h.job("long-delay-restart").build().unwrap();
    let delay = long_delay(h.driver.as_ref());
    let calls = Calls::default();
    let first = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 2);
    let sent = Instant::now();
    h.producer
        .dispatch(&job)
        .delay(delay)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    tokio::time::sleep(delay / 2).await;
    first.shutdown().await.unwrap();
    assert_eq!(calls.count(), 0, "nothing ran before its time");
    let second = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 2);
    h.events
        .wait_count(h.patience + delay, "succeeded", 1)
        .await;
    tokio::time::sleep(MS(500)).await;
    second.shutdown().await.unwrap();
    let times = calls.times();
    assert_eq!(times.len(), 1, "the job ran once");
    assert!(times[0] - sent >= delay, "ran before its time");
}

/// No more than `concurrency` handlers run at once, and that many do.
pub async fn concurrency_limit_is_respected(backend: &dyn Backend) {
    let h = Harness::new(backend, "concurrency").await;
    let job = h.job("concurrency").build().unwrap();
    let active = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (a, p) = (active.clone(), peak.clone());
    let consumer = h.start(
        registry_with(&job, move |_, _| {
            let (a, p) = (a.clone(), p.clone());
            async move {
                let now = a.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(MS(100)).await;
                a.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        }),
        2,
    );
    for id in 0..6 {
        h.producer.dispatch(&job).send(&Work { id }).await.unwrap();
    }
    h.events.wait_count(h.patience, "succeeded", 6).await;
    assert_eq!(peak.load(Ordering::SeqCst), 2);
    consumer.shutdown().await.unwrap();
}

/// Many messages with transient failures: every one ends acknowledged.
pub async fn many_messages_nothing_lost(backend: &dyn Backend) {
    let h = Harness::new(backend, "many").await;
    let job = h.job("many").max_deliveries(3).build().unwrap();
    let consumer = h.start(
        registry_with(&job, |ctx, work| async move {
            if work.id % 3 == 0 && ctx.attempt() == 1 {
                Err(JobError::new("first try fails"))
            } else {
                Ok(())
            }
        }),
        4,
    );
    let mut ids = std::collections::BTreeSet::new();
    for id in 0..50 {
        ids.insert(h.producer.dispatch(&job).send(&Work { id }).await.unwrap());
    }
    // A zero-delay retry's copy can be handled, and its success reported,
    // before the retry that made it is: wait for both counts.
    let events = h
        .events
        .wait_for(h.patience * 2, "50 successes and 17 retries", |all| {
            let count = |name| all.iter().filter(|e| e.kind.name() == name).count();
            count("succeeded") >= 50 && count("retried") >= 17
        })
        .await;
    let done: std::collections::BTreeSet<_> = events
        .iter()
        .filter(|e| e.kind.name() == "succeeded")
        .map(|e| e.message_id.clone())
        .collect();
    assert_eq!(done, ids);
    let names = h.events.names();
    assert_eq!(
        names.iter().filter(|n| **n == "succeeded").count(),
        50,
        "each message succeeded once"
    );
    assert_eq!(
        names.iter().filter(|n| **n == "retried").count(),
        17,
        "every third message retried once"
    );
    consumer.shutdown().await.unwrap();
}

/// An always-failing handler runs exactly N x M times: 3 in-process x 3 deliveries = 9.
pub async fn tier_one_times_tier_two_executions(backend: &dyn Backend) {
    let h = Harness::new(backend, "tiers").await;
    let job = h
        .job("tiers")
        .max_deliveries(3)
        .tier_one(3)
        .tier_one_backoff(MS(1), 1.0, MS(1))
        .build()
        .unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        registry_with(
            &job,
            calls.handler(|_, _| Err(JobError::new("model unavailable"))),
        ),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(calls.count(), 9);
    let seen = calls.seen();
    assert_eq!(
        seen,
        [
            (1, 1),
            (1, 2),
            (1, 3),
            (2, 1),
            (2, 2),
            (2, 3),
            (3, 1),
            (3, 2),
            (3, 3)
        ]
    );
    assert_eq!(last(&events).executions, 3);
    assert_eq!(consumer.registry().stats().job("tiers").executions, 9);
    let records = backend.failure_records(&h.queue).await;
    assert_eq!((records[0].attempt, records[0].executions), (3, 3));
    consumer.shutdown().await.unwrap();
}

/// A success on in-process attempt 2 is acknowledged on the first delivery and counted as tier one.
pub async fn tier_one_success_is_acked_on_first_delivery(backend: &dyn Backend) {
    let h = Harness::new(backend, "tier-one").await;
    let job = h
        .job("tier-one")
        .max_deliveries(3)
        .tier_one(3)
        .tier_one_backoff(MS(5), 1.0, MS(5))
        .build()
        .unwrap();
    let consumer = h.start(
        registry_with(&job, |ctx, _| async move {
            if ctx.in_process_attempt() == 1 {
                Err(JobError::new("blip"))
            } else {
                Ok(())
            }
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(h.events.names(), ["succeeded"]);
    assert_eq!(events[0].attempt, 1);
    assert_eq!(events[0].executions, 2);
    assert_eq!(
        events[0].kind,
        EventKind::Succeeded {
            resolution: Resolution::TierOne { attempt: 2, of: 3 }
        }
    );
    let stats = consumer.registry().stats().job("tier-one");
    assert_eq!(
        (stats.tier_one, stats.first_attempt, stats.tier_two),
        (1, 0, 0)
    );
    consumer.shutdown().await.unwrap();
}

/// With the breaker open, tier one is skipped: 3 deliveries cost 3 executions,
/// and the protected operation ran only until the breaker opened.
pub async fn open_breaker_skips_tier_one(backend: &dyn Backend) {
    let h = Harness::new(backend, "breaker").await;
    let breaker = CircuitBreaker::new(
        "upstream",
        BreakerConfig {
            failure_threshold: 1,
            cool_down: Duration::from_secs(3600),
        },
    )
    .unwrap();
    let job = h
        .job("breaker")
        .max_deliveries(3)
        .tier_one(3)
        .tier_one_backoff(MS(1), 1.0, MS(1))
        .breaker(breaker.clone())
        .build()
        .unwrap();
    let executions = Arc::new(AtomicU32::new(0));
    let upstream_calls = Arc::new(AtomicU32::new(0));
    let (e, u, b) = (executions.clone(), upstream_calls.clone(), breaker.clone());
    let consumer = h.start(
        registry_with(&job, move |_, _| {
            let (e, u, b) = (e.clone(), u.clone(), b.clone());
            async move {
                e.fetch_add(1, Ordering::SeqCst);
                b.call(|| async {
                    u.fetch_add(1, Ordering::SeqCst);
                    Err::<(), _>(std::io::Error::other("upstream down"))
                })
                .await?;
                Ok(())
            }
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(executions.load(Ordering::SeqCst), 3);
    assert_eq!(upstream_calls.load(Ordering::SeqCst), 1);
    assert!(breaker.is_open());
    consumer.shutdown().await.unwrap();
}

/// A validation failure is permanent at once and costs no execution.
pub async fn validation_failure_costs_no_execution(backend: &dyn Backend) {
    let h = Harness::new(backend, "validate").await;
    let job = h
        .job("validate")
        .max_deliveries(3)
        .tier_one(3)
        .validate(|w: &Work| {
            if w.id == 0 {
                Err("id must be positive".into())
            } else {
                Ok(())
            }
        })
        .build()
        .unwrap();
    let calls = Calls::default();
    let consumer = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 1);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 0 })
        .await
        .unwrap();
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(failure_of(&events[0]), FailureKind::InvalidPayload);
    assert_eq!(events[0].executions, 0);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(calls.count(), 1, "only the valid message ran");
    consumer.shutdown().await.unwrap();
}

/// Shutdown during a tier-one backoff settles as a zero-delay retry.
pub async fn shutdown_during_tier_one_backoff_retries_at_once(backend: &dyn Backend) {
    let h = Harness::new(backend, "tier-one-shutdown").await;
    let job = h
        .job("tier-one-shutdown")
        .max_deliveries(2)
        .tier_one(3)
        .tier_one_backoff(Duration::from_secs(60), 1.0, Duration::ZERO)
        .build()
        .unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let consumer = h.start(
        registry_with(&job, move |_, _| {
            s.notify_one();
            async { Err(JobError::new("blip")) }
        }),
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    tokio::time::timeout(h.patience, started.notified())
        .await
        .expect("handler ran");
    let begun = Instant::now();
    consumer.shutdown().await.unwrap();
    assert!(
        begun.elapsed() < Duration::from_secs(30),
        "shutdown did not wait out the backoff"
    );
    let events = h.events.all();
    assert_eq!(events.len(), 1);
    assert!(
        matches!(events[0].kind, EventKind::Retried { delay: Some(d), shutdown: true, .. } if d.is_zero()),
        "{events:?}"
    );
    assert_eq!(events[0].executions, 1);

    let next = h
        .start_on(
            backend.connect().await,
            registry_with(&job, |_, _| async { Ok(()) }),
        )
        .await;
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    assert_eq!(last(&events).attempt, 2);
    next.shutdown().await.unwrap();
}

/// Shutting a consumer down leaves the messages it had not taken in the queue
/// for the next consumer.
pub async fn shutdown_keeps_the_backlog(backend: &dyn Backend) {
    let h = Harness::new(backend, "backlog").await;
    let job = h.job("backlog").max_deliveries(5).build().unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let consumer = h.start(registry_with(&job, cancelled_handler(started.clone())), 1);
    for id in 0..5 {
        h.producer.dispatch(&job).send(&Work { id }).await.unwrap();
    }
    tokio::time::timeout(h.patience, started.notified())
        .await
        .expect("handler started");
    consumer.shutdown().await.unwrap();
    assert_eq!(
        h.events.names(),
        ["retried"],
        "only the active delivery was settled"
    );

    let calls = Calls::default();
    let next = h
        .start_on(
            backend.connect().await,
            registry_with(&job, calls.handler(|_, _| Ok(()))),
        )
        .await;
    h.events.wait_count(h.patience, "succeeded", 5).await;
    let mut attempts = calls.attempts();
    attempts.sort();
    assert_eq!(
        attempts,
        [1, 1, 1, 1, 2],
        "four untouched messages and the interrupted one"
    );
    next.shutdown().await.unwrap();
}

/// A message sent just after an idle consumer (waiting for work) shut down
/// runs on the next consumer, promptly, even for a job allowed a single
/// delivery: the stopped consumer neither keeps the message nor spends one
/// of its deliveries.
pub async fn stopped_consumer_spends_nothing_sent_after(backend: &dyn Backend) {
    let h = Harness::new(backend, "stopped-idle").await;
    let job = h.job("stopped-idle").max_deliveries(1).build().unwrap();
    let calls = Calls::default();
    let first = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 1);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events.wait_count(h.patience, "succeeded", 1).await;
    // Idle now, waiting for the next message.
    tokio::time::sleep(MS(200)).await;
    first.shutdown().await.unwrap();
    let sent = Instant::now();
    let id = h
        .producer
        .dispatch(&job)
        .send(&Work { id: 2 })
        .await
        .unwrap();
    tokio::time::sleep(MS(300)).await;
    let next = h
        .start_on(
            backend.connect().await,
            registry_with(&job, calls.handler(|_, _| Ok(()))),
        )
        .await;
    let events = h
        .events
        .wait_for(h.patience, "the second message's outcome", |all| {
            all.len() >= 2
        })
        .await;
    let took = sent.elapsed();
    next.shutdown().await.unwrap();
    assert_eq!(events[1].message_id, id);
    assert_eq!(
        h.events.names(),
        ["succeeded", "succeeded"],
        "the stopped consumer spent the message's only delivery: {events:#?}"
    );
    assert_eq!(calls.count(), 2);
    let hint = h.driver.capabilities().redelivery_hint;
    assert!(
        took < MS(300) + hint.max(MS(1000)),
        "delivered {took:?} after it was sent"
    );
}

/// A payload whose size a scenario chooses.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Padded {
    /// Filler.
    pub pad: String,
}

/// `envelope` padded, in a `pad` field of its (object) payload, so that its
/// encoded body is exactly `size` bytes. A payload type without that field
/// ignores it.
pub fn padded_to(mut envelope: Envelope, size: usize) -> Envelope {
    envelope.payload["pad"] = serde_json::Value::String(String::new());
    let base = envelope.encode().len();
    assert!(
        size >= base,
        "a body of {size} bytes cannot hold this envelope ({base} bytes)"
    );
    envelope.payload["pad"] = serde_json::Value::String("a".repeat(size - base));
    assert_eq!(envelope.encode().len(), size);
    envelope
}

/// An envelope for `job` whose encoded body is exactly `size` bytes.
fn envelope_of_size(job: &str, size: usize) -> Envelope {
    padded_to(Envelope::new(job, serde_json::json!({})), size)
}

/// The driver's size limit.
fn size_limit(h: &Harness) -> usize {
    h.driver
        .capabilities()
        .max_message_bytes
        .expect("registered only for backends with a size limit")
}

/// A registry running `job` with a handler that records each payload's
/// `pad` length.
fn recording_pads(job: &Job<Padded>) -> (Registry, Arc<Mutex<Vec<usize>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let mut registry = Registry::new();
    registry
        .register(job, move |_ctx, padded: Padded| {
            record.lock().unwrap().push(padded.pad.len());
            std::future::ready(Ok(()))
        })
        .unwrap();
    (registry, seen)
}

/// A body one byte over the driver's `max_message_bytes` is refused as not
/// accepted before any I/O (even through a stopped driver), with an error
/// naming the limit and the size; nothing reaches the queue.
pub async fn oversize_dispatch_is_refused_before_io(backend: &dyn Backend) {
    let h = Harness::new(backend, "oversize").await;
    let limit = size_limit(&h);
    let job = Job::<Padded>::builder("oversize")
        .queue(h.queue.clone())
        .build()
        .unwrap();
    let over = envelope_of_size(job.name(), limit + 1);
    let err = h
        .producer
        .send_raw(&h.queue, over.id.clone(), over.encode(), None)
        .await
        .expect_err("an oversize message was accepted");
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    let text = err.to_string();
    assert!(text.contains(&limit.to_string()), "{text}");
    assert!(text.contains(&(limit + 1).to_string()), "{text}");

    // Before any I/O: a stopped driver refuses it for its size, not for
    // being stopped.
    let stopped = backend.connect().await;
    stopped.stop().await.unwrap();
    let err = jobrail_native::Producer::new(stopped)
        .send_raw(&h.queue, over.id.clone(), over.encode(), None)
        .await
        .expect_err("an oversize message was accepted");
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    assert!(err.to_string().contains(&limit.to_string()), "{err}");

    let (registry, seen) = recording_pads(&job);
    h.producer
        .dispatch(&job)
        .send(&Padded { pad: "x".into() })
        .await
        .unwrap();
    let consumer = h.start(registry, 2);
    h.events.wait_count(h.patience, "succeeded", 1).await;
    // Time for anything else in the queue to arrive.
    tokio::time::sleep(MS(500)).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [1],
        "only the small message was stored"
    );
    assert_eq!(h.events.names(), ["succeeded"]);
    assert!(backend.failure_records(&h.queue).await.is_empty());
}

/// A message whose body is exactly the driver's `max_message_bytes` is
/// dispatched, delivered whole and acknowledged.
pub async fn body_at_the_limit_round_trips(backend: &dyn Backend) {
    let h = Harness::new(backend, "at-limit").await;
    let limit = size_limit(&h);
    let job = Job::<Padded>::builder("at-limit")
        .queue(h.queue.clone())
        .max_deliveries(3)
        .build()
        .unwrap();
    let envelope = envelope_of_size(job.name(), limit);
    let expected = match &envelope.payload["pad"] {
        serde_json::Value::String(pad) => pad.len(),
        other => panic!("unexpected payload {other}"),
    };
    let (registry, seen) = recording_pads(&job);
    let started = Instant::now();
    h.producer
        .send_raw(&h.queue, envelope.id.clone(), envelope.encode(), None)
        .await
        .unwrap_or_else(|e| panic!("a message of exactly {limit} bytes was refused: {e}"));
    let consumer = h.start(registry, 1);
    let events = h.events.wait_count(h.patience, "succeeded", 1).await;
    println!(
        "{}: a {limit}-byte message round-tripped in {:?}",
        h.driver.name(),
        started.elapsed()
    );
    consumer.shutdown().await.unwrap();
    assert_eq!(events[0].message_id, envelope.id);
    assert_eq!(*seen.lock().unwrap(), [expected]);
    assert!(backend.failure_records(&h.queue).await.is_empty());
}

/// `Dispatch::send_batch` answers once per payload, in order, with
/// distinct message ids; each message is delivered and succeeds exactly
/// once, under those ids. 25 messages: more than one backend batch call
/// where a call is bounded (SQS takes 10 at a time).
pub async fn batch_dispatch_runs_each_message_once(backend: &dyn Backend) {
    let h = Harness::new(backend, "batch").await;
    let job = h.job("batch").build().unwrap();
    let payloads: Vec<Work> = (0..25).map(|id| Work { id }).collect();
    let results = h.producer.dispatch(&job).send_batch(&payloads).await;
    assert_eq!(results.len(), payloads.len(), "one answer per payload");
    let ids: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("a batch message was not accepted: {e}")))
        .collect();
    let distinct: std::collections::BTreeSet<_> = ids.iter().cloned().collect();
    assert_eq!(distinct.len(), ids.len(), "message ids are distinct");

    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let consumer = h.start(
        registry_with(&job, move |ctx, work| {
            record
                .lock()
                .unwrap()
                .push((work.id, ctx.message_id().to_string()));
            std::future::ready(Ok(()))
        }),
        4,
    );
    h.events.wait_count(h.patience * 2, "succeeded", 25).await;
    // Time for a duplicate to show up.
    tokio::time::sleep(MS(300)).await;
    consumer.shutdown().await.unwrap();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let expected: Vec<(u32, String)> = (0..25).zip(ids.iter().cloned()).collect();
    assert_eq!(
        seen, expected,
        "each payload ran once, under its returned id"
    );
    assert_eq!(h.events.names().len(), 25, "no other outcome");
    assert!(backend.failure_records(&h.queue).await.is_empty());
}

/// A batch dispatched with a delay: on a backend that can delay, no message
/// runs before the delay; on one that cannot, every message is refused with
/// `Unsupported` and nothing is sent.
pub async fn delayed_batch_dispatch(backend: &dyn Backend) {
    let h = Harness::new(backend, "batch-delayed").await;
    let job = h.job("batch-delayed").build().unwrap();
    let options = DispatchOptions {
        delay: Some(MS(400)),
        ..Default::default()
    };
    let payloads: Vec<Work> = (0..3).map(|id| Work { id }).collect();
    let calls = Calls::default();
    let consumer = h.start(registry_with(&job, calls.handler(|_, _| Ok(()))), 2);
    let sent = Instant::now();
    let results = h
        .producer
        .dispatch(&job)
        .options(options)
        .send_batch(&payloads)
        .await;
    assert_eq!(results.len(), 3);
    if !h.driver.capabilities().delayed_dispatch {
        for result in results {
            assert_eq!(result.unwrap_err().kind(), ErrorKind::Unsupported);
        }
        tokio::time::sleep(MS(500)).await;
        consumer.shutdown().await.unwrap();
        assert!(calls.times().is_empty(), "a refused batch sent nothing");
        return;
    }
    for result in results {
        result.unwrap();
    }
    h.events.wait_count(h.patience, "succeeded", 3).await;
    consumer.shutdown().await.unwrap();
    for ran in calls.times() {
        assert!(ran - sent >= MS(400), "delivered after {:?}", ran - sent);
    }
}

/// In a batch, a message over the size limit is refused alone, before any
/// I/O, with `NotAccepted`; the messages before and after it are sent and
/// run.
pub async fn oversize_message_in_a_batch_is_refused_alone(backend: &dyn Backend) {
    let h = Harness::new(backend, "batch-oversize").await;
    let limit = size_limit(&h);
    let job = Job::<Padded>::builder("batch-oversize")
        .queue(h.queue.clone())
        .build()
        .unwrap();
    let small = |pad: &str| {
        let envelope = Envelope::new(job.name(), serde_json::json!({ "pad": pad }));
        jobrail_native::Outgoing {
            id: envelope.id.clone(),
            body: envelope.encode(),
            delay: None,
        }
    };
    let over = envelope_of_size(job.name(), limit + 1);
    let messages = vec![
        small("a"),
        jobrail_native::Outgoing {
            id: over.id.clone(),
            body: over.encode(),
            delay: None,
        },
        small("bb"),
    ];
    let results = h.producer.send_batch(&h.queue, messages).await;
    assert_eq!(results.len(), 3, "one answer per message");
    assert!(results[0].is_ok(), "{:?}", results[0]);
    let err = results[1]
        .as_ref()
        .expect_err("the oversize message was accepted");
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    assert!(err.to_string().contains(&limit.to_string()), "{err}");
    assert!(results[2].is_ok(), "{:?}", results[2]);

    let (registry, seen) = recording_pads(&job);
    let consumer = h.start(registry, 2);
    h.events.wait_count(h.patience, "succeeded", 2).await;
    tokio::time::sleep(MS(300)).await;
    consumer.shutdown().await.unwrap();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, [1, 2], "only the two small messages were stored");
    assert!(backend.failure_records(&h.queue).await.is_empty());
}
