//! What the registry reads of a message: its envelope, owned or borrowed
//! ([`Message`]), and what is known of its identity when it is not one
//! ([`Known`]).

use std::borrow::Cow;

use crate::model::envelope::{Envelope, EnvelopeView};

/// An envelope as the registry reads it: owned ([`Envelope::decode`]) or
/// borrowed from the body ([`EnvelopeView`], the one-pass read of
/// [`Registry::process`]).
pub(super) trait Message {
    fn job(&self) -> &str;
    fn id(&self) -> &str;
    /// The payload as a JSON value (events that include payloads).
    fn payload_value(&self) -> serde_json::Value;
    /// The owned envelope (failure records).
    fn owned(&self) -> Cow<'_, Envelope>;
}

impl Message for Envelope {
    fn job(&self) -> &str {
        &self.job
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn payload_value(&self) -> serde_json::Value {
        self.payload.clone()
    }
    fn owned(&self) -> Cow<'_, Envelope> {
        Cow::Borrowed(self)
    }
}

impl Message for EnvelopeView<'_> {
    fn job(&self) -> &str {
        &self.job
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn payload_value(&self) -> serde_json::Value {
        EnvelopeView::payload_value(self)
    }
    fn owned(&self) -> Cow<'_, Envelope> {
        Cow::Owned(self.to_envelope())
    }
}

/// What is known of a message's identity, even when its envelope did not
/// decode: events and failure records carry whatever could be read.
pub(super) struct Known {
    pub(super) job: Option<String>,
    pub(super) message_id: Option<String>,
}

impl Known {
    pub(super) fn from_envelope(envelope: &Envelope) -> Self {
        Known {
            job: Some(envelope.job.clone()),
            message_id: Some(envelope.id.clone()),
        }
    }

    /// Reads `job` and `id` from a body that is JSON but not a valid
    /// envelope (a missing field, a newer version); nothing otherwise.
    pub(super) fn from_body(body: &[u8]) -> Self {
        let fields: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).unwrap_or_default();
        let text = |name: &str| fields.get(name).and_then(|v| v.as_str()).map(String::from);
        Known {
            job: text("job"),
            message_id: text("id"),
        }
    }
}
