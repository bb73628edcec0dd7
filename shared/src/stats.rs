//! Resolution telemetry ([`Stats`], [`Resolution`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

/// Which tier resolved a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "tier", rename_all = "snake_case")]
pub enum Resolution {
    /// The first execution of the first delivery succeeded.
    FirstAttempt,
    /// An in-process retry succeeded within the first delivery.
    TierOne {
        /// The in-process attempt that succeeded.
        attempt: u32,
        /// Tier one's limit.
        of: u32,
    },
    /// A redelivery (delivery 2 or later) succeeded.
    TierTwo {
        /// The delivery that succeeded.
        delivery: u32,
        /// The job's delivery cap (0: none).
        of: u32,
        /// The in-process attempt within that delivery.
        in_process: u32,
    },
}

impl Resolution {
    /// Classifies a success on in-process attempt `k` of `n` within delivery `m` of `cap`.
    pub fn classify(delivery: u32, cap: u32, in_process: u32, of: u32) -> Self {
        if delivery > 1 {
            Resolution::TierTwo {
                delivery,
                of: cap,
                in_process,
            }
        } else if in_process > 1 {
            Resolution::TierOne {
                attempt: in_process,
                of,
            }
        } else {
            Resolution::FirstAttempt
        }
    }
}

/// Counters for one job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct JobStats {
    /// Successes on the first execution of the first delivery.
    pub first_attempt: u64,
    /// Successes from an in-process retry.
    pub tier_one: u64,
    /// Successes on a redelivery.
    pub tier_two: u64,
    /// Accepted retries (tier two).
    pub retried: u64,
    /// Accepted rejections.
    pub rejected: u64,
    /// Accepted terminal failures.
    pub failed: u64,
    /// Settlements the backend refused.
    pub settlement_errors: u64,
    /// Handler executions, whatever their result.
    pub executions: u64,
}

impl JobStats {
    /// All successes.
    pub fn succeeded(&self) -> u64 {
        self.first_attempt + self.tier_one + self.tier_two
    }
}

/// The one entry of [`Stats`] that counts deliveries for every name no
/// handler is registered for (unknown job names, bodies that are not
/// envelopes). Those names come from message bodies: counting each under its
/// own name would let any producer grow a worker's memory without bound.
/// The events of such deliveries keep the name the message carried.
pub const UNREGISTERED_JOBS: &str = "(unregistered)";

/// Counters for every job, keyed by job name, plus [`UNREGISTERED_JOBS`].
///
/// Why: a system that recovers mostly in tier one has a flaky dependency; one
/// that recovers mostly in tier two has flaky infrastructure. Those are
/// different problems with different owners, and the counters here tell them
/// apart. They also count executions, so the real cost of the failure path
/// can be compared with the budget.
#[derive(Debug, Default)]
pub struct Stats {
    jobs: Mutex<BTreeMap<String, JobStats>>,
}

impl Stats {
    pub(crate) fn update(&self, job: &str, f: impl FnOnce(&mut JobStats)) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        f(jobs.entry(job.to_string()).or_default());
    }

    /// A copy of every job's counters.
    pub fn snapshot(&self) -> BTreeMap<String, JobStats> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A copy of one job's counters.
    pub fn job(&self, name: &str) -> JobStats {
        self.snapshot().remove(name).unwrap_or_default()
    }
}
