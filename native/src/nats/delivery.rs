//! Subscriptions (pull requests kept outstanding on one inbox), deliveries,
//! the lease ticker that renews every delivery a subscription holds, and
//! settlements.
//!
//! A subscription owns one core subscription on an inbox of its own (a new
//! one after each reconnection) and sends its pull requests
//! (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`) with that inbox as
//! their reply subject, so several requests are open at once and a new one
//! costs a publish, not a subscription and a round trip. Its window counts
//! the messages it holds (received, not yet settled or dropped) and those
//! it has asked for and not received; see the module documentation for the
//! bound.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::{HeaderMap, Message, StatusCode, Subject, Subscriber};
use async_trait::async_trait;
use futures_util::{FutureExt, StreamExt};
use jobrail::{FailureRecord, Settlement};
use tokio::time::Instant;
use tracing::{debug, error, warn};

use super::connection::Link;
use super::errors::{self, error};
use super::publish::Stored;
use super::{NatsDriver, ATTEMPTS_HEADER, SHUTDOWNS_HEADER};
use crate::driver::{Delivery, DriverError, ErrorKind, Subscription};
use crate::kit::{lock, Reconnect};

/// Kept past a pull request's expiry before the subscription stops counting
/// it on its own (the server's `408` normally ends it first).
const EXPIRY_GRACE: Duration = Duration::from_secs(1);

/// The server's count of a pull request's messages it did not deliver, on
/// a `408`/`409` ending the request.
const PENDING_MESSAGES: &str = "Nats-Pending-Messages";

/// What a subscription holds, shared with its deliveries and its lease
/// ticker.
struct Window {
    /// The most messages held plus asked for.
    prefetch: usize,
    held: Mutex<Held>,
    /// A held message was settled or dropped: the subscription may pull.
    freed: tokio::sync::Notify,
}

/// The messages a subscription received and has not seen settled or
/// dropped, each with its lease.
#[derive(Default)]
struct Held {
    leases: HashMap<u64, Lease>,
    next: u64,
}

struct Lease {
    /// The message's ack subject, where `+WPI` goes.
    reply: Subject,
    /// When its AckWait was last restarted (received, or `+WPI` sent).
    renewed: Instant,
}

impl Window {
    fn held(&self) -> usize {
        lock(&self.held).leases.len()
    }

    /// Starts holding (and leasing) the message acked at `reply`.
    fn hold(&self, reply: Subject) -> u64 {
        let mut held = lock(&self.held);
        let id = held.next;
        held.next = held.next.wrapping_add(1);
        held.leases.insert(
            id,
            Lease {
                reply,
                renewed: Instant::now(),
            },
        );
        id
    }

    /// Message `id` is settled or dropped: its slot is free.
    fn release(&self, id: u64) {
        lock(&self.held).leases.remove(&id);
        self.freed.notify_one();
    }

    /// The ack subjects whose lease is due (renewed at least `every` ago),
    /// marked renewed now.
    fn due(&self, every: Duration) -> Vec<Subject> {
        let now = Instant::now();
        let mut held = lock(&self.held);
        held.leases
            .values_mut()
            .filter(|lease| now.saturating_duration_since(lease.renewed) >= every)
            .map(|lease| {
                lease.renewed = now;
                lease.reply.clone()
            })
            .collect()
    }
}

/// The lease ticker of one subscription: every `every` (a quarter of
/// AckWait) it sends `+WPI` for each held message whose AckWait was last
/// restarted at least `every` ago, so none goes more than half AckWait
/// without one. It ends once the subscription and all its deliveries are
/// gone, or the driver is stopped.
async fn renew_leases(driver: NatsDriver, window: Weak<Window>, link: Arc<Link>, queue: Arc<str>) {
    let every = driver.inner.config.ack_wait / 4;
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = driver.inner.life.stopped() => return,
            _ = ticks.tick() => {}
        }
        let Some(window) = window.upgrade() else {
            return;
        };
        let due = window.due(every);
        drop(window);
        for reply in due {
            if let Err(e) = link.client.publish(reply, AckKind::Progress.into()).await {
                debug!(queue = %queue, "could not renew a delivery's lease: {e}");
            }
        }
    }
}

type Sending = Pin<Box<dyn Future<Output = Result<Sent, DriverError>> + Send>>;

/// A pull request sent.
struct Sent {
    /// The inbox subscription made for it (none was open on this
    /// connection).
    fresh: Option<Inbox>,
}

/// The inbox a subscription's pull requests are answered on.
struct Inbox {
    subject: Subject,
    subscriber: Subscriber,
    link: Arc<Link>,
    /// The connection generation it was made on.
    generation: u64,
}

/// A pull request the subscription counts as open.
struct Pull {
    /// Messages it may still deliver.
    remaining: usize,
    /// When the subscription stops counting it even without the server's
    /// `408`.
    until: Instant,
}

struct NatsSubscription {
    driver: NatsDriver,
    queue: Arc<str>,
    window: Arc<Window>,
    inbox: Option<Inbox>,
    /// Open pull requests, oldest first (the server fills them in order).
    pulls: VecDeque<Pull>,
    /// Messages asked for and not received: the sum of `pulls`' remaining.
    requested: usize,
    /// A pull request being sent (kept across cancelled `next()` calls).
    sending: Option<Sending>,
    /// The waits before pulling again after a failed pull.
    backoff: Reconnect,
    closed: bool,
}

/// What woke a subscription waiting for its next delivery.
enum Woken {
    Again,
    Sent(Result<Sent, DriverError>),
    Received(Option<Message>),
    Expired,
}

impl NatsDriver {
    /// A subscription to `queue` (declared first), holding at most
    /// `prefetch` messages, received or asked for.
    pub(super) async fn subscription(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.life.check_running()?;
        let max_ack_pending = self.declare(queue).await?.max_ack_pending;
        // Held delayed dispatches are moved to the work subject by a relay
        // in every worker (see `delay.rs`).
        self.start_relay(queue);
        let prefetch = prefetch.max(1);
        if max_ack_pending > 0 && prefetch as i64 > max_ack_pending {
            warn!(
                queue,
                prefetch,
                max_ack_pending,
                "the consumer's MaxAckPending is below this subscription's prefetch: \
                 the server delivers no more than MaxAckPending unacknowledged messages"
            );
        }
        let link = self.link().await?;
        let window = Arc::new(Window {
            prefetch,
            held: Mutex::default(),
            freed: tokio::sync::Notify::new(),
        });
        let queue: Arc<str> = Arc::from(queue);
        tokio::spawn(renew_leases(
            self.clone(),
            Arc::downgrade(&window),
            link,
            queue.clone(),
        ));
        Ok(Box::new(NatsSubscription {
            backoff: self.reconnect(),
            driver: self.clone(),
            queue,
            window,
            inbox: None,
            pulls: VecDeque::new(),
            requested: 0,
            sending: None,
            closed: false,
        }))
    }

    /// The subject pull requests for `queue`'s consumer are sent to.
    fn next_subject(&self, queue: &str) -> String {
        format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
            self.stream_name(queue),
            self.inner.config.consumer_name
        )
    }
}

impl NatsSubscription {
    /// The messages to ask for now, if any: the window's free slots, once
    /// they are at least half of it (so pull requests stay large).
    fn wanted(&self) -> Option<usize> {
        let prefetch = self.window.prefetch;
        let free = prefetch.saturating_sub(self.window.held() + self.requested);
        let threshold = (prefetch / 2).max(1);
        (free >= threshold).then_some(free)
    }

    /// Counts a pull request for `batch` messages as open and starts
    /// sending it (on the open inbox, or on a fresh one).
    fn send(&mut self, batch: usize) {
        let driver = self.driver.clone();
        let queue = self.queue.clone();
        let expiry = driver.inner.config.fetch_expiry;
        self.pulls.push_back(Pull {
            remaining: batch,
            until: Instant::now() + expiry + EXPIRY_GRACE,
        });
        self.requested += batch;
        let inbox = self
            .inbox
            .as_ref()
            .map(|inbox| (inbox.subject.clone(), inbox.link.clone()));
        #[cfg(feature = "testing")]
        driver
            .inner
            .pulls_sent
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.sending = Some(Box::pin(async move {
            driver.declare(&queue).await?;
            let request = serde_json::json!({
                "batch": batch,
                "expires": u64::try_from(expiry.as_nanos()).unwrap_or(u64::MAX),
            })
            .to_string();
            let (subject, link, fresh) = match inbox {
                Some((subject, link)) => (subject, link, None),
                None => {
                    let link = driver.link().await?;
                    driver.wait_connected(&link).await?;
                    let generation = *driver.inner.connections.borrow();
                    let subject = Subject::from(link.client.new_inbox());
                    let subscriber =
                        link.client.subscribe(subject.clone()).await.map_err(|e| {
                            errors::connection(format!("pull inbox for `{queue}`"), e)
                        })?;
                    let fresh = Inbox {
                        subject: subject.clone(),
                        subscriber,
                        link: link.clone(),
                        generation,
                    };
                    (subject, link, Some(fresh))
                }
            };
            link.client
                .publish_with_reply(driver.next_subject(&queue), subject, request.into())
                .await
                .map_err(|e| errors::connection(format!("pull request on `{queue}`"), e))?;
            Ok(Sent { fresh })
        }));
    }

    /// Stops counting every open pull request (their inbox is gone, or the
    /// consumer is).
    fn forget_pulls(&mut self) {
        self.pulls.clear();
        self.requested = 0;
        self.sending = None;
    }

    /// One message of the open pull requests arrived.
    fn count_received(&mut self) {
        if let Some(front) = self.pulls.front_mut() {
            front.remaining = front.remaining.saturating_sub(1);
            if front.remaining == 0 {
                self.pulls.pop_front();
            }
        }
        self.requested = self.requested.saturating_sub(1);
    }

    /// The server ended a pull request with `pending` messages undelivered
    /// (the oldest one, unless another matches `pending` exactly).
    fn count_ended(&mut self, pending: Option<usize>) {
        let at = pending
            .and_then(|pending| self.pulls.iter().position(|p| p.remaining == pending))
            .unwrap_or(0);
        if let Some(pull) = self.pulls.remove(at) {
            self.requested = self.requested.saturating_sub(pull.remaining);
        }
    }

    /// Pull requests past their expiry (and grace) are no longer counted.
    fn expire(&mut self) {
        let now = Instant::now();
        while self.pulls.front().is_some_and(|p| p.until <= now) {
            if let Some(pull) = self.pulls.pop_front() {
                self.requested = self.requested.saturating_sub(pull.remaining);
            }
        }
    }

    /// A message from the inbox: a delivery, or the server's word on a pull
    /// request (`None`: nothing to hand out).
    fn receive(
        &mut self,
        message: Message,
        link: Arc<Link>,
    ) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        match message.status {
            None | Some(StatusCode::OK) => {
                self.count_received();
                Some(Ok(self.deliver(message, link)))
            }
            Some(StatusCode::IDLE_HEARTBEAT) => None,
            Some(StatusCode::NO_RESPONDERS) => {
                // Nothing serves the consumer's pull subject: it is gone.
                self.forget_pulls();
                Some(Err(error(
                    ErrorKind::Connection,
                    format!(
                        "pull request on `{}`: no consumer answers (no responders)",
                        self.queue
                    ),
                )))
            }
            Some(status) => {
                let pending = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(PENDING_MESSAGES))
                    .and_then(|v| v.as_str().trim().parse::<usize>().ok());
                self.count_ended(pending);
                let description = message.description.unwrap_or_default();
                let lost = description.to_ascii_lowercase();
                if status == StatusCode::REQUEST_TERMINATED
                    && (lost.contains("deleted") || lost.contains("push based"))
                {
                    self.forget_pulls();
                    return Some(Err(error(
                        ErrorKind::Connection,
                        format!("pull request on `{}` ended: {description}", self.queue),
                    )));
                }
                if status != StatusCode::TIMEOUT {
                    debug!(queue = %self.queue, %status, "pull request ended: {description}");
                }
                None
            }
        }
    }

    fn deliver(&self, message: Message, link: Arc<Link>) -> Box<dyn Delivery> {
        let headers = message.headers.as_ref();
        let info = message.reply.as_deref().and_then(ack_info);
        let (attempt, stored) = match info {
            Some(info) => (
                attempt_of(headers, info.delivered),
                Stored {
                    sequence: info.stream_sequence,
                    published: info.published,
                },
            ),
            None => {
                warn!(queue = %self.queue, "a delivery without JetStream metadata");
                (
                    0,
                    Stored {
                        sequence: 0,
                        published: 0,
                    },
                )
            }
        };
        let shutdowns = header_count(headers, SHUTDOWNS_HEADER);
        let lease = message.reply.clone().map(|reply| self.window.hold(reply));
        Box::new(NatsDelivery {
            driver: self.driver.clone(),
            link,
            queue: self.queue.clone(),
            window: self.window.clone(),
            lease,
            message,
            attempt,
            shutdowns,
            stored,
            settled: false,
        })
    }

    /// Waits before pulling again (ends early once the driver is stopped).
    async fn wait(&mut self) {
        let wait = self.backoff.failed();
        tokio::select! {
            _ = self.driver.inner.life.stopped() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }

    /// A pull failed: warn, declare the topology again, back off.
    async fn failed(&mut self, e: &DriverError) {
        warn!(queue = %self.queue, "cannot pull, retrying in {:?}: {e}", self.backoff.upcoming());
        self.forget_pulls();
        self.driver.forget(&self.queue);
        self.wait().await;
    }
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        let mut stopped = self.driver.inner.life.watch();
        let mut connections = self.driver.inner.connections.subscribe();
        loop {
            if self.closed || *stopped.borrow_and_update() {
                self.inbox = None;
                self.forget_pulls();
                return None;
            }
            let generation = *connections.borrow_and_update();
            if let Some(inbox) = self.inbox.as_mut() {
                if inbox.generation != generation {
                    // Made on a connection since lost: hand out what already
                    // arrived, then pull afresh on a fresh inbox (the old
                    // one's requests find no interest and end).
                    if let Some(Some(message)) = inbox.subscriber.next().now_or_never() {
                        let link = inbox.link.clone();
                        match self.receive(message, link) {
                            Some(Ok(delivery)) => return Some(Ok(delivery)),
                            _ => continue,
                        }
                    }
                    debug!(queue = %self.queue, "reconnected: abandoning the open pull requests");
                    self.inbox = None;
                    self.forget_pulls();
                    continue;
                }
            }
            self.expire();
            if self.sending.is_none() {
                if let Some(batch) = self.wanted() {
                    self.send(batch);
                }
            }
            let until = self.pulls.front().map(|p| p.until);
            let woken = {
                let Self {
                    sending,
                    inbox,
                    window,
                    ..
                } = self;
                let sent = async {
                    match sending.as_mut() {
                        Some(sending) => sending.await,
                        None => std::future::pending().await,
                    }
                };
                let received = async {
                    match inbox.as_mut() {
                        Some(inbox) => inbox.subscriber.next().await,
                        None => std::future::pending().await,
                    }
                };
                let expired = async {
                    match until {
                        Some(until) => tokio::time::sleep_until(until).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = stopped.changed() => Woken::Again,
                    _ = connections.changed() => Woken::Again,
                    _ = window.freed.notified() => Woken::Again,
                    sent = sent => Woken::Sent(sent),
                    message = received => Woken::Received(message),
                    _ = expired => Woken::Expired,
                }
            };
            match woken {
                Woken::Again | Woken::Expired => {}
                Woken::Sent(Ok(sent)) => {
                    self.sending = None;
                    self.backoff.succeeded();
                    if let Some(fresh) = sent.fresh {
                        self.inbox = Some(fresh);
                    }
                }
                Woken::Sent(Err(e)) => {
                    self.sending = None;
                    if e.kind() == ErrorKind::Stopped {
                        return None;
                    }
                    self.failed(&e).await;
                    if e.kind() == ErrorKind::Config {
                        // Someone changed the topology under us: say so to the consumer too.
                        return Some(Err(e));
                    }
                }
                Woken::Received(None) => {
                    // The inbox subscription ended (the client closed it).
                    self.inbox = None;
                    self.forget_pulls();
                }
                Woken::Received(Some(message)) => {
                    let Some(link) = self.inbox.as_ref().map(|inbox| inbox.link.clone()) else {
                        continue;
                    };
                    match self.receive(message, link) {
                        Some(Ok(delivery)) => return Some(Ok(delivery)),
                        Some(Err(e)) => {
                            self.failed(&e).await;
                        }
                        None => {}
                    }
                }
            }
        }
    }

    /// Unsubscribes the inbox: the server ends the open pull requests (no
    /// interest) and sends nothing more. Deliveries handed out stay
    /// settleable and leased.
    async fn close(&mut self) {
        self.closed = true;
        if let Some(mut inbox) = self.inbox.take() {
            let _ = inbox.subscriber.unsubscribe().await;
        }
        self.forget_pulls();
    }
}

/// What a delivery's ack subject says about it.
struct AckInfo {
    /// The server's delivery count (first = 1).
    delivered: i64,
    stream_sequence: u64,
    /// When the server stored the message, in nanoseconds since the epoch.
    published: i128,
}

/// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
/// seq>.<time>.<pending>`, or the form with a domain and account hash
/// before the stream (and a token after).
fn ack_info(reply: &str) -> Option<AckInfo> {
    let rest = reply.strip_prefix("$JS.ACK.")?;
    let mut tokens: [&str; 12] = [""; 12];
    let mut count = 0;
    for token in rest.split('.') {
        if count == tokens.len() {
            break;
        }
        tokens[count] = token;
        count += 1;
    }
    let at = match count {
        7 => 2,
        n if n >= 9 => 4,
        _ => return None,
    };
    Some(AckInfo {
        delivered: tokens[at].parse().ok()?,
        stream_sequence: tokens[at + 1].parse().ok()?,
        published: tokens[at + 3].parse().ok()?,
    })
}

/// A count header, 0 when absent or unreadable, saturating at `u32::MAX`.
fn header_count(headers: Option<&HeaderMap>, name: &str) -> u32 {
    headers
        .and_then(|h| h.get(name))
        .and_then(|v| v.as_str().trim().parse::<u64>().ok())
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// [`ATTEMPTS_HEADER`] + the server's delivery count, saturating.
fn attempt_of(headers: Option<&HeaderMap>, delivered: i64) -> u32 {
    let delivered = u32::try_from(delivered.max(0)).unwrap_or(u32::MAX);
    header_count(headers, ATTEMPTS_HEADER).saturating_add(delivered)
}

/// How a final acknowledgement is sent (see the module documentation for
/// which settlement uses which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Confirm {
    /// A request the server answers once it has processed it: `Ok` means
    /// it did.
    Double,
    /// A plain publish: `Ok` means it was handed to the connection.
    Plain,
}

struct NatsDelivery {
    driver: NatsDriver,
    link: Arc<Link>,
    queue: Arc<str>,
    window: Arc<Window>,
    /// Its lease in the window (`None`: no ack subject, nothing to lease).
    lease: Option<u64>,
    message: Message,
    attempt: u32,
    /// Earlier deliveries a graceful shutdown handed back.
    shutdowns: u32,
    stored: Stored,
    settled: bool,
}

impl NatsDelivery {
    /// Sends the final `kind`, confirmed as `confirm` says. Its slot in the
    /// window is freed as it is sent: the message is no longer this
    /// subscription's to hold.
    async fn reply(
        &mut self,
        kind: AckKind,
        confirm: Confirm,
        what: &str,
    ) -> Result<(), DriverError> {
        if let Some(id) = self.lease.take() {
            self.window.release(id);
        }
        self.settled = true;
        let Some(reply) = self.message.reply.clone() else {
            return Err(error(
                ErrorKind::Connection,
                format!(
                    "{what} of a delivery from `{}`: it has no ack subject",
                    self.queue
                ),
            ));
        };
        let limit = self.driver.inner.config.operation_timeout;
        let client = &self.link.client;
        let sent = match confirm {
            Confirm::Double => tokio::time::timeout(limit, client.request(reply, kind.into()))
                .await
                .map(|answer| {
                    answer.map(|_| ()).map_err(|e| {
                        let timed_out = e.kind() == async_nats::RequestErrorKind::TimedOut;
                        errors::settlement(what, &self.queue, e, timed_out)
                    })
                }),
            Confirm::Plain => tokio::time::timeout(limit, client.publish(reply, kind.into()))
                .await
                .map(|sent| sent.map_err(|e| errors::settlement(what, &self.queue, e, false))),
        };
        match sent {
            Ok(result) => result,
            Err(_) => Err(error(
                ErrorKind::Uncertain,
                format!(
                    "{what} of a delivery from `{}`: no confirmation within {limit:?}",
                    self.queue
                ),
            )),
        }
    }

    fn message_id(&self) -> Option<String> {
        self.message
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.to_string())
    }

    /// A graceful-shutdown retry: publishes a copy carrying this delivery's
    /// attempt and one more shutdown, then acks the original (plainly: the
    /// copy is stored). If the copy is not accepted the original is left
    /// (it comes back), never acked.
    async fn hand_back(&mut self) -> Result<(), DriverError> {
        // The lease keeps running while the copy is published.
        self.driver
            .publish_shutdown_copy(
                &self.queue,
                self.stored,
                self.message.payload.to_vec(),
                self.attempt,
                self.shutdowns.saturating_add(1),
            )
            .await?;
        self.reply(AckKind::Ack, Confirm::Plain, "ack after the shutdown copy")
            .await
    }

    async fn fail(&mut self, record: &FailureRecord) -> Result<(), DriverError> {
        match self.driver.failure_subject(&self.queue) {
            Some(subject) => {
                // The lease keeps running while the record is transferred.
                self.driver
                    .publish_failure(&self.queue, &subject, self.stored, record)
                    .await?;
                self.reply(
                    AckKind::Ack,
                    Confirm::Plain,
                    "ack after the failure transfer",
                )
                .await
            }
            None => {
                self.reply(AckKind::Ack, Confirm::Double, "ack").await?;
                error!(
                    queue = %self.queue,
                    message_id = self.message_id().as_deref().unwrap_or(""),
                    attempt = self.attempt,
                    "terminal failure, no failure subject configured; message acknowledged: {}",
                    record.reason
                );
                Ok(())
            }
        }
    }
}

impl Drop for NatsDelivery {
    /// Frees its slot; unsettled (never asked to settle: a handler task that
    /// died): `-NAK` so the message comes back now.
    fn drop(&mut self) {
        if let Some(id) = self.lease {
            self.window.release(id);
        }
        if self.settled || self.driver.inner.life.is_stopped() {
            return;
        }
        let Some(reply) = self.message.reply.clone() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let link = self.link.clone();
            runtime.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(10),
                    link.client.publish(reply, AckKind::Nak(None).into()),
                )
                .await;
            });
        }
    }
}

#[async_trait]
impl Delivery for NatsDelivery {
    fn body(&self) -> &[u8] {
        &self.message.payload
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn shutdown_returns(&self) -> Option<u32> {
        Some(self.shutdowns)
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        if self.driver.inner.life.is_stopped() {
            self.settled = true;
            return Err(error(
                ErrorKind::Stopped,
                "the nats driver has been stopped; the message is redelivered after AckWait",
            ));
        }
        let result = match settlement {
            Settlement::Ack => self.reply(AckKind::Ack, Confirm::Double, "ack").await,
            Settlement::Reject => self.reply(AckKind::Term, Confirm::Double, "term").await,
            Settlement::Retry { shutdown: true, .. } => self.hand_back().await,
            Settlement::Retry { delay, .. } => match delay.filter(|d| !d.is_zero()) {
                None => self.reply(AckKind::Nak(None), Confirm::Double, "nak").await,
                Some(delay) if delay.as_nanos() > i64::MAX as u128 => Err(error(
                    ErrorKind::Unsupported,
                    format!("retry delay {delay:?} exceeds what JetStream can express"),
                )),
                Some(delay) => {
                    self.reply(AckKind::Nak(Some(delay)), Confirm::Double, "nak")
                        .await
                }
            },
            Settlement::Fail(record) => self.fail(record).await,
        };
        if result.is_err() {
            // Refused (a failure record or a shutdown copy the server did
            // not take, a delay it cannot express): no `-NAK` when dropped,
            // which would bring the message back at once, again and again;
            // the server redelivers it when AckWait ends.
            self.settled = true;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempts_combine_header_and_delivery_count() {
        let with = |pairs: &[(&str, &str)]| {
            let mut headers = HeaderMap::new();
            for (k, v) in pairs {
                headers.insert(*k, *v);
            }
            headers
        };
        assert_eq!(attempt_of(None, 1), 1);
        assert_eq!(attempt_of(None, 3), 3);
        assert_eq!(attempt_of(Some(&with(&[])), 2), 2);
        assert_eq!(attempt_of(Some(&with(&[(ATTEMPTS_HEADER, "4")])), 1), 5);
        assert_eq!(attempt_of(Some(&with(&[(ATTEMPTS_HEADER, "4")])), 3), 7);
        assert_eq!(
            attempt_of(Some(&with(&[(ATTEMPTS_HEADER, "99999999999")])), 1),
            u32::MAX
        );
        assert_eq!(
            attempt_of(Some(&with(&[(ATTEMPTS_HEADER, &u32::MAX.to_string())])), 2),
            u32::MAX
        );
        assert_eq!(attempt_of(Some(&with(&[(ATTEMPTS_HEADER, "-5")])), 1), 1);
        assert_eq!(attempt_of(Some(&with(&[(ATTEMPTS_HEADER, "x")])), 1), 1);
        assert_eq!(attempt_of(None, i64::MAX), u32::MAX);
        assert_eq!(attempt_of(None, -1), 0);
        // Graceful-shutdown returns travel in their own header; a crash (the
        // delivery count) never adds to them.
        let headers = with(&[(ATTEMPTS_HEADER, "2"), (SHUTDOWNS_HEADER, "2")]);
        assert_eq!(attempt_of(Some(&headers), 2), 4);
        assert_eq!(header_count(Some(&headers), SHUTDOWNS_HEADER), 2);
        assert_eq!(header_count(Some(&with(&[])), SHUTDOWNS_HEADER), 0);
        assert_eq!(header_count(None, SHUTDOWNS_HEADER), 0);
    }
}
