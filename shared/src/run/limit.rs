//! The broker-limit rule ([`check_delivery_limit`]).

use std::fmt;

use crate::model::job::JobSpec;
use crate::rules::settle::{deliveries_needed, UnknownNameAttempts, SHUTDOWN_GRACE};
use crate::run::registry::Registry;

/// Whose deliveries a [`DeliveryLimitError`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitedBy {
    /// A registered job, by name, with its attempt cap (0: no cap).
    Job {
        /// The job's name.
        name: String,
        /// Its attempt cap.
        cap: u32,
    },
    /// A message with a job name no handler is registered for, under the
    /// registry's unknown-name cap (`None`: unlimited).
    UnknownName {
        /// The registry's unknown-name cap.
        limit: Option<u32>,
    },
}

/// A backend's delivery limit on one queue that allows fewer deliveries
/// than the facade needs to end a message itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryLimitError {
    /// The queue.
    pub queue: String,
    /// The job (or the unknown-name rule) that needs more.
    pub by: LimitedBy,
    /// The deliveries needed; `None` when no finite limit is enough (a job
    /// without a cap, an unlimited unknown-name cap).
    pub needed: Option<u32>,
    /// The deliveries the backend allows.
    pub allowed: u32,
}

impl fmt::Display for DeliveryLimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let queue = &self.queue;
        let allowed = self.allowed;
        match (&self.by, self.needed) {
            (LimitedBy::Job { name, cap }, Some(needed)) => write!(
                f,
                "queue `{queue}`: job `{name}` has an attempt cap of {cap} and needs {needed} deliveries \
                 (the cap, plus the delivery that records a message which crashed its worker every time, \
                 plus any grace for a delivery handed back), but the backend ends a message after {allowed}"
            ),
            (LimitedBy::Job { name, .. }, None) => write!(
                f,
                "queue `{queue}`: job `{name}` has no attempt cap, but the backend ends a message after \
                 {allowed} deliveries, with no failure record; give the job a cap"
            ),
            (LimitedBy::UnknownName { limit: Some(limit) }, Some(needed)) => write!(
                f,
                "queue `{queue}`: a message with an unknown job name fails on delivery {limit} (the \
                 registry's unknown-name cap) and needs {needed} deliveries, but the backend ends a \
                 message after {allowed}"
            ),
            (LimitedBy::UnknownName { .. }, _) => write!(
                f,
                "queue `{queue}`: the registry's unknown-name cap is unlimited, but the backend ends a \
                 message after {allowed} deliveries, with no failure record; set a limited unknown-name cap"
            ),
        }
    }
}

impl std::error::Error for DeliveryLimitError {}

/// The deliveries a backend must allow a message whose job name has no
/// handler, under the registry's unknown-name cap `limit` (`None`:
/// unlimited, and no finite limit is enough).
///
/// The facade fails such a message on delivery `limit` without running
/// anything, but a delivery can still end unsettled (a batch-mate crashed
/// the worker, a budget ran out, a shutdown handed it back where the
/// backend cannot count that), so one delivery more is needed
/// ([`SHUTDOWN_GRACE`]).
pub fn unknown_name_deliveries_needed(limit: Option<u32>) -> Option<u32> {
    limit.map(|limit| limit.saturating_add(SHUTDOWN_GRACE))
}

/// Checks a backend's delivery limit on `queue` (`allowed`: the deliveries
/// it gives one message before ending it on its own) against every job of
/// `registry` on that queue and against the unknown-name rule. `None`: the
/// backend sets no limit, which always passes.
/// `counts_shutdown_returns`: whether the backend carries graceful-shutdown
/// returns across deliveries (see [`deliveries_needed`]).
///
/// Most brokers can end a message themselves after some number of
/// deliveries (JetStream `MaxDeliver`, SQS `maxReceiveCount`, a quorum
/// queue's `x-delivery-limit`, Cloudflare's `max_retries`). A message ended
/// that way gets no failure record, so a backend whose limit is below what a
/// job needs ([`deliveries_needed`]) is refused before anything is consumed.
/// Every host checks the same rule, from the registry's own jobs: the native
/// consumer with the limit its driver reports, the edge with the consumer's
/// `max_retries` from `wrangler.toml`.
///
/// The first job (by name) that needs more is reported, then the
/// unknown-name rule. A host that reports every problem at once (the edge's
/// wrangler.toml check) applies the two halves of the rule itself:
/// [`check_job_delivery_limit`] for each job and
/// [`check_unknown_name_delivery_limit`] for each queue.
pub fn check_delivery_limit(
    registry: &Registry,
    queue: &str,
    allowed: Option<u32>,
    counts_shutdown_returns: bool,
) -> Result<(), DeliveryLimitError> {
    let Some(allowed) = allowed else {
        return Ok(());
    };
    let mut jobs: Vec<_> = registry.specs().filter(|s| s.queue == queue).collect();
    jobs.sort_by(|a, b| a.name.cmp(&b.name));
    for spec in jobs {
        check_job_delivery_limit(spec, queue, allowed, counts_shutdown_returns)?;
    }
    check_unknown_name_delivery_limit(registry.unknown_name_attempts_setting(), queue, allowed)
}

/// The rule for one job consumed from `queue`: `allowed` deliveries must
/// reach [`deliveries_needed`] for the job's cap (a job without a cap never
/// fits a finite limit).
pub fn check_job_delivery_limit(
    spec: &JobSpec,
    queue: &str,
    allowed: u32,
    counts_shutdown_returns: bool,
) -> Result<(), DeliveryLimitError> {
    let cap = spec.retry.max_deliveries;
    let needed = deliveries_needed(cap, counts_shutdown_returns);
    if needed.is_some_and(|needed| needed <= allowed) {
        return Ok(());
    }
    Err(DeliveryLimitError {
        queue: queue.to_string(),
        by: LimitedBy::Job {
            name: spec.name.clone(),
            cap,
        },
        needed,
        allowed,
    })
}

/// The rule for messages on `queue` whose job name has no handler, under
/// the registry's unknown-name cap `cap`: `allowed` deliveries must reach
/// [`unknown_name_deliveries_needed`] (an unlimited cap never fits a finite
/// limit). It applies to every consumed queue, with jobs or not: a stray
/// name can arrive anywhere.
pub fn check_unknown_name_delivery_limit(
    cap: UnknownNameAttempts,
    queue: &str,
    allowed: u32,
) -> Result<(), DeliveryLimitError> {
    let limit = cap.limit();
    let needed = unknown_name_deliveries_needed(limit);
    if needed.is_some_and(|needed| needed <= allowed) {
        return Ok(());
    }
    Err(DeliveryLimitError {
        queue: queue.to_string(),
        by: LimitedBy::UnknownName { limit },
        needed,
        allowed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Job, JobContext};

    fn build(jobs: &[(&str, &str, u32)], unknown: UnknownNameAttempts) -> Registry {
        let mut registry = Registry::new();
        for &(name, queue, cap) in jobs {
            let job = Job::<u32>::builder(name)
                .queue(queue)
                .delivery_cap((cap > 0).then_some(cap))
                .build()
                .unwrap();
            registry
                .register(&job, |_: JobContext, _: u32| async { Ok(()) })
                .unwrap();
        }
        registry.unknown_name_attempts(unknown);
        registry
    }

    #[test]
    fn no_backend_limit_always_passes() {
        let registry = build(&[("a", "q", 0)], UnknownNameAttempts::unlimited());
        assert_eq!(check_delivery_limit(&registry, "q", None, true), Ok(()));
    }

    #[test]
    fn each_job_on_the_queue_needs_its_cap_plus_the_crash_delivery() {
        let registry = build(
            &[
                ("small", "q", 3),
                ("big", "q", 6),
                ("other", "elsewhere", 50),
            ],
            UnknownNameAttempts::limited(2),
        );
        // big needs 7 where shutdown returns are counted, 8 where not.
        assert_eq!(check_delivery_limit(&registry, "q", Some(7), true), Ok(()));
        let err = check_delivery_limit(&registry, "q", Some(6), true).unwrap_err();
        assert_eq!(
            err.by,
            LimitedBy::Job {
                name: "big".into(),
                cap: 6
            }
        );
        assert_eq!((err.needed, err.allowed), (Some(7), 6));
        assert!(err.to_string().contains("job `big`"), "{err}");
        let err = check_delivery_limit(&registry, "q", Some(7), false).unwrap_err();
        assert_eq!(err.needed, Some(8));
        // The job on another queue does not count here.
        assert_eq!(check_delivery_limit(&registry, "q", Some(8), false), Ok(()));
    }

    #[test]
    fn the_unknown_name_rule_and_uncapped_jobs() {
        let registry = build(&[("a", "q", 1)], UnknownNameAttempts::default());
        let err = check_delivery_limit(&registry, "q", Some(10), true).unwrap_err();
        assert_eq!(err.by, LimitedBy::UnknownName { limit: Some(10) });
        assert_eq!(err.needed, Some(11));
        assert_eq!(check_delivery_limit(&registry, "q", Some(11), true), Ok(()));
        // An unknown name can arrive on a queue with no job at all.
        assert!(check_delivery_limit(&registry, "empty", Some(10), true).is_err());

        let uncapped = registry_with_uncapped();
        let err = check_delivery_limit(&uncapped, "q", Some(1000), true).unwrap_err();
        assert_eq!(err.needed, None);
        assert!(err.to_string().contains("no attempt cap"), "{err}");

        let unlimited = build(&[("a", "q", 1)], UnknownNameAttempts::unlimited());
        let err = check_delivery_limit(&unlimited, "q", Some(1000), true).unwrap_err();
        assert_eq!(err.by, LimitedBy::UnknownName { limit: None });
    }

    #[test]
    fn the_halves_judge_one_job_and_one_queue() {
        let registry = build(&[("big", "q", 6)], UnknownNameAttempts::limited(2));
        let spec = registry.spec("big").unwrap();
        // Held to another queue's limit (a second queue with the same jobs).
        let err = check_job_delivery_limit(spec, "also", 7, false).unwrap_err();
        assert_eq!(
            (err.queue.as_str(), err.needed, err.allowed),
            ("also", Some(8), 7)
        );
        assert_eq!(check_job_delivery_limit(spec, "also", 8, false), Ok(()));
        let cap = UnknownNameAttempts::limited(2);
        assert_eq!(check_unknown_name_delivery_limit(cap, "also", 3), Ok(()));
        let err = check_unknown_name_delivery_limit(cap, "also", 2).unwrap_err();
        assert_eq!(err.by, LimitedBy::UnknownName { limit: Some(2) });
    }

    fn registry_with_uncapped() -> Registry {
        build(&[("forever", "q", 0)], UnknownNameAttempts::limited(2))
    }
}
