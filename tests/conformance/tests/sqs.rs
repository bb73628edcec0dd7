//! The conformance suite against an SQS emulator (the `moto` server) at
//! `SQS_ENDPOINT`, for example `http://127.0.0.1:4517`.
//!
//! Run with
//! `SQS_ENDPOINT=$(tests/sqs-emulator) cargo test -p jobrail-conformance --features sqs --test sqs`.
//!
//! Short settings so the scenarios take seconds (see
//! [`sqs_emulator_config`]). Every queue a test creates is deleted when it
//! ends.

use jobrail_conformance::fixture::{sqs_emulator_config, Fixture, Sqs};

// Queues created by the fixture's drivers are deleted when each test ends.
jobrail_conformance::conformance_suite!(Fixture::<Sqs>::new(sqs_emulator_config()));
