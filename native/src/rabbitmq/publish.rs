//! Sending: a dispatch, a retry's copy and a failure record are each one
//! persistent, mandatory publish on the driver's confirm channel, waiting
//! for the broker's confirm. A batch ([`Driver::send_batch`]) publishes
//! every message first and then awaits their confirms (pipelined), with one
//! answer per message.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use jobrail::FailureRecord;
use lapin::options::BasicPublishOptions;
use lapin::publisher_confirm::PublisherConfirm;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

use super::errors::{confirmed, error, publish_failed};
use super::{RabbitDriver, ATTEMPTS_HEADER, NAME, SHUTDOWNS_HEADER};
use crate::driver::{Driver, DriverError, ErrorKind, Outgoing};

/// The properties of a message with `id` that consumed `attempts`
/// deliveries, `shutdowns` of them handed back by a graceful shutdown.
fn counted(id: Option<&str>, attempts: u32, shutdowns: u32) -> BasicProperties {
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

/// One publish of a batch.
enum Sending<'a> {
    /// Refused before sending (its error is kept apart, in order).
    Refused,
    /// Started: its frames are queued, not yet written.
    Started(Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send + 'a>>),
    /// Written (or failed) on its first poll.
    Written(lapin::Result<PublisherConfirm>),
}

/// The properties of a new message: its id only. A first publish carries
/// no count headers; absent, they read as 0 (see the module documentation,
/// "Attempts"), so the broker stores and parses less per dispatch.
fn fresh(id: &str) -> BasicProperties {
    BasicProperties::default().with_message_id(ShortString::from(id.to_string()))
}

impl RabbitDriver {
    /// A new message for `queue` (see [`Driver::send`]): refused before any
    /// I/O when too long, otherwise published to the work queue or the hold
    /// queue of its delay's bucket, both declared first.
    pub(super) async fn dispatch(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.lifecycle.check_running()?;
        self.capabilities()
            .refuse_oversize(NAME, message.body.len())?;
        self.declare_work(queue)
            .await
            .map_err(DriverError::not_sent)?;
        let bucket = self.dispatch_hold(&message.body, message.delay)?;
        let target = self
            .destination(queue, bucket)
            .await
            .map_err(DriverError::not_sent)?;
        self.publish(&target, &message.body, fresh(&message.id))
            .await
    }

    /// A batch of new messages for `queue` (see [`Driver::send_batch`]):
    /// each checked as in [`dispatch`](Self::dispatch), then all published
    /// on the confirm channel one after another without waiting, then their
    /// confirms awaited (all within one
    /// [`confirm_timeout`](super::RabbitConfig::confirm_timeout)). One
    /// answer per message, in order: a message refused before sending, nacked
    /// or returned is [`ErrorKind::NotAccepted`]; one sent whose confirm was
    /// lost (the connection ended) or late is [`ErrorKind::Uncertain`].
    pub(super) async fn dispatch_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let all_fail = |e: DriverError, n: usize| -> Vec<Result<(), DriverError>> {
            let text = e.to_string();
            let kind = e.kind();
            let mut out = Vec::with_capacity(n);
            out.push(Err(e));
            out.extend((1..n).map(|_| Err(error(kind, text.clone()))));
            out
        };
        if messages.is_empty() {
            return vec![];
        }
        let count = messages.len();
        if let Err(e) = self.inner.lifecycle.check_running() {
            return all_fail(e, count);
        }
        if let Err(e) = self
            .declare_work(queue)
            .await
            .map_err(DriverError::not_sent)
        {
            return all_fail(e, count);
        }
        // Where each message goes (declaring hold queues first), or why not.
        let mut targets: Vec<Result<String, DriverError>> = Vec::with_capacity(count);
        let mut routes: Vec<(Option<Duration>, String)> = vec![];
        for message in &messages {
            let target = async {
                self.capabilities()
                    .refuse_oversize(NAME, message.body.len())?;
                let bucket = self.dispatch_hold(&message.body, message.delay)?;
                if let Some((_, name)) = routes.iter().find(|(b, _)| *b == bucket) {
                    return Ok(name.clone());
                }
                let name = self
                    .destination(queue, bucket)
                    .await
                    .map_err(DriverError::not_sent)?;
                routes.push((bucket, name.clone()));
                Ok(name)
            }
            .await;
            targets.push(target);
        }
        let channel = match self.publisher().await.map_err(DriverError::not_sent) {
            Ok(channel) => channel,
            Err(e) => return all_fail(e, count),
        };
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let limit = self.inner.config.operation_timeout;
        // Every publish is started (polled once, in order: lapin queues its
        // frames for the socket on that first poll and takes its confirm
        // number), then each awaited until written: the frames of the whole
        // batch go out together instead of one write per message.
        let properties: Vec<BasicProperties> = messages
            .iter()
            .map(|m| fresh(&m.id).with_delivery_mode(2))
            .collect();
        let (names, refusals): (Vec<Option<String>>, Vec<Option<DriverError>>) = targets
            .into_iter()
            .map(|target| match target {
                Ok(name) => (Some(name), None),
                Err(e) => (None, Some(e)),
            })
            .unzip();
        let mut publishes: Vec<Sending<'_>> = messages
            .iter()
            .zip(&names)
            .zip(properties)
            .map(|((message, target), properties)| match target {
                None => Sending::Refused,
                Some(target) => Sending::Started(Box::pin(channel.basic_publish(
                    "",
                    target,
                    options,
                    &message.body,
                    properties,
                ))),
            })
            .collect();
        std::future::poll_fn(|cx| {
            for sending in publishes.iter_mut() {
                if let Sending::Started(publish) = sending {
                    if let std::task::Poll::Ready(outcome) = publish.as_mut().poll(cx) {
                        *sending = Sending::Written(outcome);
                    }
                }
            }
            std::task::Poll::Ready(())
        })
        .await;
        let written_by = tokio::time::Instant::now() + limit;
        let mut pending: Vec<Result<(&str, PublisherConfirm), DriverError>> =
            Vec::with_capacity(count);
        for ((sending, target), refusal) in publishes.into_iter().zip(&names).zip(refusals) {
            let target = target.as_deref().unwrap_or_default();
            let outcome = match sending {
                Sending::Refused => None,
                Sending::Written(outcome) => Some(Ok(outcome)),
                Sending::Started(publish) => {
                    Some(tokio::time::timeout_at(written_by, publish).await)
                }
            };
            pending.push(match (outcome, refusal) {
                (_, Some(refusal)) => Err(refusal),
                (None, None) => Err(error(ErrorKind::NotAccepted, "not sent")),
                (Some(Ok(Ok(confirm))), None) => Ok((target, confirm)),
                (Some(Ok(Err(e))), None) => Err(publish_failed(target, e)),
                (Some(Err(_)), None) => Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{target}` did not finish within {limit:?}"),
                )),
            });
        }
        let limit = self.inner.config.confirm_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let mut results = Vec::with_capacity(count);
        for sent in pending {
            results.push(match sent {
                Err(e) => Err(e),
                Ok((target, confirm)) => confirmed(
                    target,
                    limit,
                    tokio::time::timeout_at(deadline, confirm).await,
                ),
            });
        }
        results
    }

    /// A retry's copy of a delivered message, to `target` (the work queue or
    /// a hold queue), carrying its counts.
    pub(super) async fn republish(
        &self,
        target: &str,
        body: &[u8],
        message_id: Option<&str>,
        attempts: u32,
        shutdowns: u32,
    ) -> Result<(), DriverError> {
        self.publish(target, body, counted(message_id, attempts, shutdowns))
            .await
    }

    /// The failure record of the message `message_id`, to `failure_queue`.
    pub(super) async fn publish_failure(
        &self,
        failure_queue: &str,
        record: &FailureRecord,
        message_id: Option<&str>,
    ) -> Result<(), DriverError> {
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id(message_id.unwrap_or_default().into());
        // Never over the broker's max_message_size: one that does not fit
        // is cut to fit (the whole would be refused, again and again).
        let body = record.encode_within(self.inner.config.max_message_bytes);
        self.publish(failure_queue, &body, properties).await
    }

    /// Publishes persistently to `routing_key` on the default exchange and
    /// waits for the confirm.
    pub(super) async fn publish(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), DriverError> {
        self.inner.lifecycle.check_running()?;
        let channel = self.publisher().await.map_err(DriverError::not_sent)?;
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
            Ok(Err(e)) => return Err(publish_failed(routing_key, e)),
            Err(_) => {
                return Err(error(
                    ErrorKind::Uncertain,
                    format!("publish to `{routing_key}` did not finish within {limit:?}"),
                ))
            }
        };
        let limit = self.inner.config.confirm_timeout;
        confirmed(
            routing_key,
            limit,
            tokio::time::timeout(limit, confirm).await,
        )
    }
}
