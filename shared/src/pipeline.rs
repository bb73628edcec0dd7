//! One delivery, end to end ([`Registry::deliver`], [`DeliveryHandle`]).

use std::error::Error as StdError;
use std::fmt;
use std::pin::pin;
use std::sync::Arc;

use futures_util::future::{select, Either};

use crate::cancel::CancelToken;
use crate::error::{BoxError, Panicked};
use crate::maybe_send::{BoxFuture, MaybeSend};
use crate::registry::{Incoming, Processed, Registry};
use crate::runtime::{Instant, Runtime};
use crate::settle::{Settlement, SETTLEMENT_BUDGET};

/// What kind of failure a settlement (or any backend request) met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The backend certainly did not take the message or settlement.
    NotAccepted,
    /// The request was sent but its result is unknown: the backend may have
    /// acted on it. Repeating a dispatch may enqueue a second copy.
    Uncertain,
    /// The backend cannot do this (a delay too long, delayed dispatch...).
    Unsupported,
    /// The driver or the backend's existing topology is misconfigured.
    Config,
    /// The connection to the backend failed or was lost.
    Connection,
    /// The driver has been stopped.
    Stopped,
    /// The payload could not be encoded.
    Encode,
    /// What the request names does not exist (a failure record that is
    /// gone, say).
    NotFound,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::NotAccepted => "not accepted",
            ErrorKind::Uncertain => "outcome uncertain",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Config => "configuration error",
            ErrorKind::Connection => "connection error",
            ErrorKind::Stopped => "driver stopped",
            ErrorKind::Encode => "encoding error",
            ErrorKind::NotFound => "not found",
        })
    }
}

/// A settlement the backend did not confirm: its kind and the host's error.
#[derive(Debug)]
pub struct SettlementError {
    kind: ErrorKind,
    source: BoxError,
}

impl SettlementError {
    /// A settlement error of `kind` caused by `source` (the driver's error).
    pub fn new(kind: ErrorKind, source: impl Into<BoxError>) -> Self {
        SettlementError {
            kind,
            source: source.into(),
        }
    }

    /// What kind of failure it was.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The host's own error, for matching or downcasting.
    pub fn get_ref(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.source.as_ref()
    }
}

impl fmt::Display for SettlementError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl StdError for SettlementError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(self.source.as_ref())
    }
}

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
        let started = crate::metrics::recording().then(|| runtime.now());
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
                Panicked::new(crate::panic::payload_text(payload.as_ref()), String::new())
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
