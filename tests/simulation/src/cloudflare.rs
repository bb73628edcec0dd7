//! The Cloudflare Workers Queues host: the real batch loop of the edge,
//! `jobrail_edge::EdgeConsumer::consume`, driven the way the Worker's
//! JavaScript driver (`edge/js/invocation.js`) drives it.
//!
//! The platform side is modelled here: [`SimMessage`] (a message of a batch:
//! `ack` and `retry(delaySeconds)` mark it in the [`World`]) and
//! [`SimBindings`] (the failure queue: a record sent through it is logged).
//! One invocation per batch, up to the batch size, with a work budget; at its
//! normal end every unmarked message is acknowledged by the platform.
//!
//! A panic in a handler aborts the wasm instance (wasm32 cannot unwind).
//! Here the handler reports it ([`crash`]) and never completes: from then on
//! nothing of that instance runs ([`frozen`]: no new execution starts, no
//! platform call or event takes effect), and the host drops the invocation's
//! future, as the instance is lost. Like the driver, it then builds a fresh
//! consumer (a new instance, new breakers) and calls `consume` again, with
//! the same start, on the messages of the batch not yet settled, naming the
//! panicking one as `crashed`: the edge settles it as one failed execution,
//! and the others run as if nothing had happened, without spending a
//! delivery. An execution the reset cut short runs again, from the same
//! script steps (they are put back, and the trace says so). When no message
//! can be blamed, or after more crashes than messages, every unsettled
//! message is handed back with `retry()` and the invocation returns.
//!
//! A handler that kills its worker loses the invocation for good (the
//! platform kills the isolate; nothing resumes): every unmarked message comes
//! back with a delivery spent, explicit marks stand. Each queue is consumed
//! by its own instance.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use jobrail::{BoxFuture, Clock, Runtime};
use jobrail_edge::{Bindings, EdgeConfig, EdgeConsumer, EdgeError, QueueMessage};

use crate::model::{Abandon, CfCall, World};
use crate::scenario::Scenario;
use jobrail_native::TokioRuntime;

/// The platform's retry delay when none is requested.
pub(crate) const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(2);
/// The invocation's budget.
const BUDGET: Duration = Duration::from_secs(60);
/// Kept for settlement at the end of the budget.
const RESERVE: Duration = Duration::from_secs(10);
/// The failure queue's binding.
const FAILURES: &str = "FAILURES";

/// What brought an instance down.
#[derive(Debug, Clone)]
enum Crash {
    /// A handler panicked while running `delivery` (`None`: no message
    /// can be blamed).
    Panic { delivery: Option<u64>, text: String },
    /// A handler killed the worker.
    Killed,
}

/// One wasm instance running an invocation.
#[derive(Default)]
struct Instance {
    crash: RefCell<Option<Crash>>,
}

thread_local! {
    /// The instance being polled (the runtime is single-threaded).
    static CURRENT: RefCell<Option<Rc<Instance>>> = const { RefCell::new(None) };
}

/// Whether the instance being polled has crashed: nothing more of it runs.
pub(crate) fn frozen() -> bool {
    CURRENT.with(|c| {
        c.borrow()
            .as_ref()
            .is_some_and(|i| i.crash.borrow().is_some())
    })
}

/// A handler of the instance being polled panicked with `text` while running
/// `delivery` (`text` `None`: it killed the worker). The first crash wins:
/// nothing runs after it.
pub(crate) fn crash(delivery: Option<u64>, text: Option<&str>) {
    CURRENT.with(|c| {
        if let Some(instance) = c.borrow().as_ref() {
            let mut slot = instance.crash.borrow_mut();
            if slot.is_none() {
                *slot = Some(match text {
                    Some(text) => Crash::Panic {
                        delivery,
                        text: text.to_string(),
                    },
                    None => Crash::Killed,
                });
            }
        }
    });
}

/// Polls `run` as the code of `instance` until it returns (`None`) or the
/// instance crashes.
async fn run_in<F: Future>(instance: &Rc<Instance>, run: F) -> Option<Crash> {
    let mut run = std::pin::pin!(run);
    std::future::poll_fn(|cx| {
        let previous = CURRENT.with(|c| c.replace(Some(instance.clone())));
        let polled = run.as_mut().poll(cx);
        CURRENT.with(|c| *c.borrow_mut() = previous);
        if let Some(crash) = instance.crash.borrow().clone() {
            return Poll::Ready(Some(crash));
        }
        polled.map(|_| None)
    })
    .await
}

/// A message of a batch, as the platform hands it to the Worker.
struct SimMessage {
    world: Arc<World>,
    delivery: u64,
    msg: u64,
    attempts: u32,
    body: Vec<u8>,
}

impl QueueMessage for SimMessage {
    fn id(&self) -> String {
        message_id(self.msg)
    }

    fn attempts(&self) -> u32 {
        self.attempts
    }

    fn body(&self) -> Vec<u8> {
        self.body.clone()
    }

    fn ack(&self) -> Result<(), EdgeError> {
        self.world
            .cf_call(self.delivery, CfCall::Ack { record: None })
            .map_err(|()| EdgeError::uncertain("ack", "refused (injected)"))
    }

    fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError> {
        self.world
            .cf_call(self.delivery, CfCall::Retry(delay_seconds))
            .map_err(|()| EdgeError::uncertain("retry", "refused (injected)"))
    }
}

/// The platform's id of message `n`.
fn message_id(n: u64) -> String {
    format!("m{n}")
}

/// The Worker's Queue bindings: only the failure queue.
struct SimBindings(Arc<World>);

impl Bindings for SimBindings {
    fn send_text<'a>(
        &'a self,
        binding: &'a str,
        text: String,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        Box::pin(async move {
            assert_eq!(binding, FAILURES, "the only binding");
            self.0.cf_send(&text).map_err(|()| {
                EdgeError::uncertain(&format!("failure queue `{binding}`"), "refused (injected)")
            })
        })
    }
}

/// A consumer of `queue` in a fresh instance: new registry, new breakers.
fn consumer(
    sc: &Scenario,
    world: &Arc<World>,
    clock: &Arc<TokioRuntime>,
    concurrency: usize,
) -> EdgeConsumer {
    let config = EdgeConfig {
        budget: BUDGET,
        settlement_reserve: RESERVE,
        concurrency,
        failure_queue: Some(FAILURES.to_string()),
        platform_max_retries: None,
    };
    let runtime: Arc<dyn Runtime> = clock.clone();
    EdgeConsumer::with_runtime(crate::scenario::registry(sc, world, clock), config, runtime)
        .expect("a valid edge configuration")
}

/// One queue's consumer: invocations one after another until aborted.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_queue(
    sc: Rc<Scenario>,
    world: Arc<World>,
    clock: Arc<TokioRuntime>,
    queue: String,
    batch_size: usize,
    concurrency: usize,
    incarnation: u32,
    max_retries: u32,
) {
    let bindings = SimBindings(world.clone());
    let mut edge = consumer(&sc, &world, &clock, concurrency);
    loop {
        // Wait for the first message, then take what is available (up to the batch size).
        let mut batch = Vec::new();
        loop {
            let notified = world.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match world.take(std::slice::from_ref(&queue), incarnation) {
                Ok(d) => {
                    batch.push(d);
                    break;
                }
                Err(Some(at)) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                Err(None) => notified.await,
            }
        }
        while batch.len() < batch_size {
            match world.take(std::slice::from_ref(&queue), incarnation) {
                Ok(d) => batch.push(d),
                Err(_) => break,
            }
        }
        let ids: Vec<u64> = batch.iter().map(|d| d.0).collect();
        let started = clock.now();
        world.cf_started(&ids, BUDGET - RESERVE);
        let mut crashed: Option<(String, String)> = None;
        let mut crashes = 0;
        let lost = loop {
            let unsettled = world.cf_unsettled(&ids);
            let messages: Vec<SimMessage> = batch
                .iter()
                .filter(|d| unsettled.contains(&d.0))
                .map(|(delivery, msg, body, attempts, _)| SimMessage {
                    world: world.clone(),
                    delivery: *delivery,
                    msg: *msg,
                    attempts: *attempts,
                    body: body.clone(),
                })
                .collect();
            let instance = Rc::new(Instance::default());
            let blamed = crashed
                .as_ref()
                .map(|(id, text)| (id.as_str(), text.as_str()));
            let run = edge.consume(&queue, messages, &bindings, started, blamed);
            let crash = run_in(&instance, run).await;
            if crash.is_some() {
                // The instance is gone: the next run of the invocation (or,
                // if the worker was killed, the next invocation) gets a
                // fresh one.
                edge = consumer(&sc, &world, &clock, concurrency);
            }
            match crash {
                None => break None,
                Some(Crash::Killed) => break Some(Abandon::WorkerKilled),
                Some(Crash::Panic { delivery, text }) => {
                    crashes += 1;
                    world.cf_reset(&ids, delivery, &text);
                    match delivery.filter(|_| crashes <= ids.len()) {
                        Some(d) => {
                            let n = batch.iter().find(|t| t.0 == d).expect("in the batch").1;
                            crashed = Some((message_id(n), text));
                        }
                        None => {
                            world.cf_hand_back(&ids);
                            break None;
                        }
                    }
                }
            }
        };
        world.cf_end(&ids, lost, max_retries);
    }
}
