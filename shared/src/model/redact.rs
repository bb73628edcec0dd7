//! Decode errors without the payload in them ([`json_error`]).

use serde_json::error::Category;

/// The kinds serde (and serde_json) name an unexpected value by, longest
/// first where one is a prefix of another.
const KINDS: &[&str] = &[
    "boolean",
    "integer",
    "floating point",
    "character",
    "string",
    "byte array",
    "unit value",
    "null",
    "Option value",
    "newtype struct",
    "sequence",
    "map",
    "enum",
    "unit variant",
    "newtype variant",
    "tuple variant",
    "struct variant",
];

/// `err`'s message with every payload value taken out, and its position.
///
/// The result never quotes a value from the input: what remains comes from
/// the target type's schema or from serde_json's fixed syntax messages.
///
/// Why: serde's error messages quote the value they choke on
/// (`invalid type: string "4111 1111 1111 1111", expected u64`), and a decode
/// failure's message travels into the `failed` event, the consumer's log and
/// every sink an operator wires up. Payloads may hold personal data or
/// secrets, so no payload value reaches an event or a log unless the
/// application opts in ([`Registry::events_include_payload`]). The bytes
/// themselves are not lost: the failure record keeps the raw body, and the
/// failure destination is where job data belongs.
///
/// It keeps what serde says about the *schema* (field names,
/// expected types, the allowed variants) and the position, and replaces what
/// it says about the *value* with the value's kind:
///
/// | serde_json says | we say |
/// |---|---|
/// | syntax and end-of-input errors (`expected value`, `EOF while parsing a string`, `trailing characters`, ...) | the same |
/// | ``missing field `x` ``, ``duplicate field `x` `` (names from the type) | the same |
/// | `invalid length 3, expected ...` | the same |
/// | `invalid type: string "...", expected u64` | `invalid type: string, expected u64` |
/// | ``invalid value: integer `-4`, expected u32`` | `invalid value: integer, expected u32` |
/// | ``unknown variant `x`, expected one of ...`` | `unknown variant, expected one of ...` |
/// | ``unknown field `x`, expected one of ...`` | `unknown field, expected one of ...` |
/// | anything else (a custom `Deserialize` error, I/O) | the category only |
///
/// The position (`at line L column C`) is kept where serde_json reports one;
/// a payload decoded from an already parsed JSON value has none.
///
/// [`Registry::events_include_payload`]: crate::Registry::events_include_payload
pub fn json_error(err: &serde_json::Error) -> String {
    redacted(err, true)
}

/// [`json_error`] without the position: a payload decoded from its raw
/// JSON reports the text it reported when it was decoded from a parsed
/// value (which has no position), so failure reasons stay as they were.
pub(crate) fn json_error_unplaced(err: &serde_json::Error) -> String {
    redacted(err, false)
}

fn redacted(err: &serde_json::Error, placed: bool) -> String {
    let full = err.to_string();
    let message = if err.line() == 0 {
        full.as_str()
    } else {
        full.strip_suffix(&format!(" at line {} column {}", err.line(), err.column()))
            .unwrap_or(&full)
    };
    let text = match err.classify() {
        Category::Syntax | Category::Eof => message.to_string(),
        Category::Data => data_error(message),
        Category::Io => "I/O error".to_string(),
    };
    if err.line() == 0 || !placed {
        text
    } else {
        format!("{text} at line {} column {}", err.line(), err.column())
    }
}

/// A data error (the input is valid JSON but does not fit the type).
fn data_error(message: &str) -> String {
    const WITHHELD: &str = "invalid data (detail withheld: it may quote the payload)";
    // The schema's expectation follows the last `, expected `: everything
    // before it may come from the payload, everything after it cannot.
    let expected = message
        .rfind(", expected ")
        .map(|at| &message[at + ", expected ".len()..]);
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        let Some(expected) = expected else {
            return WITHHELD.to_string();
        };
        return format!("invalid type: {}, expected {expected}", kind_of(rest));
    }
    if let Some(rest) = message.strip_prefix("invalid value: ") {
        let Some(expected) = expected else {
            return WITHHELD.to_string();
        };
        return format!("invalid value: {}, expected {expected}", kind_of(rest));
    }
    if let Some(rest) = message.strip_prefix("invalid length ") {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let (false, Some(expected)) = (digits.is_empty(), expected) {
            if rest[digits.len()..].starts_with(", expected ") {
                return format!("invalid length {digits}, expected {expected}");
            }
        }
        return WITHHELD.to_string();
    }
    for what in ["variant", "field"] {
        if message.starts_with(&format!("unknown {what} `")) {
            let none = format!("`, there are no {what}s");
            return match expected {
                Some(expected) => format!("unknown {what}, expected {expected}"),
                None if message.ends_with(&none) => {
                    format!("unknown {what}, there are no {what}s")
                }
                None => WITHHELD.to_string(),
            };
        }
    }
    // `missing_field` and `duplicate_field` take `&'static str` names: they
    // come from the type, never from the input.
    for prefix in ["missing field `", "duplicate field `"] {
        if let Some(name) = message
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix('`'))
        {
            if !name.contains('`') {
                return message.to_string();
            }
        }
    }
    WITHHELD.to_string()
}

/// The kind an `Unexpected` description starts with (`string "x"` -> `string`).
fn kind_of(unexpected: &str) -> &'static str {
    KINDS
        .iter()
        .copied()
        .filter(|kind| {
            unexpected.starts_with(kind)
                && matches!(
                    unexpected.as_bytes().get(kind.len()),
                    None | Some(b' ') | Some(b',')
                )
        })
        .max_by_key(|kind| kind.len())
        .unwrap_or("value")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Report {
        report_id: u64,
        small: Option<u8>,
        mode: Option<Mode>,
        pair: Option<(u32, u32)>,
        flag: Option<bool>,
        letter: Option<char>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    enum Mode {
        Fast,
        Slow,
    }

    #[derive(Debug)]
    struct Custom;

    impl<'de> Deserialize<'de> for Custom {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let s = String::deserialize(d)?;
            Err(serde::de::Error::custom(format!("bad date {s}")))
        }
    }

    fn from_value(v: serde_json::Value) -> String {
        json_error(&serde_json::from_value::<Report>(v).unwrap_err())
    }

    fn from_str<T: serde::de::DeserializeOwned + std::fmt::Debug>(text: &str) -> String {
        json_error(&serde_json::from_str::<T>(text).unwrap_err())
    }

    #[test]
    fn invalid_type_keeps_the_kind_only() {
        let cases = [
            (
                serde_json::json!({"report_id": "hunter2"}),
                "invalid type: string, expected u64",
            ),
            (
                serde_json::json!({"report_id": 1.25}),
                "invalid type: floating point, expected u64",
            ),
            (
                serde_json::json!({"report_id": true}),
                "invalid type: boolean, expected u64",
            ),
            (
                serde_json::json!({"report_id": null}),
                "invalid type: null, expected u64",
            ),
            (
                serde_json::json!({"report_id": [1]}),
                "invalid type: sequence, expected u64",
            ),
            (
                serde_json::json!({"report_id": 1, "flag": "yes, expected bool"}),
                "invalid type: string, expected a boolean",
            ),
            (
                serde_json::json!("hunter2"),
                "invalid type: string, expected struct Report",
            ),
        ];
        for (value, want) in cases {
            assert_eq!(from_value(value.clone()), want, "{value}");
        }
    }

    #[test]
    fn invalid_value_keeps_the_kind_only() {
        assert_eq!(
            from_value(serde_json::json!({"report_id": -31337})),
            "invalid value: integer, expected u64"
        );
        assert_eq!(
            from_value(serde_json::json!({"report_id": 1, "small": 31337})),
            "invalid value: integer, expected u8"
        );
        assert_eq!(
            from_value(serde_json::json!({"report_id": 1, "letter": "xyzzy"})),
            "invalid value: string, expected a character"
        );
    }

    #[test]
    fn schema_names_and_lengths_are_kept() {
        assert_eq!(
            from_value(serde_json::json!({})),
            "missing field `report_id`"
        );
        assert_eq!(
            from_value(serde_json::json!({"report_id": 1, "pair": [1, 2, 3]})),
            "invalid length 3, expected fewer elements in array"
        );
        assert_eq!(
            from_str::<Report>(r#"{"report_id": 1, "report_id": 2}"#),
            "duplicate field `report_id` at line 1 column 28"
        );
    }

    #[test]
    fn payload_chosen_names_are_dropped() {
        assert_eq!(
            from_value(serde_json::json!({"report_id": 1, "mode": "hunter2"})),
            "unknown variant, expected `Fast` or `Slow`"
        );
        assert_eq!(
            from_value(serde_json::json!({"report_id": 1, "hunter2": 0})),
            "unknown field, expected one of `report_id`, `small`, `mode`, `pair`, `flag`, `letter`"
        );
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Empty {}
        assert_eq!(
            from_str::<Empty>(r#"{"hunter2": 1}"#),
            "unknown field, there are no fields at line 1 column 10"
        );
    }

    #[test]
    fn syntax_errors_are_kept_with_their_position() {
        assert_eq!(
            from_str::<Report>("{\"report_id\": hunter2}"),
            "expected value at line 1 column 15"
        );
        assert_eq!(
            from_str::<Report>("{\"report_id\": \"hunt"),
            "EOF while parsing a string at line 1 column 19"
        );
        assert_eq!(
            from_str::<Report>("{\"report_id\": 1} hunter2"),
            "trailing characters at line 1 column 18"
        );
        assert_eq!(
            from_str::<serde_json::Value>("{1: 2}"),
            "key must be a string at line 1 column 2"
        );
    }

    #[test]
    fn data_errors_in_text_keep_their_position() {
        assert_eq!(
            from_str::<Report>("{\"report_id\": \"hunter2\"}"),
            "invalid type: string, expected u64 at line 1 column 23"
        );
    }

    #[test]
    fn custom_errors_say_only_the_category() {
        let msg = from_str::<Custom>("\"hunter2\"");
        assert_eq!(
            msg,
            "invalid data (detail withheld: it may quote the payload)"
        );
        let msg = json_error(
            &serde_json::from_value::<Custom>(serde_json::json!("hunter2")).unwrap_err(),
        );
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    /// Processes `body` through a registry with `Report` registered and
    /// returns the terminal failure's event and record.
    fn process(body: &[u8]) -> (crate::Event, crate::FailureRecord) {
        use std::sync::Arc;
        let job = crate::Job::<Report>::builder("report").build().unwrap();
        let mut registry = crate::Registry::new();
        registry
            .register(&job, |_: crate::JobContext, _: Report| async { Ok(()) })
            .unwrap();
        let runtime: Arc<dyn crate::Runtime> = Arc::new(crate::VirtualRuntime::new());
        let delivery = crate::Incoming {
            queue: "q",
            body,
            attempt: 1,
            shutdown_returns: None,
            deadline: None,
        };
        let processed = futures_executor::block_on(registry.process(
            delivery,
            &runtime,
            &crate::CancelToken::new(),
        ));
        match processed.settlement {
            crate::Settlement::Fail(record) => (processed.event, *record),
            other => panic!("expected a terminal failure, got {other:?}"),
        }
    }

    fn raw_text(record: &crate::FailureRecord) -> String {
        String::from_utf8(record.raw_body.as_ref().expect("raw body kept").to_bytes()).unwrap()
    }

    #[test]
    fn an_undecodable_payload_stays_out_of_the_event() {
        let body =
            crate::Envelope::new("report", serde_json::json!({"report_id": "hunter2"})).encode();
        let (event, record) = process(&body);
        let crate::EventKind::Failed { failure } = &event.kind else {
            panic!("{event:?}")
        };
        assert_eq!(failure.kind, crate::FailureKind::UndecodablePayload);
        assert_eq!(
            failure.message,
            "payload does not decode as job `report`: invalid type: string, expected u64"
        );
        assert!(raw_text(&record).contains("hunter2"));
    }

    #[test]
    fn a_malformed_envelope_stays_out_of_the_event() {
        let body = br#"{"v":1,"id":"a","job":"report","payload":{},"dispatched_at_ms":"hunter2"}"#;
        let (event, record) = process(body);
        let crate::EventKind::Failed { failure } = &event.kind else {
            panic!("{event:?}")
        };
        assert_eq!(failure.kind, crate::FailureKind::MalformedEnvelope);
        assert_eq!(
            failure.message,
            "malformed envelope: invalid type: string, expected u64 at line 1 column 72"
        );
        assert!(raw_text(&record).contains("hunter2"));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::*;
        use proptest::prelude::*;
        use serde_json::json;

        fn envelope(payload: serde_json::Value) -> Vec<u8> {
            crate::Envelope::new("report", payload).encode()
        }

        /// A body that cannot be processed and the secret it carries.
        fn poison() -> impl Strategy<Value = (Vec<u8>, String)> {
            let text = "zq[A-Za-z0-9 _.,:`\\\"-]{6,24}";
            let num = 1_000_000_000u64..1_000_000_000_000_000;
            (0u8..17, text, num).prop_map(|(shape, text, num)| {
                let n = num.to_string();
                let (body, secret) = match shape {
                    0 => (envelope(json!({"report_id": text})), text),
                    1 => (envelope(json!({"report_id": -(num as i64)})), n),
                    2 => (envelope(json!({"report_id": num as f64 + 0.5})), n),
                    3 => (envelope(json!({"report_id": 1, "mode": text})), text),
                    4 => (envelope(json!({"report_id": 1, text.clone(): 0})), text),
                    5 => (envelope(json!({"report_id": 1, "small": num})), n),
                    6 => (envelope(json!(text)), text),
                    7 => (envelope(json!([text])), text),
                    8 => (envelope(json!({"report_id": 1, "flag": text})), text),
                    9 => (envelope(json!({"report_id": 1, "mode": {text.clone(): 1}})), text),
                    10 => (envelope(json!({"report_id": 1, "letter": text})), text),
                    11 => (envelope(json!({"report_id": 1, "pair": [num, 1]})), n),
                    12 => (
                        serde_json::to_vec(&json!({"v": 1, "id": num, "job": "report", "payload": {}, "dispatched_at_ms": 0})).unwrap(),
                        n,
                    ),
                    13 => (
                        serde_json::to_vec(&json!({"v": 1, "id": "a", "job": "report", "payload": {}, "dispatched_at_ms": text})).unwrap(),
                        text,
                    ),
                    14 => (
                        serde_json::to_vec(&json!({"v": 1, "id": "a", "job": "report", "payload": {}, "dispatched_at_ms": 0, "metadata": {"k": num}})).unwrap(),
                        n,
                    ),
                    15 => (
                        serde_json::to_vec(&json!({"v": text, "id": "a"})).unwrap(),
                        text,
                    ),
                    _ => {
                        let mut body = envelope(json!({"report_id": 1}));
                        body.extend_from_slice(format!(" {text}").as_bytes());
                        (body, text)
                    }
                };
                (body, secret)
            })
        }

        proptest! {
            #[test]
            fn no_payload_value_reaches_the_event((body, secret) in poison()) {
                let (event, record) = process(&body);
                let crate::EventKind::Failed { failure } = &event.kind else {
                    panic!("{event:?}")
                };
                prop_assert!(!failure.message.contains(&secret), "{}", failure.message);
                prop_assert!(!record.reason.contains(&secret), "{}", record.reason);
                let event_json = serde_json::to_string(&event).unwrap();
                prop_assert!(!event_json.contains(&secret), "{event_json}");
                let escaped = serde_json::to_string(&secret).unwrap();
                let escaped = &escaped[1..escaped.len() - 1];
                let raw = raw_text(&record);
                prop_assert!(
                    raw.contains(escaped) || raw.contains(&secret),
                    "the record keeps the raw body"
                );
            }
        }
    }
}
