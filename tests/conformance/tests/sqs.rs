//! The conformance suite against an SQS emulator (the `moto` server) at
//! `SQS_ENDPOINT`, for example `http://127.0.0.1:4517`.
//!
//! Run with
//! `SQS_ENDPOINT=$(tests/sqs-emulator) cargo test -p queue-conformance --features sqs --test sqs`.
//!
//! Short settings so the scenarios take seconds: a 2 s visibility timeout,
//! 1 s long polls. Every queue a test creates is deleted when it ends.
use std::time::Duration;

use queue_conformance::fixture::{Fixture, Sqs};
use queue_native::{SqsConfig, SqsCredentials};

fn config() -> SqsConfig {
    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "SQS_ENDPOINT is not set: start the emulator with `tests/sqs-emulator` and export \
             SQS_ENDPOINT=<the URL it prints> (e.g. http://127.0.0.1:4517)"
        )
    });
    SqsConfig::new("us-east-1")
        .endpoint(endpoint)
        .credentials(SqsCredentials::fixed("test", "test"))
        .visibility_timeout(Duration::from_secs(2))
        .wait_time(Duration::from_secs(1))
}

// Queues created by the fixture's drivers are deleted when each test ends.
queue_conformance::conformance_suite!(Fixture::<Sqs>::new(config()));
