//! The platform's limits on one message: its size ([`MAX_MESSAGE_BYTES`]),
//! checked before any send, and its delay ([`MAX_DELAY`]), with the
//! rounding of a delay to the whole seconds the platform takes. Pure, so
//! they are tested natively.

use std::time::Duration;

use jobrail::{whole_seconds_up, Envelope};

use crate::error::{EdgeError, EdgeErrorKind};

/// The longest delay Cloudflare accepts for a retry or a delayed send.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
