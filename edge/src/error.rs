//! The edge binding's errors ([`EdgeError`], [`EdgeErrorKind`]).

use std::fmt;

/// What went wrong talking to the platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EdgeErrorKind {
    /// The platform cannot do this (a delay above 24 hours).
    Unsupported,
    /// The request was made but failed; the platform may or may not have acted.
    Uncertain,
    /// The payload could not be encoded.
    Encode,
    /// A binding is missing or of the wrong type.
    Config,
}

/// An error from the edge binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeError {
    /// The kind.
    pub kind: EdgeErrorKind,
    /// What happened.
    pub message: String,
}

impl EdgeError {
    pub(crate) fn new(kind: EdgeErrorKind, message: impl Into<String>) -> Self {
        EdgeError {
            kind,
            message: message.into(),
        }
    }
}

impl EdgeError {
    /// A failed platform call whose effect is unknown.
    pub fn uncertain(what: &str, detail: impl fmt::Display) -> Self {
        EdgeError::new(EdgeErrorKind::Uncertain, format!("{what}: {detail}"))
    }
}

impl fmt::Display for EdgeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            EdgeErrorKind::Unsupported => "unsupported",
            EdgeErrorKind::Uncertain => "outcome uncertain",
            EdgeErrorKind::Encode => "encoding error",
            EdgeErrorKind::Config => "configuration error",
        };
        write!(f, "cloudflare: {kind}: {}", self.message)
    }
}

impl std::error::Error for EdgeError {}

impl From<EdgeError> for queue::SettlementError {
    fn from(err: EdgeError) -> Self {
        let kind = match err.kind {
            EdgeErrorKind::Unsupported => queue::ErrorKind::Unsupported,
            EdgeErrorKind::Uncertain => queue::ErrorKind::Uncertain,
            EdgeErrorKind::Encode => queue::ErrorKind::Encode,
            EdgeErrorKind::Config => queue::ErrorKind::Config,
        };
        queue::SettlementError::new(kind, err)
    }
}
