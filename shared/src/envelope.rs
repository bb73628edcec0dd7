//! The wire format every backend carries ([`Envelope`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::redact::json_error;
use crate::runtime::{SystemTime, UNIX_EPOCH};

/// The envelope format version this crate writes.
pub(crate) const ENVELOPE_VERSION: u32 = 1;

/// One message on the wire.
///
/// JSON, so that a message is readable in a broker's management UI and can be
/// produced from any language. The `v` field versions the format: a decoder
/// refuses versions newer than it knows with a clear error instead of
/// misreading them, and new optional fields can be added without a new version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Format version.
    pub v: u32,
    /// A fresh id per dispatch (UUID v4).
    pub id: String,
    /// The job name, used to find the handler.
    pub job: String,
    /// The typed payload, as JSON.
    pub payload: serde_json::Value,
    /// When it was dispatched, in milliseconds since the Unix epoch.
    pub dispatched_at_ms: u64,
    /// Free-form application metadata (not interpreted by the facade).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// The body could not be read as an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// Not valid JSON, or missing required fields. The text is serde's,
    /// with every value from the body taken out ([`crate::redact::json_error`]):
    /// the body may hold payload data, which stays out of logs and events.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// Written by a newer version of the facade.
    #[error("unsupported envelope version {found} (this worker reads up to {ENVELOPE_VERSION})")]
    UnsupportedVersion {
        /// The version in the message.
        found: u32,
    },
}

impl Envelope {
    /// A new envelope for `job` with a fresh id and the current time.
    pub fn new(job: impl Into<String>, payload: serde_json::Value) -> Self {
        let dispatched_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis().min(u64::MAX as u128) as u64)
            .unwrap_or(0);
        Envelope {
            v: ENVELOPE_VERSION,
            id: new_message_id(),
            job: job.into(),
            payload,
            dispatched_at_ms,
            metadata: BTreeMap::new(),
        }
    }

    /// Serializes to bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an envelope always serializes")
    }

    /// Parses bytes, checking the version.
    pub fn decode(body: &[u8]) -> Result<Self, EnvelopeError> {
        #[derive(Deserialize)]
        struct Version {
            v: u32,
        }
        let version: Version =
            serde_json::from_slice(body).map_err(|e| EnvelopeError::Malformed(json_error(&e)))?;
        if version.v == 0 || version.v > ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion { found: version.v });
        }
        serde_json::from_slice(body).map_err(|e| EnvelopeError::Malformed(json_error(&e)))
    }
}

/// A new random message id (UUID v4; uses the JS crypto source on wasm32).
pub fn new_message_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trips() {
        let mut env = Envelope::new("build-report", serde_json::json!({"report_id": 7}));
        env.metadata.insert("tenant".into(), "a".into());
        let back = Envelope::decode(&env.encode()).unwrap();
        assert_eq!(back, env);
        assert_ne!(Envelope::new("x", serde_json::Value::Null).id, env.id);
    }

    #[test]
    fn rejects_garbage_and_future_versions() {
        assert!(matches!(
            Envelope::decode(b"not json"),
            Err(EnvelopeError::Malformed(_))
        ));
        assert!(matches!(
            Envelope::decode(br#"{"v":1}"#),
            Err(EnvelopeError::Malformed(_))
        ));
        let future = br#"{"v":2,"id":"a","job":"j","payload":null,"dispatched_at_ms":0}"#;
        assert_eq!(
            Envelope::decode(future),
            Err(EnvelopeError::UnsupportedVersion { found: 2 })
        );
    }
}
