use std::time::Duration;

use async_trait::async_trait;

use crate::failures::{Admin, FailureStore};
pub use jobrail::ErrorKind;
use jobrail::{BoxError, BoxFuture, DeliveryHandle, Instant, Settlement, SettlementError};

/// What a backend can and cannot do. The conformance suite reads this to
/// choose expectations, and checks that unsupported operations fail with
/// [`ErrorKind::Unsupported`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Longest retry delay a settlement can request; longer ones fail with
    /// [`ErrorKind::Unsupported`] (and the message is held for
    /// [`refused_hold`](Self::refused_hold)). `None`: no limit. A consumer
    /// refuses to start when a job declares a longer delay
    /// ([`jobrail::check_retry_delays`]).
    pub max_retry_delay: Option<Duration>,
    /// The least time a message whose settlement the backend refused (a
    /// retry too long, a failure record it did not take, a settlement that
    /// timed out) stays away before it is delivered again: the backend's
    /// lease (SQS's visibility timeout, JetStream's AckWait, each renewed at
    /// half its length while a handler runs, so half of it after the last
    /// renewal), or the hold of a backend without one (the memory driver's
    /// and RabbitMQ's `refused_hold`). A refused settlement never brings a
    /// message back sooner: it never becomes a hot loop.
    pub refused_hold: Duration,
    /// Whether a message can be dispatched with a delay.
    pub delayed_dispatch: bool,
    /// The longest dispatch delay the backend holds in one message. `None`:
    /// any delay. A longer one is carried in steps: the
    /// [`Producer`](crate::Producer) writes the due time into the envelope
    /// ([`jobrail::Envelope::due_ms`]) and sends the message delayed by this
    /// much; a consumer that receives it before it is due sends it on
    /// again (the same body and id, delayed by the rest or by this much)
    /// and acknowledges the delivery, without running the handler or
    /// counting an attempt ([`jobrail::delay_remaining`]). A step costs one
    /// message, so a delay of `d` costs `ceil(d / max_dispatch_delay)`.
    /// A backend that may deliver a delayed message a little early (a delay
    /// rounded down to the hold it has) sets it too, and the consumer steps
    /// over the rest.
    pub max_dispatch_delay: Option<Duration>,
    /// Whether a rejected message is dropped (`true`) or left for the
    /// backend to redeliver later (`false`).
    pub reject_drops: bool,
    /// How long the backend waits before redelivering when the facade leaves
    /// timing to it (used for failure budgets).
    pub redelivery_hint: Duration,
    /// Whether a delivery abandoned without settlement (crash, lost
    /// connection) comes back with a higher attempt count.
    pub counts_abandoned_deliveries: bool,
    /// Whether deliveries report how many earlier deliveries a graceful
    /// shutdown handed back ([`Delivery::shutdown_returns`]). Where they do,
    /// any number of graceful shutdowns leave the job's cap untouched; where
    /// they do not, the rules allow one delivery of grace past the cap
    /// ([`jobrail::SHUTDOWN_GRACE`]).
    pub counts_shutdown_returns: bool,
    /// The largest message body, in bytes, the backend stores: the encoded
    /// envelope, which holds the payload. [`Producer`](crate::Producer)
    /// refuses a longer one before any I/O, with [`ErrorKind::NotAccepted`]
    /// and an error naming both sizes, rather than leaving the backend to
    /// refuse it (or, where the backend counts its own headers, to refuse it
    /// only sometimes). `None`: no limit known.
    pub max_message_bytes: Option<usize>,
    /// The deliveries the backend gives one message before ending it on its
    /// own, with no failure record (a configured `MaxDeliver`,
    /// `x-delivery-limit`...). `None`: it never does. A backend whose limit
    /// depends on the queue reports it through [`Driver::delivery_limit`]
    /// instead. A consumer refuses to start when a limit is below what a
    /// registered job needs ([`jobrail::check_delivery_limit`]).
    pub max_deliveries: Option<u32>,
}

impl Capabilities {
    /// Refuses a body of `len` bytes above
    /// [`max_message_bytes`](Self::max_message_bytes), before any I/O:
    /// [`ErrorKind::NotAccepted`] from `driver`, naming the limit and the
    /// size; `Ok` within the limit or without one. The
    /// [`Producer`](crate::Producer) checks every dispatch; a driver whose
    /// limit is known only once connected checks again in `send`.
    ///
    /// ```
    /// use jobrail_native::{Capabilities, ErrorKind};
    ///
    /// let mut caps = Capabilities::full();
    /// caps.max_message_bytes = Some(1024);
    /// assert!(caps.refuse_oversize("mine", 1024).is_ok());
    /// let err = caps.refuse_oversize("mine", 1025).unwrap_err();
    /// assert_eq!(err.kind(), ErrorKind::NotAccepted);
    /// assert!(err.to_string().contains("message of 1025 bytes is over the mine driver's limit of 1024 bytes"));
    /// ```
    pub fn refuse_oversize(&self, driver: &'static str, len: usize) -> Result<(), DriverError> {
        match self.max_message_bytes {
            Some(limit) if len > limit => Err(DriverError::new(
                driver,
                ErrorKind::NotAccepted,
                format!(
                    "message of {len} bytes is over the {driver} driver's limit of {limit} bytes \
                     (max_message_bytes); nothing was sent"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// A backend that supports everything with no delay limit.
    pub fn full() -> Self {
        Capabilities {
            max_retry_delay: None,
            refused_hold: jobrail::REFUSED_SETTLEMENT_HOLD,
            delayed_dispatch: true,
            max_dispatch_delay: None,
            reject_drops: true,
            redelivery_hint: Duration::ZERO,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: None,
            max_deliveries: None,
        }
    }
}

/// A message to store.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The message id (also in the envelope).
    pub id: String,
    /// The encoded envelope.
    pub body: Vec<u8>,
    /// Not deliverable before this delay has passed.
    pub delay: Option<Duration>,
}

/// A backend.
///
/// A driver stores messages ([`Driver::send`]), hands out deliveries
/// ([`Driver::subscribe`]) and carries out settlements
/// ([`Delivery::settle`]). It decides nothing: the consumer runs each
/// delivery through [`jobrail::Registry::deliver`], which decides what to
/// request and reports what the backend answered. To support a new
/// backend, implement these three traits and run the conformance suite
/// (`jobrail-conformance`) against it.
#[async_trait]
pub trait Driver: Send + Sync + 'static {
    /// A short name for logs and errors (`memory`, `rabbitmq`...).
    fn name(&self) -> &'static str;
    /// What this backend supports.
    fn capabilities(&self) -> Capabilities;
    /// Stores a message on `queue`. An error says whether the backend
    /// certainly did not take it ([`ErrorKind::NotAccepted`]) or might have
    /// ([`ErrorKind::Uncertain`]).
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError>;

    /// Stores several messages on `queue`; the answer has one result per
    /// message, in order, each saying what [`Driver::send`] would
    /// ([`ErrorKind::NotAccepted`] or [`ErrorKind::Uncertain`] on error).
    ///
    /// Drivers override it to keep the batch in flight at once (pipelined
    /// publisher confirms, PubAcks, `SendMessageBatch`); the default sends
    /// one message after another.
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let mut results = Vec::with_capacity(messages.len());
        for message in messages {
            results.push(self.send(queue, message).await);
        }
        results
    }
    /// Starts consuming `queue` with at most `prefetch` unsettled deliveries.
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError>;
    /// Releases the backend. Call after every consumer has been joined.
    async fn stop(&self) -> Result<(), DriverError>;

    /// Refuses, with [`ErrorKind::Config`], a job this backend cannot run
    /// as declared (a delivery it would hold longer than the backend allows,
    /// say). A consumer checks every registered job before it subscribes to
    /// anything. The default accepts every job.
    fn check_job(&self, spec: &jobrail::JobSpec) -> Result<(), DriverError> {
        let _ = spec;
        Ok(())
    }

    /// The deliveries the backend gives one message of `queue` before
    /// ending it on its own (see [`Capabilities::max_deliveries`]); `None`:
    /// no such limit. A consumer checks it against every registered job of
    /// the queue before subscribing. The default reports
    /// [`Capabilities::max_deliveries`]; a backend that reads the limit per
    /// queue (SQS's redrive policy) overrides it.
    async fn delivery_limit(&self, queue: &str) -> Result<Option<u32>, DriverError> {
        let _ = queue;
        Ok(self.capabilities().max_deliveries)
    }

    /// Where the backend keeps terminal failure records, for operators
    /// ([`Failures`](crate::Failures)). `None` (the default): it keeps
    /// none, and every failure-store operation fails with
    /// [`ErrorKind::Unsupported`].
    fn failure_store(&self) -> Option<&dyn FailureStore> {
        None
    }

    /// Queue depths and deletion, for operators and tests. `None` (the
    /// default): not supported.
    fn admin(&self) -> Option<&dyn Admin> {
        None
    }
}

/// A stream of deliveries from one queue.
#[async_trait]
pub trait Subscription: Send {
    /// The next delivery, or `None` once the subscription has ended for good
    /// (the driver stopped). Must be cancel-safe: dropping the future before
    /// it completes must not lose a message.
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>>;

    /// Stops receiving: the backend sends this subscription nothing more.
    /// Deliveries already handed out must stay settleable. The consumer calls
    /// it on shutdown before cancelling handlers. The default does nothing,
    /// which suits backends that only deliver when `next` asks.
    async fn close(&mut self) {}
}

/// One message reserved for this consumer.
///
/// Dropping a delivery without settling it must leave the message with the
/// backend (redelivered later), never lose it.
#[async_trait]
pub trait Delivery: Send {
    /// The raw body.
    fn body(&self) -> &[u8];
    /// The delivery attempt (first = 1), counting redeliveries after crashes
    /// where the backend can. 0 means the backend cannot count.
    fn attempt(&self) -> u32;
    /// How many earlier deliveries of this message ended in an accepted
    /// graceful-shutdown retry (a [`Settlement::Retry`] with `shutdown`
    /// set), where the backend can carry that count across redeliveries.
    /// `None` (the default): it cannot, and the rules allow a fixed grace
    /// instead ([`jobrail::SHUTDOWN_GRACE`], [`jobrail::exceeds_crash_bound`]).
    fn shutdown_returns(&self) -> Option<u32> {
        None
    }
    /// When the backend's hold on this delivery must end, if it cannot be
    /// renewed.
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// Carries out `settlement`. A [`Settlement::Fail`] carries the failure
    /// record to transfer before removing the message.
    async fn settle(self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError>;
}

/// The rules' view of a driver's delivery: what
/// [`jobrail::Registry::deliver`] runs end to end.
impl DeliveryHandle for Box<dyn Delivery> {
    fn body(&self) -> &[u8] {
        Delivery::body(self.as_ref())
    }

    fn attempt(&self) -> u32 {
        Delivery::attempt(self.as_ref())
    }

    fn shutdown_returns(&self) -> Option<u32> {
        Delivery::shutdown_returns(self.as_ref())
    }

    fn deadline(&self) -> Option<Instant> {
        Delivery::deadline(self.as_ref())
    }

    fn settle<'a>(self, settlement: &'a Settlement) -> BoxFuture<'a, Result<(), SettlementError>>
    where
        Self: 'a,
    {
        Box::pin(async move {
            Delivery::settle(self, settlement)
                .await
                .map_err(SettlementError::from)
        })
    }
}

/// An error from a driver: which driver, what kind, and the cause.
///
/// The cause is the [`source`](std::error::Error::source): the backend
/// client's own error (a `lapin::Error`, an async-nats error, an AWS SDK
/// error) where there was one, wrapped in the driver's description of what
/// it was doing. Find it with [`find`](Self::find).
#[derive(Debug, thiserror::Error)]
#[error("{driver} driver: {kind}: {source}")]
pub struct DriverError {
    driver: &'static str,
    kind: ErrorKind,
    #[source]
    source: BoxError,
}

impl DriverError {
    /// A new error.
    pub fn new(driver: &'static str, kind: ErrorKind, source: impl Into<BoxError>) -> Self {
        DriverError {
            driver,
            kind,
            source: source.into(),
        }
    }
    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The driver's name.
    pub fn driver(&self) -> &'static str {
        self.driver
    }

    /// The first error of type `E` in the chain of causes, if any: the
    /// backend client's error, say (`err.find::<lapin::Error>()`).
    pub fn find<E: std::error::Error + 'static>(&self) -> Option<&E> {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self.source.as_ref());
        while let Some(err) = cause {
            if let Some(found) = err.downcast_ref::<E>() {
                return Some(found);
            }
            cause = err.source();
        }
        None
    }

    /// This error, from a step before anything was handed to the backend
    /// (resolving the connection, declaring topology): the message was
    /// certainly not stored, so the kind becomes
    /// [`ErrorKind::NotAccepted`]. Configuration errors, a stopped driver
    /// and refusals keep their kind. The cause is kept.
    pub fn not_sent(self) -> Self {
        match self.kind {
            ErrorKind::Config | ErrorKind::Stopped | ErrorKind::NotAccepted => self,
            _ => DriverError {
                driver: self.driver,
                kind: ErrorKind::NotAccepted,
                source: Box::new(NotSent(self)),
            },
        }
    }
}

/// The cause of a [`DriverError::not_sent`]: the original error, kind and all.
#[derive(Debug, thiserror::Error)]
#[error("not sent: {0}")]
struct NotSent(#[source] DriverError);

impl From<DriverError> for SettlementError {
    fn from(err: DriverError) -> Self {
        SettlementError::new(err.kind, err)
    }
}
