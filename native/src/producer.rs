//! Dispatching typed jobs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{Envelope, Job};
use serde::Serialize;

use crate::driver::{Driver, DriverError, ErrorKind, Outgoing};

/// Options for one dispatch.
#[derive(Debug, Clone, Default)]
pub struct DispatchOptions {
    /// Not deliverable before this delay.
    pub delay: Option<Duration>,
    /// Metadata carried in the envelope.
    pub metadata: BTreeMap<String, String>,
}

/// Sends typed jobs through a driver.
///
/// A successful dispatch means the backend accepted the message, not that a
/// handler ran. On error, [`DriverError::kind`] tells "certainly not
/// accepted" ([`ErrorKind::NotAccepted`]) from "may have been accepted"
/// ([`ErrorKind::Uncertain`]); repeating an uncertain dispatch can enqueue a
/// second copy with a new message id.
#[derive(Clone)]
pub struct Producer {
    driver: Arc<dyn Driver>,
}

impl Producer {
    /// A producer on `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Producer { driver }
    }

    /// Dispatches `payload` as `job`; returns the message id.
    pub async fn dispatch<P: Serialize>(
        &self,
        job: &Job<P>,
        payload: &P,
    ) -> Result<String, DriverError> {
        self.dispatch_with(job, payload, DispatchOptions::default())
            .await
    }

    /// Dispatches with options (delay, metadata).
    pub async fn dispatch_with<P: Serialize>(
        &self,
        job: &Job<P>,
        payload: &P,
        options: DispatchOptions,
    ) -> Result<String, DriverError> {
        let payload = serde_json::to_value(payload)
            .map_err(|e| DriverError::new(self.driver.name(), ErrorKind::Encode, e))?;
        let mut envelope = Envelope::new(job.name(), payload);
        envelope.metadata = options.metadata;
        self.send_envelope(job.queue(), &envelope, options.delay)
            .await?;
        Ok(envelope.id)
    }

    /// Sends an already-built envelope to `queue`.
    pub async fn send_envelope(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Option<Duration>,
    ) -> Result<(), DriverError> {
        self.send_raw(queue, envelope.id.clone(), envelope.encode(), delay)
            .await
    }

    /// Sends raw bytes to `queue` (refused before any I/O if longer than
    /// the driver's [`max_message_bytes`](crate::Capabilities::max_message_bytes)) (for tests of malformed input and for
    /// bridging producers written in other languages).
    pub async fn send_raw(
        &self,
        queue: &str,
        id: String,
        body: Vec<u8>,
        delay: Option<Duration>,
    ) -> Result<(), DriverError> {
        let delay = delay.filter(|d| !d.is_zero());
        let capabilities = self.driver.capabilities();
        if delay.is_some() && !capabilities.delayed_dispatch {
            return Err(DriverError::new(
                self.driver.name(),
                ErrorKind::Unsupported,
                "this backend cannot delay a dispatch",
            ));
        }
        capabilities.refuse_oversize(self.driver.name(), body.len())?;
        self.driver.send(queue, Outgoing { id, body, delay }).await
    }
}
