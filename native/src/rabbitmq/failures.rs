//! The failure store and the admin interface: reading, claiming and removing
//! the messages of a failure queue with `basic.get`, and the depth and
//! deletion of a work queue with everything declared for it.
//!
//! A quorum queue cannot be read without taking messages, so every look at
//! the failure queue is a *scan*: messages are taken one by one with
//! `basic.get` on a channel of the scan's own and kept unacknowledged, which
//! hides them from everyone else, until the scan settles each of them: an ack
//! removes one, a `basic.nack` with requeue gives it back. Scans of one failure
//! queue by one driver take turns, so they never hide entries from each other.
//! A claim is a scan that stops at its entry and gives back everything else:
//! the broker hands a message to one channel at a time, which is what makes a
//! claim exclusive, and closing the channel (explicitly, by dropping the claim,
//! or by losing the connection) gives the entry back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::Channel;
use tokio::sync::OwnedMutexGuard;

use super::errors::{bounded, error, not_found};
use super::RabbitDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::failures::{
    Admin, ClaimedFailure, FailureStore, HeldFailures, QueueDepth, StoredFailure,
};
use crate::kit::lock;

/// How long a channel stays open after its last ack of `basic.get`
/// deliveries: RabbitMQ's quorum queues (3.10) give back deliveries whose
/// acks they had not applied when the channel closed (measured: none of
/// 1,000 after 20 ms; up to a few hundred without the wait).
const ACKS_SETTLE: Duration = Duration::from_millis(100);

/// A message a scan took and holds unacknowledged.
struct Held {
    tag: u64,
    entry: StoredFailure,
}

/// A scan of one failure queue (see the module documentation). Dropping it
/// drops its channel, which lapin closes, and the broker gives back whatever
/// it still held.
struct Scan {
    driver: RabbitDriver,
    /// The failure queue.
    failed: String,
    /// `None` once handed to a claim.
    channel: Option<Channel>,
    held: Vec<Held>,
    /// This scan's turn on the failure queue.
    turn: Option<OwnedMutexGuard<()>>,
}

impl Scan {
    /// Starts a scan of `queue`'s failure queue (declared first), once the
    /// scans before it are done. [`ErrorKind::Config`] when the driver has
    /// no failure queue.
    async fn start(driver: &RabbitDriver, queue: &str) -> Result<Scan, DriverError> {
        driver.inner.lifecycle.check_running()?;
        let Some(failed) = driver.declare_failure_queue(queue).await? else {
            return Err(no_failure_queue(queue));
        };
        let turn = {
            let mut turns = lock(&driver.inner.scans);
            turns.retain(|_, t| Arc::strong_count(t) > 1);
            turns.entry(failed.clone()).or_default().clone()
        };
        let turn = turn.lock_owned().await;
        let channel = driver.open_channel().await?;
        Ok(Scan {
            driver: driver.clone(),
            failed,
            channel: Some(channel),
            held: Vec::new(),
            turn: Some(turn),
        })
    }

    fn channel(&self) -> &Channel {
        self.channel
            .as_ref()
            .expect("a scan keeps its channel until it ends")
    }

    /// Takes the next message; `None` once the queue has no more ready.
    async fn take(&mut self) -> Result<Option<&StoredFailure>, DriverError> {
        let limit = self.driver.inner.config.operation_timeout;
        let got = bounded(
            limit,
            &format!("basic.get from `{}`", self.failed),
            ErrorKind::Connection,
            self.channel()
                .basic_get(&self.failed, BasicGetOptions { no_ack: false }),
        )
        .await?;
        let Some(message) = got else {
            return Ok(None);
        };
        self.held.push(Held {
            tag: message.delivery.delivery_tag,
            entry: StoredFailure::from_body(message.delivery.data),
        });
        Ok(self.held.last().map(|h| &h.entry))
    }

    /// Takes every message.
    async fn take_all(&mut self) -> Result<(), DriverError> {
        while self.take().await?.is_some() {}
        Ok(())
    }

    /// Removes the held message `tag`.
    async fn ack(&self, tag: u64) -> Result<(), DriverError> {
        bounded(
            self.driver.inner.config.operation_timeout,
            &format!("basic.ack on `{}`", self.failed),
            ErrorKind::Connection,
            self.channel().basic_ack(tag, BasicAckOptions::default()),
        )
        .await
    }

    /// Gives back every held message up to `tag` that is not settled yet.
    async fn give_back_up_to(&self, tag: u64) -> Result<(), DriverError> {
        let options = BasicNackOptions {
            multiple: true,
            requeue: true,
        };
        bounded(
            self.driver.inner.config.operation_timeout,
            &format!("basic.nack on `{}`", self.failed),
            ErrorKind::Connection,
            self.channel().basic_nack(tag, options),
        )
        .await
    }

    /// Closes the channel and waits for the broker's answer, which comes
    /// after it processed every settlement sent before.
    async fn close(self) -> Result<(), DriverError> {
        close(&self.driver, self.channel(), &self.failed).await
    }
}

impl Drop for Scan {
    /// Ended early (an error): lapin closes the dropped channel in the
    /// background and the broker gives back everything still held.
    fn drop(&mut self) {
        if let Some(channel) = self.channel.take() {
            self.driver.release(&channel);
        }
    }
}

/// Closes `channel` (used on `failed`), waiting for the broker's answer.
async fn close(driver: &RabbitDriver, channel: &Channel, failed: &str) -> Result<(), DriverError> {
    bounded(
        driver.inner.config.operation_timeout,
        &format!("closing the channel reading `{failed}`"),
        ErrorKind::Connection,
        channel.close(200, "done"),
    )
    .await
}

#[async_trait]
impl FailureStore for RabbitDriver {
    /// Takes every message of the failure queue, then gives them all back
    /// in one `basic.nack` (a returned message goes back ahead of those
    /// never taken, in the order returned, so the order stays).
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        if !self.failure_queue_exists(queue).await? {
            return Ok(Vec::new());
        }
        let mut scan = Scan::start(self, queue).await?;
        scan.take_all().await?;
        if let Some(last) = scan.held.last() {
            scan.give_back_up_to(last.tag).await?;
        }
        let entries = scan.held.iter().map(|h| h.entry.clone()).collect();
        scan.close().await?;
        Ok(entries)
    }

    /// Takes messages until the first that matches `id`, gives back those
    /// before it and keeps it on the claim's channel.
    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError> {
        if !self.failure_queue_exists(queue).await? {
            return Ok(None);
        }
        let mut scan = Scan::start(self, queue).await?;
        loop {
            match scan.take().await? {
                Some(entry) if entry.matches(id) => break,
                Some(_) => {}
                None => {
                    if let Some(last) = scan.held.last() {
                        scan.give_back_up_to(last.tag).await?;
                    }
                    scan.close().await?;
                    return Ok(None);
                }
            }
        }
        let target = scan.held.pop().expect("the loop ends on a held message");
        if let Some(before) = scan.held.last() {
            scan.give_back_up_to(before.tag).await?;
        }
        // The next scan may start: it cannot see the claimed message.
        scan.turn = None;
        Ok(Some(Box::new(RabbitClaim {
            driver: self.clone(),
            failed: scan.failed.clone(),
            channel: scan.channel.take(),
            tag: target.tag,
            entry: target.entry,
        })))
    }

    /// Takes every message, acks those named, gives back the rest.
    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        if !self.failure_queue_exists(queue).await? {
            return Ok(0);
        }
        let mut scan = Scan::start(self, queue).await?;
        scan.take_all().await?;
        scan.finish(ids).await
    }

    /// Takes every message and keeps them on the scan's channel until
    /// [`HeldFailures::finish`]: one pass over the queue for a bulk replay.
    async fn hold_all(&self, queue: &str) -> Result<Option<Box<dyn HeldFailures>>, DriverError> {
        if !self.failure_queue_exists(queue).await? {
            return Ok(Some(Box::new(HeldScan {
                scan: None,
                entries: Vec::new(),
            })));
        }
        let mut scan = Scan::start(self, queue).await?;
        scan.take_all().await?;
        let entries = scan.held.iter().map(|h| h.entry.clone()).collect();
        Ok(Some(Box::new(HeldScan {
            scan: Some(scan),
            entries,
        })))
    }
}

impl Scan {
    /// Acks the held messages named in `ids`, gives back the rest, closes.
    async fn finish(self, ids: &[String]) -> Result<u64, DriverError> {
        // A set: a bulk removal names thousands of ids.
        let ids: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        let mut removed = 0;
        let mut kept = None;
        for held in &self.held {
            if ids.contains(held.entry.id.as_str()) {
                self.ack(held.tag).await?;
                removed += 1;
            } else {
                kept = Some(held.tag);
            }
        }
        // `multiple` skips what was acked, but its own tag must be unsettled.
        if let Some(last) = kept {
            self.give_back_up_to(last).await?;
        }
        if removed > 0 {
            tokio::time::sleep(ACKS_SETTLE).await;
        }
        self.close().await?;
        Ok(removed)
    }
}

/// Every message of a failure queue, held on one scan's channel.
struct HeldScan {
    /// `None`: the queue does not exist (nothing held).
    scan: Option<Scan>,
    entries: Vec<StoredFailure>,
}

#[async_trait]
impl HeldFailures for HeldScan {
    fn entries(&self) -> &[StoredFailure] {
        &self.entries
    }

    async fn finish(mut self: Box<Self>, remove: &[String]) -> Result<u64, DriverError> {
        match self.scan.take() {
            Some(scan) => scan.finish(remove).await,
            None => Ok(0),
        }
    }
}

/// A claimed entry: one message held unacknowledged on a channel of its own.
struct RabbitClaim {
    driver: RabbitDriver,
    failed: String,
    /// `None` once removed or released.
    channel: Option<Channel>,
    tag: u64,
    entry: StoredFailure,
}

impl RabbitClaim {
    /// The claim's channel, still open.
    fn open_channel(&mut self) -> Result<Channel, DriverError> {
        let channel = self.channel.take().expect("a claim ends once");
        if channel.status().connected() {
            Ok(channel)
        } else {
            Err(error(
                ErrorKind::Connection,
                format!(
                    "the channel holding failure entry `{}` is gone; the broker gave the entry \
                     back to `{}`",
                    self.entry.id, self.failed
                ),
            ))
        }
    }
}

#[async_trait]
impl ClaimedFailure for RabbitClaim {
    fn entry(&self) -> &StoredFailure {
        &self.entry
    }

    /// Acks the message, then closes the channel: the broker's answer to the
    /// close says the ack was processed.
    async fn remove(mut self: Box<Self>) -> Result<(), DriverError> {
        let channel = self.open_channel()?;
        bounded(
            self.driver.inner.config.operation_timeout,
            &format!("basic.ack of failure entry `{}`", self.entry.id),
            ErrorKind::Connection,
            channel.basic_ack(self.tag, BasicAckOptions::default()),
        )
        .await?;
        tokio::time::sleep(ACKS_SETTLE).await;
        close(&self.driver, &channel, &self.failed).await
    }

    async fn release(mut self: Box<Self>) -> Result<(), DriverError> {
        let channel = self.open_channel()?;
        let options = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        bounded(
            self.driver.inner.config.operation_timeout,
            &format!("basic.nack of failure entry `{}`", self.entry.id),
            ErrorKind::Connection,
            channel.basic_nack(self.tag, options),
        )
        .await?;
        close(&self.driver, &channel, &self.failed).await
    }
}

impl Drop for RabbitClaim {
    /// Neither removed nor released: lapin closes the dropped channel in the
    /// background and the broker gives the entry back.
    fn drop(&mut self) {
        if let Some(channel) = self.channel.take() {
            self.driver.release(&channel);
        }
    }
}

impl RabbitDriver {
    /// The hold queues `queue` may have, one per configured bucket.
    fn hold_queues(&self, queue: &str) -> Vec<String> {
        self.inner
            .config
            .delay_buckets
            .iter()
            .map(|bucket| Self::hold_queue_name(queue, *bucket))
            .collect()
    }

    /// Whether `queue`'s failure queue exists (a passive declare: reading the
    /// failures of a queue never declared creates nothing).
    /// [`ErrorKind::Config`] when the driver has no failure queue.
    async fn failure_queue_exists(&self, queue: &str) -> Result<bool, DriverError> {
        let Some(failed) = self.failure_queue_name(queue) else {
            return Err(no_failure_queue(queue));
        };
        Ok(self.ready_counts(&[failed]).await?[0].is_some())
    }

    /// The ready messages of each of `names` (`None`: no such queue), by
    /// passive declares. A declare of a missing queue closes its channel,
    /// so the next one opens another.
    async fn ready_counts(&self, names: &[String]) -> Result<Vec<Option<u64>>, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let mut channel: Option<Channel> = None;
        let mut counts = Vec::with_capacity(names.len());
        for name in names {
            let current = match channel.take().filter(|c| c.status().connected()) {
                Some(c) => c,
                None => self.open_channel().await?,
            };
            let options = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let declared = tokio::time::timeout(
                limit,
                current.queue_declare(name, options, FieldTable::default()),
            )
            .await;
            match declared {
                Ok(Err(e)) if not_found(&e) => counts.push(None),
                declared => {
                    let declared = super::errors::answer(
                        limit,
                        &format!("passive declare of `{name}`"),
                        ErrorKind::Connection,
                        declared,
                    )?;
                    counts.push(Some(u64::from(declared.message_count())));
                    channel = Some(current);
                }
            }
        }
        if let Some(channel) = channel {
            let _ = tokio::time::timeout(limit, channel.close(200, "counted")).await;
        }
        Ok(counts)
    }
}

#[async_trait]
impl Admin for RabbitDriver {
    /// Ready: the work queue's ready messages (0 when it does not exist);
    /// delayed: the messages of its hold queues; in flight: not reported
    /// (AMQP gives no count of unacknowledged messages).
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        self.inner.lifecycle.check_running()?;
        let mut names = vec![queue.to_string()];
        names.extend(self.hold_queues(queue));
        let counts = self.ready_counts(&names).await?;
        let ready = counts[0].unwrap_or(0);
        let delayed = counts[1..].iter().flatten().sum();
        Ok(QueueDepth::new(ready, None, Some(delayed)))
    }

    /// Deletes the hold queues of every configured bucket, the work queue
    /// and its failure queue, with their messages (the broker cancels their
    /// consumers; a subscription of this driver that is still running
    /// declares the work queue again when it resumes).
    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        self.inner.lifecycle.check_running()?;
        let mut names = self.hold_queues(queue);
        names.push(queue.to_string());
        names.extend(self.failure_queue_name(queue));
        let limit = self.inner.config.operation_timeout;
        let channel = self.open_channel().await?;
        for name in &names {
            // Forgotten first: a later use declares again even if this fails.
            lock(&self.inner.declared).remove(name);
            #[cfg(feature = "testing")]
            lock(&self.inner.known).remove(name);
            // The broker answers a delete of a missing queue with delete-ok.
            bounded(
                limit,
                &format!("deleting queue `{name}`"),
                ErrorKind::Connection,
                channel.queue_delete(name, QueueDeleteOptions::default()),
            )
            .await?;
        }
        let _ = tokio::time::timeout(limit, channel.close(200, "deleted")).await;
        Ok(())
    }
}

/// The turns of the scans of each failure queue.
pub(super) type ScanTurns = HashMap<String, Arc<tokio::sync::Mutex<()>>>;

/// The error for a failure-store operation on a driver configured without a
/// failure queue.
fn no_failure_queue(queue: &str) -> DriverError {
    error(
        ErrorKind::Config,
        format!(
            "queue `{queue}` has no failure queue: the driver is configured without one \
             (RabbitConfig::failure_queue is None), so terminal failures are rejected and nothing \
             keeps them"
        ),
    )
}
