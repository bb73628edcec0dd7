//! Dispatching typed jobs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use jobrail::{
    encode_envelope, encode_envelope_with_id, new_message_id, ClaimStore, Job, UniqueDispatch,
};
use serde::Serialize;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing};
use crate::unique::UniqueDispatchError;

/// Options for one dispatch, as [`Dispatch`] collects them (and as
/// hosts that dispatch on a producer's behalf, the outbox's relay for one,
/// carry them).
#[derive(Debug, Clone, Default)]
pub struct DispatchOptions {
    /// Not deliverable before this delay.
    pub delay: Option<Duration>,
    /// Metadata carried in the envelope.
    pub metadata: BTreeMap<String, String>,
}

/// One dispatch of a job, built by [`Producer::dispatch`]: a delay, metadata
/// and a unique key are optional; [`send`](Dispatch::send) sends one payload,
/// [`send_batch`](Dispatch::send_batch) several with the backend's round
/// trips overlapped.
#[must_use = "a dispatch sends nothing until `send` or `send_batch` is awaited"]
pub struct Dispatch<'a, P> {
    producer: &'a Producer,
    job: &'a Job<P>,
    options: DispatchOptions,
}

impl<P> std::fmt::Debug for Dispatch<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatch")
            .field("job", &self.job.name())
            .field("options", &self.options)
            .finish()
    }
}

impl<'a, P: Serialize> Dispatch<'a, P> {
    /// Not deliverable before `delay` from now (a zero delay is none), of
    /// any length on every backend: a backend that holds delays only up to
    /// a limit ([`Capabilities::max_dispatch_delay`]) carries a longer one
    /// in steps that neither run the handler nor count an attempt. A
    /// backend that cannot delay at all refuses it before any I/O
    /// ([`ErrorKind::Unsupported`]).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.options.delay = Some(delay);
        self
    }

    /// Not deliverable before `when` (a time past is now): a delay of the
    /// time between now and then, by the system clock. As
    /// [`delay`](Self::delay), any length on every backend.
    pub fn at(self, when: SystemTime) -> Self {
        let delay = when.duration_since(SystemTime::now()).unwrap_or_default();
        self.delay(delay)
    }

    /// Adds `key` = `value` to the envelope's metadata (a handler reads it
    /// with `JobContext::metadata`).
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.metadata.insert(key.into(), value.into());
        self
    }

    /// Replaces the delay and the metadata at once.
    pub fn options(mut self, options: DispatchOptions) -> Self {
        self.options = options;
        self
    }

    /// Makes this dispatch unique: it is sent unless a job with the same
    /// `key` was dispatched within `window`, the unique jobs of Sidekiq and
    /// the unique tasks of asynq, on any [`ClaimStore`].
    ///
    /// The key (`unique:<job name>:<key>` in the store, so it never meets a
    /// handler's own claims) is claimed for `window` and never completed: it
    /// frees itself when the window ends. A claim already held answers
    /// [`UniqueDispatch::Duplicate`] and sends nothing. If the dispatch
    /// certainly did not reach the backend (refused, encode error), the
    /// claim is released so the caller can try again at once; if it may
    /// have ([`ErrorKind::Uncertain`]), the key stays taken for the window.
    /// The rule is [`jobrail::dispatch_unique`], shared with the edge's
    /// producer.
    ///
    /// This prevents duplicate *dispatches*; it does not make the handler
    /// run once (redelivery still repeats it): for that, claim in the
    /// handler ([`jobrail::run_once`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use jobrail::{Job, MemoryClaims};
    /// use jobrail_native::{MemoryDriver, Producer, UniqueDispatch};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let job = Job::<u64>::builder("rebuild-index").build()?;
    /// let producer = Producer::new(Arc::new(MemoryDriver::default()));
    /// let claims = MemoryClaims::new();
    /// let hour = Duration::from_secs(3600);
    /// let first = producer.dispatch(&job).unique(&claims, "tenant-7", hour).send(&7).await?;
    /// assert!(matches!(first, UniqueDispatch::Dispatched(_)));
    /// let again = producer.dispatch(&job).unique(&claims, "tenant-7", hour).send(&7).await?;
    /// assert!(matches!(again, UniqueDispatch::Duplicate { .. }));
    /// # Ok(())
    /// # }
    /// ```
    pub fn unique<S: ClaimStore + ?Sized>(
        self,
        claims: &'a S,
        key: &'a str,
        window: Duration,
    ) -> UniqueDispatchBuilder<'a, P, S> {
        UniqueDispatchBuilder {
            dispatch: self,
            claims,
            key,
            window,
        }
    }

    /// Sends `payload`; returns its message id.
    ///
    /// A successful send means the backend accepted the message, not that a
    /// handler ran. On error, [`DriverError::kind`] tells "certainly not
    /// accepted" ([`ErrorKind::NotAccepted`], [`ErrorKind::Unsupported`],
    /// [`ErrorKind::Encode`]) from "may have been accepted"
    /// ([`ErrorKind::Uncertain`]).
    pub async fn send(self, payload: &P) -> Result<String, DriverError> {
        self.producer
            .send_one(self.job, payload, &self.options)
            .await
    }

    /// Sends every payload in one batch, with the backend's round trips
    /// overlapped (pipelined confirms or PubAcks, or the backend's batch
    /// call); returns one result per payload, in order: the message id, or
    /// the error that says whether that message was certainly not accepted
    /// ([`ErrorKind::NotAccepted`]) or may have been
    /// ([`ErrorKind::Uncertain`]). A payload that does not serialize fails
    /// alone, with [`ErrorKind::Encode`]; the delay and metadata apply to
    /// every message.
    pub async fn send_batch(self, payloads: &[P]) -> Vec<Result<String, DriverError>> {
        self.producer
            .send_many(self.job, payloads, &self.options)
            .await
    }
}

/// A dispatch made unique by [`Dispatch::unique`]: [`send`](Self::send)
/// answers whether it went out or was a duplicate.
#[must_use = "a dispatch sends nothing until `send` is awaited"]
pub struct UniqueDispatchBuilder<'a, P, S: ?Sized> {
    dispatch: Dispatch<'a, P>,
    claims: &'a S,
    key: &'a str,
    window: Duration,
}

impl<P, S: ?Sized> std::fmt::Debug for UniqueDispatchBuilder<'_, P, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueDispatchBuilder")
            .field("dispatch", &self.dispatch)
            .field("key", &self.key)
            .field("window", &self.window)
            .finish()
    }
}

impl<P: Serialize, S: ClaimStore + ?Sized> UniqueDispatchBuilder<'_, P, S> {
    /// As [`Dispatch::delay`].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.dispatch = self.dispatch.delay(delay);
        self
    }

    /// As [`Dispatch::at`].
    pub fn at(mut self, when: SystemTime) -> Self {
        self.dispatch = self.dispatch.at(when);
        self
    }

    /// As [`Dispatch::metadata`].
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.dispatch = self.dispatch.metadata(key, value);
        self
    }

    /// Sends `payload` unless the key is taken: [`UniqueDispatch::Dispatched`]
    /// with its message id, or [`UniqueDispatch::Duplicate`] with the rest of
    /// the window, nothing sent. A store error, or a key or window the store
    /// refuses, sends nothing ([`UniqueDispatchError::Claim`]).
    pub async fn send(self, payload: &P) -> Result<UniqueDispatch, UniqueDispatchError> {
        let Dispatch {
            producer,
            job,
            options,
        } = self.dispatch;
        jobrail::dispatch_unique(
            self.claims,
            job.name(),
            self.key,
            self.window,
            || producer.send_one(job, payload, &options),
            |e: &DriverError| e.kind() != ErrorKind::Uncertain,
        )
        .await
    }
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

    /// Starts a dispatch of `job`: set its delay, metadata or unique key on
    /// the [`Dispatch`] it returns, then [`send`](Dispatch::send) one payload
    /// or [`send_batch`](Dispatch::send_batch) several. The edge's producer
    /// has the same builder (`jobrail_edge::EdgeProducer::dispatch`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use jobrail::Job;
    /// use jobrail_native::{MemoryDriver, Producer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let job = Job::<u64>::builder("build-report").build()?;
    /// let producer = Producer::new(Arc::new(MemoryDriver::default()));
    /// let id = producer.dispatch(&job).send(&7).await?;
    /// let later = producer
    ///     .dispatch(&job)
    ///     .delay(Duration::from_secs(60))
    ///     .metadata("tenant", "acme")
    ///     .send(&8)
    ///     .await?;
    /// assert_ne!(id, later);
    /// let ids = producer.dispatch(&job).send_batch(&[9, 10]).await;
    /// assert!(ids.iter().all(Result::is_ok));
    /// # Ok(())
    /// # }
    /// ```
    pub fn dispatch<'a, P: Serialize>(&'a self, job: &'a Job<P>) -> Dispatch<'a, P> {
        Dispatch {
            producer: self,
            job,
            options: DispatchOptions::default(),
        }
    }

    async fn send_one<P: Serialize>(
        &self,
        job: &Job<P>,
        payload: &P,
        options: &DispatchOptions,
    ) -> Result<String, DriverError> {
        let (id, body) = encode_envelope(job.name(), payload, &options.metadata)
            .map_err(|e| DriverError::new(self.driver.name(), ErrorKind::Encode, e))?;
        self.send_raw(job.queue(), id.clone(), body, options.delay)
            .await?;
        Ok(id)
    }

    async fn send_many<P: Serialize>(
        &self,
        job: &Job<P>,
        payloads: &[P],
        options: &DispatchOptions,
    ) -> Vec<Result<String, DriverError>> {
        // The ids first, then the copies the results keep, then the
        // bodies: each kind made in one run, not one of each per message.
        // The ids the driver drops as it stores the bodies, and those the
        // caller drops once it has the results, then free runs of memory,
        // not a small hole beside every stored body, which the allocator
        // would hand out one by one, scattered, to the deliveries that
        // follow: the memory driver consumed 200,000 jobs about 8% slower
        // after a batch whose ids were made with each body.
        let ids: Vec<String> = payloads.iter().map(|_| new_message_id()).collect();
        let mut results: Vec<Result<String, DriverError>> =
            ids.iter().map(|id| Ok(id.clone())).collect();
        let mut outgoing = Vec::with_capacity(payloads.len());
        for ((payload, id), result) in payloads.iter().zip(ids).zip(&mut results) {
            match encode_envelope_with_id(&id, job.name(), payload, &options.metadata) {
                Ok(body) => outgoing.push(Outgoing {
                    id,
                    body,
                    delay: options.delay,
                }),
                Err(e) => {
                    *result = Err(DriverError::new(self.driver.name(), ErrorKind::Encode, e));
                }
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
    /// [`Dispatch::send_batch`]); one result per message, in order. A
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
        for message in messages {
            match self.prepare(&capabilities, message) {
                Ok(message) => {
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

    /// `message` as the driver is to get it, or why not, before any I/O: a
    /// zero delay is none; a delay on a backend that holds delays in steps
    /// ([`Capabilities::max_dispatch_delay`]) writes the due time into the
    /// envelope and sends the first step; the body, due time included,
    /// must fit the backend's size limit.
    fn prepare(
        &self,
        capabilities: &Capabilities,
        mut message: Outgoing,
    ) -> Result<Outgoing, DriverError> {
        message.delay = message.delay.filter(|d| !d.is_zero());
        if let Some(delay) = message.delay {
            if !capabilities.delayed_dispatch {
                return Err(DriverError::new(
                    self.driver.name(),
                    ErrorKind::Unsupported,
                    "this backend cannot delay a dispatch",
                ));
            }
            if let Some(longest) = capabilities.max_dispatch_delay {
                let due = jobrail::due_ms(SystemTime::now(), delay);
                match jobrail::with_due(&message.body, due) {
                    Some(body) => {
                        message.body = body;
                        message.delay = Some(jobrail::delay_leg(delay, Some(longest)));
                    }
                    None if delay > longest => {
                        return Err(DriverError::new(
                            self.driver.name(),
                            ErrorKind::Unsupported,
                            format!(
                                "a delay of {delay:?} is longer than one {} message holds ({longest:?}), \
                                 and a body that is not an envelope cannot carry the due time that \
                                 would carry it in steps; nothing was sent",
                                self.driver.name()
                            ),
                        ));
                    }
                    None => {}
                }
            }
        }
        capabilities.refuse_oversize(self.driver.name(), message.body.len())?;
        Ok(message)
    }

    /// Sends raw bytes to `queue` (refused before any I/O if longer than
    /// the driver's [`max_message_bytes`](crate::Capabilities::max_message_bytes)) (for tests of malformed input and for
    /// bridging producers written in other languages). A delay longer than
    /// the backend holds in one message
    /// ([`max_dispatch_delay`](crate::Capabilities::max_dispatch_delay)) is
    /// carried in steps when the body is an envelope (its due time is
    /// written in) and refused ([`ErrorKind::Unsupported`]) when it is not.
    pub async fn send_raw(
        &self,
        queue: &str,
        id: String,
        body: Vec<u8>,
        delay: Option<Duration>,
    ) -> Result<(), DriverError> {
        let message = self.prepare(&self.driver.capabilities(), Outgoing { id, body, delay })?;
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
            .dispatch(&job)
            .send_batch(&[good.clone(), bad, good])
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
