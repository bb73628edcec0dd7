//! AWS SDK errors as driver errors: which [`ErrorKind`] a failed request
//! is, with the SDK's own error kept as the cause.
//!
//! The kind follows where the request failed. One that could not be built
//! or that found no connection was certainly not sent; one that SQS answered
//! with an error was not acted on; one that failed after it may have been
//! sent (connection lost, no answer, unreadable answer) has an unknown
//! outcome. Each caller says which [`ErrorKind`] the first two and the last
//! one are for its request ([`sdk_error`]). A request whose credentials
//! could not be had (an [`SqsCredentialSource`](super::SqsCredentialSource)
//! that failed) was certainly not sent.
//!
//! The SDK's error stays the [`source`](std::error::Error::source) (reach it
//! with [`DriverError::find`], e.g. `SdkError<SendMessageError, _>`). Its
//! own text is only "service error" or "dispatch failure", so the driver's
//! error text spells out the causes below it, and its `Debug` output shows
//! that text rather than the SDK's, which carries the raw HTTP response.

use std::fmt;
use std::sync::Arc;

use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_sqs::error::{ConnectorError, ProvideErrorMetadata, SdkError};

use super::NAME;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::failed;

/// A configuration error described by `message`.
pub(super) fn config_error(message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, ErrorKind::Config, message.into())
}

/// An error of `kind` described by `message` (no client error behind it).
pub(super) fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// Where an SDK request failed, for choosing an [`ErrorKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Certainly not sent: the request could not be built or no connection
    /// could be made.
    NotSent,
    /// SQS answered with an error: it did not act on the request.
    Refused,
    /// Sent, outcome unknown (connection lost, timeout, unreadable answer).
    Unknown,
}

fn failure_of<E, R>(err: &SdkError<E, R>) -> Failure
where
    E: std::error::Error + 'static,
    R: fmt::Debug + 'static,
{
    match err {
        SdkError::ConstructionFailure(_) => Failure::NotSent,
        SdkError::DispatchFailure(_) if no_credentials(err) => Failure::NotSent,
        SdkError::ServiceError(_) => Failure::Refused,
        SdkError::DispatchFailure(dispatch) if dispatch.is_user() => Failure::NotSent,
        SdkError::DispatchFailure(dispatch) if connect_failed(dispatch.as_connector_error()) => {
            Failure::NotSent
        }
        _ => Failure::Unknown,
    }
}

/// Whether the connection itself could not be made (so nothing was sent).
fn connect_failed(connector: Option<&ConnectorError>) -> bool {
    let Some(connector) = connector else {
        return false;
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(connector);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable
            ) {
                return true;
            }
        }
        // hyper-util's legacy client says `client error (Connect)` when the
        // connection could not be established.
        if e.to_string().contains("(Connect)") {
            return true;
        }
        source = e.source();
    }
    false
}

/// Whether the request failed for want of credentials (the SDK resolves
/// them before it sends, and reports a failure as a dispatch failure).
fn no_credentials<E, R>(err: &SdkError<E, R>) -> bool
where
    E: std::error::Error + 'static,
    R: fmt::Debug + 'static,
{
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.is::<CredentialsError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// The service error's code (`QueueDoesNotExist`...), if SQS answered.
fn code_of<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Option<&str> {
    match err {
        SdkError::ServiceError(service) => service.err().code(),
        _ => None,
    }
}

/// Whether SQS answered that the queue does not exist.
pub(super) fn is_missing_queue<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    matches!(
        code_of(err),
        Some("QueueDoesNotExist" | "AWS.SimpleQueueService.NonExistentQueue" | "NonExistentQueue")
    )
}

/// Whether SQS answered that a queue of that name exists already (with
/// other attributes).
pub(super) fn is_existing_queue<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    code_of(err).is_some_and(|c| c.contains("QueueNameExists") || c.contains("QueueAlreadyExists"))
}

/// `what` failed with the SDK error `err`: refused or not sent -> `refused`,
/// sent with an unknown outcome -> `unknown`. The SDK error is the cause.
pub(super) fn sdk_error<E, R>(
    what: &str,
    err: SdkError<E, R>,
    refused: ErrorKind,
    unknown: ErrorKind,
) -> DriverError
where
    E: std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    let kind = match failure_of(&err) {
        Failure::NotSent | Failure::Refused => refused,
        Failure::Unknown => unknown,
    };
    failed(NAME, kind, what, Sdk(err))
}

/// The probe of [`SqsDriver::connect`](super::SqsDriver::connect) failed:
/// refused by the service (credentials, region), impossible to build, or
/// without credentials (the configured source failed), the settings are
/// wrong ([`ErrorKind::Config`]); not sent for want of a connection, or no
/// answer, the endpoint is down or unreachable ([`ErrorKind::Connection`],
/// which the caller may retry).
pub(super) fn probe_error<E, R>(what: &str, err: SdkError<E, R>) -> DriverError
where
    E: std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    let kind = match &err {
        SdkError::ConstructionFailure(_) | SdkError::ServiceError(_) => ErrorKind::Config,
        _ if no_credentials(&err) => ErrorKind::Config,
        _ => ErrorKind::Connection,
    };
    failed(NAME, kind, what, Sdk(err))
}

/// `err` as the error of each of `n` messages (a batch call that failed
/// for all of them): the same kind, and the same cause, shared (an SDK
/// error cannot be copied), still reached with [`DriverError::find`].
pub(super) fn fan_out(err: DriverError, n: usize) -> Vec<DriverError> {
    if n <= 1 {
        return if n == 1 { vec![err] } else { vec![] };
    }
    let kind = err.kind();
    let shared = Shared(Arc::new(err));
    (0..n)
        .map(|_| DriverError::new(NAME, kind, shared.clone()))
        .collect()
}

/// The cause of one of several errors [`fan_out`] made from one: its text
/// and its causes are the original's (without repeating the driver and
/// kind, which the new error states).
#[derive(Clone)]
struct Shared(Arc<DriverError>);

impl fmt::Display for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::error::Error::source(&*self.0) {
            Some(cause) => fmt::Display::fmt(cause, f),
            None => fmt::Display::fmt(&*self.0, f),
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::error::Error for Shared {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)?.source()
    }
}

/// An SDK error whose text includes its causes; its source is the SDK
/// error itself.
struct Sdk<E, R>(SdkError<E, R>);

impl<E, R> fmt::Display for Sdk<E, R>
where
    E: std::error::Error + 'static,
    R: fmt::Debug + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&chain_text(&self.0))
    }
}

/// The text, not the SDK's `Debug` (which holds the raw HTTP response).
impl<E, R> fmt::Debug for Sdk<E, R>
where
    E: std::error::Error + 'static,
    R: fmt::Debug + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SdkError")
            .field(&chain_text(&self.0))
            .finish()
    }
}

impl<E, R> std::error::Error for Sdk<E, R>
where
    E: std::error::Error + 'static,
    R: fmt::Debug + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// An error and its sources, `: `-separated.
fn chain_text(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::error::ErrorMetadata;
    use aws_sdk_sqs::operation::send_message::SendMessageError;

    #[test]
    fn an_sdk_error_is_kept_and_spelled_out() {
        let answer = SendMessageError::generic(
            ErrorMetadata::builder()
                .code("QueueDoesNotExist")
                .message("The specified queue does not exist.")
                .build(),
        );
        let err: SdkError<SendMessageError, ()> = SdkError::service_error(answer, ());
        assert!(is_missing_queue(&err));
        let err = sdk_error(
            "SendMessage to `q`",
            err,
            ErrorKind::NotAccepted,
            ErrorKind::Uncertain,
        );
        assert_eq!(err.kind(), ErrorKind::NotAccepted);
        let text = err.to_string();
        assert!(text.contains("SendMessage to `q`: service error"), "{text}");
        assert!(text.contains("QueueDoesNotExist"), "{text}");
        let kept = err
            .find::<SdkError<SendMessageError, ()>>()
            .expect("the SDK error is the cause");
        assert_eq!(code_of(kept), Some("QueueDoesNotExist"));
        assert!(err.find::<SendMessageError>().is_some());

        // Shared by the messages of a batch call: same kind, text and cause.
        let all = fan_out(err, 3);
        assert_eq!(all.len(), 3);
        for each in &all {
            assert_eq!(each.kind(), ErrorKind::NotAccepted);
            assert_eq!(each.to_string(), text);
            assert!(each.find::<SdkError<SendMessageError, ()>>().is_some());
        }
    }
}
