//! Sending: a dispatch, a batch of them, and the two messages a settlement
//! publishes on a delivery's behalf (a failure record, a graceful
//! shutdown's copy). Every one is a JetStream publish that waits for the
//! server's `PubAck`, with a `Nats-Msg-Id` so the duplicate window drops a
//! repeated one.
//!
//! A dispatch reads the shared connection and the set of declared queues
//! under read locks and clones only an `Arc`: concurrent dispatches never
//! wait for one another in the driver. A batch publishes every message
//! before awaiting any `PubAck`, then awaits them in order, as a
//! hand-written batch does, so it costs about one round trip, not one per
//! message; each message still gets its own result.
//!
//! async-nats allows 5,000 unanswered publishes per context, one permit
//! each, and a `PubAck` future gives its permit back only once polled to
//! completion (or dropped). A batch therefore awaits its pending `PubAck`s,
//! oldest first, whenever a publish has waited [`PERMIT_PATIENCE`] for the
//! client (a publish that goes out at once leaves them alone and starts no
//! timer, which keeps the batch's pace): any number of concurrent batches
//! and single dispatches make progress, none waits on another's un-polled
//! acks, and a batch larger than the permits frees its own. A publish that
//! waits longer than the operation timeout for a permit is refused as not
//! sent.

use std::collections::VecDeque;
use std::future::{Future, IntoFuture};

use async_nats::jetstream::context::{PublishAckFuture, PublishError};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use futures_util::FutureExt;
use jobrail::FailureRecord;

use super::connection::Link;
use super::delay::Mechanism;
use super::errors::{self, error};
use super::{NatsDriver, ATTEMPTS_HEADER, NAME, SHUTDOWNS_HEADER};
use crate::driver::{Driver, DriverError, ErrorKind, Outgoing};

/// How long a batch's publish waits for the client before it polls the
/// batch's pending `PubAck`s while it waits on (freeing the permits of the
/// acks that arrived).
const PERMIT_PATIENCE: std::time::Duration = std::time::Duration::from_millis(2);

/// Where a delivered message is stored: the ids of what the driver publishes
/// on its behalf are derived from it, so a repeated publish is a duplicate.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stored {
    /// The message's sequence in its work stream.
    pub(super) sequence: u64,
    /// When the server stored it, in nanoseconds since the Unix epoch.
    pub(super) published: i128,
}

impl NatsDriver {
    /// Stores `message` on `queue`: refused at once while disconnected or
    /// over the server's size limit. A delayed one goes to the queue's
    /// schedule subject or hold stream (see `delay.rs`).
    pub(super) async fn dispatch(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.life.check_running()?;
        let subject = self.subject(queue);
        // Before the stream setup, which would wait in the client's queue
        // while it reconnects.
        let link = self.connected_link(&subject).await?;
        // The limit is the server's: known once connected.
        self.capabilities()
            .refuse_oversize(NAME, message.body.len())?;
        let declared = self.declare(queue).await.map_err(DriverError::not_sent)?;
        let (target, publish) = self.prepare(queue, declared.mechanism, message).await?;
        let result = async {
            let ack = self.send_publish(&link, &target, publish).await?;
            ack.await
                .map_err(|e| errors::publish_unconfirmed(&target, e))
        }
        .await;
        if let Err(e) = &result {
            if e.kind() == ErrorKind::NotAccepted {
                // The stream may have been deleted: declare again next time.
                self.forget(queue);
            }
        }
        result.map(|_| ())
    }

    /// Stores `messages` on `queue`, all in flight at once: each is checked
    /// as [`dispatch`](Self::dispatch) checks it (a delayed or oversize one
    /// is refused alone), the others are published one after another
    /// without waiting, then their `PubAck`s are awaited. One result per
    /// message, in order: a publish not sent or refused is
    /// [`ErrorKind::NotAccepted`], one whose `PubAck` did not come is
    /// [`ErrorKind::Uncertain`].
    pub(super) async fn dispatch_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let count = messages.len();
        if let Err(e) = self.inner.life.check_running() {
            return each_refused(e, count);
        }
        let mut results: Vec<Option<Result<(), DriverError>>> = Vec::with_capacity(count);
        let mut sendable = Vec::with_capacity(count);
        for (index, message) in messages.into_iter().enumerate() {
            results.push(None);
            sendable.push((index, message));
        }
        if sendable.is_empty() {
            return Vec::new();
        }
        let subject = self.subject(queue);
        // What every message needs: a connection and the queue's topology
        // (and its hold stream, if one is delayed and relayed). If one is
        // missing, each message says so.
        let ready = async {
            let link = self.connected_link(&subject).await?;
            let declared = self.declare(queue).await.map_err(DriverError::not_sent)?;
            Ok::<_, DriverError>((link, declared))
        };
        let (link, declared) = match ready.await {
            Ok(ready) => ready,
            Err(e) => {
                let mut refused = each_refused(e, sendable.len()).into_iter();
                for (index, _) in &sendable {
                    results[*index] = refused.next();
                }
                return results.into_iter().flatten().collect();
            }
        };
        // The limit is the server's: known once connected.
        let capabilities = self.capabilities();
        // The batch's `PubAck`s, oldest first, as a hand-written batch
        // keeps them: not polled while the batch publishes (a poll of an
        // unanswered ack starts its timer and registers its waker, to be
        // woken and polled again when it comes), then awaited in order,
        // when most have come. Only while a publish waits for one of the
        // client's permits are they awaited meanwhile, oldest first (see
        // `publish_waiting`).
        let mut pending: VecDeque<(usize, PublishAckFuture)> = VecDeque::with_capacity(count);
        let mut oldest: Option<(usize, AckWait)> = None;
        for (index, message) in sendable {
            if let Err(e) = capabilities.refuse_oversize(NAME, message.body.len()) {
                results[index] = Some(Err(e));
                continue;
            }
            let (target, publish) = if message.delay.is_some_and(|d| !d.is_zero()) {
                match self.prepare(queue, declared.mechanism, message).await {
                    Ok(prepared) => prepared,
                    Err(e) => {
                        results[index] = Some(Err(e));
                        continue;
                    }
                }
            } else {
                let publish = PublishMessage::build()
                    .payload(message.body.into())
                    .message_id(&message.id);
                (subject.clone(), publish)
            };
            let send = link.js.send_publish(target.clone(), publish);
            tokio::pin!(send);
            // Most publishes go out at once: no timer is started for them.
            let sent = match send.as_mut().now_or_never() {
                Some(sent) => sent.map_err(|e| errors::publish_not_sent(&target, e)),
                None => {
                    let waited = self.publish_waiting(send, &target, &mut pending, &mut oldest);
                    let (sent, answered) = waited.await;
                    for (at, acked) in answered {
                        results[at] = Some(confirmed(&subject, acked));
                    }
                    sent
                }
            };
            match sent {
                Ok(ack) => pending.push_back((index, ack)),
                Err(e) => results[index] = Some(Err(e)),
            }
        }
        if let Some((at, wait)) = oldest {
            results[at] = Some(confirmed(&subject, wait.await));
        }
        for (at, ack) in pending {
            results[at] = Some(confirmed(&subject, ack.await));
        }
        let results: Vec<Result<(), DriverError>> = results
            .into_iter()
            .map(|r| r.expect("every message has a result once its PubAck is awaited"))
            .collect();
        if results
            .iter()
            .any(|r| matches!(r, Err(e) if e.kind() == ErrorKind::NotAccepted))
        {
            // The stream may have been deleted: declare again next time.
            self.forget(queue);
        }
        results
    }

    /// A batch's publish (`send`, to `subject`) that did not go out at
    /// once: async-nats is waiting for one of the context's permits, or for
    /// room in the connection's buffer. After [`PERMIT_PATIENCE`] the
    /// batch's own `PubAck`s are awaited meanwhile, oldest first (`oldest`,
    /// then those `pending`), each permit freed as its ack comes: the
    /// permits may be held by this batch's un-polled acks and by other
    /// batches', and every batch that waits frees its own, so concurrent
    /// batches never wait for each other. Refused as not sent after the
    /// operation timeout. The publish's outcome, with the acks answered
    /// meanwhile (their indices in the batch).
    #[allow(clippy::type_complexity)]
    async fn publish_waiting(
        &self,
        mut send: std::pin::Pin<&mut impl Future<Output = Result<PublishAckFuture, PublishError>>>,
        subject: &str,
        pending: &mut VecDeque<(usize, PublishAckFuture)>,
        oldest: &mut Option<(usize, AckWait)>,
    ) -> (
        Result<PublishAckFuture, DriverError>,
        Vec<(usize, Result<PublishAck, PublishError>)>,
    ) {
        let limit = self.inner.config.operation_timeout;
        let give_up = tokio::time::sleep(limit);
        tokio::pin!(give_up);
        let mut answered = Vec::new();
        let mut patient = true;
        let sent = loop {
            if !patient && oldest.is_none() {
                *oldest = pending.pop_front().map(|(at, ack)| (at, ack.into_future()));
            }
            tokio::select! {
                biased;
                sent = &mut send => break sent.map_err(|e| errors::publish_not_sent(subject, e)),
                _ = &mut give_up => break Err(error(
                    ErrorKind::NotAccepted,
                    format!(
                        "publish to `{subject}` not sent: the client's unanswered publishes \
                         (5,000) stayed at their limit for {limit:?}"
                    ),
                )),
                _ = tokio::time::sleep(PERMIT_PATIENCE), if patient => patient = false,
                acked = oldest_answer(oldest), if !patient && oldest.is_some() => answered.push(acked),
            }
        };
        (sent, answered)
    }

    /// What to publish for `message` on `queue`: to the work subject with
    /// `Nats-Msg-Id`, or, delayed, as `mechanism` holds it (declaring the
    /// hold stream first for the relay). Refused before anything is sent:
    /// a delay past the year 9999, a hold stream that cannot be declared.
    async fn prepare(
        &self,
        queue: &str,
        mechanism: Mechanism,
        message: Outgoing,
    ) -> Result<(String, PublishMessage), DriverError> {
        match message.delay.filter(|d| !d.is_zero()) {
            None => Ok((
                self.subject(queue),
                PublishMessage::build()
                    .payload(message.body.into())
                    .message_id(&message.id),
            )),
            Some(delay) => {
                if mechanism == Mechanism::Relay {
                    self.ensure_hold(queue)
                        .await
                        .map_err(DriverError::not_sent)?;
                }
                self.delayed_publish(queue, mechanism, &message.id, message.body, delay)
            }
        }
    }

    /// Publishes `record` for the message `stored` from `queue` to the
    /// failure subject `subject`. Its `Nats-Msg-Id` is derived from the
    /// failed message, so a transfer repeated after a crash between the
    /// record and the ack stores one record within the duplicate window.
    pub(super) async fn publish_failure(
        &self,
        queue: &str,
        subject: &str,
        stored: Stored,
        record: &FailureRecord,
    ) -> Result<(), DriverError> {
        let id = format!(
            "failed:{}:{}:{}",
            self.stream_name(queue),
            stored.sequence,
            stored.published
        );
        // Never over the server's max_payload (less the headers' room): one
        // that does not fit is cut to fit, as the server would close the
        // connection on it.
        let body = match self.max_message_bytes() {
            Some(limit) => record.encode_within(limit),
            None => record.encode(),
        };
        self.publish(subject, body, &id, &[]).await.map(|_| ())
    }

    /// Publishes the copy a graceful shutdown hands back for the message
    /// `stored` from `queue`: `body` again, carrying `attempt` (the
    /// deliveries consumed so far) and `shutdowns` (graceful shutdowns so
    /// far, this one included).
    pub(super) async fn publish_shutdown_copy(
        &self,
        queue: &str,
        stored: Stored,
        body: Vec<u8>,
        attempt: u32,
        shutdowns: u32,
    ) -> Result<(), DriverError> {
        // Never the original's id: the duplicate window would drop the copy.
        let id = format!(
            "{}:{}:{}:shutdown:{shutdowns}",
            self.stream_name(queue),
            stored.sequence,
            stored.published
        );
        let headers = [
            (ATTEMPTS_HEADER, attempt.to_string()),
            (SHUTDOWNS_HEADER, shutdowns.to_string()),
        ];
        self.publish(&self.subject(queue), body, &id, &headers)
            .await
            .map(|_| ())
    }

    /// Sends `publish` to `subject` on `link`, without waiting for its
    /// `PubAck`. async-nats first waits for one of the context's permits
    /// (5,000, one per unanswered publish); a wait longer than the
    /// operation timeout (the acks holding them are not coming) refuses
    /// the publish as not sent rather than waiting on.
    async fn send_publish(
        &self,
        link: &Link,
        subject: &str,
        publish: PublishMessage,
    ) -> Result<PublishAckFuture, DriverError> {
        let limit = self.inner.config.operation_timeout;
        match tokio::time::timeout(limit, link.js.send_publish(subject.to_string(), publish)).await
        {
            Ok(sent) => sent.map_err(|e| errors::publish_not_sent(subject, e)),
            Err(_) => Err(error(
                ErrorKind::NotAccepted,
                format!(
                    "publish to `{subject}` not sent: the client's unanswered publishes \
                     (5,000) stayed at their limit for {limit:?}"
                ),
            )),
        }
    }

    /// Publishes to `subject` with `Nats-Msg-Id` = `message_id` and the
    /// `headers`, and waits for the `PubAck`.
    pub(super) async fn publish(
        &self,
        subject: &str,
        body: Vec<u8>,
        message_id: &str,
        headers: &[(&str, String)],
    ) -> Result<PublishAck, DriverError> {
        self.inner.life.check_running()?;
        let link = self.connected_link(subject).await?;
        let mut publish = PublishMessage::build()
            .payload(body.into())
            .message_id(message_id);
        for (name, value) in headers {
            publish = publish.header(*name, value.as_str());
        }
        let ack = self.send_publish(&link, subject, publish).await?;
        ack.await
            .map_err(|e| errors::publish_unconfirmed(subject, e))
    }
}

/// A batch's `PubAck` being awaited.
type AckWait = std::pin::Pin<Box<dyn Future<Output = Result<PublishAck, PublishError>> + Send>>;

/// The answer to the batch's oldest `PubAck` being awaited (`oldest`,
/// which must hold one), taken out of it.
async fn oldest_answer(
    oldest: &mut Option<(usize, AckWait)>,
) -> (usize, Result<PublishAck, PublishError>) {
    let (at, wait) = oldest.as_mut().expect("an ack is being awaited");
    let (at, acked) = (*at, wait.await);
    *oldest = None;
    (at, acked)
}

/// The outcome of one publish of a batch, once its `PubAck` came or not.
fn confirmed(subject: &str, acked: Result<PublishAck, PublishError>) -> Result<(), DriverError> {
    acked
        .map(|_| ())
        .map_err(|e| errors::publish_unconfirmed(subject, e))
}

/// `e` for the first of `count` messages, and the same description and
/// kind for each of the others.
fn each_refused(e: DriverError, count: usize) -> Vec<Result<(), DriverError>> {
    let (kind, description) = (e.kind(), e.to_string());
    let mut results = Vec::with_capacity(count);
    results.push(Err(e));
    results.extend((1..count).map(|_| Err(error(kind, description.clone()))));
    results
}
