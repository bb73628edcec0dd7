//! The rules a section's settings are held to against the registry's jobs
//! ([`Wrangler::check`]): every problem found, all at once.

use std::collections::BTreeMap;

use jobrail::{PolicyError, Registry};

use super::checked::Checked;
use super::limits::{job_max_retries, unknown_names_problem};
use super::{invalid, Wrangler, MAX_RETRIES_LIMIT};

impl Wrangler {
    /// [`Wrangler::check_consumed`].
    pub(super) fn held_to_the_rules(
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
        let mut queue_bindings = BTreeMap::new();
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
            match self.producers.iter().find(|p| &p.queue == queue) {
                Some(producer) => {
                    queue_bindings.insert(queue.clone(), producer.binding.clone());
                }
                None => problems.push(invalid(
                    "*",
                    "wrangler.queues.producers",
                    format!(
                        "queue `{queue}` has no {producers} entry: a message dispatched to it with a delay beyond 24 hours comes to its consumer once a day before it is due, and the consumer sends it back to `{queue}` through a producer binding of its own; add a {producers} entry with queue = \"{queue}\" and a binding",
                        producers = self.table("producers")
                    ),
                )),
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
                queue_bindings,
            })
        } else {
            Err(problems)
        }
    }
}
