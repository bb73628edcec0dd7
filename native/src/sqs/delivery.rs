//! Subscriptions, deliveries and their leases.
//!
//! A subscription keeps `ReceiveMessage` calls in flight for its consumer:
//! when asked for a delivery it starts calls (each for `min(prefetch, 10)`
//! messages) while the messages in hand (handed out unsettled, buffered,
//! and the capacity of the calls in flight) leave room for one more call
//! within the prefetch, or when it has nothing buffered or in flight and
//! fewer than the prefetch handed out; and, whatever it holds, one call
//! when asked with nothing buffered or in flight (a consumer asks only
//! with a free slot). So the next messages are already arriving while the
//! consumer runs the last ones, a call never asks for fewer messages than
//! that, and what is held stays within about the prefetch (at most one
//! call's worth over). Acks go through the subscription's [`Acker`]
//! (`DeleteMessageBatch`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use futures_util::stream::{FuturesUnordered, StreamExt};
use jobrail::{FailureRecord, Instant, Settlement};
use tokio::task::JoinHandle;
use tracing::{debug, error, warn};

use super::acks::Acker;
use super::connection::bounded;
use super::errors::{error, is_missing_queue, sdk_error};
use super::publish::decode_body;
use super::{
    SqsDriver, ATTEMPTS_ATTRIBUTE, ENCODING_ATTRIBUTE, MAX_VISIBILITY, NAME, SHUTDOWNS_ATTRIBUTE,
};
use crate::driver::{Delivery, DriverError, ErrorKind, Subscription};
use crate::kit::failed;

/// Whether a received message's body is base64 (see [`ENCODING_ATTRIBUTE`]).
pub(super) fn is_base64(message: &Message) -> bool {
    message
        .message_attributes()
        .and_then(|a| a.get(ENCODING_ATTRIBUTE))
        .and_then(|v| v.string_value())
        == Some("base64")
}

/// A Number message attribute, 0 when absent or unreadable, saturating at
/// `u32::MAX`.
fn attribute_count(message: &Message, name: &str) -> u32 {
    message
        .message_attributes()
        .and_then(|a| a.get(name))
        .and_then(|v| v.string_value())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// `ApproximateReceiveCount` + [`ATTEMPTS_ATTRIBUTE`], saturating; 0
/// (unknown) without a receive count.
fn attempt_of(message: &Message) -> Option<u32> {
    message
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
        .and_then(|n| n.parse::<u32>().ok())
        .map(|received| received.saturating_add(attribute_count(message, ATTEMPTS_ATTRIBUTE)))
}

/// What one `ReceiveMessage` call returned.
type Batch = Result<Vec<SqsDelivery>, DriverError>;

pub(super) struct SqsSubscription {
    driver: SqsDriver,
    queue: Arc<str>,
    url: Arc<str>,
    failure_url: Option<Arc<str>>,
    max_messages: i32,
    prefetch: usize,
    /// Received, not yet handed out (their leases run).
    buffer: VecDeque<SqsDelivery>,
    /// The receive calls in flight: kept across dropped `next()` futures.
    pending: FuturesUnordered<JoinHandle<Batch>>,
    /// Its deliveries' acks.
    acker: Arc<Acker>,
}

impl SqsSubscription {
    /// A subscription to `queue`, resolving (creating) the work queue and
    /// its failure queue first. Receives nothing until asked.
    pub(super) async fn open(
        driver: &SqsDriver,
        queue: &str,
        prefetch: usize,
    ) -> Result<Self, DriverError> {
        let (url, failure_url) = driver.resolve_work(queue).await?;
        let (queue, url): (Arc<str>, Arc<str>) = (queue.into(), url.into());
        let prefetch = prefetch.max(1);
        Ok(SqsSubscription {
            driver: driver.clone(),
            acker: Arc::new(Acker::new(
                driver.clone(),
                queue.clone(),
                url.clone(),
                prefetch,
            )),
            queue,
            url,
            failure_url: failure_url.map(Into::into),
            max_messages: prefetch.min(10) as i32,
            prefetch,
            buffer: VecDeque::new(),
            pending: FuturesUnordered::new(),
        })
    }

    /// Starts receive calls while the messages in hand leave room (see the
    /// module docs).
    fn top_up(&mut self) {
        let max = self.max_messages as usize;
        let out = self.acker.out();
        loop {
            let idle = self.buffer.is_empty() && self.pending.is_empty();
            let held = out + self.buffer.len() + self.pending.len() * max;
            if !(idle && out < self.prefetch) && held + max > self.prefetch {
                return;
            }
            self.pending.push(self.start_receive());
        }
    }

    /// Starts a `ReceiveMessage` call in its own task.
    fn start_receive(&self) -> JoinHandle<Batch> {
        let driver = self.driver.clone();
        let queue = self.queue.clone();
        let url = self.url.clone();
        let failure_url = self.failure_url.clone();
        let acker = self.acker.clone();
        let max = self.max_messages;
        tokio::spawn(async move {
            let config = &driver.inner.config;
            let wait = config.wait_time;
            let limit = config.operation_timeout + wait;
            let what = format!("ReceiveMessage from `{queue}`");
            // Measured before the request: SQS's 12-hour clock starts no
            // earlier than this.
            let received = Instant::now();
            #[allow(deprecated)] // `AttributeNames`: for servers without the newer parameter.
            let request = driver
                .inner
                .client
                .receive_message()
                .queue_url(&*url)
                .max_number_of_messages(max)
                .wait_time_seconds(wait.as_secs() as i32)
                .visibility_timeout(config.visibility_timeout.as_secs() as i32)
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .attribute_names(aws_sdk_sqs::types::QueueAttributeName::All)
                .message_attribute_names(ENCODING_ATTRIBUTE)
                .message_attribute_names(ATTEMPTS_ATTRIBUTE)
                .message_attribute_names(SHUTDOWNS_ATTRIBUTE);
            let out = match bounded(limit, &what, ErrorKind::Connection, request.send()).await? {
                Ok(out) => out,
                Err(e) => {
                    if is_missing_queue(&e) {
                        driver.forget(&queue);
                    }
                    return Err(sdk_error(
                        &what,
                        e,
                        ErrorKind::Connection,
                        ErrorKind::Connection,
                    ));
                }
            };
            let mut batch = Vec::new();
            for message in out.messages() {
                let Some(receipt) = message.receipt_handle().map(str::to_string) else {
                    warn!(queue = %queue, "a received message has no receipt handle; skipped");
                    continue;
                };
                let attempt = attempt_of(message).unwrap_or_else(|| {
                    warn!(queue = %queue, "no ApproximateReceiveCount on a message: attempt unknown (0)");
                    0
                });
                let shutdowns = attribute_count(message, SHUTDOWNS_ATTRIBUTE);
                let body = decode_body(message.body().unwrap_or_default(), is_base64(message));
                let hold = Hold::start(driver.clone(), url.clone(), receipt, received);
                batch.push(SqsDelivery {
                    acker: acker.clone(),
                    out: false,
                    queue: queue.clone(),
                    failure_url: failure_url.clone(),
                    message_id: message.message_id().unwrap_or_default().to_string(),
                    body,
                    attempt,
                    shutdowns,
                    hold,
                });
            }
            Ok(batch)
        })
    }
}

#[async_trait]
impl Subscription for SqsSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        let driver = self.driver.clone();
        let life = &driver.inner.life;
        loop {
            if life.is_stopped() {
                self.buffer.clear();
                self.acker.set_buffered(0);
                return None;
            }
            if let Some(mut delivery) = self.buffer.pop_front() {
                delivery.out = true;
                self.acker.handed_out();
                self.acker.set_buffered(self.buffer.len());
                self.top_up();
                return Some(Ok(Box::new(delivery)));
            }
            self.top_up();
            if self.pending.is_empty() {
                // Asked with nothing in hand: receive whatever is held.
                self.pending.push(self.start_receive());
            }
            // Cancel-safe: if this future is dropped here, the calls stay
            // in `pending`.
            let joined = tokio::select! {
                _ = life.stopped() => continue,
                joined = self.pending.next() => joined,
            };
            let Some(joined) = joined else {
                continue;
            };
            match joined {
                Ok(Ok(batch)) => {
                    self.buffer.extend(batch);
                    self.acker.set_buffered(self.buffer.len());
                }
                Ok(Err(e)) => return Some(Err(e)),
                Err(e) => {
                    return Some(Err(failed(
                        NAME,
                        ErrorKind::Connection,
                        format!("the receive task of `{}`", self.queue),
                        e,
                    )))
                }
            }
        }
    }
}

/// A subscription dropped (its consumer stopped) may still have a
/// `ReceiveMessage` call in flight and deliveries buffered that no handler
/// ever saw. SQS has already counted those receives, so handing them back
/// by visibility alone would make the next consumer see one attempt more
/// than the message spent, and a job allowed one delivery would fail
/// without running. Each is handed back uncounted instead: a copy carrying
/// one attempt less, then the original deleted (copy first: a failure
/// between the two duplicates, never loses). Where the copy is not taken,
/// the hold's own release makes the original visible again, counted.
impl Drop for SqsSubscription {
    fn drop(&mut self) {
        let buffered: Vec<SqsDelivery> = self.buffer.drain(..).collect();
        let pending = std::mem::take(&mut self.pending);
        if buffered.is_empty() && pending.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.acker.set_buffered(0);
        runtime.spawn(async move {
            let mut unseen = buffered;
            for pending in pending {
                if let Ok(Ok(batch)) = pending.await {
                    unseen.extend(batch);
                }
            }
            for mut delivery in unseen {
                delivery.return_uncounted().await;
            }
        });
    }
}

/// The driver's hold on one received message: its receipt and the task
/// renewing its visibility.
struct Hold {
    driver: SqsDriver,
    url: Arc<str>,
    receipt: String,
    received: Instant,
    /// `true` once renewal must stop. The renewal task holds the lock while
    /// its request is in flight, so a settlement that takes it runs after.
    stop: Arc<tokio::sync::Mutex<bool>>,
    renewal: tokio::task::AbortHandle,
    /// Settled (or settling): do not release on drop.
    settled: bool,
}

impl Hold {
    fn start(driver: SqsDriver, url: Arc<str>, receipt: String, received: Instant) -> Self {
        let stop = Arc::new(tokio::sync::Mutex::new(false));
        let renewal = tokio::spawn(renew(
            driver.clone(),
            url.clone(),
            receipt.clone(),
            received,
            stop.clone(),
        ))
        .abort_handle();
        Hold {
            driver,
            url,
            receipt,
            received,
            stop,
            renewal,
            settled: false,
        }
    }

    /// Stops the renewal, waiting for a renewal request in flight.
    async fn stop_renewal(&mut self) {
        self.settled = true;
        *self.stop.lock().await = true;
        self.renewal.abort();
    }

    async fn change_visibility(&self, seconds: u64) -> Result<(), DriverError> {
        change_visibility(&self.driver, &self.url, &self.receipt, seconds).await
    }

    async fn delete(&self) -> Result<(), DriverError> {
        delete_message(&self.driver, &self.url, &self.receipt, "DeleteMessage").await
    }
}

/// `DeleteMessage` of the message of `receipt` (`what` names the request in
/// errors): not accepted when SQS refused it, uncertain when the answer was
/// lost.
pub(super) async fn delete_message(
    driver: &SqsDriver,
    url: &str,
    receipt: &str,
    what: &str,
) -> Result<(), DriverError> {
    let limit = driver.inner.config.operation_timeout;
    bounded(
        limit,
        what,
        ErrorKind::Uncertain,
        driver
            .inner
            .client
            .delete_message()
            .queue_url(url)
            .receipt_handle(receipt)
            .send(),
    )
    .await?
    .map(|_| ())
    .map_err(|e| sdk_error(what, e, ErrorKind::NotAccepted, ErrorKind::Uncertain))
}

impl Drop for Hold {
    /// Unsettled (a dropped delivery, or one buffered by a dropped
    /// subscription): make the message visible again now, best effort.
    fn drop(&mut self) {
        self.renewal.abort();
        if self.settled || self.driver.inner.life.is_stopped() {
            return;
        }
        release_soon(
            &self.driver,
            &self.url,
            std::mem::take(&mut self.receipt),
            &self.stop,
            "an unsettled message (it returns when its visibility ends)",
        );
    }
}

/// From a `Drop`: makes the message of `receipt` visible again now, in a
/// task of its own, once the renewal guarded by `stop` has let go; best
/// effort (failing that, the message returns when its visibility ends).
/// `what` names it in the debug line of a failure.
pub(super) fn release_soon(
    driver: &SqsDriver,
    url: &Arc<str>,
    receipt: String,
    stop: &Arc<tokio::sync::Mutex<bool>>,
    what: &'static str,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (driver, url, stop) = (driver.clone(), url.clone(), stop.clone());
    runtime.spawn(async move {
        *stop.lock().await = true;
        if let Err(e) = change_visibility(&driver, &url, &receipt, 0).await {
            debug!("could not release {what}: {e}");
        }
    });
}

pub(super) async fn change_visibility(
    driver: &SqsDriver,
    url: &str,
    receipt: &str,
    seconds: u64,
) -> Result<(), DriverError> {
    let what = "ChangeMessageVisibility";
    let limit = driver.inner.config.operation_timeout;
    bounded(
        limit,
        what,
        ErrorKind::Uncertain,
        driver
            .inner
            .client
            .change_message_visibility()
            .queue_url(url)
            .receipt_handle(receipt)
            .visibility_timeout(seconds as i32)
            .send(),
    )
    .await?
    .map(|_| ())
    .map_err(|e| sdk_error(what, e, ErrorKind::NotAccepted, ErrorKind::Uncertain))
}

/// Extends the visibility every half visibility timeout, never past 12 h
/// after the receive, until told to stop.
async fn renew(
    driver: SqsDriver,
    url: Arc<str>,
    receipt: String,
    received: Instant,
    stop: Arc<tokio::sync::Mutex<bool>>,
) {
    let visibility = driver.inner.config.visibility_timeout;
    let period = (visibility / 2).max(Duration::from_millis(500));
    let limit = received + MAX_VISIBILITY;
    loop {
        tokio::time::sleep(period).await;
        let stopped = stop.lock().await;
        if *stopped || driver.inner.life.is_stopped() {
            return;
        }
        let left = limit.saturating_duration_since(Instant::now());
        // Whole seconds, rounded down: never ask past the 12-hour cap.
        let seconds = visibility.min(left).as_secs();
        if seconds == 0 {
            return;
        }
        match change_visibility(&driver, &url, &receipt, seconds).await {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotAccepted => {
                // Deleted, receipt expired (its visibility had already ended),
                // or past the cap: nothing left to renew.
                debug!("visibility renewal ends: {e}");
                return;
            }
            Err(e) => warn!("visibility renewal failed, trying again in {period:?}: {e}"),
        }
        drop(stopped);
    }
}

pub(super) struct SqsDelivery {
    /// Its subscription's acks.
    acker: Arc<Acker>,
    /// Handed out and not yet settling: counted by the acker.
    out: bool,
    queue: Arc<str>,
    failure_url: Option<Arc<str>>,
    message_id: String,
    body: Vec<u8>,
    attempt: u32,
    /// Earlier deliveries a graceful shutdown handed back.
    shutdowns: u32,
    hold: Hold,
}

impl SqsDelivery {
    /// No longer counted as handed out (settling otherwise than by ack, or
    /// dropped).
    fn leave(&mut self) {
        if std::mem::take(&mut self.out) {
            self.acker.left();
        }
    }

    async fn retry(&mut self, delay: Option<Duration>) -> Result<(), DriverError> {
        let Some(delay) = delay else {
            // Driver timing: back when the current visibility ends.
            return Ok(());
        };
        let seconds = jobrail::whole_seconds_up(delay);
        let since_receive = self.hold.received.elapsed();
        if since_receive.saturating_add(Duration::from_secs(seconds)) > MAX_VISIBILITY {
            return Err(error(
                ErrorKind::Unsupported,
                format!(
                    "retry delay {delay:?} would end more than 12 h after the message was received \
                     (SQS's visibility cap); the message stays in `{}` and returns when its visibility ends",
                    self.queue
                ),
            ));
        }
        self.hold.change_visibility(seconds).await
    }

    /// A graceful-shutdown retry: sends a copy carrying this delivery's
    /// attempt and one more shutdown, then deletes the original. If the copy
    /// is not accepted the original is left (it returns when its visibility
    /// ends), never deleted.
    async fn hand_back(&mut self) -> Result<(), DriverError> {
        let driver = self.hold.driver.clone();
        let counts = [
            (ATTEMPTS_ATTRIBUTE, self.attempt),
            (SHUTDOWNS_ATTRIBUTE, self.shutdowns.saturating_add(1)),
        ];
        driver
            .send_body(&self.queue, &self.hold.url, &self.body, 0, &counts)
            .await?;
        self.hold.delete().await
    }

    /// Hands back a delivery no handler saw, without spending an attempt:
    /// a copy carrying one attempt less (and the same shutdown count), then
    /// the original deleted. Unknown attempts (0), a stopped driver or a
    /// copy not taken leave the original to the hold's release (counted).
    async fn return_uncounted(&mut self) {
        if self.attempt == 0 || self.hold.driver.inner.life.is_stopped() {
            return;
        }
        self.hold.stop_renewal().await;
        let driver = self.hold.driver.clone();
        let counts = [
            (ATTEMPTS_ATTRIBUTE, self.attempt - 1),
            (SHUTDOWNS_ATTRIBUTE, self.shutdowns),
        ];
        let copied = driver
            .send_body(&self.queue, &self.hold.url, &self.body, 0, &counts)
            .await;
        match copied {
            Ok(()) => {
                if let Err(e) = self.hold.delete().await {
                    debug!(queue = %self.queue, "a message handed back uncounted may be delivered twice (the original was not deleted): {e}");
                }
            }
            Err(e) => {
                debug!(queue = %self.queue, "could not hand back an unseen message uncounted (it returns counted): {e}");
                // Release as an unsettled hold does.
                self.hold.settled = false;
            }
        }
    }

    async fn fail(&mut self, record: &FailureRecord) -> Result<(), DriverError> {
        let driver = self.hold.driver.clone();
        match self.failure_url.clone() {
            Some(url) => {
                let failed = driver.failure_queue_name(&self.queue).unwrap_or_default();
                driver
                    .send_body(&failed, &url, &super::publish::record_body(record), 0, &[])
                    .await?;
                self.hold.delete().await
            }
            None => {
                self.hold.delete().await?;
                error!(
                    queue = %self.queue,
                    message_id = %self.message_id,
                    attempt = self.attempt,
                    "terminal failure, no failure queue configured; message deleted: {}",
                    record.reason
                );
                Ok(())
            }
        }
    }
}

#[async_trait]
impl Delivery for SqsDelivery {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn shutdown_returns(&self) -> Option<u32> {
        Some(self.shutdowns)
    }

    fn deadline(&self) -> Option<Instant> {
        Some(self.hold.received + MAX_VISIBILITY)
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        self.hold.stop_renewal().await;
        if self.hold.driver.inner.life.is_stopped() {
            self.leave();
            return Err(error(
                ErrorKind::Stopped,
                "the sqs driver has been stopped; the message returns when its visibility ends",
            ));
        }
        if let Settlement::Ack = settlement {
            // Coalesced with the subscription's other acks.
            let out = std::mem::take(&mut self.out);
            return self.acker.ack(self.hold.receipt.clone(), out).await;
        }
        self.leave();
        match settlement {
            Settlement::Ack => Ok(()),
            Settlement::Retry { shutdown: true, .. } => self.hand_back().await,
            Settlement::Retry { delay, .. } => self.retry(*delay).await,
            // SQS cannot drop a message without deleting it: leave it to its
            // visibility timeout and the queue's redrive policy.
            Settlement::Reject => Ok(()),
            Settlement::Fail(record) => self.fail(record).await,
        }
    }
}

impl Drop for SqsDelivery {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::types::MessageAttributeValue;

    fn message(received: Option<&str>, counts: &[(&str, &str)]) -> Message {
        let mut builder = Message::builder();
        if let Some(n) = received {
            builder = builder.attributes(MessageSystemAttributeName::ApproximateReceiveCount, n);
        }
        for (name, value) in counts {
            let value = MessageAttributeValue::builder()
                .data_type("Number")
                .string_value(*value)
                .build()
                .unwrap();
            builder = builder.message_attributes(*name, value);
        }
        builder.build()
    }

    #[test]
    fn attempts_combine_attribute_and_receive_count() {
        assert_eq!(attempt_of(&message(None, &[])), None);
        assert_eq!(
            attempt_of(&message(None, &[(ATTEMPTS_ATTRIBUTE, "3")])),
            None
        );
        assert_eq!(attempt_of(&message(Some("1"), &[])), Some(1));
        assert_eq!(attempt_of(&message(Some("3"), &[])), Some(3));
        assert_eq!(
            attempt_of(&message(Some("1"), &[(ATTEMPTS_ATTRIBUTE, "4")])),
            Some(5)
        );
        assert_eq!(
            attempt_of(&message(Some("2"), &[(ATTEMPTS_ATTRIBUTE, "4")])),
            Some(6)
        );
        assert_eq!(
            attempt_of(&message(Some("2"), &[(ATTEMPTS_ATTRIBUTE, "99999999999")])),
            Some(u32::MAX)
        );
        assert_eq!(
            attempt_of(&message(Some("1"), &[(ATTEMPTS_ATTRIBUTE, "-5")])),
            Some(1)
        );
        // Graceful-shutdown returns travel in their own attribute; a crash
        // (the receive count) never adds to them.
        let m = message(
            Some("2"),
            &[(ATTEMPTS_ATTRIBUTE, "2"), (SHUTDOWNS_ATTRIBUTE, "2")],
        );
        assert_eq!(attempt_of(&m), Some(4));
        assert_eq!(attribute_count(&m, SHUTDOWNS_ATTRIBUTE), 2);
        assert_eq!(
            attribute_count(&message(Some("1"), &[]), SHUTDOWNS_ATTRIBUTE),
            0
        );
    }
}
