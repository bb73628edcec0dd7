//! Helpers for the conformance and fault suites (feature `testing`): what
//! the driver declared, how many messages a stream holds, and deleting
//! streams and consumers behind the driver's back. Not a supported API.

use super::errors;
use super::NatsDriver;
use crate::driver::DriverError;
use crate::support::lock;

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
        lock(&self.inner.consumers).clear();
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
}
