//! How the broker's answers become [`DriverError`]s: each failed lapin call
//! keeps lapin's error as its cause (built on [`crate::kit::failed`]),
//! under the [`ErrorKind`] that tells the caller what it may assume.

use std::future::Future;
use std::time::Duration;

use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::publisher_confirm::Confirmation;
use tokio::time::error::Elapsed;

use super::NAME;
use crate::driver::{DriverError, ErrorKind};

/// A descriptive error of `kind`, with no client error behind it.
pub(super) fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// A configuration the driver refuses.
pub(super) fn config_error(message: impl Into<String>) -> DriverError {
    error(ErrorKind::Config, message)
}

/// `doing` failed with lapin's error `cause`, which is kept as the source.
pub(super) fn failed(
    kind: ErrorKind,
    doing: impl Into<String>,
    cause: lapin::Error,
) -> DriverError {
    crate::kit::failed(NAME, kind, doing, cause)
}

/// A broker round trip bounded by `limit`; a failure or a timeout is `kind`.
pub(super) async fn bounded<T>(
    limit: Duration,
    doing: &str,
    kind: ErrorKind,
    call: impl Future<Output = lapin::Result<T>>,
) -> Result<T, DriverError> {
    answer(limit, doing, kind, tokio::time::timeout(limit, call).await)
}

/// The result of a call bounded by `limit`, as a driver error of `kind`.
pub(super) fn answer<T>(
    limit: Duration,
    doing: &str,
    kind: ErrorKind,
    outcome: Result<lapin::Result<T>, Elapsed>,
) -> Result<T, DriverError> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(cause)) => Err(failed(kind, doing, cause)),
        Err(_) => Err(error(kind, format!("{doing}: no answer within {limit:?}"))),
    }
}

/// Whether the broker refused a declaration because the queue exists with
/// other arguments (`PRECONDITION_FAILED`, which closes only that channel).
pub(super) fn precondition_failed(cause: &lapin::Error) -> bool {
    matches!(
        cause,
        lapin::Error::ProtocolError(e)
            if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
    )
}

/// Whether the broker answered that the queue does not exist (`NOT_FOUND`,
/// which closes only that channel).
pub(super) fn not_found(cause: &lapin::Error) -> bool {
    matches!(
        cause,
        lapin::Error::ProtocolError(e)
            if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
    )
}

/// Queue `name` exists with arguments other than `expected` (the role and
/// arguments this driver declares): a configuration error naming the queue.
pub(super) fn conflicting_queue(name: &str, expected: &str, cause: lapin::Error) -> DriverError {
    failed(
        ErrorKind::Config,
        format!(
            "queue `{name}` already exists with arguments that differ from what this driver declares \
             ({expected}); delete or migrate it, or align the driver's configuration. The broker \
             refused the declaration"
        ),
        cause,
    )
}

/// A `basic.publish` lapin could not write. A channel or connection that
/// was already gone sent nothing ([`ErrorKind::NotAccepted`]); any other
/// failure may have left the message with the broker
/// ([`ErrorKind::Uncertain`]).
pub(super) fn publish_failed(routing_key: &str, cause: lapin::Error) -> DriverError {
    match cause {
        lapin::Error::InvalidChannelState(_) | lapin::Error::InvalidConnectionState(_) => failed(
            ErrorKind::NotAccepted,
            format!("publish to `{routing_key}` not sent"),
            cause,
        ),
        _ => failed(
            ErrorKind::Uncertain,
            format!("publish to `{routing_key}` failed"),
            cause,
        ),
    }
}

/// The broker's confirm of a publish to `routing_key`, awaited up to
/// `limit`: only an ack of a routed message is success. A nack or a return
/// (unroutable) is [`ErrorKind::NotAccepted`]; a lost or late confirm is
/// [`ErrorKind::Uncertain`].
pub(super) fn confirmed(
    routing_key: &str,
    limit: Duration,
    outcome: Result<lapin::Result<Confirmation>, Elapsed>,
) -> Result<(), DriverError> {
    match outcome {
        Ok(Ok(Confirmation::Ack(None))) => Ok(()),
        Ok(Ok(Confirmation::Ack(Some(returned)))) => Err(error(
            ErrorKind::NotAccepted,
            format!(
                "publish to `{routing_key}` was returned as unroutable ({}): does the queue exist?",
                returned.reply_text
            ),
        )),
        Ok(Ok(Confirmation::Nack(_))) => Err(error(
            ErrorKind::NotAccepted,
            format!("the broker refused the publish to `{routing_key}` (nack)"),
        )),
        Ok(Ok(Confirmation::NotRequested)) => Err(error(
            ErrorKind::Uncertain,
            format!("publish to `{routing_key}` was sent without a confirm"),
        )),
        Ok(Err(cause)) => Err(failed(
            ErrorKind::Uncertain,
            format!("publish to `{routing_key}` sent, confirm lost"),
            cause,
        )),
        Err(_) => Err(error(
            ErrorKind::Uncertain,
            format!("publish to `{routing_key}`: no confirm within {limit:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPHardError};

    use super::*;

    #[test]
    fn a_failed_call_keeps_lapin_error() {
        let gone = lapin::Error::InvalidChannelState(lapin::ChannelState::Closed);
        let err = publish_failed("jobs", gone);
        assert_eq!(err.kind(), ErrorKind::NotAccepted);
        assert!(
            err.to_string().contains("publish to `jobs` not sent: "),
            "{err}"
        );
        assert!(matches!(
            err.find::<lapin::Error>(),
            Some(lapin::Error::InvalidChannelState(_))
        ));
        let err = publish_failed("jobs", lapin::Error::MissingHeartbeatError);
        assert_eq!(err.kind(), ErrorKind::Uncertain);
        assert!(err.find::<lapin::Error>().is_some());
    }

    #[test]
    fn only_a_refused_declaration_is_a_conflict() {
        let refused = lapin::Error::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
            "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit'".into(),
        ));
        assert!(precondition_failed(&refused));
        let err = conflicting_queue("jobs", "Work queue: quorum", refused);
        assert_eq!(err.kind(), ErrorKind::Config);
        let text = err.to_string();
        assert!(text.contains("queue `jobs` already exists"), "{text}");
        assert!(text.contains("inequivalent arg"), "{text}");
        assert!(err.find::<lapin::Error>().is_some());
        let other = lapin::Error::ProtocolError(AMQPError::new(
            AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED),
            "closed".into(),
        ));
        assert!(!precondition_failed(&other));
        assert!(!not_found(&other));
        let missing = lapin::Error::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no queue 'jobs' in vhost '/'".into(),
        ));
        assert!(not_found(&missing));
        assert!(!precondition_failed(&missing));
    }
}
