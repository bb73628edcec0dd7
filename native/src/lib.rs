//! Native worker runtime and drivers for the queue facade.
//!
//! The rules live in the `queue` crate; this crate runs them on tokio
//! against a backend. Declare jobs with [`queue::Job`], register handlers in
//! a [`queue::Registry`], dispatch with a [`Producer`], and consume with a
//! [`Consumer`].
//!
//! # Layout
//!
//! - [`driver`]: the interface every backend implements.
//! - [`producer`]: typed dispatch.
//! - [`consumer`]: the worker loop, concurrency and graceful shutdown.
//! - [`memory`]: the in-memory backend (feature `memory`, on by default).
//! - `rabbitmq`: RabbitMQ through lapin (feature `rabbitmq`).
//! - `sqs`: Amazon SQS through aws-sdk-sqs (feature `sqs`).
//! - `nats`: NATS JetStream through async-nats (feature `nats`).
//! - [`runtime`]: tokio's clock and sleep for the rules.
//! - `overrides`: operator overrides from `QUEUE_CONFIG` and the
//!   environment ([`apply_env_overrides`]).
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use queue::{Job, JobContext, Registry};
//! use queue_native::{Consumer, MemoryDriver, Producer};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Greet { name: String }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let job = Job::<Greet>::builder("greet").build().unwrap();
//! let driver = Arc::new(MemoryDriver::default());
//! Producer::new(driver.clone()).dispatch(&job, &Greet { name: "Ada".into() }).await.unwrap();
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

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

pub mod consumer;
pub mod driver;
#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
mod overrides;
pub mod producer;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
pub mod runtime;
#[cfg(feature = "sqs")]
pub mod sqs;
mod support;

pub use consumer::{shutdown_signal, Consumer, ConsumerBuilder, ConsumerHandle};
pub use driver::{Capabilities, Delivery, Driver, DriverError, ErrorKind, Outgoing, Subscription};
#[cfg(feature = "memory")]
pub use memory::{MemoryConfig, MemoryDriver};
#[cfg(feature = "nats")]
pub use nats::{NatsConfig, NatsDriver};
pub use overrides::{apply_env_overrides, overrides_from_env};
pub use producer::{DispatchOptions, Producer};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::{RabbitConfig, RabbitDriver};
pub use runtime::TokioRuntime;
#[cfg(feature = "sqs")]
pub use sqs::{SqsConfig, SqsCredentials, SqsDriver};
