//! The failure store and the admin interface: a queue's failure stream read
//! by sequence, its entries claimed through the queue's claims stream and
//! removed by sequence; a queue's depth from its work stream and consumer,
//! and its deletion.
//!
//! A claim on the entry stored at sequence `N` of the failure stream is a
//! message on the subject `<failure subject>.claim.N` of the claims stream,
//! published with `Nats-Expected-Last-Subject-Sequence: 0`: the server
//! stores it only while that subject holds no message, so of two claims of
//! one entry exactly one is stored (the way a key-value bucket's `create`
//! works, on a plain stream, so a 2.9 server and the client's JetStream
//! feature suffice). Ending the claim deletes that message; the stream's age
//! limit (the claim hold) deletes it when its holder never does.

use std::time::{SystemTime, UNIX_EPOCH};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream;
use async_trait::async_trait;
use tracing::warn;

use super::errors::{self, config_error};
use super::topology::Role;
use super::NatsDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::failures::{Admin, ClaimedFailure, FailureStore, QueueDepth, StoredFailure};
#[cfg(feature = "testing")]
use crate::kit::lock;

/// How many times a claim reads the store again when the entry it found
/// was removed before its claim was stored.
const CLAIM_ROUNDS: usize = 4;

/// A queue's failure destination: its subject and stream.
pub(super) struct Destination {
    pub(super) subject: String,
    stream: stream::Stream,
}

/// An entry and the sequence it is stored at.
struct Located {
    sequence: u64,
    entry: StoredFailure,
}

impl NatsDriver {
    /// The claims stream of `queue` (used only if a failure subject is
    /// configured): the claims an operator holds on its failure records.
    pub fn claims_stream_name(&self, queue: &str) -> String {
        format!("{}_claims", self.stream_name(queue))
    }

    /// The subjects of the claims stream of the failure subject `failed`.
    fn claim_subjects(failed: &str) -> String {
        format!("{failed}.claim.*")
    }

    /// `queue`'s failure destination, declared if missing.
    pub(super) async fn destination(&self, queue: &str) -> Result<Destination, DriverError> {
        self.check_queue(queue)?;
        let subject = self.failure_subject(queue).ok_or_else(|| {
            config_error(format!(
                "queue `{queue}` has no failure destination: the NATS driver has no failure subject \
                 configured (NatsConfig::failure_subject), so its terminal failures are only logged"
            ))
        })?;
        let link = self.link().await?;
        let stream = self
            .ensure_stream(
                &link.js,
                &self.failure_stream_name(queue),
                &subject,
                Role::Failure,
            )
            .await?;
        Ok(Destination { subject, stream })
    }

    /// Every entry of `destination`, by sequence: each read asks for the
    /// first message of the failure subject from the sequence after the
    /// last one read, so removed entries cost nothing.
    async fn entries(&self, destination: &Destination) -> Result<Vec<Located>, DriverError> {
        let info = destination.stream.cached_info();
        let name = &info.config.name;
        let mut next = info.state.first_sequence.max(1);
        let mut entries = Vec::new();
        loop {
            match destination
                .stream
                .get_first_raw_message_by_subject(&destination.subject, next)
                .await
            {
                Ok(message) if message.sequence >= next => {
                    next = message.sequence + 1;
                    entries.push(Located {
                        sequence: message.sequence,
                        entry: StoredFailure::from_body(message.payload.to_vec()),
                    });
                }
                Ok(message) => {
                    return Err(errors::error(
                        ErrorKind::Connection,
                        format!(
                            "reading `{name}` from sequence {next}: the server answered with sequence {}",
                            message.sequence
                        ),
                    ))
                }
                Err(e) => {
                    return match errors::raw_message(name, next, e) {
                        // No message from `next` on.
                        None => Ok(entries),
                        Some(err) => Err(err),
                    }
                }
            }
        }
    }

    /// The claims stream of `queue` (whose failure subject is `failed`),
    /// declared if missing, with the configured claim hold as its age limit.
    async fn claims(&self, queue: &str, failed: &str) -> Result<stream::Stream, DriverError> {
        let link = self.link().await?;
        let name = self.claims_stream_name(queue);
        let stream = self
            .ensure_stream(&link.js, &name, &Self::claim_subjects(failed), Role::Claims)
            .await?;
        let hold = self.inner.config.effective_claim_hold();
        if stream.cached_info().config.max_age == hold {
            return Ok(stream);
        }
        let mut config = stream.cached_info().config.clone();
        config.max_age = hold;
        config.duplicate_window = config.duplicate_window.min(hold);
        link.js.update_stream(&config).await.map_err(|e| {
            errors::connection(
                format!("setting the age limit of stream `{name}` to the claim hold {hold:?}"),
                e,
            )
        })?;
        link.js
            .get_stream(&name)
            .await
            .map_err(|e| errors::connection(format!("stream `{name}`"), e))
    }

    /// Stores a claim on `entry`, stored at `sequence` of the failure stream
    /// of `failed`; `None` when another claim holds it. Returns the claim's
    /// sequence in the claims stream.
    async fn take_claim(
        &self,
        failed: &str,
        sequence: u64,
        entry: &StoredFailure,
    ) -> Result<Option<u64>, DriverError> {
        let subject = format!("{failed}.claim.{sequence}");
        let link = self.link().await?;
        self.wait_connected(&link).await?;
        let body = serde_json::json!({
            "entry": entry.id,
            "claimed_at_ms": SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            "connection": self.inner.config.connection_name,
            "pid": std::process::id(),
        });
        let message = PublishMessage::build()
            .payload(body.to_string().into_bytes().into())
            .expected_last_subject_sequence(0);
        let ack = link
            .js
            .send_publish(subject.clone(), message)
            .await
            .map_err(|e| errors::publish_not_sent(&subject, e))?;
        match ack.await {
            Ok(ack) => Ok(Some(ack.sequence)),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Ok(None),
            Err(e) => Err(errors::publish_unconfirmed(&subject, e)),
        }
    }
}

/// Deletes the message at `sequence` of `stream`: `true` if it was there.
async fn delete(stream: &stream::Stream, sequence: u64) -> Result<bool, DriverError> {
    let name = &stream.cached_info().config.name;
    match stream.delete_message(sequence).await {
        Ok(deleted) => Ok(deleted),
        Err(e) => errors::message_delete(name, sequence, e).map_or(Ok(false), Err),
    }
}

/// Ends the claim stored at `claim` of `claims`, warning when it cannot
/// (it lapses after the claim hold then).
async fn end_claim(claims: &stream::Stream, claim: u64) -> Result<(), DriverError> {
    delete(claims, claim).await.map(|_| ())
}

#[async_trait]
impl FailureStore for NatsDriver {
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        let destination = self.destination(queue).await?;
        Ok(self
            .entries(&destination)
            .await?
            .into_iter()
            .map(|located| located.entry)
            .collect())
    }

    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError> {
        let destination = self.destination(queue).await?;
        for _ in 0..CLAIM_ROUNDS {
            let Some(found) = self
                .entries(&destination)
                .await?
                .into_iter()
                .find(|located| located.entry.matches(id))
            else {
                return Ok(None);
            };
            let claims = self.claims(queue, &destination.subject).await?;
            let Some(claim) = self
                .take_claim(&destination.subject, found.sequence, &found.entry)
                .await?
            else {
                return Ok(None);
            };
            // A claim that has since ended may have removed the entry
            // between the read and this claim: look again under the claim.
            let name = &destination.stream.cached_info().config.name;
            match destination.stream.get_raw_message(found.sequence).await {
                Ok(_) => {
                    return Ok(Some(Box::new(NatsClaim {
                        entry: found.entry,
                        failures: destination.stream.clone(),
                        sequence: found.sequence,
                        claims,
                        claim: Some(claim),
                    })))
                }
                Err(e) => {
                    let failed = errors::raw_message(name, found.sequence, e);
                    end_claim(&claims, claim).await?;
                    if let Some(err) = failed {
                        return Err(err);
                    }
                }
            }
        }
        Ok(None)
    }

    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        // A set: a bulk removal names thousands of ids.
        let ids: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        let destination = self.destination(queue).await?;
        let chosen: Vec<Located> = self
            .entries(&destination)
            .await?
            .into_iter()
            .filter(|located| ids.contains(located.entry.id.as_str()))
            .collect();
        if chosen.is_empty() {
            return Ok(0);
        }
        let claims = self.claims(queue, &destination.subject).await?;
        let mut removed = 0;
        for located in chosen {
            // Claimed for the removal, so an entry another claim holds stays.
            let Some(claim) = self
                .take_claim(&destination.subject, located.sequence, &located.entry)
                .await?
            else {
                continue;
            };
            let deleted = delete(&destination.stream, located.sequence).await;
            end_claim(&claims, claim).await?;
            if deleted? {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

#[async_trait]
impl Admin for NatsDriver {
    /// Ready: the messages the queue's consumer has not delivered yet (the
    /// work stream's message count before a consumer exists). In flight:
    /// the consumer's unacknowledged deliveries, which on JetStream include
    /// retries waiting out a `-NAK` delay. Delayed: delayed dispatches not
    /// yet due, the work stream's schedules (its messages the consumer
    /// neither has pending nor in flight) plus the hold stream's messages.
    /// A queue never declared has depth 0.
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        self.check_queue(queue)?;
        let link = self.link().await?;
        let hold = self.hold_stream_name(queue);
        let held = match link.js.get_stream(&hold).await {
            Ok(stream) => stream.cached_info().state.messages,
            Err(e) => match errors::stream_lookup(&hold, e) {
                Some(err) => return Err(err),
                None => 0,
            },
        };
        let name = self.stream_name(queue);
        let stream = match link.js.get_stream(&name).await {
            Ok(stream) => stream,
            Err(e) => {
                return match errors::stream_lookup(&name, e) {
                    Some(err) => Err(err),
                    None => Ok(QueueDepth::default()),
                }
            }
        };
        let consumer = &self.inner.config.consumer_name;
        match stream.consumer_info(consumer).await {
            Ok(info) => {
                let in_flight = info.num_ack_pending as u64;
                let scheduled = stream
                    .cached_info()
                    .state
                    .messages
                    .saturating_sub(info.num_pending.saturating_add(in_flight));
                Ok(QueueDepth::new(
                    info.num_pending,
                    Some(in_flight),
                    Some(scheduled.saturating_add(held)),
                ))
            }
            Err(e) => match errors::consumer_lookup(consumer, &name, e) {
                Some(err) => Err(err),
                None => Ok(QueueDepth::new(
                    stream.cached_info().state.messages,
                    Some(0),
                    Some(held),
                )),
            },
        }
    }

    /// Deletes `queue`'s work stream (with its consumer and schedules),
    /// failure stream, claims stream and hold stream, after checking that each holds the subject this
    /// driver gives it (a stream that does not is not `queue`'s and is
    /// reported, not deleted).
    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        self.check_queue(queue)?;
        let link = self.link().await?;
        let mut streams = vec![(self.stream_name(queue), self.subject(queue))];
        if let Some(failed) = self.failure_subject(queue) {
            streams.push((
                self.claims_stream_name(queue),
                Self::claim_subjects(&failed),
            ));
            streams.push((self.failure_stream_name(queue), failed));
        }
        streams.push((self.hold_stream_name(queue), self.hold_subject(queue)));
        let mut present = Vec::new();
        for (name, subject) in streams {
            match link.js.get_stream(&name).await {
                Ok(stream) => {
                    let subjects = &stream.cached_info().config.subjects;
                    if !subjects.contains(&subject) {
                        return Err(config_error(format!(
                            "stream `{name}` holds {subjects:?}, not `{subject}`: it is not queue \
                             `{queue}`'s, so nothing was deleted"
                        )));
                    }
                    present.push(name);
                }
                Err(e) => {
                    if let Some(err) = errors::stream_lookup(&name, e) {
                        return Err(err);
                    }
                }
            }
        }
        for name in present {
            if let Err(e) = link.js.delete_stream(&name).await {
                if !errors::stream_not_found(&e) {
                    return Err(errors::connection(format!("deleting stream `{name}`"), e));
                }
            }
            #[cfg(feature = "testing")]
            lock(&self.inner.known).remove(&name);
        }
        self.forget(queue);
        Ok(())
    }
}

/// A claimed entry of a failure stream.
struct NatsClaim {
    entry: StoredFailure,
    /// The failure stream, and the entry's sequence there.
    failures: stream::Stream,
    sequence: u64,
    /// The claims stream, and the claim's sequence there (`None` once
    /// ended). A claim dropped while it is still set lapses after the claim
    /// hold.
    claims: stream::Stream,
    claim: Option<u64>,
}

#[async_trait]
impl ClaimedFailure for NatsClaim {
    fn entry(&self) -> &StoredFailure {
        &self.entry
    }

    /// Deletes the entry by its sequence, then the claim. If the entry
    /// cannot be deleted, the claim is kept until it lapses (a replay that
    /// sent the record is not repeated at once).
    async fn remove(mut self: Box<Self>) -> Result<(), DriverError> {
        let claim = self.claim.take();
        delete(&self.failures, self.sequence).await?;
        if let Some(claim) = claim {
            if let Err(e) = end_claim(&self.claims, claim).await {
                warn!(
                    entry = %self.entry.id,
                    "failure record removed; its claim stays until the claim hold lapses: {e}"
                );
            }
        }
        Ok(())
    }

    async fn release(mut self: Box<Self>) -> Result<(), DriverError> {
        match self.claim.take() {
            Some(claim) => end_claim(&self.claims, claim).await,
            None => Ok(()),
        }
    }
}
