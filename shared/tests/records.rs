//! Failure records always fit where they are kept
//! (`FailureRecord::encode_within`), on generated bodies, failures and
//! limits: whole when the record fits, otherwise cut, keeping a prefix of
//! the body byte for byte with the body's length and digest; raw bodies
//! take the shorter of text and base64.

#![cfg(not(target_arch = "wasm32"))]

use jobrail::{Envelope, Failure, FailureKind, FailureRecord, RawBody};
use proptest::prelude::*;
use sha2::Digest as _;

fn sha256(bytes: &[u8]) -> String {
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Bodies of every shape: binary, plain text, text full of characters JSON
/// escapes, text with a stray byte that is not UTF-8, and long ones.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..3000),
        "[ -~]{0,3000}".prop_map(String::into_bytes),
        "[\\x00-\\x1f\"\\\\a-z]{0,3000}".prop_map(String::into_bytes),
        ("[a-z]{0,1500}", any::<u8>(), "[a-z]{0,1500}").prop_map(|(a, b, c)| {
            let mut v = a.into_bytes();
            v.push(b | 0x80);
            v.extend(c.into_bytes());
            v
        }),
        (1usize..200_000).prop_map(|n| (0..n).map(|i| b'a' + (i % 26) as u8).collect()),
    ]
}

/// A record as the registry builds one: of a malformed body (raw body
/// kept), or of a job's envelope holding `body` as its payload text.
fn record(body: &[u8], malformed: bool, reason: usize) -> (FailureRecord, Vec<u8>) {
    let failure = Failure {
        kind: if malformed {
            FailureKind::MalformedEnvelope
        } else {
            FailureKind::Permanent
        },
        message: "r".repeat(reason),
    };
    if malformed {
        let record = FailureRecord::build("q", &failure, 2, 1, None, body);
        return (record, body.to_vec());
    }
    let text = String::from_utf8_lossy(body).into_owned();
    let envelope = Envelope::new("job", serde_json::json!({ "text": text }));
    let record = FailureRecord::build("q", &failure, 2, 1, Some(&envelope), b"");
    (record, envelope.encode())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn a_record_always_fits_and_keeps_what_it_can(
        body in body(),
        malformed in any::<bool>(),
        reason in prop_oneof![0usize..100, 20_000usize..40_000],
        limit in prop_oneof![2048usize..4096, 4096usize..300_000],
    ) {
        let (record, kept_as) = record(&body, malformed, reason);
        let whole = record.encode();
        let encoded = record.encode_within(limit);
        prop_assert!(encoded.len() <= limit, "{} bytes over the limit {limit}", encoded.len());
        let read = FailureRecord::decode(&encoded).unwrap();
        if whole.len() <= limit {
            prop_assert_eq!(&read, &record, "a record that fits is kept whole");
            prop_assert!(read.truncated.is_none());
        } else {
            let t = read.truncated.clone().expect("a record that does not fit says it was cut");
            prop_assert_eq!(t.body_bytes, kept_as.len() as u64);
            prop_assert_eq!(&t.body_sha256, &sha256(&kept_as));
            prop_assert_eq!(t.record_bytes, whole.len() as u64);
            prop_assert_eq!(t.limit_bytes, limit as u64);
            let prefix = read.raw_body.as_ref().expect("the prefix").to_bytes();
            prop_assert_eq!(prefix.len() as u64, t.kept_bytes);
            prop_assert_eq!(&prefix[..], &kept_as[..prefix.len()]);
            prop_assert!(read.envelope.is_none());
            prop_assert!(read.reason.len() <= jobrail::TRUNCATED_REASON_BYTES);
            prop_assert_eq!(
                (read.kind, read.attempt, read.executions, &read.queue, &read.id),
                (record.kind, record.attempt, record.executions, &record.queue, &record.id)
            );
            // Little room wasted: the prefix keeps at least what base64
            // would in the room the rest of the record leaves (less what
            // measuring with the longest number, 20 digits for
            // `kept_bytes`, and the longer encoding tag leave).
            let raw_json = serde_json::to_string(read.raw_body.as_ref().unwrap()).unwrap().len();
            let room = limit.saturating_sub(encoded.len() - raw_json + 32 + 31);
            prop_assert!(
                prefix.len() >= kept_as.len().min(room / 4 * 3),
                "{} of {limit} bytes used, {} of {} body bytes kept", encoded.len(), prefix.len(), kept_as.len()
            );
        }
    }

    #[test]
    fn raw_bodies_round_trip_in_the_shorter_encoding(body in body()) {
        let raw = RawBody::from_bytes(&body);
        prop_assert_eq!(raw.to_bytes(), body.clone());
        let json = serde_json::to_string(&raw).unwrap();
        let base64 = body.len().div_ceil(3) * 4;
        // `{"encoding":"base64","data":""}` is 31 bytes around the data.
        prop_assert!(json.len() <= base64 + 31, "{} bytes for {} of body", json.len(), body.len());
        if let Ok(text) = std::str::from_utf8(&body) {
            let as_text = serde_json::to_string(text).unwrap().len() - 2;
            prop_assert!(json.len() <= as_text.min(base64) + 31);
        }
    }
}

/// A body at the edge of fitting: the largest that keeps its record whole,
/// and one byte more, which is cut.
#[test]
fn the_threshold_between_whole_and_cut() {
    let limit = 10_000;
    let at = |n: usize| record(&vec![b'x'; n], true, 10).0;
    let mut n = 0;
    while at(n + 1).encode().len() <= limit {
        n += 1;
    }
    let whole = FailureRecord::decode(&at(n).encode_within(limit)).unwrap();
    assert!(whole.truncated.is_none());
    assert_eq!(whole.raw_body.unwrap().to_bytes().len(), n);
    let cut = FailureRecord::decode(&at(n + 1).encode_within(limit)).unwrap();
    let t = cut.truncated.expect("one byte more is cut");
    assert_eq!(t.body_bytes, n as u64 + 1);
    assert!(t.kept_bytes < n as u64 + 1 && t.kept_bytes > (n as u64) * 9 / 10);
}
