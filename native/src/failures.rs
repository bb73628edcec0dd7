//! Failure stores: where a backend keeps terminal failure records, and the
//! operator's view of them ([`Failures`]: list, show, replay, purge).
//!
//! A driver implements [`FailureStore`], three primitives over its failure
//! destination (`Q.failed`, a failure stream, `Q-failed`...): read every
//! entry without removing it, claim one entry so no other operator can take
//! it, remove entries. The rules of replay and purge live once, in
//! [`Failures`], on top of those primitives.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use jobrail::FailureRecord;
use std::sync::Arc;

use crate::driver::{Driver, DriverError, ErrorKind, Outgoing};

/// One entry of a failure destination: a failure record, or a message
/// there that is not one.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StoredFailure {
    /// The entry's id, stable across reads: the record's
    /// [`id`](FailureRecord::id), or for an entry without one (not a
    /// record, or a record written before records had ids) a hash of its
    /// body. [`Failures::show`], `replay` and `purge` take it, or a message
    /// id.
    pub id: String,
    /// The record, when the entry is one.
    pub record: Option<FailureRecord>,
    /// The entry's body as stored.
    pub body: Vec<u8>,
}

impl StoredFailure {
    /// The entry stored as `body`: decoded when it is a failure record.
    pub fn from_body(body: Vec<u8>) -> Self {
        let record = FailureRecord::decode(&body).ok();
        let id = jobrail::failure_entry_id(&body, record.as_ref());
        StoredFailure { id, record, body }
    }

    /// When it failed, in milliseconds since the Unix epoch (0 when the
    /// entry is not a record).
    pub fn failed_at_ms(&self) -> u64 {
        self.record.as_ref().map_or(0, |r| r.failed_at_ms)
    }

    /// Whether `id` names this entry: its id or its record's message id.
    pub fn matches(&self, id: &str) -> bool {
        self.id == id
            || self
                .record
                .as_ref()
                .and_then(|r| r.message_id.as_deref())
                .is_some_and(|m| m == id)
    }

    /// Why replaying it would not run the job again, if it would not: the
    /// entry is not a record, the message never decoded, or its payload
    /// did not decode for its job. `None`: replayable.
    pub fn poison_reason(&self) -> Option<String> {
        jobrail::poison_reason(self.record.as_ref())
    }
}

/// An entry claimed by one operator: no other claim gets it until this one
/// is removed or released. Dropping it without either releases it (at once
/// or once the backend's hold expires).
#[async_trait]
pub trait ClaimedFailure: Send {
    /// The claimed entry.
    fn entry(&self) -> &StoredFailure;
    /// Removes the entry for good.
    async fn remove(self: Box<Self>) -> Result<(), DriverError>;
    /// Gives the entry back, unchanged.
    async fn release(self: Box<Self>) -> Result<(), DriverError>;
}

/// A backend's failure destination, per work queue: part of the driver
/// contract ([`Driver::failure_store`]).
#[async_trait]
pub trait FailureStore: Send + Sync {
    /// Every entry of `queue`'s failure destination, in the order stored,
    /// without removing or hiding any for longer than the read.
    /// [`ErrorKind::Config`] when the queue has no failure destination.
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError>;

    /// Claims the oldest entry of `queue` that [`matches`](StoredFailure::matches)
    /// `id`. `None`: there is none, or another claim holds it.
    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError>;

    /// Removes the entries of `queue` whose ids are in `ids` (ids read by
    /// [`read_failures`](Self::read_failures)); returns how many went.
    /// Entries another claim holds are left, and ids no longer there are
    /// not an error.
    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError>;

    /// Takes every entry of `queue` at once and holds them all (no other
    /// operator's claim gets one) until [`HeldFailures::finish`] says which
    /// to remove; dropped without it, they are given back. Bulk replays use
    /// it to read, send and remove in one pass. `None` (the default): the
    /// store cannot, and bulk replays read, send, then remove.
    async fn hold_all(&self, queue: &str) -> Result<Option<Box<dyn HeldFailures>>, DriverError> {
        let _ = queue;
        Ok(None)
    }
}

/// Every entry of a failure destination, held by one operator
/// ([`FailureStore::hold_all`]).
#[async_trait]
pub trait HeldFailures: Send {
    /// The entries held, in the order stored.
    fn entries(&self) -> &[StoredFailure];
    /// Removes the entries whose ids are in `remove` and gives the others
    /// back; returns how many went.
    async fn finish(self: Box<Self>, remove: &[String]) -> Result<u64, DriverError>;
}

/// How many messages a queue holds, as far as the backend reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct QueueDepth {
    /// Ready for delivery now.
    pub ready: u64,
    /// Delivered and not yet settled, where the backend reports it.
    pub in_flight: Option<u64>,
    /// Waiting out a delay, where the backend reports it.
    pub delayed: Option<u64>,
}

impl QueueDepth {
    /// A depth.
    pub fn new(ready: u64, in_flight: Option<u64>, delayed: Option<u64>) -> Self {
        QueueDepth {
            ready,
            in_flight,
            delayed,
        }
    }
}

/// Operations on a backend's queues for operators and tests, next to the
/// failure store ([`Driver::admin`]).
#[async_trait]
pub trait Admin: Send + Sync {
    /// How many messages `queue` holds.
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError>;
    /// Deletes `queue` and everything the driver declared for it (hold
    /// queues, failure destination), with their messages. A queue that does
    /// not exist is not an error.
    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError>;
}

/// Which entries to purge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purge {
    /// The oldest entry matching this id (entry or message id).
    One(String),
    /// Every entry.
    All,
    /// Records that failed before this time (entries that are not records
    /// have no time and stay).
    OlderThan(SystemTime),
}

/// Where a page of [`Failures::list`] starts and how long it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// Start after this cursor (a previous page's [`FailurePage::next`]);
    /// `None`: from the oldest.
    pub after: Option<String>,
    /// At most this many entries (0: the default, 50).
    pub limit: usize,
}

/// A page of entries, oldest first.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct FailurePage {
    /// The entries.
    pub entries: Vec<StoredFailure>,
    /// The cursor of the next page, when there are more entries.
    pub next: Option<String>,
    /// Entries in the store in all.
    pub total: usize,
}

/// What [`Failures::replay`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Replayed {
    /// The entry replayed (now removed).
    pub entry_id: String,
    /// The message id of the new delivery.
    pub message_id: String,
    /// The queue it went to.
    pub queue: String,
}

/// What [`Failures::replay_many`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BulkReplay {
    /// Entries sent again and removed.
    pub replayed: u64,
    /// Poison entries left where they were, with the reason (not forced).
    pub refused: Vec<(String, String)>,
    /// Entries whose send failed or may have failed, with the error: they
    /// stay, and a later replay sends them (perhaps a second time).
    pub not_sent: Vec<(String, String)>,
    /// Entries selected (by id or by the predicate), replayed or not.
    pub matched: usize,
    /// Ids asked for that were no longer there.
    pub missing: usize,
    /// Entries whose message was sent but that could not be removed after
    /// it (the destination kept showing them): a later replay of them sends
    /// a duplicate.
    pub not_removed: Vec<String>,
}

/// How many times [`Failures::replay_many`] removes what it sent and reads
/// the destination again before reporting what stayed.
const REMOVAL_ROUNDS: u32 = 6;

/// The operator's view of a backend's failure records: list, show, replay
/// and purge, the same on every backend.
///
/// Replay re-dispatches the record's envelope to its queue as a new message
/// (so its attempt count starts again) with metadata [`REPLAY_OF`](jobrail::REPLAY_OF) (the
/// entry id), [`REPLAY_OF_MESSAGE`](jobrail::REPLAY_OF_MESSAGE) (the original message id) and
/// [`REPLAYED_AT_MS`](jobrail::REPLAYED_AT_MS), then removes the record: in that order, so a crash
/// between the two leaves a duplicate, never a loss. The entry is claimed
/// first, so concurrent replays of one record send it once; the new
/// message's id is derived from the entry id, so a backend that
/// deduplicates by message id (NATS) drops a second copy too.
///
/// # Example
///
/// A handler that fails permanently leaves a record; the operator lists it,
/// replays it (a new message, its attempts counted afresh) and purges what
/// is left. The `jobrail failed` commands do the same from a shell.
///
/// ```
/// use std::sync::Arc;
/// use jobrail::{Job, JobContext, JobError, Registry};
/// use jobrail_native::{Consumer, Failures, MemoryDriver, Page, Producer, Purge};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let job = Job::<u32>::builder("invoice").max_deliveries(3).build()?;
/// let mut registry = Registry::new();
/// registry.register(&job, |_ctx: JobContext, n: u32| async move {
///     Err(JobError::permanent(format!("invoice {n} has no customer")))
/// })?;
/// let driver = Arc::new(MemoryDriver::default());
/// Producer::new(driver.clone()).dispatch(&job).send(&42).await?;
/// let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
/// while driver.failure_records("default").is_empty() {
///     tokio::task::yield_now().await;
/// }
/// consumer.shutdown().await?;
///
/// let failures = Failures::new(driver.clone());
/// let page = failures.list("default", &Page::default()).await?;
/// assert_eq!(page.total, 1);
/// let record = page.entries[0].record.as_ref().unwrap();
/// assert_eq!(record.job.as_deref(), Some("invoice"));
///
/// let replayed = failures.replay("default", &page.entries[0].id, false).await?;
/// assert_eq!(replayed.queue, "default");
/// assert_eq!(driver.depth("default"), 1);
/// assert_eq!(failures.purge("default", &Purge::All).await?, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Failures {
    driver: Arc<dyn Driver>,
}

impl Failures {
    /// The failure records of `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Failures { driver }
    }

    fn store(&self) -> Result<&dyn FailureStore, DriverError> {
        self.driver.failure_store().ok_or_else(|| {
            DriverError::new(
                self.driver.name(),
                ErrorKind::Unsupported,
                format!("the {} driver keeps no failure store", self.driver.name()),
            )
        })
    }

    /// Every entry of `queue`'s failure destination, oldest first.
    pub async fn all(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        let mut entries = self.store()?.read_failures(queue).await?;
        // Entries of one time by id: a total order, so that a page cursor
        // places an entry that went meanwhile among them.
        entries.sort_by(|a, b| (a.failed_at_ms(), &a.id).cmp(&(b.failed_at_ms(), &b.id)));
        Ok(entries)
    }

    /// One page of `queue`'s entries, oldest first, without consuming them.
    pub async fn list(&self, queue: &str, page: &Page) -> Result<FailurePage, DriverError> {
        let entries = self.all(queue).await?;
        let total = entries.len();
        let limit = if page.limit == 0 { 50 } else { page.limit };
        let start = match &page.after {
            None => 0,
            Some(cursor) => {
                let (at, id) = parse_cursor(cursor).ok_or_else(|| {
                    DriverError::new(
                        self.driver.name(),
                        ErrorKind::Config,
                        format!("`{cursor}` is not a page cursor"),
                    )
                })?;
                // After the cursor's entry; where that entry went, after
                // every entry before it in (time, id) order.
                match entries.iter().position(|e| e.id == id) {
                    Some(i) => i + 1,
                    None => {
                        entries.partition_point(|e| (e.failed_at_ms(), e.id.as_str()) <= (at, id))
                    }
                }
            }
        };
        let page_entries: Vec<_> = entries.iter().skip(start).take(limit).cloned().collect();
        let next = (start + page_entries.len() < total)
            .then(|| page_entries.last().map(cursor_of))
            .flatten();
        Ok(FailurePage {
            entries: page_entries,
            next,
            total,
        })
    }

    /// The oldest entry matching `id` (entry id or message id).
    pub async fn show(&self, queue: &str, id: &str) -> Result<Option<StoredFailure>, DriverError> {
        Ok(self.all(queue).await?.into_iter().find(|e| e.matches(id)))
    }

    /// Replays the entry `id` (entry id or message id) to `queue`. Refused
    /// ([`ErrorKind::NotAccepted`]) for poison entries unless `force`, in
    /// which case the stored body is sent as it is; not found
    /// ([`ErrorKind::NotFound`]) when no entry matches or another replay
    /// holds it.
    pub async fn replay(
        &self,
        queue: &str,
        id: &str,
        force: bool,
    ) -> Result<Replayed, DriverError> {
        let name = self.driver.name();
        let Some(claim) = self.store()?.claim_failure(queue, id).await? else {
            return Err(DriverError::new(
                name,
                ErrorKind::NotFound,
                format!("no failure record `{id}` on queue `{queue}` (or another replay holds it)"),
            ));
        };
        let entry = claim.entry().clone();
        let replay = match jobrail::replay_message(
            &entry.id,
            entry.record.as_ref(),
            &entry.body,
            force,
            now_ms(),
        ) {
            Ok(replay) => replay,
            Err(refused) => {
                claim.release().await?;
                return Err(DriverError::new(name, ErrorKind::NotAccepted, refused));
            }
        };
        let (message_id, body) = (replay.message_id, replay.body);
        let sent = match self.driver.capabilities().refuse_oversize(name, body.len()) {
            Ok(()) => {
                self.driver
                    .send(
                        queue,
                        Outgoing {
                            id: message_id.clone(),
                            body,
                            delay: None,
                        },
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            if e.kind() == ErrorKind::NotAccepted {
                // Certainly not sent: the record goes back as it was.
                claim.release().await?;
            }
            // Might have been sent: the claim lapses on its own, and a
            // second replay may duplicate, never lose.
            return Err(e);
        }
        claim.remove().await?;
        Ok(Replayed {
            entry_id: entry.id,
            message_id,
            queue: queue.to_string(),
        })
    }

    /// Replays every entry of `queue` whose id is in `ids` (ids read by
    /// [`all`](Self::all) or [`list`](Self::list)), as [`replay`](Self::replay)
    /// replays one: the same message, metadata and new message id. For a
    /// selection of thousands (an operator's "replay everything matching"):
    /// one read of the failure destination, the messages sent in batches
    /// ([`Driver::send_batch`]), then one removal of those sent.
    ///
    /// Nothing is lost: an entry is removed only after its message was
    /// accepted; a send that may have gone out leaves the entry (a second
    /// replay may duplicate it). Unlike [`replay`](Self::replay), the
    /// entries are not claimed one by one: a replay of the same entry by
    /// another operator at the same moment may send it twice (on NATS, the
    /// new message id makes the second copy a duplicate the stream drops).
    /// Poison entries are left and counted in [`BulkReplay::refused`]
    /// unless `force`. The messages are sent first, in batches of 500;
    /// then the entries sent are removed, and the destination read again
    /// until none is left (a few rounds; what stays is reported in
    /// [`BulkReplay::not_removed`]).
    pub async fn replay_many(
        &self,
        queue: &str,
        ids: &[String],
        force: bool,
    ) -> Result<BulkReplay, DriverError> {
        let wanted: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        let mut outcome = self
            .replay_where(
                queue,
                &|e: &StoredFailure| wanted.contains(e.id.as_str()),
                force,
            )
            .await?;
        outcome.missing = wanted.len().saturating_sub(outcome.matched);
        Ok(outcome)
    }

    /// Replays every entry of `queue` that `select` picks, as
    /// [`replay_many`](Self::replay_many) replays those it names: "replay
    /// every record matching this filter" in one read of the destination.
    pub async fn replay_where(
        &self,
        queue: &str,
        select: &(dyn Fn(&StoredFailure) -> bool + Send + Sync),
        force: bool,
    ) -> Result<BulkReplay, DriverError> {
        let store = self.store()?;
        let held = store.hold_all(queue).await?;
        let read;
        let entries: &[StoredFailure] = match &held {
            Some(held) => held.entries(),
            None => {
                read = store.read_failures(queue).await?;
                &read
            }
        };
        let mut outcome = BulkReplay::default();
        let mut seen = std::collections::HashSet::new();
        let mut batch: Vec<(String, Outgoing)> = Vec::new();
        let name = self.driver.name();
        let capabilities = self.driver.capabilities();
        let now = now_ms();
        for entry in entries.iter().filter(|e| select(e)) {
            if !seen.insert(entry.id.clone()) {
                continue;
            }
            match jobrail::replay_message(&entry.id, entry.record.as_ref(), &entry.body, force, now)
            {
                Ok(replay) => {
                    if let Err(e) = capabilities.refuse_oversize(name, replay.body.len()) {
                        outcome.not_sent.push((entry.id.clone(), e.to_string()));
                        continue;
                    }
                    batch.push((
                        entry.id.clone(),
                        Outgoing {
                            id: replay.message_id,
                            body: replay.body,
                            delay: None,
                        },
                    ));
                }
                Err(refused) => outcome
                    .refused
                    .push((entry.id.clone(), refused.to_string())),
            }
        }
        outcome.matched = seen.len();
        const CHUNK: usize = 500;
        let mut sent = Vec::with_capacity(batch.len());
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(CHUNK));
            let (chunk_ids, messages): (Vec<String>, Vec<Outgoing>) =
                std::mem::replace(&mut batch, rest).into_iter().unzip();
            let results = self.driver.send_batch(queue, messages).await;
            for (id, result) in chunk_ids.into_iter().zip(results) {
                match result {
                    Ok(()) => sent.push(id),
                    Err(e) => outcome.not_sent.push((id, e.to_string())),
                }
            }
        }
        // The records sent are removed, then the destination is read again
        // until none of them is left: a removal only takes what the broker
        // shows it, and RabbitMQ's quorum queues (3.10) give back a few
        // messages whose `basic.get` deliveries were acked just before the
        // channel closed.
        match held {
            // Held all along: the entries sent go, the others come back.
            Some(held) => held.finish(&sent).await.map(drop)?,
            None if sent.is_empty() => {}
            None => store.remove_failures(queue, &sent).await.map(drop)?,
        }
        let still_there = |left: std::collections::HashSet<String>| async move {
            Ok::<_, DriverError>(
                store
                    .read_failures(queue)
                    .await?
                    .into_iter()
                    .map(|e| e.id)
                    .filter(|id| left.contains(id))
                    .collect::<std::collections::HashSet<String>>(),
            )
        };
        let mut left = match sent.is_empty() {
            true => std::collections::HashSet::new(),
            false => still_there(sent.iter().cloned().collect()).await?,
        };
        for round in 1..REMOVAL_ROUNDS {
            if left.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50 << round.min(4))).await;
            let ids: Vec<String> = left.iter().cloned().collect();
            store.remove_failures(queue, &ids).await?;
            left = still_there(left).await?;
        }
        outcome.replayed = (sent.len() - left.len()) as u64;
        outcome.not_removed = left.into_iter().collect();
        outcome.not_removed.sort();
        Ok(outcome)
    }

    /// Removes the entries of `queue` whose ids are in `ids`; returns how
    /// many went (entries another operator's replay holds stay).
    pub async fn purge_ids(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.store()?.remove_failures(queue, ids).await
    }

    /// Removes the entries `which` selects; returns how many went.
    pub async fn purge(&self, queue: &str, which: &Purge) -> Result<u64, DriverError> {
        let store = self.store()?;
        let keep: Box<dyn Fn(&StoredFailure) -> bool + Send + Sync> = match which {
            Purge::All => Box::new(|_| true),
            Purge::OlderThan(time) => {
                let before = time
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or(Duration::ZERO)
                    .as_millis() as u64;
                Box::new(move |e| e.record.as_ref().is_some_and(|r| r.failed_at_ms < before))
            }
            Purge::One(id) => {
                return match store.claim_failure(queue, id).await? {
                    Some(claim) => claim.remove().await.map(|()| 1),
                    None => Ok(0),
                };
            }
        };
        let ids: Vec<String> = store
            .read_failures(queue)
            .await?
            .into_iter()
            .filter(|e| keep(e))
            .map(|e| e.id)
            .collect();
        if ids.is_empty() {
            return Ok(0);
        }
        store.remove_failures(queue, &ids).await
    }
}
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn cursor_of(entry: &StoredFailure) -> String {
    format!("{}:{}", entry.failed_at_ms(), entry.id)
}

fn parse_cursor(cursor: &str) -> Option<(u64, &str)> {
    let (at, id) = cursor.split_once(':')?;
    Some((at.parse().ok()?, id))
}
