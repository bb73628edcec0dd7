//! Subscriptions, deliveries and their settlement, and the job check
//! against the broker's consumer timeout.

use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use jobrail::{FailureRecord, Settlement};
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use std::sync::Arc;
use tracing::{error, warn};

use super::acks::{AckRuns, Single};
use super::config::RabbitConfig;
use super::errors::{bounded, config_error, error};
use super::{RabbitDriver, ATTEMPTS_HEADER, CONSUMER_TIMEOUT_MARGIN, SHUTDOWNS_HEADER};
use crate::driver::{Delivery, DriverError, ErrorKind, Subscription};
use crate::kit::Reconnect;

/// Refuses a job that can hold one delivery longer than the broker's
/// `consumer_timeout` allows, with [`CONSUMER_TIMEOUT_MARGIN`] to spare (see
/// [`RabbitConfig::consumer_timeout`]); a job without a timeout is accepted
/// with a warning.
pub(super) fn check_hold(
    config: &RabbitConfig,
    spec: &jobrail::JobSpec,
) -> Result<(), DriverError> {
    let limit = config.consumer_timeout;
    let Some(hold) = jobrail::longest_hold(spec) else {
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

pub(super) struct RabbitSubscription {
    driver: RabbitDriver,
    queue: String,
    /// The queue's name, shared by its deliveries.
    shared_queue: Arc<str>,
    prefetch: u16,
    /// The channel (with its ack runs) and the consumer on it.
    current: Option<(Arc<AckRuns>, lapin::Consumer)>,
    /// The wait before the next attempt to resume consuming.
    reconnect: Reconnect,
}

impl RabbitSubscription {
    /// Consumes `queue` (declared first) with at most `prefetch` unsettled
    /// deliveries.
    pub(super) async fn start(
        driver: RabbitDriver,
        queue: &str,
        prefetch: usize,
    ) -> Result<Self, DriverError> {
        driver.inner.lifecycle.check_running()?;
        driver.declare_work(queue).await?;
        let reconnect = Reconnect::new(
            Duration::from_millis(100),
            driver.inner.config.max_reconnect_backoff,
        );
        let mut subscription = RabbitSubscription {
            driver,
            queue: queue.to_string(),
            shared_queue: Arc::from(queue),
            prefetch: prefetch.clamp(1, usize::from(u16::MAX)) as u16,
            current: None,
            reconnect,
        };
        subscription.open().await?;
        Ok(subscription)
    }

    /// Opens a channel with the prefetch and starts consuming.
    ///
    /// Cancel-safe: if dropped midway, the channel (and any consumer on it)
    /// is dropped, which closes it, and the broker requeues whatever it sent.
    async fn open(&mut self) -> Result<(), DriverError> {
        self.release();
        let driver = &self.driver;
        driver.declare_work(&self.queue).await?;
        let limit = driver.inner.config.operation_timeout;
        let channel = driver.open_channel().await?;
        bounded(
            limit,
            "basic.qos",
            ErrorKind::Connection,
            channel.basic_qos(self.prefetch, BasicQosOptions::default()),
        )
        .await?;
        let consumer = bounded(
            limit,
            &format!("consuming `{}`", self.queue),
            ErrorKind::Connection,
            channel.basic_consume(
                &self.queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        let runs = AckRuns::new(
            channel,
            self.prefetch,
            driver.inner.config.ack_gap_wait,
            limit,
        );
        driver.track(&runs);
        self.current = Some((runs, consumer));
        Ok(())
    }

    /// Lets go of the current channel (see [`RabbitDriver::release`]).
    fn release(&mut self) {
        if let Some((runs, _)) = self.current.take() {
            self.driver.release(runs.channel());
        }
    }
}

impl Drop for RabbitSubscription {
    fn drop(&mut self) {
        self.release();
    }
}

#[async_trait]
impl Subscription for RabbitSubscription {
    /// `basic.cancel`, awaited: the broker pushes nothing more to this
    /// channel, so a settlement that frees a prefetch slot during shutdown
    /// cannot draw a message that nobody will handle. The channel stays open
    /// for the deliveries still being settled. Messages the broker had
    /// already pushed but the consumer never took return to the queue when
    /// the channel closes, and the broker counts that as a delivery.
    async fn close(&mut self) {
        if let Some((runs, consumer)) = &self.current {
            let limit = self.driver.inner.config.operation_timeout;
            let tag = consumer.tag();
            let cancel = runs
                .channel()
                .basic_cancel(tag.as_str(), BasicCancelOptions::default());
            if let Err(e) = bounded(limit, "basic.cancel", ErrorKind::Connection, cancel).await {
                warn!(queue = %self.queue, "could not cancel the consumer: {e}");
            }
            // Acks waiting behind a running delivery are written now, and
            // those still to come without waiting.
            runs.drain(limit).await;
        }
        self.release();
    }

    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        // A handle of its own, so waiting for the stop borrows nothing of `self`.
        let inner = self.driver.inner.clone();
        loop {
            if inner.lifecycle.is_stopped() {
                self.release();
                return None;
            }
            let Some((runs, consumer)) = self.current.as_mut() else {
                match self.open().await {
                    Ok(()) => {
                        self.reconnect.succeeded();
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::Stopped => return None,
                    Err(e) => {
                        let wait = self.reconnect.failed();
                        warn!(queue = %self.queue, "cannot resume consuming, retrying in {wait:?}: {e}");
                        if e.kind() == ErrorKind::Config {
                            // Someone changed the topology under us: say so to the consumer too.
                            tokio::time::sleep(wait).await;
                            return Some(Err(e));
                        }
                        tokio::select! {
                            _ = inner.lifecycle.stopped() => {}
                            _ = tokio::time::sleep(wait) => {}
                        }
                        continue;
                    }
                }
            };
            let item = tokio::select! {
                _ = inner.lifecycle.stopped() => continue,
                item = consumer.next() => item,
            };
            match item {
                Some(Ok(delivery)) => {
                    let attempt = attempt_of(&delivery.properties);
                    let shutdowns = header_count(&delivery.properties, SHUTDOWNS_HEADER);
                    runs.handed_out(delivery.delivery_tag);
                    return Some(Ok(Box::new(RabbitDelivery {
                        driver: self.driver.clone(),
                        queue: self.shared_queue.clone(),
                        runs: runs.clone(),
                        tag: delivery.delivery_tag,
                        message_id: delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|id| id.to_string()),
                        body: delivery.data,
                        attempt,
                        shutdowns,
                        settled: false,
                    })));
                }
                Some(Err(e)) => {
                    warn!(queue = %self.queue, "consumer failed, reconnecting: {e}");
                    self.release();
                }
                None => {
                    warn!(queue = %self.queue, "consumer ended (channel closed or consumer cancelled), reconnecting");
                    self.release();
                }
            }
        }
    }
}

fn as_count(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::Timestamp(v) => Some(*v),
        _ => None,
    }
}

fn header(properties: &BasicProperties, name: &str) -> u64 {
    properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(name))
        .and_then(as_count)
        .unwrap_or(0)
}

/// A count header, 0 when absent, saturating at `u32::MAX`.
fn header_count(properties: &BasicProperties, name: &str) -> u32 {
    u32::try_from(header(properties, name)).unwrap_or(u32::MAX)
}

/// `x-queue-attempts + x-delivery-count + 1`, saturating.
fn attempt_of(properties: &BasicProperties) -> u32 {
    let attempt = header(properties, ATTEMPTS_HEADER)
        .saturating_add(header(properties, "x-delivery-count"))
        .saturating_add(1);
    u32::try_from(attempt).unwrap_or(u32::MAX)
}

struct RabbitDelivery {
    driver: RabbitDriver,
    queue: Arc<str>,
    /// The channel the delivery came on (its tag means nothing elsewhere),
    /// whose ack runs write its settlement.
    runs: Arc<AckRuns>,
    tag: u64,
    message_id: Option<String>,
    body: Vec<u8>,
    attempt: u32,
    /// Earlier deliveries a graceful shutdown handed back.
    shutdowns: u32,
    settled: bool,
}

impl RabbitDelivery {
    fn channel_gone(&self) -> DriverError {
        error(
            ErrorKind::Connection,
            format!(
                "the channel this delivery came on is gone; the broker returns the message to `{}` \
                 (it is redelivered with a higher attempt count)",
                self.queue
            ),
        )
    }

    fn check_channel(&self) -> Result<(), DriverError> {
        if self.runs.channel().status().connected() {
            Ok(())
        } else {
            Err(self.channel_gone())
        }
    }

    async fn ack(&mut self) -> Result<(), DriverError> {
        self.check_channel()?;
        self.settled = true;
        self.runs.ack(self.tag).await
    }

    async fn reject(&mut self) -> Result<(), DriverError> {
        self.check_channel()?;
        self.settled = true;
        self.runs.single(self.tag, Single::Reject).await
    }

    async fn forward(
        &mut self,
        delay: Option<Duration>,
        shutdown: bool,
    ) -> Result<(), DriverError> {
        // Refused (a delay above the largest bucket): `settle` holds the
        // message, then returns it to the queue.
        let target = self.driver.route_for_delay(&self.queue, delay).await?;
        let shutdowns = self.shutdowns.saturating_add(u32::from(shutdown));
        self.driver
            .republish(
                &target,
                &self.body,
                self.message_id.as_deref(),
                self.attempt,
                shutdowns,
            )
            .await?;
        self.ack().await
    }

    async fn fail(&mut self, record: &FailureRecord) -> Result<(), DriverError> {
        match self.driver.declare_failure_queue(&self.queue).await? {
            Some(failed) => {
                self.driver
                    .publish_failure(&failed, record, self.message_id.as_deref())
                    .await?;
                self.ack().await
            }
            None => {
                self.reject().await?;
                error!(
                    queue = %self.queue,
                    message_id = self.message_id.as_deref().unwrap_or(""),
                    attempt = self.attempt,
                    "terminal failure, no failure queue configured; message rejected: {}",
                    record.reason
                );
                Ok(())
            }
        }
    }
}

impl Drop for RabbitDelivery {
    /// Unsettled (never asked to settle: a handler task that died): return
    /// the message to the queue now rather than when the channel closes.
    fn drop(&mut self) {
        if self.settled || !self.runs.channel().status().connected() {
            return;
        }
        self.runs.requeue_later(self.tag);
    }
}

#[async_trait]
impl Delivery for RabbitDelivery {
    fn body(&self) -> &[u8] {
        &self.body
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn shutdown_returns(&self) -> Option<u32> {
        Some(self.shutdowns)
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        if self.driver.inner.lifecycle.is_stopped() {
            return Err(error(
                ErrorKind::Stopped,
                "the rabbitmq driver has been stopped; the broker returns the message to its queue",
            ));
        }
        self.check_channel()?;
        let result = match settlement {
            Settlement::Ack => self.ack().await,
            Settlement::Reject => self.reject().await,
            Settlement::Retry { delay, shutdown } => self.forward(*delay, *shutdown).await,
            Settlement::Fail(record) => self.fail(record).await,
        };
        if result.is_err() && !self.settled {
            // Refused before any frame for this delivery was written (a
            // retry too long, a republish or a failure record the broker
            // did not confirm): hold it unacknowledged, as a lease would,
            // then return it to the queue. Handed straight back it would
            // come back at once, again and again.
            self.settled = true;
            self.runs
                .requeue_after(self.tag, self.driver.inner.config.refused_hold);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempts_combine_header_and_delivery_count() {
        let with = |pairs: &[(&str, AMQPValue)]| {
            let mut headers = FieldTable::default();
            for (k, v) in pairs {
                headers.insert((*k).into(), v.clone());
            }
            BasicProperties::default().with_headers(headers)
        };
        assert_eq!(attempt_of(&BasicProperties::default()), 1);
        assert_eq!(
            attempt_of(&with(&[("x-delivery-count", AMQPValue::LongLongInt(2))])),
            3
        );
        assert_eq!(
            attempt_of(&with(&[(ATTEMPTS_HEADER, AMQPValue::LongLongInt(4))])),
            5
        );
        assert_eq!(
            attempt_of(&with(&[
                (ATTEMPTS_HEADER, AMQPValue::LongInt(4)),
                ("x-delivery-count", AMQPValue::LongLongInt(1))
            ])),
            6
        );
        assert_eq!(
            attempt_of(&with(&[(
                ATTEMPTS_HEADER,
                AMQPValue::LongLongInt(i64::MAX)
            )])),
            u32::MAX
        );
        assert_eq!(
            attempt_of(&with(&[(ATTEMPTS_HEADER, AMQPValue::LongLongInt(-5))])),
            1
        );
        // Graceful-shutdown returns travel in their own header; a crash
        // (x-delivery-count) never adds to them.
        let props = with(&[
            (SHUTDOWNS_HEADER, AMQPValue::LongLongInt(2)),
            ("x-delivery-count", AMQPValue::LongLongInt(1)),
        ]);
        assert_eq!(header_count(&props, SHUTDOWNS_HEADER), 2);
        assert_eq!(
            header_count(&BasicProperties::default(), SHUTDOWNS_HEADER),
            0
        );
    }
}
