//! Sending a message: dispatch (with its delay), and the `SendMessage`
//! that a graceful shutdown's copy and a failure record's transfer share;
//! a batch dispatch with `SendMessageBatch`. Also the body encoding both
//! directions use.
//!
//! A batch is cut into calls of at most [`BATCH_ENTRIES`] entries whose
//! bodies and attributes add up to at most [`BATCH_BYTES`] (SQS refuses a
//! longer request whole; a message longer than that on its own goes alone,
//! and SQS refuses it alone). The calls run together. Each message's
//! result: stored; refused before any I/O (a delay above 900 s:
//! [`ErrorKind::Unsupported`]; its queue unresolved: as for a single
//! dispatch); listed by SQS among the call's failed entries with
//! `SenderFault` true (SQS refused that entry: [`ErrorKind::NotAccepted`])
//! or false (SQS failed on its own side, and its API reference does not
//! say the message was not stored: [`ErrorKind::Uncertain`]); named in
//! neither list ([`ErrorKind::Uncertain`]); or the error of a call that
//! failed whole, kind chosen as for `SendMessage` (refused or certainly not
//! sent: [`ErrorKind::NotAccepted`]; outcome unknown:
//! [`ErrorKind::Uncertain`]) and the SDK's error shared as the cause.

use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use futures_util::future::join_all;
use tracing::warn;

use super::connection::bounded;
use super::errors::{error, fan_out, is_missing_queue, sdk_error};
use super::topology::Role;
use super::{SqsDriver, ENCODING_ATTRIBUTE, MAX_DELAY_SECONDS, NAME};
use crate::driver::{DriverError, ErrorKind, Outgoing};
use crate::kit::failed;

/// A body as SQS message text, and whether it had to be base64-encoded.
fn encode_body(body: &[u8]) -> (String, bool) {
    let allowed = |c: char| matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..);
    match std::str::from_utf8(body) {
        Ok(text) if !text.is_empty() && text.chars().all(allowed) => (text.to_string(), false),
        _ => (aws_smithy_types::base64::encode(body), true),
    }
}

/// A failure record as a body within [`MAX_BODY_BYTES`](super::MAX_BODY_BYTES):
/// cut to fit when too large ([`FailureRecord::encode_within`]), and, if
/// its text is one SQS cannot carry as is (sent as base64, a third
/// larger), cut to fit three quarters of it.
pub(super) fn record_body(record: &jobrail::FailureRecord) -> Vec<u8> {
    let body = record.encode_within(super::MAX_BODY_BYTES);
    if encode_body(&body).1 {
        record.encode_within(super::MAX_BODY_BYTES / 4 * 3)
    } else {
        body
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

/// The most entries SQS takes in one batch call.
pub(super) const BATCH_ENTRIES: usize = 10;
/// The most bytes (bodies, attribute names, types and values) sent in one
/// `SendMessageBatch`: SQS's limit before it rose to 1 MiB (2025), which
/// every SQS endpoint and emulator still takes, and the driver's own
/// message limit.
pub(super) const BATCH_BYTES: usize = 262_144;

/// Refuses a dispatch delay SQS cannot carry; its whole seconds otherwise.
fn delay_seconds(delay: Option<Duration>) -> Result<u64, DriverError> {
    let seconds = delay.map(jobrail::whole_seconds_up).unwrap_or(0);
    if seconds > MAX_DELAY_SECONDS {
        return Err(error(
            ErrorKind::Unsupported,
            format!(
                "dispatch delay {:?} exceeds SQS's maximum of {MAX_DELAY_SECONDS} s",
                delay.unwrap_or_default()
            ),
        ));
    }
    Ok(seconds)
}

/// A message attribute value.
fn attribute(data_type: &str, value: String) -> Result<MessageAttributeValue, String> {
    MessageAttributeValue::builder()
        .data_type(data_type)
        .string_value(value)
        .build()
        .map_err(|e| e.to_string())
}

/// One entry of a `SendMessageBatch` and the bytes SQS counts for it.
struct Entry {
    /// Its place in the caller's batch.
    index: usize,
    entry: SendMessageBatchRequestEntry,
    bytes: usize,
}

impl SqsDriver {
    /// Stores `messages` on `queue` with `SendMessageBatch` calls run
    /// together; one result per message, in order (see the module docs).
    pub(super) async fn dispatch_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let n = messages.len();
        let mut results: Vec<Option<Result<(), DriverError>>> = (0..n).map(|_| None).collect();
        if n == 0 {
            return vec![];
        }
        if let Err(e) = self.inner.life.check_running() {
            return fan_out(e, n).into_iter().map(Err).collect();
        }
        let url = match self.queue_url(queue, Role::Work).await {
            Ok(url) => url,
            Err(e) => return fan_out(e.not_sent(), n).into_iter().map(Err).collect(),
        };
        let what = format!("SendMessageBatch to `{queue}`");
        // Cut into calls: at most 10 entries and 256 KiB each.
        let mut calls: Vec<Vec<Entry>> = vec![];
        let mut bytes = 0;
        for (index, message) in messages.into_iter().enumerate() {
            let entry = delay_seconds(message.delay).and_then(|delay| {
                batch_entry(index, &message.body, delay)
                    .map_err(|e| error(ErrorKind::NotAccepted, format!("{what}: {e}")))
            });
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    results[index] = Some(Err(e));
                    continue;
                }
            };
            match calls.last_mut() {
                Some(call) if call.len() < BATCH_ENTRIES && bytes + entry.bytes <= BATCH_BYTES => {
                    bytes += entry.bytes;
                    call.push(entry);
                }
                _ => {
                    bytes = entry.bytes;
                    calls.push(vec![entry]);
                }
            }
        }
        let answers = join_all(
            calls
                .into_iter()
                .map(|call| self.send_batch_call(queue, &url, &what, call)),
        )
        .await;
        for (index, result) in answers.into_iter().flatten() {
            results[index] = Some(result);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(error(
                        ErrorKind::Uncertain,
                        format!("{what}: no answer for this message"),
                    ))
                })
            })
            .collect()
    }

    /// One `SendMessageBatch` call: each entry's place and result.
    async fn send_batch_call(
        &self,
        queue: &str,
        url: &str,
        what: &str,
        call: Vec<Entry>,
    ) -> Vec<(usize, Result<(), DriverError>)> {
        let indexes: Vec<usize> = call.iter().map(|e| e.index).collect();
        let request = self
            .inner
            .client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(call.into_iter().map(|e| e.entry).collect()));
        let limit = self.inner.config.operation_timeout;
        let answer = match bounded(limit, what, ErrorKind::Uncertain, request.send()).await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => {
                if is_missing_queue(&e) {
                    self.forget(queue);
                }
                let e = sdk_error(what, e, ErrorKind::NotAccepted, ErrorKind::Uncertain);
                return indexes
                    .iter()
                    .copied()
                    .zip(fan_out(e, indexes.len()).into_iter().map(Err))
                    .collect();
            }
            Err(e) => {
                return indexes
                    .iter()
                    .copied()
                    .zip(fan_out(e, indexes.len()).into_iter().map(Err))
                    .collect();
            }
        };
        let mut results = Vec::with_capacity(indexes.len());
        for index in indexes {
            let id = index.to_string();
            if answer.successful().iter().any(|s| s.id() == id) {
                results.push((index, Ok(())));
            } else if let Some(refused) = answer.failed().iter().find(|f| f.id() == id) {
                let kind = if refused.sender_fault() {
                    ErrorKind::NotAccepted
                } else {
                    ErrorKind::Uncertain
                };
                let fault = if refused.sender_fault() {
                    "refused by SQS"
                } else {
                    "failed on SQS's side (SenderFault false), it may have been stored"
                };
                results.push((
                    index,
                    Err(error(
                        kind,
                        format!(
                            "{what}: entry {fault}: {}: {}",
                            refused.code(),
                            refused.message().unwrap_or_default()
                        ),
                    )),
                ));
            } else {
                results.push((
                    index,
                    Err(error(
                        ErrorKind::Uncertain,
                        format!(
                            "{what}: SQS's answer names neither success nor failure for this entry"
                        ),
                    )),
                ));
            }
        }
        results
    }

    /// Stores `message` on the work queue `queue` (resolving or creating
    /// it), its delay rounded up to whole seconds.
    pub(super) async fn dispatch(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let delay_seconds = delay_seconds(message.delay)?;
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

/// The batch entry of the message at `index` (its id), base64 if needed.
fn batch_entry(index: usize, body: &[u8], delay_seconds: u64) -> Result<Entry, String> {
    let (text, base64) = encode_body(body);
    let mut bytes = text.len();
    let mut entry = SendMessageBatchRequestEntry::builder()
        .id(index.to_string())
        .message_body(text);
    if delay_seconds > 0 {
        entry = entry.delay_seconds(delay_seconds as i32);
    }
    if base64 {
        bytes += ENCODING_ATTRIBUTE.len() + "String".len() + "base64".len();
        entry = entry.message_attributes(ENCODING_ATTRIBUTE, attribute("String", "base64".into())?);
    }
    let entry = entry.build().map_err(|e| e.to_string())?;
    Ok(Entry {
        index,
        entry,
        bytes,
    })
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
