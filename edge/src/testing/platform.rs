//! The platform side the Worker's batch loop talks to inside the harness:
//! the messages of a batch, the producer bindings, and what the consumer
//! reported, gathered for [`CloudflareQueues`](super::CloudflareQueues).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{BoxFuture, Event, EventSink, SettlementError, VirtualRuntime};

use super::lock;
use super::report::{Call, EventRecord};
use crate::batch::{Bindings, Progress, QueueMessage};
use crate::error::{EdgeError, EdgeErrorKind};
use crate::wrangler::Wrangler;

/// What the consumer did during an invocation, gathered for the harness.
#[derive(Default)]
pub(super) struct Shared {
    /// The message whose work is being polled.
    pub(super) current: Option<String>,
    pub(super) observed: Vec<EventRecord>,
    pub(super) outbox: Vec<Sent>,
    pub(super) send_failures: BTreeMap<String, usize>,
}

/// A message sent through a producer binding during an invocation.
pub(super) struct Sent {
    /// The message whose settlement sent it.
    pub(super) message: Option<String>,
    pub(super) queue: String,
    pub(super) body: Vec<u8>,
    pub(super) at: Duration,
    /// The send's delay (a step of a dispatch delay); `None`: none.
    pub(super) delay: Option<Duration>,
}

/// Records events for the harness, then passes them on.
pub(super) struct Recorder {
    pub(super) inner: Option<Arc<dyn EventSink>>,
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) clock: VirtualRuntime,
}

impl Recorder {
    fn record(&self, event: &Event, refused: Option<String>) {
        let mut shared = lock(&self.shared);
        let message = shared.current.clone().unwrap_or_default();
        shared.observed.push(EventRecord {
            message,
            at: self.clock.elapsed(),
            event: event.clone(),
            refused,
        });
    }
}

impl EventSink for Recorder {
    fn emit(&self, event: &Event) {
        self.record(event, None);
        if let Some(inner) = &self.inner {
            inner.emit(event);
        }
    }

    fn settlement_failed(&self, event: &Event, error: &SettlementError) {
        self.record(event, Some(error.to_string()));
        if let Some(inner) = &self.inner {
            inner.settlement_failed(event, error);
        }
    }
}

/// Knows which message's work is running, so events and sends are
/// attributed to it (the Worker uses the same hook for crash recovery).
pub(super) struct Tracker(pub(super) Arc<Mutex<Shared>>);

impl Progress for Tracker {
    fn current(&self, id: &str, active: bool) {
        lock(&self.0).current = active.then(|| id.to_string());
    }

    fn settled(&self, _: &str) {}
}

/// One message of a batch.
pub(super) struct HarnessMessage {
    pub(super) id: String,
    pub(super) attempts: u32,
    pub(super) body: Vec<u8>,
    pub(super) call: Arc<Mutex<Option<(Call, Duration)>>>,
    pub(super) clock: VirtualRuntime,
}

impl HarnessMessage {
    /// The platform keeps the first call and ignores the rest.
    pub(super) fn call(&self, call: Call) {
        let mut slot = lock(&self.call);
        if slot.is_none() {
            *slot = Some((call, self.clock.elapsed()));
        }
    }
}

impl QueueMessage for HarnessMessage {
    fn id(&self) -> String {
        self.id.clone()
    }

    fn attempts(&self) -> u32 {
        self.attempts
    }

    fn body(&self) -> Vec<u8> {
        self.body.clone()
    }

    fn ack(&self) -> Result<(), EdgeError> {
        self.call(Call::Ack);
        Ok(())
    }

    fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError> {
        self.call(Call::Retry { delay_seconds });
        Ok(())
    }
}

/// The worker's producer bindings.
pub(super) struct HarnessBindings<'w> {
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) wrangler: &'w Wrangler,
    pub(super) clock: VirtualRuntime,
}

impl HarnessBindings<'_> {
    fn send(&self, binding: &str, text: String, delay: Option<Duration>) -> Result<(), EdgeError> {
        let Some(queue) = self.wrangler.producer_binding(binding) else {
            return Err(EdgeError::new(
                EdgeErrorKind::Config,
                format!("queue binding `{binding}`: no such queue binding"),
            ));
        };
        let mut shared = lock(&self.shared);
        if let Some(left) = shared.send_failures.get_mut(binding).filter(|n| **n > 0) {
            *left -= 1;
            return Err(EdgeError::uncertain(
                &format!("queue `{binding}`"),
                "the send failed (CloudflareQueues::fail_sends)",
            ));
        }
        let message = shared.current.clone();
        shared.outbox.push(Sent {
            message,
            queue: queue.to_string(),
            body: text.into_bytes(),
            at: self.clock.elapsed(),
            delay,
        });
        Ok(())
    }
}

impl Bindings for HarnessBindings<'_> {
    fn send_text<'a>(
        &'a self,
        binding: &'a str,
        text: String,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        Box::pin(std::future::ready(self.send(binding, text, None)))
    }

    fn send_text_delayed<'a>(
        &'a self,
        binding: &'a str,
        text: String,
        delay_seconds: u32,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        let delay = Duration::from_secs(u64::from(delay_seconds));
        Box::pin(std::future::ready(self.send(binding, text, Some(delay))))
    }
}
