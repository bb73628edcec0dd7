//! What a terminal failure is ([`Failure`], [`FailureKind`]): the words the
//! settlement rules decide with and the failure record keeps.

use serde::{Deserialize, Serialize};

/// Why a message failed terminally.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The category.
    pub kind: FailureKind,
    /// Human-readable reason (the error chain).
    pub message: String,
}

/// Categories of terminal failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureKind {
    /// The handler returned a permanent error.
    Permanent,
    /// The attempt cap was reached.
    AttemptsExhausted,
    /// The payload did not decode into the job's type.
    UndecodablePayload,
    /// The body was not an envelope this worker can read.
    MalformedEnvelope,
    /// No handler is registered for the job name (after the unknown-name cap).
    UnknownName,
    /// The validation hook refused the payload.
    InvalidPayload,
}
