//! Resolution telemetry ([`Stats`], [`Resolution`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
///
/// Each job's counters are made once, when its handler is registered (the
/// unregistered entry at its first delivery), and counting is an atomic add:
/// a delivery allocates nothing and takes no lock for them. A job appears in
/// [`Stats::snapshot`] once one of its counters has moved.
#[derive(Debug, Default)]
pub struct Stats {
    jobs: Mutex<BTreeMap<String, Arc<Counters>>>,
}

/// One job's counters, shared by the registry's entry for the job and
/// [`Stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    first_attempt: AtomicU64,
    tier_one: AtomicU64,
    tier_two: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    settlement_errors: AtomicU64,
    executions: AtomicU64,
}

/// What a counter counts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    FirstAttempt,
    TierOne,
    TierTwo,
    Retried,
    Rejected,
    Failed,
    SettlementErrors,
    Executions,
}

impl Counters {
    /// Adds `n` to one counter.
    pub(crate) fn add(&self, count: Count, n: u64) {
        let counter = match count {
            Count::FirstAttempt => &self.first_attempt,
            Count::TierOne => &self.tier_one,
            Count::TierTwo => &self.tier_two,
            Count::Retried => &self.retried,
            Count::Rejected => &self.rejected,
            Count::Failed => &self.failed,
            Count::SettlementErrors => &self.settlement_errors,
            Count::Executions => &self.executions,
        };
        // Release: a snapshot that sees an outcome also sees the executions
        // counted before it (they are read after the outcomes).
        counter.fetch_add(n, Ordering::Release);
    }

    /// The counters' values: the outcomes first, then the executions, so
    /// that a delivery's outcome is never seen without its executions.
    fn read(&self) -> JobStats {
        let get = |c: &AtomicU64| c.load(Ordering::Acquire);
        let mut stats = JobStats {
            first_attempt: get(&self.first_attempt),
            tier_one: get(&self.tier_one),
            tier_two: get(&self.tier_two),
            retried: get(&self.retried),
            rejected: get(&self.rejected),
            failed: get(&self.failed),
            settlement_errors: get(&self.settlement_errors),
            executions: 0,
        };
        stats.executions = get(&self.executions);
        stats
    }
}

impl Stats {
    /// The counters of `job`, made at the first call for that name.
    pub(crate) fn counters(&self, job: &str) -> Arc<Counters> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(counters) = jobs.get(job) {
            return counters.clone();
        }
        let counters = Arc::<Counters>::default();
        jobs.insert(job.to_string(), counters.clone());
        counters
    }

    /// A copy of every job's counters (the jobs whose counters have moved).
    pub fn snapshot(&self) -> BTreeMap<String, JobStats> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.iter()
            .map(|(name, counters)| (name, counters.read()))
            .filter(|(_, stats)| *stats != JobStats::default())
            .map(|(name, stats)| (name.clone(), stats))
            .collect()
    }

    /// A copy of one job's counters.
    pub fn job(&self, name: &str) -> JobStats {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.get(name).map(|c| c.read()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn counters_are_made_once_and_listed_once_they_move() {
        let stats = Stats::default();
        let counters = stats.counters("a");
        assert!(Arc::ptr_eq(&counters, &stats.counters("a")));
        let _ = stats.counters("b");
        assert!(stats.snapshot().is_empty(), "no counter has moved");
        counters.add(Count::Executions, 2);
        counters.add(Count::FirstAttempt, 1);
        let expected = JobStats {
            first_attempt: 1,
            executions: 2,
            ..JobStats::default()
        };
        assert_eq!(
            stats.snapshot(),
            BTreeMap::from([("a".to_string(), expected.clone())])
        );
        assert_eq!(stats.job("a"), expected);
        assert_eq!(stats.job("b"), JobStats::default());
        assert_eq!(stats.job("c"), JobStats::default());
    }
}
