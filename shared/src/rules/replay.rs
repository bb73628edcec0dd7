//! Replaying failure records: the conventions every failure store shares
//! (native [`Failures`](https://docs.rs/jobrail-native) and the edge's
//! failure keeper), so a replayed message reads the same wherever it ran.
//!
//! An entry of a failure store is a [`FailureRecord`], or a body there that
//! is not one. Its id ([`failure_entry_id`]) is the record's own id, or a
//! stable hash of the body for an entry without one. A replay sends the
//! record's envelope again as a new message whose id is [`replay_id`] of the
//! entry id (every replay of one entry sends the same id, so a backend that
//! deduplicates by id drops a second copy) and whose metadata names where it
//! came from: [`REPLAY_OF`], [`REPLAY_OF_MESSAGE`], [`REPLAYED_AT_MS`].
//! Entries that would not run the job again (poison) are refused unless
//! forced; forced, the stored body goes as it is.

use std::fmt;

use crate::model::failure::FailureKind;
use crate::model::record::FailureRecord;

/// Metadata key of a replayed message: the id of the entry it came from.
pub const REPLAY_OF: &str = "replay_of";
/// Metadata key of a replayed message: the original message id.
pub const REPLAY_OF_MESSAGE: &str = "replay_of_message";
/// Metadata key of a replayed message: when it was replayed, in
/// milliseconds since the Unix epoch.
pub const REPLAYED_AT_MS: &str = "replayed_at_ms";

/// The message id a replay of entry `entry_id` gets: derived, so that every
/// replay of one entry sends the same id.
pub fn replay_id(entry_id: &str) -> String {
    format!("replay-{entry_id}")
}

/// The id of a failure-store entry stored as `body`: the record's id when
/// `body` is a record that has one, else `h` and a stable 64-bit hash of
/// `body` (records written before records had ids, bodies that are not
/// records). `record` is `body` decoded, when it decoded.
pub fn failure_entry_id(body: &[u8], record: Option<&FailureRecord>) -> String {
    match record {
        Some(record) if !record.id.is_empty() => record.id.clone(),
        _ => format!("h{:016x}", fnv1a(body)),
    }
}

/// A stable 64-bit FNV-1a hash.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Why replaying an entry would not run its job again, if it would not:
/// the entry is not a record (`None`), the message never decoded, its
/// payload did not decode for its job, or the record keeps no envelope.
/// `None`: replayable.
pub fn poison_reason(record: Option<&FailureRecord>) -> Option<String> {
    let Some(record) = record else {
        return Some("the entry is not a failure record".into());
    };
    if let Some(reason) = truncated_reason(record) {
        return Some(reason);
    }
    match record.kind {
        FailureKind::MalformedEnvelope => {
            Some("poison: the message is not an envelope (malformed)".into())
        }
        FailureKind::UndecodablePayload => Some(format!(
            "poison: the payload did not decode for job `{}`",
            record.job.as_deref().unwrap_or("?")
        )),
        _ if record.envelope.is_none() => Some("the record keeps no envelope".into()),
        _ => None,
    }
}

/// Why a record cut to fit its backend's size limit cannot be replayed,
/// forced or not: it keeps only the first bytes of the message.
fn truncated_reason(record: &FailureRecord) -> Option<String> {
    record.truncated.as_ref().map(|t| {
        format!(
            "the record keeps only the first {} of the message's {} bytes (sha256 {}): it was too \
             large to keep whole, and cannot be sent again",
            t.kept_bytes, t.body_bytes, t.body_sha256
        )
    })
}

/// What a replay sends: the new message's id and body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Replay {
    /// [`replay_id`] of the entry id.
    pub message_id: String,
    /// The encoded envelope (or, forced, the stored body).
    pub body: Vec<u8>,
}

/// A replay refused: the entry is poison and the replay was not forced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRefused {
    /// The entry's id.
    pub entry_id: String,
    /// Why ([`poison_reason`]).
    pub reason: String,
}

impl fmt::Display for ReplayRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "entry `{}` is not replayed: {} (force sends the stored body as it is)",
            self.entry_id, self.reason
        )
    }
}

impl std::error::Error for ReplayRefused {}

/// The message a replay of entry `entry_id` sends at `now_ms`. `record` is
/// the entry's record (if it is one) and `stored` its body as stored. A
/// replayable record's envelope goes with a new id ([`replay_id`]) and the
/// replay metadata; a poison entry is refused unless `force`, and forced
/// sends the original message's bytes (the record's raw body) or, for an
/// entry that is not a record, the stored body. A record cut to fit its
/// backend's limit ([`FailureRecord::truncated`]) is refused even forced.
pub fn replay_message(
    entry_id: &str,
    record: Option<&FailureRecord>,
    stored: &[u8],
    force: bool,
    now_ms: u64,
) -> Result<Replay, ReplayRefused> {
    let message_id = replay_id(entry_id);
    if let Some(reason) = record.and_then(truncated_reason) {
        // Not even forced: the bytes kept are not the message.
        return Err(ReplayRefused {
            entry_id: entry_id.to_string(),
            reason,
        });
    }
    let body = match (poison_reason(record), record) {
        (None, Some(record)) => {
            let mut envelope = record
                .envelope
                .clone()
                .expect("poison_reason checks the envelope");
            envelope
                .metadata
                .insert(REPLAY_OF_MESSAGE.into(), envelope.id.clone());
            envelope
                .metadata
                .insert(REPLAY_OF.into(), entry_id.to_string());
            envelope
                .metadata
                .insert(REPLAYED_AT_MS.into(), now_ms.to_string());
            envelope.id = message_id.clone();
            envelope.encode()
        }
        (Some(reason), _) if !force => {
            return Err(ReplayRefused {
                entry_id: entry_id.to_string(),
                reason,
            })
        }
        (_, Some(record)) => match (&record.raw_body, &record.envelope) {
            (Some(raw), _) => raw.to_bytes(),
            (None, Some(envelope)) => envelope.encode(),
            (None, None) => stored.to_vec(),
        },
        (_, None) => stored.to_vec(),
    };
    Ok(Replay { message_id, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::envelope::Envelope;
    use crate::model::failure::Failure;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn record(kind: FailureKind, envelope: Option<&Envelope>, raw: &[u8]) -> FailureRecord {
        let failure = Failure {
            kind,
            message: "boom".into(),
        };
        FailureRecord::build("q", &failure, 3, 1, envelope, raw)
    }

    #[test]
    fn a_replay_carries_the_entry_and_a_derived_id() {
        let envelope = Envelope::new("job", serde_json::json!({"n": 1}));
        let r = record(FailureKind::AttemptsExhausted, Some(&envelope), b"");
        let id = failure_entry_id(&r.encode(), Some(&r));
        assert_eq!(id, r.id);
        let sent = replay_message(&id, Some(&r), &r.encode(), false, 1234).unwrap();
        assert_eq!(sent.message_id, format!("replay-{id}"));
        let decoded = Envelope::decode(&sent.body).unwrap();
        assert_eq!(decoded.id, sent.message_id);
        assert_eq!(decoded.payload, envelope.payload);
        assert_eq!(decoded.metadata[REPLAY_OF], id);
        assert_eq!(decoded.metadata[REPLAY_OF_MESSAGE], envelope.id);
        assert_eq!(decoded.metadata[REPLAYED_AT_MS], "1234");
    }

    #[test]
    fn a_record_cut_to_fit_is_never_replayed() {
        let payload = "x".repeat(20_000);
        let envelope = Envelope::new("job", serde_json::json!({ "big": payload }));
        let r = record(FailureKind::AttemptsExhausted, Some(&envelope), b"");
        let cut = FailureRecord::decode(&r.encode_within(4096)).unwrap();
        assert!(cut.truncated.is_some());
        for force in [false, true] {
            let refused = replay_message(&cut.id, Some(&cut), &cut.encode(), force, 1).unwrap_err();
            assert!(refused.reason.contains("only the first"), "{refused}");
        }
        assert!(poison_reason(Some(&cut)).unwrap().contains("too large"));
    }

    #[test]
    fn poison_is_refused_unless_forced_then_sent_as_it_came() {
        let r = record(FailureKind::MalformedEnvelope, None, b"{not json");
        let err = replay_message("e", Some(&r), &r.encode(), false, 0).unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
        let sent = replay_message("e", Some(&r), &r.encode(), true, 0).unwrap();
        assert_eq!(sent.body, b"{not json");
        let stray = b"not a record at all";
        let id = failure_entry_id(stray, None);
        assert!(id.starts_with('h') && id.len() == 17, "{id}");
        assert_eq!(id, failure_entry_id(stray, None), "stable");
        assert_ne!(id, failure_entry_id(b"another", None));
        assert!(replay_message(&id, None, stray, false, 0).is_err());
        assert_eq!(
            replay_message(&id, None, stray, true, 0).unwrap().body,
            stray
        );
    }
}
