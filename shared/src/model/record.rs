//! Failure records ([`FailureRecord`]) and how one is kept within a
//! backend's size limit ([`FailureRecord::encode_within`]).
//!
//! Why a limit: a record keeps the message it failed (its envelope, or its
//! raw body), so a message near the backend's own size limit makes a record
//! over it. A backend that refuses the record refuses the settlement, and
//! the message comes back at every lease to be refused again, each time
//! costing a full parse and encode. So a record always fits where it is
//! kept: whole when it fits, otherwise the first bytes of the body with its
//! length and SHA-256 digest ([`Truncation`]), saying so in the record.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use crate::model::envelope::{new_message_id, Envelope};
use crate::model::failure::{Failure, FailureKind};
use crate::model::runtime::{SystemTime, UNIX_EPOCH};

/// The format version of failure records.
pub(crate) const FAILURE_RECORD_VERSION: u32 = 1;

/// The longest `reason` a record cut to fit keeps, in bytes.
pub const TRUNCATED_REASON_BYTES: usize = 16 * 1024;
/// The longest `job` and `message_id` a record cut to fit keeps, in bytes.
pub const TRUNCATED_NAME_BYTES: usize = 1024;

/// A terminal failure, as published to a failure destination.
///
/// A record keeps enough to investigate and replay by hand: the envelope when
/// it decoded, the raw body when it did not (poison), the reason, and how
/// many deliveries and executions the message consumed. Records can hold job
/// data and unsanitised error text: protect the destination accordingly.
///
/// A record too large for where it is kept is cut to fit
/// ([`encode_within`](Self::encode_within)): then `truncated` says so, the
/// envelope is left out, and `raw_body` holds the first bytes of the body.
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
    /// The raw body, for messages that did not decode (as text where that
    /// is no longer than base64, else base64). In a record cut to fit, the
    /// body's first [`Truncation::kept_bytes`] bytes.
    pub raw_body: Option<RawBody>,
    /// Set when the record was too large for where it is kept and was cut
    /// to fit: what the whole body was. `None`: the record is whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<Truncation>,
}

/// What a record cut to fit ([`FailureRecord::encode_within`]) says of the
/// body it could not keep whole. The body is the raw message body when the
/// record kept one, else the envelope as encoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Truncation {
    /// The whole body's length, in bytes.
    pub body_bytes: u64,
    /// The SHA-256 digest of the whole body, lowercase hex.
    pub body_sha256: String,
    /// How many leading bytes of the body `raw_body` keeps.
    pub kept_bytes: u64,
    /// The whole record's length, in bytes.
    pub record_bytes: u64,
    /// The limit, in bytes, of where the record is kept.
    pub limit_bytes: u64,
}

/// A message body that could not be decoded, kept byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "encoding", content = "data", rename_all = "snake_case")]
pub enum RawBody {
    /// The body was valid UTF-8 (and as JSON text no longer than base64).
    Utf8(String),
    /// Standard base64 with padding: a body that is not UTF-8, or whose
    /// text would grow more than base64 does when escaped for JSON.
    Base64(String),
    /// Lowercase hex: how records written before base64 kept bodies that
    /// were not UTF-8 (read, never written).
    Hex(String),
}

impl RawBody {
    /// Keeps `bytes` losslessly, in the shorter of the two encodings.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) if json_text_len(text) <= base64_len(bytes.len()) => {
                RawBody::Utf8(text.to_string())
            }
            _ => RawBody::Base64(base64::engine::general_purpose::STANDARD.encode(bytes)),
        }
    }

    /// The original bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            RawBody::Utf8(text) => text.as_bytes().to_vec(),
            RawBody::Base64(data) => base64::engine::general_purpose::STANDARD
                .decode(data)
                .unwrap_or_default(),
            RawBody::Hex(hex) => (0..hex.len() / 2)
                .filter_map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
                .collect(),
        }
    }
}

/// The length of base64 with padding of `n` bytes.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3).saturating_mul(4)
}

/// How many bytes `c` takes inside a JSON string, as serde_json writes it.
fn json_char_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

/// How many bytes `text` takes inside a JSON string (without the quotes).
fn json_text_len(text: &str) -> usize {
    text.chars().map(json_char_len).sum()
}

/// `text`, cut to at most `max` bytes at a character boundary.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The longest prefix of `body` kept as a [`RawBody`] in at most `room`
/// bytes of JSON string: as text (up to the first byte that is not UTF-8)
/// or as base64, whichever keeps more; and how many bytes it keeps.
fn prefix_within(body: &[u8], room: usize) -> (RawBody, usize) {
    let text = match std::str::from_utf8(body) {
        Ok(text) => text,
        // Valid up to the error, by construction.
        Err(e) => std::str::from_utf8(&body[..e.valid_up_to()]).unwrap_or_default(),
    };
    let mut used = 0;
    let mut text_bytes = 0;
    for c in text.chars() {
        let len = json_char_len(c);
        if used + len > room {
            break;
        }
        used += len;
        text_bytes += c.len_utf8();
    }
    let b64_bytes = (room / 4 * 3).min(body.len());
    if text_bytes >= b64_bytes {
        (RawBody::Utf8(text[..text_bytes].to_string()), text_bytes)
    } else {
        let data = base64::engine::general_purpose::STANDARD.encode(&body[..b64_bytes]);
        (RawBody::Base64(data), b64_bytes)
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
            truncated: None,
        }
    }

    /// Serializes to JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a failure record always serializes")
    }

    /// Serializes to JSON bytes of at most `limit` bytes: the whole record
    /// when it fits, otherwise the record cut to fit: the envelope left out,
    /// the reason, job and message id shortened to
    /// [`TRUNCATED_REASON_BYTES`] and [`TRUNCATED_NAME_BYTES`] (or a quarter
    /// and a sixteenth of the limit, if less), and `raw_body` the longest
    /// prefix of the body that fits (the raw body, or the envelope as
    /// encoded), with its length and SHA-256 digest in
    /// [`truncated`](Self::truncated). Every host encodes records this way
    /// with the limit of where it keeps them, so a record is never refused
    /// for its size.
    pub fn encode_within(&self, limit: usize) -> Vec<u8> {
        let whole = self.encode();
        if whole.len() <= limit {
            return whole;
        }
        self.fitted(limit, whole.len()).encode()
    }

    /// This record cut to fit in `limit` bytes (its whole encoding being
    /// `whole_len` bytes): the envelope left out, the reason, job and
    /// message id shortened to [`TRUNCATED_REASON_BYTES`] and
    /// [`TRUNCATED_NAME_BYTES`] (or a quarter and a sixteenth of the limit,
    /// if less), and `raw_body` the longest prefix of the
    /// body that fits (the raw body, or the envelope as encoded), with its
    /// length and digest in `truncated`. A limit too small for even that
    /// leaves an empty prefix.
    fn fitted(&self, limit: usize, whole_len: usize) -> FailureRecord {
        let body = match (&self.raw_body, &self.envelope) {
            (Some(raw), _) => raw.to_bytes(),
            (None, Some(envelope)) => envelope.encode(),
            (None, None) => Vec::new(),
        };
        let digest = sha2::Sha256::digest(&body);
        // The texts get a share of the limit too, so a small limit still
        // leaves room for the rest.
        let names = TRUNCATED_NAME_BYTES.min(limit / 16);
        let mut fitted = FailureRecord {
            message_id: self.message_id.as_deref().map(|id| cut(id, names)),
            job: self.job.as_deref().map(|job| cut(job, names)),
            reason: cut(&self.reason, TRUNCATED_REASON_BYTES.min(limit / 4)),
            envelope: None,
            raw_body: Some(RawBody::Base64(String::new())),
            truncated: Some(Truncation {
                body_bytes: body.len() as u64,
                body_sha256: digest.iter().map(|b| format!("{b:02x}")).collect(),
                // Its longest value while measuring.
                kept_bytes: u64::MAX,
                record_bytes: whole_len as u64,
                limit_bytes: limit as u64,
            }),
            ..self.clone()
        };
        let frame = fitted.encode().len();
        let (prefix, kept) = prefix_within(&body, limit.saturating_sub(frame));
        fitted.raw_body = Some(prefix);
        if let Some(truncation) = &mut fitted.truncated {
            truncation.kept_bytes = kept as u64;
        }
        fitted
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
        for bytes in [
            &b"{not json"[..],
            &[0xff, 0x00, 0x10][..],
            &b"\x01\x02\x03"[..],
        ] {
            assert_eq!(RawBody::from_bytes(bytes).to_bytes(), bytes);
        }
        // Hex, as older records kept bodies, still reads.
        assert_eq!(RawBody::Hex("ff0010".into()).to_bytes(), [0xff, 0x00, 0x10]);
    }

    #[test]
    fn raw_bodies_take_the_shorter_encoding() {
        assert!(matches!(
            RawBody::from_bytes(b"plain text"),
            RawBody::Utf8(_)
        ));
        // Not UTF-8: base64, a third larger (hex was twice as large).
        let binary = vec![0xffu8; 3000];
        match RawBody::from_bytes(&binary) {
            RawBody::Base64(data) => assert_eq!(data.len(), 4000),
            other => panic!("{other:?}"),
        }
        // Control characters escape to six bytes each in JSON: base64 is
        // shorter.
        assert!(matches!(
            RawBody::from_bytes(&[1u8; 30]),
            RawBody::Base64(_)
        ));
    }

    fn poison(body: &[u8]) -> FailureRecord {
        let failure = Failure {
            kind: FailureKind::MalformedEnvelope,
            message: "not an envelope".into(),
        };
        FailureRecord::build("q", &failure, 1, 0, None, body)
    }

    #[test]
    fn a_record_that_fits_is_kept_whole() {
        let record = poison(b"small body");
        let whole = record.encode();
        assert_eq!(record.encode_within(whole.len()), whole);
        assert_eq!(FailureRecord::decode(&whole).unwrap(), record);
    }

    #[test]
    fn a_record_too_large_keeps_a_prefix_its_length_and_digest() {
        let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let record = poison(&body);
        for limit in [4096, 65_536, 128_000, 262_080] {
            let encoded = record.encode_within(limit);
            assert!(encoded.len() <= limit, "{} > {limit}", encoded.len());
            let cut = FailureRecord::decode(&encoded).unwrap();
            let t = cut.truncated.clone().expect("cut");
            assert_eq!(t.body_bytes, 200_000);
            assert_eq!(t.limit_bytes, limit as u64);
            let kept = cut.raw_body.unwrap().to_bytes();
            assert_eq!(kept.len() as u64, t.kept_bytes);
            assert_eq!(kept, body[..kept.len()]);
            assert!(kept.len() > limit / 2, "{} of {limit}", kept.len());
            let digest: String = sha2::Sha256::digest(&body)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(t.body_sha256, digest);
            assert_eq!((cut.kind, cut.attempt), (record.kind, record.attempt));
        }
    }
}
