//! Helpers for the conformance and fault suites (feature `testing`): the
//! queues a driver created, deleting queues, counting messages, and setting
//! up what the driver itself never does (a redrive policy, a queue deleted
//! behind its back, a failure-queue message that is not a record). Not a
//! supported API.

use aws_sdk_sqs::types::QueueAttributeName;

use super::connection::bounded;
use super::errors::{config_error, sdk_error};
use super::topology::{check_name, Role};
use super::SqsDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

impl SqsDriver {
    /// Every queue this driver created (work and failure queues).
    pub fn created_queues(&self) -> Vec<String> {
        lock(&self.inner.created).iter().cloned().collect()
    }

    /// Deletes `names` (for tests and tooling), whatever they hold. Names
    /// that do not exist are skipped.
    pub async fn delete_queues(&self, names: &[String]) -> Result<(), DriverError> {
        self.delete_names(names).await
    }

    /// Sends `body` as it is to `queue`'s failure queue (creating it if
    /// missing and the driver creates queues), as if a failure had been
    /// recorded there: for entries that are not failure records.
    /// [`ErrorKind::Config`] when no failure queue is configured.
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let name = self.failure_queue_name(queue).ok_or_else(|| {
            config_error(format!(
                "queue `{queue}` has no failure queue (SqsConfig::failure_queue is None)"
            ))
        })?;
        let url = self.queue_url(&name, Role::Failure).await?;
        self.send_body(&name, &url, &body, 0, &[]).await
    }

    /// Sends `body` to the work queue `queue` (created first) as it is, with
    /// the AWS SDK and no check of the driver's own (its size limit, which
    /// leaves room for a retry's attributes, included): a message as
    /// another client might send it. The queue's own limit still applies.
    pub async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let url = self.queue_url(queue, Role::Work).await?;
        self.send_body(queue, &url, &body, 0, &[]).await
    }

    /// Deletes `queue` while this driver keeps its URL, as if someone else
    /// had deleted it. A queue that does not exist is an error.
    pub async fn delete_queue_keeping_url(&self, queue: &str) -> Result<(), DriverError> {
        check_name(queue)?;
        let Some(url) = self.lookup(queue).await? else {
            return Err(config_error(format!("queue `{queue}` does not exist")));
        };
        self.delete_url(queue, url).await
    }

    /// Messages on `queue`, visible, in flight or delayed (SQS's
    /// approximate counts). A queue that does not exist is an error.
    pub async fn message_count(&self, queue: &str) -> Result<u64, DriverError> {
        check_name(queue)?;
        let Some(url) = self.lookup(queue).await? else {
            return Err(config_error(format!("queue `{queue}` does not exist")));
        };
        let counts = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        ];
        let attributes = self.attributes(queue, &url, &counts).await?;
        let mut total = 0;
        for name in &counts {
            let count = attributes
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.parse::<u64>().ok())
                .ok_or_else(|| {
                    config_error(format!("queue `{queue}`: no readable {}", name.as_str()))
                })?;
            total += count;
        }
        Ok(total)
    }

    /// Creates `dead_letter_queue`, then `queue` with a redrive policy that
    /// moves a message there after `max_receive_count` receives (SQS's own
    /// dead-lettering, the delivery limit [`Driver::delivery_limit`]
    /// reports). Both count among [`created_queues`](Self::created_queues).
    ///
    /// [`Driver::delivery_limit`]: crate::Driver::delivery_limit
    pub async fn create_queue_with_redrive(
        &self,
        queue: &str,
        dead_letter_queue: &str,
        max_receive_count: u32,
    ) -> Result<(), DriverError> {
        check_name(queue)?;
        check_name(dead_letter_queue)?;
        let dlq_url = self.create_with(dead_letter_queue, None).await?;
        let arn = self
            .attributes(dead_letter_queue, &dlq_url, &[QueueAttributeName::QueueArn])
            .await?
            .into_iter()
            .find_map(|(n, v)| (n == QueueAttributeName::QueueArn).then_some(v))
            .ok_or_else(|| {
                config_error(format!(
                    "queue `{dead_letter_queue}`: no QueueArn in the answer"
                ))
            })?;
        let policy = serde_json::json!({
            "deadLetterTargetArn": arn,
            "maxReceiveCount": max_receive_count,
        });
        self.create_with(queue, Some(policy.to_string())).await?;
        Ok(())
    }

    /// `CreateQueue` with an optional redrive policy; the URL.
    async fn create_with(
        &self,
        name: &str,
        redrive: Option<String>,
    ) -> Result<String, DriverError> {
        let what = format!("CreateQueue `{name}`");
        let mut request = self.inner.client.create_queue().queue_name(name);
        if let Some(policy) = redrive {
            request = request.attributes(QueueAttributeName::RedrivePolicy, policy);
        }
        let limit = self.inner.config.operation_timeout;
        let out = bounded(limit, &what, ErrorKind::Connection, request.send())
            .await?
            .map_err(|e| sdk_error(&what, e, ErrorKind::Config, ErrorKind::Connection))?;
        lock(&self.inner.created).insert(name.to_string());
        out.queue_url()
            .map(str::to_string)
            .ok_or_else(|| config_error(format!("{what}: no URL in the answer")))
    }
}
