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

use jobrail::PolicyError;
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
