//! async-nats' errors as [`DriverError`]s.
//!
//! One function per client call whose failure the driver reports: it chooses
//! the [`ErrorKind`] (a refusal by the server, a request that got no answer,
//! something that is not there) and keeps the client's error as the cause,
//! so a caller can reach it with [`DriverError::find`]. Lookups whose "not
//! found" is part of the plan (declare when missing, skip a deleted
//! sequence) return `None` for it.
//!
//! The driver never hands async-nats a URL with credentials (they travel in
//! the connect options), so no client error here can carry them.

use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
    GetStreamError, GetStreamErrorKind, PublishError, PublishErrorKind,
};
use async_nats::jetstream::stream::{
    ConsumerError, ConsumerErrorKind, DeleteMessageError, DeleteMessageErrorKind, RawMessageError,
    RawMessageErrorKind,
};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::ConnectError;

use super::NAME;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::failed;

/// A descriptive error of `kind`, with no client error behind it.
pub(super) fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// A descriptive configuration error (settings, topology that differs).
pub(super) fn config_error(message: impl Into<String>) -> DriverError {
    error(ErrorKind::Config, message)
}

/// An error async-nats hands out boxed ([`async_nats::Error`]), kept as a
/// cause: [`DriverError::find`] sees through it to the client's own error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct Boxed(#[source] pub(super) async_nats::Error);

/// A request to the server that failed or got no answer: a connection
/// error while `doing`.
pub(super) fn connection<E>(doing: impl Into<String>, e: E) -> DriverError
where
    E: std::error::Error + Send + Sync + 'static,
{
    failed(NAME, ErrorKind::Connection, doing, e)
}

/// Connecting to `address` (never with its credentials) failed.
pub(super) fn connect(address: &str, e: ConnectError) -> DriverError {
    connection(format!("cannot connect to {address}"), e)
}

/// The server's error, if `e`'s chain carries one (a refusal, as opposed to
/// a transport failure).
fn server_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a jetstream::Error> {
    let mut current = Some(e);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<jetstream::Error>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

fn invalid_stream_name(name: &str) -> DriverError {
    config_error(format!("`{name}` is not a valid stream name"))
}

/// Whether a stream lookup (or deletion) failed because there is no such
/// stream.
pub(super) fn stream_not_found(e: &GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Looking up the stream `name` failed; `None` when it does not exist.
pub(super) fn stream_lookup(name: &str, e: GetStreamError) -> Option<DriverError> {
    if stream_not_found(&e) {
        return None;
    }
    Some(match e.kind() {
        GetStreamErrorKind::InvalidStreamName | GetStreamErrorKind::EmptyName => {
            invalid_stream_name(name)
        }
        _ => connection(format!("looking up stream `{name}`"), e),
    })
}

/// Creating the stream `name` for `subject` failed; `None` when someone
/// created it meanwhile (inspect theirs).
pub(super) fn stream_create(
    name: &str,
    subject: &str,
    e: CreateStreamError,
) -> Option<DriverError> {
    Some(match e.kind() {
        CreateStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NAME_EXIST => {
            return None
        }
        CreateStreamErrorKind::JetStream(_) => failed(
            NAME,
            ErrorKind::Config,
            format!("the server refused to create stream `{name}` for subject `{subject}`"),
            e,
        ),
        CreateStreamErrorKind::InvalidStreamName | CreateStreamErrorKind::EmptyStreamName => {
            invalid_stream_name(name)
        }
        _ => connection(format!("creating stream `{name}`"), e),
    })
}

/// Whether the server refused a stream because another stream holds its
/// subjects.
pub(super) fn is_subject_overlap(e: &CreateStreamError) -> bool {
    matches!(e.kind(), CreateStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP)
}

/// Whether the server failed to create a stream's store (`10049`, "error
/// creating store for stream"): seen when a stream is created while the
/// server removes the account's last emptied stream directory, a race that
/// passes; the create is tried again.
pub(super) fn is_store_creation(e: &CreateStreamError) -> bool {
    matches!(e.kind(), CreateStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_CREATE)
}

/// Looking up the consumer `name` on `stream` failed; `None` when it does
/// not exist.
pub(super) fn consumer_lookup(
    name: &str,
    stream: &str,
    e: ConsumerInfoError,
) -> Option<DriverError> {
    (e.kind() != ConsumerInfoErrorKind::NotFound)
        .then(|| connection(format!("looking up consumer `{name}` on `{stream}`"), e))
}

/// Creating the consumer `name` on `stream` failed; `None` when someone
/// created it meanwhile (inspect theirs).
pub(super) fn consumer_create(name: &str, stream: &str, e: ConsumerError) -> Option<DriverError> {
    Some(match e.kind() {
        ConsumerErrorKind::JetStream(j)
            if j.error_code() == ErrorCode::CONSUMER_NAME_EXIST
                || j.error_code() == ErrorCode::CONSUMER_ALREADY_EXISTS =>
        {
            return None
        }
        ConsumerErrorKind::JetStream(_) => failed(
            NAME,
            ErrorKind::Config,
            format!("the server refused to create consumer `{name}` on stream `{stream}`"),
            e,
        ),
        _ => connection(format!("creating consumer `{name}` on `{stream}`"), e),
    })
}

/// The consumer `name`'s configuration is not one of a pull consumer.
pub(super) fn not_a_pull_consumer(name: &str, e: async_nats::Error) -> DriverError {
    failed(
        NAME,
        ErrorKind::Config,
        format!("consumer `{name}`"),
        Boxed(e),
    )
}

/// A publish to `subject` that failed before it was sent (not connected,
/// the client's queue full): certainly not stored.
pub(super) fn publish_not_sent(subject: &str, e: PublishError) -> DriverError {
    failed(
        NAME,
        ErrorKind::NotAccepted,
        format!("publish to `{subject}` not sent"),
        e,
    )
}

/// A publish to `subject` that was sent but not confirmed: no stream (no
/// responders) and the server's refusals are not accepted, a `PubAck` that
/// did not arrive or could not be read is uncertain.
pub(super) fn publish_unconfirmed(subject: &str, e: PublishError) -> DriverError {
    let (kind, doing) = match e.kind() {
        PublishErrorKind::StreamNotFound => (
            ErrorKind::NotAccepted,
            format!("publish to `{subject}`: no stream stores this subject (no responders)"),
        ),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => (
            ErrorKind::Uncertain,
            format!("publish to `{subject}` sent, no PubAck"),
        ),
        _ if server_error(&e).is_some() => (
            ErrorKind::NotAccepted,
            format!("the server refused the publish to `{subject}`"),
        ),
        _ => (
            ErrorKind::Uncertain,
            format!("publish to `{subject}` sent, PubAck unreadable"),
        ),
    };
    failed(NAME, kind, doing, e)
}

/// Reading `sequence` of the stream `stream` failed; `None` when there is
/// no message at that sequence (deleted).
pub(super) fn raw_message(stream: &str, sequence: u64, e: RawMessageError) -> Option<DriverError> {
    let missing = e.kind() == RawMessageErrorKind::NoMessageFound
        || server_error(&e).map(|j| j.error_code()) == Some(ErrorCode::NO_MESSAGE_FOUND);
    (!missing).then(|| connection(format!("reading `{stream}` sequence {sequence}"), e))
}

/// Deleting `sequence` of the stream `stream` failed; `None` when there is
/// no message at that sequence (deleted already). A 2.9 server reports that
/// as a failed deletion (10057) whose description is the store's "no
/// message found".
pub(super) fn message_delete(
    stream: &str,
    sequence: u64,
    e: DeleteMessageError,
) -> Option<DriverError> {
    let missing = matches!(e.kind(), DeleteMessageErrorKind::JetStream(j)
        if j.error_code() == ErrorCode::SEQUENCE_NOT_FOUND
            || j.error_code() == ErrorCode::NO_MESSAGE_FOUND
            || (j.error_code() == ErrorCode::STREAM_MESSAGE_DELETE_FAILED
                && j.to_string().starts_with("no message found")));
    (!missing).then(|| connection(format!("deleting `{stream}` sequence {sequence}"), e))
}

/// A settlement (`what`) of a delivery from `queue` that was not sent or
/// not confirmed: uncertain if it `timed_out`, a connection error otherwise.
pub(super) fn settlement<E>(what: &str, queue: &str, e: E, timed_out: bool) -> DriverError
where
    E: std::error::Error + Send + Sync + 'static,
{
    failed(
        NAME,
        if timed_out {
            ErrorKind::Uncertain
        } else {
            ErrorKind::Connection
        },
        format!(
            "{what} of a delivery from `{queue}` not confirmed (if the server did not get it, \
             the message is redelivered after AckWait)"
        ),
        e,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_stay_reachable_as_causes() {
        let err = publish_unconfirmed("queue.q", PublishError::new(PublishErrorKind::TimedOut));
        assert_eq!(err.kind(), ErrorKind::Uncertain);
        assert!(
            err.to_string()
                .contains("publish to `queue.q` sent, no PubAck"),
            "{err}"
        );
        assert_eq!(
            err.find::<PublishError>().map(|e| e.kind()),
            Some(PublishErrorKind::TimedOut)
        );
        let err = publish_unconfirmed(
            "queue.q",
            PublishError::new(PublishErrorKind::StreamNotFound),
        );
        assert_eq!(err.kind(), ErrorKind::NotAccepted);

        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer");
        let err = settlement("ack", "q", timed_out, true);
        assert_eq!(err.kind(), ErrorKind::Uncertain);
        assert!(
            err.to_string()
                .contains("ack of a delivery from `q` not confirmed"),
            "{err}"
        );
        assert_eq!(
            err.find::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::TimedOut),
            "the client error is seen through"
        );
        let err = settlement("nak", "q", std::io::Error::other("broken pipe"), false);
        assert_eq!(err.kind(), ErrorKind::Connection);
    }

    #[test]
    fn expected_absences_are_not_errors() {
        let missing = RawMessageError::new(RawMessageErrorKind::NoMessageFound);
        assert!(raw_message("S", 3, missing).is_none());
        let other = RawMessageError::new(RawMessageErrorKind::Other);
        let err = raw_message("S", 3, other).unwrap();
        assert_eq!(err.kind(), ErrorKind::Connection);
        assert!(err.find::<RawMessageError>().is_some());
        let server = |json: &str| {
            let error: jetstream::Error = serde_json::from_str(json).unwrap();
            DeleteMessageError::new(DeleteMessageErrorKind::JetStream(error))
        };
        let missing = server(r#"{"code":500,"err_code":10057,"description":"no message found"}"#);
        assert!(message_delete("S", 3, missing).is_none());
        let missing = server(r#"{"code":404,"err_code":10043,"description":"sequence not found"}"#);
        assert!(message_delete("S", 3, missing).is_none());
        let failed = server(r#"{"code":500,"err_code":10057,"description":"disk full"}"#);
        let err = message_delete("S", 3, failed).unwrap();
        assert!(err.to_string().contains("deleting `S` sequence 3"), "{err}");
        let missing = ConsumerInfoError::new(ConsumerInfoErrorKind::NotFound);
        assert!(consumer_lookup("c", "S", missing).is_none());
        let invalid = GetStreamError::new(GetStreamErrorKind::InvalidStreamName);
        assert_eq!(
            stream_lookup("S", invalid).unwrap().kind(),
            ErrorKind::Config
        );
    }
}
