//! The envelope and payload decoders under arbitrary bytes, through the
//! pipeline a host uses: no panic, one settlement, and a terminal failure
//! that keeps the message unless the bytes are a valid envelope (see
//! `support/delivery_oracle.rs` for the rule). Arbitrary byte strings, then
//! structured near-misses: envelopes with fields of the wrong type, numbers
//! out of range, deep nesting, invalid UTF-8, truncation, payloads that do
//! not fit the job's type. The fuzz target in `fuzz/` runs the same check.

#![cfg(not(target_arch = "wasm32"))]

#[path = "support/delivery_oracle.rs"]
mod oracle;

use std::collections::BTreeMap;

use jobrail::FailureKind;
use oracle::{Ending, Pipeline, JOB};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{json, Value};

const CASES: u32 = 2_500;

thread_local! {
    static PIPELINE: Pipeline = Pipeline::new();
}

fn check(body: &[u8]) {
    PIPELINE.with(|p| p.check(body));
}

/// A JSON value nested `depth` deep in arrays or objects.
fn nested(depth: usize, objects: bool) -> String {
    let (open, close) = if objects {
        ("{\"a\":", "}")
    } else {
        ("[", "]")
    };
    format!("{}1{}", open.repeat(depth), close.repeat(depth))
}

/// Values of every JSON type, including awkward numbers and big strings.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A field's text: valid for the envelope, or a near miss.
fn field(valid: BoxedStrategy<String>) -> BoxedStrategy<Option<String>> {
    prop_oneof![
        24 => valid.prop_map(Some),
        1 => Just(None), // missing
        1 => any_value().prop_map(|v| Some(v.to_string())),
        1 => Just(Some("1e400".to_string())),
        1 => Just(Some("-1".to_string())),
        1 => Just(Some("18446744073709551616".to_string())),
        1 => Just(Some("0.5".to_string())),
    ]
    .boxed()
}

fn payload() -> BoxedStrategy<String> {
    let order = (
        any::<u64>(),
        prop::collection::vec(".{0,12}", 0..4),
        prop::option::of(".{0,12}"),
    )
        .prop_map(|(id, items, note)| {
            json!({ "id": id, "items": items, "note": note }).to_string()
        });
    prop_oneof![
        4 => order,
        // Not the job's type.
        1 => any_value().prop_map(|v| v.to_string()),
        1 => (any::<i64>(), any_value()).prop_map(|(id, items)| json!({ "id": id, "items": items }).to_string()),
        1 => Just(r#"{"id":1e400,"items":[]}"#.to_string()),
        1 => Just(r#"{"id":-1,"items":[]}"#.to_string()),
        1 => Just(r#"{"id":18446744073709551616,"items":[]}"#.to_string()),
        1 => (1usize..400, any::<bool>()).prop_map(|(d, o)| format!(r#"{{"id":1,"items":[],"note":{}}}"#, nested(d, o))),
        1 => (1usize..400, any::<bool>()).prop_map(|(d, o)| nested(d, o)),
    ]
    .boxed()
}

/// An envelope as JSON text with each field valid or a near miss, fields in
/// any order, possibly a duplicate or an extra field.
fn envelope_text() -> impl Strategy<Value = String> {
    let version = prop_oneof![8 => Just("1".to_string()), 1 => Just("0".to_string()), 1 => Just("2".to_string())].boxed();
    let id = "[0-9a-f-]{0,36}".prop_map(|s| json!(s).to_string()).boxed();
    let job = prop_oneof![6 => Just(JOB.to_string()), 1 => Just("ORDER".to_string()), 1 => "[a-z-]{0,12}".prop_map(String::from)]
        .prop_map(|s| json!(s).to_string())
        .boxed();
    let time = any::<u64>().prop_map(|n| n.to_string()).boxed();
    let metadata = prop::collection::btree_map("[a-z]{1,5}", ".{0,8}", 0..3)
        .prop_map(|m| json!(m).to_string())
        .boxed();
    (
        field(version),
        field(id),
        field(job),
        field(payload()),
        field(time),
        field(metadata),
        any::<u64>(),
        prop::option::of(("[a-z_]{1,10}", any_value())),
    )
        .prop_map(|(v, id, job, payload, time, metadata, order, extra)| {
            let mut fields: Vec<String> = [
                ("v", v),
                ("id", id),
                ("job", job),
                ("payload", payload),
                ("dispatched_at_ms", time),
                ("metadata", metadata),
            ]
            .into_iter()
            .filter_map(|(name, value)| value.map(|value| format!("{name:?}:{value}")))
            .collect();
            if let Some((name, value)) = extra {
                fields.push(format!("{name:?}:{value}"));
            }
            // A few field orders.
            let shift = (order % fields.len().max(1) as u64) as usize;
            fields.rotate_left(shift);
            format!("{{{}}}", fields.join(","))
        })
}

/// How an envelope's bytes are damaged: not at all, truncated, a byte
/// replaced with one that is not UTF-8, or a byte flipped.
fn damaged() -> impl Strategy<Value = Vec<u8>> {
    (
        envelope_text(),
        0u8..6,
        any::<prop::sample::Index>(),
        any::<u8>(),
    )
        .prop_map(|(text, how, at, byte)| {
            let mut bytes = text.into_bytes();
            let i = at
                .index(bytes.len().max(1))
                .min(bytes.len().saturating_sub(1));
            match how {
                0 if !bytes.is_empty() => bytes.truncate(i),
                1 if !bytes.is_empty() => bytes[i] = 0xff,
                2 if !bytes.is_empty() => bytes[i] ^= byte | 1,
                3 => bytes.splice(i..i, [0xc3, 0x28]).for_each(drop),
                _ => {}
            }
            bytes
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_fail_once_keeping_the_body(body in prop::collection::vec(any::<u8>(), 0..600)) {
        check(&body);
    }

    #[test]
    fn near_miss_envelopes_end_by_the_rule(body in envelope_text()) {
        check(body.as_bytes());
    }

    #[test]
    fn damaged_envelopes_end_by_the_rule(body in damaged()) {
        check(&body);
    }

    /// A crash report ([`jobrail::Registry::settle_crashed`]) settles a body
    /// it cannot run as delivering it would, on any delivery, the
    /// unknown-name cap included.
    #[test]
    fn crash_reports_settle_unrunnable_bodies_as_delivery_does(
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..200),
            envelope_text().prop_map(String::into_bytes),
            damaged(),
        ],
        attempt in prop_oneof![1u32..=12, Just(0), Just(u32::MAX)],
    ) {
        PIPELINE.with(|p| p.check_crashed(&body, attempt));
    }
}

/// The crash-report property above reaches the bodies it is about: a
/// malformed envelope, an unknown name below and at its cap.
#[test]
fn crash_reports_of_each_unrunnable_kind() {
    let unknown = |attempt| {
        format!(r#"{{"v":1,"id":"m-{attempt}","job":"stranger","payload":1,"dispatched_at_ms":0}}"#)
    };
    PIPELINE.with(|p| {
        p.check_crashed(b"not an envelope", 1);
        p.check_crashed(&[0xff, 0xfe, 0x00], 4);
        for attempt in [1, 9, 10, 11] {
            p.check_crashed(unknown(attempt).as_bytes(), attempt);
        }
    });
}

/// The structured strategies reach every ending, so the properties above
/// are not vacuous: valid envelopes run, unknown names are retried, payloads
/// that do not fit and malformed envelopes fail.
#[test]
fn the_near_misses_reach_every_ending() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop_oneof![envelope_text().prop_map(String::into_bytes), damaged()];
    let mut seen = BTreeMap::new();
    for _ in 0..CASES {
        let body = strategy.new_tree(&mut runner).unwrap().current();
        let ending = PIPELINE.with(|p| p.check(&body));
        *seen.entry(format!("{ending:?}")).or_insert(0u32) += 1;
    }
    println!("{CASES} near-miss bodies: {seen:?}");
    for ending in [
        Ending::Ran,
        Ending::UnknownName,
        Ending::Failed(FailureKind::UndecodablePayload),
        Ending::Failed(FailureKind::MalformedEnvelope),
    ] {
        assert!(
            seen.contains_key(&format!("{ending:?}")),
            "{ending:?} never reached: {seen:?}"
        );
    }
}

/// Deeper than serde_json's recursion limit: a clean failure, not a stack
/// overflow, in the envelope and in the payload.
#[test]
fn nesting_beyond_the_parsers_limit_fails_cleanly() {
    for depth in [127, 128, 129, 10_000] {
        for objects in [false, true] {
            let deep = nested(depth, objects);
            check(deep.as_bytes());
            let envelope = format!(
                r#"{{"v":1,"id":"x","job":"{JOB}","payload":{deep},"dispatched_at_ms":0}}"#
            );
            check(envelope.as_bytes());
        }
    }
}
