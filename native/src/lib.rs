//! jobrail on servers: the native worker runtime (tokio) and drivers.
//!
//! The rules live in the `jobrail` crate; this crate runs them on tokio
//! against a backend. Declare jobs with [`jobrail::Job`], register handlers in
//! a [`jobrail::Registry`], dispatch with a [`Producer`], and consume with a
//! [`Consumer`]. Recurring jobs ([`jobrail::Schedule`]) are fired by a
//! [`Scheduler`] in every worker, each tick once
//! ([schedules](https://github.com/jobrail/jobrail/blob/main/guide/schedules.md)).
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use jobrail::{Job, JobContext, Registry};
//! use jobrail_native::{Consumer, MemoryDriver, Producer};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Greet { name: String }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let job = Job::<Greet>::builder("greet").build().unwrap();
//! let driver = Arc::new(MemoryDriver::default());
//! Producer::new(driver.clone()).dispatch(&job).send(&Greet { name: "Ada".into() }).await.unwrap();
//!
//! let mut registry = Registry::new();
//! registry.register(&job, |_ctx: JobContext, greet: Greet| async move {
//!     println!("hello, {}", greet.name);
//!     Ok(())
//! }).unwrap();
//! let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
//! while driver.depth("default") > 0 { tokio::task::yield_now().await; }
//! consumer.shutdown().await.unwrap();
//! # }
//! ```
//!
//! # The guide
//!
//! The [guide](https://github.com/jobrail/jobrail/blob/main/guide/README.md) has a chapter per concern:
//! [declaring jobs](https://github.com/jobrail/jobrail/blob/main/guide/jobs.md), [the settlement rules](https://github.com/jobrail/jobrail/blob/main/guide/rules.md),
//! each backend ([in memory](https://github.com/jobrail/jobrail/blob/main/guide/memory.md), [RabbitMQ](https://github.com/jobrail/jobrail/blob/main/guide/rabbitmq.md),
//! [NATS JetStream](https://github.com/jobrail/jobrail/blob/main/guide/nats.md), [Amazon SQS](https://github.com/jobrail/jobrail/blob/main/guide/sqs.md)),
//! [running an effect once](https://github.com/jobrail/jobrail/blob/main/guide/claims.md), [operating](https://github.com/jobrail/jobrail/blob/main/guide/operating.md)
//! (the `jobrail` CLI, failure records, metrics) and
//! [writing a driver](https://github.com/jobrail/jobrail/blob/main/guide/writing-a-driver.md).
//!
//! # What is where
//!
//! Every item has one path. The worker, the producer, the driver interface
//! ([`Driver`], [`Subscription`], [`Delivery`], [`Capabilities`],
//! [`DriverError`]), the in-memory backend ([`MemoryDriver`], feature
//! `memory`, on by default), tokio's clock ([`TokioRuntime`]), operator
//! overrides ([`apply_env_overrides`]) and the metrics' descriptions
//! ([`describe_metrics`]: what the worker records through the `metrics`
//! facade) are at the crate root. Each broker
//! driver is a module of its own, with its contract (topology, guarantees,
//! limits) in the module docs and its settings beside it:
//!
//! - `rabbitmq`: RabbitMQ through lapin (feature `rabbitmq`; `rabbitmq-tls`
//!   for `amqps://`): `rabbitmq::{RabbitDriver, RabbitConfig}`.
//! - `nats`: NATS JetStream through async-nats (feature `nats`):
//!   `nats::{NatsDriver, NatsConfig}`.
//! - `sqs`: Amazon SQS through aws-sdk-sqs (feature `sqs`):
//!   `sqs::{SqsDriver, SqsConfig, SqsCredentials}`.
//!
//! Running an effect once ([`jobrail::ClaimStore`], [`jobrail::run_once`])
//! is in crates of their own, so that their clients' versions are not part
//! of this crate's API:
//!
//! - `jobrail-postgres`: claims on Postgres, with completion in the
//!   caller's own transaction, and the transactional outbox for dispatch:
//!   `jobrail_postgres::{PgClaims, Outbox, OutboxRelay}`.
//! - `jobrail-redis`: claims on Redis with fencing tokens:
//!   `jobrail_redis::RedisClaims`.
//!
//! A driver of your own implements [`Driver`] with the helpers of
//! [`kit`] (errors that keep the client's cause, the stopped state, the
//! waits between reconnection attempts), as the drivers here do.
//!

/// The README's and the guide's examples, compiled and run as doc tests
/// (`native/tests/readme.rs` checks that every Rust block in them is one of
/// these or an excerpt of a built file).
#[cfg(doctest)]
mod readme_doctests {
    macro_rules! pages {
        ($($name:ident: $path:literal),* $(,)?) => {
            $(
                #[doc = include_str!($path)]
                struct $name;
            )*
        };
    }
    pages! {
        Readme: "../../README.md",
        Jobs: "../../guide/jobs.md",
        Rules: "../../guide/rules.md",
        Tiers: "../../guide/tiers.md",
        Claims: "../../guide/claims.md",
        Later: "../../guide/later.md",
        Schedules: "../../guide/schedules.md",
        Memory: "../../guide/memory.md",
        Rabbitmq: "../../guide/rabbitmq.md",
        Nats: "../../guide/nats.md",
        Sqs: "../../guide/sqs.md",
        Postgres: "../../guide/postgres.md",
        Edge: "../../guide/edge.md",
        EdgeWorker: "../../guide/edge-worker.md",
        EdgeSchedules: "../../guide/edge-schedules.md",
        Operating: "../../guide/operating.md",
        Dashboard: "../../guide/dashboard.md",
        Testing: "../../guide/testing.md",
        Performance: "../../guide/performance.md",
        WritingADriver: "../../guide/writing-a-driver.md",
        Wire: "../../guide/wire.md",
        Layout: "../../guide/layout.md",
    }
}

mod consumer;
mod driver;
mod failures;
pub mod kit;
#[cfg(feature = "memory")]
mod memory;
mod metrics;
#[cfg(feature = "nats")]
pub mod nats;
mod overrides;
mod producer;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
mod runtime;
mod scheduler;
#[cfg(feature = "sqs")]
pub mod sqs;
mod unique;

pub use crate::metrics::describe_metrics;
pub use consumer::{shutdown_signal, Consumer, ConsumerBuilder, ConsumerHandle};
pub use driver::{Capabilities, Delivery, Driver, DriverError, ErrorKind, Outgoing, Subscription};
pub use failures::{
    Admin, BulkReplay, ClaimedFailure, FailurePage, FailureStore, Failures, HeldFailures, Page,
    Purge, QueueDepth, Replayed, StoredFailure,
};
#[cfg(feature = "memory")]
pub use memory::{MemoryConfig, MemoryDriver};
pub use overrides::{apply_env_overrides, overrides_from_env};
pub use producer::{Dispatch, DispatchOptions, Producer, UniqueDispatchBuilder};
pub use runtime::TokioRuntime;
pub use scheduler::{
    OverlapGuard, Running, Scheduler, SchedulerBuilder, SchedulerHandle, TickSink, DEFAULT_POLL,
    RUNNING_LEASE,
};
pub use unique::{UniqueDispatch, UniqueDispatchError};
