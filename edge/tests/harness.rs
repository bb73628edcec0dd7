//! The native Cloudflare Queues harness, from the platform's rules and the
//! facade's: each test states what Cloudflare and DESIGN.md say must happen
//! and checks the harness's record of it.

#![cfg(not(target_arch = "wasm32"))]

use std::time::Duration;

use jobrail::{EventKind, FailureKind, Job, JobContext, JobError, Registry, RegistryError};
use jobrail_edge::testing::{Call, CloudflareQueues, MessageReport, MessageState};
use jobrail_edge::Options;
use serde::{Deserialize, Serialize};

const S: fn(u64) -> Duration = Duration::from_secs;
const MS: fn(u64) -> Duration = Duration::from_millis;

/// One job queue consumed in batches of up to 4 (1 s to fill), 11
/// deliveries per message, a dead-letter queue, and a failure queue.
const WRANGLER: &str = r#"
[vars]
UNKNOWN_NAME_RETRY_DELAY_MS = "1000"

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
retry_delay = 1
dead_letter_queue = "jobs-dlq"
"#;

const OPTIONS: Options = Options {
    failure_queue: Some("FAILED"),
    ..Options::DEFAULT
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Behaviour {
    Succeed,
    Fail,
    FailFirstDelivery,
    Permanent,
    Reject,
    Panic,
    /// Sleeps this many milliseconds (cut short by the deadline), then succeeds.
    Sleep(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Task {
    id: u32,
    behaviour: Behaviour,
}

fn task(id: u32, behaviour: Behaviour) -> Task {
    Task { id, behaviour }
}

async fn handle(ctx: JobContext, task: Task) -> Result<(), JobError> {
    match task.behaviour {
        Behaviour::Succeed => Ok(()),
        Behaviour::Fail => Err(JobError::new("upstream unavailable")),
        Behaviour::FailFirstDelivery if ctx.attempt() == 1 => Err(JobError::new("bad host")),
        Behaviour::FailFirstDelivery => Ok(()),
        Behaviour::Permanent => Err(JobError::permanent("the record is gone")),
        Behaviour::Reject => Err(JobError::reject("another tenant's task")),
        Behaviour::Panic => panic!("bug in task {}", task.id),
        Behaviour::Sleep(ms) => {
            let _ = ctx.sleep(MS(ms)).await;
            Ok(())
        }
    }
}

/// A job on `jobs`; `build` sets its policy.
fn task_job(
    build: impl FnOnce(jobrail::JobBuilder<Task>) -> jobrail::JobBuilder<Task>,
) -> Job<Task> {
    build(Job::<Task>::builder("task").queue("jobs"))
        .build()
        .expect("a valid job")
}

fn try_harness(wrangler: &str, job: &Job<Task>) -> Result<CloudflareQueues, String> {
    let job = job.clone();
    let jobs = move || -> Result<Registry, RegistryError> {
        let mut registry = Registry::new();
        registry.register(&job, handle)?;
        Ok(registry)
    };
    CloudflareQueues::new(wrangler, jobs, OPTIONS)
}

fn harness(job: &Job<Task>) -> CloudflareQueues {
    try_harness(WRANGLER, job).expect("the configuration fits")
}

fn failed_kind(report: &MessageReport) -> Option<FailureKind> {
    match &report.state {
        MessageState::Failed { failure, .. } => Some(failure.kind),
        _ => None,
    }
}

#[test]
fn a_healthy_job_is_acknowledged_on_its_first_delivery() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    let id = cf.send(&job, &task(1, Behaviour::Succeed));
    assert_eq!(cf.state(&id), &MessageState::Pending);
    assert_eq!(cf.run_until_idle(), 1);

    let report = cf.message(&id);
    assert_eq!(report.state, MessageState::Acked);
    assert_eq!(report.attempts(), [1]);
    assert_eq!(report.executions(), 1);
    assert_eq!(report.deliveries[0].call, Some(Call::Ack));
    let outcome = report.deliveries[0].outcome().expect("an accepted outcome");
    assert_eq!(outcome.kind.name(), "succeeded");
    assert_eq!(
        outcome.message_id, id,
        "the envelope's id is the message id"
    );
    assert!(cf.failure_records().is_empty());
    assert!(cf.queued("jobs").is_empty());
    // The batch waited max_batch_timeout (1 s) to fill.
    assert_eq!(cf.batches()[0].started, S(1));
}

#[test]
fn retry_delays_are_the_backoff_rounded_up_to_whole_seconds() {
    // retry(4) with backoff(1.5 s, x2): 1.5, 3 and 6 s before deliveries 2-4;
    // the platform takes whole seconds, never fewer than asked: 2, 3, 6.
    let job = task_job(|b| b.max_deliveries(4).backoff(MS(1500), 2.0, S(10)));
    let mut cf = harness(&job);
    let id = cf.send(&job, &task(1, Behaviour::Fail));
    cf.run_until_idle();

    let report = cf.message(&id);
    assert_eq!(report.attempts(), [1, 2, 3, 4], "attempts count up");
    assert_eq!(report.retry_delays(), [Some(2), Some(3), Some(6)]);
    assert_eq!(failed_kind(report), Some(FailureKind::AttemptsExhausted));
    for pair in report.deliveries.windows(2) {
        let Some(Call::Retry {
            delay_seconds: Some(delay),
        }) = pair[0].call
        else {
            panic!("a retry with a delay: {:?}", pair[0].call);
        };
        let called = pair[0].called_at.expect("the call's time");
        assert!(
            pair[1].delivered_at >= called + S(delay.into()),
            "redelivered no sooner than the delay: {pair:?}"
        );
    }
    // The events carry the rules' own delay, before rounding.
    let delays: Vec<Option<Duration>> = report
        .events()
        .filter_map(|e| match &e.event.kind {
            EventKind::Retried { delay, .. } => Some(*delay),
            _ => None,
        })
        .collect();
    assert_eq!(delays, [Some(MS(1500)), Some(S(3)), Some(S(6))]);
}

#[test]
fn an_always_failing_job_ends_in_one_failure_record_at_its_cap() {
    // Two tiers: 2 in-process attempts per delivery, 3 deliveries.
    let job = task_job(|b| {
        b.max_deliveries(3)
            .backoff(S(1), 2.0, S(10))
            .tier_one(2)
            .tier_one_backoff(MS(10), 2.0, MS(100))
    });
    let mut cf = harness(&job);
    let id = cf.send(&job, &task(7, Behaviour::Fail));
    cf.run_until_idle();

    let report = cf.message(&id);
    assert_eq!(report.attempts(), [1, 2, 3]);
    assert_eq!(report.executions(), 2 * 3, "tier one x deliveries");
    assert!(report.deliveries.iter().all(|d| d.executions() == 2));
    let records = cf.failure_records();
    assert_eq!(records.len(), 1, "exactly one record");
    let record = &records[0];
    assert_eq!(Some(record), report.failure_record());
    assert_eq!(record.kind, FailureKind::AttemptsExhausted);
    assert_eq!(record.attempt, 3, "recorded at the cap");
    assert_eq!(record.executions, 2, "the last delivery's executions");
    assert_eq!(record.job.as_deref(), Some("task"));
    assert_eq!(record.message_id.as_deref(), Some(id.as_str()));
    assert_eq!(record.queue, "jobs");
    assert!(record.reason.contains("upstream unavailable"), "{record:?}");
    assert_eq!(
        report.deliveries[2].call,
        Some(Call::Ack),
        "acked after the record"
    );
    assert!(cf.dead_letter("jobs").is_empty());
}

#[test]
fn a_permanent_error_fails_at_once() {
    let job = task_job(|b| b.max_deliveries(5).tier_one(3));
    let mut cf = harness(&job);
    let id = cf.send(&job, &task(1, Behaviour::Permanent));
    cf.run_until_idle();

    let report = cf.message(&id);
    assert_eq!(report.attempts(), [1]);
    assert_eq!(report.executions(), 1, "permanent skips tier one");
    assert_eq!(failed_kind(report), Some(FailureKind::Permanent));
    assert_eq!(
        report.failure_record().map(|r| r.kind),
        Some(FailureKind::Permanent)
    );
    assert_eq!(cf.failure_records().len(), 1);
}

#[test]
fn a_rejection_is_acknowledged_by_returning() {
    let job = task_job(|b| b.max_deliveries(3).tier_one(3));
    let mut cf = harness(&job);
    let id = cf.send(&job, &task(1, Behaviour::Reject));
    cf.run_until_idle();

    let report = cf.message(&id);
    assert_eq!(report.state, MessageState::Rejected);
    assert_eq!(report.attempts(), [1], "never redelivered");
    assert_eq!(report.executions(), 1);
    assert_eq!(
        report.deliveries[0].call, None,
        "no request to the platform"
    );
    assert_eq!(
        report.deliveries[0].outcome().map(|e| e.kind.name()),
        Some("rejected")
    );
    assert!(cf.failure_records().is_empty(), "no record");
    assert!(cf.dead_letter("jobs").is_empty());
}

#[test]
fn a_slow_batch_hands_later_messages_back_without_running_them() {
    // A 10 s budget with 1 s kept for settling: work must start before 9 s.
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    cf.var("EDGE_BUDGET_MS", "10000")
        .unwrap()
        .var("EDGE_RESERVE_MS", "1000")
        .unwrap();
    let ids: Vec<String> = (1..=3)
        .map(|n| cf.send(&job, &task(n, Behaviour::Sleep(6000))))
        .collect();

    let first = cf.run_batch().expect("a batch");
    assert_eq!(first.messages, ids, "sent together, delivered together");
    assert_eq!(first.summary.messages, 3);
    assert_eq!(first.summary.deferred, 1);
    // The first sleeps 6 s; the second is cut at the budget's end (9 s);
    // the third is reached at 9 s and handed back.
    assert_eq!(first.finished - first.started, S(9));
    cf.run_until_idle();

    for id in &ids[..2] {
        let report = cf.message(id);
        assert_eq!((report.attempts(), report.executions()), (vec![1], 1));
        assert_eq!(report.state, MessageState::Acked);
    }
    let late = cf.message(&ids[2]);
    assert_eq!(late.attempts(), [1, 2], "the hand-back spent a delivery");
    assert_eq!(late.deliveries[0].executions(), 0, "it did not run");
    assert_eq!(
        late.deliveries[0].call,
        Some(Call::Retry {
            delay_seconds: Some(0)
        })
    );
    assert!(matches!(
        late.deliveries[0].outcome().map(|e| &e.kind),
        Some(EventKind::Retried { shutdown: true, .. })
    ));
    assert_eq!(late.executions(), 1);
    assert_eq!(late.state, MessageState::Acked);
}

#[test]
fn a_message_handed_back_on_every_delivery_reaches_the_dead_letter_queue() {
    // The platform counts every delivery, run or not: once max_retries is
    // used up, it moves the message to the dead-letter queue.
    let wrangler = r#"
[vars]
EDGE_BUDGET_MS = "10000"
EDGE_RESERVE_MS = "1000"
UNKNOWN_NAME_ATTEMPTS = "2"

[[queues.producers]]
queue = "failed"
binding = "FAILED"

[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.consumers]]
queue = "jobs"
max_batch_size = 2
max_batch_timeout = 1
max_retries = 2
dead_letter_queue = "jobs-dlq"
"#;
    let job = task_job(|b| b.max_deliveries(1));
    let mut cf = try_harness(wrangler, &job).expect("cap 1 needs 3 deliveries");
    // Each batch pairs a slow message (first) with the victim (second).
    cf.send(&job, &task(1, Behaviour::Sleep(9000)));
    let victim = cf.send(&job, &task(2, Behaviour::Succeed));
    cf.send_with_delay(&job, &task(3, Behaviour::Sleep(9000)), S(9));
    cf.send_with_delay(&job, &task(4, Behaviour::Sleep(9000)), S(18));
    cf.run_until_idle();

    let report = cf.message(&victim);
    assert_eq!(report.attempts(), [1, 2, 3]);
    assert_eq!(report.executions(), 0);
    let MessageState::DeadLettered { queue, id } = &report.state else {
        panic!("dead-lettered: {:?}", report.state);
    };
    assert_eq!(queue, "jobs-dlq");
    let dead = cf.dead_letter("jobs");
    assert_eq!(dead.len(), 1);
    assert_eq!(&dead[0].id, id);
    assert_eq!(dead[0].body, report.body, "the same body");
    assert_eq!(cf.state(id), &MessageState::Pending, "not consumed here");
    assert!(cf.failure_records().is_empty());
}

#[test]
fn new_refuses_a_max_retries_below_the_jobs_cap_and_names_the_job() {
    let wrangler = WRANGLER.replace("max_retries = 10", "max_retries = 3");
    // With the default unknown-name cap two problems; name both.
    let job = task_job(|b| b.max_deliveries(3));
    let err = try_harness(&wrangler, &job).unwrap_err();
    assert!(err.contains("job `task`: invalid `retry`"), "{err}");
    assert!(err.contains("max_retries = 3"), "{err}");
    assert!(err.contains("invalid `unknown_name_attempts`"), "{err}");
    // A cap of 2 needs 4 deliveries: max_retries = 3 is enough for the job.
    let wrangler =
        format!("{wrangler}\n").replace("[vars]\n", "[vars]\nUNKNOWN_NAME_ATTEMPTS = \"3\"\n");
    assert!(try_harness(&wrangler, &task_job(|b| b.max_deliveries(2))).is_ok());
}

#[test]
fn var_refuses_what_the_worker_would_refuse() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    let err = cf.var("UNKNOWN_NAME_ATTEMPTS", "50").unwrap_err();
    assert!(err.contains("unknown_name_attempts"), "{err}");
    let err = cf.var("EDGE_BUDGET_MS", "soon").unwrap_err();
    assert!(err.contains("EDGE_BUDGET_MS"), "{err}");
    let err = cf.var("EDGE_BUDGET", "1000").unwrap_err();
    assert!(err.contains("EDGE_BUDGET_MS"), "lists the variables: {err}");
    // Refused values are not kept.
    let id = cf.send(&job, &task(1, Behaviour::Succeed));
    cf.run_until_idle();
    assert_eq!(cf.state(&id), &MessageState::Acked);
}

#[test]
fn an_unknown_job_name_fails_after_the_unknown_name_cap() {
    let job = task_job(|b| b.max_deliveries(3));
    // A job this worker does not know (deployed to a newer worker).
    let renamed = Job::<Task>::builder("renamed")
        .queue("jobs")
        .build()
        .unwrap();

    // The default cap: retried (here every 1 s, from [vars]) until the
    // delivery count reaches 10, then failed with nothing run.
    let mut cf = harness(&job);
    let id = cf.send(&renamed, &task(1, Behaviour::Succeed));
    cf.run_until_idle();
    let report = cf.message(&id);
    assert_eq!(report.attempts(), (1..=10).collect::<Vec<_>>());
    assert_eq!(report.retry_delays(), vec![Some(1); 9]);
    assert_eq!(report.executions(), 0);
    assert_eq!(failed_kind(report), Some(FailureKind::UnknownName));
    let record = report.failure_record().expect("a record");
    assert_eq!(record.job.as_deref(), Some("renamed"));
    assert_eq!(record.attempt, 10);

    // An operator's cap of 3.
    let mut cf = harness(&job);
    cf.var("UNKNOWN_NAME_ATTEMPTS", "3").unwrap();
    let id = cf.send(&renamed, &task(1, Behaviour::Succeed));
    cf.run_until_idle();
    assert_eq!(cf.message(&id).attempts(), [1, 2, 3]);
    assert_eq!(failed_kind(cf.message(&id)), Some(FailureKind::UnknownName));
}

#[test]
fn a_malformed_body_fails_at_once_with_its_raw_body() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    let id = cf.send_raw("jobs", "{not json");
    cf.run_until_idle();
    let report = cf.message(&id);
    assert_eq!(report.attempts(), [1]);
    assert_eq!(failed_kind(report), Some(FailureKind::MalformedEnvelope));
    let record = report.failure_record().expect("a record");
    assert_eq!(
        record.raw_body.as_ref().map(|b| b.to_bytes()),
        Some(b"{not json".to_vec())
    );
}

#[test]
fn a_failed_failure_queue_send_keeps_the_message() {
    let job = task_job(|b| b.max_deliveries(2));
    let mut cf = harness(&job);
    cf.fail_sends("FAILED", 1);
    let id = cf.send(&job, &task(1, Behaviour::Fail));
    cf.run_until_idle();

    let report = cf.message(&id);
    // Delivery 2 reached the cap, but its record could not be sent: the
    // message was kept, held 30 s as a lease would hold it (never handed
    // straight back, which would loop), not lost.
    let refused = &report.deliveries[1];
    assert!(
        refused.events.iter().all(|e| e.refused.is_some()),
        "{refused:?}"
    );
    assert_eq!(refused.outcome(), None, "no outcome reported");
    assert_eq!(
        refused.call,
        Some(Call::Retry {
            delay_seconds: Some(30)
        })
    );
    // Redelivered, run again, and recorded once the send worked.
    assert_eq!(report.attempts(), [1, 2, 3]);
    assert_eq!(report.executions(), 3);
    assert_eq!(failed_kind(report), Some(FailureKind::AttemptsExhausted));
    let records = cf.failure_records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].attempt, 3);
}

/// What the platform did with a message, for comparing runs.
fn settlements(report: &MessageReport) -> (String, Vec<u32>, u32, Vec<Option<u32>>) {
    let state = match &report.state {
        MessageState::Failed { failure, .. } => format!("failed: {:?}", failure.kind),
        other => format!("{other:?}"),
    };
    (
        state,
        report.attempts(),
        report.executions(),
        report.retry_delays(),
    )
}

#[test]
fn a_panic_settles_only_its_own_message() {
    // No tier one: the settlements are the same natively and at the edge.
    let job = task_job(|b| b.max_deliveries(3).backoff(S(1), 2.0, S(10)));
    let tasks = [
        task(1, Behaviour::Succeed),
        task(2, Behaviour::Panic),
        task(3, Behaviour::FailFirstDelivery),
    ];
    let mut together = harness(&job);
    let ids: Vec<String> = tasks.iter().map(|t| together.send(&job, t)).collect();
    let first = together.run_batch().expect("a batch");
    assert_eq!(first.messages, ids, "one batch");
    together.run_until_idle();

    let panicked = together.message(&ids[1]);
    assert_eq!(panicked.attempts(), [1, 2, 3]);
    assert_eq!(failed_kind(panicked), Some(FailureKind::AttemptsExhausted));
    let record = panicked.failure_record().expect("a record");
    assert!(record.reason.contains("bug in task 2"), "{record:?}");
    assert_eq!(together.state(&ids[0]), &MessageState::Acked);
    assert_eq!(together.message(&ids[0]).attempts(), [1]);

    // Each message settles as it does alone.
    for (task, id) in tasks.iter().zip(&ids) {
        let mut alone = harness(&job);
        let alone_id = alone.send(&job, task);
        alone.run_until_idle();
        assert_eq!(
            settlements(together.message(id)),
            settlements(alone.message(&alone_id)),
            "{task:?}"
        );
    }
}

#[test]
fn messages_sent_together_are_delivered_together_up_to_the_batch_size() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    let ids: Vec<String> = (1..=6)
        .map(|n| cf.send(&job, &task(n, Behaviour::Succeed)))
        .collect();
    let first = cf.run_batch().unwrap();
    assert_eq!(first.messages, ids[..4], "a full batch goes at once");
    assert_eq!(first.started, S(0));
    let second = cf.run_batch().unwrap();
    assert_eq!(
        second.messages,
        ids[4..],
        "the rest after max_batch_timeout"
    );
    assert_eq!(second.started, S(1));
    assert!(cf.run_batch().is_none());

    // A redelivered message joins whatever is visible when its batch goes.
    let retried = cf.send(&job, &task(7, Behaviour::FailFirstDelivery));
    let batch = cf.run_batch().unwrap();
    assert_eq!(batch.messages, std::slice::from_ref(&retried));
    cf.advance(MS(500));
    let fresh = cf.send(&job, &task(8, Behaviour::Succeed));
    let batch = cf.run_batch().unwrap();
    let mut together = batch.messages.clone();
    together.sort();
    let mut expected = vec![retried.clone(), fresh];
    expected.sort();
    assert_eq!(together, expected);
    assert_eq!(cf.message(&retried).attempts(), [1, 2]);
}

#[test]
fn a_delayed_send_waits_for_its_delay() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    let id = cf.send_with_delay(&job, &task(1, Behaviour::Succeed), MS(2500));
    cf.run_until_idle();
    let delivered = cf.message(&id).deliveries[0].delivered_at;
    assert!(delivered >= S(3), "rounded up to 3 s: {delivered:?}");
}

/// The report job of the examples, with the settings of the repository's
/// wrangler.toml for the `reports` queue.
const REPORTS_WRANGLER: &str = r#"
[vars]
EDGE_BUDGET_MS = "300000"
EDGE_RESERVE_MS = "5000"
UNKNOWN_NAME_ATTEMPTS = "10"
UNKNOWN_NAME_RETRY_DELAY_MS = "30000"

[[queues.producers]]
queue = "reports"
binding = "REPORTS"

[[queues.producers]]
queue = "reports-parallel"
binding = "REPORTS_PARALLEL"

[[queues.producers]]
queue = "reports-failed"
binding = "FAILED"

[[queues.consumers]]
queue = "reports"
max_batch_size = 4
max_batch_timeout = 1
max_retries = 10
retry_delay = 1
dead_letter_queue = "reports-dlq"

[[queues.consumers]]
queue = "reports-parallel"
max_batch_size = 4
max_batch_timeout = 1
max_retries = 10
retry_delay = 1
dead_letter_queue = "reports-dlq"

[[queues.consumers]]
queue = "reports-failed"
max_batch_size = 10
max_batch_timeout = 1
max_retries = 10
dead_letter_queue = "reports-failed-dlq"
"#;

fn report_jobs() -> Result<Registry, String> {
    let job = report_job::job().map_err(|e| e.to_string())?;
    let mut registry = Registry::new();
    registry
        .register(&job, report_job::handle)
        .map_err(|e| e.to_string())?;
    Ok(registry)
}

/// The report worker's options.
const REPORT_OPTIONS: Options = Options {
    failure_queue: Some("FAILED"),
    queue_concurrency: &[("reports-parallel", 4)],
    ..Options::DEFAULT
};

#[test]
fn the_report_job_settles_every_path() {
    use report_job::{Behaviour::*, BuildReport};

    let mut cf = CloudflareQueues::new(REPORTS_WRANGLER, report_jobs, REPORT_OPTIONS).unwrap();
    let job = report_job::job().unwrap();

    // behaviour, end, attempts, executions (natively: tier one retries a
    // panic in-process, 3 attempts per delivery), retry delays
    let cases = [
        (Healthy, "acked", vec![1], 1, vec![]),
        (Blip, "acked", vec![1], 2, vec![]),
        (BadHost, "acked", vec![1, 2], 4, vec![Some(1)]),
        (RateLimited, "acked", vec![1, 2], 2, vec![Some(1)]),
        (Missing, "permanent", vec![1], 1, vec![]),
        (
            Broken,
            "exhausted",
            vec![1, 2, 3],
            9,
            vec![Some(1), Some(2)],
        ),
        (Rejected, "rejected", vec![1], 1, vec![]),
        (Panics, "acked", vec![1, 2], 4, vec![Some(1)]),
        (
            AlwaysPanics,
            "exhausted",
            vec![1, 2, 3],
            9,
            vec![Some(1), Some(2)],
        ),
        (Slow, "acked", vec![1], 1, vec![]),
    ];
    let ids: Vec<String> = cases
        .iter()
        .zip(1..)
        .map(|((behaviour, ..), report_id)| {
            cf.send(
                &job,
                &BuildReport {
                    report_id,
                    behaviour: *behaviour,
                },
            )
        })
        .collect();
    cf.run_until_idle();

    for ((behaviour, end, attempts, executions, delays), id) in cases.iter().zip(&ids) {
        let report = cf.message(id);
        let state = match &report.state {
            MessageState::Acked => "acked",
            MessageState::Rejected => "rejected",
            MessageState::Failed { failure, .. } => match failure.kind {
                FailureKind::Permanent => "permanent",
                FailureKind::AttemptsExhausted => "exhausted",
                other => panic!("{behaviour:?}: {other:?}"),
            },
            other => panic!("{behaviour:?}: {other:?}"),
        };
        assert_eq!(state, *end, "{behaviour:?}");
        assert_eq!(&report.attempts(), attempts, "{behaviour:?}");
        assert_eq!(report.executions(), *executions, "{behaviour:?}");
        assert_eq!(&report.retry_delays(), delays, "{behaviour:?}");
    }
    let records = cf.failure_records();
    assert_eq!(records.len(), 3, "Missing, Broken, AlwaysPanics");
    assert!(records
        .iter()
        .all(|r| r.job.as_deref() == Some("build-report")));
    assert_eq!(
        cf.queued("reports-failed").len(),
        3,
        "the failure queue has no job: its records wait there"
    );
    assert!(cf.dead_letter("reports").is_empty());
    // The consumer's own counters agree.
    let stats = cf
        .consumer("reports")
        .unwrap()
        .registry()
        .stats()
        .job(report_job::NAME);
    let executions: u32 = cases.iter().map(|c| c.3).sum();
    assert_eq!(stats.executions, u64::from(executions));
    assert_eq!(stats.failed, 3);
}

#[test]
fn a_queue_with_concurrency_runs_its_batch_at_once() {
    use report_job::{Behaviour::Slow, BuildReport};

    let mut cf = CloudflareQueues::new(REPORTS_WRANGLER, report_jobs, REPORT_OPTIONS).unwrap();
    let job = report_job::job().unwrap();
    let slow = |report_id| BuildReport {
        report_id,
        behaviour: Slow,
    };
    // Four 2-second reports: one after another on `reports`, four at once
    // on `reports-parallel`.
    let in_order: Vec<String> = (1..=4).map(|n| cf.send(&job, &slow(n))).collect();
    let parallel: Vec<String> = (5..=8)
        .map(|n| cf.send_to("reports-parallel", &job, &slow(n)))
        .collect();
    cf.run_until_idle();

    let took = |queue: &str| {
        let batch = cf.batches().iter().find(|b| b.queue == queue).unwrap();
        batch.finished - batch.started
    };
    assert_eq!(took("reports"), S(8));
    assert_eq!(took("reports-parallel"), S(2));
    for id in in_order.iter().chain(&parallel) {
        assert_eq!(cf.state(id), &MessageState::Acked);
        assert_eq!(cf.message(id).attempts(), [1]);
    }
}

#[test]
fn without_a_failure_queue_a_failure_is_only_logged() {
    let job = task_job(|b| b.max_deliveries(3));
    let jobs = {
        let job = job.clone();
        move || -> Result<Registry, RegistryError> {
            let mut registry = Registry::new();
            registry.register(&job, handle)?;
            Ok(registry)
        }
    };
    let mut cf = CloudflareQueues::new(WRANGLER, jobs, Options::DEFAULT).unwrap();
    let id = cf.send(&job, &task(1, Behaviour::Permanent));
    cf.run_until_idle();
    let MessageState::Failed { failure, record } = cf.state(&id) else {
        panic!("failed: {:?}", cf.state(&id));
    };
    assert_eq!(failure.kind, FailureKind::Permanent);
    assert!(record.is_none());
    assert_eq!(cf.message(&id).deliveries[0].call, Some(Call::Ack));
    assert!(cf.failure_records().is_empty());
}

#[test]
#[should_panic(expected = "not idle after 2 invocations")]
fn run_until_idle_stops_at_its_invocation_limit() {
    let job = task_job(|b| b.max_deliveries(3));
    let mut cf = harness(&job);
    cf.max_invocations(2);
    cf.send(&job, &task(1, Behaviour::Fail));
    cf.run_until_idle();
}
