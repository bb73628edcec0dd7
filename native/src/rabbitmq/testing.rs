//! Helpers for the conformance and fault suites (feature `testing`): setting
//! up and inspecting a broker. Not a supported API.

use std::time::Duration;

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

use super::errors::{bounded, error};
use super::RabbitDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

impl RabbitDriver {
    /// The bucket a delay rounds up to; `None` above the largest bucket.
    pub fn bucket_for(&self, delay: Duration) -> Option<Duration> {
        self.bucket(delay)
    }

    /// Messages ready on `name` (any queue), by a passive declare.
    pub async fn ready_count(&self, name: &str) -> Result<u32, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = bounded(
            limit,
            &format!("passive declare of `{name}`"),
            ErrorKind::Connection,
            channel.queue_declare(name, options, FieldTable::default()),
        )
        .await?;
        let _ = tokio::time::timeout(limit, channel.close(200, "counted")).await;
        Ok(declared.message_count())
    }

    /// Every queue this driver has declared (work, hold and failure queues).
    pub fn declared_queues(&self) -> Vec<String> {
        let mut names: Vec<String> = lock(&self.inner.known).iter().cloned().collect();
        names.sort();
        names
    }

    /// Publishes `body` as it is to `queue`'s failure queue (declared
    /// first), as a failure record would be: to put there a message that is
    /// not one. [`ErrorKind::Config`] when no failure queue is configured.
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let Some(failed) = self.declare_failure_queue(queue).await? else {
            return Err(error(
                ErrorKind::Config,
                format!(
                    "queue `{queue}` has no failure queue (RabbitConfig::failure_queue is None)"
                ),
            ));
        };
        let properties = BasicProperties::default().with_content_type("application/json".into());
        self.publish(&failed, &body, properties).await
    }

    /// Publishes `body` to the work queue `queue` (declared first) as it
    /// is, with lapin and no check of the driver's own (its
    /// `max_message_bytes` included): a message as another client might
    /// send it. The broker's own limit still applies.
    pub async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        self.declare_work(queue).await?;
        self.publish(queue, &body, BasicProperties::default()).await
    }

    /// Deletes `names`, even if in use or not empty.
    pub async fn delete_queues(&self, names: &[String]) -> Result<(), DriverError> {
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        for name in names {
            bounded(
                limit,
                &format!("deleting `{name}`"),
                ErrorKind::Connection,
                channel.queue_delete(name, QueueDeleteOptions::default()),
            )
            .await?;
            lock(&self.inner.known).remove(name);
            lock(&self.inner.declared).remove(name);
        }
        let _ = tokio::time::timeout(limit, channel.close(200, "deleted")).await;
        Ok(())
    }
}
