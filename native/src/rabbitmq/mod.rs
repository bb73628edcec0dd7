//! The RabbitMQ driver (feature `rabbitmq`), on lapin with tokio.
//!
//! # Topology
//!
//! For a work queue `Q` the driver declares, idempotently and durably:
//!
//! - `Q`: a quorum queue, so the broker counts redeliveries in
//!   `x-delivery-count`. No `x-delivery-limit` unless configured (see below).
//! - `Q.hold.<ms>ms`, one per delay bucket, created on first use: a quorum
//!   queue with `x-message-ttl = <ms>`, `x-dead-letter-exchange = ""`,
//!   `x-dead-letter-routing-key = Q`, `x-dead-letter-strategy = at-least-once`
//!   and `x-overflow = reject-publish`. A retried message waits there and is
//!   dead-lettered back to `Q` when its TTL expires.
//! - the failure queue (default `Q.failed`, a quorum queue), if configured.
//!
//! Declarations are active declares on a throwaway channel: if a queue exists
//! with different arguments the broker refuses (`PRECONDITION_FAILED`, which
//! closes that channel only) and the driver reports [`ErrorKind::Config`]
//! naming the queue, rather than using a queue that behaves differently.
//! Work and failure queues are declared on the first `send` or `subscribe`;
//! hold queues when a delay first needs them.
//!
//! # Publishing
//!
//! Every publish the driver makes (dispatch, retry forwarding, failure
//! transfer) is persistent (`delivery_mode = 2`), `mandatory`, on a channel in
//! confirm mode, and waits for the broker's confirm. A dispatch that fails
//! before anything was sent, is nacked, or is returned as unroutable is
//! [`ErrorKind::NotAccepted`]; one whose connection is lost after sending or
//! whose confirm does not arrive within
//! [`confirm_timeout`](RabbitConfig::confirm_timeout) is
//! [`ErrorKind::Uncertain`].
//!
//! The confirm channel is shared by every publish of the driver and read
//! under a read lock (`RwLock<Option<Arc<Channel>>>`): concurrent dispatches
//! take no lock that serialises them. Only opening that channel, or
//! reconnecting, takes the connection's async mutex.
//!
//! ## Batches
//!
//! [`Driver::send_batch`] (behind
//! [`Dispatch::send_batch`](crate::Dispatch::send_batch)) pipelines
//! the confirms: each message is checked as a single dispatch would be (too
//! long, or a delay above the largest bucket, refuses that message alone),
//! the work queue and the hold queues the batch needs are declared once,
//! then every publish is started in order (lapin queues its frames and
//! numbers its confirm on that first poll), so the batch's frames reach the
//! socket together; then the writes are awaited (within
//! [`operation_timeout`](RabbitConfig::operation_timeout) in all) and the
//! confirms in order (within one
//! [`confirm_timeout`](RabbitConfig::confirm_timeout) in all). The answer
//! has one entry per message, in order, with the same kinds as a single
//! dispatch: refused before sending, nacked (a full queue under
//! `x-overflow = reject-publish`, say) or returned as unroutable is
//! [`ErrorKind::NotAccepted`]; written but its confirm lost with the
//! connection, or late, is [`ErrorKind::Uncertain`]. If the channel is lost
//! in the middle of a batch, a message lapin refuses because the channel is
//! already gone is `NotAccepted`, and one that may have reached the broker
//! is `Uncertain`. Messages of one batch keep their order in the queue.
//!
//! During an outage (the broker stopped or unreachable) a dispatch does not
//! wait for the operation timeout: lapin sees the connection end as soon as
//! the socket does, and the next dispatch tries to connect again, which
//! fails at once when nothing listens (connection refused), so each
//! dispatch fails within milliseconds with [`ErrorKind::NotAccepted`]. Only
//! a publish written to the socket just before the connection's loss was
//! noticed is [`ErrorKind::Uncertain`]. The connection is re-established on
//! the first dispatch once the broker is reachable again; nothing else is
//! needed. A broker that accepts TCP but does not answer makes a dispatch
//! wait up to `operation_timeout` for the connection.
//!
//! A body longer than [`max_message_bytes`](RabbitConfig::max_message_bytes)
//! (default 128 MiB, RabbitMQ's default `max_message_size`; set it to the
//! broker's value) is refused before anything is sent, with
//! [`ErrorKind::NotAccepted`]: the broker would otherwise close the
//! publishing channel. The broker counts the body only, not the headers.
//!
//! # Attempts
//!
//! A dispatch carries no count headers (absent, they read as 0). Each
//! republish carries the header [`ATTEMPTS_HEADER`] (`x-queue-attempts`):
//! the number of deliveries the message consumed before that publish. The
//! broker adds `x-delivery-count` (quorum queues; absent on a first delivery)
//! for returns since the publish, including those caused by a crashed worker
//! or a lost connection. The reported attempt is
//! `x-queue-attempts + x-delivery-count + 1`, so a message that kills its
//! worker is still counted. A second header, [`SHUTDOWNS_HEADER`]
//! (`x-queue-shutdowns`), counts the deliveries a graceful shutdown handed
//! back: they do not consume the job's cap, while a crash (no settlement,
//! so only `x-delivery-count` rises) does.
//!
//! # Retries and delays
//!
//! A retry with no (or zero) delay republishes to `Q` with the incremented
//! header; a retry with a delay republishes to the hold queue of the smallest
//! bucket at least as long as the delay (rounding up, never down). Either way
//! the original is acked only after the copy is confirmed. A delay above the
//! largest bucket is refused with [`ErrorKind::Unsupported`] (a job whose
//! backoff declares one is refused when its consumer starts) and the
//! original is kept: held unacknowledged for
//! [`RabbitConfig::refused_hold`] (30 s), then returned to the queue
//! (`basic.nack` with requeue), so nothing is lost and nothing loops; it is
//! redelivered with a higher attempt count. Any settlement that fails before
//! its frame is written (a republish or failure record the broker did not
//! confirm) is held the same way. A delayed dispatch uses
//! the same hold queues. Default buckets: 1 s, 5 s, 10 s, 30 s, 1 min, 5 min,
//! 15 min, 30 min, 1 h, 3 h, 6 h, 12 h, 24 h.
//!
//! ## What at-least-once dead-lettering guarantees
//!
//! With `x-dead-letter-strategy = at-least-once` (RabbitMQ 3.10+, quorum
//! source queue, requires `x-overflow = reject-publish` and the `stream_queue`
//! feature flag), the hold queue keeps an expired message until the work
//! queue has confirmed it, so the transfer survives a broker restart or a
//! failing node: a message is forwarded at least once. It does not
//! guarantee:
//!
//! - exactly once: a crash during the transfer can deliver a duplicate;
//! - timing: an expired message is forwarded only once it reaches the head of
//!   its hold queue (all messages of one bucket share one TTL, so this is FIFO),
//!   and while `Q` is unavailable (deleted, over a length limit) the message
//!   stays in the hold queue until it can be delivered;
//! - anything on brokers older than 3.10 or with the `stream_queue` feature
//!   flag disabled, where the broker silently falls back to at-most-once
//!   dead-lettering (a message can be lost if the broker fails mid-transfer).
//!
//! The retry copy and the ack of the original are not atomic: a crash between
//! them duplicates the message (at-least-once), never loses it. The same holds
//! for the failure record and the ack of the failed message.
//!
//! # Reject and terminal failure
//!
//! Reject is `basic.reject` without requeue (the work queue has no
//! dead-letter exchange: the message is dropped). Terminal failure publishes
//! the failure record to the failure queue with a confirm, then acks; with
//! no failure queue configured it rejects without requeue and logs the
//! record's reason at error level. The record is never larger than
//! [`RabbitConfig::max_message_bytes`]: one that would be (a message near
//! the broker's limit, kept whole in it) is cut to fit
//! ([`FailureRecord::encode_within`](jobrail::FailureRecord::encode_within)),
//! as the broker would refuse it, and refuse it again at every redelivery.
//!
//! # Failure store
//!
//! The driver is its own [`FailureStore`] and [`Admin`]
//! ([`Driver::failure_store`], [`Driver::admin`]), over the failure queue.
//! A quorum queue has no way to look at a message without taking it, so each
//! operation is a scan: a channel of its own takes messages with `basic.get`
//! and keeps them unacknowledged (hidden from everyone else) until it settles
//! them.
//!
//! - **List** takes every message, then gives them all back in one
//!   `basic.nack` with requeue: they return ahead of anything published
//!   meanwhile, in their order. Nothing is consumed.
//! - **Claim** takes messages up to the first that matches, gives back the
//!   others and keeps that one unacknowledged on its channel. The broker hands
//!   a message to one channel at a time, so no other claim (or list) sees it
//!   while the claim lives. **Remove** acks it (exactly that message);
//!   **release** nacks it back. A claim dropped without either, a lost
//!   connection or a crashed process closes the channel and the broker gives
//!   the entry back at once (so a crash mid-replay leaves the record, and
//!   the replayed copy may then be sent twice, never lost).
//! - **Remove by ids** (purge) takes every message, acks those named, gives
//!   back the rest; a claimed entry is not among them, so it stays.
//!
//! Limits: scans by one driver take turns per failure queue, but scans by
//! other processes do not: while one runs, a concurrent list sees fewer
//! entries and a claim may miss its entry (a replay then answers not found;
//! trying again finds it). A claimed entry is missing from lists until it
//! is removed or released, and a released entry goes back to the head of the
//! queue. Each `basic.get` is a round trip and a scan holds every message it
//! took, so listing is linear in the queue's length. A returned message
//! counts as a delivery (`x-delivery-count`), harmless on the failure queue,
//! which has no delivery limit. Without a failure queue configured, the
//! store answers [`ErrorKind::Config`].
//!
//! [`Admin::depth`] reports the work queue's ready messages (0 for a queue
//! that does not exist) and, as delayed, the messages of its hold queues;
//! in-flight messages are not reported (AMQP has no count of them).
//! [`Admin::delete_queue`] deletes the hold queues of every configured
//! bucket, the work queue and its failure queue (the broker cancels their
//! consumers) and forgets they were declared; a later use declares them
//! again, as does a subscription of this driver still running.
//!
//! # The broker's delivery limit
//!
//! RabbitMQ 3.x quorum queues have no default `x-delivery-limit`, and the
//! driver sets none, so the broker never drops a message before the
//! facade's cap. If [`delivery_limit`](RabbitConfig::delivery_limit) is set,
//! the driver reports it as [`Capabilities::max_deliveries`] (the limit
//! plus one: it counts returns to the queue, not deliveries), and a
//! consumer refuses to start ([`ErrorKind::Config`], naming the job) when a
//! job of its registry, or the unknown-name rule, needs more deliveries
//! than that ([`jobrail::check_delivery_limit`]). (RabbitMQ 4.0 introduced a
//! default limit of 20: set `delivery_limit` explicitly above your caps
//! there, and note that a work queue declared by an older version keeps its
//! arguments.)
//!
//! # The broker's consumer timeout
//!
//! RabbitMQ closes the channel of a delivery left unacknowledged longer than
//! its `consumer_timeout` (30 min by default, checked on a 60 s tick; 3.10
//! has no per-queue override) and redelivers the message, even though the
//! handler is still running: the settlement then fails and the work runs
//! twice. [`consumer_timeout`](RabbitConfig::consumer_timeout) tells the
//! driver the broker's value (it must be the same), and a consumer refuses
//! to start ([`ErrorKind::Config`], naming the job, its timeout and the
//! setting) with a job whose [`longest_hold`](jobrail::longest_hold) on a delivery (timeout x
//! in-process attempts, plus the tier-one waits) does not fit in it with
//! [`CONSUMER_TIMEOUT_MARGIN`] to spare. A job without a timeout is
//! accepted with a warning at start: its handler is unbounded by
//! construction, and keeping it under the broker's limit is the
//! application's business.
//!
//! # Consumption and connection loss
//!
//! A subscription opens its own channel with `basic.qos(prefetch)` and
//! consumes `Q`. Unsettled deliveries stay unacked; if the connection or
//! channel is lost the broker returns them to the queue (raising
//! `x-delivery-count`). The subscription then reconnects by itself with
//! exponential backoff (100 ms up to
//! [`max_reconnect_backoff`](RabbitConfig::max_reconnect_backoff)) and resumes
//! consuming; its `next()` returns `None` only once the driver is stopped.
//! A delivery remembers its channel: settling it after that channel is gone
//! fails with [`ErrorKind::Connection`] and is never retried on a new channel
//! (the broker has already requeued it). Dropping a delivery unsettled
//! returns it to the queue (`basic.nack` with requeue).
//!
//! ## Ack runs
//!
//! Acking one message per frame costs the broker about twice the CPU per
//! message of acking runs of them, so a subscription's channel merges acks:
//! one task per channel writes every settlement frame of that channel (acks,
//! nacks, rejects), and sends each *run* of acks as one
//! `basic.ack multiple=true` of the run's highest tag. A multiple ack of tag
//! `N` acknowledges every tag up to `N` the channel still holds, so a run
//! only ever covers tags whose settlement is an ack:
//!
//! - the channel knows every delivery it handed out and whether a
//!   settlement was requested for it; a run stops below the lowest delivery
//!   still running (its handler not finished, its settlement not requested);
//! - a run is written once half the prefetch waits (at prefetch 64, 32 acks
//!   per frame, as a hand-written loop acking every 32 messages), once no
//!   delivery is running (a lone consumer's ack goes at once), or once its
//!   oldest ack waited [`ack_gap_wait`](RabbitConfig::ack_gap_wait);
//! - nacks (retry refused, a dropped delivery) and rejects are written
//!   singly and before any run written after they were requested, so a
//!   run never swallows them; a retry's or a failure's own ack (after its
//!   copy or record was confirmed) is an ack like any other;
//! - acks above a running delivery (a gap in tag order: a slower handler)
//!   wait for it to settle, but at most
//!   [`ack_gap_wait`](RabbitConfig::ack_gap_wait) (5 ms by default) from
//!   when that delivery was handed out, and only while fewer than half the
//!   prefetch wait; past either they are written one by one, so a slow
//!   handler delays the others' acks by at most that much (and not at all
//!   once it has run longer), and waiting acks never hold the broker's
//!   whole window, which would stall the deliveries.
//!
//! A settlement's future resolves only once its frame was written (a run's
//! frame for each of its acks), or failed: [`ErrorKind::Connection`], as
//! for any settlement frame. The writer task owns the writes, so a
//! settlement whose future is dropped is still written. Closing a
//! subscription (a consumer's shutdown) writes the acks still waiting at
//! once, as does [`Driver::stop`] before it closes the connection: nothing
//! settled is left unacknowledged to be redelivered. Deliveries run
//! concurrently finish in roughly the order they were handed out, so under
//! load most acks travel in runs.
//!
//! [`Driver::stop`] closes the connection cleanly: it first writes the acks
//! the ack runs still hold, then waits (up to 2 s) for the channels of
//! dropped subscriptions to finish closing, so stopping right after a
//! consumer's shutdown does not race those closes.
//!
//! # Connection settings
//!
//! One connection per driver (re-established on demand), from
//! [`RabbitConfig::url`]: `amqp://`, or `amqps://` with the `rabbitmq-tls`
//! feature (rustls; the platform's root certificates plus any in
//! [`RabbitConfig::ca_certificates`]). The password never appears in `Debug`
//! output, errors or logs.
//!
//! # Errors
//!
//! A failed broker call keeps lapin's error as the
//! [`source`](std::error::Error::source) of the [`DriverError`], under the
//! driver's description of what it was doing:
//! `err.find::<lapin::Error>()` reaches it.
//!
//! # Layout
//!
//! `config.rs` holds the settings and their validation; `connection.rs` the
//! connection, channels, the stopped state and `stop`; `topology.rs` queue
//! names, arguments, declarations and the failure queue's records;
//! `failures.rs` the failure store and admin interface;
//! `publish.rs` every publish and batches; `delivery.rs` subscriptions,
//! deliveries and their settlement, and the consumer-timeout check;
//! `acks.rs` the ack runs (each consuming channel's settlement writer); `errors.rs` the mapping
//! of lapin's errors; `testing.rs` helpers for the test suites (feature
//! `testing`).

mod acks;
mod config;
mod connection;
mod delivery;
mod errors;
mod failures;
mod publish;
#[cfg(feature = "testing")]
mod testing;
mod topology;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;

pub use config::{RabbitConfig, DEFAULT_HEARTBEAT, DEFAULT_MAX_MESSAGE_BYTES};
use connection::Link;
use delivery::RabbitSubscription;

#[cfg(doc)]
use crate::driver::ErrorKind;
use crate::driver::{Capabilities, Driver, DriverError, Outgoing, Subscription};
use crate::failures::{Admin, FailureStore};
use crate::kit::Lifecycle;

const NAME: &str = "rabbitmq";

/// What a job's longest hold on a delivery must leave free of
/// [`RabbitConfig::consumer_timeout`]: the broker checks the timeout on a
/// 60-second tick, and the settlement after the last execution takes time too.
pub const CONSUMER_TIMEOUT_MARGIN: Duration = Duration::from_secs(60);

/// The header carrying the deliveries a message consumed before its latest
/// publish.
pub const ATTEMPTS_HEADER: &str = "x-queue-attempts";

/// The header counting deliveries a graceful shutdown handed back
/// (see [`jobrail::exceeds_crash_bound`]).
pub const SHUTDOWNS_HEADER: &str = "x-queue-shutdowns";

/// The default delay buckets, in seconds.
pub const DEFAULT_DELAY_BUCKETS: &[u64] = &[
    1,
    5,
    10,
    30,
    60,
    300,
    900,
    1800,
    3600,
    3 * 3600,
    6 * 3600,
    12 * 3600,
    24 * 3600,
];

struct Inner {
    config: RabbitConfig,
    /// Taken only to connect (or reconnect) and to open the publishing
    /// channel; a publish on a live channel reads `publisher` instead.
    link: tokio::sync::Mutex<Option<Link>>,
    /// The live publishing channel, read without waiting by every publish
    /// (concurrent dispatches share it and take no lock that serialises
    /// them).
    publisher: RwLock<Option<Arc<lapin::Channel>>>,
    /// The ack runs of consuming channels, drained by `stop`.
    ack_runs: Mutex<Vec<Weak<acks::AckRuns>>>,
    /// Queues declared on the current connection.
    declared: Mutex<HashSet<String>>,
    /// Every queue declared since the driver was made, for the test suites'
    /// clean-up.
    #[cfg(feature = "testing")]
    known: Mutex<HashSet<String>>,
    lifecycle: Lifecycle,
    /// Channels a subscription let go of. lapin closes a channel in the
    /// background when its last handle drops; [`Driver::stop`] waits for
    /// those closes before closing the connection, because a background
    /// close that starts after the connection began closing fails and takes
    /// the connection down with an error instead of a clean close.
    released: Mutex<Vec<lapin::ChannelStatus>>,
    /// Per failure queue, the turn its scans take (see `failures.rs`).
    scans: Mutex<failures::ScanTurns>,
}

/// The RabbitMQ driver. Clones share one connection.
///
/// See the [module documentation](self) for the topology and guarantees.
#[derive(Clone)]
pub struct RabbitDriver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RabbitDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitDriver")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl RabbitDriver {
    /// A driver with `config`; connects on first use. Fails with
    /// [`ErrorKind::Config`] on an invalid configuration.
    pub fn new(mut config: RabbitConfig) -> Result<Self, DriverError> {
        config.validate()?;
        Ok(RabbitDriver {
            inner: Arc::new(Inner {
                config,
                link: tokio::sync::Mutex::new(None),
                publisher: RwLock::new(None),
                ack_runs: Mutex::default(),
                declared: Mutex::default(),
                #[cfg(feature = "testing")]
                known: Mutex::default(),
                lifecycle: Lifecycle::new(NAME),
                released: Mutex::default(),
                scans: Mutex::default(),
            }),
        })
    }

    /// A driver with `config`, connected now (so a wrong URL or credentials
    /// fail here, as [`ErrorKind::Connection`]).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use jobrail::Registry;
    /// use jobrail_native::Consumer;
    /// use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), jobrail_native::DriverError> {
    /// # let registry = Registry::new();
    /// let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    /// // Fails now, as ErrorKind::Connection, when the broker is unreachable.
    /// let driver = Arc::new(RabbitDriver::connect(RabbitConfig::new(url)).await?);
    /// Consumer::builder(driver, registry).build().run_until_signal().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(config: RabbitConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        driver.connection().await?;
        Ok(driver)
    }

    /// The configuration in force (buckets sorted).
    pub fn config(&self) -> &RabbitConfig {
        &self.inner.config
    }
}

#[async_trait]
impl Driver for RabbitDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        let config = &self.inner.config;
        Capabilities {
            max_retry_delay: config.delay_buckets.last().copied(),
            refused_hold: config.refused_hold,
            delayed_dispatch: true,
            // A dispatch delay rounds down to a bucket (the consumer steps
            // over the rest), so the largest bucket is the longest step.
            max_dispatch_delay: config.delay_buckets.last().copied(),
            reject_drops: true,
            redelivery_hint: Duration::ZERO,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: Some(config.max_message_bytes),
            // x-delivery-limit counts returns: it allows one delivery more.
            max_deliveries: config.delivery_limit.map(|limit| limit.saturating_add(1)),
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.dispatch(queue, message).await
    }

    /// Pipelined: every message published, then every confirm awaited (see
    /// the module documentation, "Batches").
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        self.dispatch_batch(queue, messages).await
    }

    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        let subscription = RabbitSubscription::start(self.clone(), queue, prefetch).await?;
        Ok(Box::new(subscription))
    }

    fn failure_store(&self) -> Option<&dyn FailureStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.disconnect().await
    }

    fn check_job(&self, spec: &jobrail::JobSpec) -> Result<(), DriverError> {
        delivery::check_hold(&self.inner.config, spec)
    }
}
