//! The failure store (list, claim and remove the entries of a failure
//! queue) and the admin interface (queue depth, deleting a queue and what
//! the driver made for it). See the module documentation's "Failure store"
//! section for what these guarantee on SQS.
//!
//! SQS cannot peek: every operation receives the failure queue's messages
//! (short polls, each message hidden for [`HOLD`] while the rest is read),
//! then makes visible again what it does not keep or delete.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageSystemAttributeName, QueueAttributeName,
};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::connection::bounded;
use super::delivery::{change_visibility, delete_message, is_base64, release_soon};
use super::errors::{config_error, error, is_missing_queue, sdk_error};
use super::publish::decode_body;
use super::topology::check_name;
use super::{SqsDriver, ENCODING_ATTRIBUTE};
use crate::driver::{DriverError, ErrorKind};
use crate::failures::{Admin, ClaimedFailure, FailureStore, QueueDepth, StoredFailure};
use crate::kit::lock;

/// How long a scan hides each message it received, and how long a claim's
/// hold lasts after its last renewal: what a crash leaves hidden.
const HOLD: Duration = Duration::from_secs(30);
/// How often a live claim renews its hold.
const RENEW_EVERY: Duration = Duration::from_secs(10);
/// How long an operation that found entries hidden by others (another
/// read, claim or removal) scans again before it settles for what it saw.
const CONTENTION_WAIT: Duration = Duration::from_secs(3);
/// Most messages one `ReceiveMessage` or batch request takes.
const BATCH: usize = 10;

/// A resolved failure queue.
struct FailureQueue {
    name: String,
    url: Arc<str>,
}

/// A message of a failure queue received by a scan: hidden until it is
/// made visible again, deleted, or its hold lapses.
struct Held {
    message_id: String,
    receipt: String,
    /// `SentTimestamp`, in milliseconds (0 when SQS did not say).
    sent_at: u64,
    entry: StoredFailure,
}

/// Retries of a scan that may have missed entries others were hiding.
struct Contention {
    started: Instant,
    deadline: Instant,
}

impl Contention {
    fn new() -> Self {
        let started = Instant::now();
        Contention {
            started,
            deadline: started + CONTENTION_WAIT,
        }
    }

    /// Waits before another scan; `false` once the time is up. The pause is
    /// random, up to twice as long as the last scan took, so that
    /// operations scanning at the same time take turns.
    async fn wait(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        let scan = now - self.started;
        let fraction = (RandomState::new().build_hasher().finish() % 1000) as f64 / 1000.0;
        let pause = (scan * 2 + Duration::from_millis(20)).mul_f64(fraction);
        tokio::time::sleep(pause.min(self.deadline - now)).await;
        self.started = Instant::now();
        true
    }
}

impl SqsDriver {
    /// The failure queue of `queue`: [`ErrorKind::Config`] when none is
    /// configured, `None` when it does not exist (yet). Never creates it.
    async fn failure_queue(&self, queue: &str) -> Result<Option<FailureQueue>, DriverError> {
        let name = self.failure_queue_name(queue).ok_or_else(|| {
            config_error(format!(
                "queue `{queue}` has no failure queue: the SQS driver is configured without one \
                 (SqsConfig::failure_queue is None), so terminal failures are logged and deleted"
            ))
        })?;
        check_name(&name)?;
        Ok(self.lookup(&name).await?.map(|url| FailureQueue {
            name,
            url: url.into(),
        }))
    }

    /// One short-poll `ReceiveMessage` of up to ten messages of `fq`, each
    /// hidden for [`HOLD`].
    async fn receive_held(&self, fq: &FailureQueue) -> Result<Vec<Held>, DriverError> {
        let what = format!("ReceiveMessage from `{}`", fq.name);
        let limit = self.inner.config.operation_timeout;
        #[allow(deprecated)] // `AttributeNames`: for servers without the newer parameter.
        let request = self
            .inner
            .client
            .receive_message()
            .queue_url(&*fq.url)
            .max_number_of_messages(BATCH as i32)
            .visibility_timeout(HOLD.as_secs() as i32)
            .wait_time_seconds(0)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .attribute_names(QueueAttributeName::All)
            .message_attribute_names(ENCODING_ATTRIBUTE);
        let out = bounded(limit, &what, ErrorKind::Connection, request.send())
            .await?
            .map_err(|e| sdk_error(&what, e, ErrorKind::Connection, ErrorKind::Connection))?;
        let mut held = Vec::new();
        for message in out.messages() {
            let Some(receipt) = message.receipt_handle() else {
                warn!(queue = %fq.name, "a received message has no receipt handle; skipped");
                continue;
            };
            let sent_at = message
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp))
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            let body = decode_body(message.body().unwrap_or_default(), is_base64(message));
            held.push(Held {
                message_id: message.message_id().unwrap_or(receipt).to_string(),
                receipt: receipt.to_string(),
                sent_at,
                entry: StoredFailure::from_body(body),
            });
        }
        Ok(held)
    }

    /// Receives messages of `fq` into `held` until a receive returns none
    /// or `stop` picks one; returns the index in `held` of the one picked.
    /// A message received twice (its hold lapsed during a long scan) is kept
    /// once, with its newest receipt. On an error, `held` still has what was
    /// received, for the caller to release.
    async fn scan(
        &self,
        fq: &FailureQueue,
        held: &mut Vec<Held>,
        mut stop: impl FnMut(&Held) -> bool,
    ) -> Result<Option<usize>, DriverError> {
        let mut index: HashMap<String, usize> = HashMap::new();
        loop {
            let batch = self.receive_held(fq).await?;
            if batch.is_empty() {
                return Ok(None);
            }
            let mut picked = None;
            for message in batch {
                let at = match index.get(&message.message_id) {
                    Some(&i) => {
                        held[i].receipt = message.receipt;
                        i
                    }
                    None => {
                        index.insert(message.message_id.clone(), held.len());
                        held.push(message);
                        held.len() - 1
                    }
                };
                if picked.is_none() && stop(&held[at]) {
                    picked = Some(at);
                }
            }
            if picked.is_some() {
                return Ok(picked);
            }
        }
    }

    /// Makes `receipts` of `fq` visible again at once
    /// (`ChangeMessageVisibilityBatch`), best effort: what could not be
    /// released comes back when its hold lapses.
    async fn release(&self, fq: &FailureQueue, receipts: &[String]) {
        let limit = self.inner.config.operation_timeout;
        let what = format!("ChangeMessageVisibilityBatch on `{}`", fq.name);
        let mut lost = 0;
        for chunk in receipts.chunks(BATCH) {
            let entries = chunk.iter().enumerate().map(|(i, receipt)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(receipt)
                    .visibility_timeout(0)
                    .build()
            });
            let entries = match entries.collect::<Result<Vec<_>, _>>() {
                Ok(entries) => entries,
                Err(e) => {
                    debug!("{what}: {e}");
                    lost += chunk.len();
                    continue;
                }
            };
            let request = self
                .inner
                .client
                .change_message_visibility_batch()
                .queue_url(&*fq.url)
                .set_entries(Some(entries));
            match bounded(limit, &what, ErrorKind::Connection, request.send()).await {
                Ok(Ok(out)) => lost += out.failed().len(),
                Ok(Err(e)) => {
                    debug!(
                        "{}",
                        sdk_error(&what, e, ErrorKind::Connection, ErrorKind::Connection)
                    );
                    lost += chunk.len();
                }
                Err(e) => {
                    debug!("{e}");
                    lost += chunk.len();
                }
            }
        }
        if lost > 0 {
            warn!(
                queue = %fq.name,
                "{lost} failure entries read stay hidden for up to {HOLD:?}: could not make them visible again"
            );
        }
    }

    /// Deletes `receipts` of `fq` (`DeleteMessageBatch`); returns how many
    /// went. Entries SQS refuses to delete (a receipt no longer valid) are
    /// skipped with a warning.
    async fn delete_held(
        &self,
        fq: &FailureQueue,
        receipts: &[String],
    ) -> Result<u64, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let what = format!("DeleteMessageBatch on `{}`", fq.name);
        let mut deleted = 0;
        for chunk in receipts.chunks(BATCH) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, receipt)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(receipt)
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| error(ErrorKind::NotAccepted, format!("{what}: {e}")))?;
            let request = self
                .inner
                .client
                .delete_message_batch()
                .queue_url(&*fq.url)
                .set_entries(Some(entries));
            let out = bounded(limit, &what, ErrorKind::Uncertain, request.send())
                .await?
                .map_err(|e| sdk_error(&what, e, ErrorKind::NotAccepted, ErrorKind::Uncertain))?;
            for refused in out.failed() {
                warn!(
                    queue = %fq.name,
                    "a failure entry was not deleted: {} ({})",
                    refused.message().unwrap_or("no reason given"),
                    refused.code()
                );
            }
            deleted += out.successful().len() as u64;
        }
        Ok(deleted)
    }

    /// How many messages `fq` has visible and hidden (another read, claim
    /// or removal holds them), per SQS's approximate counts.
    async fn counts(&self, fq: &FailureQueue) -> Result<(u64, u64), DriverError> {
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        ];
        let attributes = self.attributes(&fq.name, &fq.url, &names).await?;
        let count = |name: &QueueAttributeName| {
            attributes
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Ok((count(&names[0]), count(&names[1])))
    }

    /// Whether `fq` holds more than the `seen` messages a scan saw (and
    /// kept): others hid some from it.
    async fn missed(&self, fq: &FailureQueue, seen: usize) -> Result<bool, DriverError> {
        let (visible, hidden) = self.counts(fq).await?;
        Ok(visible + hidden > seen as u64)
    }

    /// `GetQueueAttributes` of `names`.
    pub(super) async fn attributes(
        &self,
        queue: &str,
        url: &str,
        names: &[QueueAttributeName],
    ) -> Result<Vec<(QueueAttributeName, String)>, DriverError> {
        let what = format!("GetQueueAttributes `{queue}`");
        let mut request = self.inner.client.get_queue_attributes().queue_url(url);
        for name in names {
            request = request.attribute_names(name.clone());
        }
        let limit = self.inner.config.operation_timeout;
        let out = bounded(limit, &what, ErrorKind::Connection, request.send())
            .await?
            .map_err(|e| sdk_error(&what, e, ErrorKind::Connection, ErrorKind::Connection))?;
        Ok(out
            .attributes()
            .map(|a| a.iter().map(|(n, v)| (n.clone(), v.clone())).collect())
            .unwrap_or_default())
    }

    /// Deletes the queues `names`, whatever they hold, and forgets their
    /// URLs and that this driver created them. Names that do not exist are
    /// skipped.
    pub(super) async fn delete_names(&self, names: &[String]) -> Result<(), DriverError> {
        for name in names {
            check_name(name)?;
            self.forget(name);
            if let Some(url) = self.lookup(name).await? {
                self.delete_url(name, url).await?;
            }
            lock(&self.inner.created).remove(name);
        }
        Ok(())
    }

    /// `DeleteQueue`; one already gone is not an error.
    pub(super) async fn delete_url(&self, name: &str, url: String) -> Result<(), DriverError> {
        let what = format!("DeleteQueue `{name}`");
        let limit = self.inner.config.operation_timeout;
        let answer = bounded(
            limit,
            &what,
            ErrorKind::Connection,
            self.inner.client.delete_queue().queue_url(url).send(),
        )
        .await?;
        match answer {
            Ok(_) => Ok(()),
            Err(e) if is_missing_queue(&e) => Ok(()),
            Err(e) => Err(sdk_error(
                &what,
                e,
                ErrorKind::Connection,
                ErrorKind::Connection,
            )),
        }
    }
}

#[async_trait]
impl FailureStore for SqsDriver {
    /// Receives every message of the failure queue, then makes them all
    /// visible again; oldest sent first. Does not create the failure queue
    /// (a missing one has no entries).
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        let Some(fq) = self.failure_queue(queue).await? else {
            return Ok(Vec::new());
        };
        let mut seen: HashSet<String> = HashSet::new();
        let mut entries: Vec<(u64, StoredFailure)> = Vec::new();
        let mut contention = Contention::new();
        loop {
            let mut held = Vec::new();
            let scanned = self.scan(&fq, &mut held, |_| false).await;
            let receipts: Vec<String> = held.iter().map(|h| h.receipt.clone()).collect();
            self.release(&fq, &receipts).await;
            for h in held {
                if seen.insert(h.message_id) {
                    entries.push((h.sent_at, h.entry));
                }
            }
            scanned?;
            if !self.missed(&fq, entries.len()).await? || !contention.wait().await {
                break;
            }
        }
        // Stable: messages sent in one millisecond keep their receive order.
        entries.sort_by_key(|(sent_at, _)| *sent_at);
        Ok(entries.into_iter().map(|(_, entry)| entry).collect())
    }

    /// Receives messages until one matches, keeps that one hidden (the
    /// claim, renewed while it lives) and makes the others visible again.
    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError> {
        self.inner.life.check_running()?;
        let Some(fq) = self.failure_queue(queue).await? else {
            return Ok(None);
        };
        let mut contention = Contention::new();
        loop {
            let mut held = Vec::new();
            let scanned = self.scan(&fq, &mut held, |h| h.entry.matches(id)).await;
            let target = match &scanned {
                Ok(Some(i)) => Some(held.swap_remove(*i)),
                _ => None,
            };
            let receipts: Vec<String> = held.iter().map(|h| h.receipt.clone()).collect();
            self.release(&fq, &receipts).await;
            if let Some(target) = target {
                return Ok(Some(Box::new(SqsClaim::start(self.clone(), &fq, target))));
            }
            scanned?;
            if !self.missed(&fq, receipts.len()).await? || !contention.wait().await {
                return Ok(None);
            }
        }
    }

    /// Receives every message, deletes those whose ids are in `ids` and
    /// makes the others visible again.
    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        // A set: a bulk removal names thousands of ids.
        let ids: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        self.inner.life.check_running()?;
        let Some(fq) = self.failure_queue(queue).await? else {
            return Ok(0);
        };
        let mut removed = 0;
        let mut missing: std::collections::HashSet<&str> = ids.clone();
        let mut contention = Contention::new();
        loop {
            let mut held = Vec::new();
            let scanned = self.scan(&fq, &mut held, |_| false).await;
            let (chosen, kept): (Vec<Held>, Vec<Held>) = held
                .into_iter()
                .partition(|h| ids.contains(h.entry.id.as_str()));
            let receipts: Vec<String> = kept.into_iter().map(|h| h.receipt).collect();
            let deleting: Vec<String> = chosen.iter().map(|h| h.receipt.clone()).collect();
            let deleted = self.delete_held(&fq, &deleting).await;
            self.release(&fq, &receipts).await;
            removed += deleted?;
            scanned?;
            for h in &chosen {
                missing.remove(h.entry.id.as_str());
            }
            if missing.is_empty()
                || !self.missed(&fq, receipts.len()).await?
                || !contention.wait().await
            {
                return Ok(removed);
            }
        }
    }
}

#[async_trait]
impl Admin for SqsDriver {
    /// `GetQueueAttributes`: ready is `ApproximateNumberOfMessages`, in
    /// flight `ApproximateNumberOfMessagesNotVisible`, delayed
    /// `ApproximateNumberOfMessagesDelayed` (SQS's approximations). A queue
    /// that does not exist holds nothing (all zero); it is not created.
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        self.inner.life.check_running()?;
        check_name(queue)?;
        let Some(url) = self.lookup(queue).await? else {
            return Ok(QueueDepth::new(0, Some(0), Some(0)));
        };
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        ];
        let attributes = self.attributes(queue, &url, &names).await?;
        let count = |name: &QueueAttributeName| {
            attributes
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.parse::<u64>().ok())
        };
        let ready = count(&names[0]).ok_or_else(|| {
            error(
                ErrorKind::Connection,
                format!("GetQueueAttributes `{queue}`: no readable ApproximateNumberOfMessages"),
            )
        })?;
        Ok(QueueDepth::new(ready, count(&names[1]), count(&names[2])))
    }

    /// Deletes the work queue and its failure queue (`DeleteQueue`). SQS
    /// itself waits 60 s before a queue of a deleted queue's name can be
    /// created again (the emulator does not).
    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        self.inner.life.check_running()?;
        let mut names = vec![queue.to_string()];
        names.extend(self.failure_queue_name(queue));
        self.delete_names(&names).await
    }
}

/// A claimed failure entry: its message received and kept hidden, the hold
/// renewed every [`RENEW_EVERY`] until it is removed, released or dropped.
struct SqsClaim {
    driver: SqsDriver,
    queue: String,
    url: Arc<str>,
    receipt: String,
    entry: StoredFailure,
    /// `true` once renewal must stop. The renewal task holds the lock while
    /// its request is in flight, so what takes it after runs after.
    stop: Arc<tokio::sync::Mutex<bool>>,
    renewal: tokio::task::AbortHandle,
    /// Removed or released: nothing to do on drop.
    ended: bool,
}

impl SqsClaim {
    fn start(driver: SqsDriver, fq: &FailureQueue, held: Held) -> Self {
        let stop = Arc::new(tokio::sync::Mutex::new(false));
        let renewal = tokio::spawn(renew(
            driver.clone(),
            fq.name.clone(),
            fq.url.clone(),
            held.receipt.clone(),
            stop.clone(),
        ))
        .abort_handle();
        SqsClaim {
            driver,
            queue: fq.name.clone(),
            url: fq.url.clone(),
            receipt: held.receipt,
            entry: held.entry,
            stop,
            renewal,
            ended: false,
        }
    }

    async fn stop_renewal(&mut self) {
        *self.stop.lock().await = true;
        self.renewal.abort();
    }
}

/// Extends a claim's hold to [`HOLD`] every [`RENEW_EVERY`] until told to
/// stop; gives up (the hold lapses) when SQS refuses.
async fn renew(
    driver: SqsDriver,
    queue: String,
    url: Arc<str>,
    receipt: String,
    stop: Arc<tokio::sync::Mutex<bool>>,
) {
    loop {
        tokio::time::sleep(RENEW_EVERY).await;
        let stopped = stop.lock().await;
        if *stopped {
            return;
        }
        if let Err(e) = change_visibility(&driver, &url, &receipt, HOLD.as_secs()).await {
            warn!(queue = %queue, "a claimed failure entry's hold could not be renewed (another claim may take it once it lapses): {e}");
            return;
        }
    }
}

#[async_trait]
impl ClaimedFailure for SqsClaim {
    fn entry(&self) -> &StoredFailure {
        &self.entry
    }

    /// `DeleteMessage` with the claim's receipt. On an error the claim is
    /// released (best effort) when dropped.
    async fn remove(mut self: Box<Self>) -> Result<(), DriverError> {
        self.stop_renewal().await;
        let what = format!("DeleteMessage from `{}`", self.queue);
        delete_message(&self.driver, &self.url, &self.receipt, &what).await?;
        self.ended = true;
        Ok(())
    }

    /// `ChangeMessageVisibility` 0: visible again at once. If that fails,
    /// the entry comes back when its hold lapses.
    async fn release(mut self: Box<Self>) -> Result<(), DriverError> {
        self.stop_renewal().await;
        self.ended = true;
        change_visibility(&self.driver, &self.url, &self.receipt, 0).await
    }
}

impl Drop for SqsClaim {
    /// Neither removed nor released: made visible again now, best effort
    /// (failing that, when its hold lapses).
    fn drop(&mut self) {
        self.renewal.abort();
        if self.ended {
            return;
        }
        release_soon(
            &self.driver,
            &self.url,
            std::mem::take(&mut self.receipt),
            &self.stop,
            "a dropped claim on a failure entry (it returns when its hold lapses)",
        );
    }
}
