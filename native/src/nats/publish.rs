//! Sending: a dispatch, and the two messages a settlement publishes on a
//! delivery's behalf (a failure record, a graceful shutdown's copy). Every
//! one is a JetStream publish that waits for the server's `PubAck`, with a
//! `Nats-Msg-Id` so the duplicate window drops a repeated one.

use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use jobrail::FailureRecord;

use super::errors::{self, error};
use super::{NatsDriver, ATTEMPTS_HEADER, NAME, SHUTDOWNS_HEADER};
use crate::driver::{Driver, DriverError, ErrorKind, Outgoing};

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
    /// Stores `message` on `queue`: refused at once while disconnected, when
    /// delayed (JetStream 2.9 has no scheduled messages) or over the
    /// server's size limit.
    pub(super) async fn dispatch(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.life.check_running()?;
        if let Some(delay) = message.delay.filter(|d| !d.is_zero()) {
            return Err(error(
                ErrorKind::Unsupported,
                format!(
                    "delayed dispatch ({delay:?}) is not supported: JetStream 2.9 has no scheduled messages"
                ),
            ));
        }
        let subject = self.subject(queue);
        // Before the stream setup, which would wait in the client's queue
        // while it reconnects.
        self.connected_link(&subject).await?;
        // The limit is the server's: known once connected.
        self.capabilities()
            .refuse_oversize(NAME, message.body.len())?;
        self.declare(queue).await.map_err(DriverError::not_sent)?;
        let result = self.publish(&subject, message.body, &message.id, &[]).await;
        if let Err(e) = &result {
            if e.kind() == ErrorKind::NotAccepted {
                // The stream may have been deleted: declare again next time.
                self.forget(queue);
            }
        }
        result.map(|_| ())
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
        self.publish(subject, record.encode(), &id, &[])
            .await
            .map(|_| ())
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
        let ack = link
            .js
            .send_publish(subject.to_string(), publish)
            .await
            .map_err(|e| errors::publish_not_sent(subject, e))?;
        ack.await
            .map_err(|e| errors::publish_unconfirmed(subject, e))
    }
}
