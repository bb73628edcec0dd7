//! Failure records ([`FailureRecord`]).

use serde::{Deserialize, Serialize};

use crate::envelope::{new_message_id, Envelope};
use crate::runtime::{SystemTime, UNIX_EPOCH};
use crate::settle::{Failure, FailureKind};

/// The format version of failure records.
pub(crate) const FAILURE_RECORD_VERSION: u32 = 1;

/// A terminal failure, as published to a failure destination.
///
/// A record keeps enough to investigate and replay by hand: the envelope when
/// it decoded, the raw body when it did not (poison), the reason, and how
/// many deliveries and executions the message consumed. Records can hold job
/// data and unsanitised error text: protect the destination accordingly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// Format version.
    pub v: u32,
    /// The record's own id, unique per record (a message that failed twice,
    /// after a crash, has two records with one message id). Empty in records
    /// written before records had ids.
    #[serde(default)]
    pub id: String,
    /// The queue the message was consumed from.
    pub queue: String,
    /// The message id, when the envelope decoded.
    pub message_id: Option<String>,
    /// The job name, when the envelope decoded.
    pub job: Option<String>,
    /// Why it failed.
    pub kind: FailureKind,
    /// The error text.
    pub reason: String,
    /// The delivery attempt on which it failed.
    pub attempt: u32,
    /// Handler executions in that last delivery.
    pub executions: u32,
    /// When, in milliseconds since the Unix epoch.
    pub failed_at_ms: u64,
    /// The decoded envelope, if it decoded.
    pub envelope: Option<Envelope>,
    /// The raw body, for messages that did not decode (UTF-8 text, or hex).
    pub raw_body: Option<RawBody>,
}

/// A message body that could not be decoded, kept byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "encoding", content = "data", rename_all = "snake_case")]
pub enum RawBody {
    /// The body was valid UTF-8.
    Utf8(String),
    /// The body was not UTF-8: lowercase hex.
    Hex(String),
}

impl RawBody {
    /// Keeps `bytes` losslessly.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => RawBody::Utf8(text.to_string()),
            Err(_) => RawBody::Hex(bytes.iter().map(|b| format!("{b:02x}")).collect()),
        }
    }

    /// The original bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            RawBody::Utf8(text) => text.as_bytes().to_vec(),
            RawBody::Hex(hex) => (0..hex.len() / 2)
                .filter_map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
                .collect(),
        }
    }
}

impl FailureRecord {
    /// The record of `failure` for a message consumed from `queue`, on
    /// delivery `attempt` after `executions` handler executions. Keeps the
    /// envelope when it decoded, and the raw body when it did not (or when
    /// the payload itself was the problem).
    pub fn build(
        queue: &str,
        failure: &Failure,
        attempt: u32,
        executions: u32,
        envelope: Option<&Envelope>,
        raw: &[u8],
    ) -> Self {
        let keep_raw = matches!(
            failure.kind,
            FailureKind::MalformedEnvelope | FailureKind::UndecodablePayload
        );
        FailureRecord {
            v: FAILURE_RECORD_VERSION,
            id: new_message_id(),
            queue: queue.to_string(),
            message_id: envelope.map(|e| e.id.clone()),
            job: envelope.map(|e| e.job.clone()),
            kind: failure.kind,
            reason: failure.message.clone(),
            attempt,
            executions,
            failed_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            envelope: envelope.cloned(),
            raw_body: (keep_raw || envelope.is_none()).then(|| RawBody::from_bytes(raw)),
        }
    }

    /// Serializes to JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a failure record always serializes")
    }

    /// Parses JSON bytes.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn raw_bodies_round_trip() {
        for bytes in [&b"{not json"[..], &[0xff, 0x00, 0x10][..]] {
            assert_eq!(RawBody::from_bytes(bytes).to_bytes(), bytes);
        }
    }
}
