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
//! Each republish carries the header [`ATTEMPTS_HEADER`] (`x-queue-attempts`):
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
//! largest bucket is refused with [`ErrorKind::Unsupported`] and the original
//! is returned to the queue (`basic.nack` with requeue), so nothing is lost;
//! it is redelivered with a higher attempt count. A delayed dispatch uses
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
//! [`FailureRecord::encode`] to the failure queue with a confirm, then acks;
//! with no failure queue configured it rejects without requeue and logs the
//! record's reason at error level.
//!
//! # The broker's delivery limit
//!
//! RabbitMQ 3.x quorum queues have no default `x-delivery-limit`, and the
//! driver sets none, so the broker never drops a message before the
//! facade's cap. If [`delivery_limit`](RabbitConfig::delivery_limit) is set
//! it must be at least [`largest_attempt_cap`](RabbitConfig::largest_attempt_cap),
//! otherwise the driver refuses to start. (RabbitMQ 4.0 introduced a default
//! limit of 20: set `delivery_limit` explicitly above your caps there, and
//! note that a work queue declared by an older version keeps its arguments.)
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
//! setting) with a job whose [`longest_hold`](queue::budget::longest_hold) on a delivery (timeout x
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
//! [`Driver::stop`] closes the connection cleanly: it first waits (up to 2 s)
//! for the channels of dropped subscriptions to finish closing, so stopping
//! right after a consumer's shutdown does not race those closes.
//!
//! # Connection settings
//!
//! One connection per driver (re-established on demand), from
//! [`RabbitConfig::url`]: `amqp://`, or `amqps://` with the `rabbitmq-tls`
//! feature (rustls; the platform's root certificates plus any in
//! [`RabbitConfig::ca_certificates`]). The password never appears in `Debug`
//! output, errors or logs.

mod config;
mod delivery;

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::protocol::AMQPErrorKind;
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use queue::FailureRecord;
use tokio::sync::watch;
use tracing::{debug, info, warn};

pub use config::{RabbitConfig, DEFAULT_MAX_MESSAGE_BYTES};
use delivery::RabbitSubscription;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing, Subscription};

const NAME: &str = "rabbitmq";
/// What a job's longest hold on a delivery must leave free of
/// [`RabbitConfig::consumer_timeout`]: the broker checks the timeout on a
/// 60-second tick, and the settlement after the last execution takes time too.
pub const CONSUMER_TIMEOUT_MARGIN: Duration = Duration::from_secs(60);

/// How long [`Driver::stop`] waits, after a released channel closed, for
/// lapin to remove it from the connection (see `await_released_channels`).
const CHANNEL_REMOVAL_WAIT: Duration = Duration::from_millis(50);

/// How long [`Driver::stop`] waits at most for released channels to close.
const RELEASED_CHANNELS_WAIT: Duration = Duration::from_secs(2);

/// The header carrying the deliveries a message consumed before its latest
/// publish.
pub const ATTEMPTS_HEADER: &str = "x-queue-attempts";

/// The header counting deliveries a graceful shutdown handed back
/// (see [`queue::exceeds_crash_bound`]).
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

fn config_error(message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, ErrorKind::Config, message.into())
}

fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// A broker round trip bounded by `limit`; a timeout is `kind`.
async fn bounded<T>(
    limit: Duration,
    what: &str,
    kind: ErrorKind,
    fut: impl Future<Output = lapin::Result<T>>,
) -> Result<T, DriverError> {
    answer(limit, what, kind, tokio::time::timeout(limit, fut).await)
}

/// The result of an operation bounded by `limit`, as a driver error.
fn answer<T>(
    limit: Duration,
    what: &str,
    kind: ErrorKind,
    outcome: Result<lapin::Result<T>, tokio::time::error::Elapsed>,
) -> Result<T, DriverError> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(error(kind, format!("{what}: {e}"))),
        Err(_) => Err(error(kind, format!("{what}: no answer within {limit:?}"))),
    }
}

/// Whether a released channel may still have a close in flight.
fn closing(status: &lapin::ChannelStatus) -> bool {
    matches!(
        status.state(),
        lapin::ChannelState::Connected | lapin::ChannelState::Closing
    )
}

struct Link {
    connection: Arc<Connection>,
    publisher: Option<Channel>,
}

pub(crate) struct Inner {
    config: RabbitConfig,
    link: tokio::sync::Mutex<Option<Link>>,
    declared: Mutex<HashSet<String>>,
    known: Mutex<HashSet<String>>,
    stopped: watch::Sender<bool>,
    /// Channels a subscription let go of. lapin closes a channel in the
    /// background when its last handle drops; [`Driver::stop`] waits for
    /// those closes before closing the connection, because a background
    /// close that starts after the connection began closing fails and takes
    /// the connection down with an error instead of a clean close.
    released: Mutex<Vec<lapin::ChannelStatus>>,
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

/// Which kind of queue a name is, for its arguments.
#[derive(Debug, Clone, Copy)]
enum Role {
    Work,
    Hold(Duration),
    Failure,
}

impl RabbitDriver {
    /// A driver with `config`; connects on first use. Fails with
    /// [`ErrorKind::Config`] on an invalid configuration.
    pub fn new(mut config: RabbitConfig) -> Result<Self, DriverError> {
        config.validate()?;
        let (stopped, _) = watch::channel(false);
        Ok(RabbitDriver {
            inner: Arc::new(Inner {
                config,
                link: tokio::sync::Mutex::new(None),
                declared: Mutex::default(),
                known: Mutex::default(),
                stopped,
                released: Mutex::default(),
            }),
        })
    }

    /// A driver with `config`, connected now (so a wrong URL or credentials
    /// fail here, as [`ErrorKind::Connection`]).
    pub async fn connect(config: RabbitConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        driver.connection().await?;
        Ok(driver)
    }

    /// The configuration in force (buckets sorted).
    pub fn config(&self) -> &RabbitConfig {
        &self.inner.config
    }

    /// The bucket a delay rounds up to; `None` above the largest bucket.
    pub fn bucket_for(&self, delay: Duration) -> Option<Duration> {
        self.inner
            .config
            .delay_buckets
            .iter()
            .copied()
            .find(|b| *b >= delay)
    }

    /// The hold queue of `queue` for `bucket`.
    pub fn hold_queue_name(queue: &str, bucket: Duration) -> String {
        format!("{queue}.hold.{}ms", bucket.as_millis())
    }

    /// The failure queue of `queue`, if failure queues are configured.
    pub fn failure_queue_name(&self, queue: &str) -> Option<String> {
        self.inner
            .config
            .failure_queue
            .as_ref()
            .map(|p| p.replace("{queue}", queue))
    }

    fn lock_set(set: &Mutex<HashSet<String>>) -> MutexGuard<'_, HashSet<String>> {
        set.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_stopped(&self) -> bool {
        *self.inner.stopped.borrow()
    }

    fn check_running(&self) -> Result<(), DriverError> {
        if self.is_stopped() {
            Err(error(
                ErrorKind::Stopped,
                "the rabbitmq driver has been stopped",
            ))
        } else {
            Ok(())
        }
    }

    /// The live connection, reconnecting if it was lost.
    async fn connection(&self) -> Result<Arc<Connection>, DriverError> {
        let mut link = self.inner.link.lock().await;
        self.check_running()?;
        if let Some(link) = link.as_ref() {
            if link.connection.status().connected() {
                return Ok(link.connection.clone());
            }
        }
        let config = &self.inner.config;
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio)
            .with_connection_name(LongString::from(config.connection_name.clone()));
        let connection = match tokio::time::timeout(
            config.operation_timeout,
            Connection::connect_with_config(
                &config.url,
                properties,
                lapin::tcp::OwnedTLSConfig {
                    identity: None,
                    cert_chain: config.ca_certificates.clone(),
                },
            ),
        )
        .await
        {
            Ok(Ok(connection)) => Arc::new(connection),
            Ok(Err(e)) => {
                return Err(error(
                    ErrorKind::Connection,
                    format!("cannot connect to {}: {e}", config.redacted_url()),
                ))
            }
            Err(_) => {
                return Err(error(
                    ErrorKind::Connection,
                    format!(
                        "cannot connect to {}: no answer within {:?}",
                        config.redacted_url(),
                        config.operation_timeout
                    ),
                ))
            }
        };
        info!(url = %config.redacted_url(), "connected to RabbitMQ");
        // Queues may have been deleted while we were away: declare again.
        Self::lock_set(&self.inner.declared).clear();
        *link = Some(Link {
            connection: connection.clone(),
            publisher: None,
        });
        Ok(connection)
    }

    /// A channel in confirm mode for publishing, shared by the driver.
    async fn publisher(&self) -> Result<Channel, DriverError> {
        let connection = self.connection().await?;
        let mut link = self.inner.link.lock().await;
        let Some(link) = link
            .as_mut()
            .filter(|l| Arc::ptr_eq(&l.connection, &connection))
        else {
            return Err(error(
                ErrorKind::Connection,
                "the connection was replaced; try again",
            ));
        };
        if let Some(channel) = link.publisher.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let limit = self.inner.config.operation_timeout;
        let channel = bounded(
            limit,
            "opening a channel",
            ErrorKind::Connection,
            connection.create_channel(),
        )
        .await?;
        bounded(
            limit,
            "confirm.select",
            ErrorKind::Connection,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        link.publisher = Some(channel.clone());
        Ok(channel)
    }

    fn arguments(&self, role: Role, work_queue: &str) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        match role {
            Role::Work => {
                if let Some(limit) = self.inner.config.delivery_limit {
                    args.insert(
                        "x-delivery-limit".into(),
                        AMQPValue::LongLongInt(i64::from(limit)),
                    );
                }
            }
            Role::Hold(bucket) => {
                args.insert(
                    "x-message-ttl".into(),
                    AMQPValue::LongLongInt(bucket.as_millis() as i64),
                );
                args.insert(
                    "x-dead-letter-exchange".into(),
                    AMQPValue::LongString("".into()),
                );
                args.insert(
                    "x-dead-letter-routing-key".into(),
                    AMQPValue::LongString(work_queue.into()),
                );
                args.insert(
                    "x-dead-letter-strategy".into(),
                    AMQPValue::LongString("at-least-once".into()),
                );
                args.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString("reject-publish".into()),
                );
            }
            Role::Failure => {}
        }
        args
    }

    /// Records that the caller dropped its handle on `channel`: lapin closes
    /// it in the background once no delivery holds it any more.
    pub(crate) fn release(&self, channel: &Channel) {
        self.still_closing().push(channel.status().clone());
    }

    /// The released channels whose close may still be in flight.
    fn still_closing(&self) -> MutexGuard<'_, Vec<lapin::ChannelStatus>> {
        let mut released = self
            .inner
            .released
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        released.retain(closing);
        released
    }

    /// Waits until every released channel finished closing, or `limit`.
    ///
    /// A channel reads as closed once its `close-ok` arrived, but lapin
    /// removes it from the connection afterwards, in a task of its own. If
    /// the connection closes before that task ran, lapin removes the channel
    /// twice and logs the second removal as a connection error ("invalid
    /// channel") although the close was clean. So this also waits
    /// [`CHANNEL_REMOVAL_WAIT`] once no channel is closing any more.
    async fn await_released_channels(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let pending = self.still_closing().len();
            if pending == 0 {
                // Any channel may have closed just now (a released one, or
                // one the driver closed itself after a declaration).
                tokio::time::sleep(CHANNEL_REMOVAL_WAIT).await;
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                debug!("{pending} released channel(s) still open; closing the connection anyway");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (up to `limit`) for lapin's IO loop of a closed `connection` to
    /// end. lapin answers `close` once the broker confirmed it, while its IO
    /// loop, a thread of its own, still shuts the socket down through the
    /// tokio reactor. A program that returns from `main` right after
    /// [`Driver::stop`] would shut the runtime down under that thread, which
    /// then logs an I/O error ("the Tokio context is being shut down") at
    /// error level although nothing went wrong. Only a connection no longer
    /// connected is waited for (its loop is ending), and only if no other
    /// handle shares it.
    async fn await_io_loop(connection: Arc<Connection>, limit: Duration) {
        if connection.status().connected() {
            return;
        }
        let Ok(connection) = Arc::try_unwrap(connection) else {
            debug!("the connection is still shared; not waiting for its IO loop");
            return;
        };
        match tokio::time::timeout(limit, tokio::task::spawn_blocking(move || connection.run()))
            .await
        {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => debug!("the connection's IO loop ended with: {e}"),
            Ok(Err(e)) => debug!("waiting for the connection's IO loop failed: {e}"),
            Err(_) => debug!("the connection's IO loop did not end within {limit:?}"),
        }
    }

    /// Opens a channel on the (re-established if needed) connection.
    pub(crate) async fn open_channel(&self) -> Result<Channel, DriverError> {
        let connection = self.connection().await?;
        bounded(
            self.inner.config.operation_timeout,
            "opening a channel",
            ErrorKind::Connection,
            connection.create_channel(),
        )
        .await
    }

    /// Declares `name` (once per connection) with the arguments of `role`.
    async fn declare(&self, name: &str, role: Role, work_queue: &str) -> Result<(), DriverError> {
        if Self::lock_set(&self.inner.declared).contains(name) {
            return Ok(());
        }
        let connection = self.connection().await?;
        let limit = self.inner.config.operation_timeout;
        // A refused declare closes its channel: use a throwaway one.
        let channel = bounded(
            limit,
            "opening a channel",
            ErrorKind::Connection,
            connection.create_channel(),
        )
        .await?;
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let declared = tokio::time::timeout(
            limit,
            channel.queue_declare(name, options, self.arguments(role, work_queue)),
        )
        .await;
        match declared {
            Ok(Ok(_)) => {
                let _ = tokio::time::timeout(limit, channel.close(200, "declared")).await;
            }
            Ok(Err(lapin::Error::ProtocolError(e)))
                if matches!(e.kind(), AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::PRECONDITIONFAILED)) =>
            {
                return Err(config_error(format!(
                    "queue `{name}` already exists with arguments that differ from what this driver declares \
                     ({role:?} queue: quorum{}); delete or migrate it, or align the driver's configuration. \
                     Broker said: {}",
                    match role {
                        Role::Hold(b) => format!(
                            ", x-message-ttl={}, dead-lettering at-least-once to `{work_queue}`, x-overflow=reject-publish",
                            b.as_millis()
                        ),
                        Role::Work => match self.inner.config.delivery_limit {
                            Some(l) => format!(", x-delivery-limit={l}"),
                            None => ", no x-delivery-limit".into(),
                        },
                        Role::Failure => String::new(),
                    },
                    e.get_message()
                )))
            }
            Ok(Err(e)) => return Err(error(ErrorKind::Connection, format!("declaring queue `{name}`: {e}"))),
            Err(_) => return Err(error(ErrorKind::Connection, format!("declaring queue `{name}`: no answer within {limit:?}"))),
        }
        Self::lock_set(&self.inner.declared).insert(name.to_string());
        Self::lock_set(&self.inner.known).insert(name.to_string());
        Ok(())
    }

    /// Declares the work queue and its failure queue.
    async fn declare_work(&self, queue: &str) -> Result<(), DriverError> {
        self.declare(queue, Role::Work, queue).await?;
        if let Some(failed) = self.failure_queue_name(queue) {
            self.declare(&failed, Role::Failure, queue).await?;
        }
        Ok(())
    }

    /// Declares the hold queue of `queue` for `bucket`; returns its name.
    async fn declare_hold(&self, queue: &str, bucket: Duration) -> Result<String, DriverError> {
        let name = Self::hold_queue_name(queue, bucket);
        self.declare(&name, Role::Hold(bucket), queue).await?;
        Ok(name)
    }

    /// Where a message for `queue` delayed by `delay` goes (rounding up).
    async fn route_for_delay(
        &self,
        queue: &str,
        delay: Option<Duration>,
    ) -> Result<String, DriverError> {
        match delay.filter(|d| !d.is_zero()) {
            None => Ok(queue.to_string()),
            Some(delay) => {
                match self.bucket_for(delay) {
                    Some(bucket) => self.declare_hold(queue, bucket).await,
                    None => {
                        Err(error(
                            ErrorKind::Unsupported,
                            format!(
                        "delay {delay:?} exceeds the largest delay bucket {:?} of this driver",
                        self.inner.config.delay_buckets.last().copied().unwrap_or_default()
                    ),
                        ))
                    }
                }
            }
        }
    }

    /// Publishes persistently to `routing_key` on the default exchange and
    /// waits for the confirm.
    async fn publish(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), DriverError> {
        self.check_running()?;
        let not_accepted = |e: DriverError| error(ErrorKind::NotAccepted, format!("not sent: {e}"));
        let channel = self.publisher().await.map_err(not_accepted)?;
        let properties = properties.with_delivery_mode(2);
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let limit = self.inner.config.operation_timeout;
        let confirm = match tokio::time::timeout(
            limit,
            channel.basic_publish("", routing_key, options, body, properties),
        )
        .await
        {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(
                e
                @ (lapin::Error::InvalidChannelState(_) | lapin::Error::InvalidConnectionState(_)),
            )) => {
                return Err(error(
                    ErrorKind::NotAccepted,
                    format!("publish to `{routing_key}` not sent: {e}"),
                ))
            }
            Ok(Err(e)) => {
                return Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{routing_key}` failed: {e}"),
                ))
            }
            Err(_) => {
                return Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{routing_key}` did not finish within {limit:?}"),
                ))
            }
        };
        let limit = self.inner.config.confirm_timeout;
        match tokio::time::timeout(limit, confirm).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => Err(error(
                ErrorKind::NotAccepted,
                format!(
                    "publish to `{routing_key}` was returned as unroutable ({}): does the queue exist?",
                    returned.reply_text
                ),
            )),
            Ok(Ok(Confirmation::Nack(_))) => Err(error(ErrorKind::NotAccepted, format!("the broker refused the publish to `{routing_key}` (nack)"))),
            Ok(Ok(Confirmation::NotRequested)) => {
                Err(error(ErrorKind::Uncertain, format!("publish to `{routing_key}` was sent without a confirm")))
            }
            Ok(Err(e)) => Err(error(ErrorKind::Uncertain, format!("publish to `{routing_key}` sent, confirm lost: {e}"))),
            Err(_) => Err(error(ErrorKind::Uncertain, format!("publish to `{routing_key}`: no confirm within {limit:?}"))),
        }
    }

    /// Terminal failure records on `queue`'s failure queue, oldest first.
    ///
    /// Reads every message with `basic.get` and returns them to the queue
    /// (the channel closes without acking), so the records stay. Messages
    /// that are not failure records are skipped with a warning.
    pub async fn failure_records(&self, queue: &str) -> Result<Vec<FailureRecord>, DriverError> {
        let Some(failed) = self.failure_queue_name(queue) else {
            return Ok(Vec::new());
        };
        self.declare(&failed, Role::Failure, queue).await?;
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        let mut records = Vec::new();
        while let Some(message) = bounded(
            limit,
            "basic.get",
            ErrorKind::Connection,
            channel.basic_get(&failed, BasicGetOptions { no_ack: false }),
        )
        .await?
        {
            match FailureRecord::decode(&message.delivery.data) {
                Ok(record) => records.push(record),
                Err(e) => {
                    warn!(queue = %failed, "skipping a message that is not a failure record: {}", queue::redact::json_error(&e))
                }
            }
        }
        // Closing without acking returns every message to the queue.
        let _ = tokio::time::timeout(limit, channel.close(200, "peeked")).await;
        Ok(records)
    }

    /// Messages ready on `name` (any queue), by a passive declare.
    pub async fn ready_count(&self, name: &str) -> Result<u32, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = bounded(
            limit,
            &format!("passive declare of `{name}`"),
            ErrorKind::Connection,
            channel.queue_declare(name, options, FieldTable::default()),
        )
        .await?;
        let _ = tokio::time::timeout(limit, channel.close(200, "counted")).await;
        Ok(declared.message_count())
    }

    /// Every queue this driver has declared (work, hold and failure queues).
    pub fn declared_queues(&self) -> Vec<String> {
        let mut names: Vec<String> = Self::lock_set(&self.inner.known).iter().cloned().collect();
        names.sort();
        names
    }

    /// Deletes `names` (for tests and tooling), even if in use or not empty.
    pub async fn delete_queues(&self, names: &[String]) -> Result<(), DriverError> {
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        for name in names {
            bounded(
                limit,
                &format!("deleting `{name}`"),
                ErrorKind::Connection,
                channel.queue_delete(name, QueueDeleteOptions::default()),
            )
            .await?;
            Self::lock_set(&self.inner.known).remove(name);
            Self::lock_set(&self.inner.declared).remove(name);
        }
        let _ = tokio::time::timeout(limit, channel.close(200, "deleted")).await;
        Ok(())
    }

    fn properties(id: Option<&str>, attempts: u32, shutdowns: u32) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            ATTEMPTS_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(attempts)),
        );
        headers.insert(
            SHUTDOWNS_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(shutdowns)),
        );
        let properties = BasicProperties::default().with_headers(headers);
        match id {
            Some(id) => properties.with_message_id(ShortString::from(id.to_string())),
            None => properties,
        }
    }
}

#[async_trait]
impl Driver for RabbitDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: self.inner.config.delay_buckets.last().copied(),
            delayed_dispatch: true,
            reject_drops: true,
            redelivery_hint: Duration::ZERO,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: Some(self.inner.config.max_message_bytes),
            max_deliveries: self.inner.config.delivery_limit.map(|limit| limit.saturating_add(1)),
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.check_running()?;
        let not_sent = |e: DriverError| match e.kind() {
            ErrorKind::Config
            | ErrorKind::Unsupported
            | ErrorKind::Stopped
            | ErrorKind::NotAccepted => e,
            _ => error(ErrorKind::NotAccepted, format!("not sent: {e}")),
        };
        let limit = self.inner.config.max_message_bytes;
        if message.body.len() > limit {
            return Err(error(
                ErrorKind::NotAccepted,
                format!(
                    "message of {} bytes is over the rabbitmq driver's limit of {limit} bytes \
                     (max_message_bytes, the broker's max_message_size); nothing was sent",
                    message.body.len()
                ),
            ));
        }
        self.declare_work(queue).await.map_err(not_sent)?;
        let target = self
            .route_for_delay(queue, message.delay)
            .await
            .map_err(not_sent)?;
        self.publish(
            &target,
            &message.body,
            Self::properties(Some(&message.id), 0, 0),
        )
        .await
    }

    fn check_job(&self, spec: &queue::JobSpec) -> Result<(), DriverError> {
        let limit = self.inner.config.consumer_timeout;
        let Some(hold) = queue::budget::longest_hold(spec) else {
            warn!(
                job = %spec.name,
                "job `{}` has no timeout: a handler running longer than the broker's consumer_timeout \
                 ({limit:?}) loses its channel and its message is redelivered while it still runs",
                spec.name
            );
            return Ok(());
        };
        if hold.saturating_add(CONSUMER_TIMEOUT_MARGIN) > limit {
            let timeout = spec.timeout.unwrap_or_default();
            return Err(config_error(format!(
                "job `{}` can hold a delivery for {hold:?} (timeout {timeout:?} x {} in-process attempts, \
                 plus tier-one waits), which with {CONSUMER_TIMEOUT_MARGIN:?} to spare does not fit in \
                 consumer_timeout {limit:?} (RabbitConfig::consumer_timeout, which must equal the broker's \
                 consumer_timeout setting): the broker would close the channel and redeliver the message \
                 while the handler still runs; shorten the job's timeout or tier one, or raise \
                 consumer_timeout on the broker and in the configuration",
                spec.name,
                spec.tier_one.attempts.max(1)
            )));
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.check_running()?;
        self.declare_work(queue).await?;
        let mut subscription = RabbitSubscription::new(self.clone(), queue, prefetch);
        subscription.open().await?;
        Ok(Box::new(subscription))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stopped.send_replace(true);
        let link = self.inner.link.lock().await.take();
        let Some(Link {
            connection,
            publisher,
        }) = link
        else {
            return Ok(());
        };
        let limit = self.inner.config.operation_timeout;
        self.await_released_channels(limit.min(RELEASED_CHANNELS_WAIT))
            .await;
        let mut closed = Ok(());
        if connection.status().connected() {
            let outcome =
                tokio::time::timeout(limit, connection.close(200, "driver stopped")).await;
            // A channel whose last handle dropped just now (a delivery
            // settled by a task still running) was being closed in the
            // background when the connection began closing; lapin then
            // ends the connection with that error instead of a clean
            // close. The connection is gone either way and everything
            // settled before `stop` was already on the wire.
            closed = match &outcome {
                Ok(Err(lapin::Error::InvalidChannelState(state)))
                    if !connection.status().connected() =>
                {
                    debug!("connection ended without a clean close (a channel was {state:?})");
                    Ok(())
                }
                _ => answer(
                    limit,
                    "closing the connection",
                    ErrorKind::Connection,
                    outcome,
                ),
            };
        }
        drop(publisher);
        Self::await_io_loop(connection, limit).await;
        closed
    }
}
