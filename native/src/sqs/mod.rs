//! The Amazon SQS driver (feature `sqs`), on aws-sdk-sqs with tokio.
//!
//! # Queues
//!
//! A facade queue `Q` is the SQS queue named `Q` in the configured region
//! (or at the configured endpoint). Its failure queue is `Q-failed` unless
//! [`SqsConfig::failure_queue`] says otherwise. Both are resolved on the
//! first `send` or `subscribe` (`GetQueueUrl`) and, with
//! [`create_queues`](SqsConfig::create_queues) (the default), created if
//! missing: standard queues (FIFO queues are not supported), the work queue
//! with the configured visibility timeout, the failure queue with the
//! longest retention (14 days).
//!
//! SQS queue names are 1 to 80 characters among `A-Z a-z 0-9 - _`. The
//! facade also allows `.`: such a name is refused with
//! [`ErrorKind::Config`] rather than mapped, since a mapping (`.` to `-`)
//! could make two facade queues share one SQS queue.
//!
//! # Delivery limit
//!
//! A work queue's redrive policy (`RedrivePolicy`, SQS's own
//! dead-lettering) ends a message after `maxReceiveCount` receives, with no
//! failure record. That count is the queue's delivery limit, read by
//! [`Driver::delivery_limit`] (`GetQueueAttributes`, after resolving or
//! creating the queue as a dispatch would; `None` without a policy). A
//! consumer checks it when it starts against the registry's own jobs on
//! that queue ([`jobrail::check_delivery_limit`]): a job whose attempt cap
//! needs more receives (the cap plus the receive on which the facade
//! records a message that crashed its worker every time,
//! [`jobrail::deliveries_needed`]) is refused with [`ErrorKind::Config`]
//! naming the job, since SQS would move its messages to the dead-letter
//! queue before the facade ends them. A policy without a readable
//! `maxReceiveCount` is refused with [`ErrorKind::Config`]. Dispatch does
//! not read the policy. [`Capabilities::max_deliveries`] stays `None`: the
//! limit is per queue.
//!
//! # Dispatch
//!
//! `SendMessage`. SQS bodies are text with a restricted character set; a
//! body that is not such text (bytes that are not UTF-8, control
//! characters) travels base64-encoded, marked by the message attribute
//! [`ENCODING_ATTRIBUTE`] = `base64`, and is decoded on receipt. A delay is
//! SQS's `DelaySeconds`, rounded up to whole seconds (never shortened); a
//! delay above 900 s is refused with [`ErrorKind::Unsupported`]. A request
//! that fails before it is sent (invalid input, no connection) or that SQS
//! answers with an error (a queue that does not exist...) is
//! [`ErrorKind::NotAccepted`]; one that fails after it may have been sent
//! (connection lost, no answer within
//! [`operation_timeout`](SqsConfig::operation_timeout), unreadable answer)
//! is [`ErrorKind::Uncertain`]. The SDK's standard retries apply first.
//! Every error from a request keeps the SDK's error as its cause (reach it
//! with [`DriverError::find`]).
//!
//! A batch ([`Driver::send_batch`], behind
//! [`Dispatch::send_batch`](crate::Dispatch::send_batch)) is
//! `SendMessageBatch`: calls of at most 10 messages whose bodies and
//! attributes add up to at most 256 KiB (a message longer than that goes
//! alone), all in flight together, and one result per message. A delay
//! above 900 s is refused for its message alone, before any I/O. An entry
//! SQS lists as failed through the sender's fault (`SenderFault` true) is
//! [`ErrorKind::NotAccepted`]; one it failed on its own side (`SenderFault`
//! false) is [`ErrorKind::Uncertain`], since SQS's API reference says only
//! that the action failed, not that nothing was stored; an entry the answer
//! does not mention is [`ErrorKind::Uncertain`]. A call that fails whole
//! gives each of its messages the error a `SendMessage` would have (not
//! accepted or uncertain as above), the SDK's error shared as their cause.
//! Concurrent dispatches share the client and a queue-URL cache read under
//! a lock held only for the lookup, never across a request.
//!
//! # Consumption
//!
//! A subscription long-polls `ReceiveMessage` (wait
//! [`wait_time`](SqsConfig::wait_time), `min(prefetch, 10)` messages per
//! call, visibility [`visibility_timeout`](SqsConfig::visibility_timeout))
//! only when the consumer asks for a delivery, and buffers what the calls
//! returned. To keep the consumer's slots full it keeps several calls in
//! flight: another starts while the messages it holds (handed out and not
//! yet settling, buffered, and the size of the calls in flight) leave room
//! for a whole call within the prefetch, and one always starts when the
//! consumer asks with nothing buffered or in flight; so it holds about the
//! prefetch (at most one call's worth over), and never asks for a handful.
//! Each call runs in its own task, so `next()` is cancel-safe: a dropped
//! `next()` leaves the calls and their messages to the next `next()`.
//!
//! # Attempts
//!
//! The attempt is SQS's `ApproximateReceiveCount`, which rises on every
//! receive, including after a crash or a lost connection, plus the message
//! attribute [`ATTEMPTS_ATTRIBUTE`] (`queue-attempts`, Number, 0 when
//! absent). That attribute is set only on the copy a graceful shutdown sends
//! (see below): it carries the receives the message consumed before that
//! copy, since a new message starts its receive count afresh. A second
//! attribute, [`SHUTDOWNS_ATTRIBUTE`] (`queue-shutdowns`, Number), counts the
//! deliveries a graceful shutdown handed back
//! ([`Delivery::shutdown_returns`](crate::Delivery::shutdown_returns)): they
//! do not consume the job's cap, while a crash (no settlement, so only the
//! receive count rises) does.
//!
//! # Leases
//!
//! From the moment a message is received, a background task extends its
//! visibility (`ChangeMessageVisibility` to the visibility timeout) every
//! half visibility timeout, never past 12 hours after the receive (SQS's
//! cap), so a handler longer than the visibility timeout is not delivered
//! twice. The renewal stops when the delivery is settled or dropped.
//! [`Delivery::deadline`](crate::Delivery::deadline) reports the 12-hour
//! limit. A delivery dropped unsettled is made visible again at once
//! (`ChangeMessageVisibility` 0, best effort; failing that it comes back
//! when its visibility ends); its receive count has risen, as a crash's
//! would. Messages a dropped subscription received but never handed out
//! (buffered, or taken by a long poll still in flight when its consumer
//! stopped) are handed back uncounted: a copy carrying one attempt less,
//! then the original deleted; where the copy is not taken they are released
//! like a dropped delivery, counted.
//!
//! # Settlements
//!
//! - Ack: an entry of a `DeleteMessageBatch` shared with the subscription's
//!   other acks. An ack waits for others to join only while the
//!   subscription has more deliveries in hand that could (handed out
//!   unsettled, or buffered), at most 10 entries and at most 2 ms, and
//!   never while every slot of the prefetch is taken by acks waiting for
//!   their call; the calls run in flight together. Each ack resolves
//!   with its own entry's result: deleted; refused (an expired or unknown
//!   receipt: [`ErrorKind::NotAccepted`], as a refused `DeleteMessage`);
//!   not in the answer ([`ErrorKind::Uncertain`]); or the error of a call
//!   that failed whole (not accepted when refused or certainly not sent,
//!   uncertain when the answer was lost). One refused entry fails only its
//!   own settlement.
//! - Retry with a delay: `ChangeMessageVisibility` to the delay rounded up to
//!   whole seconds (zero: visible at once). A delay that would end more than
//!   12 hours after the receive is refused with [`ErrorKind::Unsupported`]
//!   (a job whose declared delays and hold cannot fit is refused when its
//!   consumer starts, [`Driver::check_job`]); the message stays and comes
//!   back when its current visibility ends, as after any refused
//!   settlement (at least half a visibility timeout later). A failure
//!   record is never larger than [`MAX_BODY_BYTES`]: one that would be is
//!   cut to fit ([`jobrail::FailureRecord::encode_within`]).
//! - Retry without a delay: no request; the message comes back when its
//!   current visibility ends (at most one visibility timeout). These keep
//!   the same message, so its carried attributes stay valid.
//! - Retry from a graceful shutdown (always without delay): `SendMessage` of
//!   a copy (same body and encoding) to the work queue with
//!   `queue-attempts` = this delivery's attempt and `queue-shutdowns`
//!   incremented, then `DeleteMessage` of the original: SQS cannot change a
//!   message's attributes, and a visibility change would count as a receive.
//!   If the copy is not accepted the error is returned and the original is
//!   left; it comes back when its visibility ends, with a higher receive
//!   count. A crash between the copy and the delete duplicates the message,
//!   never loses it.
//! - Reject: no request; the message comes back when its visibility ends,
//!   and the queue's own redrive policy (if any) decides its fate. SQS has no
//!   way to drop a message other than deleting it.
//! - Fail: `SendMessage` of [`FailureRecord::encode`](jobrail::FailureRecord::encode) to the failure queue,
//!   then `DeleteMessage`. With no failure queue configured the record's
//!   reason is logged at error level and the message deleted. The transfer
//!   and the delete are not atomic: a crash between them duplicates the
//!   record, never loses it.
//!
//! # Failure store
//!
//! [`FailureStore`] (behind [`Failures`](crate::Failures))
//! works on the failure queue. SQS cannot peek, so each operation receives
//! the messages (short polls, each message hidden for 30 s) and then makes
//! visible again (visibility 0) what it does not keep or delete. List
//! receives everything and gives it all back, oldest sent first; it never
//! creates the failure queue, and a queue configured without one is
//! [`ErrorKind::Config`]. Claim receives until it finds the entry, gives
//! back the rest and keeps the entry hidden under its receipt handle,
//! renewed every 10 s: SQS hands a message to one receiver at a time, so
//! two claims never both get it. Remove after a claim is `DeleteMessage`
//! with that receipt (exactly that message); release or a dropped claim
//! makes it visible at once, and a claim whose process died lapses within
//! 30 s. Remove by ids deletes the named entries among those received;
//! claimed ones are not received, so they stay.
//!
//! Limits: what one operation holds is invisible to the others meanwhile.
//! An operation that saw fewer messages than the queue reports
//! (`ApproximateNumberOfMessages` plus `...NotVisible`) scans again, for
//! up to 3 s, and a list keeps the union of its scans; an entry held by a
//! live claim, or by a process that died mid-scan, stays out of sight until
//! released or lapsed. On SQS itself a short poll samples a subset of its
//! servers and the counts are approximate and lag, so a list can come back
//! short or late and a claim can miss its entry (not found: try again); the
//! emulator answers exactly.
//!
//! [`Admin`]: depth from `GetQueueAttributes`
//! (`ApproximateNumberOfMessages` ready, `...NotVisible` in flight,
//! `...Delayed` delayed; a queue that does not exist holds nothing and is
//! not created). `delete_queue` deletes the work and failure queues and
//! forgets their URLs, so a later use resolves or creates them again; SQS
//! itself refuses a deleted queue's name for 60 s.
//!
//! # Credentials
//!
//! Static keys, the standard environment variables, or an
//! [`SqsCredentialSource`] the application implements (see
//! [`SqsCredentials`]): the driver's own types, so the public API names no
//! type of the AWS SDK and does not change with its releases. A source is
//! asked for [`SqsKeys`] before the first request and again before they
//! expire; a source that fails makes [`SqsDriver::connect`] fail with
//! [`ErrorKind::Config`] and a dispatch with [`ErrorKind::NotAccepted`],
//! the source's error kept as the cause. The driver's own `Debug`
//! output, log lines and errors (connection errors included) never show the
//! keys, the session token or a message body. The secret key appears
//! nowhere, not even in the SDK's own logs. The SDK's debug and trace lines
//! (targets `aws_smithy_runtime` and `aws_sigv4`) do show the access key id,
//! and at trace level the session token and request bodies: keep those
//! targets at `info` or above in production.
//!
//! # With the endpoint down
//!
//! A dispatch while nothing answers at the endpoint fails at once (the
//! connection is refused) with [`ErrorKind::NotAccepted`]; an endpoint that
//! accepts connections but never answers is bounded by
//! [`operation_timeout`](SqsConfig::operation_timeout) (default 10 s).
//!
//! # Layout
//!
//! - `config`: [`SqsConfig`], [`SqsCredentials`], [`SqsKeys`] and
//!   [`SqsCredentialSource`], and their validation.
//! - `connection`: the SDK client and its credentials (a source adapted to
//!   the SDK's credentials provider), the probe of
//!   [`SqsDriver::connect`], the stopped state, the bound on every request.
//! - `topology`: queue names, resolving and creating queues, the redrive
//!   policy.
//! - `failures`: the failure store (list, claim, remove) and the admin
//!   interface (depth, deleting a queue).
//! - `publish`: `SendMessage` (dispatch, a shutdown's copy, a failure
//!   record's transfer), `SendMessageBatch` (a batch dispatch) and the
//!   body encoding.
//! - `delivery`: subscriptions (receive calls kept in flight), deliveries,
//!   leases and settlements.
//! - `acks`: acks coalesced into `DeleteMessageBatch` calls.
//! - `errors`: SDK errors as driver errors, with the SDK's error as cause.
//! - `testing` (feature `testing`): helpers for the test suites.

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

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::Client;

pub use config::{SqsConfig, SqsCredentialSource, SqsCredentials, SqsKeys};
use delivery::SqsSubscription;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing, Subscription};
use crate::failures::{Admin, FailureStore};
use crate::kit::Lifecycle;

const NAME: &str = "sqs";

/// The message attribute marking a base64-encoded body (value `base64`).
pub const ENCODING_ATTRIBUTE: &str = "queue-body-encoding";
/// The message attribute (Number) carrying the receives a message consumed
/// before it was sent again by a graceful shutdown.
pub const ATTEMPTS_ATTRIBUTE: &str = "queue-attempts";
/// The message attribute (Number) counting deliveries a graceful shutdown
/// handed back (see [`jobrail::exceeds_crash_bound`]).
pub const SHUTDOWNS_ATTRIBUTE: &str = "queue-shutdowns";
/// The longest dispatch delay SQS supports, in seconds.
pub const MAX_DELAY_SECONDS: u64 = 900;
/// SQS's cap on a message's invisibility, counted from its receive.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);

/// The largest body the driver sends: SQS's 262,144 bytes count message
/// attributes too, and 64 stay free for a retry's counts.
pub const MAX_BODY_BYTES: usize = 262_144 - 64;

struct Inner {
    config: SqsConfig,
    client: Client,
    /// Queue name -> URL.
    urls: Mutex<HashMap<String, String>>,
    /// Queues this driver created.
    created: Mutex<BTreeSet<String>>,
    life: Lifecycle,
}

/// The SQS driver. Clones share one client.
///
/// See the [module documentation](self) for the mapping and guarantees.
#[derive(Clone)]
pub struct SqsDriver {
    inner: Arc<Inner>,
}

impl fmt::Debug for SqsDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsDriver")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl SqsDriver {
    /// A driver with `config`; makes no request. Fails with
    /// [`ErrorKind::Config`] on an invalid configuration or, for
    /// [`SqsCredentials::Environment`], missing variables.
    pub fn new(config: SqsConfig) -> Result<Self, DriverError> {
        config.validate()?;
        let client = connection::client(&config)?;
        Ok(SqsDriver {
            inner: Arc::new(Inner {
                config,
                client,
                urls: Mutex::default(),
                created: Mutex::default(),
                life: Lifecycle::new(NAME),
            }),
        })
    }

    /// A driver with `config` whose endpoint and credentials were checked
    /// now (`ListQueues`): a wrong endpoint is [`ErrorKind::Connection`],
    /// refused credentials [`ErrorKind::Config`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use jobrail::Registry;
    /// use jobrail_native::Consumer;
    /// use jobrail_native::sqs::{SqsConfig, SqsDriver};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), jobrail_native::DriverError> {
    /// # let registry = Registry::new();
    /// // Credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; one
    /// // ListQueues call checks them and the endpoint now.
    /// let driver = Arc::new(SqsDriver::connect(SqsConfig::new("eu-west-1")).await?);
    /// Consumer::builder(driver, registry).build().run_until_signal().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(config: SqsConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        driver.probe().await?;
        Ok(driver)
    }

    /// The configuration in force.
    pub fn config(&self) -> &SqsConfig {
        &self.inner.config
    }
}

#[async_trait]
impl Driver for SqsDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: Some(MAX_VISIBILITY),
            // The visibility is extended every half of it while a handler runs.
            refused_hold: self.inner.config.visibility_timeout / 2,
            delayed_dispatch: true,
            max_dispatch_delay: Some(self.inner.config.max_dispatch_delay),
            reject_drops: false,
            redelivery_hint: self.inner.config.visibility_timeout,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            max_message_bytes: Some(MAX_BODY_BYTES),
            // Per queue: see `delivery_limit`.
            max_deliveries: None,
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.life.check_running()?;
        self.dispatch(queue, message).await
    }

    /// `SendMessageBatch`, up to 10 messages and 256 KiB per call, the
    /// calls in flight together (see the [module documentation](self#dispatch)).
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
        self.inner.life.check_running()?;
        Ok(Box::new(
            SqsSubscription::open(self, queue, prefetch).await?,
        ))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.mark_stopped();
        Ok(())
    }

    /// Refuses a job that can hold a delivery and then ask for a retry delay
    /// that together pass 12 hours: a retry's visibility counts from the
    /// receive ([`MAX_VISIBILITY`]), so the longest hold (every in-process
    /// attempt at its timeout, plus tier one's waits) and the longest
    /// declared delay must fit in it. A job without a timeout has no known
    /// hold: only its delay is checked (by the consumer, against
    /// `max_retry_delay`).
    fn check_job(&self, spec: &jobrail::JobSpec) -> Result<(), DriverError> {
        let (Some(hold), Some(delay)) = (
            jobrail::longest_hold(spec),
            jobrail::longest_retry_delay(spec),
        ) else {
            return Ok(());
        };
        let delay_secs = Duration::from_secs(jobrail::whole_seconds_up(delay));
        if hold.saturating_add(delay_secs) > MAX_VISIBILITY {
            return Err(DriverError::new(
                NAME,
                ErrorKind::Config,
                format!(
                    "job `{}` can hold a delivery for {hold:?} (its timeout times its in-process \
                     attempts, plus tier-one waits) and then asks for a retry delay of up to \
                     {delay:?}: SQS counts a retry's visibility from the receive, at most 12 h, so \
                     that retry would be refused; shorten the job's timeout, tier one or backoff",
                    spec.name
                ),
            ));
        }
        Ok(())
    }

    /// The work queue's redrive policy's `maxReceiveCount`, `None` without
    /// a policy (see the [module documentation](self#delivery-limit)).
    async fn delivery_limit(&self, queue: &str) -> Result<Option<u32>, DriverError> {
        self.inner.life.check_running()?;
        self.max_receive_count(queue).await
    }

    /// The failure queues (see the [module documentation](self#failure-store)).
    fn failure_store(&self) -> Option<&dyn FailureStore> {
        Some(self)
    }

    /// Depths from `GetQueueAttributes`, deletion with `DeleteQueue` (see
    /// the [module documentation](self#failure-store)).
    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }
}
