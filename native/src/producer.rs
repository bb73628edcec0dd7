//! Dispatching typed jobs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{encode_envelope, Envelope, Job};
use serde::Serialize;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing};

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
        let (id, body) = encode_envelope(job.name(), payload, &options.metadata)
            .map_err(|e| DriverError::new(self.driver.name(), ErrorKind::Encode, e))?;
        self.send_raw(job.queue(), id.clone(), body, options.delay)
            .await?;
        Ok(id)
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

    /// Dispatches every payload as `job` in one batch, with the backend's
    /// round trips overlapped (pipelined confirms or PubAcks, or the
    /// backend's batch call); returns one result per payload, in order: the
    /// message id, or the error that says whether that message was
    /// certainly not accepted ([`ErrorKind::NotAccepted`]) or may have been
    /// ([`ErrorKind::Uncertain`]). A payload that does not serialize fails
    /// alone, with [`ErrorKind::Encode`].
    pub async fn dispatch_batch<P: Serialize>(
        &self,
        job: &Job<P>,
        payloads: &[P],
    ) -> Vec<Result<String, DriverError>> {
        self.dispatch_batch_with(job, payloads, DispatchOptions::default())
            .await
    }

    /// [`Producer::dispatch_batch`] with options (delay, metadata) that apply
    /// to every message of the batch.
    pub async fn dispatch_batch_with<P: Serialize>(
        &self,
        job: &Job<P>,
        payloads: &[P],
        options: DispatchOptions,
    ) -> Vec<Result<String, DriverError>> {
        let mut results: Vec<Result<String, DriverError>> = Vec::with_capacity(payloads.len());
        let mut outgoing = Vec::with_capacity(payloads.len());
        for payload in payloads {
            match encode_envelope(job.name(), payload, &options.metadata) {
                Ok((id, body)) => {
                    results.push(Ok(id.clone()));
                    outgoing.push(Outgoing {
                        id,
                        body,
                        delay: options.delay,
                    });
                }
                Err(e) => results.push(Err(DriverError::new(
                    self.driver.name(),
                    ErrorKind::Encode,
                    e,
                ))),
            }
        }
        let mut sent = self.send_batch(job.queue(), outgoing).await.into_iter();
        for result in &mut results {
            if result.is_ok() {
                if let Some(Err(e)) = sent.next() {
                    *result = Err(e);
                }
            }
        }
        results
    }

    /// Sends already-encoded messages to `queue` in one batch (see
    /// [`Producer::dispatch_batch`]); one result per message, in order. A
    /// message over the size limit, or delayed on a backend that cannot
    /// delay, is refused alone before any I/O.
    pub async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let capabilities = self.driver.capabilities();
        let mut results: Vec<Result<(), DriverError>> = Vec::with_capacity(messages.len());
        let mut accepted = Vec::with_capacity(messages.len());
        for mut message in messages {
            message.delay = message.delay.filter(|d| !d.is_zero());
            match self.refuse(&capabilities, &message) {
                Ok(()) => {
                    results.push(Ok(()));
                    accepted.push(message);
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if accepted.is_empty() {
            return results;
        }
        let expected = accepted.len();
        let mut sent = self.driver.send_batch(queue, accepted).await;
        debug_assert_eq!(sent.len(), expected, "send_batch answers once per message");
        sent.resize_with(expected, || {
            Err(DriverError::new(
                self.driver.name(),
                ErrorKind::Uncertain,
                "the driver gave no answer for this message",
            ))
        });
        let mut sent = sent.into_iter();
        for result in &mut results {
            if result.is_ok() {
                if let Some(answer) = sent.next() {
                    *result = answer;
                }
            }
        }
        results
    }

    fn refuse(&self, capabilities: &Capabilities, message: &Outgoing) -> Result<(), DriverError> {
        if message.delay.is_some() && !capabilities.delayed_dispatch {
            return Err(DriverError::new(
                self.driver.name(),
                ErrorKind::Unsupported,
                "this backend cannot delay a dispatch",
            ));
        }
        capabilities.refuse_oversize(self.driver.name(), message.body.len())
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
        let message = Outgoing {
            id,
            body,
            delay: delay.filter(|d| !d.is_zero()),
        };
        self.refuse(&self.driver.capabilities(), &message)?;
        self.driver.send(queue, message).await
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::MemoryDriver;

    /// A payload that fails to serialize fails alone, with `Encode`; the
    /// others of the batch are sent, in order, under the returned ids.
    #[tokio::test]
    async fn a_payload_that_does_not_encode_fails_alone() {
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let job = Job::<BTreeMap<(u8, u8), u8>>::builder("pairs")
            .queue("pairs")
            .build()
            .unwrap();
        let good = BTreeMap::new();
        let bad = BTreeMap::from([((1, 2), 3)]);
        let results = producer
            .dispatch_batch(&job, &[good.clone(), bad, good])
            .await;
        assert_eq!(results.len(), 3);
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::Encode);
        let ids: Vec<&String> = [&results[0], &results[2]]
            .into_iter()
            .map(|r| r.as_ref().unwrap())
            .collect();
        assert_ne!(ids[0], ids[1]);
        assert_eq!(driver.ready("pairs"), 2, "the two good ones are stored");
    }

    /// A zero delay in a batch is no delay: the messages are ready at once.
    #[tokio::test]
    async fn a_zero_delay_in_a_batch_is_no_delay() {
        let driver = Arc::new(MemoryDriver::default());
        let producer = Producer::new(driver.clone());
        let results = producer
            .send_batch(
                "q",
                vec![
                    Outgoing {
                        id: "a".into(),
                        body: b"{}".to_vec(),
                        delay: Some(Duration::ZERO),
                    },
                    Outgoing {
                        id: "b".into(),
                        body: b"[]".to_vec(),
                        delay: None,
                    },
                ],
            )
            .await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert_eq!(driver.ready("q"), 2, "a zero delay is no delay");
    }
}
