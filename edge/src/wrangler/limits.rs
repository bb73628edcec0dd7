//! The delivery-limit rules of the facade (a job's cap, the unknown-name
//! cap) against a consumer's `max_retries`, phrased for wrangler.toml.

use jobrail::{
    check_job_delivery_limit, check_unknown_name_delivery_limit, JobSpec, LimitedBy, PolicyError,
    UnknownNameAttempts, SHUTDOWN_GRACE,
};

use super::{invalid, ConsumerSettings, MAX_RETRIES_LIMIT};

/// Whether the consumer of `queue`, whose `max_retries` is `max_retries`,
/// lets the facade, not the platform, end every message of the job `spec`:
/// the broker-cap rule ([`jobrail::check_job_delivery_limit`]) with the
/// platform's deliveries (`max_retries + 1`), on a backend that cannot
/// count graceful-shutdown returns, phrased for wrangler.toml. The error
/// names the job and the field `retry`.
pub(crate) fn job_max_retries(
    spec: &JobSpec,
    queue: &str,
    max_retries: u32,
) -> Result<(), PolicyError> {
    let deliveries = max_retries.saturating_add(1);
    let Err(refused) = check_job_delivery_limit(spec, queue, deliveries, false) else {
        return Ok(());
    };
    let reason = match (refused.by, refused.needed) {
        (LimitedBy::Job { cap, .. }, Some(needed)) => format!(
            "this job's cap of {cap} needs {needed} deliveries on Cloudflare (the cap, the delivery that records a message crashing the instance every time, and {SHUTDOWN_GRACE} of grace for a delivery handed back), but the consumer of `{queue}` has max_retries = {max_retries} ({deliveries} deliveries): {}",
            raise_to(needed)
        ),
        _ => format!(
            "this job has no cap, but the consumer of `{queue}` has max_retries = {max_retries}: the platform would end its messages with no failure record; give the job a cap"
        ),
    };
    Err(invalid(&spec.name, "retry", reason))
}

/// The unknown-name half of the rule for one job queue's consumer
/// ([`jobrail::check_unknown_name_delivery_limit`]), phrased for
/// wrangler.toml.
///
/// The facade fails a message with an unknown job name on delivery `limit`
/// without running anything, so the name alone cannot crash the instance.
/// But a delivery can still end without a settlement on Cloudflare: the
/// invocation budget can run out before the message is reached (it is
/// handed back and the platform counts the delivery), or a batch-mate's
/// panic can abort the instance. Hence the one delivery of grace
/// ([`jobrail::unknown_name_deliveries_needed`]).
pub(super) fn unknown_names_problem(
    queue: &str,
    consumer: &ConsumerSettings,
    cap: UnknownNameAttempts,
) -> Option<String> {
    let max_retries = consumer.max_retries;
    let deliveries = consumer.deliveries();
    let refused = check_unknown_name_delivery_limit(cap, queue, deliveries).err()?;
    Some(match (refused.by, refused.needed) {
        (LimitedBy::UnknownName { limit: Some(limit) }, Some(needed)) => format!(
            "queue `{queue}`: a message with an unknown job name fails on delivery {limit} (the registry's unknown-name cap), and with {SHUTDOWN_GRACE} of grace for a delivery handed back needs {needed} deliveries, but the consumer has max_retries = {max_retries} ({deliveries} deliveries): {}",
            raise_to(needed)
        ),
        _ => format!(
            "queue `{queue}`: the registry's unknown-name cap is unlimited, but the consumer has max_retries = {max_retries}: the platform would end such a message with no failure record; set a limited unknown-name cap"
        ),
    })
}

/// What to tell the operator when `needed` deliveries are required.
fn raise_to(needed: u32) -> String {
    let max_retries = needed.saturating_sub(1);
    if max_retries > MAX_RETRIES_LIMIT {
        format!(
            "that takes max_retries = {max_retries}, above the platform's limit of {MAX_RETRIES_LIMIT}: lower the cap"
        )
    } else {
        format!("raise max_retries to at least {max_retries} in wrangler.toml")
    }
}
