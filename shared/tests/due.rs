//! The due time of a delay held in steps (`Envelope::due_ms`), on generated
//! envelopes: writing it in leaves every other field as it was, reading it
//! back gives the rest of the delay, and a step's leg never exceeds the
//! backend's longest delay nor the rest.

#![cfg(not(target_arch = "wasm32"))]

use std::time::Duration;

use jobrail::{
    delay_leg, delay_remaining, due_ms, encode_envelope, with_due, Envelope, UNIX_EPOCH,
};
use proptest::prelude::*;

fn payload() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        // A payload may itself hold a `due_ms` field: it is not the envelope's.
        "[a-z_\"\\\\]{0,12}".prop_map(serde_json::Value::String),
        any::<u64>().prop_map(|n| serde_json::json!({ "due_ms": n })),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    /// A due time written at any instant (not a whole millisecond) is found
    /// due, by a worker reading the clock in whole milliseconds, no sooner
    /// than the delay: at every instant before `now + delay` some delay
    /// remains. (The conformance suite caught a job run 0.4 ms early when
    /// the due time added the delay to the clock rounded down.)
    #[test]
    fn a_due_time_is_never_reached_before_its_delay(
        now_ns in 0u64..u64::MAX / 4,
        delay_ns in 0u64..u64::MAX / 4,
        probe_ns in 0u64..2_000_000,
    ) {
        let now = Duration::from_nanos(now_ns);
        let delay = Duration::from_nanos(delay_ns);
        let due = due_ms(UNIX_EPOCH + now, delay);
        let (_, plain) = encode_envelope("report", &7, &std::collections::BTreeMap::new()).unwrap();
        let body = with_due(&plain, due).unwrap();
        let target = now + delay;
        // Instants around the target, read as a worker reads the clock.
        for at in [target.saturating_sub(Duration::from_nanos(probe_ns)), target + Duration::from_nanos(probe_ns)] {
            let read = u64::try_from(at.as_millis()).unwrap();
            let remaining = delay_remaining(&body, read);
            if at < target {
                prop_assert!(remaining.is_some(), "due {due} found reached at {at:?}, before {target:?}");
            }
            if let Some(rest) = remaining {
                // Waiting the rest out from the reading never ends early.
                prop_assert!(Duration::from_millis(read) + rest >= target);
            }
        }
        prop_assert!(Duration::from_millis(due) < target + Duration::from_millis(1), "at most 1 ms late");
    }

    #[test]
    fn a_due_time_written_in_reads_back_and_changes_nothing_else(
        job in "[a-z-]{1,12}",
        payload in payload(),
        metadata in prop::collection::btree_map("[a-z]{1,6}", "[a-z\"]{0,6}", 0..3),
        due in 1u64..u64::MAX / 2,
        now in 0u64..u64::MAX / 2,
    ) {
        let (_, body) = encode_envelope(&job, &payload, &metadata).unwrap();
        prop_assert_eq!(delay_remaining(&body, now), None, "no due time before it is written");
        let stepped = with_due(&body, due).unwrap();
        let before = Envelope::decode(&body).unwrap();
        let after = Envelope::decode(&stepped).unwrap();
        prop_assert_eq!(after.due_ms, Some(due));
        prop_assert_eq!(Envelope { due_ms: None, ..after }, before);
        let expected = (due > now).then(|| Duration::from_millis(due - now));
        prop_assert_eq!(delay_remaining(&stepped, now), expected);
        // Written once: a second write keeps the first due time.
        prop_assert_eq!(with_due(&stepped, due / 2 + 1).unwrap(), stepped);
    }

    #[test]
    fn a_leg_is_never_longer_than_the_rest_or_the_longest(
        rest_ms in 0u64..10_000_000_000,
        longest_ms in proptest::option::of(1u64..100_000_000),
    ) {
        let rest = Duration::from_millis(rest_ms);
        let longest = longest_ms.map(Duration::from_millis);
        let leg = delay_leg(rest, longest);
        prop_assert!(leg <= rest);
        if let Some(longest) = longest {
            prop_assert!(leg <= longest);
            prop_assert!(leg == rest || leg == longest, "the rest when it fits, else the longest");
            // Steps to the due time: ceil(rest / longest).
            let mut left = rest;
            let mut steps = 0u64;
            while !left.is_zero() {
                left -= delay_leg(left, Some(longest));
                steps += 1;
            }
            prop_assert_eq!(steps, rest_ms.div_ceil(longest.as_millis() as u64));
        } else {
            prop_assert_eq!(leg, rest);
        }
    }
}

#[test]
fn a_body_that_is_no_object_cannot_carry_a_due_time() {
    assert!(with_due(b"[1, 2]", 5).is_none());
    assert!(with_due(b"  ", 5).is_none());
    assert!(
        with_due(b"{\"due_ms\": \"soon\"}", 5).is_none(),
        "a due_ms of the wrong type"
    );
    let empty = with_due(b" {} ", 5).unwrap();
    assert_eq!(empty, b" {\"due_ms\":5} ".to_vec());
}
