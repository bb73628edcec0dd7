//! One delivery, end to end ([`Registry::deliver`], [`DeliveryHandle`]).

use std::pin::pin;
use std::sync::Arc;

use futures_util::future::{select, Either};

use crate::model::backend::{ErrorKind, SettlementError};
use crate::model::cancel::CancelToken;
use crate::model::error::Panicked;
use crate::model::maybe_send::{BoxFuture, MaybeSend};
use crate::model::runtime::{Instant, Runtime};
use crate::rules::settle::{Settlement, SETTLEMENT_BUDGET};
use crate::run::registry::{Incoming, Processed, Registry};

/// A delivery as a host holds it: what the rules need to know, and the
/// means to settle it once.
///
/// Why: the native worker, the Cloudflare edge and the simulation used to
/// repeat the same steps (process, settle, report) and could drift apart.
/// [`Registry::deliver`] runs them in one order everywhere: decide with
/// [`Registry::process`], ask the host to carry the settlement out within a
/// fresh [`SETTLEMENT_BUDGET`] measured on the injected [`Runtime`] (so
/// shutdown never cuts acknowledgement of finished work short), then count
/// and emit the event only if the backend accepted. A host supplies a
/// [`DeliveryHandle`]: the facts of the delivery and the means to settle it.
pub trait DeliveryHandle: MaybeSend {
    /// The raw body.
    fn body(&self) -> &[u8];
    /// The delivery attempt (first = 1; 0 = the backend cannot count).
    fn attempt(&self) -> u32;
    /// Earlier deliveries of this message that ended in an accepted
    /// graceful-shutdown retry, where the backend carries that count across
    /// redeliveries; `None` where it cannot.
    fn shutdown_returns(&self) -> Option<u32> {
        None
    }
    /// When the host's hold on the delivery ends, if it must end.
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// Carries out `settlement`; `Ok` only once the backend accepted it.
    fn settle<'a>(self, settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a;
}

/// What [`Registry::deliver`] did with one delivery.
#[derive(Debug)]
pub struct Delivered {
    /// The decision, its settlement and the event.
    pub processed: Processed,
    /// The backend's answer to the settlement.
    pub outcome: Result<(), SettlementError>,
}

impl Registry {
    /// Runs one delivery end to end: process it, settle it through `handle`
    /// within a fresh [`SETTLEMENT_BUDGET`] (measured on `runtime`, detached
    /// from `cancel`), then count the outcome and emit its event if the
    /// backend accepted it ([`Registry::settled`]).
    pub async fn deliver<H: DeliveryHandle>(
        &self,
        queue: &str,
        handle: H,
        runtime: &Arc<dyn Runtime>,
        cancel: &CancelToken,
    ) -> Delivered {
        let delivery = delivery_of(queue, &handle);
        let processed = match guarded(self.process(delivery, runtime, cancel)).await {
            Ok(processed) => processed,
            // Handler panics are caught inside `process`; this is the last
            // line of defence (a defect of the facade itself). The delivery is
            // handed back after a pause rather than dropped, which would
            // redeliver it at once, again and again.
            Err(panicked) => self.recover(delivery, &panicked),
        };
        self.settle_and_report(handle, processed, runtime).await
    }

    /// Hands a delivery back without running it (the edge's invocation
    /// budget ran low before it started): [`Registry::defer`]'s zero-delay
    /// retry, settled and reported as [`Registry::deliver`] settles and
    /// reports.
    pub async fn hand_back<H: DeliveryHandle>(
        &self,
        queue: &str,
        handle: H,
        reason: &str,
        runtime: &Arc<dyn Runtime>,
    ) -> Delivered {
        let delivery = delivery_of(queue, &handle);
        let processed = self.defer(delivery, reason);
        self.settle_and_report(handle, processed, runtime).await
    }

    /// Settles a delivery whose execution brought the host down (a panic
    /// where panics abort): [`Registry::crashed`]'s decision, settled and
    /// reported as [`Registry::deliver`] settles and reports.
    pub async fn settle_crashed<H: DeliveryHandle>(
        &self,
        queue: &str,
        handle: H,
        panic_message: &str,
        runtime: &Arc<dyn Runtime>,
    ) -> Delivered {
        let delivery = delivery_of(queue, &handle);
        let processed = self.crashed(delivery, panic_message);
        self.settle_and_report(handle, processed, runtime).await
    }

    /// Settles through `handle` within the budget, then counts and reports.
    async fn settle_and_report<H: DeliveryHandle>(
        &self,
        handle: H,
        processed: Processed,
        runtime: &Arc<dyn Runtime>,
    ) -> Delivered {
        // Timed only when a recorder takes the duration.
        let started = crate::observe::metrics::recording().then(|| runtime.now());
        let settling = settle_within_budget(handle, &processed.settlement, runtime);
        let outcome = match guarded(settling).await {
            Ok(outcome) => outcome,
            Err(panicked) => Err(SettlementError::new(ErrorKind::Uncertain, panicked)),
        };
        let meter = self.meter(&processed.event.job, &processed.event.queue);
        if let Some(started) = started {
            let took = runtime.now().saturating_duration_since(started);
            meter.settlement_took(&processed.settlement, took);
        }
        self.report(&processed, outcome.as_ref().map(|_| ()), &meter);
        Delivered { processed, outcome }
    }
}

/// The facts of `handle`'s delivery, as the rules read them.
fn delivery_of<'a, H: DeliveryHandle>(queue: &'a str, handle: &'a H) -> Incoming<'a> {
    Incoming {
        queue,
        body: handle.body(),
        attempt: handle.attempt(),
        shutdown_returns: handle.shutdown_returns(),
        deadline: handle.deadline(),
    }
}

/// Runs `fut`, turning a panic into [`Panicked`] where panics unwind.
async fn guarded<T>(fut: impl std::future::Future<Output = T>) -> Result<T, Panicked> {
    #[cfg(panic = "unwind")]
    {
        use futures_util::FutureExt;
        std::panic::AssertUnwindSafe(fut)
            .catch_unwind()
            .await
            .map_err(|payload| {
                Panicked::new(
                    crate::model::panic::payload_text(payload.as_ref()),
                    String::new(),
                )
            })
    }
    #[cfg(not(panic = "unwind"))]
    {
        Ok(fut.await)
    }
}

async fn settle_within_budget<H: DeliveryHandle>(
    handle: H,
    settlement: &Settlement,
    runtime: &Arc<dyn Runtime>,
) -> Result<(), SettlementError> {
    let settling = pin!(handle.settle(settlement));
    match select(settling, runtime.sleep(SETTLEMENT_BUDGET)).await {
        Either::Left((outcome, _)) => outcome,
        Either::Right(_) => Err(SettlementError::new(
            ErrorKind::Uncertain,
            format!("settlement did not finish within {SETTLEMENT_BUDGET:?}"),
        )),
    }
}
