//! The one decision: from what happened to what the backend should do
//! ([`Settlement`], whose docs give the rules).
//!
//! Every driver, and the edge, gets its settlement from here and only carries
//! it out. A rule change is one edit here, and the table-driven tests below
//! pin every row of the outcome table.

use std::time::Duration;

use crate::model::error::{JobError, Outcome};
use crate::model::failure::{Failure, FailureKind};
use crate::model::policy::RetryPolicy;
use crate::model::record::FailureRecord;

/// How long an unknown job name waits before its next delivery.
pub(crate) const UNKNOWN_NAME_RETRY_DELAY: Duration = Duration::from_secs(30);
/// The default cap on deliveries of a message whose job name is unknown.
pub const DEFAULT_UNKNOWN_NAME_ATTEMPTS: u32 = 10;
/// The fresh budget every settlement gets, detached from shutdown.
pub const SETTLEMENT_BUDGET: Duration = Duration::from_secs(30);
/// How long a message whose settlement the backend refused stays away, on a
/// backend without a lease of its own (the memory driver and RabbitMQ by
/// default, the edge): as long as a default SQS visibility timeout or
/// JetStream AckWait, so that a refused settlement never becomes a hot
/// loop on any backend.
pub const REFUSED_SETTLEMENT_HOLD: Duration = Duration::from_secs(30);

/// What the rules decide for a delivery: [`settle`]'s answer.
///
/// The registry turns a decision into a [`Settlement`] by attaching the
/// failure record to a terminal failure, so a backend never receives a
/// terminal failure without its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The work is done: remove the message.
    Ack,
    /// Deliver again. `None`: the driver's own timing; `Some(d)`: no sooner
    /// than `d` (a driver may round up or refuse, never shorten).
    Retry {
        /// The requested delay.
        delay: Option<Duration>,
        /// Whether this is the shutdown rule: the delivery was handed back
        /// because the consumer is stopping, not because the job failed.
        shutdown: bool,
    },
    /// No facade retry: the backend's own rejection policy decides.
    Reject,
    /// Terminal failure.
    Fail(Failure),
}

/// What the consumer asks the backend to do with a delivery.
///
/// Drivers carry it out and decide nothing: every host gets its settlement
/// from [`Registry::process`](crate::Registry::process) (through
/// [`Registry::deliver`](crate::Registry::deliver)). A terminal failure
/// carries the record to transfer before the message is removed, so one
/// cannot be built without it.
///
/// # The rules
///
/// The first row that applies decides. "Outermost" is the first outcome
/// marker found walking the handler error's source chain (see
/// [`JobError`](crate::JobError)); the cap is the job's
/// [`RetryPolicy::max_deliveries`](crate::RetryPolicy::max_deliveries) (0: none), and a
/// driver that cannot count deliveries reports attempt 0, so no cap applies.
///
/// | What happened | Settlement |
/// |---|---|
/// | the body is not an envelope this worker reads (poison) | `Fail`, [`FailureKind::MalformedEnvelope`], keeping the raw body |
/// | no handler is registered for the job name | `Retry` after the registry's unknown-name delay; `Fail`, [`FailureKind::UnknownName`], once the delivery count reaches [`UnknownNameAttempts`] |
/// | the payload does not decode, or the job's validation refuses it | `Fail`, [`FailureKind::UndecodablePayload`] or [`FailureKind::InvalidPayload`] |
/// | the delivery is past the crash bound ([`exceeds_crash_bound`]) | `Fail`, [`FailureKind::AttemptsExhausted`], without running the handler |
/// | the handler returned `Ok(())` | `Ack` |
/// | the consumer is stopping and the outermost marker is its cancellation | `Retry { delay: Some(0), shutdown: true }`: the delivery is handed back and does not spend the cap |
/// | outermost [`Permanent`](crate::Permanent) | `Fail`, [`FailureKind::Permanent`] |
/// | outermost [`Reject`](crate::Reject) | `Reject` |
/// | any other error on the delivery that reaches the cap | `Fail`, [`FailureKind::AttemptsExhausted`] |
/// | outermost [`RetryAfter`](crate::RetryAfter) of `d` | `Retry { delay: Some(d) }` (`None` when `d` is zero) |
/// | any other error | `Retry` with the job's backoff for the next delivery (`None` without a backoff: the driver's own timing) |
///
/// Tier one runs first: an ordinary error is retried in-process before it
/// reaches this table. A panic in the facade itself (not in a handler) is
/// retried after [`PANICKED_BACKOFF_DELAY`](crate::PANICKED_BACKOFF_DELAY).
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// The work is done: remove the message.
    Ack,
    /// Deliver again. `None`: the driver's own timing; `Some(d)`: no sooner
    /// than `d` (a driver may round up or refuse, never shorten).
    Retry {
        /// The requested delay.
        delay: Option<Duration>,
        /// Whether this is the shutdown rule: the delivery is handed back
        /// because the consumer is stopping. A driver that can carry a count
        /// across redeliveries counts these apart (see
        /// [`Incoming::shutdown_returns`](crate::Incoming::shutdown_returns)).
        shutdown: bool,
    },
    /// No facade retry: the backend's own rejection policy decides.
    Reject,
    /// Terminal failure: transfer this record (where the backend has a
    /// failure destination), then remove the message.
    Fail(Box<FailureRecord>),
}

impl Settlement {
    /// A short name: `ack`, `retry`, `reject` or `fail`.
    pub fn name(&self) -> &'static str {
        match self {
            Settlement::Ack => "ack",
            Settlement::Retry { .. } => "retry",
            Settlement::Reject => "reject",
            Settlement::Fail(_) => "fail",
        }
    }
}

/// The cap on deliveries of a message with an unknown job name.
///
/// Built only through [`UnknownNameAttempts::limited`] (where `0` restores
/// the default of [`DEFAULT_UNKNOWN_NAME_ATTEMPTS`]),
/// [`UnknownNameAttempts::unlimited`] or [`Default`], so a zero cap that
/// would fail an unknown name on its first delivery cannot be expressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownNameAttempts {
    /// `None`: no facade cap. Never `Some(0)`.
    limit: Option<u32>,
}

impl Default for UnknownNameAttempts {
    /// The default cap of [`DEFAULT_UNKNOWN_NAME_ATTEMPTS`] deliveries.
    fn default() -> Self {
        UnknownNameAttempts {
            limit: Some(DEFAULT_UNKNOWN_NAME_ATTEMPTS),
        }
    }
}

impl UnknownNameAttempts {
    /// Fail once the reported delivery count reaches `n`; `0` restores the
    /// default of 10.
    pub fn limited(n: u32) -> Self {
        UnknownNameAttempts {
            limit: Some(if n == 0 {
                DEFAULT_UNKNOWN_NAME_ATTEMPTS
            } else {
                n
            }),
        }
    }

    /// No facade cap (the broker's own limits still apply).
    pub fn unlimited() -> Self {
        UnknownNameAttempts { limit: None }
    }

    /// The delivery count at which an unknown name fails (at least 1);
    /// `None`: no facade cap.
    pub fn limit(&self) -> Option<u32> {
        self.limit
    }
}

/// Decides the settlement for a handler result (the handler rows of
/// [`Settlement`]'s table).
///
/// `attempt` is the delivery attempt the driver reported (first = 1; 0 means
/// the driver cannot count, and then no cap can be enforced). `cancelled` is
/// whether the consumer is shutting down.
pub(crate) fn settle(
    policy: &RetryPolicy,
    attempt: u32,
    result: &Result<(), JobError>,
    cancelled: bool,
) -> Decision {
    let err = match result {
        Ok(()) => return Decision::Ack,
        Err(err) => err,
    };
    let exhausted = || {
        Decision::Fail(Failure {
            kind: FailureKind::AttemptsExhausted,
            message: err.chain_text(),
        })
    };
    match err.outcome() {
        _ if is_shutdown(result, cancelled) => Decision::Retry {
            delay: Some(Duration::ZERO),
            shutdown: true,
        },
        Outcome::Permanent => Decision::Fail(Failure {
            kind: FailureKind::Permanent,
            message: err.chain_text(),
        }),
        Outcome::Reject => Decision::Reject,
        _ if policy.is_last(attempt) => exhausted(),
        Outcome::RetryAfter(delay) => Decision::Retry {
            delay: (!delay.is_zero()).then_some(delay),
            shutdown: false,
        },
        Outcome::Ordinary | Outcome::BreakerOpen | Outcome::Cancelled => Decision::Retry {
            delay: policy
                .backoff
                .as_ref()
                .map(|b| b.delay(attempt.saturating_add(1))),
            shutdown: false,
        },
    }
}

/// Deliveries past the cap that still run on a backend that cannot count
/// graceful-shutdown returns ([`Incoming::shutdown_returns`] is `None`):
/// one, so a shutdown that interrupts the last allowed delivery still gets
/// its redelivery run.
///
/// [`Incoming::shutdown_returns`]: crate::Incoming::shutdown_returns
pub const SHUTDOWN_GRACE: u32 = 1;

/// The crash rule: whether delivery `attempt` of a job capped at `cap`
/// (0: no cap) must fail without running, because earlier deliveries ended
/// without any settlement (a worker killed mid-job, every time).
///
/// A graceful-shutdown retry does not consume the cap: deliveries handed
/// back that way (`shutdown_returns`, where the backend counts them) are
/// added to the cap. A backend that cannot count them gets
/// [`SHUTDOWN_GRACE`] instead. So a message that kills its worker every
/// time ends on delivery `cap + 1` where shutdowns are counted (every
/// native driver: memory, RabbitMQ, NATS, SQS) and on delivery `cap + 2`
/// where they are not (Cloudflare), after at most `cap` (resp. `cap + 1`)
/// executions, plus one per graceful shutdown that interrupted it.
pub fn exceeds_crash_bound(cap: u32, attempt: u32, shutdown_returns: Option<u32>) -> bool {
    let allowance = shutdown_returns.unwrap_or(SHUTDOWN_GRACE);
    cap != 0 && attempt > cap.saturating_add(allowance)
}

/// The deliveries a backend must allow one message of a job capped at
/// `cap` so that the facade, not the backend's own limit, ends it: the cap,
/// plus the delivery on which the crash bound ([`exceeds_crash_bound`])
/// records a message that killed its worker every time, plus
/// [`SHUTDOWN_GRACE`] where the backend cannot count graceful-shutdown
/// returns. `None` for a job without a cap (0): no finite limit is enough.
/// A driver refuses a broker limit (JetStream `MaxDeliver`, SQS
/// `maxReceiveCount`, quorum `x-delivery-limit`, Cloudflare `max_retries`)
/// that allows fewer deliveries than this.
pub fn deliveries_needed(cap: u32, counts_shutdown_returns: bool) -> Option<u32> {
    let grace = if counts_shutdown_returns {
        0
    } else {
        SHUTDOWN_GRACE
    };
    (cap != 0).then(|| cap.saturating_add(1).saturating_add(grace))
}

/// Whether the shutdown rule applies: the consumer is shutting down and the
/// handler's error is (or wraps) the cancellation.
pub(crate) fn is_shutdown(result: &Result<(), JobError>, cancelled: bool) -> bool {
    cancelled
        && result
            .as_ref()
            .err()
            .is_some_and(|e| e.outcome() == Outcome::Cancelled)
}

/// Decides the settlement for a message whose job name has no handler.
///
/// The retry waits `delay` ([`UNKNOWN_NAME_RETRY_DELAY`] unless the consumer
/// was configured otherwise).
pub(crate) fn settle_unknown_name(
    name: &str,
    attempt: u32,
    cap: UnknownNameAttempts,
    delay: Duration,
) -> Decision {
    match cap.limit() {
        Some(n) if attempt >= n => Decision::Fail(Failure {
            kind: FailureKind::UnknownName,
            message: format!("unknown job name `{name}` after {attempt} deliveries"),
        }),
        _ => Decision::Retry {
            delay: Some(delay),
            shutdown: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::error::{Permanent, Reject, RetryAfter};
    use crate::model::policy::Backoff;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn policy(attempts: u32) -> RetryPolicy {
        RetryPolicy {
            max_deliveries: attempts,
            backoff: Some(Backoff::exponential(S(2), 2.0, S(10))),
        }
    }

    fn retry(d: Option<Duration>) -> Decision {
        Decision::Retry {
            delay: d,
            shutdown: false,
        }
    }

    fn kind(s: &Decision) -> Option<FailureKind> {
        match s {
            Decision::Fail(failure) => Some(failure.kind),
            _ => None,
        }
    }

    #[test]
    fn outcome_table() {
        type Case = (
            &'static str,
            fn() -> Result<(), JobError>,
            u32,
            bool,
            Decision,
        );
        let cases: Vec<Case> = vec![
            ("ok acks", || Ok(()), 1, false, Decision::Ack),
            (
                "ok acks even at the cap",
                || Ok(()),
                5,
                false,
                Decision::Ack,
            ),
            (
                "ordinary retries with backoff",
                || Err("x".into()),
                1,
                false,
                retry(Some(S(2))),
            ),
            (
                "ordinary at attempt 3 waits 8s",
                || Err("x".into()),
                3,
                false,
                retry(Some(S(8))),
            ),
            (
                "retry-after overrides backoff",
                || Err(JobError::retry_after("r", S(7))),
                1,
                false,
                retry(Some(S(7))),
            ),
            (
                "zero retry-after selects driver timing",
                || Err(RetryAfter::without_cause(Duration::ZERO).into()),
                1,
                false,
                retry(None),
            ),
            (
                "reject",
                || Err(JobError::reject("r")),
                1,
                false,
                Decision::Reject,
            ),
            (
                "reject without cause",
                || Err(Reject::without_cause().into()),
                5,
                false,
                Decision::Reject,
            ),
            (
                "cancelled during shutdown retries at once",
                || Err(crate::Cancelled::new().into()),
                5,
                true,
                Decision::Retry {
                    delay: Some(Duration::ZERO),
                    shutdown: true,
                },
            ),
            (
                "cancelled error without shutdown is ordinary",
                || Err(crate::Cancelled::new().into()),
                1,
                false,
                retry(Some(S(2))),
            ),
        ];
        for (name, result, attempt, cancelled, want) in cases {
            assert_eq!(
                settle(&policy(5), attempt, &result(), cancelled),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn terminal_rows() {
        let p = policy(5);
        let s = settle(&p, 1, &Err(JobError::permanent("gone")), false);
        assert_eq!(kind(&s), Some(FailureKind::Permanent));
        let s = settle(&p, 1, &Err(Permanent::without_cause().into()), false);
        assert_eq!(
            kind(&s),
            Some(FailureKind::Permanent),
            "permanent with no cause is a failure"
        );
        let s = settle(&p, 5, &Err("x".into()), false);
        assert_eq!(kind(&s), Some(FailureKind::AttemptsExhausted));
        let s = settle(&p, 5, &Err(JobError::retry_after("r", S(1))), false);
        assert_eq!(
            kind(&s),
            Some(FailureKind::AttemptsExhausted),
            "retry-after obeys the cap"
        );
        let s = settle(&p, 5, &Err(JobError::permanent("p")), true);
        assert_eq!(
            kind(&s),
            Some(FailureKind::Permanent),
            "shutdown does not turn permanent into retry"
        );
    }

    #[test]
    fn documented_schedules() {
        let p = policy(5);
        let mut delays = vec![];
        for attempt in 1..=5 {
            match settle(&p, attempt, &Err("x".into()), false) {
                Decision::Retry { delay, .. } => delays.push(delay.unwrap()),
                other => {
                    assert_eq!(attempt, 5);
                    assert_eq!(kind(&other), Some(FailureKind::AttemptsExhausted));
                }
            }
        }
        assert_eq!(delays, vec![S(2), S(4), S(8), S(10)]);

        let p = RetryPolicy {
            max_deliveries: 4,
            backoff: Some(Backoff::custom(|a| S(5) * (a - 1))),
        };
        let mut delays = vec![];
        for attempt in 1..=4 {
            match settle(&p, attempt, &Err("x".into()), false) {
                Decision::Retry { delay, .. } => delays.push(delay.unwrap()),
                other => assert_eq!(kind(&other), Some(FailureKind::AttemptsExhausted)),
            }
        }
        assert_eq!(delays, vec![S(5), S(10), S(15)]);
    }

    #[test]
    fn no_cap_and_no_backoff() {
        let p = RetryPolicy::default();
        assert_eq!(settle(&p, 1_000_000, &Err("x".into()), false), retry(None));
        assert_eq!(
            settle(&policy(3), 0, &Err("x".into()), false),
            retry(Some(S(2))),
            "attempt 0: unknown, no cap"
        );
    }

    #[test]
    fn a_backend_limit_must_leave_room_for_the_crash_bound() {
        assert_eq!(deliveries_needed(3, true), Some(4));
        assert_eq!(deliveries_needed(3, false), Some(5));
        assert_eq!(deliveries_needed(0, true), None);
        assert_eq!(deliveries_needed(u32::MAX, false), Some(u32::MAX));
        // The bound it protects: delivery cap + 1 is the one that records.
        assert!(!exceeds_crash_bound(3, 3, Some(0)));
        assert!(exceeds_crash_bound(3, 4, Some(0)));
        assert!(!exceeds_crash_bound(3, 4, None));
        assert!(exceeds_crash_bound(3, 5, None));
    }

    #[test]
    fn unknown_names() {
        // The default, and a zero cap (which means the default of 10).
        for cap in [
            UnknownNameAttempts::default(),
            UnknownNameAttempts::limited(0),
        ] {
            for attempt in 1..10 {
                assert_eq!(
                    settle_unknown_name("new-job", attempt, cap, UNKNOWN_NAME_RETRY_DELAY),
                    retry(Some(S(30))),
                    "{cap:?} attempt {attempt}"
                );
            }
            assert_eq!(
                kind(&settle_unknown_name(
                    "new-job",
                    10,
                    cap,
                    UNKNOWN_NAME_RETRY_DELAY
                )),
                Some(FailureKind::UnknownName)
            );
        }
        let cap = UnknownNameAttempts::default();
        assert_eq!(UnknownNameAttempts::limited(0), cap);
        assert_eq!(cap.limit(), Some(DEFAULT_UNKNOWN_NAME_ATTEMPTS));
        assert_eq!(UnknownNameAttempts::unlimited().limit(), None);
        let cap = UnknownNameAttempts::limited(20);
        assert_eq!(
            settle_unknown_name("j", 10, cap, UNKNOWN_NAME_RETRY_DELAY),
            retry(Some(S(30)))
        );
        assert_eq!(
            settle_unknown_name("j", 10_000, UnknownNameAttempts::unlimited(), S(30)),
            retry(Some(S(30)))
        );
    }
}
