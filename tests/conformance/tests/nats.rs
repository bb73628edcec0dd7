//! The conformance suite against a real NATS server with JetStream
//! (`NATS_URL`, default `nats://127.0.0.1:4222`).
//!
//! Run with `cargo test -p jobrail-conformance --features nats --test nats`.
use std::time::Duration;

use jobrail_conformance::fixture::{Fixture, Nats};
use jobrail_native::nats::NatsConfig;

/// Short, so that redeliveries after a lost lease come quickly.
const ACK_WAIT: Duration = Duration::from_secs(2);

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Each scenario's queue name is unique, so its streams
/// (`CONFORMANCE_<queue>` and `CONFORMANCE_<queue>_failed`) are too; the
/// fixture deletes them when the test ends.
fn config() -> NatsConfig {
    let mut config = NatsConfig::new(url()).ack_wait(ACK_WAIT);
    config.subject_prefix = "conformance".into();
    config.stream_prefix = "CONFORMANCE".into();
    config.fetch_expiry = Duration::from_secs(2);
    config.connection_name = "conformance".into();
    config
}

jobrail_conformance::conformance_suite!(Fixture::<Nats>::new(config()));
