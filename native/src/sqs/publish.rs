//! Sending a message: dispatch (with its delay), and the `SendMessage`
//! that a graceful shutdown's copy and a failure record's transfer share.
//! Also the body encoding both directions use.

use aws_sdk_sqs::types::MessageAttributeValue;
use tracing::warn;

use super::connection::bounded;
use super::errors::{error, is_missing_queue, sdk_error};
use super::topology::Role;
use super::{SqsDriver, ENCODING_ATTRIBUTE, MAX_DELAY_SECONDS, NAME};
use crate::driver::{DriverError, ErrorKind, Outgoing};
use crate::support::failed;

/// A body as SQS message text, and whether it had to be base64-encoded.
fn encode_body(body: &[u8]) -> (String, bool) {
    let allowed = |c: char| matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..);
    match std::str::from_utf8(body) {
        Ok(text) if !text.is_empty() && text.chars().all(allowed) => (text.to_string(), false),
        _ => (aws_smithy_types::base64::encode(body), true),
    }
}

/// The original bytes of a received body.
pub(super) fn decode_body(text: &str, base64: bool) -> Vec<u8> {
    if base64 {
        match aws_smithy_types::base64::decode(text) {
            Ok(bytes) => return bytes,
            Err(e) => warn!("a body marked base64 does not decode ({e}); passing it on as is"),
        }
    }
    text.as_bytes().to_vec()
}

impl SqsDriver {
    /// Stores `message` on the work queue `queue` (resolving or creating
    /// it), its delay rounded up to whole seconds.
    pub(super) async fn dispatch(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let delay_seconds = message.delay.map(jobrail::whole_seconds_up).unwrap_or(0);
        if delay_seconds > MAX_DELAY_SECONDS {
            return Err(error(
                ErrorKind::Unsupported,
                format!(
                    "dispatch delay {:?} exceeds SQS's maximum of {MAX_DELAY_SECONDS} s",
                    message.delay.unwrap_or_default()
                ),
            ));
        }
        let url = self
            .queue_url(queue, Role::Work)
            .await
            .map_err(DriverError::not_sent)?;
        self.send_body(queue, &url, &message.body, delay_seconds, &[])
            .await
    }

    /// `SendMessage` of `body` to `url` (base64 if needed), with the Number
    /// message attributes `counts`.
    pub(super) async fn send_body(
        &self,
        queue: &str,
        url: &str,
        body: &[u8],
        delay_seconds: u64,
        counts: &[(&str, u32)],
    ) -> Result<(), DriverError> {
        let what = format!("SendMessage to `{queue}`");
        let (text, base64) = encode_body(body);
        let mut request = self
            .inner
            .client
            .send_message()
            .queue_url(url)
            .message_body(text);
        if delay_seconds > 0 {
            request = request.delay_seconds(delay_seconds as i32);
        }
        let attribute = |data_type: &str, value: String| {
            MessageAttributeValue::builder()
                .data_type(data_type)
                .string_value(value)
                .build()
                .map_err(|e| failed(NAME, ErrorKind::NotAccepted, what.as_str(), e))
        };
        if base64 {
            request = request
                .message_attributes(ENCODING_ATTRIBUTE, attribute("String", "base64".into())?);
        }
        for (name, count) in counts {
            request = request.message_attributes(*name, attribute("Number", count.to_string())?);
        }
        let limit = self.inner.config.operation_timeout;
        match bounded(limit, &what, ErrorKind::Uncertain, request.send()).await? {
            Ok(_) => Ok(()),
            Err(e) => {
                if is_missing_queue(&e) {
                    self.forget(queue);
                }
                Err(sdk_error(
                    &what,
                    e,
                    ErrorKind::NotAccepted,
                    ErrorKind::Uncertain,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip() {
        for body in [
            &b"{\"v\":1}"[..],
            "caf\u{e9} \u{1F600}\n\t".as_bytes(),
            &[0xff, b'{', b'x', 0x00],
            b"nul \0 inside",
            b"",
            "\u{FFFE}".as_bytes(),
        ] {
            let (text, base64) = encode_body(body);
            assert_eq!(decode_body(&text, base64), body, "{body:?}");
        }
        assert!(!encode_body(b"{\"v\":1}").1);
        assert!(encode_body(&[0xff]).1);
        assert!(encode_body(b"a\0b").1);
        assert!(encode_body(b"\x07").1);
    }
}
