//! The conformance suite: one set of scenarios every driver must pass.
//!
//! Each scenario is a plain async function taking a [`Backend`], so the same
//! code runs against the memory driver, RabbitMQ, and any driver a user
//! writes. Where backends legitimately differ, the scenario reads the
//! driver's [`Capabilities`](jobrail_native::Capabilities) instead of being
//! copied per driver; a scenario that needs a capability or a set-up some
//! backends lack is registered only for those that have it
//! ([`scenarios::registered`], as opendal registers its behaviour tests).
//! [`conformance_suite!`] expands to a test binary's `main` that registers
//! and runs the scenarios for a backend.
//!
//! To run the suite against your own driver, add a test target with
//! `harness = false` and:
//!
//! ```ignore
//! struct MyBackend;
//! #[async_trait::async_trait]
//! impl jobrail_conformance::Backend for MyBackend { /* connect, hooks... */ }
//! jobrail_conformance::conformance_suite!(MyBackend);
//! ```

pub mod claims;
pub mod crash;
pub mod edge;
pub mod failures;
pub mod fixture;
pub mod gated;
pub mod harness;
pub mod runner;
pub mod scenarios;
pub mod servers;

pub use fixture::{Broker, Fixture};
pub use harness::{Backend, Calls, Events, Harness, Hooks, Unreachable};

/// Expands to the `main` of a test binary (a target with `harness = false`)
/// running the claim-store suite ([`claims`]) on the fixture `$make` builds:
/// an expression evaluated for each scenario, which may `.await`.
#[macro_export]
macro_rules! claim_store_suite {
    ($make:expr) => {
        fn main() {
            $crate::claims::run(|| async { $make })
        }
    };
}

/// Expands to the `main` of a test binary (a target with
/// `harness = false`) running the suite on the backend `$make` builds: an
/// expression evaluated for each scenario, which may `.await`. Tests of the
/// backend beyond the suite follow `extra:`, each an `async fn()` run as a
/// test of its own.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr $(; extra: $($extra:ident),* $(,)?)?) => {
        fn main() {
            $crate::runner::run(
                || async { $make },
                vec![$($((
                    stringify!($extra),
                    (|| Box::pin($extra()) as $crate::runner::TestFuture)
                        as fn() -> $crate::runner::TestFuture,
                )),*)?],
            )
        }
    };
}
