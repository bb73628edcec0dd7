//! Delayed dispatch: the server's message schedules (nats-server 2.12+),
//! or the driver's hold stream and relay (any server). See the module
//! documentation, "Delayed dispatch", for the contract.
//!
//! - **Schedules.** The work stream also holds the schedule subjects
//!   `<subject_prefix>-scheduled.Q.*` and allows schedules
//!   (`allow_msg_schedules`, set with a raw `STREAM.UPDATE`: async-nats'
//!   typed stream configuration has no such field without its
//!   `server_2_12` feature, which stays off for 2.9). A delayed dispatch is
//!   published to `<subject_prefix>-scheduled.Q.<id>` with
//!   `Nats-Schedule: @at <due time>` and `Nats-Schedule-Target:
//!   <subject_prefix>.Q`; the server publishes its body to the work subject
//!   when it is due and removes the schedule. The work consumer filters on
//!   the work subject, so it never sees a schedule.
//! - **Relay.** A delayed dispatch is published to the hold stream
//!   `<work stream>_delayed` (subject `<subject_prefix>-delayed.Q`) with its
//!   due time in [`DUE_HEADER`]. Every worker of the queue runs a relay: it
//!   pulls held messages through the hold stream's own consumer, `-NAK`s one
//!   not yet due with the time left (at most [`LONGEST_HOLD`]), and
//!   publishes a due one to the work subject (`Nats-Msg-Id` = its message
//!   id) before acknowledging the held copy.

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{self, pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::response::Response;
use async_nats::jetstream::AckKind;
use futures_util::StreamExt;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::config::DelayMechanism;
use super::errors::{self, config_error, error};
use super::topology::Role;
use super::{read, write, Inner, NatsDriver};
use crate::driver::{DriverError, ErrorKind};
use crate::kit::{lock, Reconnect};

/// The header of a held message (relay mechanism) carrying when it is due,
/// in milliseconds since the Unix epoch.
pub const DUE_HEADER: &str = "Queue-Due";

/// The longest `-NAK` delay the relay gives a held message that is not
/// due: one that is due later comes back after this long and is `-NAK`ed
/// again, so a held message costs at most one redelivery a day.
pub const LONGEST_HOLD: Duration = Duration::from_secs(24 * 60 * 60);

/// How long the hold stream's consumer waits for a relay's settlement
/// before redelivering a held message to another relay.
pub(super) const HOLD_ACK_WAIT: Duration = Duration::from_secs(30);

/// The most held messages one pull request of a relay asks for.
const RELAY_BATCH: usize = 256;

/// How often a relay on a schedules server looks for a hold stream (left
/// by a relay-mechanism driver, or from before the server was upgraded).
const HOLD_PROBE: Duration = Duration::from_secs(60);

/// The last due time RFC 3339 (and so a schedule) can say: 9999-12-31.
const LAST_DUE_MS: u128 = 253_402_300_799_999;

/// The mechanism a queue's delayed dispatches use, chosen when it is
/// declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mechanism {
    Schedules,
    Relay,
}

/// Whether a server of `version` (`2.12.0`, `2.15.1-beta`...) has message
/// schedules (2.12 or later).
pub(super) fn has_schedules(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u64>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= (2, 12)
}

/// Milliseconds since the Unix epoch, now.
fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

/// When a message delayed by `delay` from now is due, in milliseconds since
/// the epoch, rounded up (never early); refused past year 9999.
pub(super) fn due_ms(delay: Duration) -> Result<u128, DriverError> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let due = now.checked_add(delay).map(|due| {
        let ms = due.as_millis();
        if due.as_nanos() % 1_000_000 == 0 {
            ms
        } else {
            ms + 1
        }
    });
    match due {
        Some(ms) if ms <= LAST_DUE_MS => Ok(ms),
        _ => Err(error(
            ErrorKind::Unsupported,
            format!("dispatch delay {delay:?} ends after the year 9999; nothing was sent"),
        )),
    }
}

/// `ms` since the epoch as RFC 3339 in UTC with milliseconds
/// (`2026-12-02T18:30:00.123Z`).
pub(super) fn rfc3339(ms: u128) -> String {
    let millis = ms % 1000;
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}

/// A subject token standing for message id `id`: the id itself when it is
/// made of letters, digits, `-` and `_` (a UUID is), else `~` and its bytes
/// in hex (so two ids never share a token).
fn id_token(id: &str) -> String {
    if !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        id.to_string()
    } else {
        let mut token = String::with_capacity(1 + 2 * id.len());
        token.push('~');
        for b in id.bytes() {
            token.push_str(&format!("{b:02x}"));
        }
        token
    }
}

impl NatsDriver {
    /// The subjects of `queue`'s schedules (schedules mechanism), in its
    /// work stream: `<subject_prefix>-scheduled.<queue>.*`.
    pub(super) fn schedule_subjects(&self, queue: &str) -> String {
        format!("{}-scheduled.{queue}.*", self.inner.config.subject_prefix)
    }

    /// The schedule subject of message `id` of `queue`.
    fn schedule_subject(&self, queue: &str, id: &str) -> String {
        format!(
            "{}-scheduled.{queue}.{}",
            self.inner.config.subject_prefix,
            id_token(id)
        )
    }

    /// The subject of `queue`'s held messages (relay mechanism), in its hold
    /// stream: `<subject_prefix>-delayed.<queue>`.
    pub(super) fn hold_subject(&self, queue: &str) -> String {
        format!("{}-delayed.{queue}", self.inner.config.subject_prefix)
    }

    /// `queue`'s hold stream (relay mechanism): `<work stream>_delayed`.
    pub(super) fn hold_stream_name(&self, queue: &str) -> String {
        format!("{}_delayed", self.stream_name(queue))
    }

    /// The mechanism for a queue declared now, on a server of `version`.
    pub(super) fn mechanism(&self, version: &str) -> Result<Mechanism, DriverError> {
        match self.inner.config.delay_mechanism {
            DelayMechanism::Relay => Ok(Mechanism::Relay),
            DelayMechanism::Auto if has_schedules(version) => Ok(Mechanism::Schedules),
            DelayMechanism::Auto => Ok(Mechanism::Relay),
            DelayMechanism::Schedules if has_schedules(version) => Ok(Mechanism::Schedules),
            DelayMechanism::Schedules => Err(config_error(format!(
                "the delay mechanism is Schedules, but the server is nats-server {version}: message \
                 schedules need 2.12 or later (use DelayMechanism::Auto or Relay)"
            ))),
        }
    }

    /// Makes `queue`'s work stream `name` hold its schedule subjects and
    /// allow schedules, with a raw `STREAM.UPDATE` of its configuration as
    /// the server reports it (nothing else changes). The work consumer must
    /// already filter on the work subject.
    pub(super) async fn enable_schedules(
        &self,
        js: &async_nats::jetstream::Context,
        name: &str,
        queue: &str,
    ) -> Result<(), DriverError> {
        let doing = format!("enabling message schedules on stream `{name}`");
        let info: Response<serde_json::Value> = js
            .request(format!("STREAM.INFO.{name}"), &())
            .await
            .map_err(|e| errors::connection(doing.clone(), e))?;
        let info = match info {
            Response::Ok(info) => info,
            Response::Err { error } => {
                return Err(errors::connection(doing, error));
            }
        };
        let mut config = info
            .get("config")
            .cloned()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| {
                error(
                    ErrorKind::Connection,
                    format!("{doing}: no configuration in the stream's info"),
                )
            })?;
        let wanted = self.schedule_subjects(queue);
        let mut subjects: Vec<serde_json::Value> = config
            .get("subjects")
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default();
        let has_subject = subjects.iter().any(|s| s.as_str() == Some(wanted.as_str()));
        let allowed = config
            .get("allow_msg_schedules")
            .and_then(serde_json::Value::as_bool)
            == Some(true);
        if has_subject && allowed {
            return Ok(());
        }
        if !has_subject {
            subjects.push(serde_json::Value::from(wanted.clone()));
        }
        config["subjects"] = serde_json::Value::from(subjects);
        config["allow_msg_schedules"] = serde_json::Value::from(true);
        let updated: Response<serde_json::Value> = js
            .request(format!("STREAM.UPDATE.{name}"), &config)
            .await
            .map_err(|e| errors::connection(doing.clone(), e))?;
        match updated {
            Response::Ok(_) => {
                info!(stream = name, subjects = %wanted, "enabled message schedules");
                Ok(())
            }
            Response::Err { error } => Err(config_error(format!(
                "{doing} (subjects `{wanted}`, allow_msg_schedules) was refused: {error}; \
                 enable it by hand, or use DelayMechanism::Relay"
            ))),
        }
    }

    /// The subject and message to publish for a dispatch of `id` delayed by
    /// `delay` on `queue` with `mechanism`.
    pub(super) fn delayed_publish(
        &self,
        queue: &str,
        mechanism: Mechanism,
        id: &str,
        body: Vec<u8>,
        delay: Duration,
    ) -> Result<(String, PublishMessage), DriverError> {
        let due = due_ms(delay)?;
        Ok(match mechanism {
            // No Nats-Msg-Id: the schedule's subject is its identity (a
            // repeated dispatch replaces it), and the server copies the
            // schedule's headers onto the message it publishes.
            Mechanism::Schedules => (
                self.schedule_subject(queue, id),
                PublishMessage::build()
                    .payload(body.into())
                    .header("Nats-Schedule", format!("@at {}", rfc3339(due)).as_str())
                    .header("Nats-Schedule-Target", self.subject(queue).as_str()),
            ),
            Mechanism::Relay => (
                self.hold_subject(queue),
                PublishMessage::build()
                    .payload(body.into())
                    .message_id(id)
                    .header(DUE_HEADER, due.to_string().as_str()),
            ),
        })
    }

    fn wanted_hold_consumer(&self) -> pull::Config {
        pull::Config {
            durable_name: Some(self.inner.config.consumer_name.clone()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: HOLD_ACK_WAIT,
            max_deliver: -1,
            // Every held message may wait out a -NAK at once: a cap would
            // leave a message due soon behind ones due in a month.
            max_ack_pending: -1,
            ..Default::default()
        }
    }

    /// Declares `queue`'s hold stream and its consumer (once per driver,
    /// again after [`forget_hold`](Self::forget_hold)) and returns the
    /// consumer.
    pub(super) async fn declare_hold(
        &self,
        queue: &str,
    ) -> Result<consumer::Consumer<pull::Config>, DriverError> {
        self.check_queue(queue)?;
        let link = self.link().await?;
        let name = self.hold_stream_name(queue);
        let stream = self
            .ensure_stream(&link.js, &name, &self.hold_subject(queue), Role::Held)
            .await?;
        let durable = self.inner.config.consumer_name.clone();
        let known = read(&self.inner.held).contains(queue);
        if !known {
            match stream.consumer_info(&durable).await {
                Ok(info) => {
                    if info.config.ack_policy != AckPolicy::Explicit
                        || info.config.deliver_subject.is_some()
                    {
                        return Err(config_error(format!(
                            "consumer `{durable}` on hold stream `{name}` is not an explicit-ack \
                             pull consumer; delete it"
                        )));
                    }
                }
                Err(e) => {
                    if let Some(err) = errors::consumer_lookup(&durable, &name, e) {
                        return Err(err);
                    }
                    if let Err(e) = stream.create_consumer(self.wanted_hold_consumer()).await {
                        if let Some(err) = errors::consumer_create(&durable, &name, e) {
                            return Err(err);
                        }
                    }
                    info!(stream = %name, consumer = %durable, "declared hold consumer");
                }
            }
            write(&self.inner.held).insert(queue.to_string());
        }
        stream.get_consumer(&durable).await.map_err(|e| {
            errors::connection(
                format!("consumer `{durable}` on `{name}`"),
                errors::Boxed(e),
            )
        })
    }

    /// Declares `queue`'s hold stream and its consumer unless this driver
    /// already did (a shared read then).
    pub(super) async fn ensure_hold(&self, queue: &str) -> Result<(), DriverError> {
        if read(&self.inner.held).contains(queue) {
            return Ok(());
        }
        self.declare_hold(queue).await.map(|_| ())
    }

    /// Forgets that `queue`'s hold stream was declared.
    pub(super) fn forget_hold(&self, queue: &str) {
        write(&self.inner.held).remove(queue);
    }

    /// Starts `queue`'s relay in this driver, unless it runs already.
    pub(super) fn start_relay(&self, queue: &str) {
        if !lock(&self.inner.relays).insert(queue.to_string()) {
            return;
        }
        tokio::spawn(relay(Arc::downgrade(&self.inner), Arc::from(queue)));
    }

    /// Whether `queue` has a hold stream.
    async fn hold_exists(&self, queue: &str) -> Result<bool, DriverError> {
        let link = self.link().await?;
        let name = self.hold_stream_name(queue);
        match link.js.get_stream(&name).await {
            Ok(_) => Ok(true),
            Err(e) => match errors::stream_lookup(&name, e) {
                Some(err) => Err(err),
                None => Ok(false),
            },
        }
    }

    /// One pull request of `queue`'s relay on `consumer`: each held
    /// message received is sent on (due) or `-NAK`ed for the time left.
    async fn relay_batch(
        &self,
        queue: &str,
        consumer: &consumer::Consumer<pull::Config>,
    ) -> Result<(), DriverError> {
        let link = self.link().await?;
        self.wait_connected(&link).await?;
        let name = self.hold_stream_name(queue);
        let mut batch = consumer
            .batch()
            .max_messages(RELAY_BATCH)
            .expires(self.inner.config.fetch_expiry)
            .messages()
            .await
            .map_err(|e| errors::connection(format!("pull request on `{name}`"), e))?;
        loop {
            let next = tokio::select! {
                _ = self.inner.life.stopped() => return Ok(()),
                next = batch.next() => next,
            };
            match next {
                None => return Ok(()),
                Some(Ok(message)) => self.relay_one(queue, message).await,
                Some(Err(e)) => {
                    return Err(errors::connection(
                        format!("pull request on `{name}`"),
                        errors::Boxed(e),
                    ));
                }
            }
        }
    }

    /// Sends one held message on if it is due, else `-NAK`s it for the time
    /// left (at most [`LONGEST_HOLD`]).
    async fn relay_one(&self, queue: &str, message: async_nats::jetstream::Message) {
        let received = Instant::now();
        let headers = message.headers.as_ref();
        let due = headers
            .and_then(|h| h.get(DUE_HEADER))
            .and_then(|v| v.as_str().trim().parse::<u128>().ok());
        let now = now_ms();
        if let Some(due) = due.filter(|due| *due > now) {
            let left = Duration::from_millis(u64::try_from(due - now).unwrap_or(u64::MAX));
            let wait = left.min(LONGEST_HOLD);
            if let Err(e) = message.ack_with(AckKind::Nak(Some(wait))).await {
                // The hold consumer's AckWait brings it back.
                debug!(queue, "could not -NAK a held message: {e}");
            }
            return;
        }
        let id = headers
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.to_string());
        let Some(id) = id else {
            warn!(
                queue,
                "a held message without Nats-Msg-Id: sent on with a derived id"
            );
            let id = message
                .info()
                .map(|i| format!("held:{}:{}", i.stream, i.stream_sequence))
                .unwrap_or_default();
            self.relay_publish(queue, message, id, received).await;
            return;
        };
        self.relay_publish(queue, message, id, received).await;
    }

    async fn relay_publish(
        &self,
        queue: &str,
        message: async_nats::jetstream::Message,
        id: String,
        received: Instant,
    ) {
        let sent = async {
            self.declare(queue).await?;
            // Read too long ago: the server may have handed it to another
            // relay already; leave it to the one that has it.
            if received.elapsed() > HOLD_ACK_WAIT / 2 {
                return Err(error(
                    ErrorKind::Uncertain,
                    "held message read too long ago; left for its redelivery",
                ));
            }
            self.publish(&self.subject(queue), message.payload.to_vec(), &id, &[])
                .await
        }
        .await;
        match sent {
            Ok(_) => {
                if let Err(e) = message.ack().await {
                    // Redelivered after the hold AckWait; its second
                    // publish is dropped by the duplicate window.
                    debug!(queue, "could not ack a held message sent on: {e}");
                }
            }
            Err(e) => {
                warn!(queue, message_id = %id, "could not send a due held message on, retrying in 1 s: {e}");
                if e.kind() == ErrorKind::NotAccepted {
                    self.forget(queue);
                }
                let _ = message
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
            }
        }
    }
}

/// `queue`'s relay: pulls held messages until the driver is stopped or
/// dropped (it holds the driver only while a pull request is open, at most
/// the fetch expiry), backing off after a failure. On a schedules server it
/// first waits for a hold stream to exist (looking every [`HOLD_PROBE`]).
async fn relay(driver: Weak<Inner>, queue: Arc<str>) {
    let mut backoff: Option<Reconnect> = None;
    let mut consumer = None;
    loop {
        let Some(inner) = driver.upgrade() else {
            return;
        };
        let driver = NatsDriver { inner };
        if driver.inner.life.is_stopped() {
            return;
        }
        let backoff = backoff.get_or_insert_with(|| driver.reconnect());
        let round = async {
            if consumer.is_none() {
                let relayed = driver.declare(&queue).await?.mechanism == Mechanism::Relay;
                if !relayed && !driver.hold_exists(&queue).await? {
                    return Ok(false);
                }
                consumer = Some(driver.declare_hold(&queue).await?);
            }
            match &consumer {
                Some(consumer) => driver.relay_batch(&queue, consumer).await.map(|()| true),
                None => Ok(false),
            }
        };
        let wait = match round.await {
            Ok(true) => {
                backoff.succeeded();
                continue;
            }
            // No hold stream (a schedules server): look again later.
            Ok(false) => HOLD_PROBE,
            Err(e) => {
                if e.kind() == ErrorKind::Stopped {
                    return;
                }
                warn!(queue = %queue, "relay of delayed messages: retrying in {:?}: {e}", backoff.upcoming());
                consumer = None;
                driver.forget_hold(&queue);
                backoff.failed()
            }
        };
        let stopped = driver.inner.life.watch();
        drop(driver);
        let mut stopped = stopped;
        tokio::select! {
            _ = stopped.wait_for(|stopped| *stopped) => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// The queues whose relay runs in a driver.
pub(super) type Relays = std::sync::Mutex<HashSet<String>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_with_schedules() {
        assert!(!has_schedules("2.9.10"));
        assert!(!has_schedules("2.11.4"));
        assert!(has_schedules("2.12.0"));
        assert!(has_schedules("2.15.1-beta.2"));
        assert!(has_schedules("v3.0.0"));
        assert!(!has_schedules(""));
    }

    #[test]
    fn rfc3339_in_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_239_800_500), "2026-12-02T19:30:00.500Z");
        assert_eq!(rfc3339(LAST_DUE_MS), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn due_times_round_up_and_end_in_9999() {
        let before = now_ms();
        let due = due_ms(Duration::from_secs(3)).unwrap();
        assert!(due >= before + 3000 && due <= now_ms() + 3001);
        let err = due_ms(Duration::MAX).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        assert!(due_ms(Duration::from_secs(400 * 365 * 86_400)).is_ok());
        assert!(due_ms(Duration::from_secs(9000 * 366 * 86_400)).is_err());
    }

    #[test]
    fn id_tokens_are_single_tokens() {
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        assert_eq!(id_token(uuid), uuid);
        assert_eq!(id_token("a.b"), "~612e62");
        assert_eq!(id_token(""), "~");
        assert!(super::super::config::valid_subject(&id_token("x *>y")));
    }
}
