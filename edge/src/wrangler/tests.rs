use super::*;
use crate::settings::EdgeConfig;
use jobrail::{
    deliveries_needed, unknown_name_deliveries_needed, Job, JobContext, Registry,
    UnknownNameAttempts,
};

/// A registry with one job per `(name, queue, cap)` and the given
/// unknown-name cap.
fn registry(jobs: &[(&str, &str, u32)], unknown: UnknownNameAttempts) -> Registry {
    let mut registry = Registry::new();
    for &(name, queue, cap) in jobs {
        let job = Job::<u32>::builder(name)
            .queue(queue)
            .delivery_cap((cap != 0).then_some(cap))
            .build()
            .unwrap();
        registry
            .register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
    }
    registry.unknown_name_attempts(unknown);
    registry
}

/// The `(job, field)` of every problem, in order.
fn fields(problems: &[PolicyError]) -> Vec<(String, String)> {
    problems
        .iter()
        .map(|p| match p {
            PolicyError::Invalid { job, field, .. } => (job.clone(), field.to_string()),
            _ => panic!("unexpected problem {p:?}"),
        })
        .collect()
}

fn reasons(problems: &[PolicyError]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// A consumer of `queue` with the given max_retries and a dead-letter
/// queue, its producer binding, plus a failure-queue producer.
fn toml_with(queue: &str, max_retries: u32) -> String {
    let binding = queue.to_uppercase().replace('-', "_");
    format!(
        r#"
[[queues.producers]]
queue = "failed"
binding = "FAILED"

[[queues.producers]]
queue = "{queue}"
binding = "{binding}"

[[queues.consumers]]
queue = "{queue}"
max_retries = {max_retries}
dead_letter_queue = "{queue}-dlq"
"#
    )
}

fn small_unknown_cap() -> UnknownNameAttempts {
    UnknownNameAttempts::limited(2)
}

#[test]
fn reads_producers_and_consumers_and_ignores_other_keys() {
    let text = r#"
name = "w"
main = "build/index.js"
[vars]
X = "1"
[[kv_namespaces]]
binding = "LOG"
id = "x"

[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.consumers]]
queue = "jobs"
max_batch_size = 4
max_batch_timeout = 1.5
max_retries = 7
retry_delay = 2
dead_letter_queue = "jobs-dlq"
max_concurrency = 3
some_future_key = true
"#;
    let w = Wrangler::parse(text).unwrap();
    assert_eq!(w.env(), None);
    assert_eq!(w.producer_binding("JOBS"), Some("jobs"));
    assert_eq!(w.producer_binding("jobs"), None, "by binding, not queue");
    assert_eq!(w.producers().len(), 1);
    assert_eq!(w.consumers().len(), 1);
    assert_eq!(
        w.consumer("jobs"),
        Some(&ConsumerSettings {
            queue: "jobs".into(),
            max_batch_size: 4,
            max_batch_timeout: Duration::from_millis(1500),
            max_retries: 7,
            retry_delay: Duration::from_secs(2),
            dead_letter_queue: Some("jobs-dlq".into()),
            max_concurrency: Some(3),
        })
    );
    assert_eq!(w.consumer("jobs").unwrap().deliveries(), 8);
    assert_eq!(w.consumer("other"), None);
}

#[test]
fn absent_keys_take_the_platforms_defaults() {
    let w = Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\n").unwrap();
    assert_eq!(
        w.consumer("q"),
        Some(&ConsumerSettings {
            queue: "q".into(),
            max_batch_size: 10,
            max_batch_timeout: Duration::from_secs(5),
            max_retries: 3,
            retry_delay: Duration::ZERO,
            dead_letter_queue: None,
            max_concurrency: None,
        })
    );
    let w = Wrangler::parse("").unwrap();
    assert!(w.consumers().is_empty() && w.producers().is_empty());
}

#[test]
fn the_default_max_retries_is_checked_like_an_explicit_one() {
    // 3 retries = 4 deliveries. deliveries_needed on Cloudflare: cap 2
    // needs 2 + 1 + 1 = 4 (fits), cap 3 needs 5 (does not).
    assert_eq!(deliveries_needed(2, false), Some(4));
    let text = "[[queues.producers]]\nqueue = \"q\"\nbinding = \"Q\"\n\
                [[queues.consumers]]\nqueue = \"q\"\ndead_letter_queue = \"dlq\"\n";
    let w = Wrangler::parse(text).unwrap();
    let ok = w.check(&registry(&[("j", "q", 2)], small_unknown_cap()), None);
    assert!(ok.is_ok(), "{ok:?}");
    assert_eq!(ok.unwrap().max_retries("q"), Some(3));
    let problems = w
        .check(&registry(&[("j", "q", 3)], small_unknown_cap()), None)
        .unwrap_err();
    assert_eq!(fields(&problems), [("j".into(), "retry".into())]);
    let text = reasons(&problems);
    assert!(
        text.contains("cap of 3")
            && text.contains("max_retries = 3")
            && text.contains("at least 4"),
        "{text}"
    );
}

#[test]
fn a_parse_error_names_the_line_and_the_key() {
    let err = Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_retries = \"five\"\n")
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, WranglerError::Parse(_)));
    assert!(
        text.contains("line 3") && text.contains("max_retries"),
        "{text}"
    );

    let err = Wrangler::parse("[[queues.consumers]]\nqueue = \n").unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");

    let err = Wrangler::parse("[[queues.consumers]]\nmax_retries = 3\n").unwrap_err();
    assert!(err.to_string().contains("queue"), "missing queue: {err}");

    let err =
        Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_retries = -1\n").unwrap_err();
    assert!(err.to_string().contains("line 3"), "{err}");

    let err = Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_batch_timeout = -1.0\n")
        .unwrap_err();
    assert!(
        matches!(&err, WranglerError::Invalid { queue, field: "max_batch_timeout", .. } if queue == "q"),
        "{err:?}"
    );
}

const ENVS: &str = r#"
[[queues.producers]]
queue = "top-failed"
binding = "FAILED"

[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.consumers]]
queue = "jobs"
max_retries = 9
dead_letter_queue = "jobs-dlq"

[env.production]
name = "w-prod"

[[env.production.queues.producers]]
queue = "prod-failed"
binding = "FAILED"

[[env.production.queues.producers]]
queue = "prod-jobs"
binding = "JOBS"

[[env.production.queues.consumers]]
queue = "prod-jobs"
max_retries = 20
dead_letter_queue = "prod-jobs-dlq"

[env.staging]
name = "w-staging"
"#;

#[test]
fn an_environment_has_only_its_own_queues() {
    let top = Wrangler::parse(ENVS).unwrap();
    assert_eq!(top.consumers().len(), 1);
    assert_eq!(top.consumer("jobs").unwrap().max_retries, 9);
    assert_eq!(top.producer_binding("FAILED"), Some("top-failed"));
    assert_eq!(top.producer_binding("JOBS"), Some("jobs"));

    let prod = Wrangler::parse_env(ENVS, Some("production")).unwrap();
    assert_eq!(prod.env(), Some("production"));
    assert_eq!(prod.consumer("jobs"), None, "not inherited");
    assert_eq!(prod.consumer("prod-jobs").unwrap().max_retries, 20);
    assert_eq!(prod.producer_binding("FAILED"), Some("prod-failed"));

    let staging = Wrangler::parse_env(ENVS, Some("staging")).unwrap();
    assert!(staging.consumers().is_empty() && staging.producers().is_empty());

    assert_eq!(
        Wrangler::parse_env(ENVS, Some("dev")),
        Err(WranglerError::NoEnvironment("dev".into()))
    );
}

#[test]
fn an_environment_is_checked_on_its_own_consumers() {
    let jobs = registry(&[("j", "jobs", 3)], small_unknown_cap());
    assert!(Wrangler::parse(ENVS)
        .unwrap()
        .check(&jobs, Some("FAILED"))
        .is_ok());
    let prod = Wrangler::parse_env(ENVS, Some("production")).unwrap();
    let problems = prod.check(&jobs, Some("FAILED")).unwrap_err();
    assert_eq!(fields(&problems), [("j".into(), "queue".into())]);
    assert!(
        reasons(&problems).contains("[[env.production.queues.consumers]]"),
        "{}",
        reasons(&problems)
    );
    let prod_jobs = registry(&[("j", "prod-jobs", 3)], small_unknown_cap());
    assert!(prod.check(&prod_jobs, Some("FAILED")).is_ok());
}

#[test]
fn rule_1_every_job_queue_has_a_consumer() {
    let w = Wrangler::parse(&toml_with("jobs", 5)).unwrap();
    let r = registry(&[("a", "jobs", 2), ("b", "other", 2)], small_unknown_cap());
    let problems = w.check(&r, None).unwrap_err();
    assert_eq!(fields(&problems), [("b".into(), "queue".into())]);
    assert!(reasons(&problems).contains("`other`"));
    let r = registry(&[("a", "jobs", 2)], small_unknown_cap());
    assert!(w.check(&r, None).is_ok());
}

#[test]
fn rule_2_the_platform_allows_the_jobs_deliveries() {
    // Cap 4 on Cloudflare: 4 + 1 + 1 = 6 deliveries = max_retries 5.
    assert_eq!(deliveries_needed(4, false), Some(6));
    let r = registry(&[("j", "jobs", 4)], small_unknown_cap());
    let problems = Wrangler::parse(&toml_with("jobs", 4))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert_eq!(fields(&problems), [("j".into(), "retry".into())]);
    let text = reasons(&problems);
    assert!(
        text.contains("job `j`")
            && text.contains("cap of 4")
            && text.contains("max_retries = 4")
            && text.contains("at least 5"),
        "{text}"
    );
    assert!(Wrangler::parse(&toml_with("jobs", 5))
        .unwrap()
        .check(&r, None)
        .is_ok());

    // A job without a cap cannot be honoured by any max_retries.
    let r = registry(&[("forever", "jobs", 0)], small_unknown_cap());
    let problems = Wrangler::parse(&toml_with("jobs", 100))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert_eq!(fields(&problems), [("forever".into(), "retry".into())]);
    assert!(reasons(&problems).contains("no cap"));

    // A cap the platform's limit cannot cover says so.
    let r = registry(&[("j", "jobs", 100)], small_unknown_cap());
    let problems = Wrangler::parse(&toml_with("jobs", 100))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert!(reasons(&problems).contains("above the platform's limit"));
}

#[test]
fn rule_7_no_declared_delay_is_longer_than_the_platform_holds() {
    let w = Wrangler::parse(&toml_with("jobs", 10)).unwrap();
    let mut r = Registry::new();
    // 1 h, 2 h, ... 16 h, then 24 h, 24 h: at the limit.
    let at_limit = Job::<u32>::builder("daily")
        .queue("jobs")
        .max_deliveries(8)
        .backoff(
            Duration::from_secs(3600),
            2.0,
            Duration::from_secs(24 * 3600),
        )
        .build()
        .unwrap();
    r.register(&at_limit, |_: JobContext, _: u32| async { Ok(()) })
        .unwrap();
    r.unknown_name_attempts(small_unknown_cap());
    assert!(w.check(&r, None).is_ok());
    let beyond = Job::<u32>::builder("weekly")
        .queue("jobs")
        .max_deliveries(5)
        .backoff(Duration::from_secs(86_400), 2.0, Duration::ZERO)
        .build()
        .unwrap();
    r.register(&beyond, |_: JobContext, _: u32| async { Ok(()) })
        .unwrap();
    r.unknown_name_retry_delay(Duration::from_secs(86_401));
    let problems = w.check(&r, None).unwrap_err();
    assert_eq!(
        fields(&problems),
        [
            ("weekly".into(), "retry.backoff".into()),
            ("*".into(), "unknown_name_retry_delay".into())
        ]
    );
    assert!(
        reasons(&problems).contains("691200s"),
        "{}",
        reasons(&problems)
    );
}

#[test]
fn rule_3_the_platform_allows_the_unknown_name_deliveries() {
    // The default cap: failed on delivery 10, plus one of grace = 11
    // deliveries = max_retries 10.
    let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::default());
    assert_eq!(
        unknown_name_deliveries_needed(UnknownNameAttempts::default().limit()),
        Some(11)
    );
    let problems = Wrangler::parse(&toml_with("jobs", 9))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [("*".into(), "unknown_name_attempts".into())]
    );
    let text = reasons(&problems);
    assert!(
        text.contains("`jobs`") && text.contains("delivery 10") && text.contains("at least 10"),
        "{text}"
    );
    assert!(Wrangler::parse(&toml_with("jobs", 10))
        .unwrap()
        .check(&r, None)
        .is_ok());

    // A smaller cap needs fewer: limited(3) needs 4 = max_retries 3.
    let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::limited(3));
    assert!(Wrangler::parse(&toml_with("jobs", 3))
        .unwrap()
        .check(&r, None)
        .is_ok());
    let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::limited(4));
    assert!(Wrangler::parse(&toml_with("jobs", 3))
        .unwrap()
        .check(&r, None)
        .is_err());

    // Unlimited can never be honoured; one problem per job queue.
    let r = registry(
        &[("a", "jobs", 2), ("b", "jobs", 2)],
        UnknownNameAttempts::unlimited(),
    );
    let problems = Wrangler::parse(&toml_with("jobs", 100))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [("*".into(), "unknown_name_attempts".into())]
    );
    assert!(reasons(&problems).contains("unlimited"));
}

#[test]
fn rule_4_every_job_queue_has_a_dead_letter_queue() {
    let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
    let w = Wrangler::parse(
        "[[queues.producers]]\nqueue = \"jobs\"\nbinding = \"JOBS\"\n\
         [[queues.consumers]]\nqueue = \"jobs\"\nmax_retries = 5\n",
    )
    .unwrap();
    let problems = w.check(&r, None).unwrap_err();
    assert_eq!(
        fields(&problems),
        [(
            "*".into(),
            "wrangler.queues.consumers.dead_letter_queue".into()
        )]
    );
    assert!(reasons(&problems).contains("`jobs`"));
    assert!(Wrangler::parse(&toml_with("jobs", 5))
        .unwrap()
        .check(&r, None)
        .is_ok());

    // A dead-letter queue that is a job queue feeds given-up messages
    // back into the work.
    let r = registry(&[("a", "one", 2), ("b", "two", 2)], small_unknown_cap());
    let text = r#"
[[queues.producers]]
queue = "one"
binding = "ONE"
[[queues.producers]]
queue = "two"
binding = "TWO"
[[queues.consumers]]
queue = "one"
max_retries = 5
dead_letter_queue = "two"
[[queues.consumers]]
queue = "two"
max_retries = 5
dead_letter_queue = "two-dlq"
"#;
    let problems = Wrangler::parse(text).unwrap().check(&r, None).unwrap_err();
    assert_eq!(
        fields(&problems),
        [(
            "*".into(),
            "wrangler.queues.consumers.dead_letter_queue".into()
        )]
    );
}

#[test]
fn rule_5_the_failure_queue_is_a_producer_outside_the_job_queues() {
    let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
    let w = Wrangler::parse(&toml_with("jobs", 5)).unwrap();
    let checked = w.check(&r, Some("FAILED")).unwrap();
    assert_eq!(checked.failure_queue(), Some("FAILED"));

    let problems = w.check(&r, Some("MISSING")).unwrap_err();
    assert_eq!(fields(&problems), [("*".into(), "failure_queue".into())]);
    assert!(reasons(&problems).contains("`MISSING`"));

    let text = format!(
        "{}\n[[queues.producers]]\nqueue = \"jobs\"\nbinding = \"JOBS\"\n",
        toml_with("jobs", 5)
    );
    let problems = Wrangler::parse(&text)
        .unwrap()
        .check(&r, Some("JOBS"))
        .unwrap_err();
    assert_eq!(fields(&problems), [("*".into(), "failure_queue".into())]);
    assert!(reasons(&problems).contains("`jobs`"));
}

#[test]
fn rule_6_a_consumed_failure_queue_keeps_what_it_cannot_store() {
    let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
    let consumed = |extra: &str| {
        let text = format!(
            "{}\n[[queues.consumers]]\nqueue = \"failed\"\nmax_retries = 10\n{extra}",
            toml_with("jobs", 5)
        );
        Wrangler::parse(&text).unwrap().check(&r, Some("FAILED"))
    };
    assert!(consumed("dead_letter_queue = \"failed-dlq\"\n").is_ok());
    for extra in [
        "",
        "dead_letter_queue = \"jobs\"\n",
        "dead_letter_queue = \"failed\"\n",
    ] {
        let problems = consumed(extra).unwrap_err();
        assert_eq!(
            fields(&problems),
            [(
                "*".into(),
                "wrangler.queues.consumers.dead_letter_queue".into()
            )],
            "{extra}"
        );
        assert!(reasons(&problems).contains("`failed`"), "{problems:?}");
    }
}

#[test]
fn every_problem_is_reported_at_once() {
    let r = registry(
        &[("a", "one", 5), ("b", "two", 2), ("c", "one", 1)],
        UnknownNameAttempts::default(),
    );
    let text = r#"
[[queues.consumers]]
queue = "one"
max_retries = 2
[[queues.consumers]]
queue = "one"
max_retries = 200
"#;
    let problems = Wrangler::parse(text)
        .unwrap()
        .check(&r, Some("FAILED"))
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [
            ("a".into(), "retry".into()),
            ("b".into(), "queue".into()),
            ("*".into(), "wrangler.queues.consumers".into()),
            ("*".into(), "unknown_name_attempts".into()),
            (
                "*".into(),
                "wrangler.queues.consumers.dead_letter_queue".into()
            ),
            ("*".into(), "wrangler.queues.producers".into()),
            ("*".into(), "failure_queue".into()),
        ],
        "{}",
        reasons(&problems)
    );
}

#[test]
fn rule_8_every_job_queue_has_a_producer_binding_for_the_steps_of_long_delays() {
    let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
    let text = r#"
[[queues.producers]]
queue = "failed"
binding = "FAILED"

[[queues.consumers]]
queue = "jobs"
max_retries = 5
dead_letter_queue = "jobs-dlq"
"#;
    let problems = Wrangler::parse(text)
        .unwrap()
        .check(&r, Some("FAILED"))
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [("*".into(), "wrangler.queues.producers".into())]
    );
    let reason = reasons(&problems);
    assert!(
        reason.contains("`jobs`")
            && reason.contains("[[queues.producers]]")
            && reason.contains("24 hours"),
        "{reason}"
    );
    // A queue consumed with the jobs besides theirs needs one too.
    let w = Wrangler::parse(&toml_with("jobs", 5)).unwrap();
    let checked = w.check(&r, Some("FAILED")).unwrap();
    assert_eq!(checked.queue_binding("jobs"), Some("JOBS"));
    assert_eq!(checked.queue_binding("failed"), None, "not a job queue");
    let text = format!(
        "{}[[queues.consumers]]\nqueue = \"jobs-2\"\nmax_retries = 5\ndead_letter_queue = \"jobs-dlq\"\n",
        toml_with("jobs", 5)
    );
    let problems = Wrangler::parse(&text)
        .unwrap()
        .check_consumed(&r, Some("FAILED"), &["jobs-2"])
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [("*".into(), "wrangler.queues.producers".into())]
    );
    assert!(reasons(&problems).contains("`jobs-2`"));
    // In an environment, the environment's own producers.
    let text = r#"
[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[env.staging.queues.consumers]]
queue = "jobs"
max_retries = 5
dead_letter_queue = "jobs-dlq"
"#;
    let problems = Wrangler::parse_env(text, Some("staging"))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert!(
        reasons(&problems).contains("[[env.staging.queues.producers]]"),
        "{}",
        reasons(&problems)
    );
}

#[test]
fn max_retries_above_the_platforms_limit_is_refused() {
    let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
    let problems = Wrangler::parse(&toml_with("jobs", 101))
        .unwrap()
        .check(&r, None)
        .unwrap_err();
    assert_eq!(
        fields(&problems),
        [("*".into(), "wrangler.queues.consumers.max_retries".into())]
    );
}

#[test]
fn checked_feeds_the_edge_config() {
    let r = registry(&[("a", "one", 2), ("b", "two", 2)], small_unknown_cap());
    let text = format!("{}{}", toml_with("one", 7), toml_with("two", 4));
    let checked = Wrangler::parse(&text)
        .unwrap()
        .check(&r, Some("FAILED"))
        .unwrap();
    assert_eq!(checked.max_retries("one"), Some(7));
    assert_eq!(checked.max_retries("two"), Some(4));
    assert_eq!(checked.max_retries("failed"), None, "not a job queue");
    assert_eq!(
        checked
            .consumer("two")
            .unwrap()
            .dead_letter_queue
            .as_deref(),
        Some("two-dlq")
    );
    assert_eq!(checked.platform_max_retries(), Some(4), "the least");
    let base = EdgeConfig {
        concurrency: 3,
        failure_queue: Some("OTHER".into()),
        ..EdgeConfig::default()
    };
    let config = checked.edge_config(base);
    assert_eq!(config.platform_max_retries, Some(4));
    assert_eq!(config.failure_queue.as_deref(), Some("FAILED"));
    assert_eq!(config.concurrency, 3, "the rest is kept");
    assert_eq!(config.validate(&r), Ok(()));
}

/// The repository's own wrangler.toml, embedded as the worker embeds it,
/// against the report job as the worker registers it (unknown-name cap
/// 10, `UNKNOWN_NAME_ATTEMPTS`, also the default).
#[test]
fn the_shipped_wrangler_toml_against_the_report_job() {
    const SHIPPED: &str = include_str!("../../../wrangler.toml");
    let w = Wrangler::parse(SHIPPED).unwrap();
    let job = report_job::job().unwrap();
    let report_registry = |unknown: UnknownNameAttempts| {
        let mut r = Registry::new();
        r.register(&job, report_job::handle).unwrap();
        r.unknown_name_attempts(unknown);
        r
    };
    let r = report_registry(UnknownNameAttempts::limited(10));
    let max_retries = w.consumer(report_job::QUEUE).unwrap().max_retries;

    // The job's cap of 3 needs 5 deliveries (max_retries 4); the
    // unknown-name cap of 10 needs 11 (max_retries 10). With
    // max_retries = 5 (the file as of this check's introduction) only the
    // unknown-name rule fails; from 10 on, everything fits.
    match w.check(&r, Some("FAILED")) {
        Ok(checked) => {
            assert!(max_retries >= 10, "max_retries = {max_retries} passed");
            assert_eq!(checked.max_retries(report_job::QUEUE), Some(max_retries));
            let config = checked.edge_config(EdgeConfig::default());
            assert_eq!(config.platform_max_retries, Some(max_retries));
            assert_eq!(config.failure_queue.as_deref(), Some("FAILED"));
            assert_eq!(config.validate(&r), Ok(()));
        }
        Err(problems) => {
            assert!(
                (4..10).contains(&max_retries),
                "max_retries = {max_retries}: {}",
                reasons(&problems)
            );
            assert_eq!(
                fields(&problems),
                [("*".into(), "unknown_name_attempts".into())],
                "{}",
                reasons(&problems)
            );
            let text = reasons(&problems);
            assert!(
                text.contains("`reports`")
                    && text.contains(&format!("max_retries = {max_retries}"))
                    && text.contains("at least 10"),
                "{text}"
            );
        }
    }

    // Whatever the unknown-name cap, the shipped job queue, dead-letter
    // queue and failure binding fit: with a cap of 2 (3 deliveries
    // needed) the check passes and feeds the edge config.
    let r = report_registry(UnknownNameAttempts::limited(2));
    let checked = w.check(&r, Some("FAILED")).unwrap();
    assert_eq!(checked.max_retries(report_job::QUEUE), Some(max_retries));
    assert_eq!(checked.platform_max_retries(), Some(max_retries));
    assert_eq!(checked.failure_queue(), Some("FAILED"));
}

mod triggers {
    use super::*;
    use crate::schedules::check_triggers;
    use jobrail::{Overlap, Schedule};

    fn schedule(name: &str, cron: &str, zone: &str) -> Schedule {
        let job = Job::<()>::builder("purge").queue("jobs").build().unwrap();
        Schedule::builder(name, &job, cron)
            .time_zone(zone)
            .build()
            .unwrap()
    }

    /// A section with `crons`, the claims database and a producer to `jobs`.
    fn section(crons: &str) -> Wrangler {
        Wrangler::parse(&format!(
            "[triggers]\ncrons = [{crons}]\n\n\
             [[d1_databases]]\nbinding = \"CLAIMS_DB\"\ndatabase_name = \"c\"\ndatabase_id = \"c\"\n\n\
             [[queues.producers]]\nqueue = \"jobs\"\nbinding = \"JOBS\"\n"
        ))
        .unwrap()
    }

    #[test]
    fn triggers_and_d1_bindings_are_read_and_environments_inherit_the_triggers() {
        let text = r#"
[triggers]
crons = ["* * * * *", "0 3 * * *"]

[[d1_databases]]
binding = "CLAIMS_DB"
database_name = "c"
database_id = "c"

[env.staging]
name = "w-staging"

[env.other]
name = "w-other"
[env.other.triggers]
crons = []
"#;
        let sections = Wrangler::parse_all(text).unwrap();
        assert_eq!(sections[0].crons(), ["* * * * *", "0 3 * * *"]);
        assert!(sections[0].has_d1_binding("CLAIMS_DB"));
        let other = Wrangler::parse_env(text, Some("other")).unwrap();
        assert!(other.crons().is_empty(), "its own, empty list");
        let staging = Wrangler::parse_env(text, Some("staging")).unwrap();
        assert_eq!(staging.crons(), ["* * * * *", "0 3 * * *"], "inherited");
        assert!(
            !staging.has_d1_binding("CLAIMS_DB"),
            "d1_databases are not inherited"
        );
        assert_eq!(
            sections
                .iter()
                .find(|s| s.env() == Some("staging"))
                .unwrap()
                .crons()
                .len(),
            2
        );
        assert!(Wrangler::parse("").unwrap().crons().is_empty());
    }

    #[test]
    fn every_schedule_has_a_trigger_and_every_trigger_a_schedule() {
        let nightly = schedule("nightly", "0 3 * * *", "UTC");
        let paris = schedule("paris", "30 7 * * *", "Europe/Paris");
        // Fits: nightly by its own trigger, paris every minute.
        let ok = check_triggers(
            &section("\"0 3 * * *\", \"* * * * *\""),
            &[nightly.clone(), paris.clone()],
            "CLAIMS_DB",
        );
        assert!(ok.is_empty(), "{}", reasons(&ok));
        // A UTC schedule may also fire from the every-minute trigger alone.
        assert!(check_triggers(
            &section("\"* * * * *\""),
            std::slice::from_ref(&nightly),
            "CLAIMS_DB"
        )
        .is_empty());

        // paris has no trigger; "5 4 * * *" fires nothing.
        let problems = check_triggers(
            &section("\"0 3 * * *\", \"5 4 * * *\""),
            &[nightly.clone(), paris.clone()],
            "CLAIMS_DB",
        );
        assert_eq!(
            fields(&problems),
            [
                ("*".into(), "triggers.crons".into()),
                ("*".into(), "triggers.crons".into())
            ]
        );
        let text = reasons(&problems);
        assert!(
            text.contains("schedule `paris` (cron `30 7 * * *`, time zone Europe/Paris) is fired by no Cron Trigger")
                && text.contains("add \"* * * * *\" to [triggers] crons"),
            "{text}"
        );
        assert!(
            text.contains("\"5 4 * * *\", which fires no declared schedule"),
            "{text}"
        );

        // A UTC schedule without a trigger is told both ways to get one.
        let problems = check_triggers(&section(""), std::slice::from_ref(&nightly), "CLAIMS_DB");
        assert!(
            reasons(&problems).contains("add \"0 3 * * *\" (its own) or \"* * * * *\""),
            "{}",
            reasons(&problems)
        );

        // The every-minute trigger when every schedule has its own.
        let problems = check_triggers(
            &section("\"0 3 * * *\", \"* * * * *\""),
            std::slice::from_ref(&nightly),
            "CLAIMS_DB",
        );
        assert!(
            reasons(&problems).contains("which no declared schedule needs"),
            "{}",
            reasons(&problems)
        );

        // A disabled schedule needs no trigger.
        let job = Job::<()>::builder("purge").queue("jobs").build().unwrap();
        let off = Schedule::builder("off", &job, "0 4 * * *")
            .enabled(false)
            .build()
            .unwrap();
        assert!(check_triggers(&section("\"0 3 * * *\""), &[nightly, off], "CLAIMS_DB").is_empty());
    }

    #[test]
    fn seconds_overlap_skip_queues_and_the_claims_database_are_checked() {
        let seconds = schedule("every-ten", "*/10 * * * * *", "UTC");
        let skip = {
            let job = Job::<()>::builder("purge").queue("jobs").build().unwrap();
            Schedule::builder("one-at-a-time", &job, "* * * * *")
                .overlap(Overlap::Skip)
                .build()
                .unwrap()
        };
        let elsewhere = {
            let job = Job::<()>::builder("bill").queue("billing").build().unwrap();
            Schedule::builder("billing", &job, "* * * * *")
                .build()
                .unwrap()
        };
        let problems = check_triggers(
            &section("\"* * * * *\""),
            &[seconds, skip, elsewhere],
            "OTHER_DB",
        );
        assert_eq!(
            fields(&problems),
            [
                ("*".into(), "triggers.crons".into()),
                ("*".into(), "triggers.crons".into()),
                ("*".into(), "wrangler.queues.producers".into()),
                ("*".into(), "wrangler.d1_databases".into()),
            ],
            "{}",
            reasons(&problems)
        );
        let text = reasons(&problems);
        assert!(
            text.contains("`every-ten`") && text.contains("seconds field"),
            "{text}"
        );
        assert!(
            text.contains("`one-at-a-time`") && text.contains("overlap"),
            "{text}"
        );
        assert!(
            text.contains("schedule `billing` sends job `bill` to `billing`"),
            "{text}"
        );
        assert!(text.contains("binding = \"OTHER_DB\""), "{text}");
        // A seconds field of 0 is minute resolution.
        let zero = schedule("zero", "0 */5 * * * *", "UTC");
        assert!(check_triggers(&section("\"*/5 * * * *\""), &[zero], "CLAIMS_DB").is_empty());
    }
}
