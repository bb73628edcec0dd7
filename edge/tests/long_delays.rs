//! Dispatch delays beyond the platform's 24 hours, in the native harness:
//! the envelope carries its due time, the message goes out delayed by a
//! day, and every delivery before the due time is a step (a copy sent back
//! to the queue, delayed by the next leg) that neither runs the handler nor
//! counts an attempt. Virtual time: a 3-day delay takes no real time.

#![cfg(not(target_arch = "wasm32"))]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jobrail::{Envelope, EventKind, Job, JobContext, JobError, Registry, RegistryError};
use jobrail_edge::testing::{Call, CloudflareQueues, MessageState};
use jobrail_edge::{Options, MAX_DELAY};

const DAY: Duration = MAX_DELAY;
const HOUR: Duration = Duration::from_secs(3600);

const WRANGLER: &str = r#"
[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.producers]]
queue = "failed"
binding = "FAILED"

[[queues.consumers]]
queue = "jobs"
max_batch_size = 4
max_batch_timeout = 1
max_retries = 10
dead_letter_queue = "jobs-dlq"
"#;

const OPTIONS: Options = Options {
    failure_queue: Some("FAILED"),
    log_settlements: false,
    ..Options::DEFAULT
};

fn job() -> Job<u32> {
    Job::<u32>::builder("remind")
        .queue("jobs")
        .max_deliveries(3)
        .build()
        .unwrap()
}

/// The harness, and what the handler saw: one entry per execution, the
/// attempt it ran as.
fn harness() -> (CloudflareQueues, Arc<std::sync::Mutex<Vec<u32>>>) {
    let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = runs.clone();
    let jobs = move || -> Result<Registry, RegistryError> {
        let mut registry = Registry::new();
        let seen = seen.clone();
        registry.register(&job(), move |ctx: JobContext, _: u32| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(ctx.attempt());
                Ok::<(), JobError>(())
            }
        })?;
        Ok(registry)
    };
    let cf = CloudflareQueues::new(WRANGLER, jobs, OPTIONS).expect("the configuration fits");
    (cf, runs)
}

#[test]
fn a_three_day_delay_takes_three_legs_and_runs_once_as_attempt_one() {
    let (mut cf, runs) = harness();
    let sent_ms = cf.unix_now_ms();
    let id = cf.send_with_delay(&job(), &7, 3 * DAY);
    let due_ms = Envelope::decode(&cf.message(&id).body)
        .unwrap()
        .due_ms
        .expect("the envelope carries its due time");
    assert_eq!(due_ms, sent_ms + 3 * 86_400_000);
    assert_eq!(cf.queued("jobs")[0].visible_at, DAY, "the first leg: a day");

    cf.run_until_idle();

    let legs = cf.legs(&id);
    assert_eq!(legs.len(), 3, "ceil(3 days / 24 h) messages: {legs:#?}");
    for step in &legs[..2] {
        assert!(
            matches!(step.state, MessageState::SentOn { .. }),
            "{step:#?}"
        );
        assert_eq!(step.attempts(), [1], "one delivery each");
        assert_eq!(step.executions(), 0, "a step never reaches the handler");
        assert_eq!(step.events().count(), 0, "a step is no settlement");
        assert_eq!(step.body, legs[0].body, "every copy is the same body");
    }
    let last = legs[2];
    assert_eq!(last.state, MessageState::Acked);
    assert_eq!(last.attempts(), [1], "no attempt was counted by the steps");
    assert_eq!(*runs.lock().unwrap(), [1], "ran once, as attempt 1");
    // Due when it ran, and late by no more than the batch wait (1 s) and
    // the rounding of the last leg to whole seconds.
    let ran_at = last.deliveries[0].delivered_at;
    assert!(ran_at >= 3 * DAY, "{ran_at:?}");
    assert!(ran_at <= 3 * DAY + Duration::from_secs(2), "{ran_at:?}");
    let stepped: usize = cf.batches().iter().map(|b| b.summary.stepped).sum();
    assert_eq!(stepped, 2);
    let outcomes: Vec<_> = cf.events().iter().map(|e| e.event.kind.clone()).collect();
    assert!(
        matches!(outcomes.as_slice(), [EventKind::Succeeded { .. }]),
        "{outcomes:?}"
    );
}

/// `ceil(delay / 24 h)` messages. (A remainder shorter than the batch
/// waits the legs took, a second each here, is absorbed by them: one day
/// and one second takes one leg, delivered a second late at most.)
#[test]
fn the_leg_count_is_the_delay_in_days_rounded_up() {
    for (delay, legs) in [
        (DAY, 1),
        (DAY + Duration::from_secs(1), 1),
        (DAY + Duration::from_secs(10), 2),
        (3 * DAY + HOUR, 4),
        (10 * DAY, 10),
        (30 * DAY, 30),
    ] {
        let (mut cf, runs) = harness();
        let id = cf.send_with_delay(&job(), &1, delay);
        cf.run_until_idle();
        let taken = cf.legs(&id);
        assert_eq!(taken.len(), legs, "{delay:?}");
        assert_eq!(*runs.lock().unwrap(), [1], "{delay:?}");
        let ran_at = taken.last().unwrap().deliveries[0].delivered_at;
        assert!(
            ran_at >= delay && ran_at <= delay + Duration::from_secs(2),
            "{delay:?}: ran at {ran_at:?}"
        );
    }
}

#[test]
fn within_24_hours_the_platform_holds_the_delay_alone() {
    let (mut cf, runs) = harness();
    let id = cf.send_with_delay(&job(), &1, 20 * HOUR);
    assert_eq!(
        Envelope::decode(&cf.message(&id).body).unwrap().due_ms,
        None,
        "no due time within the platform's limit"
    );
    cf.run_until_idle();
    assert_eq!(cf.legs(&id).len(), 1);
    assert_eq!(cf.state(&id), &MessageState::Acked);
    assert_eq!(*runs.lock().unwrap(), [1]);
}

#[test]
fn a_step_that_cannot_be_sent_is_retried_for_the_leg_and_nothing_is_lost() {
    let (mut cf, runs) = harness();
    let id = cf.send_with_delay(&job(), &1, 3 * DAY);
    // The first step's copy is refused by the binding.
    cf.fail_sends("JOBS", 1);
    cf.run_until_idle();
    let first = cf.message(&id);
    assert_eq!(
        first.deliveries[0].call,
        Some(Call::Retry {
            delay_seconds: Some(86_400)
        }),
        "handed back for the leg"
    );
    assert_eq!(
        first.attempts(),
        [1, 2],
        "the platform counted one delivery"
    );
    assert!(matches!(first.state, MessageState::SentOn { .. }));
    let legs = cf.legs(&id);
    assert_eq!(legs.len(), 2, "the retry was a leg of its own");
    let last = legs.last().unwrap();
    assert_eq!(last.attempts(), [1], "the copy starts afresh");
    assert_eq!(*runs.lock().unwrap(), [1]);
    let ran_at = last.deliveries[0].delivered_at;
    assert!(ran_at >= 3 * DAY && ran_at <= 3 * DAY + Duration::from_secs(3));
}

#[test]
fn an_envelope_already_due_runs_at_once() {
    let (mut cf, runs) = harness();
    let mut envelope = Envelope::new("remind", serde_json::json!(1));
    envelope.due_ms = Some(cf.unix_now_ms());
    let id = cf.send_raw("jobs", envelope.encode());
    cf.run_until_idle();
    assert_eq!(cf.state(&id), &MessageState::Acked);
    assert_eq!(*runs.lock().unwrap(), [1]);

    // One due in 90 s: one step of 90 s, then it runs.
    let mut envelope = Envelope::new("remind", serde_json::json!(2));
    envelope.due_ms = Some(cf.unix_now_ms() + 90_000);
    let start = cf.now();
    let id = cf.send_raw("jobs", envelope.encode());
    cf.run_until_idle();
    let legs = cf.legs(&id);
    assert_eq!(legs.len(), 2);
    let ran_at = legs[1].deliveries[0].delivered_at - start;
    assert!(
        ran_at >= Duration::from_secs(90) && ran_at <= Duration::from_secs(93),
        "{ran_at:?}"
    );
    assert_eq!(*runs.lock().unwrap(), [1, 1]);
}

#[test]
fn many_long_delays_in_one_batch_each_step_on_their_own() {
    let (mut cf, runs) = harness();
    let ids: Vec<String> = (1..=6)
        .map(|n| cf.send_with_delay(&job(), &n, 2 * DAY + HOUR * n))
        .collect();
    cf.run_until_idle();
    for id in &ids {
        assert_eq!(cf.legs(id).len(), 3, "49..54 h: three legs");
    }
    assert_eq!(runs.lock().unwrap().len(), 6);
    assert!(runs.lock().unwrap().iter().all(|&a| a == 1));
    let handled = AtomicU32::new(0);
    for b in cf.batches() {
        handled.fetch_add(b.messages.len() as u32, Ordering::Relaxed);
    }
    assert_eq!(handled.load(Ordering::Relaxed), 18, "three deliveries each");
}
