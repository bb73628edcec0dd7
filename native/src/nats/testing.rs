//! Helpers for the conformance and fault suites (feature `testing`): what
//! the driver declared, how many messages a stream holds, deleting streams
//! and consumers behind the driver's back, and putting a message that is not
//! a failure record into a failure stream. Not a supported API.

use std::sync::atomic::{AtomicU64, Ordering};

use super::errors;
use super::NatsDriver;
use crate::driver::DriverError;
use crate::kit::lock;

impl NatsDriver {
    /// Messages stored in `queue`'s work stream (ready, waiting for a retry
    /// delay, or being handled).
    pub async fn stored_count(&self, queue: &str) -> Result<u64, DriverError> {
        let link = self.link().await?;
        let name = self.stream_name(queue);
        let mut stream = link
            .js
            .get_stream(&name)
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))?;
        let info = stream
            .info()
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))?;
        Ok(info.state.messages)
    }

    /// Pull requests this driver's subscriptions have sent so far.
    pub fn pull_requests_sent(&self) -> u64 {
        self.inner.pulls_sent.load(Ordering::Relaxed)
    }

    /// Sets `queue`'s work stream's `max_msg_size` (declaring it first): a
    /// larger message is then refused by the server itself, after the
    /// driver's own size check, as a server-side refusal in a batch.
    pub async fn limit_stored_message_size(
        &self,
        queue: &str,
        bytes: i32,
    ) -> Result<(), DriverError> {
        self.limit_stream_message_size(queue, &self.stream_name(queue), bytes)
            .await
    }

    /// Sets `queue`'s failure stream's `max_msg_size` (declaring it first):
    /// a longer failure record is then refused by the server.
    pub async fn limit_failure_record_size(
        &self,
        queue: &str,
        bytes: i32,
    ) -> Result<(), DriverError> {
        self.limit_stream_message_size(queue, &self.failure_stream_name(queue), bytes)
            .await
    }

    async fn limit_stream_message_size(
        &self,
        queue: &str,
        name: &str,
        bytes: i32,
    ) -> Result<(), DriverError> {
        self.declare(queue).await?;
        let link = self.link().await?;
        let mut stream = link
            .js
            .get_stream(name)
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))?;
        let mut config = stream
            .info()
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))?
            .config
            .clone();
        config.max_message_size = bytes;
        link.js
            .update_stream(config)
            .await
            .map_err(|e| errors::connection(format!("updating stream `{name}`"), e))?;
        Ok(())
    }

    /// Every stream this driver has declared (work and failure streams).
    pub fn declared_streams(&self) -> Vec<String> {
        let mut names: Vec<String> = lock(&self.inner.known).iter().cloned().collect();
        names.sort();
        names
    }

    /// Deletes the streams `names` with their consumers. A stream that does
    /// not exist is not an error.
    pub async fn delete_streams(&self, names: &[String]) -> Result<(), DriverError> {
        let link = self.link().await?;
        for name in names {
            if let Err(e) = link.js.delete_stream(name).await {
                if !errors::stream_not_found(&e) {
                    return Err(errors::connection(format!("deleting stream `{name}`"), e));
                }
            }
            lock(&self.inner.known).remove(name);
        }
        super::write(&self.inner.declared).clear();
        Ok(())
    }

    /// Deletes `queue`'s durable consumer.
    pub async fn delete_consumer(&self, queue: &str) -> Result<(), DriverError> {
        let link = self.link().await?;
        let name = self.stream_name(queue);
        let stream = link
            .js
            .get_stream(&name)
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))?;
        stream
            .delete_consumer(&self.inner.config.consumer_name)
            .await
            .map_err(|e| errors::connection("deleting consumer", e))?;
        self.forget(queue);
        Ok(())
    }

    /// Publishes `body` (anything, typically not a failure record) to
    /// `queue`'s failure subject, declaring its failure stream if missing:
    /// the failure store then lists it as an entry. [`ErrorKind::Config`]
    /// when no failure subject is configured.
    ///
    /// [`ErrorKind::Config`]: crate::ErrorKind::Config
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let destination = self.destination(queue).await?;
        self.publish(&destination.subject, body, &injected_id(), &[])
            .await
            .map(|_| ())
    }

    /// Publishes `body` to the work stream of `queue` (declared first) as
    /// it is, with async-nats and no check of the driver's own (its size
    /// limit, which leaves room for headers, included): a message as
    /// another client might send it. The server's `max_payload` still
    /// applies.
    pub async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        self.declare(queue).await?;
        self.publish(&self.subject(queue), body, &injected_id(), &[])
            .await
            .map(|_| ())
    }
}

/// A message id of its own for each injected body, so the duplicate window
/// never drops one.
fn injected_id() -> String {
    static INJECTED: AtomicU64 = AtomicU64::new(0);
    format!(
        "injected:{}:{}:{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
        INJECTED.fetch_add(1, Ordering::Relaxed)
    )
}
