//! Outcome events ([`Event`], [`EventSink`]).

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::model::backend::SettlementError;
use crate::model::failure::Failure;
use crate::model::maybe_send::{MaybeSend, MaybeSync};
use crate::observe::stats::Resolution;

/// One accepted outcome.
///
/// An event reports a settlement the backend *accepted*: `failed` is emitted
/// only after the terminal settlement went through, and a settlement the
/// backend refused produces no outcome event at all (only
/// [`EventSink::settlement_failed`]). Payloads are left out unless the
/// application opts in, because they may hold personal data or secrets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    /// Job name (the unknown name for unknown-name events; empty when the
    /// envelope did not decode). Shared with the registered job, as is
    /// the queue's name: an event copies neither.
    pub job: Arc<str>,
    /// Message id (empty when the envelope did not decode).
    pub message_id: String,
    /// The queue.
    pub queue: Arc<str>,
    /// The delivery attempt reported by the driver.
    pub attempt: u32,
    /// Handler executions in this delivery.
    pub executions: u32,
    /// What happened.
    pub kind: EventKind,
    /// The payload, only when the application opted in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
}

/// The outcome an event reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// Acknowledged after success.
    Succeeded {
        /// Which tier resolved it.
        resolution: Resolution,
    },
    /// A retry was accepted.
    Retried {
        /// The requested delay (`None`: driver timing).
        delay: Option<Duration>,
        /// The error that caused it.
        error: String,
        /// Whether this was the shutdown rule (zero delay, cap skipped).
        shutdown: bool,
    },
    /// A rejection was accepted.
    Rejected {
        /// The error.
        error: String,
    },
    /// A terminal failure was accepted.
    Failed {
        /// Why.
        failure: Failure,
    },
}

impl EventKind {
    /// A short name: `succeeded`, `retried`, `rejected` or `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Succeeded { .. } => "succeeded",
            EventKind::Retried { .. } => "retried",
            EventKind::Rejected { .. } => "rejected",
            EventKind::Failed { .. } => "failed",
        }
    }
}

/// Receives events. Must be cheap and must not block.
pub trait EventSink: MaybeSend + MaybeSync {
    /// An accepted outcome.
    fn emit(&self, event: &Event);
    /// The backend refused a settlement (or did not confirm it); `event` is
    /// what would have been emitted. Not an outcome: the delivery stays with
    /// the backend. [`SettlementError::kind`] says what kind of failure it was.
    fn settlement_failed(&self, event: &Event, error: &SettlementError) {
        let _ = (event, error);
    }
}
