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

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use jobrail::{
    check_job_delivery_limit, check_unknown_name_delivery_limit, JobSpec, LimitedBy, PolicyError,
    Registry, UnknownNameAttempts, SHUTDOWN_GRACE,
};
use serde::Deserialize;

use crate::settings::EdgeConfig;

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

/// The file as toml reads it: only the keys this module uses (serde skips
/// the rest).
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawFile {
    queues: RawQueues,
    env: BTreeMap<String, RawEnv>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawEnv {
    queues: RawQueues,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawQueues {
    producers: Vec<Producer>,
    consumers: Vec<RawConsumer>,
}

#[derive(Deserialize)]
struct RawConsumer {
    queue: String,
    max_batch_size: Option<u32>,
    /// Seconds; the platform takes a number, so a fraction is accepted.
    max_batch_timeout: Option<f64>,
    max_retries: Option<u32>,
    retry_delay: Option<u32>,
    dead_letter_queue: Option<String>,
    max_concurrency: Option<u32>,
}

impl RawConsumer {
    fn settings(self) -> Result<ConsumerSettings, WranglerError> {
        let max_batch_timeout = match self.max_batch_timeout {
            None => DEFAULT_MAX_BATCH_TIMEOUT,
            Some(seconds) => {
                Duration::try_from_secs_f64(seconds).map_err(|_| WranglerError::Invalid {
                    queue: self.queue.clone(),
                    field: "max_batch_timeout",
                    reason: format!("{seconds} is not a number of seconds"),
                })?
            }
        };
        Ok(ConsumerSettings {
            max_batch_size: self.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH_SIZE),
            max_batch_timeout,
            max_retries: self.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
            retry_delay: self
                .retry_delay
                .map_or(DEFAULT_RETRY_DELAY, |s| Duration::from_secs(s.into())),
            dead_letter_queue: self.dead_letter_queue,
            max_concurrency: self.max_concurrency,
            queue: self.queue,
        })
    }
}

impl Wrangler {
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
        let raw: RawFile = toml::from_str(text).map_err(|e| WranglerError::Parse(e.to_string()))?;
        let queues = match env {
            None => raw.queues,
            Some(name) => {
                let mut envs = raw.env;
                envs.remove(name)
                    .ok_or_else(|| WranglerError::NoEnvironment(name.to_string()))?
                    .queues
            }
        };
        Wrangler::section(env, queues)
    }

    /// Every section of a wrangler.toml a Worker can be started with: the
    /// top level (`wrangler dev`, `wrangler deploy`), then each
    /// `[env.<name>]` (`--env <name>`), by name.
    pub fn parse_all(text: &str) -> Result<Vec<Wrangler>, WranglerError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| WranglerError::Parse(e.to_string()))?;
        let mut sections = vec![Wrangler::section(None, raw.queues)?];
        for (name, env) in raw.env {
            sections.push(Wrangler::section(Some(&name), env.queues)?);
        }
        Ok(sections)
    }

    fn section(env: Option<&str>, queues: RawQueues) -> Result<Wrangler, WranglerError> {
        let consumers = queues
            .consumers
            .into_iter()
            .map(RawConsumer::settings)
            .collect::<Result<_, _>>()?;
        Ok(Wrangler {
            env: env.map(str::to_string),
            producers: queues.producers,
            consumers,
        })
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
        let consumers_table = self.table("consumers");
        let mut job_queues = registry.queues();
        let mut problems = Vec::new();
        for queue in also_consumed {
            if !job_queues.iter().any(|q| q == queue) {
                job_queues.push(queue.to_string());
            }
            match self.consumer(queue) {
                None => problems.push(invalid(
                    "*",
                    "queue",
                    format!("no {consumers_table} entry consumes `{queue}`, which the worker consumes with its jobs"),
                )),
                Some(consumer) => {
                    for spec in registry.specs() {
                        if let Err(e) = job_max_retries(spec, queue, consumer.max_retries) {
                            problems.push(e);
                        }
                    }
                }
            }
        }

        for spec in registry.specs() {
            match self.consumer(&spec.queue) {
                None => problems.push(invalid(
                    &spec.name,
                    "queue",
                    format!(
                        "no {consumers_table} entry consumes `{}`, this job's queue: its messages would never reach the worker",
                        spec.queue
                    ),
                )),
                Some(consumer) => {
                    if let Err(e) = job_max_retries(spec, &spec.queue, consumer.max_retries) {
                        problems.push(e);
                    }
                }
            }
        }

        // The platform holds a retry at most 24 hours: a longer declared
        // delay would be refused on every retry (and the message held for
        // the refused-settlement hold each time, spending a delivery).
        for spec in registry.specs() {
            if let Err(e) = jobrail::check_job_retry_delay(spec, crate::limits::MAX_DELAY) {
                problems.push(invalid(&spec.name, "retry.backoff", e.to_string()));
            }
        }
        let unknown_delay = registry.unknown_name_retry_delay_setting();
        if unknown_delay > crate::limits::MAX_DELAY {
            problems.push(invalid(
                "*",
                "unknown_name_retry_delay",
                format!(
                    "the unknown-name retry delay of {unknown_delay:?} is above the platform's longest \
                     retry delay of 24 hours"
                ),
            ));
        }

        let mut consumed = BTreeMap::new();
        for queue in &job_queues {
            let mut entries = self.consumers.iter().filter(|c| &c.queue == queue);
            let Some(consumer) = entries.next() else {
                continue;
            };
            let more = entries.count();
            if more > 0 {
                problems.push(invalid(
                    "*",
                    "wrangler.queues.consumers",
                    format!(
                        "queue `{queue}` has {} {consumers_table} entries: the platform allows one worker consumer per queue",
                        more + 1
                    ),
                ));
            }
            if consumer.max_retries > MAX_RETRIES_LIMIT {
                problems.push(invalid(
                    "*",
                    "wrangler.queues.consumers.max_retries",
                    format!(
                        "queue `{queue}`: max_retries = {} is above the platform's limit of {MAX_RETRIES_LIMIT}",
                        consumer.max_retries
                    ),
                ));
            }
            if let Some(reason) =
                unknown_names_problem(queue, consumer, registry.unknown_name_attempts_setting())
            {
                problems.push(invalid("*", "unknown_name_attempts", reason));
            }
            match &consumer.dead_letter_queue {
                None => problems.push(invalid(
                    "*",
                    "wrangler.queues.consumers.dead_letter_queue",
                    format!(
                        "queue `{queue}` has no dead_letter_queue: a message the platform gives up on (after max_retries = {}) would be deleted, and its work lost",
                        consumer.max_retries
                    ),
                )),
                Some(dlq) if job_queues.contains(dlq) => problems.push(invalid(
                    "*",
                    "wrangler.queues.consumers.dead_letter_queue",
                    format!(
                        "queue `{queue}`: its dead_letter_queue `{dlq}` is a job queue: what the platform gives up on would be consumed again as work"
                    ),
                )),
                Some(_) => {}
            }
            consumed.insert(queue.clone(), consumer.clone());
        }

        if let Some(binding) = failure_queue_binding {
            match self.producer_binding(binding) {
                None => problems.push(invalid(
                    "*",
                    "failure_queue",
                    format!(
                        "`{binding}` is not the binding of any {} entry: failure records could not be sent",
                        self.table("producers")
                    ),
                )),
                Some(queue) if job_queues.iter().any(|q| q == queue) => problems.push(invalid(
                    "*",
                    "failure_queue",
                    format!(
                        "`{binding}` sends to `{queue}`, a job queue: failure records would come back as malformed deliveries and fail again, in a loop"
                    ),
                )),
                Some(queue) => {
                    let field = "wrangler.queues.consumers.dead_letter_queue";
                    match self.consumer(queue).map(|c| c.dead_letter_queue.as_deref()) {
                        None => {}
                        Some(None) => problems.push(invalid(
                            "*",
                            field,
                            format!(
                                "the failure queue `{queue}` is consumed here without a dead_letter_queue: a record its consumer could not keep after every retry would be deleted"
                            ),
                        )),
                        Some(Some(dlq)) if dlq == queue || job_queues.iter().any(|q| q == dlq) => {
                            problems.push(invalid(
                                "*",
                                field,
                                format!(
                                    "the failure queue `{queue}` has the dead_letter_queue `{dlq}`, which is itself consumed as a job or failure queue"
                                ),
                            ))
                        }
                        Some(Some(_)) => {}
                    }
                }
            }
        }

        if problems.is_empty() {
            Ok(Checked {
                consumers: consumed,
                failure_queue: failure_queue_binding.map(str::to_string),
            })
        } else {
            Err(problems)
        }
    }
}

/// What a successful [`Wrangler::check`] established, for the consumer to
/// use at run time instead of separate settings that could disagree with
/// wrangler.toml.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The consumer of each job queue.
    consumers: BTreeMap<String, ConsumerSettings>,
    /// The checked failure-queue binding.
    failure_queue: Option<String>,
}

impl Checked {
    /// The consumer settings of the job queue `queue`.
    pub fn consumer(&self, queue: &str) -> Option<&ConsumerSettings> {
        self.consumers.get(queue)
    }

    /// The `max_retries` of the job queue `queue`'s consumer.
    pub fn max_retries(&self, queue: &str) -> Option<u32> {
        self.consumer(queue).map(|c| c.max_retries)
    }

    /// The least `max_retries` among the job queues' consumers (`None`: the
    /// registry has no jobs): the value for
    /// [`EdgeConfig::platform_max_retries`], which holds one number for all
    /// of a consumer's jobs.
    pub fn platform_max_retries(&self) -> Option<u32> {
        self.consumers.values().map(|c| c.max_retries).min()
    }

    /// The failure-queue binding that was checked.
    pub fn failure_queue(&self) -> Option<&str> {
        self.failure_queue.as_deref()
    }

    /// `base` with `platform_max_retries` and `failure_queue` set from what
    /// was checked (so the worker needs no separate setting for either; a
    /// failure queue in `base` is replaced, by `None` when the check was
    /// given none).
    pub fn edge_config(&self, base: EdgeConfig) -> EdgeConfig {
        EdgeConfig {
            platform_max_retries: self.platform_max_retries(),
            failure_queue: self.failure_queue.clone(),
            ..base
        }
    }
}

/// Whether the consumer of `queue`, whose `max_retries` is `max_retries`,
/// lets the facade, not the platform, end every message of the job `spec`:
/// the broker-cap rule ([`jobrail::check_job_delivery_limit`]) with the
/// platform's deliveries (`max_retries + 1`), on a backend that cannot
/// count graceful-shutdown returns, phrased for wrangler.toml. The error
/// names the job and the field `retry`.
pub(crate) fn job_max_retries(
    spec: &JobSpec,
    queue: &str,
    max_retries: u32,
) -> Result<(), PolicyError> {
    let deliveries = max_retries.saturating_add(1);
    let Err(refused) = check_job_delivery_limit(spec, queue, deliveries, false) else {
        return Ok(());
    };
    let reason = match (refused.by, refused.needed) {
        (LimitedBy::Job { cap, .. }, Some(needed)) => format!(
            "this job's cap of {cap} needs {needed} deliveries on Cloudflare (the cap, the delivery that records a message crashing the instance every time, and {SHUTDOWN_GRACE} of grace for a delivery handed back), but the consumer of `{queue}` has max_retries = {max_retries} ({deliveries} deliveries): {}",
            raise_to(needed)
        ),
        _ => format!(
            "this job has no cap, but the consumer of `{queue}` has max_retries = {max_retries}: the platform would end its messages with no failure record; give the job a cap"
        ),
    };
    Err(invalid(&spec.name, "retry", reason))
}

/// The unknown-name half of the rule for one job queue's consumer
/// ([`jobrail::check_unknown_name_delivery_limit`]), phrased for
/// wrangler.toml.
///
/// The facade fails a message with an unknown job name on delivery `limit`
/// without running anything, so the name alone cannot crash the instance.
/// But a delivery can still end without a settlement on Cloudflare: the
/// invocation budget can run out before the message is reached (it is
/// handed back and the platform counts the delivery), or a batch-mate's
/// panic can abort the instance. Hence the one delivery of grace
/// ([`jobrail::unknown_name_deliveries_needed`]).
fn unknown_names_problem(
    queue: &str,
    consumer: &ConsumerSettings,
    cap: UnknownNameAttempts,
) -> Option<String> {
    let max_retries = consumer.max_retries;
    let deliveries = consumer.deliveries();
    let refused = check_unknown_name_delivery_limit(cap, queue, deliveries).err()?;
    Some(match (refused.by, refused.needed) {
        (LimitedBy::UnknownName { limit: Some(limit) }, Some(needed)) => format!(
            "queue `{queue}`: a message with an unknown job name fails on delivery {limit} (the registry's unknown-name cap), and with {SHUTDOWN_GRACE} of grace for a delivery handed back needs {needed} deliveries, but the consumer has max_retries = {max_retries} ({deliveries} deliveries): {}",
            raise_to(needed)
        ),
        _ => format!(
            "queue `{queue}`: the registry's unknown-name cap is unlimited, but the consumer has max_retries = {max_retries}: the platform would end such a message with no failure record; set a limited unknown-name cap"
        ),
    })
}

/// What to tell the operator when `needed` deliveries are required.
fn raise_to(needed: u32) -> String {
    let max_retries = needed.saturating_sub(1);
    if max_retries > MAX_RETRIES_LIMIT {
        format!(
            "that takes max_retries = {max_retries}, above the platform's limit of {MAX_RETRIES_LIMIT}: lower the cap"
        )
    } else {
        format!("raise max_retries to at least {max_retries} in wrangler.toml")
    }
}

fn invalid(job: &str, field: &'static str, reason: String) -> PolicyError {
    PolicyError::Invalid {
        job: job.to_string(),
        field: field.into(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail::{deliveries_needed, unknown_name_deliveries_needed, Job, JobContext};

    /// A registry with one job per `(name, queue, cap)` and the given
    /// unknown-name cap.
    fn registry(jobs: &[(&str, &str, u32)], unknown: UnknownNameAttempts) -> Registry {
        let mut registry = Registry::new();
        for &(name, queue, cap) in jobs {
            let job = Job::<u32>::builder(name)
                .queue(queue)
                .retry(cap)
                .build()
                .unwrap();
            registry
                .register(&job, |_: JobContext, _: u32| async { Ok(()) })
                .unwrap();
        }
        registry.unknown_name_attempts(unknown);
        registry
    }

    /// The `(job, field)` of every problem, in order.
    fn fields(problems: &[PolicyError]) -> Vec<(String, String)> {
        problems
            .iter()
            .map(|p| match p {
                PolicyError::Invalid { job, field, .. } => (job.clone(), field.to_string()),
                _ => panic!("unexpected problem {p:?}"),
            })
            .collect()
    }

    fn reasons(problems: &[PolicyError]) -> String {
        problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A consumer of `queue` with the given max_retries and a dead-letter
    /// queue, plus a failure-queue producer.
    fn toml_with(queue: &str, max_retries: u32) -> String {
        format!(
            r#"
[[queues.producers]]
queue = "failed"
binding = "FAILED"

[[queues.consumers]]
queue = "{queue}"
max_retries = {max_retries}
dead_letter_queue = "{queue}-dlq"
"#
        )
    }

    fn small_unknown_cap() -> UnknownNameAttempts {
        UnknownNameAttempts::limited(2)
    }

    #[test]
    fn reads_producers_and_consumers_and_ignores_other_keys() {
        let text = r#"
name = "w"
main = "build/index.js"
[vars]
X = "1"
[[kv_namespaces]]
binding = "LOG"
id = "x"

[[queues.producers]]
queue = "jobs"
binding = "JOBS"

[[queues.consumers]]
queue = "jobs"
max_batch_size = 4
max_batch_timeout = 1.5
max_retries = 7
retry_delay = 2
dead_letter_queue = "jobs-dlq"
max_concurrency = 3
some_future_key = true
"#;
        let w = Wrangler::parse(text).unwrap();
        assert_eq!(w.env(), None);
        assert_eq!(w.producer_binding("JOBS"), Some("jobs"));
        assert_eq!(w.producer_binding("jobs"), None, "by binding, not queue");
        assert_eq!(w.producers().len(), 1);
        assert_eq!(w.consumers().len(), 1);
        assert_eq!(
            w.consumer("jobs"),
            Some(&ConsumerSettings {
                queue: "jobs".into(),
                max_batch_size: 4,
                max_batch_timeout: Duration::from_millis(1500),
                max_retries: 7,
                retry_delay: Duration::from_secs(2),
                dead_letter_queue: Some("jobs-dlq".into()),
                max_concurrency: Some(3),
            })
        );
        assert_eq!(w.consumer("jobs").unwrap().deliveries(), 8);
        assert_eq!(w.consumer("other"), None);
    }

    #[test]
    fn absent_keys_take_the_platforms_defaults() {
        let w = Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\n").unwrap();
        assert_eq!(
            w.consumer("q"),
            Some(&ConsumerSettings {
                queue: "q".into(),
                max_batch_size: 10,
                max_batch_timeout: Duration::from_secs(5),
                max_retries: 3,
                retry_delay: Duration::ZERO,
                dead_letter_queue: None,
                max_concurrency: None,
            })
        );
        let w = Wrangler::parse("").unwrap();
        assert!(w.consumers().is_empty() && w.producers().is_empty());
    }

    #[test]
    fn the_default_max_retries_is_checked_like_an_explicit_one() {
        // 3 retries = 4 deliveries. deliveries_needed on Cloudflare: cap 2
        // needs 2 + 1 + 1 = 4 (fits), cap 3 needs 5 (does not).
        assert_eq!(deliveries_needed(2, false), Some(4));
        let text = "[[queues.consumers]]\nqueue = \"q\"\ndead_letter_queue = \"dlq\"\n";
        let w = Wrangler::parse(text).unwrap();
        let ok = w.check(&registry(&[("j", "q", 2)], small_unknown_cap()), None);
        assert!(ok.is_ok(), "{ok:?}");
        assert_eq!(ok.unwrap().max_retries("q"), Some(3));
        let problems = w
            .check(&registry(&[("j", "q", 3)], small_unknown_cap()), None)
            .unwrap_err();
        assert_eq!(fields(&problems), [("j".into(), "retry".into())]);
        let text = reasons(&problems);
        assert!(
            text.contains("cap of 3")
                && text.contains("max_retries = 3")
                && text.contains("at least 4"),
            "{text}"
        );
    }

    #[test]
    fn a_parse_error_names_the_line_and_the_key() {
        let err = Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_retries = \"five\"\n")
            .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, WranglerError::Parse(_)));
        assert!(
            text.contains("line 3") && text.contains("max_retries"),
            "{text}"
        );

        let err = Wrangler::parse("[[queues.consumers]]\nqueue = \n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");

        let err = Wrangler::parse("[[queues.consumers]]\nmax_retries = 3\n").unwrap_err();
        assert!(err.to_string().contains("queue"), "missing queue: {err}");

        let err =
            Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_retries = -1\n").unwrap_err();
        assert!(err.to_string().contains("line 3"), "{err}");

        let err =
            Wrangler::parse("[[queues.consumers]]\nqueue = \"q\"\nmax_batch_timeout = -1.0\n")
                .unwrap_err();
        assert!(
            matches!(&err, WranglerError::Invalid { queue, field: "max_batch_timeout", .. } if queue == "q"),
            "{err:?}"
        );
    }

    const ENVS: &str = r#"
[[queues.producers]]
queue = "top-failed"
binding = "FAILED"

[[queues.consumers]]
queue = "jobs"
max_retries = 9
dead_letter_queue = "jobs-dlq"

[env.production]
name = "w-prod"

[[env.production.queues.producers]]
queue = "prod-failed"
binding = "FAILED"

[[env.production.queues.consumers]]
queue = "prod-jobs"
max_retries = 20
dead_letter_queue = "prod-jobs-dlq"

[env.staging]
name = "w-staging"
"#;

    #[test]
    fn an_environment_has_only_its_own_queues() {
        let top = Wrangler::parse(ENVS).unwrap();
        assert_eq!(top.consumers().len(), 1);
        assert_eq!(top.consumer("jobs").unwrap().max_retries, 9);
        assert_eq!(top.producer_binding("FAILED"), Some("top-failed"));

        let prod = Wrangler::parse_env(ENVS, Some("production")).unwrap();
        assert_eq!(prod.env(), Some("production"));
        assert_eq!(prod.consumer("jobs"), None, "not inherited");
        assert_eq!(prod.consumer("prod-jobs").unwrap().max_retries, 20);
        assert_eq!(prod.producer_binding("FAILED"), Some("prod-failed"));

        let staging = Wrangler::parse_env(ENVS, Some("staging")).unwrap();
        assert!(staging.consumers().is_empty() && staging.producers().is_empty());

        assert_eq!(
            Wrangler::parse_env(ENVS, Some("dev")),
            Err(WranglerError::NoEnvironment("dev".into()))
        );
    }

    #[test]
    fn an_environment_is_checked_on_its_own_consumers() {
        let jobs = registry(&[("j", "jobs", 3)], small_unknown_cap());
        assert!(Wrangler::parse(ENVS)
            .unwrap()
            .check(&jobs, Some("FAILED"))
            .is_ok());
        let prod = Wrangler::parse_env(ENVS, Some("production")).unwrap();
        let problems = prod.check(&jobs, Some("FAILED")).unwrap_err();
        assert_eq!(fields(&problems), [("j".into(), "queue".into())]);
        assert!(
            reasons(&problems).contains("[[env.production.queues.consumers]]"),
            "{}",
            reasons(&problems)
        );
        let prod_jobs = registry(&[("j", "prod-jobs", 3)], small_unknown_cap());
        assert!(prod.check(&prod_jobs, Some("FAILED")).is_ok());
    }

    #[test]
    fn rule_1_every_job_queue_has_a_consumer() {
        let w = Wrangler::parse(&toml_with("jobs", 5)).unwrap();
        let r = registry(&[("a", "jobs", 2), ("b", "other", 2)], small_unknown_cap());
        let problems = w.check(&r, None).unwrap_err();
        assert_eq!(fields(&problems), [("b".into(), "queue".into())]);
        assert!(reasons(&problems).contains("`other`"));
        let r = registry(&[("a", "jobs", 2)], small_unknown_cap());
        assert!(w.check(&r, None).is_ok());
    }

    #[test]
    fn rule_2_the_platform_allows_the_jobs_deliveries() {
        // Cap 4 on Cloudflare: 4 + 1 + 1 = 6 deliveries = max_retries 5.
        assert_eq!(deliveries_needed(4, false), Some(6));
        let r = registry(&[("j", "jobs", 4)], small_unknown_cap());
        let problems = Wrangler::parse(&toml_with("jobs", 4))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert_eq!(fields(&problems), [("j".into(), "retry".into())]);
        let text = reasons(&problems);
        assert!(
            text.contains("job `j`")
                && text.contains("cap of 4")
                && text.contains("max_retries = 4")
                && text.contains("at least 5"),
            "{text}"
        );
        assert!(Wrangler::parse(&toml_with("jobs", 5))
            .unwrap()
            .check(&r, None)
            .is_ok());

        // A job without a cap cannot be honoured by any max_retries.
        let r = registry(&[("forever", "jobs", 0)], small_unknown_cap());
        let problems = Wrangler::parse(&toml_with("jobs", 100))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert_eq!(fields(&problems), [("forever".into(), "retry".into())]);
        assert!(reasons(&problems).contains("no cap"));

        // A cap the platform's limit cannot cover says so.
        let r = registry(&[("j", "jobs", 100)], small_unknown_cap());
        let problems = Wrangler::parse(&toml_with("jobs", 100))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert!(reasons(&problems).contains("above the platform's limit"));
    }

    #[test]
    fn rule_7_no_declared_delay_is_longer_than_the_platform_holds() {
        let w = Wrangler::parse(&toml_with("jobs", 10)).unwrap();
        let mut r = Registry::new();
        // 1 h, 2 h, ... 16 h, then 24 h, 24 h: at the limit.
        let at_limit = Job::<u32>::builder("daily")
            .queue("jobs")
            .retry(8)
            .backoff(
                Duration::from_secs(3600),
                2.0,
                Duration::from_secs(24 * 3600),
            )
            .build()
            .unwrap();
        r.register(&at_limit, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
        r.unknown_name_attempts(small_unknown_cap());
        assert!(w.check(&r, None).is_ok());
        let beyond = Job::<u32>::builder("weekly")
            .queue("jobs")
            .retry(5)
            .backoff(Duration::from_secs(86_400), 2.0, Duration::ZERO)
            .build()
            .unwrap();
        r.register(&beyond, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
        r.unknown_name_retry_delay(Duration::from_secs(86_401));
        let problems = w.check(&r, None).unwrap_err();
        assert_eq!(
            fields(&problems),
            [
                ("weekly".into(), "retry.backoff".into()),
                ("*".into(), "unknown_name_retry_delay".into())
            ]
        );
        assert!(
            reasons(&problems).contains("691200s"),
            "{}",
            reasons(&problems)
        );
    }

    #[test]
    fn rule_3_the_platform_allows_the_unknown_name_deliveries() {
        // The default cap: failed on delivery 10, plus one of grace = 11
        // deliveries = max_retries 10.
        let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::default());
        assert_eq!(
            unknown_name_deliveries_needed(UnknownNameAttempts::default().limit()),
            Some(11)
        );
        let problems = Wrangler::parse(&toml_with("jobs", 9))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert_eq!(
            fields(&problems),
            [("*".into(), "unknown_name_attempts".into())]
        );
        let text = reasons(&problems);
        assert!(
            text.contains("`jobs`") && text.contains("delivery 10") && text.contains("at least 10"),
            "{text}"
        );
        assert!(Wrangler::parse(&toml_with("jobs", 10))
            .unwrap()
            .check(&r, None)
            .is_ok());

        // A smaller cap needs fewer: limited(3) needs 4 = max_retries 3.
        let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::limited(3));
        assert!(Wrangler::parse(&toml_with("jobs", 3))
            .unwrap()
            .check(&r, None)
            .is_ok());
        let r = registry(&[("j", "jobs", 2)], UnknownNameAttempts::limited(4));
        assert!(Wrangler::parse(&toml_with("jobs", 3))
            .unwrap()
            .check(&r, None)
            .is_err());

        // Unlimited can never be honoured; one problem per job queue.
        let r = registry(
            &[("a", "jobs", 2), ("b", "jobs", 2)],
            UnknownNameAttempts::unlimited(),
        );
        let problems = Wrangler::parse(&toml_with("jobs", 100))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert_eq!(
            fields(&problems),
            [("*".into(), "unknown_name_attempts".into())]
        );
        assert!(reasons(&problems).contains("unlimited"));
    }

    #[test]
    fn rule_4_every_job_queue_has_a_dead_letter_queue() {
        let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
        let w =
            Wrangler::parse("[[queues.consumers]]\nqueue = \"jobs\"\nmax_retries = 5\n").unwrap();
        let problems = w.check(&r, None).unwrap_err();
        assert_eq!(
            fields(&problems),
            [(
                "*".into(),
                "wrangler.queues.consumers.dead_letter_queue".into()
            )]
        );
        assert!(reasons(&problems).contains("`jobs`"));
        assert!(Wrangler::parse(&toml_with("jobs", 5))
            .unwrap()
            .check(&r, None)
            .is_ok());

        // A dead-letter queue that is a job queue feeds given-up messages
        // back into the work.
        let r = registry(&[("a", "one", 2), ("b", "two", 2)], small_unknown_cap());
        let text = r#"
[[queues.consumers]]
queue = "one"
max_retries = 5
dead_letter_queue = "two"
[[queues.consumers]]
queue = "two"
max_retries = 5
dead_letter_queue = "two-dlq"
"#;
        let problems = Wrangler::parse(text).unwrap().check(&r, None).unwrap_err();
        assert_eq!(
            fields(&problems),
            [(
                "*".into(),
                "wrangler.queues.consumers.dead_letter_queue".into()
            )]
        );
    }

    #[test]
    fn rule_5_the_failure_queue_is_a_producer_outside_the_job_queues() {
        let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
        let w = Wrangler::parse(&toml_with("jobs", 5)).unwrap();
        let checked = w.check(&r, Some("FAILED")).unwrap();
        assert_eq!(checked.failure_queue(), Some("FAILED"));

        let problems = w.check(&r, Some("MISSING")).unwrap_err();
        assert_eq!(fields(&problems), [("*".into(), "failure_queue".into())]);
        assert!(reasons(&problems).contains("`MISSING`"));

        let text = format!(
            "{}\n[[queues.producers]]\nqueue = \"jobs\"\nbinding = \"JOBS\"\n",
            toml_with("jobs", 5)
        );
        let problems = Wrangler::parse(&text)
            .unwrap()
            .check(&r, Some("JOBS"))
            .unwrap_err();
        assert_eq!(fields(&problems), [("*".into(), "failure_queue".into())]);
        assert!(reasons(&problems).contains("`jobs`"));
    }

    #[test]
    fn rule_6_a_consumed_failure_queue_keeps_what_it_cannot_store() {
        let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
        let consumed = |extra: &str| {
            let text = format!(
                "{}\n[[queues.consumers]]\nqueue = \"failed\"\nmax_retries = 10\n{extra}",
                toml_with("jobs", 5)
            );
            Wrangler::parse(&text).unwrap().check(&r, Some("FAILED"))
        };
        assert!(consumed("dead_letter_queue = \"failed-dlq\"\n").is_ok());
        for extra in [
            "",
            "dead_letter_queue = \"jobs\"\n",
            "dead_letter_queue = \"failed\"\n",
        ] {
            let problems = consumed(extra).unwrap_err();
            assert_eq!(
                fields(&problems),
                [(
                    "*".into(),
                    "wrangler.queues.consumers.dead_letter_queue".into()
                )],
                "{extra}"
            );
            assert!(reasons(&problems).contains("`failed`"), "{problems:?}");
        }
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let r = registry(
            &[("a", "one", 5), ("b", "two", 2), ("c", "one", 1)],
            UnknownNameAttempts::default(),
        );
        let text = r#"
[[queues.consumers]]
queue = "one"
max_retries = 2
[[queues.consumers]]
queue = "one"
max_retries = 200
"#;
        let problems = Wrangler::parse(text)
            .unwrap()
            .check(&r, Some("FAILED"))
            .unwrap_err();
        assert_eq!(
            fields(&problems),
            [
                ("a".into(), "retry".into()),
                ("b".into(), "queue".into()),
                ("*".into(), "wrangler.queues.consumers".into()),
                ("*".into(), "unknown_name_attempts".into()),
                (
                    "*".into(),
                    "wrangler.queues.consumers.dead_letter_queue".into()
                ),
                ("*".into(), "failure_queue".into()),
            ],
            "{}",
            reasons(&problems)
        );
    }

    #[test]
    fn max_retries_above_the_platforms_limit_is_refused() {
        let r = registry(&[("j", "jobs", 2)], small_unknown_cap());
        let problems = Wrangler::parse(&toml_with("jobs", 101))
            .unwrap()
            .check(&r, None)
            .unwrap_err();
        assert_eq!(
            fields(&problems),
            [("*".into(), "wrangler.queues.consumers.max_retries".into())]
        );
    }

    #[test]
    fn checked_feeds_the_edge_config() {
        let r = registry(&[("a", "one", 2), ("b", "two", 2)], small_unknown_cap());
        let text = format!("{}{}", toml_with("one", 7), toml_with("two", 4));
        let checked = Wrangler::parse(&text)
            .unwrap()
            .check(&r, Some("FAILED"))
            .unwrap();
        assert_eq!(checked.max_retries("one"), Some(7));
        assert_eq!(checked.max_retries("two"), Some(4));
        assert_eq!(checked.max_retries("failed"), None, "not a job queue");
        assert_eq!(
            checked
                .consumer("two")
                .unwrap()
                .dead_letter_queue
                .as_deref(),
            Some("two-dlq")
        );
        assert_eq!(checked.platform_max_retries(), Some(4), "the least");
        let base = EdgeConfig {
            concurrency: 3,
            failure_queue: Some("OTHER".into()),
            ..EdgeConfig::default()
        };
        let config = checked.edge_config(base);
        assert_eq!(config.platform_max_retries, Some(4));
        assert_eq!(config.failure_queue.as_deref(), Some("FAILED"));
        assert_eq!(config.concurrency, 3, "the rest is kept");
        assert_eq!(config.validate(&r), Ok(()));
    }

    /// The repository's own wrangler.toml, embedded as the worker embeds it,
    /// against the report job as the worker registers it (unknown-name cap
    /// 10, `UNKNOWN_NAME_ATTEMPTS`, also the default).
    #[test]
    fn the_shipped_wrangler_toml_against_the_report_job() {
        const SHIPPED: &str = include_str!("../../wrangler.toml");
        let w = Wrangler::parse(SHIPPED).unwrap();
        let job = report_job::job().unwrap();
        let report_registry = |unknown: UnknownNameAttempts| {
            let mut r = Registry::new();
            r.register(&job, report_job::handle).unwrap();
            r.unknown_name_attempts(unknown);
            r
        };
        let r = report_registry(UnknownNameAttempts::limited(10));
        let max_retries = w.consumer(report_job::QUEUE).unwrap().max_retries;

        // The job's cap of 3 needs 5 deliveries (max_retries 4); the
        // unknown-name cap of 10 needs 11 (max_retries 10). With
        // max_retries = 5 (the file as of this check's introduction) only the
        // unknown-name rule fails; from 10 on, everything fits.
        match w.check(&r, Some("FAILED")) {
            Ok(checked) => {
                assert!(max_retries >= 10, "max_retries = {max_retries} passed");
                assert_eq!(checked.max_retries(report_job::QUEUE), Some(max_retries));
                let config = checked.edge_config(EdgeConfig::default());
                assert_eq!(config.platform_max_retries, Some(max_retries));
                assert_eq!(config.failure_queue.as_deref(), Some("FAILED"));
                assert_eq!(config.validate(&r), Ok(()));
            }
            Err(problems) => {
                assert!(
                    (4..10).contains(&max_retries),
                    "max_retries = {max_retries}: {}",
                    reasons(&problems)
                );
                assert_eq!(
                    fields(&problems),
                    [("*".into(), "unknown_name_attempts".into())],
                    "{}",
                    reasons(&problems)
                );
                let text = reasons(&problems);
                assert!(
                    text.contains("`reports`")
                        && text.contains(&format!("max_retries = {max_retries}"))
                        && text.contains("at least 10"),
                    "{text}"
                );
            }
        }

        // Whatever the unknown-name cap, the shipped job queue, dead-letter
        // queue and failure binding fit: with a cap of 2 (3 deliveries
        // needed) the check passes and feeds the edge config.
        let r = report_registry(UnknownNameAttempts::limited(2));
        let checked = w.check(&r, Some("FAILED")).unwrap();
        assert_eq!(checked.max_retries(report_job::QUEUE), Some(max_retries));
        assert_eq!(checked.platform_max_retries(), Some(max_retries));
        assert_eq!(checked.failure_queue(), Some("FAILED"));
    }
}
