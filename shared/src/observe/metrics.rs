//! Metrics through the `metrics` facade ([`describe_metrics`]).
//!
//! Why the facade: an application picks its exporter (Prometheus,
//! OpenTelemetry, StatsD...) by installing a recorder; the rules only say
//! what happened. Every fact is recorded where it is decided: a delivery and
//! its outcome where the backend's answer is reported
//! ([`Registry::settled`](crate::Registry::settled)), an execution where
//! tier one runs the handler, a settlement's latency where the pipeline waits
//! for the backend, a breaker's state where it changes. Nothing here does
//! I/O, so the crate still builds for wasm32.
//!
//! Without a recorder the hooks cost next to nothing: each asks the facade
//! once which recorder is current ([`recording`]) and, when it is the no-op
//! one, registers no handle and reads no clock (the handler and settlement
//! durations are timed only when a recorder will take them). The question
//! is asked at each hook, not cached, because a recorder can be installed
//! later or set for one thread (`metrics::set_default_local_recorder`).
//!
//! **A recorder of size zero counts as none.** The facade's no-op recorder
//! is told apart by its size (a unit struct), so a recorder type that holds
//! no state at all (a unit struct forwarding to a `static`, say) is taken
//! for it too. Such a recorder receives no per-delivery metric:
//! `jobrail_deliveries_total`, `jobrail_outcomes_total`,
//! `jobrail_failures_total`, `jobrail_resolutions_total`,
//! `jobrail_settlement_errors_total`, `jobrail_executions_total` (crashed
//! executions included), `jobrail_handler_duration_seconds` and
//! `jobrail_settlement_duration_seconds` are never registered with it nor
//! recorded. It still receives [`describe_metrics`]'s descriptions and the
//! breaker metrics (`jobrail_breaker_state`,
//! `jobrail_breaker_transitions_total`), which are not gated, as do the
//! metrics of `jobrail-native`. Give such a recorder one field (even a
//! `u8`, or an `Arc` of its state) and it receives everything.
//!
//! Labels are job and queue names, plus a few closed sets of words
//! (`outcome`, `kind`, `tier`, `settlement`, `error`, `result`). Job names
//! that no handler is registered for are counted under
//! [`UNREGISTERED_JOBS`](crate::UNREGISTERED_JOBS): the names come from
//! message bodies, and a producer must not be able to grow the number of
//! series. Payloads and message ids are never labels.
//!
//! The table of metrics is on [`describe_metrics`].

use std::sync::Arc;
use std::time::Duration;

use ::metrics::{
    describe_counter, describe_gauge, describe_histogram, Counter, Histogram, Key, Label, Level,
    Metadata, SharedString, Unit,
};

use crate::model::backend::{ErrorKind, SettlementError};
use crate::model::breaker::{BREAKER_STATE, BREAKER_TRANSITIONS};
use crate::model::failure::FailureKind;
use crate::observe::event::EventKind;
use crate::observe::stats::Resolution;
use crate::rules::settle::Settlement;

pub(crate) const DELIVERIES: &str = "jobrail_deliveries_total";
pub(crate) const OUTCOMES: &str = "jobrail_outcomes_total";
pub(crate) const FAILURES: &str = "jobrail_failures_total";
pub(crate) const RESOLUTIONS: &str = "jobrail_resolutions_total";
pub(crate) const SETTLEMENT_ERRORS: &str = "jobrail_settlement_errors_total";
pub(crate) const EXECUTIONS: &str = "jobrail_executions_total";
pub(crate) const HANDLER_DURATION: &str = "jobrail_handler_duration_seconds";
pub(crate) const SETTLEMENT_DURATION: &str = "jobrail_settlement_duration_seconds";

/// Registers the name, unit and meaning of every metric the rules record
/// with the installed recorder (exporters print them, as Prometheus's
/// `# HELP` lines). Call it once after installing a recorder; recording
/// works without it. A native worker calls
/// `jobrail_native::describe_metrics`, which also describes the metrics the
/// consumer records.
///
/// | name | type | labels | meaning |
/// |---|---|---|---|
/// | `jobrail_deliveries_total` | counter | `job`, `queue` | Deliveries whose settlement was requested, whatever the backend answered. |
/// | `jobrail_outcomes_total` | counter | `job`, `queue`, `outcome` | Settlements the backend accepted, by outcome: `succeeded`, `retried` (a tier-two retry, including a graceful shutdown's hand-back), `rejected`, `failed` (terminal). |
/// | `jobrail_failures_total` | counter | `job`, `queue`, `kind` | Accepted terminal failures by kind: `permanent`, `attempts_exhausted`, `undecodable_payload`, `malformed_envelope`, `unknown_name`, `invalid_payload`. |
/// | `jobrail_resolutions_total` | counter | `job`, `queue`, `tier` | Accepted successes by the tier that resolved them: `first_attempt`, `tier_one` (an in-process retry), `tier_two` (a redelivery). |
/// | `jobrail_settlement_errors_total` | counter | `job`, `queue`, `settlement`, `error` | Settlements (`ack`, `retry`, `reject`, `fail`) the backend refused or did not confirm, by error kind (`not_accepted`, `uncertain`, `unsupported`, `config`, `connection`, `stopped`, `encode`, `not_found`). The delivery stays with the backend. |
/// | `jobrail_executions_total` | counter | `job`, `queue`, `result` | Handler executions (`result`: `ok` or `error`; a panic is an error), tier-one retries included. |
/// | `jobrail_handler_duration_seconds` | histogram | `job`, `queue`, `result` | How long each handler execution took, on the consumer's clock. |
/// | `jobrail_settlement_duration_seconds` | histogram | `job`, `queue`, `settlement` | How long the backend took to answer a settlement request (accepted or not; a request that ran out of its budget counts the budget). |
/// | `jobrail_breaker_state` | gauge | `breaker` | A circuit breaker's state at its last change: 0 closed, 1 open, 2 half-open (a probe call is running). An open breaker whose cool-down has passed reads 1 until a call probes it. |
/// | `jobrail_breaker_transitions_total` | counter | `breaker`, `to` | Changes of a breaker's state, by the state entered (`closed`, `open`, `half_open`). |
///
/// `job` is the job name for registered jobs and `(unregistered)` for any
/// other name (unknown job names, bodies that are not envelopes); `breaker`
/// is the breaker's name.
pub fn describe_metrics() {
    describe_counter!(
        DELIVERIES,
        Unit::Count,
        "Deliveries whose settlement was requested, whatever the backend answered."
    );
    describe_counter!(
        OUTCOMES,
        Unit::Count,
        "Settlements the backend accepted, by outcome (succeeded, retried, rejected, failed)."
    );
    describe_counter!(
        FAILURES,
        Unit::Count,
        "Accepted terminal failures, by failure kind."
    );
    describe_counter!(
        RESOLUTIONS,
        Unit::Count,
        "Accepted successes, by the tier that resolved them (first_attempt, tier_one, tier_two)."
    );
    describe_counter!(
        SETTLEMENT_ERRORS,
        Unit::Count,
        "Settlements the backend refused or did not confirm, by settlement and error kind."
    );
    describe_counter!(
        EXECUTIONS,
        Unit::Count,
        "Handler executions, tier-one retries included, by result (ok, error)."
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "How long each handler execution took."
    );
    describe_histogram!(
        SETTLEMENT_DURATION,
        Unit::Seconds,
        "How long the backend took to answer a settlement request."
    );
    describe_gauge!(
        BREAKER_STATE,
        "A circuit breaker's state at its last change: 0 closed, 1 open, 2 half-open."
    );
    describe_counter!(
        BREAKER_TRANSITIONS,
        Unit::Count,
        "Changes of a circuit breaker's state, by the state entered."
    );
}

/// Where the recordings say they come from (what the facade's macros pass).
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

const OUTCOME_NAMES: [&str; 4] = ["succeeded", "retried", "rejected", "failed"];
const FAILURE_NAMES: [&str; 6] = [
    "permanent",
    "attempts_exhausted",
    "undecodable_payload",
    "malformed_envelope",
    "unknown_name",
    "invalid_payload",
];
const TIER_NAMES: [&str; 3] = ["first_attempt", "tier_one", "tier_two"];
const RESULT_NAMES: [&str; 2] = ["ok", "error"];
const SETTLEMENT_NAMES: [&str; 4] = ["ack", "retry", "reject", "fail"];

/// The keys of one job's metrics on one queue, made once (when the job is
/// registered, or at the first delivery of another job and queue): recording
/// through them builds no labels and allocates nothing, so without a
/// recorder a delivery pays a few calls into the facade's no-op recorder.
pub(crate) struct JobMeter {
    job: SharedString,
    queue: SharedString,
    deliveries: Key,
    outcomes: [Key; 4],
    failures: [Key; 6],
    resolutions: [Key; 3],
    executions: [Key; 2],
    handler: [Key; 2],
    settlement: [Key; 4],
}

impl JobMeter {
    /// The keys of `job` (already mapped to the counted name) on `queue`.
    pub(crate) fn new(job: &str, queue: &str) -> Self {
        let job = SharedString::from_shared(Arc::from(job));
        let queue = SharedString::from_shared(Arc::from(queue));
        JobMeter {
            deliveries: labelled(DELIVERIES, &job, &queue, None),
            outcomes: keys(OUTCOMES, "outcome", OUTCOME_NAMES, &job, &queue),
            failures: keys(FAILURES, "kind", FAILURE_NAMES, &job, &queue),
            resolutions: keys(RESOLUTIONS, "tier", TIER_NAMES, &job, &queue),
            executions: keys(EXECUTIONS, "result", RESULT_NAMES, &job, &queue),
            handler: keys(HANDLER_DURATION, "result", RESULT_NAMES, &job, &queue),
            settlement: keys(
                SETTLEMENT_DURATION,
                "settlement",
                SETTLEMENT_NAMES,
                &job,
                &queue,
            ),
            job,
            queue,
        }
    }

    /// Whether these are the keys of deliveries from `queue`.
    pub(crate) fn is_for(&self, queue: &str) -> bool {
        self.queue.as_ref() == queue
    }
}

/// `name{job, queue, label}` for each value of `label`.
fn keys<const N: usize>(
    name: &'static str,
    label: &'static str,
    values: [&'static str; N],
    job: &SharedString,
    queue: &SharedString,
) -> [Key; N] {
    values.map(|value| labelled(name, job, queue, Some((label, value))))
}

/// `name{job, queue, extra}`.
fn labelled(
    name: &'static str,
    job: &SharedString,
    queue: &SharedString,
    extra: Option<(&'static str, &'static str)>,
) -> Key {
    let mut labels = Vec::with_capacity(3);
    labels.push(Label::new("job", job.clone()));
    labels.push(Label::new("queue", queue.clone()));
    if let Some((key, value)) = extra {
        labels.push(Label::from_static_parts(key, value));
    }
    Key::from_parts(name, labels)
}

/// Whether a recorder other than the facade's no-op one is current (a
/// thread-local one, else the global one). The facade's no-op recorder, used
/// while none is installed, is a unit struct: the current recorder is taken
/// for it when it has no state at all, which no exporter is (every one holds
/// its registry or its connection).
pub(crate) fn recording() -> bool {
    ::metrics::with_recorder(|recorder| std::mem::size_of_val(recorder) != 0)
}

fn counter(key: &Key) -> Counter {
    ::metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA))
}

fn histogram(key: &Key) -> Histogram {
    ::metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
}

impl JobMeter {
    /// A delivery's settlement was answered: counts the delivery, and the
    /// outcome if the backend accepted it, or the settlement error.
    pub(crate) fn settled(
        &self,
        kind: &EventKind,
        settlement: &Settlement,
        outcome: Result<(), &SettlementError>,
    ) {
        if !recording() {
            return;
        }
        counter(&self.deliveries).increment(1);
        let error = match outcome {
            Ok(()) => {
                counter(&self.outcomes[outcome_index(kind)]).increment(1);
                match kind {
                    EventKind::Succeeded { resolution } => {
                        counter(&self.resolutions[resolution_index(resolution)]).increment(1);
                    }
                    EventKind::Failed { failure } => {
                        counter(&self.failures[failure_index(failure.kind)]).increment(1);
                    }
                    EventKind::Retried { .. } | EventKind::Rejected { .. } => {}
                }
                return;
            }
            Err(error) => error,
        };
        // Rare: the key is made each time.
        let labels = vec![
            Label::new("job", self.job.clone()),
            Label::new("queue", self.queue.clone()),
            Label::from_static_parts("settlement", settlement.name()),
            Label::from_static_parts("error", error_kind_label(error.kind())),
        ];
        counter(&Key::from_parts(SETTLEMENT_ERRORS, labels)).increment(1);
    }

    /// The backend answered a `settlement` request after `took` (the caller
    /// times it only when [`recording`]).
    pub(crate) fn settlement_took(&self, settlement: &Settlement, took: Duration) {
        histogram(&self.settlement[settlement_index(settlement)]).record(took.as_secs_f64());
    }

    /// One handler execution ended after `took` (the caller times it only
    /// when [`recording`]).
    pub(crate) fn executed(&self, ok: bool, took: Duration) {
        let i = usize::from(!ok);
        counter(&self.executions[i]).increment(1);
        histogram(&self.handler[i]).record(took.as_secs_f64());
    }

    /// One handler execution brought its host down (a panic where panics
    /// abort): counted as an error; its duration is unknown.
    pub(crate) fn crashed_execution(&self) {
        if !recording() {
            return;
        }
        counter(&self.executions[1]).increment(1);
    }
}

fn outcome_index(kind: &EventKind) -> usize {
    match kind {
        EventKind::Succeeded { .. } => 0,
        EventKind::Retried { .. } => 1,
        EventKind::Rejected { .. } => 2,
        EventKind::Failed { .. } => 3,
    }
}

fn resolution_index(resolution: &Resolution) -> usize {
    match resolution {
        Resolution::FirstAttempt => 0,
        Resolution::TierOne { .. } => 1,
        Resolution::TierTwo { .. } => 2,
    }
}

fn failure_index(kind: FailureKind) -> usize {
    match kind {
        FailureKind::Permanent => 0,
        FailureKind::AttemptsExhausted => 1,
        FailureKind::UndecodablePayload => 2,
        FailureKind::MalformedEnvelope => 3,
        FailureKind::UnknownName => 4,
        FailureKind::InvalidPayload => 5,
    }
}

fn settlement_index(settlement: &Settlement) -> usize {
    match settlement {
        Settlement::Ack => 0,
        Settlement::Retry { .. } => 1,
        Settlement::Reject => 2,
        Settlement::Fail(_) => 3,
    }
}

fn error_kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotAccepted => "not_accepted",
        ErrorKind::Uncertain => "uncertain",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Config => "config",
        ErrorKind::Connection => "connection",
        ErrorKind::Stopped => "stopped",
        ErrorKind::Encode => "encode",
        ErrorKind::NotFound => "not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The labels spell each kind as the failure record's JSON does, so a
    /// dashboard and the failure store agree.
    #[test]
    fn failure_kind_labels_match_the_serde_names() {
        for kind in [
            FailureKind::Permanent,
            FailureKind::AttemptsExhausted,
            FailureKind::UndecodablePayload,
            FailureKind::MalformedEnvelope,
            FailureKind::UnknownName,
            FailureKind::InvalidPayload,
        ] {
            let json = serde_json::to_value(kind).unwrap();
            assert_eq!(json.as_str(), Some(FAILURE_NAMES[failure_index(kind)]));
        }
    }
}
