//! The platform's limits on one message: its size ([`MAX_MESSAGE_BYTES`]),
//! checked before any send, and its delay ([`MAX_DELAY`]), with the
//! rounding of a delay to the whole seconds the platform takes, and the
//! steps that carry a longer dispatch delay ([`prepare_send`]). Pure, so
//! they are tested natively.

use std::time::Duration;

use jobrail::{whole_seconds_up, Envelope};

use crate::error::{EdgeError, EdgeErrorKind};

/// The longest delay Cloudflare accepts for a retry or a delayed send.
///
/// A retry delay is held to it (the wrangler.toml check refuses a job whose
/// backoff goes beyond it). A *dispatch* delay may be longer: the envelope
/// then carries its due time ([`jobrail::Envelope::due_ms`]), the message is
/// sent delayed by this much, and each delivery before the due time is a
/// step, sent on to its queue delayed by the next leg without running the
/// handler or counting an attempt: a delay costs `ceil(delay / 24 h)`
/// messages.
pub const MAX_DELAY: Duration = Duration::from_secs(24 * 60 * 60);

/// The largest message body Cloudflare Queues takes, in bytes (128 KB with
/// 1 KB = 1000 bytes, as the platform's limits page counts it).
///
/// Our messages travel as JSON text, so the serialized size is the UTF-8 length
/// of the envelope's text. Checking it here, before the binding is called,
/// turns an oversized dispatch into a clear error that names the limit and
/// the size, with nothing sent, instead of an exception from the platform
/// whose text varies between `wrangler dev` and production. A body of
/// exactly the limit is accepted.
///
/// The platform also counts up to about 100 bytes of its own metadata
/// towards the limit, so a body within that margin of the limit may still be
/// refused by the platform itself; that refusal reaches the caller as the
/// send's own error.
///
/// The check is pure and shared: the Worker's `EdgeProducer` (wasm32) and
/// the native harness (`jobrail_edge::testing`) both run it.
pub const MAX_MESSAGE_BYTES: usize = 128_000;

/// The largest failure record the consumer sends to its failure queue:
/// [`MAX_MESSAGE_BYTES`] less a margin for the metadata the platform counts
/// too, so a record is never refused for its size. A record that would be
/// larger (a message near the limit, kept whole in its record, is) is cut to
/// fit: the first bytes of the body with its length and SHA-256 digest
/// ([`jobrail::FailureRecord::encode_within`]).
pub const FAILURE_RECORD_BYTES: usize = MAX_MESSAGE_BYTES - 1_000;

/// Refuses a message body above [`MAX_MESSAGE_BYTES`]. The error (kind
/// [`EdgeErrorKind::Unsupported`]) names the limit and the body's size; the
/// body itself stays out of it, as it may hold payload data.
pub(crate) fn check_message_size(body: &str) -> Result<(), EdgeError> {
    let size = body.len();
    if size > MAX_MESSAGE_BYTES {
        return Err(EdgeError::new(
            EdgeErrorKind::Unsupported,
            format!(
                "message of {size} bytes is above the Cloudflare Queues limit of \
                 {MAX_MESSAGE_BYTES} bytes per message (128 KB); nothing was sent"
            ),
        ));
    }
    Ok(())
}

/// An envelope as the text a Queue binding sends, refused if above
/// [`MAX_MESSAGE_BYTES`].
pub(crate) fn envelope_text(envelope: &Envelope) -> Result<String, EdgeError> {
    let text = String::from_utf8(envelope.encode())
        .map_err(|e| EdgeError::caused_by(EdgeErrorKind::Encode, None, e))?;
    check_message_size(&text)?;
    Ok(text)
}

/// A retry or send delay as the platform takes it: whole seconds, rounded
/// up so it is never shortened ([`whole_seconds_up`]). `None` leaves the
/// timing to the consumer's `retry_delay` setting. Above [`MAX_DELAY`] the
/// platform cannot hold the message back: an `Unsupported` error.
pub(crate) fn delay_seconds(delay: Option<Duration>) -> Result<Option<u32>, EdgeError> {
    let Some(delay) = delay else { return Ok(None) };
    if delay > MAX_DELAY {
        return Err(EdgeError::new(
            EdgeErrorKind::Unsupported,
            format!("a delay of {delay:?} exceeds Cloudflare's maximum of 24 hours"),
        ));
    }
    // At most 86,400 once MAX_DELAY is checked.
    Ok(Some(whole_seconds_up(delay) as u32))
}

/// A send as the platform takes it: the body, and the delay of its first
/// leg in whole seconds (`None`: no delay). Within [`MAX_DELAY`] the body
/// is sent as it is, delayed by the platform (rounded up to whole
/// seconds). Beyond it the due time, `now_ms` plus the delay (rounded up to
/// whole milliseconds), is written into the envelope ([`jobrail::with_due`])
/// and the first leg is [`MAX_DELAY`]; a body that is not an envelope cannot
/// carry a due time and is refused ([`EdgeErrorKind::Unsupported`]). The
/// result is held to [`MAX_MESSAGE_BYTES`], due time included. A zero delay
/// is none.
pub(crate) fn prepare_send(
    body: String,
    delay: Option<Duration>,
    now: jobrail::SystemTime,
) -> Result<(String, Option<u32>), EdgeError> {
    let delay = delay.filter(|d| !d.is_zero());
    let body = match delay {
        Some(delay) if delay > MAX_DELAY => {
            let due = jobrail::due_ms(now, delay);
            let with_due = jobrail::with_due(body.as_bytes(), due).ok_or_else(|| {
                EdgeError::new(
                    EdgeErrorKind::Unsupported,
                    format!(
                        "a delay of {delay:?} is longer than the platform holds one message \
                         (24 hours), and a body that is not an envelope cannot carry the due \
                         time that would carry it in steps; nothing was sent"
                    ),
                )
            })?;
            // `with_due` only inserts ASCII into valid UTF-8.
            String::from_utf8(with_due)
                .map_err(|e| EdgeError::caused_by(EdgeErrorKind::Encode, None, e))?
        }
        _ => body,
    };
    check_message_size(&body)?;
    let seconds = delay.map(|d| jobrail::delay_leg(d, Some(MAX_DELAY)));
    Ok((body, delay_seconds(seconds)?))
}

/// The next leg of a delay that has `remaining` to go, as the platform
/// takes it: at most [`MAX_DELAY`], in whole seconds, rounded up (never
/// early), at least one.
pub(crate) fn leg_seconds(remaining: Duration) -> u32 {
    let leg = jobrail::delay_leg(remaining, Some(MAX_DELAY));
    // At most 86,400.
    (whole_seconds_up(leg) as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ms` milliseconds after the Unix epoch.
    fn at(ms: u64) -> jobrail::SystemTime {
        jobrail::UNIX_EPOCH + Duration::from_millis(ms)
    }

    /// An envelope whose text is exactly `size` bytes (an ASCII string payload).
    fn envelope_of(size: usize) -> Envelope {
        let mut envelope = Envelope::new("sized", serde_json::Value::String(String::new()));
        let overhead = envelope.encode().len();
        envelope.payload = serde_json::Value::String("x".repeat(size - overhead));
        assert_eq!(envelope.encode().len(), size);
        envelope
    }

    #[test]
    fn a_body_at_the_limit_is_accepted() {
        check_message_size(&"a".repeat(MAX_MESSAGE_BYTES)).unwrap();
        let text = envelope_text(&envelope_of(MAX_MESSAGE_BYTES)).unwrap();
        assert_eq!(text.len(), MAX_MESSAGE_BYTES);
    }

    #[test]
    fn a_body_one_byte_above_the_limit_is_refused_naming_the_limit_and_the_size() {
        let err = envelope_text(&envelope_of(MAX_MESSAGE_BYTES + 1)).unwrap_err();
        assert_eq!(err.kind, EdgeErrorKind::Unsupported);
        let text = err.to_string();
        assert!(text.contains("128001 bytes"), "{text}");
        assert!(text.contains("limit of 128000 bytes"), "{text}");
        assert!(
            !text.contains("xxxx"),
            "the body stays out of the error: {text}"
        );
    }

    #[test]
    fn the_size_is_counted_in_utf8_bytes_not_characters() {
        // 'é' is two bytes: 64,001 of them are 128,002 bytes.
        let body = "é".repeat(MAX_MESSAGE_BYTES / 2 + 1);
        assert_eq!(body.chars().count(), MAX_MESSAGE_BYTES / 2 + 1);
        let err = check_message_size(&body).unwrap_err();
        assert!(err.to_string().contains("128002 bytes"), "{err}");
        check_message_size(&"é".repeat(MAX_MESSAGE_BYTES / 2)).unwrap();
    }

    #[test]
    fn delays_up_to_24_hours_in_whole_seconds() {
        assert_eq!(delay_seconds(None).unwrap(), None);
        assert_eq!(
            delay_seconds(Some(Duration::from_millis(2500))).unwrap(),
            Some(3)
        );
        assert_eq!(delay_seconds(Some(MAX_DELAY)).unwrap(), Some(86_400));
        let err = delay_seconds(Some(MAX_DELAY + Duration::from_millis(1))).unwrap_err();
        assert_eq!(err.kind, EdgeErrorKind::Unsupported);
        assert!(err.to_string().contains("24 hours"));
    }

    fn body() -> String {
        let envelope = Envelope::new("report", serde_json::json!(7));
        String::from_utf8(envelope.encode()).unwrap()
    }

    #[test]
    fn a_delay_within_24_hours_is_the_platforms_own() {
        let text = body();
        let (sent, seconds) = prepare_send(text.clone(), Some(MAX_DELAY), at(1_000)).unwrap();
        assert_eq!(sent, text, "no due time written");
        assert_eq!(seconds, Some(86_400));
        let (sent, seconds) = prepare_send(text.clone(), Some(Duration::ZERO), at(1_000)).unwrap();
        assert_eq!((sent, seconds), (text.clone(), None));
        let (_, seconds) = prepare_send(text, Some(Duration::from_millis(1_500)), at(0)).unwrap();
        assert_eq!(seconds, Some(2));
    }

    #[test]
    fn a_longer_delay_carries_its_due_time_and_sends_the_first_leg() {
        let day = MAX_DELAY;
        let (sent, seconds) = prepare_send(body(), Some(3 * day), at(1_000)).unwrap();
        assert_eq!(seconds, Some(86_400));
        let envelope = Envelope::decode(sent.as_bytes()).unwrap();
        assert_eq!(envelope.due_ms, Some(1_000 + 3 * 86_400_000));
        assert_eq!(
            jobrail::delay_remaining(sent.as_bytes(), 1_000 + 86_400_000),
            Some(2 * day)
        );
        // Rounded up to whole milliseconds, never early.
        let (sent, _) = prepare_send(body(), Some(day + Duration::from_nanos(1)), at(0)).unwrap();
        let envelope = Envelope::decode(sent.as_bytes()).unwrap();
        assert_eq!(envelope.due_ms, Some(86_400_001));
    }

    #[test]
    fn a_body_that_is_not_an_envelope_cannot_be_delayed_beyond_24_hours() {
        let err = prepare_send("raw text".into(), Some(2 * MAX_DELAY), at(0)).unwrap_err();
        assert_eq!(err.kind, EdgeErrorKind::Unsupported);
        assert!(err.to_string().contains("due time"), "{err}");
        let (sent, seconds) = prepare_send("raw text".into(), Some(MAX_DELAY), at(0)).unwrap();
        assert_eq!((sent.as_str(), seconds), ("raw text", Some(86_400)));
    }

    #[test]
    fn the_due_time_counts_towards_the_size_limit() {
        let at_limit = String::from_utf8(envelope_of(MAX_MESSAGE_BYTES).encode()).unwrap();
        prepare_send(at_limit.clone(), Some(MAX_DELAY), at(0)).unwrap();
        let err = prepare_send(at_limit, Some(2 * MAX_DELAY), at(0)).unwrap_err();
        assert!(err.to_string().contains("limit of 128000 bytes"), "{err}");
    }

    #[test]
    fn legs_are_at_most_a_day_in_whole_seconds() {
        assert_eq!(leg_seconds(3 * MAX_DELAY), 86_400);
        assert_eq!(leg_seconds(Duration::from_millis(1_001)), 2);
        assert_eq!(leg_seconds(Duration::from_millis(1)), 1);
    }
}
