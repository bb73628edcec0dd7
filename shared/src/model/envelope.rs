//! The wire format every backend carries ([`Envelope`]).
//!
//! A consumer reads each body once: [`Registry::process`](crate::Registry::process)
//! parses it in one pass into a view borrowed from the body, whose payload
//! stays raw JSON until its job's type decodes it (once, straight into the
//! handler's argument). The view reads exactly the bodies
//! [`Envelope::decode`] reads and fails with the same errors: a newer
//! version is [`EnvelopeError::UnsupportedVersion`] whatever its other
//! fields hold, and a malformed body keeps its redacted error text. Reading
//! the version on its own, and parsing the payload into a JSON value, happen
//! only on the rare paths that need them (a body that does not decode, a
//! payload that might hold what only a full parse refuses).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::model::redact::json_error;
use crate::model::runtime::{SystemTime, UNIX_EPOCH};

/// The envelope format version this crate writes.
pub(crate) const ENVELOPE_VERSION: u32 = 1;

/// One message on the wire.
///
/// JSON, so that a message is readable in a broker's management UI and can be
/// produced from any language. The `v` field versions the format: a decoder
/// refuses versions newer than it knows with a clear error instead of
/// misreading them, and new optional fields can be added without a new version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Format version.
    pub v: u32,
    /// A fresh id per dispatch (UUID v4).
    pub id: String,
    /// The job name, used to find the handler.
    pub job: String,
    /// The typed payload, as JSON.
    pub payload: serde_json::Value,
    /// When it was dispatched, in milliseconds since the Unix epoch.
    pub dispatched_at_ms: u64,
    /// Free-form application metadata (not interpreted by the facade).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// When a delayed dispatch is due, in milliseconds since the Unix epoch,
    /// where the backend holds the delay in steps: a delivery before this
    /// time is a step ([`delay_remaining`]), carried on without running the
    /// handler or counting an attempt. `None`: due when delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_ms: Option<u64>,
}

/// The body could not be read as an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// Not valid JSON, or missing required fields. The text is serde's,
    /// with every value from the body taken out ([`crate::model::redact::json_error`]):
    /// the body may hold payload data, which stays out of logs and events.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// Written by a newer version of the facade.
    #[error("unsupported envelope version {found} (this worker reads up to {ENVELOPE_VERSION})")]
    UnsupportedVersion {
        /// The version in the message.
        found: u32,
    },
}

/// Milliseconds since the Unix epoch, now, by the system clock.
pub fn unix_now_ms() -> u64 {
    now_ms()
}

/// The due time, in milliseconds since the Unix epoch, of a delay `delay`
/// from `now`, rounded up to the next whole millisecond: a worker that
/// reads the clock in whole milliseconds ([`unix_now_ms`], rounded down)
/// finds it due only once `now + delay` has passed, never a fraction of a
/// millisecond early.
///
/// ```
/// use std::time::Duration;
/// use jobrail::{due_ms, UNIX_EPOCH};
///
/// let now = UNIX_EPOCH + Duration::from_micros(1_999_600);
/// assert_eq!(due_ms(now, Duration::from_millis(500)), 2_500);
/// assert_eq!(due_ms(UNIX_EPOCH + Duration::from_secs(2), Duration::from_millis(500)), 2_500);
/// ```
pub fn due_ms(now: SystemTime, delay: Duration) -> u64 {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let due = since.saturating_add(delay);
    u64::try_from(due.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch, now.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis().min(u64::MAX as u128) as u64)
        .unwrap_or(0)
}

/// An envelope for `job` with a fresh id and the current time, written
/// straight from the typed `payload` (no intermediate JSON value): what
/// [`Envelope::new`] then [`Envelope::encode`] give, in one serialization.
/// Returns the message id and the body. Fails only if `payload` does not
/// serialize to JSON (a map with non-string keys, a failing `Serialize`).
pub fn encode_envelope<P: Serialize + ?Sized>(
    job: &str,
    payload: &P,
    metadata: &BTreeMap<String, String>,
) -> Result<(String, Vec<u8>), serde_json::Error> {
    let id = new_message_id();
    let body = encode_envelope_with_id(&id, job, payload, metadata)?;
    Ok((id, body))
}

/// [`encode_envelope`] with the message id given: for a producer that
/// makes its batch's ids first ([`new_message_id`]), or one that sends a
/// message again under its id.
///
/// ```
/// use std::collections::BTreeMap;
/// use jobrail::{encode_envelope_with_id, new_message_id, Envelope};
///
/// let id = new_message_id();
/// let body = encode_envelope_with_id(&id, "report", &7, &BTreeMap::new()).unwrap();
/// assert_eq!(Envelope::decode(&body).unwrap().id, id);
/// ```
pub fn encode_envelope_with_id<P: Serialize + ?Sized>(
    id: &str,
    job: &str,
    payload: &P,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, serde_json::Error> {
    #[derive(Serialize)]
    struct Borrowed<'a, P: Serialize + ?Sized> {
        v: u32,
        id: &'a str,
        job: &'a str,
        payload: &'a P,
        dispatched_at_ms: u64,
        #[serde(skip_serializing_if = "no_metadata")]
        metadata: &'a BTreeMap<String, String>,
    }
    fn no_metadata(metadata: &&BTreeMap<String, String>) -> bool {
        metadata.is_empty()
    }
    serde_json::to_vec(&Borrowed {
        v: ENVELOPE_VERSION,
        id,
        job,
        payload,
        dispatched_at_ms: now_ms(),
        metadata,
    })
}

impl Envelope {
    /// A new envelope for `job` with a fresh id and the current time.
    pub fn new(job: impl Into<String>, payload: serde_json::Value) -> Self {
        let dispatched_at_ms = now_ms();
        Envelope {
            v: ENVELOPE_VERSION,
            id: new_message_id(),
            job: job.into(),
            payload,
            dispatched_at_ms,
            metadata: BTreeMap::new(),
            due_ms: None,
        }
    }

    /// Serializes to bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an envelope always serializes")
    }

    /// Parses bytes, checking the version.
    ///
    /// One parse on success. When the body does not fit the envelope, its
    /// version is read on its own, so that a message from a newer format is
    /// reported as [`EnvelopeError::UnsupportedVersion`] even when its other
    /// fields do not fit this one.
    pub fn decode(body: &[u8]) -> Result<Self, EnvelopeError> {
        match serde_json::from_slice::<Envelope>(body) {
            Ok(envelope) => check_version(envelope.v).map(|()| envelope),
            Err(e) => Err(not_an_envelope(body, &e)),
        }
    }
}

/// `Ok` for a version this crate reads.
fn check_version(v: u32) -> Result<(), EnvelopeError> {
    if v == 0 || v > ENVELOPE_VERSION {
        Err(EnvelopeError::UnsupportedVersion { found: v })
    } else {
        Ok(())
    }
}

/// The error for a body that did not decode as an envelope (`error`): an
/// unsupported version if its `v` says so, whatever the rest holds; else the
/// version probe's own error (a body that is not JSON, a missing or
/// mistyped `v`); else `error`. The same answer as reading the version
/// first and the envelope second, in two parses, on the failure path only.
fn not_an_envelope(body: &[u8], error: &serde_json::Error) -> EnvelopeError {
    #[derive(Deserialize)]
    struct Version {
        v: u32,
    }
    match serde_json::from_slice::<Version>(body) {
        Err(e) => EnvelopeError::Malformed(json_error(&e)),
        Ok(Version { v }) => match check_version(v) {
            Err(unsupported) => unsupported,
            Ok(()) => EnvelopeError::Malformed(json_error(error)),
        },
    }
}

/// An envelope read in one pass and borrowed from the body: the payload
/// stays raw JSON (checked, not parsed) until its job's type decodes it, and
/// the id and job name borrow the body where the JSON has no escapes. What
/// [`Registry::process`](crate::Registry::process) reads; it decodes exactly
/// the bodies [`Envelope::decode`] decodes, with the same errors.
#[derive(Debug, Deserialize)]
pub(crate) struct EnvelopeView<'a> {
    pub(crate) v: u32,
    #[serde(borrow)]
    pub(crate) id: Cow<'a, str>,
    #[serde(borrow)]
    pub(crate) job: Cow<'a, str>,
    /// The payload's JSON text, as the body holds it.
    #[serde(borrow, deserialize_with = "raw_text")]
    pub(crate) payload: &'a str,
    pub(crate) dispatched_at_ms: u64,
    #[serde(default)]
    pub(crate) metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub(crate) due_ms: Option<u64>,
}

impl<'a> EnvelopeView<'a> {
    /// Reads `body` in one pass, checking the version as [`Envelope::decode`] does.
    ///
    /// The raw payload is only scanned, where [`Envelope::decode`] parses it
    /// into a JSON value, which refuses a little more: numbers beyond `f64`
    /// (`1e400`), lone UTF-16 surrogates in `\u` escapes, nesting deeper
    /// than the parser's limit. A quick look at the payload's bytes
    /// ([`may_not_be_a_value`]) sends the rare body whose payload might
    /// hold one of those through [`Envelope::decode`] itself, which decides.
    /// On a failure the error is the one [`Envelope::decode`] gives (it is
    /// asked again), so the two agree on every body, error text included.
    pub(crate) fn decode(body: &'a [u8]) -> Result<Self, EnvelopeError> {
        match serde_json::from_slice::<EnvelopeView<'a>>(body) {
            Ok(view) => {
                check_version(view.v)?;
                if may_not_be_a_value(view.payload.as_bytes()) {
                    Envelope::decode(body)?;
                }
                Ok(view)
            }
            Err(e) => Err(match Envelope::decode(body) {
                Err(error) => error,
                // Not expected: the view reads everything the envelope reads.
                Ok(_) => not_an_envelope(body, &e),
            }),
        }
    }

    /// The payload as a JSON value (for events that include payloads, and
    /// failure records).
    pub(crate) fn payload_value(&self) -> serde_json::Value {
        // The raw payload is JSON the parser has checked; a value too deep
        // for serde_json's recursion limit reads as null.
        serde_json::from_str(self.payload).unwrap_or(serde_json::Value::Null)
    }

    /// The owned envelope.
    pub(crate) fn to_envelope(&self) -> Envelope {
        Envelope {
            v: self.v,
            id: self.id.to_string(),
            job: self.job.to_string(),
            payload: self.payload_value(),
            dispatched_at_ms: self.dispatched_at_ms,
            metadata: self.metadata.clone(),
            due_ms: self.due_ms,
        }
    }
}

/// A raw JSON value's text, borrowed from the body.
fn raw_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<&'de str, D::Error> {
    <&'de RawValue>::deserialize(deserializer).map(RawValue::get)
}

impl<'a> EnvelopeView<'a> {
    /// Reads `body` in one pass with its payload decoded into its job's
    /// type as it is read: `find` is given the job name once it is read and
    /// answers with the job, and `decode` decodes the payload at the start
    /// of the bytes it is given (the rest of the body) with the job's type,
    /// answering with the value and the bytes it took.
    ///
    /// `None` whenever this read cannot decide alone, and the two-pass read
    /// ([`EnvelopeView::decode`], then the payload from its text) must: the
    /// body is not an envelope this version reads; `payload` comes before
    /// `job`; a member name has an escape or a byte outside printable ASCII,
    /// or one of the envelope's own comes twice; the
    /// job is not found; the payload does not decode or validate; or it
    /// might hold what only a full parse refuses ([`may_not_be_a_value`]).
    /// So when it answers, the answer is the one the two-pass read gives,
    /// in one parse of the body instead of one and a half (a property test
    /// checks it). Envelopes as this crate writes them (`job` before
    /// `payload`, [`encode_envelope`]) take this read.
    pub(crate) fn decode_typed<J, P>(
        body: &'a [u8],
        find: impl FnOnce(&str) -> Option<J>,
        decode: impl FnOnce(&J, &'a [u8]) -> Option<(P, usize)>,
    ) -> Option<(Self, J, P)> {
        let mut cursor = Cursor { body, at: 0 };
        let (mut find, mut decode) = (Some(find), Some(decode));
        let (mut v, mut id, mut job, mut payload, mut at, mut metadata, mut due) =
            (None, None, None, None, None, None, None);
        let mut found = None;
        let mut typed = None;
        cursor.eat(b'{')?;
        loop {
            let name = cursor.name()?;
            cursor.eat(b':')?;
            match name {
                b"v" if v.is_none() => v = Some(cursor.value::<u32>()?),
                b"id" if id.is_none() => id = Some(cursor.text()?),
                b"job" if job.is_none() => {
                    let name = cursor.text()?;
                    found = Some((find.take()?)(&name)?);
                    job = Some(name);
                }
                b"payload" if payload.is_none() => {
                    cursor.skip_space();
                    let start = cursor.at;
                    let rest = body.get(start..)?;
                    let (value, used) = (decode.take()?)(found.as_ref()?, rest)?;
                    cursor.at = start.checked_add(used)?;
                    payload = Some(std::str::from_utf8(body.get(start..cursor.at)?).ok()?);
                    typed = Some(value);
                }
                b"dispatched_at_ms" if at.is_none() => at = Some(cursor.value::<u64>()?),
                b"metadata" if metadata.is_none() => metadata = Some(cursor.value()?),
                b"due_ms" if due.is_none() => due = Some(cursor.value::<Option<u64>>()?),
                // A member of a newer writer: ignored, as the envelope
                // ignores it (its value still checked as JSON).
                b"" => {
                    cursor.value::<serde::de::IgnoredAny>()?;
                }
                _ => return None,
            }
            match cursor.next()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
        cursor.skip_space();
        if cursor.at != body.len() {
            return None;
        }
        let v = v?;
        check_version(v).ok()?;
        let payload = payload?;
        if may_not_be_a_value(payload.as_bytes()) {
            return None;
        }
        let view = EnvelopeView {
            v,
            id: id?,
            job: job?,
            payload,
            dispatched_at_ms: at?,
            metadata: metadata.unwrap_or_default(),
            due_ms: due.flatten(),
        };
        Some((view, found?, typed?))
    }
}

/// A string borrowed from the body where it has no escapes, as the view's
/// fields read it.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// A place in a body read by [`EnvelopeView::decode_typed`]: the object's
/// punctuation and member names are read here, each value by serde_json.
struct Cursor<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    /// Past JSON's whitespace.
    #[inline]
    fn skip_space(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.body.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte after whitespace, taken.
    fn next(&mut self) -> Option<u8> {
        self.skip_space();
        let byte = *self.body.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    /// `byte`, after whitespace.
    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// A member name: one of the envelope's own as this crate writes them
    /// (no escapes), or the empty name for any other name of printable
    /// ASCII without escapes; `None` for anything else.
    fn name(&mut self) -> Option<&'static [u8]> {
        self.eat(b'"')?;
        let rest = self.body.get(self.at..)?;
        // The name with its closing quote (a name this is not, or one with
        // an escape, ends elsewhere), each compared as a constant.
        macro_rules! member {
            ($quoted:literal) => {{
                let quoted: &'static [u8] = $quoted;
                rest.starts_with(quoted).then_some(quoted)
            }};
        }
        let quoted = match rest.first()? {
            b'v' => member!(b"v\""),
            b'i' => member!(b"id\""),
            b'j' => member!(b"job\""),
            b'p' => member!(b"payload\""),
            b'd' if rest.get(1) == Some(&b'u') => member!(b"due_ms\""),
            b'd' => member!(b"dispatched_at_ms\""),
            b'm' => member!(b"metadata\""),
            _ => None,
        };
        if let Some(quoted) = quoted {
            self.at += quoted.len();
            return Some(&quoted[..quoted.len() - 1]);
        }
        // Another name: read as serde_json reads it only when it is
        // printable ASCII without escapes (so not an envelope's own name
        // written with one), as the empty name, which no member has.
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b))?;
        if rest[len] != b'"' {
            return None;
        }
        self.at += len + 1;
        Some(b"")
    }

    /// A string, borrowed where it has no escapes, as the view's fields
    /// read it. A string of printable ASCII without escapes (a message id,
    /// a job name) is taken as it is, without serde_json; any other is
    /// read by it.
    fn text(&mut self) -> Option<Cow<'a, str>> {
        self.skip_space();
        let rest = self.body.get(self.at..)?;
        if rest.first() == Some(&b'"') {
            let inner = &rest[1..];
            let len = plain_ascii_len(inner);
            if inner.get(len) == Some(&b'"') {
                // ASCII without control characters: valid UTF-8 as it is.
                let text = std::str::from_utf8(&inner[..len]).ok()?;
                self.at += len + 2;
                return Some(Cow::Borrowed(text));
            }
        }
        self.value::<Text<'a>>().map(|text| text.0)
    }

    /// One JSON value, read as `T` reads it.
    fn value<T: Deserialize<'a>>(&mut self) -> Option<T> {
        self.skip_space();
        let mut values =
            serde_json::Deserializer::from_slice(self.body.get(self.at..)?).into_iter::<T>();
        let value = values.next()?.ok()?;
        self.at += values.byte_offset();
        Some(value)
    }
}

/// How many bytes `text` starts with that a JSON string holds as they are:
/// ASCII, no control character, no quote and no backslash. Eight bytes at
/// a time while none of them is another (a message id is read in five
/// steps), then one at a time.
fn plain_ascii_len(text: &[u8]) -> usize {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    /// High bit set in each byte of `word` that is zero (and, past the
    /// first such byte, maybe in others: only "any" is read).
    fn zero_bytes(word: u64) -> u64 {
        word.wrapping_sub(ONES) & !word & HIGH
    }
    let mut at = 0;
    for chunk in text.chunks_exact(8) {
        let word = u64::from_ne_bytes(chunk.try_into().unwrap_or([0; 8]));
        let stop = zero_bytes(word ^ (ONES * u64::from(b'"')))
            | zero_bytes(word ^ (ONES * u64::from(b'\\')))
            // Below 0x20: subtracting 0x20 borrows into the high bit.
            | (word.wrapping_sub(ONES * 0x20) & !word & HIGH)
            | (word & HIGH);
        if stop != 0 {
            break;
        }
        at += 8;
    }
    at + text[at..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
        .unwrap_or(text.len() - at)
}

/// Whether `raw`, JSON text the parser has checked, might hold what a JSON
/// value refuses: a number with an exponent or 300 digits or more (it may
/// not fit an `f64`), a `\u` escape in the surrogate range (it may be
/// alone), nesting 100 deep or more. `false` means it certainly holds none.
fn may_not_be_a_value(raw: &[u8]) -> bool {
    const DEEP: u32 = 100;
    const LONG: usize = 300;
    // A short payload cannot nest 100 deep or hold a 300-digit number: with
    // no escape and no digit or `.` before an `e`, it holds none of them.
    // (A loop without an early exit, which the compiler vectorizes.)
    if raw.len() < DEEP as usize {
        let after_first = raw.get(1..).unwrap_or_default();
        let suspect =
            raw.iter()
                .zip(after_first)
                .fold(raw.first() == Some(&b'\\'), |seen, (&before, &b)| {
                    let exponent = (b | 0x20) == b'e';
                    let after_digit = before.is_ascii_digit() | (before == b'.');
                    seen | (b == b'\\') | (exponent & after_digit)
                });
        if !suspect {
            return false;
        }
    }
    let n = raw.len();
    let mut depth = 0u32;
    let mut i = 0;
    while i < n {
        let b = raw[i];
        i += 1;
        match b {
            b'"' => {
                // To the closing quote; only escapes need a look.
                while i < n {
                    let c = raw[i];
                    i += 1;
                    if c == b'"' {
                        break;
                    }
                    if c == b'\\' {
                        if raw.get(i) == Some(&b'u')
                            && matches!(raw.get(i + 1), Some(b'd' | b'D'))
                            && matches!(
                                raw.get(i + 2),
                                Some(b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F')
                            )
                        {
                            return true;
                        }
                        i += 1;
                    }
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth >= DEEP {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'-' | b'0'..=b'9' => {
                let start = i - 1;
                while i < n {
                    match raw[i] {
                        b'-' | b'+' | b'.' | b'0'..=b'9' => i += 1,
                        b'e' | b'E' => return true,
                        _ => break,
                    }
                }
                if i - start >= LONG {
                    return true;
                }
            }
            // `true`, `false`, `null`, commas, colons, whitespace.
            _ => {}
        }
    }
    false
}

/// How long before the envelope in `body` is due, if it carries a due time
/// ([`Envelope::due_ms`]) later than `now_ms`: a delivery of it now is a
/// *step* of a delay the backend holds in steps, to be sent on (the same
/// body, the same id, delayed by at most the backend's longest delay,
/// [`delay_leg`]) without running the handler or counting an attempt.
/// `None` for a body that is due (or has no due time, or is not an
/// envelope: the rules decide those as usual).
///
/// Bodies without the field are answered with one search for it, no parse.
///
/// ```
/// use std::collections::BTreeMap;
/// use std::time::Duration;
/// use jobrail::{delay_remaining, encode_envelope, with_due};
///
/// let (_, plain) = encode_envelope("report", &7, &BTreeMap::new()).unwrap();
/// let body = with_due(&plain, 10_000).unwrap();
/// assert_eq!(delay_remaining(&body, 4_000), Some(Duration::from_millis(6_000)));
/// assert_eq!(delay_remaining(&body, 10_000), None);
/// assert_eq!(delay_remaining(&plain, 0), None);
/// ```
pub fn delay_remaining(body: &[u8], now_ms: u64) -> Option<Duration> {
    #[derive(Deserialize)]
    struct Due {
        #[serde(default)]
        due_ms: Option<u64>,
    }
    const FIELD: &[u8] = b"\"due_ms\"";
    if !body.windows(FIELD.len()).any(|w| w == FIELD) {
        return None;
    }
    let due = serde_json::from_slice::<Due>(body).ok()?.due_ms?;
    (due > now_ms).then(|| Duration::from_millis(due - now_ms))
}

/// `body` with the due time `due_ms` ([`Envelope::due_ms`]) written in: the
/// field is added as the object's first member, leaving every other byte as
/// it was (the payload is not parsed again). A body that has a due time
/// already is returned as it is; `None` for a body that is not a JSON
/// object (raw bytes, which cannot carry one).
///
/// ```
/// use std::collections::BTreeMap;
/// use jobrail::{delay_remaining, encode_envelope, with_due, Envelope};
///
/// let (_, body) = encode_envelope("report", &7, &BTreeMap::new()).unwrap();
/// let due = with_due(&body, 9_000).unwrap();
/// assert_eq!(Envelope::decode(&due).unwrap().due_ms, Some(9_000));
/// assert_eq!(with_due(&due, 1).unwrap(), due, "a due time already written stays");
/// assert!(with_due(b"not json", 9_000).is_none());
/// ```
pub fn with_due(body: &[u8], due_ms: u64) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Due {
        #[serde(default)]
        due_ms: Option<u64>,
    }
    let due: Due = serde_json::from_slice(body).ok()?;
    if due.due_ms.is_some() {
        return Some(body.to_vec());
    }
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().all(|b| b.is_ascii_whitespace() || *b == b'}');
    let field = format!("\"due_ms\":{due_ms}{}", if empty { "" } else { "," });
    let mut out = Vec::with_capacity(body.len() + field.len());
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(field.as_bytes());
    out.extend_from_slice(rest);
    Some(out)
}

/// The delay of the next step toward a due time `remaining` away, on a
/// backend that holds at most `longest` in one message (`None`: any):
/// the whole rest when it fits, else `longest`. Each step costs one
/// message, so a delay costs `ceil(delay / longest)` messages.
///
/// ```
/// use std::time::Duration;
/// use jobrail::delay_leg;
///
/// let day = Duration::from_secs(86_400);
/// assert_eq!(delay_leg(3 * day, Some(day)), day);
/// assert_eq!(delay_leg(day / 2, Some(day)), day / 2);
/// assert_eq!(delay_leg(30 * day, None), 30 * day);
/// ```
pub fn delay_leg(remaining: Duration, longest: Option<Duration>) -> Duration {
    match longest {
        Some(longest) => remaining.min(longest),
        None => remaining,
    }
}

/// A new random message id (UUID v4). Natively it comes from a thread-local
/// generator the OS seeds (uuid's `fast-rng`): no system call per id. On
/// wasm32 it comes from the JS crypto source.
pub fn new_message_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn encode_envelope_reads_back_as_the_envelope() {
        #[derive(Serialize)]
        struct Report {
            report_id: u64,
            title: &'static str,
        }
        let mut metadata = BTreeMap::new();
        let (id, body) = encode_envelope(
            "build-report",
            &Report {
                report_id: 7,
                title: "q\"1",
            },
            &metadata,
        )
        .unwrap();
        let back = Envelope::decode(&body).unwrap();
        assert_eq!(back.id, id);
        assert_eq!(back.job, "build-report");
        assert_eq!(
            back.payload,
            serde_json::json!({"report_id": 7, "title": "q\"1"})
        );
        assert!(back.metadata.is_empty());
        assert!(!String::from_utf8(body).unwrap().contains("metadata"));
        metadata.insert("tenant".to_string(), "a".to_string());
        let (other, body) = encode_envelope("build-report", &1u8, &metadata).unwrap();
        assert_ne!(other, id);
        let back = Envelope::decode(&body).unwrap();
        assert_eq!(back.metadata, metadata);
        assert_eq!(back.payload, serde_json::json!(1));
        let pairs = BTreeMap::from([((1u8, 2u8), 3u8)]);
        assert!(encode_envelope("pairs", &pairs, &BTreeMap::new()).is_err());
    }

    #[test]
    fn round_trips() {
        let mut env = Envelope::new("build-report", serde_json::json!({"report_id": 7}));
        env.metadata.insert("tenant".into(), "a".into());
        let back = Envelope::decode(&env.encode()).unwrap();
        assert_eq!(back, env);
        assert_ne!(Envelope::new("x", serde_json::Value::Null).id, env.id);
    }

    #[test]
    fn rejects_garbage_and_future_versions() {
        assert!(matches!(
            Envelope::decode(b"not json"),
            Err(EnvelopeError::Malformed(_))
        ));
        assert!(matches!(
            Envelope::decode(br#"{"v":1}"#),
            Err(EnvelopeError::Malformed(_))
        ));
        let future = br#"{"v":2,"id":"a","job":"j","payload":null,"dispatched_at_ms":0}"#;
        assert_eq!(
            Envelope::decode(future),
            Err(EnvelopeError::UnsupportedVersion { found: 2 })
        );
    }

    /// The decode before the one-pass read: the version on its own, then
    /// the whole envelope, payload as a JSON value.
    fn two_pass(body: &[u8]) -> Result<Envelope, EnvelopeError> {
        #[derive(Deserialize)]
        struct Version {
            v: u32,
        }
        let version: Version =
            serde_json::from_slice(body).map_err(|e| EnvelopeError::Malformed(json_error(&e)))?;
        if version.v == 0 || version.v > ENVELOPE_VERSION {
            return Err(EnvelopeError::UnsupportedVersion { found: version.v });
        }
        serde_json::from_slice(body).map_err(|e| EnvelopeError::Malformed(json_error(&e)))
    }

    fn view(body: &[u8]) -> Result<Envelope, EnvelopeError> {
        EnvelopeView::decode(body).map(|view| view.to_envelope())
    }

    #[test]
    fn the_version_is_read_before_the_other_fields() {
        // A newer format whose other fields do not fit this one.
        for body in [
            &br#"{"v":2}"#[..],
            br#"{"job":7,"v":3,"payload":{}}"#,
            br#"{"id":"a","job":"j","payload":null,"dispatched_at_ms":"soon","v":9}"#,
        ] {
            assert_eq!(
                view(body).unwrap_err(),
                EnvelopeError::UnsupportedVersion {
                    found: serde_json::from_slice::<serde_json::Value>(body).unwrap()["v"]
                        .as_u64()
                        .unwrap() as u32
                }
            );
            assert_eq!(view(body), two_pass(body));
            assert_eq!(Envelope::decode(body), two_pass(body));
        }
        let zero = br#"{"v":0,"id":"a","job":"j","payload":null,"dispatched_at_ms":0}"#;
        assert_eq!(
            view(zero),
            Err(EnvelopeError::UnsupportedVersion { found: 0 })
        );
        // Malformed: the version probe's error, then the envelope's.
        for body in [
            &b"not json"[..],
            br#"{"v":"1","id":"a"}"#,
            br#"{"id":"a"}"#,
            br#"{"v":1,"id":"a","job":"j","dispatched_at_ms":0}"#,
            br#"{"v":1,"id":"4111 1111","job":5,"payload":null,"dispatched_at_ms":0}"#,
            br#"{"v":1,"id":"a","job":"j","payload":[1,,"dispatched_at_ms":0}"#,
        ] {
            let err = view(body).unwrap_err();
            assert!(matches!(err, EnvelopeError::Malformed(_)), "{err}");
            assert!(!err.to_string().contains("4111"), "redacted: {err}");
            assert_eq!(Err(err), two_pass(body));
            assert_eq!(Envelope::decode(body), two_pass(body));
        }
    }

    #[test]
    fn escaped_strings_metadata_and_unknown_fields() {
        let body = br#"{"v":1,"id":"a\"b","job":"caf\u00e9","payload":{"x":"\n"},
            "dispatched_at_ms":5,"metadata":{"t\u0041":"v\/w"},"later":{"field":[1]}}"#;
        let view = EnvelopeView::decode(body).unwrap();
        assert_eq!(view.id, "a\"b");
        assert_eq!(view.job, "café");
        assert!(
            matches!(view.id, Cow::Owned(_)),
            "escaped: unescaped into a copy"
        );
        assert_eq!(view.payload, r#"{"x":"\n"}"#);
        assert_eq!(view.metadata["tA"], "v/w");
        assert_eq!(Ok(view.to_envelope()), two_pass(body));

        let plain = br#"{"v":1,"id":"m-1","job":"j","payload":7,"dispatched_at_ms":0}"#;
        let view = EnvelopeView::decode(plain).unwrap();
        assert!(
            matches!(view.id, Cow::Borrowed("m-1")),
            "no escapes: borrowed"
        );
        assert!(matches!(view.job, Cow::Borrowed("j")));
        assert!(view.metadata.is_empty());
    }

    #[test]
    fn the_view_round_trips_with_encode() {
        let mut env = Envelope::new(
            "build-report",
            serde_json::json!({"report_id": 7, "note": "a \"quoted\" line\n", "list": [1.5, null]}),
        );
        env.metadata.insert("tenant".into(), "ä/\\".into());
        env.metadata.insert("trace".into(), "t-1".into());
        let body = env.encode();
        let view = EnvelopeView::decode(&body).unwrap();
        assert_eq!(view.to_envelope(), env);
        assert_eq!(view.payload_value(), env.payload);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(view.payload).unwrap(),
            env.payload
        );
    }

    #[test]
    fn the_payload_look_flags_what_only_a_full_parse_refuses() {
        let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let long_plain = format!(r#"{{"list":[{}]}}"#, vec!["1"; 80].join(","));
        for clean in [
            r#"{"id":1,"name":"report"}"#,
            r#"{"note":"1e400 in a string","x":-0.5}"#,
            "[true,false,null]",
            long_plain.as_str(),
            &deep(99),
        ] {
            assert!(!may_not_be_a_value(clean.as_bytes()), "{clean}");
        }
        let digits = "9".repeat(300);
        for suspect in [
            "1e400",
            "[1.5E3]",
            r#""\ud800""#,
            r#"{"k":"\uDBFF\uDFFF"}"#,
            &digits,
            &deep(100),
            &format!(r#"{{"pad":"{}","n":2e9}}"#, "x".repeat(120)),
        ] {
            assert!(may_not_be_a_value(suspect.as_bytes()), "{suspect}");
        }
        // An escape in a short payload takes the precise look, which clears
        // what is not a surrogate.
        assert!(!may_not_be_a_value(br#"{"k":"a\"b\u00e9"}"#));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod agreement {
        use super::*;
        use proptest::prelude::*;

        /// JSON text of some kind, with escapes in its strings, and now and
        /// then what only a full parse refuses: numbers beyond `f64`, lone
        /// surrogates, nesting past the parser's limit.
        fn value() -> impl Strategy<Value = String> {
            use serde_json::{json, Value};
            let text = prop_oneof![
                Just("plain".to_string()),
                Just("quote \" back \\ slash / tab\t".to_string()),
                Just("é ☃ \u{1F600}".to_string()),
                Just(String::new()),
                "[a-z0-9 \"\\\\]{0,8}",
            ];
            let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
            let leaf = prop_oneof![
                4 => Just(Value::Null).prop_map(|v| v.to_string()),
                4 => any::<bool>().prop_map(|b| json!(b).to_string()),
                4 => (0u64..4).prop_map(|n| json!(n).to_string()),
                4 => any::<u64>().prop_map(|n| json!(n).to_string()),
                4 => any::<i64>().prop_map(|n| json!(n).to_string()),
                4 => (-1e6f64..1e6).prop_map(|f| json!(f).to_string()),
                8 => text.prop_map(|t| json!(t).to_string()),
                1 => prop_oneof![
                    Just("1e400".to_string()),
                    Just("-2.5E+999".to_string()),
                    Just("1e5".to_string()),
                    Just("1.7976931348623157e308".to_string()),
                    Just("9".repeat(320)),
                    Just("9".repeat(20)),
                    Just(r#""\ud800""#.to_string()),
                    Just(r#""x\udc00y""#.to_string()),
                    Just(r#""\ud83d\ude00""#.to_string()),
                    Just(r#""\u00e9\u0041""#.to_string()),
                    Just(deep(99)),
                    Just(deep(126)),
                    Just(deep(127)),
                    Just(deep(128)),
                    Just(deep(200)),
                ],
            ];
            leaf.prop_recursive(3, 12, 3, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..3)
                        .prop_map(|items| format!("[{}]", items.join(","))),
                    prop::collection::vec(("[a-c\"]{1,2}", inner), 0..3).prop_map(|entries| {
                        let entries: Vec<String> = entries
                            .into_iter()
                            .map(|(k, v)| format!("{}:{v}", json!(k)))
                            .collect();
                        format!("{{{}}}", entries.join(","))
                    }),
                ]
            })
        }

        /// A field's value: mostly one that fits, sometimes anything.
        fn field(fits: BoxedStrategy<String>) -> impl Strategy<Value = Option<String>> {
            prop_oneof![
                6 => fits.prop_map(Some),
                1 => value().prop_map(Some),
                1 => Just(None),
            ]
        }

        fn body() -> impl Strategy<Value = Vec<u8>> {
            use serde_json::json;
            let text = "[a-z0-9\"\\\\é-]{0,6}"
                .prop_map(|t: String| json!(t).to_string())
                .boxed();
            let fields = (
                field((0u32..4).prop_map(|v| v.to_string()).boxed()),
                field(text.clone()),
                field(text.clone()),
                field(value().boxed()),
                field(any::<u64>().prop_map(|n| n.to_string()).boxed()),
                field(
                    prop::collection::btree_map("[a-z\"]{0,3}", "[a-z\\\\]{0,3}", 0..3)
                        .prop_map(|m| json!(m).to_string())
                        .boxed(),
                ),
                field(value().boxed()),
            );
            (
                fields,
                any::<prop::sample::Index>(),
                0usize..64,
                any::<bool>(),
            )
                .prop_map(
                    |((v, id, job, payload, at, metadata, extra), order, cut, truncate)| {
                        let mut pairs: Vec<String> = [
                            ("v", v),
                            ("id", id),
                            ("job", job),
                            ("payload", payload),
                            ("dispatched_at_ms", at),
                            ("metadata", metadata),
                            ("later", extra),
                        ]
                        .into_iter()
                        .filter_map(|(name, value)| {
                            value.map(|value| format!("\"{name}\":{value}"))
                        })
                        .collect();
                        let turn = order.index(pairs.len().max(1));
                        let len = pairs.len();
                        pairs.rotate_left(turn.min(len));
                        let mut body = format!("{{{}}}", pairs.join(",")).into_bytes();
                        if truncate {
                            body.truncate(body.len().saturating_sub(cut));
                        }
                        body
                    },
                )
        }

        /// The typed one-pass read of `body`, its payload read as a JSON
        /// value, for a job known by every name without an `a`.
        fn typed(body: &[u8]) -> Option<(EnvelopeView<'_>, String, serde_json::Value)> {
            EnvelopeView::decode_typed(
                body,
                |name| (!name.contains('a')).then(|| name.to_string()),
                |_, rest| {
                    let mut values = serde_json::Deserializer::from_slice(rest).into_iter();
                    let value: serde_json::Value = values.next()?.ok()?;
                    Some((value, values.byte_offset()))
                },
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2048))]
            /// The one-pass view decodes exactly what the two-pass decode
            /// decoded, into the same envelope, and fails with the same error.
            #[test]
            fn the_view_agrees_with_the_two_pass_decode(body in body()) {
                let old = two_pass(&body);
                prop_assert_eq!(&view(&body), &old);
                prop_assert_eq!(&Envelope::decode(&body), &old);
            }

            /// Where the typed one-pass read answers, the envelope decodes
            /// in two passes to the same envelope, and its payload text to
            /// the same value: the read never accepts a body, or gives a
            /// value, the two passes would not.
            #[test]
            fn the_typed_read_answers_only_as_the_two_passes_do(body in body()) {
                if let Some((read, job, payload)) = typed(&body) {
                    let envelope = two_pass(&body);
                    prop_assert_eq!(Ok(read.to_envelope()), envelope.clone());
                    let envelope = envelope.unwrap();
                    prop_assert_eq!(&job, &envelope.job);
                    prop_assert_eq!(&payload, &envelope.payload);
                    let text: serde_json::Value = serde_json::from_str(read.payload).unwrap();
                    prop_assert_eq!(payload, text);
                }
            }

            /// Envelopes as this crate writes them, with any payload a JSON
            /// value holds, metadata, a due time, and the spaces another
            /// writer may put between members, take the one-pass read.
            #[test]
            fn envelopes_as_written_take_the_one_pass_read(
                payload in value(),
                metadata in prop::collection::btree_map("[a-z\"é]{0,3}", "[a-z\\\\]{0,3}", 0..3),
                due in any::<Option<u64>>(),
                spaced in any::<bool>(),
            ) {
                let Ok(payload) = serde_json::from_str::<serde_json::Value>(&payload) else {
                    return Ok(());
                };
                let (_, body) = encode_envelope("job", &payload, &metadata).unwrap();
                let mut body = match due {
                    Some(due) => with_due(&body, due).unwrap(),
                    None => body,
                };
                // (A payload at the parser's depth limit does not parse
                // again inside the envelope's value: it stays unspaced.)
                if let (true, Ok(whole)) =
                    (spaced, serde_json::from_slice::<serde_json::Value>(&body))
                {
                    let text = serde_json::to_string_pretty(&whole).unwrap();
                    // `to_string_pretty` of a value writes members in key
                    // order (`job` before `payload`).
                    body = format!(" \n{text}\t ").into_bytes();
                }
                let suspect = may_not_be_a_value(
                    serde_json::to_string(&payload).unwrap().as_bytes(),
                );
                let read = typed(&body);
                prop_assert_eq!(read.is_some(), !suspect, "{}", String::from_utf8_lossy(&body));
                if let Some((read, _, value)) = read {
                    prop_assert_eq!(read.to_envelope(), Envelope::decode(&body).unwrap());
                    prop_assert_eq!(value, payload);
                }
            }
        }

        proptest! {
            /// The word-at-a-time scan stops where the byte-at-a-time one
            /// does.
            #[test]
            fn plain_ascii_len_agrees_with_a_byte_scan(text in prop::collection::vec(any::<u8>(), 0..40)) {
                let plain = text
                    .iter()
                    .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
                    .unwrap_or(text.len());
                prop_assert_eq!(plain_ascii_len(&text), plain);
            }
        }

        /// What the typed read leaves to the two passes, each on its own.
        #[test]
        fn the_typed_read_leaves_the_unusual_to_the_two_passes() {
            let (_, plain) = encode_envelope("job", &7, &BTreeMap::new()).unwrap();
            assert!(typed(&plain).is_some());
            let text = String::from_utf8(plain).unwrap();
            // A newer writer's members, ignored, and twice (as serde
            // ignores them), keep the one pass.
            let newer = text.replacen(
                r#""v":1"#,
                r#""v":1,"later":[2,{"x":""}],"":0,"later":3"#,
                1,
            );
            let (read, _, _) = typed(newer.as_bytes()).expect("newer members are read");
            assert_eq!(
                read.to_envelope(),
                Envelope::decode(newer.as_bytes()).unwrap()
            );
            for body in [
                // The payload before the job.
                r#"{"v":1,"id":"i","payload":7,"job":"job","dispatched_at_ms":1}"#.to_string(),
                // An escape in a member name (an envelope's own, or
                // another), a name not in printable ASCII, a member twice.
                text.replacen(r#""job""#, r#""j\u006fb""#, 1),
                text.replacen(r#""v":1"#, r#""v":1,"l\u0061ter":2"#, 1),
                text.replacen(r#""v":1"#, r#""v":1,"läter":2"#, 1),
                text.replacen(r#""v":1"#, r#""v":1,"v":1"#, 1),
                // A job not found (its name has an `a`), a newer version,
                // a payload only a full parse judges, trailing bytes.
                text.replacen(r#""job":"job""#, r#""job":"jab""#, 1),
                text.replacen(r#""v":1"#, r#""v":2"#, 1),
                text.replacen(r#""payload":7"#, r#""payload":1e400"#, 1),
                format!("{text} x"),
                // Missing members.
                text.replacen(r#""v":1,"#, "", 1),
                r#"{"v":1,"id":"i","job":"job","payload":7}"#.to_string(),
            ] {
                assert!(typed(body.as_bytes()).is_none(), "{body}");
            }
        }
    }
}
