//! A Cloudflare Workers Queues host mirroring `edge/src/consumer.rs`:
//! batches per queue, each message through `Registry::deliver` (or
//! `Registry::defer` once the invocation's work budget is spent), explicit
//! acknowledgement marks, implicit acknowledgement when an invocation returns
//! normally, and an aborted invocation when a handler panics (wasm cannot
//! unwind): every message of the batch not explicitly acknowledged comes back.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use queue::{
    BoxFuture, CancelToken, Clock, Delivery, DeliveryHandle, Registry, Runtime, Settlement,
    SettlementError,
};
use tokio::sync::Notify;

use crate::model::{Abandon, World};
use queue_native::TokioRuntime;

/// The platform's retry delay when none is requested.
pub(crate) const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(2);
/// The invocation's budget.
const BUDGET: Duration = Duration::from_secs(60);
/// Kept for settlement at the end of the budget.
const RESERVE: Duration = Duration::from_secs(10);

thread_local! {
    /// The invocation holding each delivery (the runtime is single-threaded).
    static ABORT: RefCell<BTreeMap<u64, Arc<Notify>>> = const { RefCell::new(BTreeMap::new()) };
}

/// A handler "panicked" on wasm: the invocation holding `delivery` is lost.
pub(crate) fn abort_invocation(delivery: Option<u64>) {
    ABORT.with(|a| {
        if let Some(n) = delivery.and_then(|d| a.borrow().get(&d).cloned()) {
            n.notify_one();
        }
    });
}

struct CfHandle {
    world: Arc<World>,
    id: u64,
    body: Vec<u8>,
    attempt: u32,
    deadline: queue::Instant,
}

impl DeliveryHandle for CfHandle {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn deadline(&self) -> Option<queue::Instant> {
        Some(self.deadline)
    }

    fn settle<'a>(self, settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a,
    {
        Box::pin(async move {
            match self.world.settle(self.id, settlement).await {
                Ok(()) => Ok(()),
                Err((kind, hint)) => {
                    self.world
                        .cf_refused(self.id, hint.unwrap_or(Abandon::Unsupported));
                    Err(SettlementError::new(kind, format!("refused: {kind}")))
                }
            }
        })
    }
}

/// One queue's consumer: invocations one after another until aborted.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_queue(
    world: Arc<World>,
    registry: Arc<Registry>,
    clock: Arc<TokioRuntime>,
    queue: String,
    batch_size: usize,
    concurrency: usize,
    incarnation: u32,
    max_retries: u32,
) {
    let runtime: Arc<dyn Runtime> = clock.clone();
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
        let work_end = started + (BUDGET - RESERVE);
        let abort = Arc::new(Notify::new());
        ABORT.with(|a| {
            let mut a = a.borrow_mut();
            for id in &ids {
                a.insert(*id, abort.clone());
            }
        });
        let cancel = CancelToken::new();
        let invocation = futures_util::stream::iter(batch).for_each_concurrent(
            concurrency,
            |(id, _n, body, attempt, _sr)| {
                let (world, registry, runtime, queue, cancel) =
                    (world.clone(), &registry, &runtime, &queue, &cancel);
                async move {
                    let handle = CfHandle {
                        world,
                        id,
                        body,
                        attempt,
                        deadline: work_end,
                    };
                    if runtime.now() >= work_end {
                        let delivery = Delivery {
                            queue,
                            body: &handle.body.clone(),
                            attempt,
                            shutdown_returns: None,
                            deadline: Some(work_end),
                        };
                        let processed = registry.defer(
                            delivery,
                            "invocation budget ran out before the message started",
                        );
                        let outcome = handle.settle(&processed.settlement).await;
                        registry.settled(&processed, outcome.as_ref().map(|_| ()));
                    } else {
                        let _ = registry.deliver(queue, handle, runtime, cancel).await;
                    }
                }
            },
        );
        let aborted = tokio::select! {
            _ = invocation => false,
            _ = abort.notified() => true,
        };
        ABORT.with(|a| {
            let mut a = a.borrow_mut();
            for id in &ids {
                a.remove(id);
            }
        });
        world.cf_end(&ids, aborted, max_retries);
    }
}
