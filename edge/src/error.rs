//! The edge binding's errors ([`EdgeError`], [`EdgeErrorKind`]).

use std::fmt;

use jobrail::BoxError;

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

/// An error from the edge binding: its [`kind`](EdgeError::kind), a message
/// naming what failed, and, where the cause is an ordinary Rust error (a
/// payload that does not encode), that error as the
/// [`source`](std::error::Error::source). Errors the platform raises as
/// JavaScript values (`worker::Error`, a `JsValue`) are not `Send`, so only
/// their text is kept, in the message.
#[derive(Debug, thiserror::Error)]
#[error("cloudflare: {}: {message}", kind.describe())]
#[non_exhaustive]
pub struct EdgeError {
    /// The kind.
    pub kind: EdgeErrorKind,
    /// What happened (with the cause's text, if there is one).
    pub message: String,
    #[source]
    source: Option<BoxError>,
}

impl EdgeError {
    pub(crate) fn new(kind: EdgeErrorKind, message: impl Into<String>) -> Self {
        EdgeError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An error of `kind` caused by `source`, kept as the source. The
    /// message is the source's text, after `context` (what failed) if given.
    pub(crate) fn caused_by(
        kind: EdgeErrorKind,
        context: Option<&str>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        let message = match context {
            Some(context) => format!("{context}: {source}"),
            None => source.to_string(),
        };
        EdgeError {
            kind,
            message,
            source: Some(Box::new(source)),
        }
    }

    /// A failed platform call whose effect is unknown. `detail` is the
    /// platform's error, kept as text.
    pub fn uncertain(what: &str, detail: impl fmt::Display) -> Self {
        EdgeError::new(EdgeErrorKind::Uncertain, format!("{what}: {detail}"))
    }
}

impl EdgeErrorKind {
    fn describe(self) -> &'static str {
        match self {
            EdgeErrorKind::Unsupported => "unsupported",
            EdgeErrorKind::Uncertain => "outcome uncertain",
            EdgeErrorKind::Encode => "encoding error",
            EdgeErrorKind::Config => "configuration error",
        }
    }
}

impl From<EdgeError> for jobrail::SettlementError {
    fn from(err: EdgeError) -> Self {
        let kind = match err.kind {
            EdgeErrorKind::Unsupported => jobrail::ErrorKind::Unsupported,
            EdgeErrorKind::Uncertain => jobrail::ErrorKind::Uncertain,
            EdgeErrorKind::Encode => jobrail::ErrorKind::Encode,
            EdgeErrorKind::Config => jobrail::ErrorKind::Config,
        };
        jobrail::SettlementError::new(kind, err)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn a_rust_cause_is_kept_as_the_source() {
        let cause = serde_json::from_str::<u32>("x").unwrap_err();
        let text = cause.to_string();
        let err = EdgeError::caused_by(EdgeErrorKind::Encode, Some("the payload"), cause);
        assert_eq!(
            err.to_string(),
            format!("cloudflare: encoding error: the payload: {text}")
        );
        assert!(err
            .source()
            .and_then(|s| s.downcast_ref::<serde_json::Error>())
            .is_some());
        let settlement = jobrail::SettlementError::from(err);
        assert_eq!(settlement.kind(), jobrail::ErrorKind::Encode);
        assert!(settlement.get_ref().downcast_ref::<EdgeError>().is_some());
    }

    #[test]
    fn a_platform_error_keeps_its_text() {
        let err = EdgeError::uncertain("ack", "refused");
        assert_eq!(
            err.to_string(),
            "cloudflare: outcome uncertain: ack: refused"
        );
        assert!(err.source().is_none());
    }
}
