//! The conformance suite against a real RabbitMQ broker (`RABBITMQ_URL`,
//! default `amqp://guest:guest@127.0.0.1:5672/%2f`).
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq --test rabbitmq`.
use std::time::Duration;

use jobrail_conformance::fixture::{Fixture, RabbitMq};
use jobrail_native::rabbitmq::RabbitConfig;

/// Small buckets so the scenarios' delays (tens to hundreds of ms) round up
/// to something short.
const BUCKETS_MS: &[u64] = &[50, 100, 250, 500, 1000, 2000, 5000];

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn config() -> RabbitConfig {
    let mut config = RabbitConfig::new(url())
        .delay_buckets(BUCKETS_MS.iter().map(|ms| Duration::from_millis(*ms)));
    config.connection_name = "conformance".into();
    // A refused settlement's message is held this long before it returns.
    config.refused_hold = Duration::from_secs(1);
    // The size scenarios send a message at the limit: 1 MiB, not the broker's 128 MiB.
    config.max_message_bytes = 1 << 20;
    config
}

// Queues declared by the fixture's drivers are deleted when each test ends.
jobrail_conformance::conformance_suite!(Fixture::<RabbitMq>::new(config()));
