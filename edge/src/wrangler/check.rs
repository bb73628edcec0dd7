//! The rules a section's settings are held to against the registry's jobs
//! ([`Wrangler::check`]): every problem found, all at once.

use std::collections::BTreeMap;

use jobrail::{PolicyError, Registry};

use super::checked::Checked;
use super::limits::{job_max_retries, unknown_names_problem};
use super::{invalid, Wrangler, MAX_RETRIES_LIMIT};

impl Wrangler {
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
