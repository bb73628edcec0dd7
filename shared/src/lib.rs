//! jobrail: the rules every host shares.
//!
//! An application declares a typed [`Job`] once and registers its handler in
//! a [`Registry`]. Every host (the native worker, the Cloudflare edge and the
//! simulation) runs each delivery through [`Registry::deliver`]: it decides
//! how to settle it ([`Registry::process`]), has the backend carry the
//! settlement out through a [`DeliveryHandle`], and reports the backend's
//! answer ([`Registry::settled`]). This crate decides; drivers act. It does
//! no I/O, owns no async runtime and builds for `wasm32-unknown-unknown` as
//! well as native targets.
//!
//! # Example
//!
//! A job is declared once (its name, queue and retry policy) and its
//! handler registered once; any host runs it. Here the test queue of
//! [`testing`] runs it on virtual time, as a unit test of the application
//! would:
//!
//! ```
//! use std::time::Duration;
//! use jobrail::testing::{MessageState, TestQueue};
//! use jobrail::{Job, JobContext, JobError, Registry};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct BuildReport { report_id: u64 }
//!
//! let job = Job::<BuildReport>::builder("build-report")
//!     .max_deliveries(5)
//!     .backoff(Duration::from_secs(2), 2.0, Duration::from_secs(10))
//!     .build()?;
//! let mut registry = Registry::new();
//! registry.register(&job, |ctx: JobContext, report: BuildReport| async move {
//!     if ctx.attempt() < 3 {
//!         return Err(JobError::new(format!("report {}: upstream unavailable", report.report_id)));
//!     }
//!     Ok(())
//! })?;
//!
//! let mut queue = TestQueue::new(registry);
//! let sent = queue.send(&job, &BuildReport { report_id: 7 });
//! queue.run_until_idle();
//! assert_eq!(queue.state(&sent), &MessageState::Acked);
//! assert_eq!(queue.message(&sent).attempts(), [1, 2, 3]);
//! assert_eq!(queue.now(), Duration::from_secs(2 + 4)); // virtual time
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Below the test queue, every host calls the same three steps; this is
//! the first of them for one delivery:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use jobrail::{CancelToken, Incoming, Envelope, Job, JobContext, JobError, Registry, Runtime, Settlement, VirtualRuntime};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct BuildReport { report_id: u64 }
//!
//! let job = Job::<BuildReport>::builder("build-report")
//!     .max_deliveries(5)
//!     .backoff(Duration::from_secs(2), 2.0, Duration::from_secs(10))
//!     .build()
//!     .unwrap();
//! let mut registry = Registry::new();
//! registry
//!     .register(&job, |_ctx: JobContext, _report: BuildReport| async {
//!         Err::<(), _>(JobError::new("upstream unavailable"))
//!     })
//!     .unwrap();
//!
//! let body = Envelope::new("build-report", serde_json::json!({"report_id": 1})).encode();
//! let runtime: Arc<dyn Runtime> = Arc::new(VirtualRuntime::new());
//! let delivery = Incoming { queue: "default", body: &body, attempt: 1, shutdown_returns: None, deadline: None };
//! let processed = futures_executor::block_on(
//!     registry.process(delivery, &runtime, &CancelToken::new()),
//! );
//! assert_eq!(processed.settlement, Settlement::Retry { delay: Some(Duration::from_secs(2)), shutdown: false });
//! ```
//!
//! # The guide
//!
//! The crate's API is documented item by item here; how to use it is in
//! the [guide](https://github.com/jobrail/jobrail/blob/main/guide/README.md): [declaring jobs](https://github.com/jobrail/jobrail/blob/main/guide/jobs.md),
//! [the settlement rules](https://github.com/jobrail/jobrail/blob/main/guide/rules.md) (the contract every backend
//! keeps), [two tiers and the failure budget](https://github.com/jobrail/jobrail/blob/main/guide/tiers.md),
//! [running an effect once](https://github.com/jobrail/jobrail/blob/main/guide/claims.md), the backends, and
//! [operating](https://github.com/jobrail/jobrail/blob/main/guide/operating.md). Workers are in `jobrail-native`
//! (servers) and `jobrail-edge` (Cloudflare Queues).
//!
//! # Layout
//!
//! Every public item has one path, at the crate root (`jobrail::Job`,
//! `jobrail::Settlement`, ...). The modules are private, one concern each;
//! the main item of each carries the why. They sit in four folders, one per
//! layer, lowest first. **A module imports only from its own layer and the
//! layers below it, and no two modules import each other, directly or
//! through others**: `tests/layers.rs` reads every file and fails on an
//! import against the rule (the order and what belongs in each layer are
//! declared there). Unit tests inside a module may use anything.
//!
//! `model/`, the vocabulary:
//! - `maybe_send`, `runtime`, `cancel`: bounds for both targets, injected
//!   time, cancellation ([`MaybeSend`], [`Runtime`], [`CancelToken`]).
//! - `error`: handler outcomes as error markers found through the source
//!   chain ([`JobError`], [`Permanent`], [`RetryAfter`], [`Reject`],
//!   [`BreakerOpen`]).
//! - `panic`: panics of handlers and custom backoffs caught as errors.
//! - `policy`: the attempt cap and backoff schedule of tier two, and tier
//!   one ([`RetryPolicy`], [`Backoff`], [`TierOnePolicy`]).
//! - `redact`: decode errors without the payload values serde quotes
//!   ([`json_error`]).
//! - `envelope`: the versioned wire format ([`Envelope`]).
//! - `failure`, `record`: why a message failed terminally and the record
//!   kept of it ([`Failure`], [`FailureRecord`]).
//! - `backend`: a backend's answer to a request it did not confirm
//!   ([`SettlementError`], [`ErrorKind`]).
//! - `breaker`: the circuit breaker per named dependency
//!   ([`CircuitBreaker`]), which records its own metrics.
//! - `job`: declarations and their validated policy ([`Job`], [`JobSpec`]).
//!
//! `rules/`, pure decisions:
//! - `settle`: the decision table from what happened to what the backend
//!   should do ([`Settlement`]), the unknown-name and crash rules.
//! - `budget`: what a failing job costs before it ends (executions, waits)
//!   and the longest hold on one delivery ([`FailureBudget`],
//!   [`longest_hold`]).
//! - `replay`: the conventions of replaying failure records every failure
//!   store shares ([`Replay`], [`replay_message`]).
//!
//! `observe/`, what an operator sees:
//! - `stats`, `event`: counters and events ([`Stats`], [`Event`]).
//! - `metrics`: counters, histograms and gauges through the `metrics`
//!   facade, recorded where each fact is decided ([`describe_metrics`]).
//!
//! `run/`, running deliveries:
//! - `context`: what a handler knows about its execution ([`JobContext`]).
//! - `executor`: tier one, in-process retries inside a delivery.
//! - `registry`: handlers by name and the decision for one delivery
//!   ([`Registry`], [`Registry::process`]), a file per concern.
//! - `pipeline`: one delivery end to end (decide, settle, report), the
//!   entry point every host calls ([`Registry::deliver`], [`DeliveryHandle`]).
//! - `limit`: the broker-limit rule every host checks before consuming
//!   ([`check_delivery_limit`]).
//! - `retry_delay`: the delay-limit rule: no job declares a retry delay its
//!   backend cannot hold ([`check_retry_delays`], [`longest_retry_delay`]).
//! - `overrides`: operator overrides of tier depths and backoffs
//!   ([`Overrides`]).
//! - `claim`: running an effect once, through a claim on a business key
//!   ([`ClaimStore`], [`run_once`], [`Claim`]).
//! - `unique`: one dispatch per key and time window, on a claim store
//!   ([`dispatch_unique`]).
//! - `schedule`: recurring jobs, their ticks in a time zone and the rule
//!   that fires each tick once across schedulers ([`Schedule`],
//!   [`ScheduleFiring`], [`SchedulesConfig`]).
//! - `state`: shared state given once to the registry and read by type
//!   from each execution's context ([`MissingState`]).
//! - `testing` (not on wasm32): the public `jobrail::testing`, a registry's
//!   jobs run on virtual time through the pipeline every host runs.
//!

// On wasm32 the runtime is single-threaded and `MaybeSend` is empty, so shared
// state held in `Arc` need not be `Send`; one `Arc` type keeps both targets alike.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

mod model;
mod observe;
mod rules;
mod run;

pub use model::backend::{ErrorKind, SettlementError};
pub use model::breaker::{BreakerConfig, BreakerError, BreakerState, CircuitBreaker};
pub use model::cancel::{CancelToken, Cancellation};
pub use model::envelope::{
    delay_leg, delay_remaining, due_ms, encode_envelope, encode_envelope_with_id, new_message_id,
    unix_now_ms, with_due, Envelope, EnvelopeError,
};
pub use model::error::BreakerOpen;
pub use model::error::{
    BoxError, Cancelled, JobError, Outcome, Panicked, Permanent, Reject, RetryAfter,
};
pub use model::failure::{Failure, FailureKind};
pub use model::job::{BreakerFeed, Job, JobBuilder, JobSpec};
pub use model::maybe_send::{BoxFuture, MaybeSend, MaybeSync};
pub use model::policy::{
    whole_seconds_up, Backoff, PolicyError, RetryPolicy, TierOnePolicy, PANICKED_BACKOFF_DELAY,
};
pub use model::record::{
    FailureRecord, RawBody, Truncation, TRUNCATED_NAME_BYTES, TRUNCATED_REASON_BYTES,
};
pub use model::redact::json_error;
pub use model::runtime::{
    Clock, Instant, Runtime, SystemClock, SystemTime, VirtualRuntime, UNIX_EPOCH,
};
pub use observe::event::{Event, EventKind, EventSink};
pub use observe::metrics::describe_metrics;
pub use observe::stats::{JobStats, Resolution, Stats, UNREGISTERED_JOBS};
pub use rules::budget::{failure_budget, human, longest_hold, FailureBudget};
pub use rules::replay::{
    failure_entry_id, poison_reason, replay_id, replay_message, Replay, ReplayRefused,
    REPLAYED_AT_MS, REPLAY_OF, REPLAY_OF_MESSAGE,
};
pub use rules::settle::{
    deliveries_needed, exceeds_crash_bound, Settlement, UnknownNameAttempts,
    DEFAULT_UNKNOWN_NAME_ATTEMPTS, REFUSED_SETTLEMENT_HOLD, SETTLEMENT_BUDGET, SHUTDOWN_GRACE,
};
pub use run::claim::ClaimState;
#[cfg(feature = "memory-claims")]
pub use run::claim::MemoryClaims;
pub use run::claim::{
    run_once, validate_claim, Claim, ClaimError, ClaimHeld, ClaimStore, Once, MAX_CLAIM_KEY_BYTES,
    MAX_CLAIM_LEASE, MIN_HELD_RETRY,
};
pub use run::context::{DeadlineExceeded, Interrupted, JobContext};
pub use run::limit::{
    check_delivery_limit, check_job_delivery_limit, check_unknown_name_delivery_limit,
    unknown_name_deliveries_needed, DeliveryLimitError, LimitedBy,
};
pub use run::overrides::Overrides;
pub use run::pipeline::{Delivered, DeliveryHandle};
pub use run::registry::{Incoming, Processed, Registry, RegistryError};
pub use run::retry_delay::{
    check_job_retry_delay, check_retry_delays, longest_retry_delay, DelayOf, RetryDelayError,
    CUSTOM_BACKOFF_EVALUATIONS,
};
pub use run::schedule::{
    validate_schedule_name, FireReport, Missed, MissedTicks, Overlap, Schedule, ScheduleBuilder,
    ScheduleEntry, ScheduleError, ScheduleFiring, SchedulesConfig, Tick, TickDispatch, TickOutcome,
    TickReport, DEFAULT_GRACE, DEFAULT_TICK_LEASE, MANUAL_TICK, MAX_MISSED_EACH, MAX_PENDING_TICKS,
    MAX_SCHEDULE_NAME_BYTES, SCHEDULE_METADATA, SEND_RETRY, SEND_RETRY_HORIZON, TICK_METADATA,
    TRIGGERED_AT_METADATA,
};
pub use run::state::MissingState;
#[cfg(not(target_arch = "wasm32"))]
pub use run::testing;
pub use run::unique::{dispatch_unique, UniqueDispatch, UniqueDispatchError};
