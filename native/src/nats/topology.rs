//! Names, and the streams and consumer a queue needs: declared once per
//! driver (again after a failure suggests the server lost them), inspected
//! rather than overwritten when they already exist. The failure store
//! (`failures.rs`) reads the failure stream back.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{self, pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use tracing::{info, warn};

use super::config::{valid_subject, DelayMechanism};
use super::delay::Mechanism;
use super::errors::{self, config_error, error};
use super::{read, write, NatsDriver};
use crate::driver::{DriverError, ErrorKind};
#[cfg(feature = "testing")]
use crate::kit::lock;

/// Which stream a name is, for its configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    Work,
    Failure,
    /// The claims of a failure stream's entries (see `failures.rs`): their
    /// age limit is the claim hold.
    Claims,
    /// Delayed dispatches waiting for the relay (see `delay.rs`).
    Held,
}

/// What declaring a queue found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Declared {
    /// The work consumer's `MaxAckPending`.
    pub(super) max_ack_pending: i64,
    /// How the queue's delayed dispatches are held.
    pub(super) mechanism: Mechanism,
}

impl NatsDriver {
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

    pub(super) fn check_queue(&self, queue: &str) -> Result<(), DriverError> {
        if valid_subject(queue) {
            Ok(())
        } else {
            Err(config_error(format!(
                "queue name `{queue}` cannot be part of a NATS subject (no spaces, `*`, `>` or empty dot-separated tokens)"
            )))
        }
    }

    fn wanted_stream(&self, name: &str, subject: &str, role: Role) -> stream::Config {
        stream::Config {
            name: name.to_string(),
            subjects: vec![subject.to_string()],
            retention: match role {
                Role::Work | Role::Held => RetentionPolicy::WorkQueue,
                Role::Failure | Role::Claims => RetentionPolicy::Limits,
            },
            storage: StorageType::File,
            max_age: match role {
                Role::Claims => self.inner.config.effective_claim_hold(),
                Role::Work | Role::Failure | Role::Held => Duration::ZERO,
            },
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
    pub(super) async fn ensure_stream(
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
                #[cfg(feature = "testing")]
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
        // A refusal for overlapping subjects may be our own stream, declared
        // a moment ago by another process (the server can answer a racing
        // create that way instead of "name in use"): look again before
        // reporting it.
        // A store the server failed to create is tried again too (see
        // `errors::is_store_creation`), after a pause.
        let mut overlap = None;
        for attempt in 1..=3u64 {
            match js.get_stream(name).await {
                Ok(stream) => return check(stream),
                Err(e) => {
                    if let Some(err) = errors::stream_lookup(name, e) {
                        return Err(err);
                    }
                }
            }
            match js.create_stream(wanted.clone()).await {
                Ok(stream) => {
                    info!(stream = name, subject, "declared stream");
                    return check(stream);
                }
                // None: declared concurrently by someone else, inspect theirs.
                Err(e) => {
                    let overlapping = errors::is_subject_overlap(&e);
                    let store = errors::is_store_creation(&e);
                    match errors::stream_create(name, subject, e) {
                        None => {}
                        Some(err) if overlapping => overlap = Some(err),
                        Some(err) if store => {
                            warn!(stream = name, "the server could not create the stream's store, trying again: {err}");
                            overlap = Some(err);
                            tokio::time::sleep(std::time::Duration::from_millis(100 * attempt))
                                .await;
                        }
                        Some(err) => return Err(err),
                    }
                }
            }
        }
        Err(overlap.unwrap_or_else(|| {
            error(
                ErrorKind::Connection,
                format!("stream `{name}` kept changing while it was declared"),
            )
        }))
    }

    /// The work consumer; with `filter`, filtering on the work subject
    /// (the schedules mechanism: the stream holds schedules too).
    fn wanted_consumer(&self, filter: Option<&str>) -> pull::Config {
        let config = &self.inner.config;
        pull::Config {
            durable_name: Some(config.consumer_name.clone()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver.map_or(-1, i64::from),
            filter_subject: filter.map(str::to_string).unwrap_or_default(),
            ..Default::default()
        }
    }

    fn consumer_conflicts(&self, actual: &consumer::Config, subject: &str) -> Vec<String> {
        let wanted = self.wanted_consumer(None);
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

    /// Makes sure the durable pull consumer exists on `stream` as
    /// configured; with `filtered` (the schedules mechanism), filtering on
    /// `subject`, which an existing consumer without a filter is updated to
    /// (its other settings kept).
    async fn ensure_consumer(
        &self,
        stream: &stream::Stream,
        subject: &str,
        filtered: bool,
    ) -> Result<consumer::Info, DriverError> {
        let name = &self.inner.config.consumer_name;
        let stream_name = &stream.cached_info().config.name;
        let check = |info: consumer::Info| {
            let conflicts = self.consumer_conflicts(&info.config, subject);
            if conflicts.is_empty() {
                <pull::Config as consumer::FromConsumer>::try_from_consumer_config(
                    info.config.clone(),
                )
                .map_err(|e| errors::not_a_pull_consumer(name, e))?;
                Ok(info)
            } else {
                let wanted = self.wanted_consumer(None);
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
        let filter = filtered.then_some(subject);
        for _ in 0..2 {
            match stream.consumer_info(name).await {
                Ok(info) if filtered && info.config.filter_subject.is_empty() => {
                    let info = check(info)?;
                    let mut config =
                        <pull::Config as consumer::FromConsumer>::try_from_consumer_config(
                            info.config,
                        )
                        .map_err(|e| errors::not_a_pull_consumer(name, e))?;
                    config.filter_subject = subject.to_string();
                    let mut consumer = stream.create_consumer(config).await.map_err(|e| {
                        errors::connection(
                            format!(
                                "filtering consumer `{name}` on `{stream_name}` on `{subject}`"
                            ),
                            e,
                        )
                    })?;
                    info!(stream = %stream_name, consumer = %name, subject, "consumer now filters on the work subject");
                    let info = consumer.info().await.map_err(|e| {
                        errors::connection(format!("consumer `{name}` on `{stream_name}`"), e)
                    })?;
                    return check(info.clone());
                }
                Ok(info) => return check(info),
                Err(e) => {
                    if let Some(err) = errors::consumer_lookup(name, stream_name, e) {
                        return Err(err);
                    }
                }
            }
            match stream.create_consumer(self.wanted_consumer(filter)).await {
                Ok(mut consumer) => {
                    info!(stream = %stream_name, consumer = %name, "declared consumer");
                    let info = consumer.info().await.map_err(|e| {
                        errors::connection(format!("consumer `{name}` on `{stream_name}`"), e)
                    })?;
                    return check(info.clone());
                }
                // None: declared concurrently by someone else, inspect theirs.
                Err(e) => {
                    if let Some(err) = errors::consumer_create(name, stream_name, e) {
                        return Err(err);
                    }
                }
            }
        }
        Err(error(
            ErrorKind::Connection,
            format!("consumer `{name}` kept changing while it was declared"),
        ))
    }

    /// Declares `queue`'s work stream, consumer and failure stream (once per
    /// driver, again after [`forget`](Self::forget)), choosing its delay
    /// mechanism by the server's version (the schedules mechanism filters
    /// the consumer on the work subject, then enables schedules on the
    /// stream: in that order, so no schedule is ever delivered as work).
    /// Once declared, this is a shared read of the map of declared queues.
    pub(super) async fn declare(&self, queue: &str) -> Result<Declared, DriverError> {
        if let Some(declared) = read(&self.inner.declared).get(queue) {
            return Ok(*declared);
        }
        self.check_queue(queue)?;
        let link = self.link().await?;
        let mut mechanism = self.mechanism(&link.client.server_info().version)?;
        let schedules = mechanism == Mechanism::Schedules;
        let subject = self.subject(queue);
        let name = self.stream_name(queue);
        let stream = self
            .ensure_stream(&link.js, &name, &subject, Role::Work)
            .await?;
        let info = self.ensure_consumer(&stream, &subject, schedules).await?;
        if schedules {
            match self.enable_schedules(&link.js, &name, queue).await {
                Ok(()) => {}
                // Refused (a server that enables schedules only on an empty
                // stream, say): the relay holds this queue's delays, unless
                // schedules were asked for by name.
                Err(e)
                    if e.kind() == ErrorKind::Config
                        && self.inner.config.delay_mechanism == DelayMechanism::Auto =>
                {
                    warn!(
                        queue,
                        "message schedules unavailable, delayed dispatches use the relay: {e}"
                    );
                    mechanism = Mechanism::Relay;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(failed) = self.failure_subject(queue) {
            self.ensure_stream(
                &link.js,
                &self.failure_stream_name(queue),
                &failed,
                Role::Failure,
            )
            .await?;
        }
        let declared = Declared {
            max_ack_pending: info.config.max_ack_pending,
            mechanism,
        };
        write(&self.inner.declared).insert(queue.to_string(), declared);
        Ok(declared)
    }

    /// Forgets that `queue` was declared, so the next use declares it again.
    pub(super) fn forget(&self, queue: &str) {
        write(&self.inner.declared).remove(queue);
        write(&self.inner.held).remove(queue);
    }
}
