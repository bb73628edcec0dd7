//! The batch loop of a Cloudflare Queues consumer, written once for the
//! Worker (wasm32) and for the native test harness.
//!
//! The platform side is two small traits: [`QueueMessage`] (one message of a
//! batch: its id, attempts, body, and the explicit `ack`/`retry` calls) and
//! [`Bindings`] (sending a failure record through a Queue binding). The
//! Worker implements them on the JavaScript objects; the harness
//! ([`crate::testing`]) on an in-memory model of the platform.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use jobrail::{
    BoxFuture, CancelToken, Delivered, DeliveryHandle, Instant, MaybeSend, MaybeSync, PolicyError,
    Registry, Runtime, Settlement, SettlementError,
};

use crate::error::EdgeError;
use crate::limits::delay_seconds;
use crate::settings::EdgeConfig;

/// How long a misconfigured worker hands each message back for: long
/// enough for an operator to deploy a fix, within the platform's delay limit.
pub(crate) const MISCONFIGURED_RETRY_DELAY: Duration = Duration::from_secs(12 * 60 * 60);

/// One message of a batch, as the platform hands it over.
pub trait QueueMessage: MaybeSend + MaybeSync {
    /// The platform's message id.
    fn id(&self) -> String;
    /// The delivery attempt, starting at 1.
    fn attempts(&self) -> u32;
    /// The body as bytes.
    fn body(&self) -> Vec<u8>;
    /// Marks the message acknowledged.
    fn ack(&self) -> Result<(), EdgeError>;
    /// Marks the message for redelivery after `delay_seconds` (`None`: the
    /// consumer's `retry_delay`).
    fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError>;
}

/// The Queue bindings a consumer sends through.
pub trait Bindings: MaybeSync {
    /// Sends `text` through the producer binding `binding`.
    fn send_text<'a>(
        &'a self,
        binding: &'a str,
        text: String,
    ) -> BoxFuture<'a, Result<(), EdgeError>>;
}

/// What one invocation did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchSummary {
    /// Messages in the batch.
    pub messages: usize,
    /// Messages retried at once without running because the budget ran low.
    pub deferred: usize,
    /// Settlements the platform refused (the message was kept for redelivery).
    pub settlement_errors: usize,
    /// Messages settled as the cause of an earlier crash of this invocation.
    pub crashed: usize,
}

/// Observes the loop, for the Worker's crash recovery: which message is
/// being worked on, and which are settled.
pub(crate) trait Progress {
    /// `id` is about to be worked on (`true`) or no longer is (`false`).
    fn current(&self, id: &str, active: bool);
    /// `id` has been settled (ack, retry, or deliberately left alone).
    fn settled(&self, id: &str);
}

/// A [`Progress`] that records nothing.
pub(crate) struct NoProgress;

impl Progress for NoProgress {
    fn current(&self, _: &str, _: bool) {}
    fn settled(&self, _: &str) {}
}

/// A Workers queue consumer running the registry's jobs.
pub struct EdgeConsumer {
    pub(crate) registry: Registry,
    pub(crate) config: EdgeConfig,
    pub(crate) runtime: Arc<dyn Runtime>,
}

impl EdgeConsumer {
    /// A consumer of `registry`'s jobs timed on `runtime`; refuses an
    /// inconsistent configuration. On wasm32, `EdgeConsumer::new` uses the
    /// Workers timer.
    pub fn with_runtime(
        registry: Registry,
        config: EdgeConfig,
        runtime: Arc<dyn Runtime>,
    ) -> Result<Self, PolicyError> {
        config.validate(&registry)?;
        Ok(EdgeConsumer {
            registry,
            config,
            runtime,
        })
    }

    /// The registry (for its counters).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The settings.
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// Handles one batch of `queue` that started at `started`. Never fails:
    /// every message ends acked, marked for retry, or (for a rejection) left
    /// to the platform. `crashed` names a message whose execution brought an
    /// earlier run of this invocation down, with the panic's message: it is
    /// settled by the rules without running again.
    pub async fn consume<M: QueueMessage, B: Bindings>(
        &self,
        queue: &str,
        messages: Vec<M>,
        bindings: &B,
        started: Instant,
        crashed: Option<(&str, &str)>,
    ) -> BatchSummary {
        self.consume_observed(queue, messages, bindings, started, crashed, &NoProgress)
            .await
    }

    pub(crate) async fn consume_observed<M: QueueMessage, B: Bindings, P: Progress>(
        &self,
        queue: &str,
        messages: Vec<M>,
        bindings: &B,
        started: Instant,
        crashed: Option<(&str, &str)>,
        progress: &P,
    ) -> BatchSummary {
        let invocation_end = started + self.config.budget;
        let work_end = invocation_end - self.config.settlement_reserve;
        let cancel = CancelToken::new();
        let summary = RefCell::new(BatchSummary {
            messages: messages.len(),
            ..BatchSummary::default()
        });
        futures_util::stream::iter(messages)
            .for_each_concurrent(self.config.concurrency, |message| {
                let (cancel, summary) = (&cancel, &summary);
                async move {
                    let id = message.id();
                    let handle = EdgeMessage {
                        consumer: self,
                        bindings,
                        body: message.body(),
                        attempt: message.attempts(),
                        deadline: work_end,
                        message: &message,
                    };
                    let run = async {
                        if let Some((_, panic)) = crashed.filter(|(c, _)| *c == id) {
                            summary.borrow_mut().crashed += 1;
                            self.registry
                                .settle_crashed(queue, handle, panic, &self.runtime)
                                .await
                        } else if self.runtime.now() >= work_end {
                            summary.borrow_mut().deferred += 1;
                            let reason = "invocation budget ran out before the message started";
                            self.registry
                                .hand_back(queue, handle, reason, &self.runtime)
                                .await
                        } else {
                            self.registry
                                .deliver(queue, handle, &self.runtime, cancel)
                                .await
                        }
                    };
                    let delivered: Delivered = Tracked {
                        inner: std::pin::pin!(run),
                        id: &id,
                        progress,
                    }
                    .await;
                    progress.settled(&id);
                    // Reported to the event sink by the pipeline (the
                    // settlement log prints it); counted here.
                    if delivered.outcome.is_err() {
                        summary.borrow_mut().settlement_errors += 1;
                    }
                }
            })
            .await;
        summary.into_inner()
    }
}

/// What a worker that cannot build its consumer does with a batch (a
/// wrangler.toml that does not fit the jobs, a bad operator variable): it
/// runs nothing and loses nothing. Every message is handed back with
/// [`MISCONFIGURED_RETRY_DELAY`], so
/// an operator has hours to deploy a fix before the consumer's
/// `max_retries` moves it to the dead-letter queue (which the check requires
/// on every consumer). Returns how many were handed back.
// Called by the Worker (wasm32); tested natively.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub(crate) fn hand_back_misconfigured<M: QueueMessage>(
    queue: &str,
    messages: &[M],
    error: &str,
) -> usize {
    let delay = MISCONFIGURED_RETRY_DELAY.as_secs() as u32;
    log_error(&format!(
        "jobrail-edge: the consumer of `{queue}` is misconfigured; {} message(s) handed back for {delay} s: {error}",
        messages.len()
    ));
    let mut handed_back = 0;
    for message in messages {
        match message.retry(Some(delay)) {
            Ok(()) => handed_back += 1,
            Err(e) => log_error(&format!(
                "jobrail-edge: handing back {} failed ({e}); the platform redelivers it",
                message.id()
            )),
        }
    }
    handed_back
}

/// Tells `progress` which message is being polled, so a panic can be
/// attributed to the message whose code raised it.
struct Tracked<'a, F, P: Progress> {
    inner: std::pin::Pin<&'a mut F>,
    id: &'a str,
    progress: &'a P,
}

impl<F: std::future::Future, P: Progress> std::future::Future for Tracked<'_, F, P> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let (id, progress) = (self.id, self.progress);
        progress.current(id, true);
        let polled = self.inner.as_mut().poll(cx);
        progress.current(id, false);
        polled
    }
}

pub(crate) fn log_error(text: &str) {
    #[cfg(target_arch = "wasm32")]
    worker::console_error!("{text}");
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("{text}");
}

/// One message of a batch, as the rules' pipeline sees it.
struct EdgeMessage<'c, M, B> {
    consumer: &'c EdgeConsumer,
    bindings: &'c B,
    message: &'c M,
    body: Vec<u8>,
    attempt: u32,
    deadline: Instant,
}

impl<M: QueueMessage, B: Bindings> DeliveryHandle for EdgeMessage<'_, M, B> {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }

    fn settle<'a>(self, settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a,
    {
        Box::pin(async move {
            settle(self.consumer, self.message, settlement, self.bindings)
                .await
                .map_err(SettlementError::from)
        })
    }
}

/// Carries out a settlement. On failure the message is marked for
/// redelivery after [`jobrail::REFUSED_SETTLEMENT_HOLD`], so it is never
/// lost, and never back at once: the platform has no lease of its own, and
/// the consumer's `retry_delay` (none by default) would turn a refused
/// settlement into a hot loop.
async fn settle<M: QueueMessage, B: Bindings>(
    consumer: &EdgeConsumer,
    message: &M,
    settlement: &Settlement,
    bindings: &B,
) -> Result<(), EdgeError> {
    let keep = |error: EdgeError| {
        let hold = jobrail::whole_seconds_up(jobrail::REFUSED_SETTLEMENT_HOLD);
        let _ = message.retry(Some(u32::try_from(hold).unwrap_or(u32::MAX)));
        Err(error)
    };
    match settlement {
        Settlement::Ack => message.ack(),
        Settlement::Retry { delay, .. } => match delay_seconds(*delay) {
            Ok(seconds) => message.retry(seconds),
            Err(e) => keep(e),
        },
        // No request: the platform's own policy decides (an invocation that
        // returns normally acknowledges unmarked messages).
        Settlement::Reject => Ok(()),
        Settlement::Fail(record) => {
            let text =
                String::from_utf8_lossy(&record.encode_within(crate::limits::FAILURE_RECORD_BYTES))
                    .into_owned();
            match &consumer.config.failure_queue {
                Some(binding) => match bindings.send_text(binding, text).await {
                    Ok(()) => message.ack(),
                    Err(e) => keep(e),
                },
                None => {
                    log_error(&format!(
                        "jobrail-edge: terminal failure ({}): {text}",
                        record.reason
                    ));
                    message.ack()
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Recorded {
        calls: Mutex<Vec<String>>,
    }

    impl QueueMessage for Recorded {
        fn id(&self) -> String {
            "m".into()
        }
        fn attempts(&self) -> u32 {
            1
        }
        fn body(&self) -> Vec<u8> {
            Vec::new()
        }
        fn ack(&self) -> Result<(), EdgeError> {
            self.calls.lock().unwrap().push("ack".into());
            Ok(())
        }
        fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("retry {delay_seconds:?}"));
            Ok(())
        }
    }

    #[test]
    fn a_misconfigured_worker_hands_every_message_back_for_hours() {
        let messages: Vec<Recorded> = (0..3)
            .map(|_| Recorded {
                calls: Mutex::new(Vec::new()),
            })
            .collect();
        assert_eq!(hand_back_misconfigured("q", &messages, "drift"), 3);
        for m in &messages {
            assert_eq!(*m.calls.lock().unwrap(), ["retry Some(43200)"]);
        }
    }
}
