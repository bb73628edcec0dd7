//! The queues of a work queue: their names, their arguments, declaring them
//! (once per connection), choosing a delay's hold queue, and the failure
//! queue's records.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};

use super::errors::{answer, conflicting_queue, error, precondition_failed};
use super::RabbitDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

/// Which kind of queue a name is, for its arguments.
#[derive(Debug, Clone, Copy)]
enum Role {
    Work,
    Hold(Duration),
    Failure,
}

impl RabbitDriver {
    /// The hold queue of `queue` for `bucket`.
    pub fn hold_queue_name(queue: &str, bucket: Duration) -> String {
        format!("{queue}.hold.{}ms", bucket.as_millis())
    }

    /// The failure queue of `queue`, if failure queues are configured.
    pub fn failure_queue_name(&self, queue: &str) -> Option<String> {
        self.inner
            .config
            .failure_queue
            .as_ref()
            .map(|p| p.replace("{queue}", queue))
    }

    /// The bucket a delay rounds up to; `None` above the largest bucket.
    pub(super) fn bucket(&self, delay: Duration) -> Option<Duration> {
        self.inner
            .config
            .delay_buckets
            .iter()
            .copied()
            .find(|b| *b >= delay)
    }

    /// The hold bucket for `delay`: `None` for no (or a zero) delay;
    /// [`ErrorKind::Unsupported`] above the largest bucket.
    pub(super) fn hold_for(
        &self,
        delay: Option<Duration>,
    ) -> Result<Option<Duration>, DriverError> {
        let Some(delay) = delay.filter(|d| !d.is_zero()) else {
            return Ok(None);
        };
        match self.bucket(delay) {
            Some(bucket) => Ok(Some(bucket)),
            None => Err(error(
                ErrorKind::Unsupported,
                format!(
                    "delay {delay:?} exceeds the largest delay bucket {:?} of this driver",
                    self.inner
                        .config
                        .delay_buckets
                        .last()
                        .copied()
                        .unwrap_or_default()
                ),
            )),
        }
    }

    /// The hold bucket of a new message delayed by `delay`. A message whose
    /// envelope carries its due time ([`jobrail::Envelope::due_ms`], which
    /// the producer writes for every delay on this driver) rounds down to a
    /// bucket (the smallest, below it), and the consumer steps over the
    /// rest when it arrives early: it is never late by more than the
    /// smallest bucket, however far the delay is from a bucket. Any other
    /// body rounds up, as a retry does, so it never arrives early.
    pub(super) fn dispatch_hold(
        &self,
        body: &[u8],
        delay: Option<Duration>,
    ) -> Result<Option<Duration>, DriverError> {
        let Some(delay) = delay.filter(|d| !d.is_zero()) else {
            return Ok(None);
        };
        let buckets = &self.inner.config.delay_buckets;
        if jobrail::delay_remaining(body, 0).is_none() {
            return self.hold_for(Some(delay));
        }
        let below = buckets.iter().copied().rfind(|b| *b <= delay);
        Ok(below.or_else(|| buckets.first().copied()))
    }

    /// Where a message for `queue` held in `bucket` goes: `queue` itself, or
    /// its hold queue for the bucket, declared if needed.
    pub(super) async fn destination(
        &self,
        queue: &str,
        bucket: Option<Duration>,
    ) -> Result<String, DriverError> {
        match bucket {
            None => Ok(queue.to_string()),
            Some(bucket) => {
                let name = Self::hold_queue_name(queue, bucket);
                self.declare(&name, Role::Hold(bucket), queue).await?;
                Ok(name)
            }
        }
    }

    /// Where a message for `queue` delayed by `delay` goes (rounding up).
    pub(super) async fn route_for_delay(
        &self,
        queue: &str,
        delay: Option<Duration>,
    ) -> Result<String, DriverError> {
        let bucket = self.hold_for(delay)?;
        self.destination(queue, bucket).await
    }

    /// Declares the work queue and its failure queue.
    pub(super) async fn declare_work(&self, queue: &str) -> Result<(), DriverError> {
        self.declare(queue, Role::Work, queue).await?;
        self.declare_failure_queue(queue).await?;
        Ok(())
    }

    /// Declares the failure queue of `queue`, if one is configured, and
    /// names it.
    pub(super) async fn declare_failure_queue(
        &self,
        queue: &str,
    ) -> Result<Option<String>, DriverError> {
        let Some(failed) = self.failure_queue_name(queue) else {
            return Ok(None);
        };
        self.declare(&failed, Role::Failure, queue).await?;
        Ok(Some(failed))
    }

    /// The arguments this driver declares a queue of `role` with.
    fn arguments(&self, role: Role, work_queue: &str) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        match role {
            Role::Work => {
                if let Some(limit) = self.inner.config.delivery_limit {
                    args.insert(
                        "x-delivery-limit".into(),
                        AMQPValue::LongLongInt(i64::from(limit)),
                    );
                }
            }
            Role::Hold(bucket) => {
                args.insert(
                    "x-message-ttl".into(),
                    AMQPValue::LongLongInt(bucket.as_millis() as i64),
                );
                args.insert(
                    "x-dead-letter-exchange".into(),
                    AMQPValue::LongString("".into()),
                );
                args.insert(
                    "x-dead-letter-routing-key".into(),
                    AMQPValue::LongString(work_queue.into()),
                );
                args.insert(
                    "x-dead-letter-strategy".into(),
                    AMQPValue::LongString("at-least-once".into()),
                );
                args.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString("reject-publish".into()),
                );
            }
            Role::Failure => {}
        }
        args
    }

    /// The arguments of [`arguments`](Self::arguments), in words, for an
    /// error about a queue that exists with others.
    fn described(&self, role: Role, work_queue: &str) -> String {
        let arguments = match role {
            Role::Hold(b) => format!(
                ", x-message-ttl={}, dead-lettering at-least-once to `{work_queue}`, x-overflow=reject-publish",
                b.as_millis()
            ),
            Role::Work => match self.inner.config.delivery_limit {
                Some(l) => format!(", x-delivery-limit={l}"),
                None => ", no x-delivery-limit".into(),
            },
            Role::Failure => String::new(),
        };
        format!("{role:?} queue: quorum{arguments}")
    }

    /// Declares `name` (once per connection) with the arguments of `role`.
    async fn declare(&self, name: &str, role: Role, work_queue: &str) -> Result<(), DriverError> {
        if lock(&self.inner.declared).contains(name) {
            return Ok(());
        }
        let limit = self.inner.config.operation_timeout;
        // A refused declare closes its channel: use a throwaway one.
        let channel = self.open_channel().await?;
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let declared = tokio::time::timeout(
            limit,
            channel.queue_declare(name, options, self.arguments(role, work_queue)),
        )
        .await;
        match declared {
            Ok(Err(e)) if precondition_failed(&e) => {
                return Err(conflicting_queue(
                    name,
                    &self.described(role, work_queue),
                    e,
                ))
            }
            declared => {
                answer(
                    limit,
                    &format!("declaring queue `{name}`"),
                    ErrorKind::Connection,
                    declared,
                )?;
                let _ = tokio::time::timeout(limit, channel.close(200, "declared")).await;
            }
        }
        lock(&self.inner.declared).insert(name.to_string());
        #[cfg(feature = "testing")]
        lock(&self.inner.known).insert(name.to_string());
        Ok(())
    }
}
