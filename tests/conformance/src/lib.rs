//! The conformance suite: one set of scenarios every driver must pass.
//!
//! Each scenario is a plain async function taking a [`Backend`], so the same
//! code runs against the memory driver, RabbitMQ, and any driver a user
//! writes. Where backends legitimately differ, the scenario reads the
//! driver's [`Capabilities`](queue_native::Capabilities) instead of being
//! copied per driver. [`conformance_suite!`] expands to one `#[tokio::test]`
//! per scenario for a backend.
//!
//! To run the suite against your own driver:
//!
//! ```ignore
//! struct MyBackend;
//! #[async_trait::async_trait]
//! impl queue_conformance::Backend for MyBackend { /* connect, failure_records */ }
//! queue_conformance::conformance_suite!(MyBackend);
//! ```

pub mod crash;
pub mod fixture;
pub mod harness;
pub mod scenarios;
pub mod servers;

pub use fixture::{Broker, Fixture};
pub use harness::{Backend, Calls, Events, Harness};

/// Expands to one `#[tokio::test]` per scenario, each with a fresh backend
/// built by `$make` (an expression evaluated per test, which may `.await`).
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@tests $make;
            ack_on_success,
            ordinary_error_retries_then_succeeds,
            attempt_cap_ends_in_failure_record,
            exponential_backoff_delays_are_lower_bounds,
            custom_backoff_delays_are_lower_bounds,
            retry_after_overrides_backoff,
            retry_after_obeys_the_cap,
            permanent_fails_at_once,
            permanent_without_cause_is_a_failure,
            reject_is_not_retried_by_the_facade,
            undecodable_payload_fails_at_once_with_raw_body,
            malformed_envelope_fails_with_raw_body,
            unknown_name_retries_then_fails,
            panic_is_an_ordinary_error,
            timeout_deadline_is_visible_and_late_success_acks,
            shutdown_retries_interrupted_work_without_loss,
            shutdown_skips_the_cap,
            repeated_shutdowns_at_the_cap,
            shutdown_keeps_the_backlog,
            settlement_failure_emits_no_outcome_and_keeps_the_message,
            failed_event_follows_the_record,
            delayed_dispatch,
            concurrency_limit_is_respected,
            many_messages_nothing_lost,
            tier_one_times_tier_two_executions,
            tier_one_success_is_acked_on_first_delivery,
            open_breaker_skips_tier_one,
            validation_failure_costs_no_execution,
            shutdown_during_tier_one_backoff_retries_at_once,
            oversize_dispatch_is_refused_before_io,
            body_at_the_limit_round_trips,
        );
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend = $make;
                $crate::scenarios::$name(&backend).await;
            }
        )*
    };
}
