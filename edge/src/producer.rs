//! Typed dispatch through a Cloudflare Queue binding.

use std::collections::BTreeMap;
use std::time::Duration;

use jobrail::{ClaimStore, Envelope, Job, UniqueDispatch, UniqueDispatchError};
use serde::Serialize;
use worker::{Env, MessageBuilder, Queue, QueueContentType};

use crate::error::{EdgeError, EdgeErrorKind};
use crate::limits::delay_seconds;
use crate::limits::{check_message_size, envelope_text};

/// Sends typed jobs to a queue. Envelopes travel as JSON text, so the body a
/// consumer sees is byte for byte what the native drivers carry.
///
/// A message above the platform's limit
/// ([`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES)) is refused with
/// [`EdgeErrorKind::Unsupported`] before the binding is called; in a batch,
/// one oversized message refuses the whole batch and nothing is sent.
///
/// [`EdgeProducer::dispatch_unique`] sends a job unless one with the same
/// key went out within a window, on any [`ClaimStore`] (`D1Claims` at the
/// edge), by the same rule as the native producer
/// ([`jobrail::dispatch_unique`]). A send refused before the binding was
/// called (above the size limit, a payload that does not encode) gives the
/// key back; an error from the binding's call keeps it for the window, as
/// the message may have been enqueued.
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

    /// Dispatches one job; returns its message id.
    pub async fn dispatch<P: Serialize>(
        &self,
        job: &Job<P>,
        payload: &P,
    ) -> Result<String, EdgeError> {
        self.dispatch_with(job, payload, None, BTreeMap::new())
            .await
    }

    /// Dispatches one job, not deliverable before `delay` (rounded up to
    /// seconds; at most 24 hours).
    pub async fn dispatch_with<P: Serialize>(
        &self,
        job: &Job<P>,
        payload: &P,
        delay: Option<Duration>,
        metadata: BTreeMap<String, String>,
    ) -> Result<String, EdgeError> {
        let envelope = Self::envelope(job, payload, metadata)?;
        self.send_text(envelope_text(&envelope)?, delay).await?;
        Ok(envelope.id)
    }

    /// Dispatches one job unless a job with the same `key` was dispatched
    /// within `window`: [`UniqueDispatch::Dispatched`] with its message id,
    /// or [`UniqueDispatch::Duplicate`] with the rest of the window, nothing
    /// sent.
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
    pub async fn dispatch_unique<S, P>(
        &self,
        claims: &S,
        key: &str,
        window: Duration,
        job: &Job<P>,
        payload: &P,
    ) -> Result<UniqueDispatch, UniqueDispatchError<EdgeError>>
    where
        S: ClaimStore + ?Sized,
        P: Serialize,
    {
        jobrail::dispatch_unique(
            claims,
            job.name(),
            key,
            window,
            || self.dispatch(job, payload),
            certainly_unsent,
        )
        .await
    }

    /// Dispatches several jobs in one request; returns their ids.
    pub async fn dispatch_batch<P: Serialize>(
        &self,
        job: &Job<P>,
        payloads: &[P],
    ) -> Result<Vec<String>, EdgeError> {
        let mut ids = Vec::with_capacity(payloads.len());
        let mut batch = worker::BatchMessageBuilder::new();
        for payload in payloads {
            let envelope = Self::envelope(job, payload, BTreeMap::new())?;
            ids.push(envelope.id.clone());
            let text = envelope_text(&envelope)?;
            batch = batch.message(
                MessageBuilder::new(text)
                    .content_type(QueueContentType::Text)
                    .build(),
            );
        }
        self.queue
            .send_batch(batch.build())
            .await
            .map_err(|e| EdgeError::new(EdgeErrorKind::Uncertain, e.to_string()))?;
        Ok(ids)
    }

    /// Sends a text body as is (bridging, and tests of malformed input),
    /// refused before any request if above the platform's size limit.
    pub async fn send_text(&self, body: String, delay: Option<Duration>) -> Result<(), EdgeError> {
        check_message_size(&body)?;
        let mut message = MessageBuilder::new(body).content_type(QueueContentType::Text);
        if let Some(seconds) = delay_seconds(delay.filter(|d| !d.is_zero()))? {
            message = message.delay_seconds(seconds);
        }
        self.queue
            .send(message.build())
            .await
            .map_err(|e| EdgeError::new(EdgeErrorKind::Uncertain, e.to_string()))
    }
}

/// Whether a send that failed with `error` certainly enqueued nothing: it
/// was refused before the binding was called (size, delay, encoding). Only
/// the binding's own call fails as [`EdgeErrorKind::Uncertain`].
fn certainly_unsent(error: &EdgeError) -> bool {
    error.kind != EdgeErrorKind::Uncertain
}
