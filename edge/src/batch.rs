//! The batch loop of a Cloudflare Queues consumer, written once for the
//! Worker (wasm32) and for the native test harness.
//!
//! The platform side is two small traits: [`QueueMessage`] (one message of a
//! batch: its id, attempts, body, and the explicit `ack`/`retry` calls) and
//! [`Bindings`] (sending a failure record through a Queue binding). The
//! Worker implements them on the JavaScript objects; the harness
//! ([`crate::testing`]) on an in-memory model of the platform.

use std::cell::RefCell;
use std::collections::BTreeMap;
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

    /// Sends `text` through the producer binding `binding`, not deliverable
    /// before `delay_seconds` (at most 86,400): how a delivery that is not
    /// due yet is sent on (a step of a dispatch delay beyond 24 hours). The
    /// default refuses ([`EdgeErrorKind::Unsupported`](crate::EdgeErrorKind::Unsupported)),
    /// and the consumer then hands the delivery back for the leg instead.
    fn send_text_delayed<'a>(
        &'a self,
        binding: &'a str,
        text: String,
        delay_seconds: u32,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        let _ = (binding, text, delay_seconds);
        Box::pin(std::future::ready(Err(EdgeError::new(
            crate::EdgeErrorKind::Unsupported,
            "these bindings cannot send with a delay",
        ))))
    }
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
    /// Messages not due yet (a dispatch delay beyond 24 hours) sent on to
    /// their queue, delayed by the next leg, without running: steps, not
    /// attempts.
    pub stepped: usize,
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
    /// The wall clock due times are compared with.
    pub(crate) wall: Wall,
    /// The producer binding of each consumed queue.
    pub(crate) queue_bindings: BTreeMap<String, String>,
}

/// The wall clock (Unix milliseconds) a consumer compares due times
/// ([`jobrail::Envelope::due_ms`]) with.
#[derive(Clone)]
pub(crate) enum Wall {
    /// The system's: `Date.now()` in a Worker ([`jobrail::unix_now_ms`]).
    System,
    /// The native harness's: `epoch_ms` plus the virtual time elapsed.
    #[cfg(not(target_arch = "wasm32"))]
    Virtual {
        epoch_ms: u64,
        clock: jobrail::VirtualRuntime,
    },
}

impl Wall {
    pub(crate) fn now_ms(&self) -> u64 {
        match self {
            Wall::System => jobrail::unix_now_ms(),
            #[cfg(not(target_arch = "wasm32"))]
            Wall::Virtual { epoch_ms, clock } => epoch_ms
                .saturating_add(u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX)),
        }
    }
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
            wall: Wall::System,
            queue_bindings: BTreeMap::new(),
        })
    }

    /// Sends deliveries of `queue` that are not due yet (steps of a
    /// dispatch delay beyond 24 hours) back to `queue` through the producer
    /// binding `binding`. A Worker built with [`consumer!`](crate::consumer!)
    /// takes it from wrangler.toml, whose check requires one for every
    /// consumed job queue ([`Checked::queue_binding`](crate::wrangler::Checked::queue_binding)).
    /// Without one such a delivery is handed back with the leg's delay
    /// instead (one more delivery counted by the platform).
    pub fn with_queue_binding(mut self, queue: &str, binding: &str) -> Self {
        self.queue_bindings
            .insert(queue.to_string(), binding.to_string());
        self
    }

    /// The producer binding deliveries of `queue` that are not due yet are
    /// sent back through ([`with_queue_binding`](Self::with_queue_binding)).
    pub fn queue_binding(&self, queue: &str) -> Option<&str> {
        self.queue_bindings.get(queue).map(String::as_str)
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
    ///
    /// A message whose envelope is not due yet ([`jobrail::delay_remaining`]:
    /// a dispatch delay beyond 24 hours) does not run and counts no
    /// attempt: a copy (the same body) is sent to `queue` through its
    /// producer binding ([`with_queue_binding`](Self::with_queue_binding)), delayed by the next
    /// leg (the rest, at most 24 hours), and the delivery is acknowledged.
    /// If the copy cannot be sent, the delivery is retried with the leg's
    /// delay instead (logged): it comes back when the copy would have, and
    /// the platform counts one more delivery of it.
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
                    let body = message.body();
                    let remaining = jobrail::delay_remaining(&body, self.wall.now_ms());
                    let handle = EdgeMessage {
                        consumer: self,
                        bindings,
                        body,
                        attempt: message.attempts(),
                        deadline: work_end,
                        message: &message,
                    };
                    let run = async {
                        if let Some(remaining) = remaining {
                            summary.borrow_mut().stepped += 1;
                            return self
                                .step(queue, &message, &handle.body, remaining, bindings)
                                .await
                                .map(|()| None);
                        }
                        Ok(Some(
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
                            },
                        ))
                    };
                    let delivered: Result<Option<Delivered>, EdgeError> = Tracked {
                        inner: std::pin::pin!(run),
                        id: &id,
                        progress,
                    }
                    .await;
                    progress.settled(&id);
                    // Reported to the event sink by the pipeline (the
                    // settlement log prints it), or logged by the step;
                    // counted here.
                    let refused = match &delivered {
                        Ok(Some(delivered)) => delivered.outcome.is_err(),
                        Ok(None) => false,
                        Err(_) => true,
                    };
                    if refused {
                        summary.borrow_mut().settlement_errors += 1;
                    }
                }
            })
            .await;
        summary.into_inner()
    }
}

impl EdgeConsumer {
    /// Carries on a delivery that is `remaining` from its due time: sends
    /// a copy of `body` to `queue` through its producer binding, delayed by
    /// the next leg, then acknowledges the delivery; if the copy cannot be
    /// sent, retries the delivery with the leg's delay (one more delivery
    /// counted by the platform, nothing lost). Logs one line either way. A
    /// crash between the send and the acknowledgement leaves two copies, as
    /// any at-least-once hand-over may.
    async fn step<M: QueueMessage, B: Bindings>(
        &self,
        queue: &str,
        message: &M,
        body: &[u8],
        remaining: Duration,
        bindings: &B,
    ) -> Result<(), EdgeError> {
        #[derive(serde::Deserialize)]
        struct Id {
            id: String,
        }
        let leg = crate::limits::leg_seconds(remaining);
        let envelope_id = serde_json::from_slice::<Id>(body)
            .map(|e| e.id)
            .unwrap_or_default();
        let line = |sent: bool, error: Option<&str>| {
            let entry = serde_json::json!({
                "message_id": envelope_id,
                "queue": queue,
                "remaining_ms": u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
                "leg_seconds": leg,
                "sent": sent,
                "error": error,
            });
            format!("jobrail-edge delay-step {entry}")
        };
        let sent = match self.queue_bindings.get(queue) {
            Some(binding) => {
                let text = String::from_utf8_lossy(body).into_owned();
                bindings.send_text_delayed(binding, text, leg).await
            }
            None => Err(EdgeError::new(
                crate::EdgeErrorKind::Config,
                format!(
                    "no producer binding to `{queue}` ([[queues.producers]] with queue = \"{queue}\"): \
                     a delivery that is not due yet cannot be sent on"
                ),
            )),
        };
        match sent {
            Ok(()) => {
                log_info(&line(true, None));
                message.ack()
            }
            Err(e) => {
                log_error(&line(
                    false,
                    Some(&format!("{e}; retried for the leg instead")),
                ));
                message.retry(Some(leg))
            }
        }
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

pub(crate) fn log_info(text: &str) {
    #[cfg(target_arch = "wasm32")]
    worker::console_log!("{text}");
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("{text}");
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

    /// A message with a body, recording its calls.
    struct Due {
        body: Vec<u8>,
        calls: Mutex<Vec<String>>,
    }

    impl QueueMessage for Due {
        fn id(&self) -> String {
            "due".into()
        }
        fn attempts(&self) -> u32 {
            1
        }
        fn body(&self) -> Vec<u8> {
            self.body.clone()
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

    /// Bindings that record what was sent, and cannot send with a delay
    /// unless `delays` (the trait's default refuses).
    struct Sends {
        delays: bool,
        sent: Mutex<Vec<(String, Option<u32>)>>,
    }

    impl Bindings for Sends {
        fn send_text<'a>(
            &'a self,
            binding: &'a str,
            _text: String,
        ) -> BoxFuture<'a, Result<(), EdgeError>> {
            self.sent.lock().unwrap().push((binding.into(), None));
            Box::pin(std::future::ready(Ok(())))
        }

        fn send_text_delayed<'a>(
            &'a self,
            binding: &'a str,
            text: String,
            delay_seconds: u32,
        ) -> BoxFuture<'a, Result<(), EdgeError>> {
            if !self.delays {
                return Box::pin(std::future::ready(Err(EdgeError::new(
                    crate::EdgeErrorKind::Unsupported,
                    "no delays here",
                ))));
            }
            let _ = text;
            self.sent
                .lock()
                .unwrap()
                .push((binding.into(), Some(delay_seconds)));
            Box::pin(std::future::ready(Ok(())))
        }
    }

    fn consumer() -> EdgeConsumer {
        let job = jobrail::Job::<u32>::builder("j")
            .queue("q")
            .max_deliveries(2)
            .build()
            .unwrap();
        let mut registry = Registry::new();
        registry
            .register(&job, |_: jobrail::JobContext, _: u32| async {
                panic!("a step must not run the handler")
            })
            .unwrap();
        EdgeConsumer::with_runtime(
            registry,
            EdgeConfig::default(),
            Arc::new(jobrail::VirtualRuntime::new()),
        )
        .unwrap()
    }

    /// Runs one batch of a message due in three days.
    fn step_once(consumer: &EdgeConsumer, bindings: &Sends) -> (BatchSummary, Vec<String>) {
        let mut envelope = jobrail::Envelope::new("j", serde_json::json!(1));
        envelope.due_ms = Some(jobrail::unix_now_ms() + 3 * 86_400_000);
        let message = Due {
            body: envelope.encode(),
            calls: Mutex::new(Vec::new()),
        };
        let calls = std::sync::Arc::new(message);
        let summary = futures_util::FutureExt::now_or_never(consumer.consume(
            "q",
            vec![ArcMessage(calls.clone())],
            bindings,
            consumer.runtime.now(),
            None,
        ))
        .expect("a step does not wait");
        let calls = calls.calls.lock().unwrap().clone();
        (summary, calls)
    }

    struct ArcMessage(std::sync::Arc<Due>);

    impl QueueMessage for ArcMessage {
        fn id(&self) -> String {
            self.0.id()
        }
        fn attempts(&self) -> u32 {
            self.0.attempts()
        }
        fn body(&self) -> Vec<u8> {
            self.0.body()
        }
        fn ack(&self) -> Result<(), EdgeError> {
            self.0.ack()
        }
        fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError> {
            self.0.retry(delay_seconds)
        }
    }

    #[test]
    fn a_message_not_due_is_sent_on_through_its_queues_binding_and_acknowledged() {
        let consumer = consumer().with_queue_binding("q", "Q");
        assert_eq!(consumer.queue_binding("q"), Some("Q"));
        let bindings = Sends {
            delays: true,
            sent: Mutex::new(Vec::new()),
        };
        let (summary, calls) = step_once(&consumer, &bindings);
        assert_eq!(summary.stepped, 1);
        assert_eq!(summary.settlement_errors, 0);
        assert_eq!(calls, ["ack"]);
        assert_eq!(
            *bindings.sent.lock().unwrap(),
            [("Q".to_string(), Some(86_400))]
        );
    }

    #[test]
    fn without_a_binding_or_a_delayed_send_a_step_is_retried_for_the_leg() {
        // No binding for the queue.
        let bindings = Sends {
            delays: true,
            sent: Mutex::new(Vec::new()),
        };
        let (summary, calls) = step_once(&consumer(), &bindings);
        assert_eq!(summary.stepped, 1);
        assert_eq!(calls, ["retry Some(86400)"]);
        assert!(bindings.sent.lock().unwrap().is_empty());
        // Bindings that cannot delay a send (the trait's default).
        let bindings = Sends {
            delays: false,
            sent: Mutex::new(Vec::new()),
        };
        let (_, calls) = step_once(&consumer().with_queue_binding("q", "Q"), &bindings);
        assert_eq!(calls, ["retry Some(86400)"]);
    }
}
