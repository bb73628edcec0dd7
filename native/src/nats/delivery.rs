//! Subscriptions (pull requests) and deliveries: their lease while they are
//! handled, and their settlement.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::Batch;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::Acker;
use async_nats::jetstream::{AckKind, Message};
use async_nats::HeaderMap;
use async_trait::async_trait;
use futures_util::{FutureExt, StreamExt};
use jobrail::{FailureRecord, Settlement};
use tokio::task::JoinHandle;
use tracing::{debug, error, warn};

use super::errors::{self, error};
use super::publish::Stored;
use super::{NatsDriver, ATTEMPTS_HEADER, SHUTDOWNS_HEADER};
use crate::driver::{Delivery, DriverError, ErrorKind, Subscription};
use crate::support::Reconnect;

type Opening = Pin<Box<dyn Future<Output = Result<Pull, DriverError>> + Send>>;

/// An open pull request.
struct Pull {
    batch: Batch,
    consumer: PullConsumer,
    /// The connection generation it was sent on.
    generation: u64,
}

struct NatsSubscription {
    driver: NatsDriver,
    queue: String,
    prefetch: usize,
    /// Deliveries handed out and not yet settled or dropped.
    outstanding: Arc<AtomicUsize>,
    consumer: Option<PullConsumer>,
    pull: Option<Pull>,
    /// A pull request being sent (kept across cancelled `next()` calls).
    opening: Option<Opening>,
    /// The waits before pulling again after a failed pull.
    backoff: Reconnect,
}

impl NatsDriver {
    /// A subscription to `queue` (declared first), with at most `prefetch`
    /// deliveries outstanding.
    pub(super) async fn subscription(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.life.check_running()?;
        let consumer = self.declare(queue).await?;
        Ok(Box::new(NatsSubscription::new(
            self.clone(),
            queue,
            prefetch,
            consumer,
        )))
    }
}

impl NatsSubscription {
    fn new(driver: NatsDriver, queue: &str, prefetch: usize, consumer: PullConsumer) -> Self {
        NatsSubscription {
            backoff: driver.reconnect(),
            driver,
            queue: queue.to_string(),
            prefetch: prefetch.max(1),
            outstanding: Arc::default(),
            consumer: Some(consumer),
            pull: None,
            opening: None,
        }
    }

    /// A future sending a pull request for the free slots.
    fn open(&self) -> Opening {
        let driver = self.driver.clone();
        let queue = self.queue.clone();
        let consumer = self.consumer.clone();
        let wanted = self
            .prefetch
            .saturating_sub(self.outstanding.load(Ordering::SeqCst))
            .max(1);
        Box::pin(async move {
            let consumer = match consumer {
                Some(consumer) => consumer,
                None => driver.declare(&queue).await?,
            };
            let link = driver.link().await?;
            driver.wait_connected(&link).await?;
            let generation = *driver.inner.connections.borrow();
            let limit = driver.inner.config.operation_timeout;
            let batch = tokio::time::timeout(
                limit,
                consumer
                    .batch()
                    .max_messages(wanted)
                    .expires(driver.inner.config.fetch_expiry)
                    .messages(),
            )
            .await
            .map_err(|_| {
                error(
                    ErrorKind::Connection,
                    format!("pull request on `{queue}`: no answer within {limit:?}"),
                )
            })?
            .map_err(|e| errors::connection(format!("pull request on `{queue}`"), e))?;
            Ok(Pull {
                batch,
                consumer,
                generation,
            })
        })
    }

    fn deliver(&self, message: Message) -> Box<dyn Delivery> {
        let headers = message.headers.as_ref();
        let (attempt, stored) = match message.info() {
            Ok(info) => (
                attempt_of(headers, info.delivered),
                Stored {
                    sequence: info.stream_sequence,
                    published: info.published.unix_timestamp_nanos(),
                },
            ),
            Err(e) => {
                warn!(queue = %self.queue, "a delivery without JetStream metadata: {e}");
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
        let acker = Acker::new(message.context.clone(), message.reply.clone());
        let every = self.driver.inner.config.ack_wait / 2;
        let queue = self.queue.clone();
        let lease = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = acker.ack_with(AckKind::Progress).await {
                    debug!(queue = %queue, "could not renew a delivery's lease: {e}");
                }
            }
        });
        self.outstanding.fetch_add(1, Ordering::SeqCst);
        Box::new(NatsDelivery {
            driver: self.driver.clone(),
            queue: self.queue.clone(),
            message,
            attempt,
            shutdowns,
            stored,
            lease: Some(lease),
            outstanding: self.outstanding.clone(),
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
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        let mut stopped = self.driver.inner.life.watch();
        let mut connections = self.driver.inner.connections.subscribe();
        loop {
            if *stopped.borrow_and_update() {
                self.pull = None;
                self.opening = None;
                return None;
            }
            let generation = *connections.borrow_and_update();
            if let Some(pull) = self.pull.as_mut() {
                if pull.generation != generation {
                    // Sent on a connection since lost: hand out what already
                    // arrived, then send a fresh request.
                    if let Some(Some(Ok(message))) = pull.batch.next().now_or_never() {
                        return Some(Ok(self.deliver(message)));
                    }
                    debug!(queue = %self.queue, "reconnected: abandoning the open pull request");
                    self.pull = None;
                    continue;
                }
                let item = tokio::select! {
                    _ = stopped.changed() => continue,
                    _ = connections.changed() => continue,
                    item = pull.batch.next() => item,
                };
                match item {
                    Some(Ok(message)) => {
                        self.backoff.succeeded();
                        return Some(Ok(self.deliver(message)));
                    }
                    Some(Err(e)) => {
                        warn!(queue = %self.queue, "pull request failed, declaring the consumer again: {e}");
                        self.pull = None;
                        self.consumer = None;
                        self.driver.forget(&self.queue);
                        self.wait().await;
                    }
                    None => {
                        // Fulfilled or expired: send the next one.
                        self.pull = None;
                    }
                }
                continue;
            }
            if self.opening.is_none() {
                self.opening = Some(self.open());
            }
            let Some(opening) = self.opening.as_mut() else {
                continue;
            };
            let opened = tokio::select! {
                _ = stopped.changed() => continue,
                opened = opening => opened,
            };
            self.opening = None;
            match opened {
                Ok(pull) => {
                    self.consumer = Some(pull.consumer.clone());
                    self.pull = Some(pull);
                }
                Err(e) if e.kind() == ErrorKind::Stopped => return None,
                Err(e) => {
                    warn!(queue = %self.queue, "cannot pull, retrying in {:?}: {e}", self.backoff.upcoming());
                    self.consumer = None;
                    self.driver.forget(&self.queue);
                    self.wait().await;
                    if e.kind() == ErrorKind::Config {
                        // Someone changed the topology under us: say so to the consumer too.
                        return Some(Err(e));
                    }
                }
            }
        }
    }
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

struct NatsDelivery {
    driver: NatsDriver,
    queue: String,
    message: Message,
    attempt: u32,
    /// Earlier deliveries a graceful shutdown handed back.
    shutdowns: u32,
    stored: Stored,
    lease: Option<JoinHandle<()>>,
    outstanding: Arc<AtomicUsize>,
    settled: bool,
}

impl NatsDelivery {
    fn stop_lease(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.abort();
        }
    }

    /// Sends the final `kind` as a double ack: `Ok` once the server confirmed.
    async fn reply(&mut self, kind: AckKind, what: &str) -> Result<(), DriverError> {
        self.stop_lease();
        self.settled = true;
        let limit = self.driver.inner.config.operation_timeout;
        match tokio::time::timeout(limit, self.message.double_ack_with(kind)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(errors::settlement(what, &self.queue, e)),
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
    /// attempt and one more shutdown, then acks the original. If the copy is
    /// not accepted the original is left (it comes back), never acked.
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
        self.reply(AckKind::Ack, "ack after the shutdown copy")
            .await
    }

    async fn fail(&mut self, record: &FailureRecord) -> Result<(), DriverError> {
        match self.driver.failure_subject(&self.queue) {
            Some(subject) => {
                // The lease keeps running while the record is transferred.
                self.driver
                    .publish_failure(&self.queue, &subject, self.stored, record)
                    .await?;
                self.reply(AckKind::Ack, "ack after the failure transfer")
                    .await
            }
            None => {
                self.reply(AckKind::Ack, "ack").await?;
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
    /// Stops the lease; unsettled: `-NAK` so the message comes back now.
    fn drop(&mut self) {
        self.stop_lease();
        self.outstanding.fetch_sub(1, Ordering::SeqCst);
        if self.settled || self.driver.inner.life.is_stopped() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let message = self.message.clone();
            runtime.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(10),
                    message.ack_with(AckKind::Nak(None)),
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
        match settlement {
            Settlement::Ack => self.reply(AckKind::Ack, "ack").await,
            Settlement::Reject => self.reply(AckKind::Term, "term").await,
            Settlement::Retry { shutdown: true, .. } => self.hand_back().await,
            Settlement::Retry { delay, .. } => match delay.filter(|d| !d.is_zero()) {
                None => self.reply(AckKind::Nak(None), "nak").await,
                Some(delay) if delay.as_nanos() > i64::MAX as u128 => Err(error(
                    ErrorKind::Unsupported,
                    format!("retry delay {delay:?} exceeds what JetStream can express"),
                )),
                Some(delay) => self.reply(AckKind::Nak(Some(delay)), "nak").await,
            },
            Settlement::Fail(record) => self.fail(record).await,
        }
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
