//! Tier one: in-process retries inside one delivery.
//!
//! Why two tiers: retrying in-process recovers from failures that are
//! transient in time (a network blip) in milliseconds, without a round trip
//! through the broker. Broker redelivery (tier two) recovers from failures
//! transient in place (a crashed process, a deploy). A message fails for good
//! only when both are exhausted, so an always-failing handler runs N x M
//! times, and that product is the failure path's cost.
//!
//! Tier one retries ordinary errors only, and short retry-afters. It stops
//! early when the job's circuit breaker is open (the dependency is down: let
//! the broker wait instead), when the next wait would pass the delivery's
//! deadline, and when the consumer shuts down.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{select, Either};

use crate::model::error::{Cancelled, JobError, Outcome};
use crate::model::job::{BreakerFeed, JobSpec};
use crate::model::maybe_send::BoxFuture;
use crate::model::panic::catch_panics;
use crate::model::runtime::Instant;
use crate::observe::metrics::JobMeter;
use crate::run::claim::ClaimHeld;
use crate::run::context::{ContextParts, JobContext};

/// What tier one did.
pub(crate) struct TierRun {
    /// The last execution's result (or `Cancelled` if shutdown interrupted a wait).
    pub(crate) result: Result<(), JobError>,
    /// Executions performed.
    pub(crate) executions: u32,
    /// The in-process attempt of the last execution.
    pub(crate) in_process: u32,
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub(crate) async fn run_tiers(
    spec: &JobSpec,
    mut run: impl FnMut(JobContext) -> BoxFuture<'static, Result<(), JobError>>,
    parts: &Arc<ContextParts>,
    meter: &JobMeter,
    delivery_deadline: Option<Instant>,
) -> TierRun {
    let runtime = &parts.runtime;
    let limit = spec.tier_one.attempts.max(1);
    let mut executions = 0;
    let mut attempt = 1;
    // The clock is read only for a timeout, or for the duration metric
    // when a recorder takes it.
    let timed = crate::observe::metrics::recording();
    loop {
        let now = (timed || spec.timeout.is_some()).then(|| runtime.now());
        let timeout_deadline = spec
            .timeout
            .zip(now)
            .and_then(|(t, now)| now.checked_add(t));
        let ctx = JobContext::new(
            parts,
            attempt,
            earliest(timeout_deadline, delivery_deadline),
        );
        let result = catch_panics(|| run(ctx)).await;
        if let Some(started) = now.filter(|_| timed) {
            meter.executed(
                result.is_ok(),
                runtime.now().saturating_duration_since(started),
            );
        }
        executions += 1;
        feed_breaker(spec, &result);
        let err = match result {
            Ok(()) => {
                return TierRun {
                    result: Ok(()),
                    executions,
                    in_process: attempt,
                }
            }
            Err(err) => err,
        };
        let wait = match err.outcome() {
            Outcome::Ordinary => spec.tier_one.backoff.delay(attempt + 1),
            Outcome::RetryAfter(delay) if delay <= spec.tier_one.max_wait => delay,
            _ => {
                return TierRun {
                    result: Err(err),
                    executions,
                    in_process: attempt,
                }
            }
        };
        let breaker_open = spec.breaker.as_ref().is_some_and(|b| b.is_open());
        if attempt >= limit || breaker_open {
            return TierRun {
                result: Err(err),
                executions,
                in_process: attempt,
            };
        }
        if let Some(deadline) = delivery_deadline {
            if runtime
                .now()
                .checked_add(wait)
                .is_none_or(|end| end >= deadline)
            {
                return TierRun {
                    result: Err(err),
                    executions,
                    in_process: attempt,
                };
            }
        }
        // Shutdown before or during the wait interrupts tier one: the
        // shutdown rule applies (zero-delay retry, cap skipped).
        if !wait_or_cancel(parts, wait).await {
            return TierRun {
                result: Err(Cancelled::new().into()),
                executions,
                in_process: attempt,
            };
        }
        attempt += 1;
    }
}

/// Counts an execution's result on the job's attached breaker, unless the
/// handler feeds it itself.
pub(crate) fn feed_breaker(spec: &JobSpec, result: &Result<(), JobError>) {
    let Some(breaker) = spec.breaker.as_ref() else {
        return;
    };
    if spec.breaker_feed != BreakerFeed::Executions {
        return;
    }
    match result {
        Ok(()) => breaker.record_success(),
        Err(err) => match err.outcome() {
            // A claim held by another worker says nothing about the dependency.
            Outcome::RetryAfter(_) if err.is::<ClaimHeld>() => {}
            Outcome::Ordinary | Outcome::RetryAfter(_) => breaker.record_failure(),
            Outcome::Permanent | Outcome::Reject | Outcome::Cancelled | Outcome::BreakerOpen => {}
        },
    }
}

/// Sleeps `wait`; `false` if the consumer was cancelled first.
async fn wait_or_cancel(parts: &ContextParts, wait: Duration) -> bool {
    if wait.is_zero() {
        return !parts.cancel.is_cancelled();
    }
    match select(parts.runtime.sleep(wait), parts.cancel.cancelled()).await {
        Either::Left(_) => !parts.cancel.is_cancelled(),
        Either::Right(_) => false,
    }
}
