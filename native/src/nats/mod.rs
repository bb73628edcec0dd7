//! The NATS JetStream driver (feature `nats`), on async-nats.
//!
//! # Topology
//!
//! For a queue `Q` the driver declares, idempotently, on the first `send` or
//! `subscribe` through a driver:
//!
//! - the work stream `<stream_prefix>_Q` (default `QUEUE_Q`; `.`, `*`, `>`,
//!   `/`, `\` and whitespace in `Q` become `_`) holding the one subject
//!   `<subject_prefix>.Q` (default `queue.Q`), with work-queue retention
//!   (a message is removed once acknowledged or terminated) and file storage.
//!   One stream per queue keeps queues independent: deleting, purging or
//!   inspecting one never touches another.
//! - the durable pull consumer [`consumer_name`](NatsConfig::consumer_name)
//!   (default `queue-worker`) on it, shared by every worker of `Q`: explicit
//!   ack, deliver-all, [`ack_wait`](NatsConfig::ack_wait) (default 30 s) and
//!   `MaxDeliver = -1` (unlimited) unless [`max_deliver`](NatsConfig::max_deliver)
//!   is set.
//! - if a failure subject is configured (default `<subject_prefix>.Q.failed`),
//!   the failure stream `<work stream>_failed` holding that subject, with
//!   limits retention and file storage, so failure records persist until an
//!   operator removes them.
//!
//! A stream or consumer that already exists is inspected rather than
//! overwritten: if its subjects, retention or storage (stream), or its ack
//! policy, AckWait, MaxDeliver, deliver policy or filter (consumer) differ
//! from what this driver declares, the driver reports [`ErrorKind::Config`]
//! naming it, rather than using something that behaves differently. Name
//! clashes (two queues whose names differ only in replaced characters, or a
//! subject owned by another stream) are reported the same way.
//!
//! # Publishing
//!
//! Every publish (dispatch, failure record) is a JetStream publish that waits
//! for the server's `PubAck`, within
//! [`operation_timeout`](NatsConfig::operation_timeout). A dispatch carries
//! its message id as `Nats-Msg-Id`, so repeating an uncertain dispatch
//! within the stream's duplicate window (2 minutes) stores one copy. A
//! publish that fails before it is sent (not connected, the client's queue
//! full), finds no stream (no responders) or is refused by the server is
//! [`ErrorKind::NotAccepted`]; one whose `PubAck` does not arrive (timeout,
//! connection lost) is [`ErrorKind::Uncertain`]. JetStream 2.9 has no
//! scheduled messages: a dispatch with a delay is refused with
//! [`ErrorKind::Unsupported`] and `delayed_dispatch` is `false`.
//!
//! A dispatch body may be at most the server's `max_payload` (1 MiB by
//! default; from the server's greeting, re-read after every reconnection)
//! less [`HEADER_ROOM`] bytes, since the server counts a message's headers
//! in `max_payload`: [`Capabilities::max_message_bytes`] reports it once the
//! driver has connected, and a longer body is refused before it is sent
//! ([`ErrorKind::NotAccepted`]).
//!
//! While the connection is down (the server stopped, the network cut),
//! async-nats queues every request until it has reconnected, so a request
//! made then would wait for the whole `operation_timeout`. A dispatch checks
//! the client's connection state first and, unless it is connected, fails at
//! once with [`ErrorKind::NotAccepted`]: during an outage every dispatch
//! fails in about a millisecond, not only the first one. Once async-nats has
//! reconnected (it keeps trying by itself), dispatch works again with no
//! action from the application; the topology is declared again on the
//! first dispatch after a refused one, in case the server lost it. Only a
//! server that dies between the check and the `PubAck` makes a dispatch
//! wait, and then the outcome is [`ErrorKind::Uncertain`].
//!
//! # Attempts
//!
//! The attempt is the header [`ATTEMPTS_HEADER`] (`Queue-Attempts`, 0 when
//! absent) plus the server's delivery count (`info().delivered`, first = 1).
//! The header is set only on the copy a graceful shutdown publishes (see
//! below): it carries the deliveries the message consumed before that copy.
//! The delivery count rises on every redelivery of the stored message: after
//! a `Nak`, after AckWait expired (a crashed worker, a lost connection), so a
//! message that kills its worker still reaches the facade's cap. A second
//! header, [`SHUTDOWNS_HEADER`] (`Queue-Shutdowns`), counts the deliveries a
//! graceful shutdown handed back
//! ([`Delivery::shutdown_returns`](crate::Delivery::shutdown_returns)): they
//! do not consume the job's cap, while a crash (no settlement, so only the
//! delivery count rises) does.
//!
//! # Settlements
//!
//! Every settlement is sent as a *double ack* (an ack request the server
//! answers), so `Ok` means the server processed it; no answer within
//! `operation_timeout` is [`ErrorKind::Uncertain`].
//!
//! | settlement | JetStream |
//! |---|---|
//! | Ack | `+ACK` |
//! | Retry, no delay or zero | `-NAK` (redelivered at once) |
//! | Retry with a delay | `-NAK {"delay": ...}` (no sooner than the delay) |
//! | Retry from a graceful shutdown | publish a copy to `<subject_prefix>.Q` with `Queue-Attempts` = this delivery's attempt and `Queue-Shutdowns` incremented, wait for its `PubAck`, then `+ACK` the original |
//! | Reject | `+TERM` (never redelivered) |
//! | Fail | publish [`FailureRecord::encode`] to the failure subject and wait for its `PubAck`, then `+ACK`; with no failure subject: `+ACK` and an error-level log line |
//!
//! The failure record carries `Nats-Msg-Id` derived from the failed
//! message's stream, sequence and store time, so a transfer repeated after a
//! crash between the record and the ack stores one record within the
//! duplicate window (and at worst a duplicate, never a loss).
//!
//! A `-NAK` redelivers the same stored message, so its headers (the carried
//! counts) stay valid; only a graceful shutdown needs a new message, since
//! JetStream cannot change a stored message's headers. The copy's
//! `Nats-Msg-Id` is derived the same way
//! (`<stream>:<sequence>:<store time>:shutdown:<n>`), never the original's
//! (which the duplicate window would drop, losing the message once the
//! original is acked). If the copy is not accepted, the original is not
//! acked and the error is returned: the message comes back with a higher
//! delivery count. A crash between the copy and the ack duplicates the
//! message (the copy repeated by the original's next shutdown is dropped as
//! a duplicate within the window), never loses it.
//!
//! A server acknowledges an ack that arrives after AckWait as if it were in
//! time, even though the message was already redelivered: that is why
//! deliveries are leased.
//!
//! # Leases
//!
//! From the moment a delivery is handed out until its final ack is sent, a
//! background task sends `+WPI` (`Progress`) every half AckWait, so a
//! handler may run for any time without its message being redelivered. The
//! task stops when the delivery is settled or dropped. A delivery dropped
//! without settlement is `-NAK`ed at once (redelivered with a higher count);
//! if even that cannot be sent, AckWait redelivers it.
//!
//! # The server's MaxDeliver
//!
//! By default the consumer has no MaxDeliver (`-1`): the server never stops
//! delivering a message before the facade's cap. If
//! [`max_deliver`](NatsConfig::max_deliver) is set it must be at least
//! [`largest_attempt_cap`](NatsConfig::largest_attempt_cap) plus one
//! ([`queue::deliveries_needed`]: the extra delivery is the one on which the
//! facade records a message that crashed its worker every time), otherwise
//! the driver refuses to start ([`ErrorKind::Config`]).
//!
//! # Consumption and reconnection
//!
//! A subscription sends pull requests for up to `prefetch` messages minus
//! those it has handed out and not yet seen settled, each waiting at most
//! [`fetch_expiry`](NatsConfig::fetch_expiry) on the server, so at most
//! `prefetch` deliveries are outstanding, as with RabbitMQ's `basic.qos`.
//! `next()` is cancel-safe: an open pull request and a request being sent
//! live in the subscription, not in the future. async-nats re-establishes a
//! lost connection by itself (backoff up to
//! [`max_reconnect_backoff`](NatsConfig::max_reconnect_backoff)); the
//! subscription then abandons pull requests sent on the old connection and
//! sends fresh ones. When a pull fails (the consumer or stream was deleted,
//! the server is unavailable) the subscription re-declares the topology and
//! retries with exponential backoff; its `next()` returns `None` only once
//! the driver is stopped. Unlike an AMQP channel, a JetStream ack is not
//! tied to a connection: a delivery received before a reconnection can still
//! be settled after it, as long as AckWait has not expired.
//!
//! # Connection settings
//!
//! One connection per driver, from [`NatsConfig::url`]: `nats://host:port`,
//! optionally `nats://user:password@host:port` or `nats://token@host:port`.
//! The credentials are taken out of the address before it is used, and
//! never appear in `Debug` output, errors or logs.

mod config;
mod delivery;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::consumer::{self, pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{Client, ConnectOptions, Event};
use async_trait::async_trait;
use queue::FailureRecord;
use tokio::sync::watch;
use tracing::{info, warn};

pub use config::NatsConfig;
use config::{Auth, Endpoint};
use delivery::NatsSubscription;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing, Subscription};

const NAME: &str = "nats";

/// The header carrying the deliveries a message consumed before it was
/// published again by a graceful shutdown.
pub const ATTEMPTS_HEADER: &str = "Queue-Attempts";

/// The header counting deliveries a graceful shutdown handed back
/// (see [`queue::exceeds_crash_bound`]).
pub const SHUTDOWNS_HEADER: &str = "Queue-Shutdowns";

/// What the driver keeps free of the server's `max_payload` for the headers
/// it adds to a message (the server counts headers in `max_payload`): the
/// message id, and on a graceful shutdown's copy the derived id and the
/// carried counts.
pub const HEADER_ROOM: usize = 256;

fn config_error(message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, ErrorKind::Config, message.into())
}

fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// The server's error, if `e`'s chain carries one (a refusal, as opposed to
/// a transport failure).
fn server_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a jetstream::Error> {
    let mut current = Some(e);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<jetstream::Error>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

#[derive(Clone)]
struct Link {
    client: Client,
    js: jetstream::Context,
}

/// Which stream a name is, for its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Work,
    Failure,
}

pub(crate) struct Inner {
    config: NatsConfig,
    endpoint: Endpoint,
    link: tokio::sync::Mutex<Option<Link>>,
    /// Queues whose topology this driver declared, with their consumer.
    consumers: Mutex<HashMap<String, PullConsumer>>,
    /// Every stream this driver declared.
    known: Mutex<HashSet<String>>,
    stopped: watch::Sender<bool>,
    /// Bumped on every (re)connection of the client.
    connections: Arc<watch::Sender<u64>>,
    /// The client once connected, to read the server's `max_payload`
    /// without waiting for the link's lock.
    client: Mutex<Option<Client>>,
}

/// The NATS JetStream driver. Clones share one connection.
///
/// See the [module documentation](self) for the topology and guarantees.
#[derive(Clone)]
pub struct NatsDriver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NatsDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDriver")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl NatsDriver {
    /// A driver with `config`; connects on first use. Fails with
    /// [`ErrorKind::Config`] on an invalid configuration (including a
    /// MaxDeliver below the largest attempt cap).
    pub fn new(config: NatsConfig) -> Result<Self, DriverError> {
        let endpoint = config.validate()?;
        let (stopped, _) = watch::channel(false);
        let (connections, _) = watch::channel(0);
        Ok(NatsDriver {
            inner: Arc::new(Inner {
                config,
                endpoint,
                link: tokio::sync::Mutex::new(None),
                consumers: Mutex::default(),
                known: Mutex::default(),
                stopped,
                connections: Arc::new(connections),
                client: Mutex::default(),
            }),
        })
    }

    /// A driver with `config`, connected now (so a wrong URL or credentials
    /// fail here, as [`ErrorKind::Connection`]).
    pub async fn connect(config: NatsConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        driver.link().await?;
        Ok(driver)
    }

    /// The configuration in force.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// The subject messages of `queue` are stored under.
    pub fn subject(&self, queue: &str) -> String {
        format!("{}.{queue}", self.inner.config.subject_prefix)
    }

    /// The work stream of `queue`.
    pub fn stream_name(&self, queue: &str) -> String {
        let cleaned: String = queue
            .chars()
            .map(|c| {
                if c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\') {
                    '_'
                } else {
                    c
                }
            })
            .collect();
        format!("{}_{cleaned}", self.inner.config.stream_prefix)
    }

    /// The failure subject of `queue`, if failure subjects are configured.
    pub fn failure_subject(&self, queue: &str) -> Option<String> {
        self.inner.config.failure_subject.as_ref().map(|p| {
            p.replace("{prefix}", &self.inner.config.subject_prefix)
                .replace("{queue}", queue)
        })
    }

    /// The failure stream of `queue` (used only if a failure subject is
    /// configured).
    pub fn failure_stream_name(&self, queue: &str) -> String {
        format!("{}_failed", self.stream_name(queue))
    }

    /// The largest dispatch body the connected server stores: its
    /// `max_payload` minus [`HEADER_ROOM`]. `None` before the first
    /// connection.
    pub fn max_message_bytes(&self) -> Option<usize> {
        let client = lock(&self.inner.client);
        let max_payload = client.as_ref()?.server_info().max_payload;
        (max_payload > 0).then(|| max_payload.saturating_sub(HEADER_ROOM))
    }

    fn is_stopped(&self) -> bool {
        *self.inner.stopped.borrow()
    }

    fn check_running(&self) -> Result<(), DriverError> {
        if self.is_stopped() {
            Err(error(
                ErrorKind::Stopped,
                "the nats driver has been stopped",
            ))
        } else {
            Ok(())
        }
    }

    fn check_queue(&self, queue: &str) -> Result<(), DriverError> {
        if config::valid_subject(queue) {
            Ok(())
        } else {
            Err(config_error(format!(
                "queue name `{queue}` cannot be part of a NATS subject (no spaces, `*`, `>` or empty dot-separated tokens)"
            )))
        }
    }

    /// The connection (async-nats keeps it up by itself once made).
    async fn link(&self) -> Result<Link, DriverError> {
        let mut link = self.inner.link.lock().await;
        self.check_running()?;
        if let Some(link) = link.as_ref() {
            return Ok(link.clone());
        }
        let config = &self.inner.config;
        let endpoint = &self.inner.endpoint;
        let connections = self.inner.connections.clone();
        let max_backoff = config.max_reconnect_backoff.max(Duration::from_millis(100));
        let address = endpoint.address.clone();
        let mut options = ConnectOptions::new()
            .name(&config.connection_name)
            .connection_timeout(config.operation_timeout)
            .request_timeout(Some(config.operation_timeout))
            .reconnect_delay_callback(move |attempts| {
                let exponent = u32::try_from(attempts.min(16)).unwrap_or(16);
                Duration::from_millis(100)
                    .saturating_mul(2u32.saturating_pow(exponent))
                    .min(max_backoff)
            })
            .event_callback(move |event| {
                let connections = connections.clone();
                let address = address.clone();
                async move {
                    match event {
                        Event::Connected => {
                            connections.send_modify(|n| *n += 1);
                            info!(url = %address, "connected to NATS");
                        }
                        Event::Disconnected => {
                            connections.send_modify(|n| *n += 1);
                            warn!(url = %address, "disconnected from NATS; reconnecting");
                        }
                        other => warn!(url = %address, "NATS connection event: {other}"),
                    }
                }
            });
        options = match &endpoint.auth {
            Auth::None => options,
            Auth::UserPassword(user, password) => {
                options.user_and_password(user.clone(), password.clone())
            }
            Auth::Token(token) => options.token(token.clone()),
        };
        let client = match tokio::time::timeout(
            config.operation_timeout,
            options.connect(endpoint.address.as_str()),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(error(
                    ErrorKind::Connection,
                    format!("cannot connect to {}: {e}", endpoint.address),
                ))
            }
            Err(_) => {
                return Err(error(
                    ErrorKind::Connection,
                    format!(
                        "cannot connect to {}: no answer within {:?}",
                        endpoint.address, config.operation_timeout
                    ),
                ))
            }
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(config.operation_timeout)
            .build(client.clone());
        *lock(&self.inner.client) = Some(client.clone());
        let fresh = Link { client, js };
        *link = Some(fresh.clone());
        Ok(fresh)
    }

    fn wanted_stream(&self, name: &str, subject: &str, role: Role) -> stream::Config {
        stream::Config {
            name: name.to_string(),
            subjects: vec![subject.to_string()],
            retention: match role {
                Role::Work => RetentionPolicy::WorkQueue,
                Role::Failure => RetentionPolicy::Limits,
            },
            storage: StorageType::File,
            ..Default::default()
        }
    }

    fn stream_conflicts(actual: &stream::Config, wanted: &stream::Config) -> Vec<String> {
        let mut conflicts = Vec::new();
        if !actual.subjects.iter().any(|s| wanted.subjects.contains(s)) {
            conflicts.push(format!(
                "subjects {:?} do not include `{}`",
                actual.subjects, wanted.subjects[0]
            ));
        }
        if actual.retention != wanted.retention {
            conflicts.push(format!(
                "retention {:?}, expected {:?}",
                actual.retention, wanted.retention
            ));
        }
        if actual.storage != wanted.storage {
            conflicts.push(format!(
                "storage {:?}, expected {:?}",
                actual.storage, wanted.storage
            ));
        }
        conflicts
    }

    /// Makes sure the stream `name` exists with the configuration of `role`.
    async fn ensure_stream(
        &self,
        js: &jetstream::Context,
        name: &str,
        subject: &str,
        role: Role,
    ) -> Result<stream::Stream, DriverError> {
        let wanted = self.wanted_stream(name, subject, role);
        let check = |stream: stream::Stream| {
            let conflicts = Self::stream_conflicts(&stream.cached_info().config, &wanted);
            if conflicts.is_empty() {
                lock(&self.inner.known).insert(name.to_string());
                Ok(stream)
            } else {
                Err(config_error(format!(
                    "stream `{name}` already exists with a configuration that differs from what this driver \
                     declares ({role:?} stream: subject `{subject}`, {:?} retention, file storage): {}; \
                     delete or migrate it, or align the driver's configuration",
                    wanted.retention,
                    conflicts.join("; ")
                )))
            }
        };
        for _ in 0..2 {
            match js.get_stream(name).await {
                Ok(stream) => return check(stream),
                Err(e) => match e.kind() {
                    GetStreamErrorKind::JetStream(j)
                        if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                    GetStreamErrorKind::InvalidStreamName | GetStreamErrorKind::EmptyName => {
                        return Err(config_error(format!("`{name}` is not a valid stream name")))
                    }
                    _ => {
                        return Err(error(
                            ErrorKind::Connection,
                            format!("looking up stream `{name}`: {e}"),
                        ))
                    }
                },
            }
            match js.create_stream(wanted.clone()).await {
                Ok(stream) => {
                    info!(stream = name, subject, "declared stream");
                    return check(stream);
                }
                Err(e) => match e.kind() {
                    // Declared concurrently by someone else: inspect theirs.
                    CreateStreamErrorKind::JetStream(j)
                        if j.error_code() == ErrorCode::STREAM_NAME_EXIST =>
                    {
                        continue
                    }
                    CreateStreamErrorKind::JetStream(j) => {
                        return Err(config_error(format!(
                        "the server refused to create stream `{name}` for subject `{subject}`: {j}"
                    )))
                    }
                    CreateStreamErrorKind::InvalidStreamName
                    | CreateStreamErrorKind::EmptyStreamName => {
                        return Err(config_error(format!("`{name}` is not a valid stream name")))
                    }
                    _ => {
                        return Err(error(
                            ErrorKind::Connection,
                            format!("creating stream `{name}`: {e}"),
                        ))
                    }
                },
            }
        }
        Err(error(
            ErrorKind::Connection,
            format!("stream `{name}` kept changing while it was declared"),
        ))
    }

    fn wanted_consumer(&self) -> pull::Config {
        let config = &self.inner.config;
        pull::Config {
            durable_name: Some(config.consumer_name.clone()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver.map_or(-1, i64::from),
            ..Default::default()
        }
    }

    fn consumer_conflicts(&self, actual: &consumer::Config, subject: &str) -> Vec<String> {
        let wanted = self.wanted_consumer();
        let mut conflicts = Vec::new();
        if actual.deliver_subject.is_some() {
            conflicts.push("it is a push consumer".to_string());
        }
        if actual.ack_policy != wanted.ack_policy {
            conflicts.push(format!("ack policy {:?}", actual.ack_policy));
        }
        if actual.ack_wait != wanted.ack_wait {
            conflicts.push(format!(
                "AckWait {:?}, expected {:?}",
                actual.ack_wait, wanted.ack_wait
            ));
        }
        let unlimited = |n: i64| n <= 0;
        if actual.max_deliver != wanted.max_deliver
            && !(unlimited(actual.max_deliver) && unlimited(wanted.max_deliver))
        {
            conflicts.push(format!(
                "MaxDeliver {}, expected {}",
                actual.max_deliver, wanted.max_deliver
            ));
        }
        if actual.deliver_policy != wanted.deliver_policy {
            conflicts.push(format!("deliver policy {:?}", actual.deliver_policy));
        }
        if !actual.filter_subject.is_empty() && actual.filter_subject != subject {
            conflicts.push(format!("filter subject `{}`", actual.filter_subject));
        }
        conflicts
    }

    /// Makes sure the durable pull consumer exists on `stream` as configured.
    async fn ensure_consumer(
        &self,
        js: &jetstream::Context,
        stream: &stream::Stream,
        subject: &str,
    ) -> Result<PullConsumer, DriverError> {
        let name = &self.inner.config.consumer_name;
        let stream_name = &stream.cached_info().config.name;
        let check = |info: consumer::Info| {
            let conflicts = self.consumer_conflicts(&info.config, subject);
            if conflicts.is_empty() {
                let config = <pull::Config as consumer::FromConsumer>::try_from_consumer_config(
                    info.config.clone(),
                )
                .map_err(|e| config_error(format!("consumer `{name}`: {e}")))?;
                Ok(PullConsumer::new(config, info, js.clone()))
            } else {
                let wanted = self.wanted_consumer();
                Err(config_error(format!(
                    "consumer `{name}` on stream `{stream_name}` already exists with a configuration that \
                     differs from what this driver declares (pull, explicit ack, AckWait {:?}, MaxDeliver {}, \
                     deliver all): {}; delete it, or align the driver's configuration",
                    wanted.ack_wait,
                    wanted.max_deliver,
                    conflicts.join("; ")
                )))
            }
        };
        for _ in 0..2 {
            match stream.consumer_info(name).await {
                Ok(info) => return check(info),
                Err(e) if e.kind() == consumer_not_found() => {}
                Err(e) => {
                    return Err(error(
                        ErrorKind::Connection,
                        format!("looking up consumer `{name}` on `{stream_name}`: {e}"),
                    ))
                }
            }
            match stream.create_consumer(self.wanted_consumer()).await {
                Ok(mut consumer) => {
                    info!(stream = %stream_name, consumer = %name, "declared consumer");
                    let info = consumer.info().await.map_err(|e| {
                        error(
                            ErrorKind::Connection,
                            format!("consumer `{name}` on `{stream_name}`: {e}"),
                        )
                    })?;
                    return check(info.clone());
                }
                Err(e) => match e.kind() {
                    async_nats::jetstream::stream::ConsumerErrorKind::JetStream(j) => {
                        if j.error_code() == ErrorCode::CONSUMER_NAME_EXIST
                            || j.error_code() == ErrorCode::CONSUMER_ALREADY_EXISTS
                        {
                            continue;
                        }
                        return Err(config_error(format!(
                            "the server refused to create consumer `{name}` on stream `{stream_name}`: {j}"
                        )));
                    }
                    _ => {
                        return Err(error(
                            ErrorKind::Connection,
                            format!("creating consumer `{name}` on `{stream_name}`: {e}"),
                        ))
                    }
                },
            }
        }
        Err(error(
            ErrorKind::Connection,
            format!("consumer `{name}` kept changing while it was declared"),
        ))
    }

    /// Declares `queue`'s work stream, consumer and failure stream (once per
    /// driver, again after [`forget`](Self::forget)); returns the consumer.
    async fn declare(&self, queue: &str) -> Result<PullConsumer, DriverError> {
        self.check_queue(queue)?;
        if let Some(consumer) = lock(&self.inner.consumers).get(queue) {
            return Ok(consumer.clone());
        }
        let link = self.link().await?;
        let subject = self.subject(queue);
        let stream = self
            .ensure_stream(&link.js, &self.stream_name(queue), &subject, Role::Work)
            .await?;
        let consumer = self.ensure_consumer(&link.js, &stream, &subject).await?;
        if let Some(failed) = self.failure_subject(queue) {
            self.ensure_stream(
                &link.js,
                &self.failure_stream_name(queue),
                &failed,
                Role::Failure,
            )
            .await?;
        }
        lock(&self.inner.consumers).insert(queue.to_string(), consumer.clone());
        Ok(consumer)
    }

    /// Forgets that `queue` was declared, so the next use declares it again.
    fn forget(&self, queue: &str) {
        lock(&self.inner.consumers).remove(queue);
    }

    /// The connection, if the client is connected now. While it reconnects
    /// every request would wait in its queue until the server is back or the
    /// operation timeout ends, so a publish to `subject` fails at once as not
    /// accepted instead.
    async fn connected_link(&self, subject: &str) -> Result<Link, DriverError> {
        let link = self
            .link()
            .await
            .map_err(|e| error(ErrorKind::NotAccepted, format!("not sent: {e}")))?;
        if link.client.connection_state() != State::Connected {
            return Err(error(
                ErrorKind::NotAccepted,
                format!(
                    "publish to `{subject}` not sent: not connected to NATS at {} (reconnecting)",
                    self.inner.endpoint.address
                ),
            ));
        }
        Ok(link)
    }

    /// Publishes to `subject` with `Nats-Msg-Id` = `message_id` and the
    /// `headers`, and waits for the `PubAck`.
    async fn publish(
        &self,
        subject: &str,
        body: Vec<u8>,
        message_id: &str,
        headers: &[(&str, String)],
    ) -> Result<PublishAck, DriverError> {
        self.check_running()?;
        let link = self.connected_link(subject).await?;
        let mut publish = PublishMessage::build()
            .payload(body.into())
            .message_id(message_id);
        for (name, value) in headers {
            publish = publish.header(*name, value.as_str());
        }
        let ack = link
            .js
            .send_publish(subject.to_string(), publish)
            .await
            .map_err(|e| {
                error(
                    ErrorKind::NotAccepted,
                    format!("publish to `{subject}` not sent: {e}"),
                )
            })?;
        match ack.await {
            Ok(ack) => Ok(ack),
            Err(e) => match e.kind() {
                PublishErrorKind::StreamNotFound => Err(error(
                    ErrorKind::NotAccepted,
                    format!(
                        "publish to `{subject}`: no stream stores this subject (no responders)"
                    ),
                )),
                PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{subject}` sent, no PubAck: {e}"),
                )),
                _ if server_error(&e).is_some() => Err(error(
                    ErrorKind::NotAccepted,
                    format!("the server refused the publish to `{subject}`: {e}"),
                )),
                _ => Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{subject}` sent, PubAck unreadable: {e}"),
                )),
            },
        }
    }

    /// Terminal failure records of `queue`, oldest first, read from its
    /// failure stream by sequence without removing them. Messages that are
    /// not failure records are skipped with a warning.
    pub async fn failure_records(&self, queue: &str) -> Result<Vec<FailureRecord>, DriverError> {
        let Some(subject) = self.failure_subject(queue) else {
            return Ok(Vec::new());
        };
        let link = self.link().await?;
        let name = self.failure_stream_name(queue);
        let mut stream = self
            .ensure_stream(&link.js, &name, &subject, Role::Failure)
            .await?;
        let state = stream
            .info()
            .await
            .map_err(|e| error(ErrorKind::Connection, format!("stream `{name}`: {e}")))?
            .state
            .clone();
        let mut records = Vec::new();
        if state.messages == 0 {
            return Ok(records);
        }
        for sequence in state.first_sequence..=state.last_sequence {
            match stream.get_raw_message(sequence).await {
                Ok(message) => match FailureRecord::decode(&message.payload) {
                    Ok(record) => records.push(record),
                    Err(e) => {
                        warn!(stream = %name, sequence, "skipping a message that is not a failure record: {}", queue::redact::json_error(&e))
                    }
                },
                Err(e)
                    if server_error(&e).map(|j| j.error_code())
                        == Some(ErrorCode::NO_MESSAGE_FOUND) => {}
                Err(e) if e.to_string().contains("no message found") => {}
                Err(e) => {
                    return Err(error(
                        ErrorKind::Connection,
                        format!("reading `{name}` sequence {sequence}: {e}"),
                    ))
                }
            }
        }
        Ok(records)
    }

    /// Messages stored in `queue`'s work stream (ready, waiting for a retry
    /// delay, or being handled).
    pub async fn stored_count(&self, queue: &str) -> Result<u64, DriverError> {
        let link = self.link().await?;
        let name = self.stream_name(queue);
        let mut stream = link
            .js
            .get_stream(&name)
            .await
            .map_err(|e| error(ErrorKind::Connection, format!("stream `{name}`: {e}")))?;
        let info = stream
            .info()
            .await
            .map_err(|e| error(ErrorKind::Connection, format!("stream `{name}`: {e}")))?;
        Ok(info.state.messages)
    }

    /// Every stream this driver has declared (work and failure streams).
    pub fn declared_streams(&self) -> Vec<String> {
        let mut names: Vec<String> = lock(&self.inner.known).iter().cloned().collect();
        names.sort();
        names
    }

    /// Deletes the streams `names` with their consumers (for tests and
    /// tooling). A stream that does not exist is not an error.
    pub async fn delete_streams(&self, names: &[String]) -> Result<(), DriverError> {
        let link = self.link().await?;
        for name in names {
            match link.js.delete_stream(name).await {
                Ok(_) => {}
                Err(e) => match e.kind() {
                    GetStreamErrorKind::JetStream(j)
                        if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                    _ => {
                        return Err(error(
                            ErrorKind::Connection,
                            format!("deleting stream `{name}`: {e}"),
                        ))
                    }
                },
            }
            lock(&self.inner.known).remove(name);
        }
        lock(&self.inner.consumers).clear();
        Ok(())
    }

    /// Deletes `queue`'s durable consumer (for tests and tooling).
    pub async fn delete_consumer(&self, queue: &str) -> Result<(), DriverError> {
        let link = self.link().await?;
        let name = self.stream_name(queue);
        let stream = link
            .js
            .get_stream(&name)
            .await
            .map_err(|e| error(ErrorKind::Connection, format!("stream `{name}`: {e}")))?;
        stream
            .delete_consumer(&self.inner.config.consumer_name)
            .await
            .map_err(|e| error(ErrorKind::Connection, format!("deleting consumer: {e}")))?;
        self.forget(queue);
        Ok(())
    }
}

fn consumer_not_found() -> async_nats::jetstream::context::ConsumerInfoErrorKind {
    async_nats::jetstream::context::ConsumerInfoErrorKind::NotFound
}

#[async_trait]
impl Driver for NatsDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: None,
            delayed_dispatch: false,
            reject_drops: true,
            redelivery_hint: self.inner.config.ack_wait,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: self.max_message_bytes(),
            max_deliveries: self.inner.config.max_deliver,
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.check_running()?;
        if let Some(delay) = message.delay.filter(|d| !d.is_zero()) {
            return Err(error(
                ErrorKind::Unsupported,
                format!(
                    "delayed dispatch ({delay:?}) is not supported: JetStream 2.9 has no scheduled messages"
                ),
            ));
        }
        // Before the stream setup, which would wait in the client's queue
        // while it reconnects.
        self.connected_link(&self.subject(queue)).await?;
        // The limit is the server's: known once connected.
        self.capabilities()
            .refuse_oversize(NAME, message.body.len())?;
        self.declare(queue).await.map_err(|e| match e.kind() {
            ErrorKind::Config | ErrorKind::Stopped | ErrorKind::NotAccepted => e,
            _ => error(ErrorKind::NotAccepted, format!("not sent: {e}")),
        })?;
        let result = self
            .publish(&self.subject(queue), message.body, &message.id, &[])
            .await;
        if let Err(e) = &result {
            if e.kind() == ErrorKind::NotAccepted {
                // The stream may have been deleted: declare again next time.
                self.forget(queue);
            }
        }
        result.map(|_| ())
    }

    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.check_running()?;
        let consumer = self.declare(queue).await?;
        Ok(Box::new(NatsSubscription::new(
            self.clone(),
            queue,
            prefetch,
            consumer,
        )))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stopped.send_replace(true);
        let link = self.inner.link.lock().await.take();
        if let Some(link) = link {
            let limit = self.inner.config.operation_timeout;
            match tokio::time::timeout(limit, link.client.drain()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(error(
                        ErrorKind::Connection,
                        format!("closing the connection: {e}"),
                    ))
                }
                Err(_) => {
                    return Err(error(
                        ErrorKind::Connection,
                        format!("closing the connection: no answer within {limit:?}"),
                    ))
                }
            }
        }
        Ok(())
    }
}
