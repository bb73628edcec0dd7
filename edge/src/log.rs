//! The default event sink: one structured line per settlement, so
//! `wrangler dev` and `wrangler tail` show every outcome with no code.

use std::sync::Arc;

use jobrail::{Event, EventSink, SettlementError};

/// Logs each settlement as one JSON line prefixed `jobrail-edge settlement`
/// (failed settlements prefixed `jobrail-edge settlement-failed`), then
/// forwards the event to the application's own sink, if it set one.
pub struct LogSink {
    inner: Option<Arc<dyn EventSink>>,
}

impl LogSink {
    /// A sink that logs, then forwards to `inner`.
    pub fn new(inner: Option<Arc<dyn EventSink>>) -> Self {
        LogSink { inner }
    }

    /// The line logged for an accepted settlement.
    pub fn line(event: &Event) -> String {
        format!(
            "jobrail-edge settlement {}",
            serde_json::to_string(event).unwrap_or_default()
        )
    }

    /// The line logged for a settlement the platform did not accept.
    pub fn failed_line(event: &Event, error: &SettlementError) -> String {
        let entry = serde_json::json!({
            "event": event,
            "kind": error.kind().to_string(),
            "error": error.to_string(),
        });
        format!("jobrail-edge settlement-failed {entry}")
    }
}

impl EventSink for LogSink {
    fn emit(&self, event: &Event) {
        emit_line(&LogSink::line(event), false);
        if let Some(inner) = &self.inner {
            inner.emit(event);
        }
    }

    fn settlement_failed(&self, event: &Event, error: &SettlementError) {
        emit_line(&LogSink::failed_line(event, error), true);
        if let Some(inner) = &self.inner {
            inner.settlement_failed(event, error);
        }
    }
}

fn emit_line(line: &str, error: bool) {
    #[cfg(target_arch = "wasm32")]
    {
        if error {
            worker::console_error!("{line}");
        } else {
            worker::console_log!("{line}");
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = error;
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail::{EventKind, Resolution};

    #[test]
    fn a_settlement_is_one_json_line() {
        let event = Event {
            job: "report".into(),
            message_id: "m1".into(),
            queue: "reports".into(),
            attempt: 2,
            executions: 1,
            kind: EventKind::Succeeded {
                resolution: Resolution::FirstAttempt,
            },
            payload: None,
        };
        let line = LogSink::line(&event);
        assert!(!line.contains('\n'));
        let json: serde_json::Value =
            serde_json::from_str(line.strip_prefix("jobrail-edge settlement ").unwrap()).unwrap();
        assert_eq!(json["job"], "report");
        assert_eq!(json["attempt"], 2);
        assert_eq!(json["queue"], "reports");
    }
}
