//! The failure budget: what the failure path costs, before it happens.
//!
//! Why: retry tiers multiply. Three in-process attempts beneath three
//! deliveries is nine executions of the same work, not six, and when the
//! retried operation is expensive that product is what an outage costs. The
//! worker prints each job's budget at start so the number is seen before the
//! bill arrives.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::job::JobSpec;

/// Worst-case cost of a message that always fails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailureBudget {
    /// The job.
    pub job: String,
    /// Tier one: executions per delivery (N).
    pub in_process: u32,
    /// Tier two: deliveries (M). `None`: no facade cap.
    pub deliveries: Option<u32>,
    /// N x M. `None`: unbounded.
    pub executions: Option<u64>,
    /// Worst-case time spent waiting between executions (tier-one backoffs in
    /// every delivery plus every tier-two delay). `None`: unbounded.
    pub waiting: Option<Duration>,
    /// Worst-case time spent executing (N x M x timeout). `None`: no timeout
    /// or no cap, so unbounded.
    pub executing: Option<Duration>,
}

impl FailureBudget {
    /// Worst-case time to terminal failure: waiting plus executing.
    /// `None` when either is unbounded.
    pub fn time_to_failure(&self) -> Option<Duration> {
        Some(self.waiting?.saturating_add(self.executing?))
    }
}

/// Computes the budget for `spec`. `redelivery_hint` is what the driver waits
/// when the facade leaves the timing to it (a visibility timeout, say); it is
/// used for tier-two retries of jobs without a backoff.
pub fn failure_budget(spec: &JobSpec, redelivery_hint: Duration) -> FailureBudget {
    let n = spec.tier_one.attempts.max(1);
    let tier_one_wait = (2..=n)
        .map(|i| spec.tier_one.backoff.delay(i))
        .fold(Duration::ZERO, Duration::saturating_add);
    let (deliveries, executions, waiting, executing) = match spec.retry.attempts {
        0 => (None, None, None, None),
        m => {
            let tier_two_wait = (2..=m)
                .map(|k| {
                    spec.retry
                        .backoff
                        .as_ref()
                        .map_or(redelivery_hint, |b| b.delay(k))
                })
                .fold(Duration::ZERO, Duration::saturating_add);
            let executions = u64::from(n) * u64::from(m);
            let waiting = tier_one_wait
                .saturating_mul(m)
                .saturating_add(tier_two_wait);
            let executing = spec
                .timeout
                .map(|t| t.saturating_mul(u32::try_from(executions).unwrap_or(u32::MAX)));
            (Some(m), Some(executions), Some(waiting), executing)
        }
    };
    FailureBudget {
        job: spec.name.clone(),
        in_process: n,
        deliveries,
        executions,
        waiting,
        executing,
    }
}

/// Formats a duration for people: `1m 30s`, `250ms`, `unbounded`.
pub fn human(d: Option<Duration>) -> String {
    match d {
        None => "unbounded".to_string(),
        Some(d) if d.is_zero() => "0s".to_string(),
        Some(d) if d < Duration::from_secs(1) => format!("{}ms", d.as_millis()),
        Some(d) => {
            let secs = d.as_secs();
            let ms = d.subsec_millis();
            let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
            let mut parts = vec![];
            if h > 0 {
                parts.push(format!("{h}h"));
            }
            if m > 0 {
                parts.push(format!("{m}m"));
            }
            if s > 0 || ms > 0 {
                parts.push(if ms > 0 {
                    format!("{s}.{ms:03}s")
                } else {
                    format!("{s}s")
                });
            }
            parts.join(" ")
        }
    }
}

impl fmt::Display for FailureBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self
            .deliveries
            .map_or("unlimited".to_string(), |m| m.to_string());
        let x = self
            .executions
            .map_or("unbounded".to_string(), |x| x.to_string());
        write!(
            f,
            "job `{}`: {} in-process x {} deliveries = {} executions at worst; waiting {}, executing {}",
            self.job,
            self.in_process,
            m,
            x,
            human(self.waiting),
            human(self.executing)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Job;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn three_by_three() {
        let job = Job::<()>::builder("model-call")
            .retry(3)
            .backoff(Duration::from_secs(10), 2.0, Duration::ZERO)
            .tier_one(3)
            .tier_one_backoff(Duration::from_millis(100), 2.0, Duration::ZERO)
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let b = failure_budget(job.spec(), Duration::ZERO);
        assert_eq!(b.executions, Some(9));
        // tier one: 100ms + 200ms per delivery, x3; tier two: 10s + 20s.
        assert_eq!(
            b.waiting,
            Some(Duration::from_millis(900) + Duration::from_secs(30))
        );
        assert_eq!(b.executing, Some(Duration::from_secs(9)));
        assert_eq!(b.time_to_failure(), Some(Duration::from_millis(39_900)));
    }

    #[test]
    fn driver_timing_uses_the_hint_and_no_cap_is_unbounded() {
        let job = Job::<()>::builder("j").retry(4).build().unwrap();
        let b = failure_budget(job.spec(), Duration::from_secs(30));
        assert_eq!(b.waiting, Some(Duration::from_secs(90)));
        assert_eq!(b.executing, None);
        let job = Job::<()>::builder("j").build().unwrap();
        let b = failure_budget(job.spec(), Duration::ZERO);
        assert_eq!((b.executions, b.time_to_failure()), (None, None));
        assert_eq!(human(Some(Duration::from_millis(90_500))), "1m 30.500s");
    }
}
