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
//!   operator removes them; and, once an operator first claims or removes
//!   one of them, the claims stream `<work stream>_claims` holding the
//!   subjects `<failure subject>.claim.*`, limits retention, file storage
//!   and [`claim_hold`](NatsConfig::claim_hold) as its age limit (see
//!   "Failure store").
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
//! connection lost) is [`ErrorKind::Uncertain`]. A dispatch with a delay
//! is held by the server's message schedules or by the driver's relay
//! (see "Delayed dispatch").
//!
//! A batch ([`Driver::send_batch`]) publishes every message before
//! awaiting any `PubAck` (at most 1,024 unanswered at once, below
//! async-nats' own limit per connection), so it costs about one round trip
//! rather than one per message; each message gets its own result, with
//! the same kinds as a single dispatch (delayed ones are published beside
//! the others, each as its mechanism holds it; an oversize one is refused
//! before anything is sent, one the server refuses is
//! [`ErrorKind::NotAccepted`] while the others are stored). A dispatch
//! reads the connection and the set of declared queues under shared read
//! locks and clones only an `Arc`: concurrent dispatches do not wait for
//! one another in the driver.
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
//! # Delayed dispatch
//!
//! Any delay is accepted ([`Capabilities::delayed_dispatch`], no
//! [`Capabilities::max_dispatch_delay`]): the message is held whole, by one
//! of two mechanisms chosen when a queue is declared, by the server's
//! version from its greeting ([`DelayMechanism::Auto`]; see
//! [`NatsConfig::delay_mechanism`] to force one):
//!
//! - **nats-server 2.12 or later: message schedules** (ADR-51). The work
//!   stream also holds `<subject_prefix>-scheduled.Q.*` and allows
//!   schedules (`allow_msg_schedules`, set by a raw `STREAM.UPDATE` of the
//!   stream's own configuration), and the work consumer filters on the work
//!   subject, so it never delivers a schedule (the filter is set first,
//!   then the stream is changed). A delayed dispatch is stored on
//!   `<subject_prefix>-scheduled.Q.<message id>` with `Nats-Schedule: @at
//!   <due time, RFC 3339 in UTC, ms rounded up>` and `Nats-Schedule-Target:
//!   <subject_prefix>.Q`; when it is due the server stores its body,
//!   unchanged, on the work subject and removes the schedule. The copy is a
//!   new message, delivered first as attempt 1. One schedule per subject:
//!   a dispatch repeated before its time replaces the schedule rather than
//!   adding one. If the server refuses to enable schedules on an existing
//!   stream, the queue uses the relay (with a warning).
//! - **older servers: the relay.** A delayed dispatch is stored in the hold
//!   stream `<work stream>_delayed` (subject `<subject_prefix>-delayed.Q`,
//!   work-queue retention, file storage) with its due time (ms since the
//!   epoch) in [`DUE_HEADER`] and `Nats-Msg-Id` = its message id. Every
//!   worker runs, per queue it consumes, a relay pulling the hold stream's
//!   own durable consumer (explicit ack, AckWait 30 s, unlimited
//!   MaxDeliver and MaxAckPending, so held messages never take the work
//!   consumer's MaxAckPending, and one due soon never waits behind ones due
//!   later). A held message not yet due is `-NAK`ed with the time left (at
//!   most [`LONGEST_HOLD`], a day); a due one is published to the work
//!   subject with `Nats-Msg-Id` = its message id, and once the `PubAck`
//!   arrives the held copy is acknowledged. The relay never publishes a
//!   held message it read more than 15 s (half the hold AckWait) earlier:
//!   the server may have handed it to another relay by then. A relay on a
//!   schedules server also serves a queue that has a hold stream (looked
//!   for every minute), so messages held before an upgrade still go out.
//!
//! Neither counts a delay as an attempt, and the handler never sees a
//! held copy. Restarts lose nothing: schedules and held messages are stored
//! messages (file storage), and the hold consumer's `-NAK` delays are
//! consumer state the server keeps across its restarts; a held copy stays
//! until its work copy is stored. A relay that crashes after publishing
//! and before acknowledging leaves the held copy to be redelivered after
//! 30 s and published again, a duplicate the work stream's duplicate window
//! (2 minutes, the server's default) drops. A relay stalled for longer than
//! that window between reading a due message and publishing it can store a
//! second work copy: a second execution, never a loss.
//!
//! Cost: a schedule is one stored message and one message published by
//! the server when due, whatever the delay (nothing per day). A held
//! message is one stored message, one delivery and `-NAK` to a relay at
//! first, one more of each per full day of delay (the `-NAK` is at most a
//! day), then one publish and one ack when due; a relay that restarts
//! costs nothing (the `-NAK`s stay with the server). Due times are the dispatching host's wall clock.
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
//! A settlement's final acknowledgement is sent either as a *double ack*
//! (a request the server answers once it has processed it, on the
//! client's shared request inbox: `Ok` means the server processed it, no
//! answer within `operation_timeout` is [`ErrorKind::Uncertain`]) or as a
//! *plain ack* (a publish: `Ok` means it was handed to the connection). A
//! plain ack can be lost with the connection, and then the server
//! redelivers the message after AckWait. Each settlement uses a plain ack
//! only where that loss costs nothing the guarantees do not already allow:
//!
//! | settlement | JetStream | ack | what a lost plain ack would cost |
//! |---|---|---|---|
//! | Ack | `+ACK` | double | a second execution *and* a `succeeded` event for a message the server still holds: the event would no longer mean the message is gone |
//! | Retry, no delay or zero | `-NAK` (redelivered at once) | double | a redelivery after AckWait instead of at once, reported as accepted |
//! | Retry with a delay | `-NAK {"delay": ...}` (no sooner than the delay) | double | a redelivery after AckWait, *sooner* than a delay longer than AckWait: the delay would not be a lower bound |
//! | Retry from a graceful shutdown | publish a copy to `<subject_prefix>.Q` with `Queue-Attempts` = this delivery's attempt and `Queue-Shutdowns` incremented, wait for its `PubAck`, then `+ACK` the original | plain | the original comes back after AckWait beside its stored copy: the duplicate a crash between the copy and the ack already makes (see below), never a loss |
//! | Reject | `+TERM` (never redelivered) | double | a rejected job redelivered and run again |
//! | Fail | publish [`FailureRecord::encode`] to the failure subject and wait for its `PubAck`, then `+ACK`; with no failure subject: `+ACK` and an error-level log line | plain after the record; double without one | after the record: a redelivery whose record the duplicate window drops (its id is derived from the message), as after a crash between the record and the ack; never a lost record. Without a record the log line is all there is, so the ack is confirmed |
//!
//! So the success path keeps its double ack: the facade's events and
//! counters say the server took the settlement. It costs one reply per
//! message, which the consumer's concurrency keeps in flight (a
//! subscription's window frees a slot as the ack is sent, not when it is
//! answered).
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
//! From the moment a subscription reads a message until its final ack is
//! sent, the message is leased: one ticker task per subscription wakes
//! every quarter AckWait and sends `+WPI` (`Progress`) for each message it
//! holds whose AckWait was last restarted at least a quarter AckWait ago,
//! so no held message goes more than half AckWait without one and a
//! handler may run for any time without its message being redelivered.
//! (One ticker for all, rather than a task per delivery: a delivery costs
//! an entry in the subscription's table, not a spawned task and a timer.)
//! The ticker keeps running for deliveries settled after their
//! subscription was closed, and ends once the subscription and all its
//! deliveries are gone, or the driver is stopped. A delivery dropped
//! without settlement is `-NAK`ed at once (redelivered with a higher
//! count); if even that cannot be sent, AckWait redelivers it. A delivery
//! whose settlement failed (a failure record or shutdown copy the server
//! refused) is not `-NAK`ed: it comes back when AckWait ends, so a refused
//! settlement never becomes a hot loop. A failure record is never larger
//! than the server's `max_payload` less [`HEADER_ROOM`]: one that would be
//! is cut to fit ([`jobrail::FailureRecord::encode_within`]).
//!
//! # The server's MaxDeliver
//!
//! By default the consumer has no MaxDeliver (`-1`): the server never stops
//! delivering a message before the facade's cap. If
//! [`max_deliver`](NatsConfig::max_deliver) is set, the driver reports it as
//! [`Capabilities::max_deliveries`], and a [`Consumer`](crate::Consumer)
//! refuses to start ([`ErrorKind::Config`], naming the job) when it is below
//! what a job registered for the queue needs: the job's attempt cap plus one
//! ([`jobrail::deliveries_needed`]: the extra delivery is the one on which the
//! facade records a message that crashed its worker every time). The rule
//! is [`jobrail::check_delivery_limit`], applied to the registry's own jobs,
//! so no cap is copied into the driver's settings.
//!
//! # Consumption and reconnection
//!
//! A subscription keeps its pull requests outstanding rather than sending
//! one after another: it subscribes once to an inbox of its own and sends
//! each pull request (a publish to
//! `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` answered on that inbox)
//! while earlier ones are still open, each waiting at most
//! [`fetch_expiry`](NatsConfig::fetch_expiry) on the server. Its window is
//! `prefetch` (the consumer's concurrency): the messages it holds (read,
//! final ack not yet sent) plus those it has asked for and not received
//! never exceed `prefetch`, and it asks for the free slots once they are
//! at least half the window (one slot with a prefetch of 1), so requests
//! stay large: about `N / (prefetch / 2)` of them for `N` messages under
//! load. The server's `408` (and `409`) ending a request says how many it
//! did not deliver; a request is no longer counted past its expiry (and a
//! second of grace) even without one.
//!
//! The bound, and what it means for AckWait and MaxAckPending: a
//! subscription holds at most `prefetch` unacknowledged messages on the
//! server, plus the acks it has sent that the server has not processed
//! yet. A message is read as soon as the consumer has a free slot for it
//! (the window never asks for more than the consumer holds slots for; a
//! slot held by a delivery whose ack is sent frees once the ack is
//! answered, within the operation timeout), and leased from then on, so
//! no message waits out AckWait in a buffer. A
//! consumer serving several queues under one concurrency limit has a
//! window per queue; a message of one queue can then wait for a slot taken
//! by another queue's deliveries, unleased, and comes back after AckWait
//! with a higher count if the wait is longer (keep AckWait above the
//! longest handler of the other queues, or give such queues consumers of
//! their own). The consumer's MaxAckPending (the server's default, 1,000,
//! unless the consumer was made otherwise) caps what all workers of a
//! queue hold together: with `W` workers the server holds back deliveries
//! once `W x prefetch` reaches it (slower, never an error); a subscription
//! whose `prefetch` alone is above it warns at start.
//!
//! `next()` is cancel-safe: the open pull requests and a request being
//! sent live in the subscription, not in the future. Closing the
//! subscription unsubscribes the inbox, so the server ends its open
//! requests (no interest) and sends nothing more. async-nats
//! re-establishes a lost connection by itself (backoff up to
//! [`max_reconnect_backoff`](NatsConfig::max_reconnect_backoff)); the
//! subscription then hands out what already arrived, abandons the old
//! inbox with its pull requests and pulls afresh on a new one. When a pull fails (the consumer or stream was deleted,
//! the server is unavailable) the subscription re-declares the topology and
//! retries with exponential backoff; its `next()` returns `None` only once
//! the driver is stopped. Unlike an AMQP channel, a JetStream ack is not
//! tied to a connection: a delivery received before a reconnection can still
//! be settled after it, as long as AckWait has not expired.
//!
//! # Failure store
//!
//! The driver is a [`FailureStore`] and an [`Admin`]
//! ([`Failures`](crate::Failures) builds list, show, replay and purge on
//! them):
//!
//! - **list** reads the failure stream by sequence, oldest stored first,
//!   with `STREAM.MSG.GET` requests (one per entry: each asks for the first
//!   message of the failure subject from the sequence after the previous
//!   one). Nothing is consumed or hidden: a reader sees every record,
//!   including one another operator holds, and a record published or
//!   removed while it reads may or may not be in its list. A message there
//!   that is not a failure record is listed as an entry without a record.
//! - **claim**: the stream has no per-message lock, so a claim on the entry
//!   at sequence `N` is a message on `<failure subject>.claim.N` in the
//!   claims stream, published with `Nats-Expected-Last-Subject-Sequence: 0`:
//!   the server stores it only while no other claim is there, so of two
//!   concurrent claims exactly one succeeds. The claimant then checks that
//!   the entry is still stored (a claim that has just ended may have removed
//!   it) and otherwise reads again. Releasing deletes the claim message. A
//!   claim whose holder crashed, or that was dropped without being removed
//!   or released, is deleted by the stream's age limit: the record stays,
//!   and can be claimed again after [`claim_hold`](NatsConfig::claim_hold)
//!   (2 minutes by default). A replay that outlives the hold (it should
//!   not: the hold must exceed three operation timeouts) can be repeated by
//!   another operator, a duplicate that the work stream's duplicate window
//!   drops only within its 2 minutes.
//! - **remove** deletes the entry by its sequence (`STREAM.MSG.DELETE`),
//!   exactly that message; removing entries by id claims each first and
//!   skips those another claim holds.
//! - **depth** is the consumer's count of messages not yet delivered
//!   (ready) and of unacknowledged deliveries (in flight; on JetStream this
//!   includes retries waiting out a `-NAK` delay); delays are not reported.
//! - **delete** removes the work, failure, claims and hold streams (the
//!   consumer and schedules go with the work stream) and forgets the queue
//!   was declared. Stop
//!   the queue's consumers first: a running subscription declares the
//!   queue again.
//!
//! # Connection settings
//!
//! One connection per driver, from [`NatsConfig::url`]: `nats://host:port`,
//! optionally `nats://user:password@host:port` or `nats://token@host:port`.
//! The credentials are taken out of the address before it is used, and
//! never appear in `Debug` output, errors or logs.
//!
//! # Errors
//!
//! An error from async-nats is kept as the cause of the [`DriverError`]
//! (reach it with [`DriverError::find`]), under the driver's description of
//! what it was doing.
//!
//! # Layout
//!
//! - this file: the contract above, [`NatsDriver`] and its `Driver` impl,
//!   which hands each operation to one of the files below;
//! - `config.rs`: [`NatsConfig`] and its validation;
//! - `connection.rs`: connecting, reconnection waits, the stopped state,
//!   `stop`;
//! - `topology.rs`: names, declaring and inspecting streams and the
//!   consumer, reading failure records;
//! - `publish.rs`: dispatch, and the failure record and shutdown copy a
//!   settlement publishes;
//! - `delay.rs`: delayed dispatch (schedules, the hold stream and its
//!   relay);
//! - `delivery.rs`: subscriptions (the inbox, the window of pull
//!   requests), deliveries, the lease ticker and settlements;
//! - `failures.rs`: the failure store (reading, claiming and removing
//!   failure records) and the admin interface (depth, deletion);
//! - `errors.rs`: async-nats' errors as [`DriverError`]s;
//! - `testing.rs` (feature `testing`): helpers for the test suites.
//!
//! [`ErrorKind::Config`]: crate::ErrorKind::Config
//! [`ErrorKind::NotAccepted`]: crate::ErrorKind::NotAccepted
//! [`ErrorKind::Uncertain`]: crate::ErrorKind::Uncertain
//! [`ErrorKind::Unsupported`]: crate::ErrorKind::Unsupported
//! [`FailureRecord::encode`]: jobrail::FailureRecord::encode

mod config;
mod connection;
mod delay;
mod delivery;
mod errors;
mod failures;
mod publish;
#[cfg(feature = "testing")]
mod testing;
mod topology;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(feature = "testing")]
use std::sync::Mutex;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use tokio::sync::watch;

use config::Endpoint;
pub use config::{DelayMechanism, NatsConfig, DEFAULT_PING_INTERVAL};
use connection::Link;
pub use delay::{DUE_HEADER, LONGEST_HOLD};

use crate::driver::{Capabilities, Driver, DriverError, Outgoing, Subscription};
use crate::failures::{Admin, FailureStore};
use crate::kit::Lifecycle;

const NAME: &str = "nats";

/// The header carrying the deliveries a message consumed before it was
/// published again by a graceful shutdown.
pub const ATTEMPTS_HEADER: &str = "Queue-Attempts";

/// The header counting deliveries a graceful shutdown handed back
/// (see [`jobrail::exceeds_crash_bound`]).
pub const SHUTDOWNS_HEADER: &str = "Queue-Shutdowns";

/// What the driver keeps free of the server's `max_payload` for the headers
/// it adds to a message (the server counts headers in `max_payload`): the
/// message id, and on a graceful shutdown's copy the derived id and the
/// carried counts.
pub const HEADER_ROOM: usize = 256;

struct Inner {
    config: NatsConfig,
    endpoint: Endpoint,
    /// Held while the connection is being made (once per driver).
    connecting: tokio::sync::Mutex<()>,
    /// The connection once made: every operation reads it here, sharing
    /// the lock, and clones only the `Arc`.
    link: RwLock<Option<Arc<Link>>>,
    /// Queues whose topology this driver declared, with their consumer's
    /// `MaxAckPending` and delay mechanism.
    declared: RwLock<HashMap<String, topology::Declared>>,
    /// Queues whose hold stream and its consumer this driver declared.
    held: RwLock<HashSet<String>>,
    /// Queues whose relay runs in this driver.
    relays: delay::Relays,
    /// Every stream this driver declared (for the test suites' clean-up).
    #[cfg(feature = "testing")]
    known: Mutex<HashSet<String>>,
    /// Pull requests sent by this driver's subscriptions (for the tests).
    #[cfg(feature = "testing")]
    pulls_sent: AtomicU64,
    life: Lifecycle,
    /// Bumped on every (re)connection of the client.
    connections: Arc<watch::Sender<u64>>,
    /// The server's `max_payload` (0 before the first connection), read
    /// again from the client once per connection generation rather than
    /// copying its whole server info on every dispatch.
    max_payload: AtomicUsize,
    /// The connection generation `max_payload` was read on (`u64::MAX`:
    /// never).
    max_payload_generation: AtomicU64,
}

/// Reads `lock`, whatever a panicking writer left (the guarded values are
/// caches, consistent at every step).
fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes `lock` (see [`read`]).
fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
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

impl NatsDriver {
    /// A driver with `config`; connects on first use. Fails with
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) on an invalid
    /// configuration.
    pub fn new(config: NatsConfig) -> Result<Self, DriverError> {
        let endpoint = config.validate()?;
        let (connections, _) = watch::channel(0);
        Ok(NatsDriver {
            inner: Arc::new(Inner {
                config,
                endpoint,
                connecting: tokio::sync::Mutex::new(()),
                link: RwLock::default(),
                declared: RwLock::default(),
                held: RwLock::default(),
                relays: delay::Relays::default(),
                #[cfg(feature = "testing")]
                known: Mutex::default(),
                #[cfg(feature = "testing")]
                pulls_sent: AtomicU64::new(0),
                life: Lifecycle::new(NAME),
                connections: Arc::new(connections),
                max_payload: AtomicUsize::new(0),
                max_payload_generation: AtomicU64::new(u64::MAX),
            }),
        })
    }

    /// A driver with `config`, connected now (so a wrong URL or credentials
    /// fail here, as [`ErrorKind::Connection`](crate::ErrorKind::Connection)).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use jobrail::Registry;
    /// use jobrail_native::Consumer;
    /// use jobrail_native::nats::{NatsConfig, NatsDriver};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), jobrail_native::DriverError> {
    /// # let registry = Registry::new();
    /// // Fails now, as ErrorKind::Connection, when the server is unreachable.
    /// let driver = Arc::new(NatsDriver::connect(NatsConfig::new("nats://127.0.0.1:4222")).await?);
    /// Consumer::builder(driver, registry).build().run_until_signal().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(config: NatsConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        driver.link().await?;
        Ok(driver)
    }

    /// The configuration in force.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// The largest dispatch body the connected server stores: its
    /// `max_payload` minus [`HEADER_ROOM`] (the last one known once the
    /// driver is stopped). `None` before the first connection.
    pub fn max_message_bytes(&self) -> Option<usize> {
        let generation = *self.inner.connections.borrow();
        let max_payload = if self.inner.max_payload_generation.load(Ordering::Acquire) == generation
        {
            self.inner.max_payload.load(Ordering::Acquire)
        } else if let Some(link) = self.current_link() {
            let max_payload = link.client.server_info().max_payload;
            self.inner.max_payload.store(max_payload, Ordering::Release);
            self.inner
                .max_payload_generation
                .store(generation, Ordering::Release);
            max_payload
        } else {
            // Stopped: the last server's limit still holds.
            self.inner.max_payload.load(Ordering::Acquire)
        };
        (max_payload > 0).then(|| max_payload.saturating_sub(HEADER_ROOM))
    }
}

#[async_trait]
impl Driver for NatsDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: None,
            // Progress renews AckWait every half of it while a handler runs.
            refused_hold: self.inner.config.ack_wait / 2,
            // Any delay: the server's schedules or the relay hold it whole.
            delayed_dispatch: true,
            max_dispatch_delay: None,
            reject_drops: true,
            redelivery_hint: self.inner.config.ack_wait,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: self.max_message_bytes(),
            max_deliveries: self.inner.config.max_deliver,
        }
    }

    /// See `publish.rs`.
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.dispatch(queue, message).await
    }

    /// See `publish.rs`: the whole batch in flight, then its `PubAck`s.
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        self.dispatch_batch(queue, messages).await
    }

    /// See `delivery.rs`.
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.subscription(queue, prefetch).await
    }

    /// See `failures.rs`.
    fn failure_store(&self) -> Option<&dyn FailureStore> {
        Some(self)
    }

    /// See `failures.rs`.
    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }

    /// See `connection.rs`.
    async fn stop(&self) -> Result<(), DriverError> {
        self.close().await
    }
}
