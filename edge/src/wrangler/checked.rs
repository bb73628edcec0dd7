//! What a successful check established ([`Checked`]), for the consumer to
//! use at run time.

use std::collections::BTreeMap;

use crate::settings::EdgeConfig;

use super::ConsumerSettings;

/// What a successful [`Wrangler::check`](super::Wrangler::check) established, for the consumer to
/// use at run time instead of separate settings that could disagree with
/// wrangler.toml.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The consumer of each job queue.
    pub(super) consumers: BTreeMap<String, ConsumerSettings>,
    /// The checked failure-queue binding.
    pub(super) failure_queue: Option<String>,
    /// The producer binding of each consumed job queue.
    pub(super) queue_bindings: BTreeMap<String, String>,
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

    /// The producer binding that sends to the consumed job queue `queue`
    /// (the first `[[queues.producers]]` entry for it): where the consumer
    /// sends a delivery that is not due yet.
    pub fn queue_binding(&self, queue: &str) -> Option<&str> {
        self.queue_bindings.get(queue).map(String::as_str)
    }

    /// `base` with `platform_max_retries` and `failure_queue` set from what
    /// was checked (so the worker needs no separate setting for either; a
    /// failure queue in `base` is replaced, by `None` when the check was
    /// given none). The queues' own bindings ([`Checked::queue_binding`])
    /// go to the consumer with [`EdgeConsumer::with_queue_binding`](crate::EdgeConsumer::with_queue_binding).
    pub fn edge_config(&self, base: EdgeConfig) -> EdgeConfig {
        EdgeConfig {
            platform_max_retries: self.platform_max_retries(),
            failure_queue: self.failure_queue.clone(),
            ..base
        }
    }

    /// Every consumed job queue with its producer binding, by queue.
    pub(crate) fn queue_bindings(&self) -> impl Iterator<Item = (&str, &str)> {
        self.queue_bindings
            .iter()
            .map(|(q, b)| (q.as_str(), b.as_str()))
    }
}
