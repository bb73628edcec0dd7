//! Scenarios registered only for backends that can run them (see
//! [`scenarios::registered`](crate::scenarios::registered)): they need a
//! capability (abandoned deliveries counted, a maximum retry delay) or a
//! set-up only some backends offer ([`Backend::short_hold`],
//! [`Backend::delivery_limited`], [`Backend::unreachable`]). Each checks
//! what the backend did, seen from outside the driver.

use std::time::Duration;

use jobrail::{JobError, Registry, Settlement, UnknownNameAttempts};
use jobrail_native::{Delivery, DriverError, ErrorKind, Outgoing, Subscription};
use tokio::time::{timeout, Instant};

use crate::harness::{outgoing, Backend, Calls, Harness};
use crate::scenarios::Work;

const MS: fn(u64) -> Duration = Duration::from_millis;

/// A message with a body of our own, for scenarios that talk to the driver.
fn message(id: &str, body: &[u8]) -> Outgoing {
    Outgoing {
        id: id.into(),
        body: body.to_vec(),
        delay: None,
    }
}

/// The next delivery within `wait`; panics naming `what` otherwise.
async fn next_within(
    subscription: &mut Box<dyn Subscription>,
    wait: Duration,
    what: &str,
) -> Box<dyn Delivery> {
    timeout(wait, subscription.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing delivered within {wait:?}"))
        .unwrap_or_else(|| panic!("{what}: the subscription ended"))
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Panics if anything is delivered within `wait`.
async fn nothing_within(subscription: &mut Box<dyn Subscription>, wait: Duration, what: &str) {
    if let Ok(Some(delivered)) = timeout(wait, subscription.next()).await {
        match delivered {
            Ok(d) => panic!("{what}: delivered again (attempt {})", d.attempt()),
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// A delivery dropped without settlement (a worker that died before
/// settling) is not lost: it comes back with the same body and a higher
/// attempt count. Where the backend holds deliveries for a time, the
/// dropped one is handed back at once rather than left to that hold. A poll
/// dropped while it waits loses nothing either (subscriptions are
/// cancel-safe).
pub async fn abandoned_delivery_returns_with_a_higher_attempt(backend: &dyn Backend) {
    let h = Harness::new(backend, "abandoned").await;
    let hold = h.driver.capabilities().redelivery_hint;
    let mut subscription = h.driver.subscribe(&h.queue, 1).await.unwrap();
    // A poll dropped while it waits...
    nothing_within(&mut subscription, MS(100), "an empty queue").await;
    h.driver
        .send(&h.queue, message("abandoned", b"payload"))
        .await
        .unwrap();
    // ...keeps nothing back: the message is handed out next.
    let first = next_within(&mut subscription, h.patience, "the message").await;
    assert_eq!(first.attempt(), 1);
    let dropped = Instant::now();
    drop(first);
    let again = next_within(
        &mut subscription,
        h.patience + hold,
        "the abandoned message",
    )
    .await;
    let back_after = dropped.elapsed();
    assert_eq!(again.body(), b"payload");
    assert_eq!(again.attempt(), 2, "the abandoned delivery counts");
    if !hold.is_zero() {
        assert!(
            back_after < hold,
            "handed back after {back_after:?}: not at once, but when the backend's hold of {hold:?} ended"
        );
    }
    again.settle(&Settlement::Ack).await.unwrap();
    nothing_within(&mut subscription, hold + MS(300), "an acknowledged message").await;
}

/// A handler running three times the backend's hold on a delivery (a
/// lease, a visibility timeout) is executed once: the hold is renewed while
/// it runs, and nothing comes back after the acknowledgement.
pub async fn long_handler_keeps_its_delivery(backend: &dyn Backend) {
    let driver = backend
        .short_hold()
        .await
        .expect("registered only for backends offering a short hold");
    let hold = driver.capabilities().redelivery_hint;
    assert!(
        !hold.is_zero(),
        "a short hold is reported as the redelivery hint"
    );
    let h = Harness::on(backend, driver, Harness::queue_name("held"));
    let job = h.job("held").max_deliveries(5).build().unwrap();
    let calls = Calls::default();
    let c = calls.clone();
    let mut registry = Registry::new();
    registry
        .register(&job, move |ctx, _: Work| {
            c.record(&ctx);
            async move {
                tokio::time::sleep(hold * 3).await;
                Ok(())
            }
        })
        .unwrap();
    // Two slots: a redelivery would be taken while the first still runs.
    let consumer = h.start(registry, 2);
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    h.events
        .wait_count(hold * 3 + h.patience, "succeeded", 1)
        .await;
    // Past another two holds: nothing comes back.
    tokio::time::sleep(hold * 2).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.attempts(), [1], "executed exactly once");
    assert_eq!(h.events.names(), ["succeeded"]);
}

/// A retry whose delay is above the backend's `max_retry_delay` is refused
/// as unsupported, and the message is kept, but held: it comes back with
/// the same body and a higher attempt no sooner than the backend's
/// `refused_hold` (its lease), never at once, and once acknowledged it is
/// gone.
pub async fn refused_retry_delay_keeps_the_message(backend: &dyn Backend) {
    let h = Harness::new(backend, "refused-delay").await;
    let capabilities = h.driver.capabilities();
    let max = capabilities
        .max_retry_delay
        .expect("registered only for backends with a maximum retry delay");
    let hold = capabilities.redelivery_hint;
    let refused_hold = capabilities.refused_hold;
    assert!(!refused_hold.is_zero(), "a refused settlement is held");
    h.driver
        .send(&h.queue, message("kept", b"keep me"))
        .await
        .unwrap();
    let mut subscription = h.driver.subscribe(&h.queue, 1).await.unwrap();
    let first = next_within(&mut subscription, h.patience, "the message").await;
    assert_eq!(first.attempt(), 1);
    let refused = first
        .settle(&Settlement::Retry {
            delay: Some(max + Duration::from_secs(1)),
            shutdown: false,
        })
        .await
        .expect_err("a retry delay above max_retry_delay was accepted");
    let refused_at = Instant::now();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    let again = next_within(
        &mut subscription,
        h.patience + refused_hold * 2 + hold,
        "the kept message",
    )
    .await;
    let away = refused_at.elapsed();
    assert!(
        away >= refused_hold,
        "back after {away:?}, sooner than the refused-settlement hold of {refused_hold:?}"
    );
    assert_eq!(again.body(), b"keep me");
    assert_eq!(again.attempt(), 2);
    again.settle(&Settlement::Ack).await.unwrap();
    nothing_within(&mut subscription, hold + MS(300), "an acknowledged message").await;
}

/// Retry delays off any backend's grid (whole seconds, delay buckets):
/// 1.2 s and 1.7 s.
pub const OFF_GRID_DELAYS: [Duration; 2] =
    [Duration::from_millis(1200), Duration::from_millis(1700)];

/// A backend may round a retry delay (SQS to whole seconds, RabbitMQ to its
/// delay buckets) but only up: delays off its grid are never delivered
/// before the time requested.
pub async fn retry_delays_are_never_rounded_down(backend: &dyn Backend) {
    let h = Harness::new(backend, "off-grid").await;
    let job = h.job("off-grid").max_deliveries(3).build().unwrap();
    let calls = Calls::default();
    let consumer = h.start(
        {
            let mut registry = Registry::new();
            registry
                .register(
                    &job,
                    calls.handler(|_, n| match OFF_GRID_DELAYS.get(n - 1) {
                        Some(delay) => Err(JobError::retry_after("come back later", *delay)),
                        None => Ok(()),
                    }),
                )
                .unwrap();
            registry
        },
        1,
    );
    h.producer
        .dispatch(&job)
        .send(&Work { id: 1 })
        .await
        .unwrap();
    let longest = OFF_GRID_DELAYS.iter().sum::<Duration>();
    h.events
        .wait_count(longest * 2 + h.patience, "succeeded", 1)
        .await;
    consumer.shutdown().await.unwrap();
    assert_eq!(calls.attempts(), [1, 2, 3]);
    for (gap, requested) in calls.gaps().iter().zip(OFF_GRID_DELAYS) {
        assert!(
            *gap >= requested,
            "delivered again after {gap:?}, {requested:?} was requested"
        );
    }
}

/// The deliveries the backend allows in [`delivery_limit_is_checked_at_start`].
const LIMIT: u32 = 4;

/// A backend that ends a message on its own after `LIMIT` deliveries (no
/// failure record) refuses, when the consumer starts, a job whose attempt
/// cap needs more: a configuration error naming the job and the limit. The
/// unknown-name rule is checked too. A registry whose caps fit starts, and
/// the messages sent meanwhile are all still there, each on its first
/// delivery.
pub async fn delivery_limit_is_checked_at_start(backend: &dyn Backend) {
    let queue = Harness::queue_name("limited");
    let driver = backend
        .delivery_limited(&queue, LIMIT)
        .await
        .expect("registered only for backends with a delivery limit");
    assert_eq!(
        driver.delivery_limit(&queue).await.unwrap(),
        Some(LIMIT),
        "the limit the driver reports for the queue"
    );
    let h = Harness::on(backend, driver, queue);
    let counted = h.driver.capabilities().counts_shutdown_returns;
    // The largest cap and unknown-name cap the limit leaves room for.
    let fits = (1..LIMIT)
        .filter(|cap| jobrail::deliveries_needed(*cap, counted).is_some_and(|n| n <= LIMIT))
        .max()
        .expect("a limit of 4 leaves room for some cap");
    let unknown = (1..LIMIT)
        .filter(|cap| {
            jobrail::unknown_name_deliveries_needed(Some(*cap)).is_some_and(|n| n <= LIMIT)
        })
        .max()
        .expect("a limit of 4 leaves room for some unknown-name cap");
    let job = |cap| {
        h.job("limited")
            .delivery_cap((cap > 0).then_some(cap))
            .build()
            .unwrap()
    };
    for id in 1..=2 {
        h.producer
            .dispatch(&job(fits))
            .send(&Work { id })
            .await
            .unwrap();
    }
    let calls = Calls::default();
    let registry = |cap, unknown| {
        let mut registry = Registry::new();
        registry
            .register(&job(cap), calls.handler(|_, _| Ok(())))
            .unwrap();
        registry.unknown_name_attempts(unknown);
        registry
    };

    // A cap needing one delivery more than the backend gives.
    let refused = h
        .start(registry(fits + 1, UnknownNameAttempts::limited(unknown)), 1)
        .shutdown()
        .await
        .expect_err("a job needing more deliveries than the backend gives started");
    assert_eq!(refused.kind(), ErrorKind::Config, "{refused}");
    let text = refused.to_string();
    for part in ["`limited`", &LIMIT.to_string(), &h.queue] {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
    // The unknown-name rule: by default a stray name is retried for longer.
    let refused = h
        .start(registry(fits, UnknownNameAttempts::default()), 1)
        .shutdown()
        .await
        .expect_err("an unknown-name cap needing more deliveries than the backend gives started");
    assert_eq!(refused.kind(), ErrorKind::Config, "{refused}");
    assert!(refused.to_string().contains("unknown"), "{refused}");
    assert!(h.events.all().is_empty(), "a refused consumer took nothing");

    let consumer = h.start(registry(fits, UnknownNameAttempts::limited(unknown)), 1);
    h.events.wait_count(h.patience, "succeeded", 2).await;
    consumer.shutdown().await.unwrap();
    assert_eq!(
        calls.attempts(),
        [1, 1],
        "both messages were still there, never delivered"
    );
}

/// Panics if `secret` is in `text`.
fn hidden(secrets: &[String], what: &str, text: &str) {
    for secret in secrets {
        assert!(
            !text.contains(secret.as_str()),
            "a secret in {what}: {text}"
        );
    }
}

/// Checks an error and every cause under it (`Display` and `Debug`).
fn hidden_in_error(secrets: &[String], what: &str, err: &DriverError) {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        hidden(secrets, what, &e.to_string());
        hidden(secrets, what, &format!("{e:?}"));
        cause = e.source();
    }
}

/// A backend that cannot be reached: a dispatch is certainly not accepted,
/// connecting is a connection error, and no secret of the configuration (a
/// password, keys, a token) appears in the configuration's `Debug`, nor in
/// any error's text, `Debug` or chain of causes.
pub async fn unreachable_backend_hides_its_secrets(backend: &dyn Backend) {
    let unreachable = backend
        .unreachable()
        .await
        .expect("registered only for backends whose configuration holds secrets");
    let secrets = &unreachable.secrets;
    assert!(!secrets.is_empty());
    assert!(!unreachable.drivers.is_empty());
    for config in &unreachable.configs {
        hidden(secrets, "a configuration's Debug", config);
    }
    for driver in &unreachable.drivers {
        let err = driver
            .send("nowhere", outgoing("x", None))
            .await
            .expect_err("a dispatch where nothing listens succeeded");
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
        hidden_in_error(secrets, "a dispatch error", &err);
    }
    for connected in unreachable.connected {
        let err = connected
            .err()
            .expect("connecting where nothing listens succeeded");
        assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
        hidden_in_error(secrets, "a connection error", &err);
    }
}
