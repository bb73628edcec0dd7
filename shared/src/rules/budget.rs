//! The failure budget ([`FailureBudget`], [`failure_budget`]) and the longest hold
//! on one delivery ([`longest_hold`]).

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::model::job::JobSpec;

/// Worst-case cost of a message that always fails.
///
/// Why: retry tiers multiply. Three in-process attempts beneath three
/// deliveries is nine executions of the same work, not six, and when the
/// retried operation is expensive that product is what an outage costs. The
/// worker prints each job's budget at start so the number is seen before the
/// bill arrives.
///
/// The time is a bound, not an estimate: it adds up the longest each wait can
/// be.
///
/// - Tier one waits, between in-process attempts, either its backoff (after
///   an ordinary error) or a handler's retry-after of up to
///   `tier_one.max_wait` (a longer one goes to tier two), so each in-process
///   wait counts as the longer of the two.
/// - Tier two waits the job's backoff, or the driver's redelivery timing for
///   a job without one. A handler's retry-after that reaches tier two
///   replaces the backoff with a delay the handler chose; the budget assumes
///   such retry-afters are no longer than the backoff they replace. A
///   handler that asks for more has explicitly asked for more time than
///   the budget shows.
/// - Executing counts the full timeout for every execution (deadlines are
///   cooperative, so a handler that ignores its deadline can exceed even
///   that).
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
    /// Worst-case time spent waiting between executions: in every delivery,
    /// each tier-one wait at its longest (the longer of the tier-one backoff
    /// and `tier_one.max_wait`, the longest retry-after tier one sleeps
    /// for), plus every tier-two delay (the job's backoff, or the driver's
    /// redelivery hint). Assumes a handler's tier-two retry-afters are no
    /// longer than the backoff they replace. `None`: unbounded.
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
/// used for tier-two retries of jobs without a backoff. See
/// [`FailureBudget`] for what the time bounds and what it assumes.
pub fn failure_budget(spec: &JobSpec, redelivery_hint: Duration) -> FailureBudget {
    let n = spec.tier_one.attempts.max(1);
    let tier_one_wait = tier_one_waits(spec);
    let (deliveries, executions, waiting, executing) = match spec.retry.max_deliveries {
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

/// The longest tier one waits within one delivery: before in-process
/// attempt i, the backoff after an ordinary error or a retry-after tier one
/// accepts (at most `max_wait`), whichever is longer.
fn tier_one_waits(spec: &JobSpec) -> Duration {
    (2..=spec.tier_one.attempts.max(1))
        .map(|i| spec.tier_one.backoff.delay(i).max(spec.tier_one.max_wait))
        .fold(Duration::ZERO, Duration::saturating_add)
}

/// The longest one delivery of `spec` is held before it is settled: every
/// in-process attempt running to its timeout, plus tier one's waits at
/// their longest. `None` for a job without a timeout. A backend that takes a
/// delivery back after a fixed time (RabbitMQ's `consumer_timeout`) must
/// allow at least this.
pub fn longest_hold(spec: &JobSpec) -> Option<Duration> {
    let timeout = spec.timeout.filter(|t| !t.is_zero())?;
    Some(
        timeout
            .saturating_mul(spec.tier_one.attempts.max(1))
            .saturating_add(tier_one_waits(spec)),
    )
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

    /// With one delivery, the longest hold of that delivery is the whole
    /// time to failure; without a timeout there is no bound.
    #[test]
    fn longest_hold_is_one_deliverys_time_to_failure() {
        let job = Job::<()>::builder("one-delivery")
            .max_deliveries(1)
            .tier_one(3)
            .tier_one_max_wait(Duration::from_secs(2))
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let budget = failure_budget(job.spec(), Duration::ZERO);
        assert_eq!(longest_hold(job.spec()), budget.time_to_failure());
        assert!(longest_hold(job.spec()).unwrap() > Duration::from_secs(90));
        let unbounded = Job::<()>::builder("no-timeout").build().unwrap();
        assert_eq!(longest_hold(unbounded.spec()), None);
    }

    #[test]
    fn three_by_three() {
        let job = Job::<()>::builder("model-call")
            .max_deliveries(3)
            .backoff(Duration::from_secs(10), 2.0, Duration::ZERO)
            .tier_one(3)
            .tier_one_backoff(Duration::from_millis(100), 2.0, Duration::ZERO)
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let b = failure_budget(job.spec(), Duration::ZERO);
        assert_eq!(b.executions, Some(9));
        // tier one: a retry-after of up to max_wait (5 s) may replace each of
        // the 100ms and 200ms backoffs, in each of 3 deliveries; tier two:
        // 10s + 20s.
        assert_eq!(
            b.waiting,
            Some(Duration::from_secs(30) + Duration::from_secs(30))
        );
        assert_eq!(b.executing, Some(Duration::from_secs(9)));
        assert_eq!(b.time_to_failure(), Some(Duration::from_secs(69)));
    }

    #[test]
    fn each_tier_one_wait_is_the_longer_of_backoff_and_max_wait() {
        let job = Job::<()>::builder("model-call")
            .max_deliveries(3)
            .backoff(Duration::from_secs(10), 2.0, Duration::ZERO)
            .tier_one(3)
            .tier_one_backoff(Duration::from_millis(100), 2.0, Duration::ZERO)
            .tier_one_max_wait(Duration::from_millis(150))
            .build()
            .unwrap();
        let b = failure_budget(job.spec(), Duration::ZERO);
        // max(100ms, 150ms) + max(200ms, 150ms), x3; then 10s + 20s.
        assert_eq!(
            b.waiting,
            Some(Duration::from_millis(3 * 350) + Duration::from_secs(30))
        );
    }

    #[test]
    fn driver_timing_uses_the_hint_and_no_cap_is_unbounded() {
        let job = Job::<()>::builder("j").max_deliveries(4).build().unwrap();
        let b = failure_budget(job.spec(), Duration::from_secs(30));
        assert_eq!(b.waiting, Some(Duration::from_secs(90)));
        assert_eq!(b.executing, None);
        let job = Job::<()>::builder("j").build().unwrap();
        let b = failure_budget(job.spec(), Duration::ZERO);
        assert_eq!((b.executions, b.time_to_failure()), (None, None));
        assert_eq!(human(Some(Duration::from_millis(90_500))), "1m 30.500s");
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::*;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        use proptest::prelude::*;

        use crate::{
            CancelToken, Envelope, Incoming, JobContext, JobError, Registry, Runtime, Settlement,
            VirtualRuntime,
        };

        const MS: fn(u64) -> Duration = Duration::from_millis;

        /// One execution's behaviour: an ordinary error or a tier-one
        /// retry-after (`Some(per-mille of max_wait)`), after working for a
        /// per-mille of the timeout.
        type Step = (Option<u64>, u64);

        /// A backoff cap the declaration accepts: none (0) or at least `initial`.
        fn cap_of(initial: u64, max: u64) -> u64 {
            if max == 0 {
                0
            } else {
                max.max(initial)
            }
        }

        proptest! {
            #[test]
            fn an_always_failing_job_fails_within_its_budget(
                cap in 1u32..=4,
                tier_one in 1u32..=4,
                t1 in (0u64..500, 1.0f64..3.0, 0u64..2_000),
                max_wait_ms in 0u64..3_000,
                t2 in proptest::option::of((0u64..5_000, 1.0f64..3.0, 0u64..20_000)),
                timeout_ms in proptest::option::of(1u64..1_000),
                hint_ms in 0u64..10_000,
                steps in proptest::collection::vec((proptest::option::of(0u64..=1_000), 0u64..1_000), 16),
            ) {
                let mut builder = Job::<u32>::builder("work")
                    .delivery_cap((cap > 0).then_some(cap))
                    .tier_one(tier_one)
                    .tier_one_backoff(MS(t1.0), t1.1, MS(cap_of(t1.0, t1.2)))
                    .tier_one_max_wait(MS(max_wait_ms));
                if let Some((initial, multiplier, max)) = t2 {
                    builder = builder.backoff(MS(initial), multiplier, MS(cap_of(initial, max)));
                }
                if let Some(t) = timeout_ms {
                    builder = builder.timeout(MS(t));
                }
                let job = builder.build().unwrap();
                let runtime = VirtualRuntime::new();
                let executions = Arc::new(AtomicUsize::new(0));
                let mut registry = Registry::new();
                let (rt, n, steps): (Arc<dyn Runtime>, _, Arc<Vec<Step>>) =
                    (Arc::new(runtime.clone()), executions.clone(), Arc::new(steps));
                registry
                    .register(&job, move |ctx: JobContext, _: u32| {
                        let (rt, steps) = (rt.clone(), steps.clone());
                        let (retry_after, work) = steps[n.fetch_add(1, Ordering::SeqCst) % steps.len()];
                        async move {
                            if let Some(t) = timeout_ms {
                                rt.sleep(MS(t * work / 1_000)).await;
                            }
                            // The budget assumes a tier-two retry-after is no
                            // longer than the backoff: only in-process attempts
                            // that tier one will retry ask for one.
                            let last = ctx.in_process_attempt() >= ctx.in_process_limit();
                            match retry_after {
                                Some(per_mille) if !last => Err(JobError::retry_after(
                                    "slow down",
                                    MS(max_wait_ms * per_mille / 1_000),
                                )),
                                _ => Err(JobError::new("down")),
                            }
                        }
                    })
                    .unwrap();
                let budget = failure_budget(job.spec(), MS(hint_ms));
                let body = Envelope::new("work", serde_json::json!(7)).encode();
                let rt: Arc<dyn Runtime> = Arc::new(runtime.clone());
                let mut failed = false;
                for attempt in 1..=cap {
                    let delivery = Incoming {
                        queue: "q",
                        body: &body,
                        attempt,
                        shutdown_returns: None,
                        deadline: None,
                    };
                    let processed =
                        futures_executor::block_on(registry.process(delivery, &rt, &CancelToken::new()));
                    match processed.settlement {
                        Settlement::Retry { delay, shutdown: false } => {
                            runtime.advance(delay.unwrap_or(MS(hint_ms)))
                        }
                        Settlement::Fail(_) => {
                            failed = true;
                            break;
                        }
                        other => panic!("unexpected settlement {other:?}"),
                    }
                }
                prop_assert!(failed, "the last delivery fails for good");
                prop_assert_eq!(
                    executions.load(Ordering::SeqCst) as u64,
                    budget.executions.unwrap()
                );
                let bound = match timeout_ms {
                    Some(_) => budget.time_to_failure().unwrap(),
                    None => budget.waiting.unwrap(),
                };
                prop_assert!(
                    runtime.elapsed() <= bound,
                    "took {:?}, budget says {:?}: {}",
                    runtime.elapsed(),
                    bound,
                    budget
                );
            }
        }
    }
}
