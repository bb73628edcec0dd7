//! Typed dispatch through a Cloudflare Queue binding.

use std::collections::BTreeMap;
use std::time::Duration;

use jobrail::{ClaimStore, Envelope, Job, UniqueDispatch, UniqueDispatchError};
use serde::Serialize;
use worker::{Env, MessageBuilder, Queue, QueueContentType};

use crate::error::{EdgeError, EdgeErrorKind};
use crate::limits::{envelope_text, prepare_send};

/// Sends typed jobs to a queue. Envelopes travel as JSON text, so the body a
/// consumer sees is byte for byte what the native drivers carry.
///
/// A message above the platform's limit
/// ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES)) is refused with
/// [`EdgeErrorKind::Unsupported`] before the binding is called; in a batch,
/// one oversized message refuses the whole batch and nothing is sent.
///
/// [`EdgeProducer::dispatch`] starts a [`Dispatch`]: a delay, metadata, a
/// unique key ([`Dispatch::unique`], on any [`ClaimStore`], `D1Claims` at
/// the edge, by the native producer's rule), then one payload or a batch.
pub struct EdgeProducer {
    queue: Queue,
}

impl EdgeProducer {
    /// A producer on a Queue binding.
    pub fn new(queue: Queue) -> Self {
        EdgeProducer { queue }
    }

    /// A producer on the binding named `binding` in `env`.
    pub fn from_env(env: &Env, binding: &str) -> Result<Self, EdgeError> {
        env.queue(binding).map(Self::new).map_err(|e| {
            EdgeError::new(
                EdgeErrorKind::Config,
                format!("queue binding `{binding}`: {e}"),
            )
        })
    }

    fn envelope<P: Serialize>(
        job: &Job<P>,
        payload: &P,
        metadata: BTreeMap<String, String>,
    ) -> Result<Envelope, EdgeError> {
        let payload = serde_json::to_value(payload)
            .map_err(|e| EdgeError::caused_by(EdgeErrorKind::Encode, None, e))?;
        let mut envelope = Envelope::new(job.name(), payload);
        envelope.metadata = metadata;
        Ok(envelope)
    }

    /// Starts a dispatch of `job`: set its delay, metadata or unique key on
    /// the [`Dispatch`] it returns, then [`send`](Dispatch::send) one payload
    /// or [`send_batch`](Dispatch::send_batch) several. The native producer
    /// has the same builder (`jobrail_native::Producer::dispatch`).
    ///
    /// ```no_run
    /// # async fn example(env: worker::Env) -> Result<(), jobrail_edge::EdgeError> {
    /// use std::time::Duration;
    /// use jobrail::Job;
    /// use jobrail_edge::EdgeProducer;
    ///
    /// let job = Job::<u64>::builder("build-report").queue("reports").build().unwrap();
    /// let producer = EdgeProducer::from_env(&env, "REPORTS")?;
    /// let id = producer.dispatch(&job).send(&7).await?;
    /// producer.dispatch(&job).delay(Duration::from_secs(60)).metadata("tenant", "acme").send(&8).await?;
    /// let ids = producer.dispatch(&job).send_batch(&[9, 10]).await?;
    /// # let _ = (id, ids);
    /// # Ok(())
    /// # }
    /// ```
    pub fn dispatch<'a, P: Serialize>(&'a self, job: &'a Job<P>) -> Dispatch<'a, P> {
        Dispatch {
            producer: self,
            job,
            delay: None,
            metadata: BTreeMap::new(),
        }
    }

    /// Sends a text body as is (bridging, and tests of malformed input),
    /// refused before any request if above the platform's size limit. A
    /// delay beyond 24 hours is carried in steps, as
    /// [`Dispatch::delay`]'s, when the body is an envelope (its due time
    /// is written in) and refused ([`EdgeErrorKind::Unsupported`]) when it
    /// is not.
    pub async fn send_text(&self, body: String, delay: Option<Duration>) -> Result<(), EdgeError> {
        let (body, seconds) = prepare_send(body, delay, jobrail::SystemTime::now())?;
        let message = text_message(body, seconds);
        self.queue
            .send(message)
            .await
            .map_err(|e| EdgeError::new(EdgeErrorKind::Uncertain, e.to_string()))
    }
}

/// One dispatch of a job, built by [`EdgeProducer::dispatch`], with the
/// native producer's shape: a delay, metadata and a unique key are optional;
/// [`send`](Dispatch::send) sends one payload, [`send_batch`](Dispatch::send_batch)
/// several in one request.
#[must_use = "a dispatch sends nothing until `send` or `send_batch` is awaited"]
pub struct Dispatch<'a, P> {
    producer: &'a EdgeProducer,
    job: &'a Job<P>,
    delay: Option<Duration>,
    metadata: BTreeMap<String, String>,
}

impl<P> std::fmt::Debug for Dispatch<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatch")
            .field("job", &self.job.name())
            .field("delay", &self.delay)
            .field("metadata", &self.metadata)
            .finish()
    }
}

impl<'a, P: Serialize> Dispatch<'a, P> {
    /// Not deliverable before `delay` from now, rounded up to whole
    /// seconds; a zero delay is none. Any length: up to 24 hours
    /// ([`MAX_DELAY`](crate::MAX_DELAY)) the platform holds the message
    /// itself; beyond, the envelope carries its due time
    /// ([`jobrail::Envelope::due_ms`], by the Worker's clock), the message is
    /// sent delayed by 24 hours, and the consumer sends each delivery that
    /// comes before the due time on to its queue, delayed by the next leg,
    /// without running the handler or counting an attempt (one message per
    /// day of delay; the consumer needs a producer binding to its queue,
    /// which the wrangler.toml check requires).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay).filter(|d| !d.is_zero());
        self
    }

    /// Not deliverable before `when` (a time past is now), by the Worker's
    /// clock: [`delay`](Self::delay) of the time between now and then.
    pub fn at(self, when: jobrail::SystemTime) -> Self {
        let delay = when
            .duration_since(jobrail::SystemTime::now())
            .unwrap_or_default();
        self.delay(delay)
    }

    /// Adds `key` = `value` to the envelope's metadata (a handler reads it
    /// with `JobContext::metadata`).
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Makes this dispatch unique: it is sent unless a job with the same
    /// `key` was dispatched within `window`, by the native producer's rule
    /// ([`jobrail::dispatch_unique`]), on any [`ClaimStore`] (`D1Claims` at
    /// the edge).
    ///
    /// The key (`unique:<job name>:<key>` in `claims`) is claimed for
    /// `window` and never completed: it frees itself when the window ends.
    /// A store error, or a key or window the store refuses, sends nothing
    /// ([`UniqueDispatchError::Claim`]). A send refused before the binding
    /// was called ([`EdgeErrorKind::Unsupported`]: above
    /// [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES);
    /// [`EdgeErrorKind::Encode`]) gives the key back, so the caller may try
    /// again at once; an error of the call itself
    /// ([`EdgeErrorKind::Uncertain`]) keeps the key for the window. Either
    /// way the error is [`UniqueDispatchError::Dispatch`].
    ///
    /// It prevents duplicate dispatches, not duplicate runs: a handler that
    /// must run once claims in the handler ([`jobrail::run_once`]).
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
    pub async fn send(self, payload: &P) -> Result<String, EdgeError> {
        let envelope = EdgeProducer::envelope(self.job, payload, self.metadata)?;
        let (text, seconds) = prepare_send(
            envelope_text(&envelope)?,
            self.delay,
            jobrail::SystemTime::now(),
        )?;
        self.producer
            .queue
            .send(text_message(text, seconds))
            .await
            .map_err(|e| EdgeError::new(EdgeErrorKind::Uncertain, e.to_string()))?;
        Ok(envelope.id)
    }

    /// Sends every payload in one request (Cloudflare's `sendBatch`, which
    /// takes all or none); returns their ids in order. One payload that
    /// does not encode, or one message above the size limit, refuses the
    /// whole batch before the binding is called.
    pub async fn send_batch(self, payloads: &[P]) -> Result<Vec<String>, EdgeError> {
        let now = jobrail::SystemTime::now();
        let mut ids = Vec::with_capacity(payloads.len());
        let mut batch = worker::BatchMessageBuilder::new();
        for payload in payloads {
            let envelope = EdgeProducer::envelope(self.job, payload, self.metadata.clone())?;
            ids.push(envelope.id.clone());
            let (text, seconds) = prepare_send(envelope_text(&envelope)?, self.delay, now)?;
            batch = batch.message(text_message(text, seconds));
        }
        self.producer
            .queue
            .send_batch(batch.build())
            .await
            .map_err(|e| EdgeError::new(EdgeErrorKind::Uncertain, e.to_string()))?;
        Ok(ids)
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
    pub fn at(mut self, when: jobrail::SystemTime) -> Self {
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
    /// the window, nothing sent.
    pub async fn send(self, payload: &P) -> Result<UniqueDispatch, UniqueDispatchError<EdgeError>> {
        let UniqueDispatchBuilder {
            dispatch,
            claims,
            key,
            window,
        } = self;
        let name = dispatch.job.name().to_string();
        jobrail::dispatch_unique(
            claims,
            &name,
            key,
            window,
            || dispatch.send(payload),
            certainly_unsent,
        )
        .await
    }
}

/// A text message, delayed by `seconds` if given: what every send passes to
/// the binding.
fn text_message(text: String, seconds: Option<u32>) -> worker::SendMessage<String> {
    let mut message = MessageBuilder::new(text).content_type(QueueContentType::Text);
    if let Some(seconds) = seconds {
        message = message.delay_seconds(seconds);
    }
    message.build()
}

/// Whether a send that failed with `error` certainly enqueued nothing: it
/// was refused before the binding was called (size, delay, encoding). Only
/// the binding's own call fails as [`EdgeErrorKind::Uncertain`].
fn certainly_unsent(error: &EdgeError) -> bool {
    error.kind != EdgeErrorKind::Uncertain
}
