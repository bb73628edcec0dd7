//! Retry policy: the attempt cap and the backoff schedule ([`RetryPolicy`], [`Backoff`]).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::model::panic::guard;

/// The delay schedule between attempts.
///
/// The schedule is a pure function of the attempt number so that every driver
/// and the edge compute the same delays, and so that it can be checked by
/// property tests rather than by sleeping. Arithmetic saturates: a huge
/// multiplier or attempt number yields the cap (or `Duration::MAX`), never a
/// panic or an overflow.
#[derive(Clone)]
pub enum Backoff {
    /// `initial * multiplier^(k-2)` before attempt `k`, capped at `max`
    /// (`max == 0` removes the cap).
    Exponential {
        /// Delay before the second attempt.
        initial: Duration,
        /// Growth factor; values below 1 (or NaN) are treated as 1.
        multiplier: f64,
        /// Upper bound on any delay; zero means no bound.
        max: Duration,
    },
    /// A custom function of the attempt about to run (always >= 2).
    Custom(Arc<dyn Fn(u32) -> Duration + Send + Sync>),
}

impl Backoff {
    /// An exponential schedule. A multiplier below 1 or NaN becomes 1.
    pub fn exponential(initial: Duration, multiplier: f64, max: Duration) -> Self {
        let multiplier = if multiplier.is_nan() || multiplier < 1.0 {
            1.0
        } else {
            multiplier
        };
        Backoff::Exponential {
            initial,
            multiplier,
            max,
        }
    }

    /// A custom schedule: `f(attempt)` for the attempt about to run (>= 2).
    /// The function may be called concurrently.
    pub fn custom(f: impl Fn(u32) -> Duration + Send + Sync + 'static) -> Self {
        Backoff::Custom(Arc::new(f))
    }

    /// The delay before attempt `attempt` (values below 2 are treated as 2).
    pub fn delay(&self, attempt: u32) -> Duration {
        let attempt = attempt.max(2);
        match self {
            Backoff::Exponential {
                initial,
                multiplier,
                max,
            } => {
                if initial.is_zero() {
                    return Duration::ZERO;
                }
                let factor = multiplier.powi((attempt - 2).min(i32::MAX as u32) as i32);
                let secs = initial.as_secs_f64() * factor;
                let raw = if secs.is_finite() && secs < Duration::MAX.as_secs_f64() {
                    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
                } else {
                    Duration::MAX
                };
                if max.is_zero() {
                    raw
                } else {
                    raw.min(*max)
                }
            }
            // A function that panics must not take the delivery down with it
            // (nor, with a zero fallback, turn into a hot redelivery loop).
            Backoff::Custom(f) => guard(|| f(attempt)).unwrap_or(PANICKED_BACKOFF_DELAY),
        }
    }
}

/// `delay` in whole seconds, rounded up so a delay is never shortened: what
/// a backend that counts delays in seconds (SQS `DelaySeconds`, Cloudflare
/// `delaySeconds`) is given.
pub fn whole_seconds_up(delay: Duration) -> u64 {
    delay
        .as_secs()
        .saturating_add(u64::from(delay.subsec_nanos() > 0))
}

/// The delay used when a custom backoff function panics (where panics can
/// be caught; on wasm32 a panic aborts the instance).
pub const PANICKED_BACKOFF_DELAY: Duration = Duration::from_secs(30);

impl fmt::Debug for Backoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backoff::Exponential {
                initial,
                multiplier,
                max,
            } => f
                .debug_struct("Exponential")
                .field("initial", initial)
                .field("multiplier", multiplier)
                .field("max", max)
                .finish(),
            Backoff::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// Tier two: how many deliveries a message gets and how long between them.
#[derive(Debug, Clone, Default)]
pub struct RetryPolicy {
    /// The delivery cap: total deliveries, counting the first (5 means one
    /// delivery and at most four redeliveries). Zero: no cap of the
    /// facade's, only the backend's own limit, if it has one.
    pub max_deliveries: u32,
    /// The schedule between deliveries. `None`: the driver's default timing.
    pub backoff: Option<Backoff>,
}

impl RetryPolicy {
    /// Whether `attempt` is the last one the cap allows.
    pub fn is_last(&self, attempt: u32) -> bool {
        self.max_deliveries != 0 && attempt >= self.max_deliveries
    }
}

/// Tier one: in-process attempts inside one delivery.
#[derive(Debug, Clone)]
pub struct TierOnePolicy {
    /// Executions per delivery, at least 1 (1 disables tier one).
    pub attempts: u32,
    /// The schedule between in-process attempts.
    pub backoff: Backoff,
    /// The longest wait tier one will sleep for. A retry-after longer than
    /// this is left to tier two (broker redelivery).
    pub max_wait: Duration,
}

impl Default for TierOnePolicy {
    fn default() -> Self {
        TierOnePolicy {
            attempts: 1,
            backoff: Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(2)),
            max_wait: Duration::from_secs(5),
        }
    }
}

/// An invalid job declaration or configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A field has a value the facade cannot use.
    #[error("job `{job}`: invalid `{field}`: {reason}")]
    Invalid {
        /// The job (or `*` for consumer-wide settings).
        job: String,
        /// The field (`backoff.initial`, `tier_one.attempts`, ...), or what
        /// was being read for consumer-wide errors (`config file`).
        field: Cow<'static, str>,
        /// Why.
        reason: String,
    },
}

impl PolicyError {
    pub(crate) fn invalid(
        job: &str,
        field: impl Into<Cow<'static, str>>,
        reason: impl Into<String>,
    ) -> Self {
        PolicyError::Invalid {
            job: job.to_string(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_seconds_round_up_never_down() {
        assert_eq!(whole_seconds_up(Duration::ZERO), 0);
        assert_eq!(whole_seconds_up(Duration::from_nanos(1)), 1);
        assert_eq!(whole_seconds_up(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds_up(Duration::from_millis(2001)), 3);
        assert_eq!(whole_seconds_up(Duration::MAX), u64::MAX);
    }
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn documented_exponential_example() {
        let b = Backoff::exponential(S(2), 2.0, S(10));
        let delays: Vec<_> = (2..=5).map(|k| b.delay(k)).collect();
        assert_eq!(delays, vec![S(2), S(4), S(8), S(10)]);
    }

    #[test]
    fn documented_custom_example() {
        let b = Backoff::custom(|a| S(5) * (a - 1));
        let delays: Vec<_> = (2..=4).map(|k| b.delay(k)).collect();
        assert_eq!(delays, vec![S(5), S(10), S(15)]);
    }

    #[test]
    fn multiplier_below_one_or_nan_becomes_one() {
        for m in [0.5, -3.0, f64::NAN] {
            let b = Backoff::exponential(S(3), m, Duration::ZERO);
            assert_eq!(b.delay(9), S(3));
        }
    }

    #[test]
    fn zero_max_removes_the_cap() {
        let b = Backoff::exponential(S(1), 10.0, Duration::ZERO);
        assert_eq!(b.delay(5), S(1000));
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        let b = Backoff::exponential(Duration::MAX, f64::INFINITY, Duration::ZERO);
        assert_eq!(b.delay(u32::MAX), Duration::MAX);
        let capped = Backoff::exponential(S(1), 1e300, S(60));
        assert_eq!(capped.delay(u32::MAX), S(60));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn exponential_is_monotone_up_to_the_cap(
                initial_ms in 0u64..1_000_000,
                multiplier in prop_oneof![Just(f64::NAN), -10.0f64..1e6],
                max_ms in 0u64..10_000_000,
                k in 2u32..200,
            ) {
                let max = Duration::from_millis(max_ms);
                let b = Backoff::exponential(Duration::from_millis(initial_ms), multiplier, max);
                let now = b.delay(k);
                let next = b.delay(k + 1);
                prop_assert!(next >= now);
                if !max.is_zero() {
                    prop_assert!(now <= max);
                }
                let floor = if max.is_zero() { Duration::from_millis(initial_ms) } else { Duration::from_millis(initial_ms).min(max) };
                prop_assert!(now >= floor);
            }

            #[test]
            fn never_panics_on_any_input(
                initial_ns in any::<u64>(),
                secs in any::<u64>(),
                multiplier in any::<f64>(),
                max_s in any::<u64>(),
                k in any::<u32>(),
            ) {
                let b = Backoff::exponential(
                    Duration::new(secs, (initial_ns % 1_000_000_000) as u32),
                    multiplier,
                    Duration::from_secs(max_s),
                );
                let _ = b.delay(k);
            }

            #[test]
            fn huge_inputs_saturate_at_the_cap(max_s in 1u64..1_000_000, k in 60u32..u32::MAX) {
                let b = Backoff::exponential(Duration::from_secs(1), 2.0, Duration::from_secs(max_s));
                prop_assert_eq!(b.delay(k), Duration::from_secs(max_s));
            }
        }
    }
}
