//! The batch loop of a Workers queue consumer.

use std::cell::RefCell;
use std::sync::{Arc, Once};

use futures_util::StreamExt;
use queue::{
    BoxFuture, CancelToken, DeliveryHandle, Instant, PolicyError, Registry, Runtime, Settlement,
    SettlementError,
};
use wasm_bindgen::JsCast;
use worker::{console_error, worker_sys, Env};

use crate::js::{body_bytes, describe, retry_options, JsMessage};
use crate::plan::{delay_seconds, EdgeConfig, EdgeError, EdgeErrorKind};
use crate::runtime::WorkersRuntime;

thread_local! {
    /// Messages of the current invocation not yet settled. If handler code
    /// panics (wasm32 cannot unwind, so the instance is lost), the panic
    /// hook marks each of them for redelivery, so none is left to the
    /// platform's implicit handling of a failed invocation.
    static UNSETTLED: RefCell<Vec<JsMessage>> = const { RefCell::new(Vec::new()) };
}

static HOOK: Once = Once::new();

fn install_panic_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let pending = UNSETTLED.with(|u| std::mem::take(&mut *u.borrow_mut()));
            for message in &pending {
                let _ = message.retry(&wasm_bindgen::JsValue::UNDEFINED);
            }
            console_error!(
                "queue-edge: handler panicked ({info}); {} unsettled message(s) marked for redelivery",
                pending.len()
            );
            previous(info);
        }));
    });
}

fn forget(message: &JsMessage) {
    UNSETTLED.with(|u| u.borrow_mut().retain(|m| !js_sys::Object::is(m, message)));
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
}

/// A Workers queue consumer running the registry's jobs.
pub struct EdgeConsumer {
    registry: Registry,
    config: EdgeConfig,
    runtime: Arc<dyn Runtime>,
}

impl EdgeConsumer {
    /// A consumer of `registry`'s jobs; refuses an inconsistent configuration.
    pub fn new(registry: Registry, config: EdgeConfig) -> Result<Self, PolicyError> {
        config.validate(&registry)?;
        install_panic_hook();
        Ok(EdgeConsumer {
            registry,
            config,
            runtime: Arc::new(WorkersRuntime),
        })
    }

    /// The registry (for its counters).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Handles one batch. Never fails: every message ends acked, marked for
    /// retry, or (for a rejection) left to the platform.
    pub async fn consume(&self, batch: &worker_sys::MessageBatch, env: &Env) -> BatchSummary {
        let started = self.runtime.now();
        let queue: String = batch.queue().map(String::from).unwrap_or_default();
        let messages: Vec<JsMessage> = batch
            .messages()
            .map(|a| a.iter().map(|m| m.unchecked_into::<JsMessage>()).collect())
            .unwrap_or_default();
        UNSETTLED.with(|u| u.borrow_mut().extend(messages.iter().cloned()));
        let invocation_end = started + self.config.budget;
        let work_end = invocation_end - self.config.settlement_reserve;
        let cancel = CancelToken::new();
        let summary = RefCell::new(BatchSummary {
            messages: messages.len(),
            ..BatchSummary::default()
        });
        futures_util::stream::iter(messages)
            .for_each_concurrent(self.config.concurrency, |message| {
                let (queue, cancel, summary) = (&queue, &cancel, &summary);
                async move {
                    let handle = EdgeMessage {
                        consumer: self,
                        env,
                        body: body_bytes(&message.body()),
                        attempt: message.attempts() as u32,
                        deadline: work_end,
                        message: message.clone(),
                    };
                    let delivered = if self.runtime.now() >= work_end {
                        summary.borrow_mut().deferred += 1;
                        let reason = "invocation budget ran out before the message started";
                        self.registry
                            .hand_back(queue, handle, reason, &self.runtime)
                            .await
                    } else {
                        self.registry
                            .deliver(queue, handle, &self.runtime, cancel)
                            .await
                    };
                    forget(&message);
                    if let Err(e) = &delivered.outcome {
                        summary.borrow_mut().settlement_errors += 1;
                        console_error!("queue-edge: settlement of {} failed: {e}", message.id());
                    }
                }
            })
            .await;
        summary.into_inner()
    }
}

/// One message of a batch, as the rules' pipeline sees it.
struct EdgeMessage<'c> {
    consumer: &'c EdgeConsumer,
    env: &'c Env,
    message: JsMessage,
    body: Vec<u8>,
    attempt: u32,
    deadline: Instant,
}

impl DeliveryHandle for EdgeMessage<'_> {
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
            settle(self.consumer, &self.message, settlement, self.env)
                .await
                .map_err(SettlementError::from)
        })
    }
}

/// Carries out a settlement. On failure the message is marked for
/// redelivery with the consumer's default delay, so it is never lost.
async fn settle(
    consumer: &EdgeConsumer,
    message: &JsMessage,
    settlement: &Settlement,
    env: &Env,
) -> Result<(), EdgeError> {
    let uncertain = |what: &str, e: wasm_bindgen::JsValue| {
        EdgeError::new(
            EdgeErrorKind::Uncertain,
            format!("{what}: {}", describe(&e)),
        )
    };
    let keep = |error: EdgeError| {
        let _ = message.retry(&wasm_bindgen::JsValue::UNDEFINED);
        Err(error)
    };
    match settlement {
        Settlement::Ack => message.ack().map_err(|e| uncertain("ack", e)),
        Settlement::Retry { delay, .. } => match delay_seconds(*delay) {
            Ok(seconds) => message
                .retry(&retry_options(seconds))
                .map_err(|e| uncertain("retry", e)),
            Err(e) => keep(e),
        },
        // No request: the platform's own policy decides (an invocation that
        // returns normally acknowledges unmarked messages).
        Settlement::Reject => Ok(()),
        Settlement::Fail(record) => {
            let text = String::from_utf8_lossy(&record.encode()).into_owned();
            match &consumer.config.failure_queue {
                Some(binding) => {
                    let sent = match env.queue(binding) {
                        Ok(q) => q
                            .send(
                                worker::MessageBuilder::new(text)
                                    .content_type(worker::QueueContentType::Text)
                                    .build(),
                            )
                            .await
                            .map_err(|e| {
                                EdgeError::new(
                                    EdgeErrorKind::Uncertain,
                                    format!("failure queue `{binding}`: {e}"),
                                )
                            }),
                        Err(e) => Err(EdgeError::new(
                            EdgeErrorKind::Config,
                            format!("failure queue binding `{binding}`: {e}"),
                        )),
                    };
                    match sent {
                        Ok(()) => message.ack().map_err(|e| uncertain("ack", e)),
                        Err(e) => keep(e),
                    }
                }
                None => {
                    console_error!("queue-edge: terminal failure ({}): {text}", record.reason);
                    message.ack().map_err(|e| uncertain("ack", e))
                }
            }
        }
    }
}
