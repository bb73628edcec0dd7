//! wrangler.toml read against the registry, so the two never drift apart
//! unnoticed.
//!
//! The platform's consumer settings (`max_retries`, the dead-letter queue,
//! the producer bindings) live in wrangler.toml; the jobs they must honour
//! are declared in Rust. [`Wrangler::check`] compares the two and names the
//! job (or queue) and the field of every mismatch, all at once. It is pure:
//! run it natively in a test or build step, and inside the worker at start
//! with the file embedded by `include_str!`:
//!
//! ```ignore
//! const WRANGLER_TOML: &str = include_str!("../../../wrangler.toml");
//!
//! let checked = jobrail_edge::wrangler::Wrangler::parse(WRANGLER_TOML)?
//!     .check(&registry, Some("FAILED"))
//!     .map_err(|problems| /* each names a job or queue and a field */ problems)?;
//! let config = checked.edge_config(EdgeConfig::default()); // max_retries and the failure binding
//! let consumer = EdgeConsumer::new(registry, config)?;
//! ```
//!
//! A Worker can be started from any section of a file (the top level, or
//! an `[env.<name>]` with `--env`) and from any file (`-c`), so the checks
//! built on this one cover them all: [`crate::check_file`] holds every
//! section of a file to the rules, [`crate::check_directory`] every wrangler
//! configuration in a worker's directory (what the [`crate::consumer!`]
//! macro's native test runs), and a Worker at start checks every section of
//! its embedded file it can be running with ([`Wrangler::could_be_running`]:
//! the batch's queue and the producer bindings it has), refusing to run its
//! handlers when none can.

mod check;
mod checked;
mod limits;
mod parse;
#[cfg(test)]
mod tests;

use std::fmt;
use std::time::Duration;

use jobrail::{PolicyError, Registry};
use serde::Deserialize;

pub use self::checked::Checked;
pub(crate) use self::limits::job_max_retries;

// What the platform does when a consumer leaves a key out, and what it does
// once `max_retries` is used up (Cloudflare's Queues documentation: "Configure
// Queues", "Batching, Retries and Delays", "Dead Letter Queues", "Limits"):
// - without `max_retries` a message is retried 3 times, so it is delivered
//   at most 4 times;
// - without `max_batch_size` a batch holds up to 10 messages, and without
//   `max_batch_timeout` the platform waits up to 5 seconds to fill one;
// - without `retry_delay` a retried message may be delivered again at once;
// - without `max_concurrency` the number of invocations scales on its own;
// - a message that has used up its retries moves to the `dead_letter_queue`,
//   and when the consumer has none it is deleted for good;
// - `max_retries` cannot exceed 100.

/// The retries a consumer gets when wrangler.toml gives no `max_retries`.
pub(crate) const DEFAULT_MAX_RETRIES: u32 = 3;
/// The batch size a consumer gets when wrangler.toml gives no `max_batch_size`.
pub(crate) const DEFAULT_MAX_BATCH_SIZE: u32 = 10;
/// How long the platform waits to fill a batch when wrangler.toml gives no
/// `max_batch_timeout`.
pub(crate) const DEFAULT_MAX_BATCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The delay before a retried message comes back when wrangler.toml gives no
/// `retry_delay`: none.
pub(crate) const DEFAULT_RETRY_DELAY: Duration = Duration::ZERO;
/// The highest `max_retries` the platform accepts.
pub(crate) const MAX_RETRIES_LIMIT: u32 = 100;

/// One `[[queues.producers]]` entry: a binding the worker sends through.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Producer {
    /// The queue the binding sends to.
    pub queue: String,
    /// The binding's name (the variable in the worker's environment).
    pub binding: String,
}

/// One `[[queues.consumers]]` entry, with the platform's default for every
/// key the file leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSettings {
    /// The queue consumed.
    pub queue: String,
    /// The most messages in one batch (`max_batch_size`).
    pub max_batch_size: u32,
    /// The longest wait for a batch to fill (`max_batch_timeout`).
    pub max_batch_timeout: Duration,
    /// Redeliveries after the first delivery before the platform gives up on
    /// a message (`max_retries`).
    pub max_retries: u32,
    /// The delay of a retry that names none (`retry_delay`).
    pub retry_delay: Duration,
    /// Where the platform moves a message once its retries are used up
    /// (`dead_letter_queue`); `None`: it deletes the message.
    pub dead_letter_queue: Option<String>,
    /// The most invocations at once (`max_concurrency`); `None`: the
    /// platform scales them itself.
    pub max_concurrency: Option<u32>,
}

impl ConsumerSettings {
    /// The deliveries the platform makes of one message: the first plus
    /// `max_retries`.
    pub fn deliveries(&self) -> u32 {
        self.max_retries.saturating_add(1)
    }
}

/// The queue settings of a wrangler.toml, for the top level or for one
/// `[env.<name>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wrangler {
    env: Option<String>,
    producers: Vec<Producer>,
    consumers: Vec<ConsumerSettings>,
    /// `[triggers] crons`; `None`: no `[triggers]` table.
    crons: Option<Vec<String>>,
    /// The bindings of `[[d1_databases]]`.
    d1_bindings: Vec<String>,
}

/// A wrangler.toml that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WranglerError {
    /// The text is not TOML, or a key has a value of the wrong type. The
    /// message is toml's own: it gives the line, the column and the key.
    Parse(String),
    /// A consumer key holds a value the platform cannot take.
    Invalid {
        /// The consumer's queue.
        queue: String,
        /// The key.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// `parse_env` named an environment the file has no `[env.<name>]` for.
    NoEnvironment(String),
}

impl fmt::Display for WranglerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WranglerError::Parse(message) => write!(f, "wrangler.toml: {message}"),
            WranglerError::Invalid {
                queue,
                field,
                reason,
            } => write!(
                f,
                "wrangler.toml: the consumer of `{queue}`: invalid `{field}`: {reason}"
            ),
            WranglerError::NoEnvironment(env) => {
                write!(f, "wrangler.toml: no [env.{env}] section")
            }
        }
    }
}

impl std::error::Error for WranglerError {}

impl Wrangler {
    // Reading a file (parse.rs) and checking it (check.rs), their public
    // face in this one `impl` block.

    /// The top-level queue settings of a wrangler.toml. Keys other than
    /// `[[queues.producers]]` and `[[queues.consumers]]` are ignored (the
    /// `[env.*]` sections are read only to reject malformed ones).
    pub fn parse(text: &str) -> Result<Wrangler, WranglerError> {
        Wrangler::parse_env(text, None)
    }

    /// The queue settings of one environment (`Some(name)`: the
    /// `[env.<name>]` section, as `wrangler deploy --env <name>` uses it) or
    /// of the top level (`None`). Wrangler does not carry `queues` from the
    /// top level into an environment, so an environment's producers and
    /// consumers are only those written under it.
    pub fn parse_env(text: &str, env: Option<&str>) -> Result<Wrangler, WranglerError> {
        Wrangler::read_env(text, env)
    }

    /// Every section of a wrangler.toml a Worker can be started with: the
    /// top level (`wrangler dev`, `wrangler deploy`), then each
    /// `[env.<name>]` (`--env <name>`), by name.
    pub fn parse_all(text: &str) -> Result<Vec<Wrangler>, WranglerError> {
        Wrangler::read_all(text)
    }

    /// Checks these settings against `registry`'s jobs and the worker's
    /// failure-queue binding, and returns every problem found, each as a
    /// [`PolicyError::Invalid`] naming the job (`*` for a queue-wide problem,
    /// with the queue in the reason) and the field:
    ///
    /// 1. `queue`: a job's queue has no consumer entry.
    /// 2. `retry`: a job's consumer gives up before the facade does: its
    ///    deliveries (`max_retries + 1`) must reach
    ///    [`jobrail::deliveries_needed`] for the job's cap.
    /// 3. `unknown_name_attempts`: a job queue's consumer gives up on a
    ///    message with an unknown job name before the facade does
    ///    ([`jobrail::unknown_name_deliveries_needed`]).
    /// 4. `wrangler.queues.consumers.dead_letter_queue`: a job queue's
    ///    consumer has no dead-letter queue (the platform would delete what
    ///    it gives up on), or its dead-letter queue is itself a job queue.
    /// 5. `failure_queue`: `failure_queue_binding` is not a producer binding,
    ///    or it sends to a job queue.
    /// 6. `wrangler.queues.consumers.dead_letter_queue`: the failure queue is
    ///    consumed here (by a [`FailureKeeper`](crate::failures::FailureKeeper),
    ///    say) without a dead-letter queue of its own, outside the job
    ///    queues and other than itself: a record that could not be kept
    ///    after every retry would be deleted by the platform.
    ///
    /// 7. `retry.backoff`: a job declares retry delays longer than the
    ///    platform's 24 hours ([`jobrail::check_job_retry_delay`] against
    ///    [`MAX_DELAY`](crate::MAX_DELAY)); likewise
    ///    `unknown_name_retry_delay` for the registry's unknown-name delay.
    ///
    /// 8. `wrangler.queues.producers`: a job queue (or one of
    ///    `also_consumed`) has no `[[queues.producers]]` entry sending to
    ///    it. A dispatch delay beyond 24 hours reaches the consumer before
    ///    it is due, and the consumer sends it on to its queue through that
    ///    binding ([`Checked::queue_binding`]); whether a producer sends
    ///    such delays is not known here, and a binding costs nothing, so it
    ///    is always required.
    ///
    /// Also `wrangler.queues.consumers.max_retries` (above the platform's
    /// limit of 100) and `wrangler.queues.consumers` (a job
    /// queue with more than one consumer entry).
    pub fn check(
        &self,
        registry: &Registry,
        failure_queue_binding: Option<&str>,
    ) -> Result<Checked, Vec<PolicyError>> {
        self.check_consumed(registry, failure_queue_binding, &[])
    }

    /// [`Wrangler::check`], for a worker that also consumes `also_consumed`
    /// with the same jobs (a second queue the producers send the same jobs
    /// to): each of those queues is held to every job's cap and to every rule
    /// a job queue is held to.
    pub fn check_consumed(
        &self,
        registry: &Registry,
        failure_queue_binding: Option<&str>,
        also_consumed: &[&str],
    ) -> Result<Checked, Vec<PolicyError>> {
        self.held_to_the_rules(registry, failure_queue_binding, also_consumed)
    }

    /// The section, for messages: `the top level` or `[env.<name>]`.
    pub fn section_name(&self) -> String {
        match &self.env {
            None => "the top level".to_string(),
            Some(env) => format!("[env.{env}]"),
        }
    }

    /// Whether a Worker handed a batch of `queue`, whose producer bindings
    /// `bound` says exist, can be running with this section: it has a
    /// consumer entry for `queue` and every producer binding it declares is
    /// bound. That is all a Worker can see of the configuration it was
    /// started with: the platform does not show it `max_retries` or the
    /// dead-letter queue, and variables are the operator's to change.
    pub fn could_be_running(&self, queue: &str, bound: &dyn Fn(&str) -> bool) -> bool {
        self.consumer(queue).is_some() && self.producers.iter().all(|p| bound(&p.binding))
    }

    /// The environment these settings are from (`None`: the top level).
    pub fn env(&self) -> Option<&str> {
        self.env.as_deref()
    }

    /// The consumer of `queue` (the first, if the file has several).
    pub fn consumer(&self, queue: &str) -> Option<&ConsumerSettings> {
        self.consumers.iter().find(|c| c.queue == queue)
    }

    /// Every consumer, in file order.
    pub fn consumers(&self) -> &[ConsumerSettings] {
        &self.consumers
    }

    /// Every producer binding, in file order.
    pub fn producers(&self) -> &[Producer] {
        &self.producers
    }

    /// The Cron Triggers (`[triggers] crons`), as written, in file order;
    /// empty without a `[triggers]` table.
    pub fn crons(&self) -> &[String] {
        self.crons.as_deref().unwrap_or(&[])
    }

    /// Whether a `[[d1_databases]]` entry has the binding `binding`.
    pub fn has_d1_binding(&self, binding: &str) -> bool {
        self.d1_bindings.iter().any(|b| b == binding)
    }

    /// The first producer binding that sends to `queue`.
    pub fn binding_to(&self, queue: &str) -> Option<&str> {
        self.producers
            .iter()
            .find(|p| p.queue == queue)
            .map(|p| p.binding.as_str())
    }

    /// The queue the producer binding `binding` sends to.
    pub fn producer_binding(&self, binding: &str) -> Option<&str> {
        self.producers
            .iter()
            .find(|p| p.binding == binding)
            .map(|p| p.queue.as_str())
    }

    /// The table these settings come from, for messages.
    fn table(&self, kind: &str) -> String {
        match &self.env {
            None => format!("[[queues.{kind}]]"),
            Some(env) => format!("[[env.{env}.queues.{kind}]]"),
        }
    }
}

fn invalid(job: &str, field: &'static str, reason: String) -> PolicyError {
    PolicyError::Invalid {
        job: job.to_string(),
        field: field.into(),
        reason,
    }
}
