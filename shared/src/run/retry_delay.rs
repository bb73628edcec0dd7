//! The delay-limit rule ([`check_retry_delays`]): no job may declare a
//! retry delay its backend cannot hold.
//!
//! Why: a backend with a longest retry delay (the memory driver's
//! `max_retry_delay`, RabbitMQ's largest hold bucket, SQS's 12 hours from
//! the receive, Cloudflare's 24 hours) refuses a longer retry. A refused
//! settlement is never an outcome (no event, nothing counted), and the
//! message comes back when the backend's lease ends, costing a delivery
//! each time: a job whose own backoff asks for more than the backend holds
//! would spend its deliveries on refusals and never wait what it declared.
//! That is a declaration error, so it is refused before anything is
//! consumed, like the broker-limit rule ([`crate::check_delivery_limit`]).
//! A delay chosen at run time (a handler's `retry_after`) cannot be checked
//! then; a backend that refuses it holds the message for its lease.

use std::fmt;
use std::time::Duration;

use crate::model::job::JobSpec;
use crate::model::policy::Backoff;
use crate::run::registry::Registry;

/// How many attempts of a custom schedule ([`Backoff::Custom`]) are
/// evaluated at most: all of a job's attempts up to its cap, or this many
/// for a job without a cap (whose longest delay is then a lower bound).
pub const CUSTOM_BACKOFF_EVALUATIONS: u32 = 10_000;

/// The longest tier-two delay `spec` declares: its backoff's delay before
/// the last delivery its cap allows (the schedule never shrinks), `ZERO` for
/// a job without a backoff (the backend's own timing) or without retries.
/// `None`: no bound, for a job without a cap whose exponential backoff has
/// no maximum. A custom schedule is evaluated for every attempt up to the
/// cap, at most [`CUSTOM_BACKOFF_EVALUATIONS`].
pub fn longest_retry_delay(spec: &JobSpec) -> Option<Duration> {
    let cap = spec.retry.max_deliveries;
    if cap == 1 {
        return Some(Duration::ZERO);
    }
    let Some(backoff) = &spec.retry.backoff else {
        return Some(Duration::ZERO);
    };
    match backoff {
        Backoff::Exponential {
            initial,
            multiplier,
            max,
        } => {
            if cap >= 2 {
                Some(backoff.delay(cap))
            } else if initial.is_zero() || *multiplier <= 1.0 {
                Some(backoff.delay(2))
            } else if max.is_zero() {
                None
            } else {
                Some(*max)
            }
        }
        Backoff::Custom(_) => {
            let last = match cap {
                0 => CUSTOM_BACKOFF_EVALUATIONS,
                cap => cap.min(CUSTOM_BACKOFF_EVALUATIONS),
            };
            (2..=last.max(2)).map(|k| backoff.delay(k)).max()
        }
    }
}

/// Whose retry delay a [`RetryDelayError`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DelayOf {
    /// A registered job's backoff, by the job's name.
    Job(String),
    /// The registry's unknown-name delay
    /// ([`Registry::unknown_name_retry_delay`]).
    UnknownName,
}

/// A declared retry delay longer than the backend holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryDelayError {
    /// The job (or the unknown-name rule) whose delay is too long.
    pub of: DelayOf,
    /// Its longest delay; `None`: without bound.
    pub longest: Option<Duration>,
    /// The backend's longest retry delay.
    pub allowed: Duration,
}

impl fmt::Display for RetryDelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let allowed = self.allowed;
        let longest = match self.longest {
            Some(d) => format!("up to {d:?}"),
            None => "without bound (no attempt cap, no maximum)".to_string(),
        };
        match &self.of {
            DelayOf::Job(name) => write!(
                f,
                "job `{name}`: its backoff asks for retry delays {longest}, but the backend's longest \
                 retry delay is {allowed:?}: it would refuse those retries and hold the message for \
                 its lease each time; lower the backoff's maximum (or the attempt cap) to at most \
                 {allowed:?}"
            ),
            DelayOf::UnknownName => write!(
                f,
                "the registry's unknown-name retry delay is {longest}, but the backend's longest \
                 retry delay is {allowed:?}; set Registry::unknown_name_retry_delay to at most \
                 {allowed:?}"
            ),
        }
    }
}

impl std::error::Error for RetryDelayError {}

/// Checks one job's declared delays against a backend's longest retry
/// delay `allowed` (see the module docs).
pub fn check_job_retry_delay(spec: &JobSpec, allowed: Duration) -> Result<(), RetryDelayError> {
    let longest = longest_retry_delay(spec);
    if longest.is_some_and(|d| d <= allowed) {
        return Ok(());
    }
    Err(RetryDelayError {
        of: DelayOf::Job(spec.name.clone()),
        longest,
        allowed,
    })
}

/// Checks every job of `registry` (by name) and its unknown-name delay
/// against a backend's longest retry delay `allowed`; the first that asks
/// for more is reported. Every host runs it before consuming: the native
/// consumer with its driver's `max_retry_delay`, the edge with the
/// platform's 24 hours.
pub fn check_retry_delays(registry: &Registry, allowed: Duration) -> Result<(), RetryDelayError> {
    let mut jobs: Vec<_> = registry.specs().collect();
    jobs.sort_by(|a, b| a.name.cmp(&b.name));
    for spec in jobs {
        check_job_retry_delay(spec, allowed)?;
    }
    let delay = registry.unknown_name_retry_delay_setting();
    if delay > allowed {
        return Err(RetryDelayError {
            of: DelayOf::UnknownName,
            longest: Some(delay),
            allowed,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Job;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn spec(cap: u32, backoff: Option<(Duration, f64, Duration)>) -> JobSpec {
        let mut builder = Job::<()>::builder("j").delivery_cap((cap > 0).then_some(cap));
        if let Some((initial, multiplier, max)) = backoff {
            builder = builder.backoff(initial, multiplier, max);
        }
        builder.build().unwrap().spec().clone()
    }

    #[test]
    fn the_longest_delay_is_the_last_the_cap_allows() {
        assert_eq!(longest_retry_delay(&spec(0, None)), Some(Duration::ZERO));
        assert_eq!(
            longest_retry_delay(&spec(1, Some((S(5), 2.0, S(60))))),
            Some(Duration::ZERO)
        );
        // 2, 4, 8, 10 s.
        assert_eq!(
            longest_retry_delay(&spec(5, Some((S(2), 2.0, S(10))))),
            Some(S(10))
        );
        assert_eq!(
            longest_retry_delay(&spec(4, Some((S(2), 2.0, S(10))))),
            Some(S(8))
        );
        // No cap: the maximum, or no bound without one.
        assert_eq!(
            longest_retry_delay(&spec(0, Some((S(2), 2.0, S(10))))),
            Some(S(10))
        );
        assert_eq!(
            longest_retry_delay(&spec(0, Some((S(2), 2.0, Duration::ZERO)))),
            None
        );
        assert_eq!(
            longest_retry_delay(&spec(0, Some((S(2), 1.0, Duration::ZERO)))),
            Some(S(2))
        );
        assert_eq!(
            longest_retry_delay(&spec(0, Some((Duration::ZERO, 3.0, Duration::ZERO)))),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn a_custom_schedule_is_evaluated_up_to_its_cap() {
        // Shrinking after attempt 3: the longest is not the last.
        let shape = |a: u32| if a == 3 { S(100) } else { S(u64::from(a)) };
        let capped = Job::<()>::builder("c")
            .max_deliveries(6)
            .backoff_fn(shape)
            .build()
            .unwrap();
        assert_eq!(longest_retry_delay(capped.spec()), Some(S(100)));
        let uncapped = Job::<()>::builder("u")
            .backoff_fn(|a| S(u64::from(a)))
            .build()
            .unwrap();
        assert_eq!(
            longest_retry_delay(uncapped.spec()),
            Some(S(u64::from(CUSTOM_BACKOFF_EVALUATIONS)))
        );
    }

    #[test]
    fn jobs_and_the_unknown_name_delay_are_held_to_the_limit() {
        let mut registry = Registry::new();
        for (name, max) in [("b-long", 120), ("a-short", 5)] {
            let job = Job::<u32>::builder(name)
                .max_deliveries(7)
                .backoff(S(1), 2.0, S(max))
                .build()
                .unwrap();
            registry
                .register(&job, |_: crate::JobContext, _: u32| async { Ok(()) })
                .unwrap();
        }
        registry.unknown_name_retry_delay(S(10));
        assert_eq!(check_retry_delays(&registry, S(32)), Ok(()));
        let err = check_retry_delays(&registry, S(31)).unwrap_err();
        assert_eq!(err.of, DelayOf::Job("b-long".into()));
        assert_eq!((err.longest, err.allowed), (Some(S(32)), S(31)));
        let text = err.to_string();
        assert!(
            text.contains("job `b-long`") && text.contains("32s") && text.contains("31s"),
            "{text}"
        );
        let err = check_retry_delays(&registry, S(4)).unwrap_err();
        assert_eq!(err.of, DelayOf::Job("a-short".into()), "by name, first");
        registry.unknown_name_retry_delay(S(40));
        let err = check_retry_delays(&registry, S(32)).unwrap_err();
        assert_eq!(err.of, DelayOf::UnknownName);
        assert!(err.to_string().contains("unknown-name"), "{err}");
        let unbounded = spec(0, Some((S(1), 2.0, Duration::ZERO)));
        let err = check_job_retry_delay(&unbounded, S(3600)).unwrap_err();
        assert!(err.to_string().contains("without bound"), "{err}");
    }
}
