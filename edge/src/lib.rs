//! jobrail on Cloudflare Queues: the same jobs and handlers as native, in a Workers queue consumer.
//!
//! The same [`jobrail::Job`] declarations and handlers that run natively run
//! here, in a Workers queue consumer compiled to wasm32. Each message of a
//! batch goes through [`jobrail::Registry::deliver`] (the same pipeline, rules
//! and two retry tiers as natively) and is settled explicitly: ack, `retry` with
//! `delaySeconds`, no request for a rejection, or a terminal failure that is
//! logged (and sent to a failure-queue binding when one is configured) before
//! the ack. No error or panic escapes the entry point with a message left to
//! the platform's whole-batch retry.
//!
//! # Example
//!
//! A worker's jobs run natively under the platform's delivery rules with
//! [`testing::CloudflareQueues`], on virtual time, as a unit test of the
//! worker would (the Worker itself is wired with [`consumer!`]; see
//! [Wiring a worker](#wiring-a-worker)):
//!
//! ```
//! use jobrail::{Job, JobContext, JobError, Registry, RegistryError};
//! use jobrail_edge::testing::{CloudflareQueues, MessageState};
//!
//! // The worker's wrangler.toml: the queue's consumer settings, and its
//! // producer binding (a delay beyond 24 hours is sent on through it).
//! const WRANGLER: &str = r#"
//! [[queues.producers]]
//! queue = "emails"
//! binding = "EMAILS"
//!
//! [[queues.consumers]]
//! queue = "emails"
//! max_retries = 10
//! dead_letter_queue = "emails-dlq"
//! "#;
//!
//! fn welcome() -> Job<String> {
//!     Job::<String>::builder("welcome").queue("emails").max_deliveries(5).build().unwrap()
//! }
//!
//! fn jobs() -> Result<Registry, RegistryError> {
//!     let mut registry = Registry::new();
//!     registry.register(&welcome(), |ctx: JobContext, to: String| async move {
//!         if ctx.attempt() == 1 {
//!             return Err(JobError::new(format!("mail provider busy for {to}")));
//!         }
//!         Ok(())
//!     })?;
//!     Ok(registry)
//! }
//!
//! let mut cf = CloudflareQueues::new(WRANGLER, jobs, jobrail_edge::Options::DEFAULT)?;
//! let sent = cf.send(&welcome(), &"ada@example.com".to_string());
//! cf.run_until_idle();
//! assert_eq!(cf.state(&sent), &MessageState::Acked);
//! assert_eq!(cf.message(&sent).attempts(), [1, 2]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The guide
//!
//! The guide's [edge chapter](https://github.com/jobrail/jobrail/blob/main/guide/edge.md) says how each rule maps onto
//! Cloudflare Queues, with claims in D1 and failure records kept for
//! operators; [your own edge worker](https://github.com/jobrail/jobrail/blob/main/guide/edge-worker.md) starts one from
//! the template and runs it under `wrangler dev`. The rules themselves are
//! in [the settlement rules](https://github.com/jobrail/jobrail/blob/main/guide/rules.md).
//!
//! # Layout
//!
//! Each item has one path: the consumer, its settings and errors at the
//! crate root, wrangler.toml's model under [`wrangler`], the failure keeper
//! under [`failures`] and the native harness under [`testing`]. The other
//! modules are private, one concern each:
//!
//! - `batch`: the batch loop ([`EdgeConsumer`]), written once for the
//!   Worker and the native harness over two small traits
//!   ([`QueueMessage`], [`Bindings`]).
//! - `options`: how the Worker builds a consumer from the jobs, the
//!   embedded wrangler.toml and the operator's variables ([`Options`],
//!   [`check`]).
//! - [`wrangler`]: reading wrangler.toml and checking it against the jobs.
//! - [`failures`]: the failure keeper, the failure queue's consumer that
//!   keeps records in D1 for operators (list, show, replay, purge routes).
//! - `claims` (feature `d1-claims`, on by default): `D1Claims` (wasm32),
//!   the [`jobrail::ClaimStore`] on D1, so that handlers run an effect once
//!   with [`jobrail::run_once`] as natively. Its SQL and row mapping are
//!   pure and unit-tested natively.
//! - `settings`: the consumer's settings ([`EdgeConfig`]: the invocation
//!   budget, concurrency, the failure queue) and their check against the
//!   jobs. Pure.
//! - `error`: the binding's errors ([`EdgeError`], [`EdgeErrorKind`]).
//! - `limits`: the platform's limits on one message, checked before a send
//!   by the producer and the harness alike: 128 KB ([`MAX_MESSAGE_BYTES`])
//!   and a delay of 24 hours ([`MAX_DELAY`]), counted in whole seconds,
//!   and how a longer dispatch delay is carried in steps. Pure.
//! - `log`: one structured line per settlement ([`LogSink`]).
//! - [`routes`]: a Worker's own HTTP routes, off until their secret is set
//!   ([`routes::Access`]: 404 without it, 401 without the token), and
//!   `routes::send` (wasm32), `POST /send` of the template worker.
//! - [`testing`] (native): Cloudflare Queues semantics without wrangler.
//! - `consumer` (wasm32): the platform's objects, the panic hook and the
//!   resumable invocation behind [`consumer!`].
//! - `producer` (wasm32): `EdgeProducer`, typed dispatch through a Queue
//!   binding; a delay beyond 24 hours is carried in steps (one message a
//!   day, sent on by the consumer without running or counting an
//!   attempt).
//! - [`schedules`]: `jobrail::Schedule`s fired by Cron Triggers
//!   ([`EdgeScheduler`]), each tick claimed once in D1, and the check of
//!   `[triggers] crons` against them; `scheduled` (wasm32): the Worker's
//!   `scheduled` handler the [`consumer!`] macro exports with
//!   `schedules = FN`.
//! - `js`, `runtime` (wasm32): the bindings workers-rs 0.8 does not expose
//!   (`Message.attempts`) and the Workers timer behind the rules' sleep.
//!
//! # Wiring a worker
//!
//! A worker is its jobs, their handlers, and one line: [`consumer!`] exports
//! the Worker's queue handler, embeds the crate's `wrangler.toml` and checks
//! it against the jobs (when the Worker starts, and natively in a test the
//! build command runs). This is the whole `src/lib.rs` of the template that
//! `templates/new-edge-worker <dir> <name>` copies
//! (`templates/edge-worker/`, with its wrangler.toml, Cargo.toml, a test
//! under [`testing`], and `src/routes.rs`: `POST /send` and the failure
//! keeper's `/failures`, each off until its secret is set); `tests/run`
//! builds it for wasm32 and runs it under `wrangler dev`, and a test keeps
//! this example and the template equal.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use jobrail::{Job, JobContext, JobError, PolicyError, Registry, RegistryError};
//! use serde::{Deserialize, Serialize};
//!
//! /// The message: what one welcome email needs.
//! #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
//! pub struct WelcomeEmail {
//!     /// The account to welcome.
//!     pub user_id: u64,
//!     /// Where to send the email.
//!     pub address: String,
//! }
//!
//! /// The job's queue (its consumer is in wrangler.toml).
//! pub const QUEUE: &str = "emails";
//! /// The producer binding of [`QUEUE`] (in wrangler.toml): `POST /send` and
//! /// replays of failure records send through it.
//! pub const SEND_BINDING: &str = "EMAILS";
//!
//! /// The job: its name on the wire, its queue, and how it is retried
//! /// (5 deliveries, 10 s, 20 s, 40 s, 80 s apart).
//! pub fn job() -> Result<Job<WelcomeEmail>, PolicyError> {
//!     Job::<WelcomeEmail>::builder("send-welcome-email")
//!         .queue(QUEUE)
//!         .max_deliveries(5)
//!         .backoff(Duration::from_secs(10), 2.0, Duration::from_secs(600))
//!         .timeout(Duration::from_secs(30))
//!         .build()
//! }
//!
//! /// The handler. `Ok(())` acknowledges the message. An error is retried by
//! /// the job's policy (`JobError::new`, or `JobError::retry_after` to choose
//! /// the delay), fails the message at once with a failure record
//! /// (`JobError::permanent`), or drops it (`JobError::reject`).
//! pub async fn handle(_ctx: JobContext, email: WelcomeEmail) -> Result<(), JobError> {
//!     if !email.address.contains('@') {
//!         return Err(JobError::permanent(format!(
//!             "user {}: `{}` is not an email address",
//!             email.user_id, email.address
//!         )));
//!     }
//!     // Send the email here (your mail provider's API); return its errors.
//!     Ok(())
//! }
//!
//! /// Every job this worker consumes, with its handler.
//! pub fn jobs() -> Result<Registry, RegistryError> {
//!     let mut registry = Registry::new();
//!     registry.register(&job()?, handle)?;
//!     Ok(registry)
//! }
//!
//! /// Terminal failures are recorded on the queue of the `FAILED` binding.
//! pub const OPTIONS: jobrail_edge::Options = jobrail_edge::Options {
//!     failure_queue: Some("FAILED"),
//!     ..jobrail_edge::Options::DEFAULT
//! };
//!
//! #[cfg(target_arch = "wasm32")]
//! mod routes;
//!
//! // The failure queue is consumed by the failure keeper (src/routes.rs).
//! jobrail_edge::consumer!(
//!     jobs,
//!     options = OPTIONS,
//!     other_queues = routes::keep_failures
//! );
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

mod batch;
#[cfg(feature = "d1-claims")]
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod claims;
mod error;
pub mod failures;
mod limits;
mod log;
mod options;
pub mod routes;
pub mod schedules;
mod settings;
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;
pub mod wrangler;

#[cfg(target_arch = "wasm32")]
mod consumer;
#[cfg(target_arch = "wasm32")]
mod js;
#[cfg(target_arch = "wasm32")]
mod producer;
#[cfg(target_arch = "wasm32")]
mod runtime;
#[cfg(all(target_arch = "wasm32", feature = "d1-claims"))]
mod scheduled;

pub use batch::{BatchSummary, Bindings, EdgeConsumer, QueueMessage};
#[cfg(all(feature = "d1-claims", target_arch = "wasm32"))]
pub use claims::D1Claims;
pub use error::{EdgeError, EdgeErrorKind};
pub use limits::{FAILURE_RECORD_BYTES, MAX_DELAY, MAX_MESSAGE_BYTES};
pub use log::LogSink;
#[cfg(not(target_arch = "wasm32"))]
pub use options::check_directory;
pub use options::{check, check_file, Options, SchedulesFn};
#[cfg(target_arch = "wasm32")]
pub use producer::{Dispatch, EdgeProducer, UniqueDispatchBuilder};
#[cfg(target_arch = "wasm32")]
pub use runtime::WorkersRuntime;
pub use schedules::{EdgeScheduler, ScheduleFired};
pub use settings::EdgeConfig;

/// What the [`consumer!`] macro expands to; not a stable API.
#[doc(hidden)]
pub mod __private {
    #[cfg(target_arch = "wasm32")]
    pub use crate::consumer::{entry, resume, WorkerSpec};
    #[cfg(all(target_arch = "wasm32", feature = "d1-claims"))]
    pub use crate::scheduled::entry as scheduled_entry;
    #[cfg(target_arch = "wasm32")]
    pub use {js_sys, wasm_bindgen, worker};
}

/// Declares a Worker's queue consumer: one line wires the jobs to the
/// platform.
///
/// `consumer!(jobs)` takes a function `fn() -> Result<jobrail::Registry, E>`
/// (`E: Display`) and exports the Worker's `queue` handler for wasm32. The
/// worker's `wrangler.toml`, next to its `Cargo.toml`, is embedded and
/// checked against the jobs when the consumer starts (see
/// [`wrangler::Wrangler::check`]): every section of it the Worker can be
/// running with, given its bindings and variables; a Worker started from a
/// configuration that is none of them (`wrangler dev -c other.toml`) hands
/// every message back instead of running it. On native targets the macro
/// instead adds a test, `wrangler_toml_fits_the_jobs`, that checks every
/// wrangler configuration in the worker's directory, each with all its
/// `[env.*]` sections ([`check_directory`]), so `cargo test` (which the
/// template's build command runs) refuses a drifted configuration, whichever
/// one `wrangler` would be started with, before anything is deployed.
///
/// Optional, in this order, by name:
/// - `options = EXPR`: an [`Options`] (failure queue, concurrency; its
///   `wrangler` field is filled in by the macro unless `wrangler = PATH` is
///   given);
/// - `wrangler = "path"`: wrangler.toml relative to the crate's manifest;
/// - `other_queues = FN`: `async fn(JsValue, worker::Env)` for batches of
///   queues no job names (the batch object as the platform passed it);
/// - `after_batch = FN`: `async fn(worker::Env)`, run after every batch;
/// - `schedules = FN`: `fn() -> Result<Vec<jobrail::Schedule>, E>`
///   (`E: Display`): the schedules the Worker fires from its Cron Triggers
///   ([`EdgeScheduler`], ticks claimed in the D1 database of
///   [`Options::schedule_claims`], feature `d1-claims`). The macro exports
///   the Worker's `scheduled` handler too (so the worker has no
///   `#[event(scheduled)]` of its own), and the wrangler.toml check holds
///   `[triggers] crons` to the schedules ([`schedules::check_triggers`]).
///
/// A message whose code panics does not fail the rest of its batch: the
/// instance is reset and the batch continues, the panicking message settled
/// by its job's retry policy as one failed execution.
///
/// # Example
///
/// The whole `src/lib.rs` of a worker with one job (compiled natively here,
/// where the macro adds the wrangler.toml test; built for wasm32 it exports
/// the queue handler):
///
/// ```no_run
/// use jobrail::{Job, JobContext, PolicyError, Registry, RegistryError};
///
/// fn resize() -> Result<Job<String>, PolicyError> {
///     Job::<String>::builder("resize-image").queue("images").max_deliveries(4).build()
/// }
///
/// pub fn jobs() -> Result<Registry, RegistryError> {
///     let mut registry = Registry::new();
///     registry.register(&resize()?, |_ctx: JobContext, key: String| async move {
///         // Resize the image stored under `key` here.
///         let _ = key;
///         Ok(())
///     })?;
///     Ok(registry)
/// }
///
/// jobrail_edge::consumer!(jobs);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! consumer {
    ($jobs:path $(, options = $options:expr)? $(, wrangler = $wrangler:literal)? $(, other_queues = $other:path)? $(, after_batch = $after:path)? $(, schedules = $schedules:path)? $(,)?) => {
        /// The worker's options, its wrangler.toml embedded.
        #[cfg(any(test, target_arch = "wasm32"))]
        const __JOBRAIL_EDGE_OPTIONS: $crate::Options = $crate::Options {
            wrangler: $crate::__wrangler_text!($($wrangler)?),
            schedules: $crate::__schedules!(($crate::__options!($($options)?)) $(, $schedules)?),
            ..$crate::__options!($($options)?)
        };

        $(
            /// The options the `scheduled` handler reads.
            #[cfg(target_arch = "wasm32")]
            static __JOBRAIL_EDGE_SCHEDULED: $crate::Options = __JOBRAIL_EDGE_OPTIONS;

            /// The Worker's `scheduled` handler: the Cron Triggers fire the schedules.
            #[cfg(target_arch = "wasm32")]
            #[$crate::__private::wasm_bindgen::prelude::wasm_bindgen(wasm_bindgen = $crate::__private::wasm_bindgen)]
            pub fn scheduled(
                event: $crate::__private::wasm_bindgen::JsValue,
                env: $crate::__private::wasm_bindgen::JsValue,
                _ctx: $crate::__private::wasm_bindgen::JsValue,
            ) -> $crate::__private::js_sys::Promise {
                let _ = $schedules;
                $crate::__private::scheduled_entry(event, env, &__JOBRAIL_EDGE_SCHEDULED)
            }
        )?

        #[cfg(not(target_arch = "wasm32"))]
        #[cfg(test)]
        #[test]
        fn wrangler_toml_fits_the_jobs() {
            let options = __JOBRAIL_EDGE_OPTIONS;
            let registry = $jobs().unwrap_or_else(|e| panic!("the jobs do not build: {e}"));
            let (dir, name) = $crate::__wrangler_place!($($wrangler)?);
            match $crate::check_directory(&registry, &options, std::path::Path::new(dir), name) {
                Ok(checked) => println!("checked against the jobs: {}", checked.join("; ")),
                Err(problems) => panic!("{problems}"),
            }
        }

        #[cfg(target_arch = "wasm32")]
        static __JOBRAIL_EDGE_WORKER: $crate::__private::WorkerSpec = $crate::__private::WorkerSpec {
            jobs: || $jobs().map_err(|e| e.to_string()),
            options: __JOBRAIL_EDGE_OPTIONS,
            other_queues: $crate::__hook2!($($other)?),
            after_batch: $crate::__hook1!($($after)?),
        };

        /// The Worker's queue handler.
        #[cfg(target_arch = "wasm32")]
        #[$crate::__private::wasm_bindgen::prelude::wasm_bindgen(wasm_bindgen = $crate::__private::wasm_bindgen)]
        pub fn queue(
            batch: $crate::__private::wasm_bindgen::JsValue,
            env: $crate::__private::wasm_bindgen::JsValue,
            _ctx: $crate::__private::wasm_bindgen::JsValue,
        ) -> $crate::__private::js_sys::Promise {
            $crate::__private::entry(batch, env, &__JOBRAIL_EDGE_WORKER)
        }

        /// Continues an invocation after a panic (called by jobrail-edge).
        #[cfg(target_arch = "wasm32")]
        #[$crate::__private::wasm_bindgen::prelude::wasm_bindgen(wasm_bindgen = $crate::__private::wasm_bindgen)]
        pub fn __queue_edge_resume(
            invocation: $crate::__private::wasm_bindgen::JsValue,
        ) -> $crate::__private::js_sys::Promise {
            $crate::__private::resume(invocation, &__JOBRAIL_EDGE_WORKER)
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __wrangler_text {
    () => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/wrangler.toml"))
    };
    ($path:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/", $path))
    };
}

/// The directory and file name of the embedded wrangler.toml.
#[doc(hidden)]
#[macro_export]
macro_rules! __wrangler_place {
    () => {
        (env!("CARGO_MANIFEST_DIR"), "wrangler.toml")
    };
    ($path:literal) => {{
        let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/", $path));
        let dir = path.parent().map_or(".", |d| d.to_str().unwrap_or("."));
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("wrangler.toml");
        (dir, name)
    }};
}

#[doc(hidden)]
#[macro_export]
macro_rules! __options {
    () => {
        $crate::Options::DEFAULT
    };
    ($options:expr) => {
        $options
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __schedules {
    (($base:expr)) => {
        $base.schedules
    };
    (($base:expr), $f:path) => {
        Some(|| $f().map_err(|e| e.to_string()))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __hook2 {
    () => {
        None
    };
    ($f:path) => {
        Some(|batch, env| Box::pin($f(batch, env)))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __hook1 {
    () => {
        None
    };
    ($f:path) => {
        Some(|env| Box::pin($f(env)))
    };
}
