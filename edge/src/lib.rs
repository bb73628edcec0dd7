//! Cloudflare Queues for the queue facade.
//!
//! The same [`queue::Job`] declarations and handlers that run natively run
//! here, in a Workers queue consumer compiled to wasm32. Each message of a
//! batch goes through [`queue::Registry::deliver`] (the same pipeline, rules
//! and two retry tiers as natively) and is settled explicitly: ack, `retry` with
//! `delaySeconds`, no request for a rejection, or a terminal failure that is
//! logged (and sent to a failure-queue binding when one is configured) before
//! the ack. No error or panic escapes the entry point with a message left to
//! the platform's whole-batch retry.
//!
//! # Layout
//!
//! - [`plan`]: how a settlement maps onto the platform (delay rounding, the
//!   24-hour limit, the invocation budget, the `max_retries` check). Pure.
//! - `consumer`: [`EdgeConsumer`], the batch loop (wasm32 only).
//! - `producer`: [`EdgeProducer`], typed dispatch through a Queue binding
//!   (wasm32 only).
//! - `js`: the bindings workers-rs 0.8 does not expose (`Message.attempts`).
//! - `runtime`: the Workers timer behind the rules' injected sleep.
//!
//! # Wiring a worker
//!
//! workers-rs's `#[event(queue)]` hides the message's `attempts`, so the
//! queue entry point is exported directly:
//!
//! ```ignore
//! use queue_edge::{EdgeConfig, EdgeConsumer};
//! use worker::{wasm_bindgen, wasm_bindgen::prelude::*, worker_sys, Env};
//!
//! #[wasm_bindgen]
//! pub async fn queue(batch: worker_sys::MessageBatch, env: Env, _ctx: worker_sys::Context) -> Result<JsValue, JsValue> {
//!     let consumer = EdgeConsumer::new(registry(), EdgeConfig::default()).expect("valid configuration");
//!     consumer.consume(&batch, &env).await;
//!     Ok(JsValue::UNDEFINED)
//! }
//! ```
//!
//! # Attempts and the invocation budget
//!
//! Attempts come from the platform's `Message.attempts` (first = 1). The
//! platform has no lease renewal, so a batch must fit in one invocation: the
//! consumer takes a budget ([`EdgeConfig::budget`]), gives each execution a
//! deadline no later than the budget's end (less the settlement reserve), and
//! retries at once, without running, a message it reaches when too little of
//! the budget is left. The platform counts that delivery as an attempt: a
//! message deferred `k` times has `k` fewer executions before the job's cap.
//! Deferral happens only when a batch is slower than the budget, so size
//! `max_batch_size` and the budget so that it is rare.

pub mod plan;

#[cfg(target_arch = "wasm32")]
mod consumer;
#[cfg(target_arch = "wasm32")]
mod js;
#[cfg(target_arch = "wasm32")]
mod producer;
#[cfg(target_arch = "wasm32")]
mod runtime;

#[cfg(target_arch = "wasm32")]
pub use consumer::{BatchSummary, EdgeConsumer};
pub use plan::{EdgeConfig, EdgeError, EdgeErrorKind};
#[cfg(target_arch = "wasm32")]
pub use producer::EdgeProducer;
#[cfg(target_arch = "wasm32")]
pub use runtime::WorkersRuntime;
