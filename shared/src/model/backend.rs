//! A backend's answer to a request it did not confirm ([`SettlementError`],
//! [`ErrorKind`]): the drivers report it, the rules count and emit it.

use std::error::Error as StdError;
use std::fmt;

use crate::model::error::BoxError;

/// What kind of failure a settlement (or any backend request) met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The backend certainly did not take the message or settlement.
    NotAccepted,
    /// The request was sent but its result is unknown: the backend may have
    /// acted on it. Repeating a dispatch may enqueue a second copy.
    Uncertain,
    /// The backend cannot do this (a delay too long, delayed dispatch...).
    Unsupported,
    /// The driver or the backend's existing topology is misconfigured.
    Config,
    /// The connection to the backend failed or was lost.
    Connection,
    /// The driver has been stopped.
    Stopped,
    /// The payload could not be encoded.
    Encode,
    /// What the request names does not exist (a failure record that is
    /// gone, say).
    NotFound,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::NotAccepted => "not accepted",
            ErrorKind::Uncertain => "outcome uncertain",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Config => "configuration error",
            ErrorKind::Connection => "connection error",
            ErrorKind::Stopped => "driver stopped",
            ErrorKind::Encode => "encoding error",
            ErrorKind::NotFound => "not found",
        })
    }
}

/// A settlement the backend did not confirm: its kind and the host's error.
#[derive(Debug)]
pub struct SettlementError {
    kind: ErrorKind,
    source: BoxError,
}

impl SettlementError {
    /// A settlement error of `kind` caused by `source` (the driver's error).
    pub fn new(kind: ErrorKind, source: impl Into<BoxError>) -> Self {
        SettlementError {
            kind,
            source: source.into(),
        }
    }

    /// What kind of failure it was.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The host's own error, for matching or downcasting.
    pub fn get_ref(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.source.as_ref()
    }
}

impl fmt::Display for SettlementError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for SettlementError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.source.as_ref())
    }
}
