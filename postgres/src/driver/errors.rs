//! What a Postgres error means for a message: stored or not, applied or
//! not, connection gone or not.

use jobrail_native::kit::failed;
use jobrail_native::{DriverError, ErrorKind};

/// The driver's name in logs, errors and metrics.
pub(crate) const NAME: &str = "postgres";

/// A configuration error, found before any I/O.
pub(crate) fn config_error(why: impl Into<String>) -> DriverError {
    DriverError::new(NAME, ErrorKind::Config, why.into())
}

/// Whether `error` means the connection is gone (closed, terminated by the
/// server, the server shutting down or refusing connections).
pub(crate) fn connection_lost(error: &tokio_postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    match error.code() {
        Some(code) => {
            let code = code.code();
            code.starts_with("08") || code.starts_with("57P")
        }
        // No SQL state: an I/O error or a protocol error, not an answer.
        None => true,
    }
}

/// The error of a statement that stores or changes something: a refusal
/// by the server (an SQL state other than a lost connection) applied
/// nothing ([`ErrorKind::NotAccepted`]); a lost connection may have lost
/// the answer of a statement that committed ([`ErrorKind::Uncertain`]).
pub(crate) fn write_error(doing: impl Into<String>, error: tokio_postgres::Error) -> DriverError {
    let kind = if connection_lost(&error) {
        ErrorKind::Uncertain
    } else {
        ErrorKind::NotAccepted
    };
    failed(NAME, kind, doing, error)
}

/// The error of a statement that only reads (or whose failure changes
/// nothing for the caller): [`ErrorKind::Connection`] when the connection
/// is gone, [`ErrorKind::NotAccepted`] when the server refused it.
pub(crate) fn read_error(doing: impl Into<String>, error: tokio_postgres::Error) -> DriverError {
    let kind = if connection_lost(&error) {
        ErrorKind::Connection
    } else {
        ErrorKind::NotAccepted
    };
    failed(NAME, kind, doing, error)
}

/// The error of connecting: nothing was sent.
pub(crate) fn connect_error(error: tokio_postgres::Error) -> DriverError {
    failed(NAME, ErrorKind::Connection, "connect to Postgres", error)
}

/// A settlement refused because another delivery holds the message now:
/// this one's lease ended and the message was delivered again (or
/// finished) by another holder. Nothing was applied.
pub(crate) fn fenced(what: &str, queue: &str, message_id: &str) -> DriverError {
    DriverError::new(
        NAME,
        ErrorKind::NotAccepted,
        format!(
            "{what} of message `{message_id}` on queue `{queue}` refused: this delivery's lease \
             was taken over (the message was delivered again after the lease ended, or finished \
             by its new holder); nothing was applied"
        ),
    )
}
