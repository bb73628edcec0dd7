//! Failure-store scenarios: what an operator does with terminal failures
//! through [`Failures`] (list, show, replay, purge), on every backend whose
//! driver keeps a failure store ([`Driver::failure_store`]).
//!
//! Records are made the way users make them: jobs that fail for good on a
//! real consumer, poison messages (a body that is not an envelope, a
//! payload that does not decode for its job), and, where the backend offers
//! it ([`Backend::inject_failure_body`]), an entry that is not a record at
//! all. What each scenario checks is what the operator sees afterwards: the
//! entries listed, the deliveries the worker made, the records left.
//!
//! [`Driver::failure_store`]: jobrail_native::Driver::failure_store

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jobrail::{
    replay_id, Envelope, EventKind, FailureKind, Job, JobContext, JobError, RawBody, Registry,
    REPLAYED_AT_MS, REPLAY_OF, REPLAY_OF_MESSAGE,
};
use jobrail_native::{
    ConsumerHandle, DispatchOptions, DriverError, ErrorKind, FailurePage, Failures, Page, Purge,
    Replayed, StoredFailure,
};

use crate::harness::{Backend, Harness};
use crate::scenarios::Work;

const MS: fn(u64) -> Duration = Duration::from_millis;

/// Metadata every subject's dispatch carries, to check a replay keeps it.
const TENANT: (&str, &str) = ("tenant", "acme");

/// One execution of a [`Subject`]'s handler.
#[derive(Debug, Clone)]
struct Run {
    id: u32,
    message_id: String,
    attempt: u32,
    metadata: BTreeMap<String, String>,
}

/// A job with a bug that can be fixed, and the worker running it for the
/// whole scenario (as in production, where the operator replays while the
/// workers run): its handler fails while `broken` is set (permanently when
/// the job allows one delivery, as an ordinary error otherwise) and records
/// every execution.
struct Subject {
    h: Harness,
    job: Job<Work>,
    broken: Arc<AtomicBool>,
    /// The handler's error is permanent (the job allows one delivery).
    permanent: bool,
    runs: Arc<Mutex<Vec<Run>>>,
    failures: Failures,
    consumer: Option<ConsumerHandle>,
}

impl Subject {
    /// A subject on a fresh queue whose job allows `deliveries` deliveries,
    /// its worker running `concurrency` handlers at most.
    async fn new(backend: &dyn Backend, name: &str, deliveries: u32, concurrency: usize) -> Self {
        let h = Harness::new(backend, name).await;
        let job = h
            .job(name)
            .max_deliveries(deliveries)
            .backoff(MS(20), 1.0, MS(20))
            .build()
            .unwrap();
        let mut subject = Subject {
            failures: Failures::new(h.driver.clone()),
            h,
            job,
            broken: Arc::new(AtomicBool::new(true)),
            permanent: deliveries == 1,
            runs: Arc::default(),
            consumer: None,
        };
        subject.consumer = Some(subject.h.start(subject.registry(), concurrency));
        subject
    }

    /// Stops the worker.
    async fn stop(mut self) {
        if let Some(consumer) = self.consumer.take() {
            consumer.shutdown().await.unwrap();
        }
    }

    fn queue(&self) -> &str {
        &self.h.queue
    }

    /// The bug is fixed: from now on the handler succeeds.
    fn fix(&self) {
        self.broken.store(false, Ordering::SeqCst);
    }

    fn registry(&self) -> Registry {
        let (broken, runs) = (self.broken.clone(), self.runs.clone());
        let permanent = self.permanent;
        let mut registry = Registry::new();
        registry
            .register(&self.job, move |ctx: JobContext, work: Work| {
                let (broken, runs) = (broken.clone(), runs.clone());
                async move {
                    runs.lock().unwrap().push(Run {
                        id: work.id,
                        message_id: ctx.message_id().to_string(),
                        attempt: ctx.attempt(),
                        metadata: ctx.metadata().clone(),
                    });
                    // Executions are a few milliseconds apart, so records
                    // made one after another have distinct times.
                    tokio::time::sleep(MS(3)).await;
                    match broken.load(Ordering::SeqCst) {
                        false => Ok(()),
                        true if permanent => Err(JobError::permanent("the bug")),
                        true => Err(JobError::new("the bug")),
                    }
                }
            })
            .unwrap();
        registry
    }

    async fn dispatch(&self, id: u32) -> String {
        let options = DispatchOptions {
            metadata: BTreeMap::from([(TENANT.0.to_string(), TENANT.1.to_string())]),
            ..Default::default()
        };
        self.h
            .producer
            .dispatch(&self.job)
            .options(options)
            .send(&Work { id })
            .await
            .unwrap()
    }

    /// Dispatches `ids` while the bug is there and waits until each has
    /// failed for good; returns their message ids in the order they failed
    /// (when the worker runs one handler at a time).
    async fn fail(&self, ids: impl IntoIterator<Item = u32>) -> Vec<String> {
        assert!(
            self.broken.load(Ordering::SeqCst),
            "the bug is fixed: nothing fails"
        );
        let before = self.count("failed");
        let mut dispatched = Vec::new();
        for id in ids {
            dispatched.push(self.dispatch(id).await);
        }
        let n = dispatched.len();
        self.h
            .events
            .wait_count(self.h.patience * 3, "failed", before + n)
            .await;
        let failed: Vec<String> = self.message_ids("failed")[before..].to_vec();
        assert_eq!(
            failed.iter().collect::<BTreeSet<_>>(),
            dispatched.iter().collect::<BTreeSet<_>>()
        );
        // In the order of their last execution: one at a time, a few
        // milliseconds apart, that is the order of their records' times.
        let runs = self.runs();
        let last_run = |id: &String| runs.iter().rposition(|r| &r.message_id == id);
        let mut failed = failed;
        failed.sort_by_key(last_run);
        failed
    }

    fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    fn runs_of(&self, message_id: &str) -> Vec<Run> {
        self.runs()
            .into_iter()
            .filter(|r| r.message_id == message_id)
            .collect()
    }

    fn count(&self, event: &str) -> usize {
        self.h
            .events
            .names()
            .iter()
            .filter(|n| **n == event)
            .count()
    }

    fn message_ids(&self, event: &str) -> Vec<String> {
        self.h
            .events
            .all()
            .into_iter()
            .filter(|e| e.kind.name() == event)
            .map(|e| e.message_id)
            .collect()
    }

    /// Every entry of the subject's failure store, oldest first.
    async fn entries(&self) -> Vec<StoredFailure> {
        self.failures
            .all(self.queue())
            .await
            .unwrap_or_else(|e| panic!("listing the failures of `{}`: {e}", self.queue()))
    }

    /// The entry of message `message_id` (exactly one).
    async fn entry_of(&self, message_id: &str) -> StoredFailure {
        let entries: Vec<_> = self
            .entries()
            .await
            .into_iter()
            .filter(|e| record_message_id(e) == Some(message_id))
            .collect();
        assert_eq!(
            entries.len(),
            1,
            "one record of `{message_id}`: {entries:#?}"
        );
        entries.into_iter().next().unwrap()
    }

    async fn replay(&self, id: &str, force: bool) -> Result<Replayed, DriverError> {
        self.failures.replay(self.queue(), id, force).await
    }

    async fn purge(&self, which: Purge) -> u64 {
        self.failures
            .purge(self.queue(), &which)
            .await
            .unwrap_or_else(|e| panic!("purging {which:?} on `{}`: {e}", self.queue()))
    }

    /// Waits until `n` messages in all have succeeded.
    async fn wait_succeeded(&self, n: usize) -> Vec<jobrail::Event> {
        self.h
            .events
            .wait_count(self.h.patience * 2, "succeeded", n)
            .await
    }

    /// Long enough for a second copy of a message, or a redelivery, to
    /// arrive if there were one.
    async fn settle(&self) {
        tokio::time::sleep(self.h.driver.capabilities().redelivery_hint + MS(700)).await;
    }
}

fn record_message_id(entry: &StoredFailure) -> Option<&str> {
    entry.record.as_ref()?.message_id.as_deref()
}

fn ids(entries: &[StoredFailure]) -> Vec<&str> {
    entries.iter().map(|e| e.id.as_str()).collect()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Every page of `queue`'s entries at `limit` per page, walking the cursors.
pub async fn walk_pages(failures: &Failures, queue: &str, limit: usize) -> Vec<FailurePage> {
    let mut pages = Vec::new();
    let mut after = None;
    loop {
        let page = failures
            .list(queue, &Page { after, limit })
            .await
            .unwrap_or_else(|e| panic!("listing `{queue}` at {limit} per page: {e}"));
        after = page.next.clone();
        let last = after.is_none();
        pages.push(page);
        if last {
            return pages;
        }
        assert!(
            pages.len() <= 1000,
            "the cursors of `{queue}` do not come to an end"
        );
    }
}

/// Checks the pages of `expected` (oldest first) at `limit` per page: each
/// page full but the last, each reporting the total, together every entry
/// once in order.
pub fn check_pages(pages: &[FailurePage], expected: &[StoredFailure], limit: usize) {
    let total = expected.len();
    let want_pages = total.div_ceil(limit).max(1);
    assert_eq!(pages.len(), want_pages, "pages at {limit} per page");
    for (i, page) in pages.iter().enumerate() {
        assert_eq!(page.total, total, "page {i} at {limit} per page");
        let want = if i + 1 < want_pages {
            limit
        } else {
            total - limit * i
        };
        assert_eq!(page.entries.len(), want, "page {i} at {limit} per page");
        assert_eq!(page.next.is_some(), i + 1 < want_pages, "page {i}'s cursor");
    }
    let listed: Vec<StoredFailure> = pages.iter().flat_map(|p| p.entries.clone()).collect();
    assert_eq!(
        ids(&listed),
        ids(expected),
        "pages at {limit} per page, in order"
    );
}

/// Listing pages oldest first; page sizes and cursors cover every entry
/// once; listing again returns the same entries (nothing is consumed); a
/// cursor whose entry went meanwhile still continues where it was.
pub async fn failures_list_pages_oldest_first(backend: &dyn Backend) {
    const N: u32 = 7;
    let s = Subject::new(backend, "failures-list", 1, 1).await;
    let empty = s.failures.list(s.queue(), &Page::default()).await.unwrap();
    assert_eq!((empty.entries.len(), empty.next, empty.total), (0, None, 0));

    let failed = s.fail(0..N).await;
    let entries = s.entries().await;
    assert_eq!(
        entries
            .iter()
            .map(|e| record_message_id(e).unwrap())
            .collect::<Vec<_>>(),
        failed,
        "oldest first"
    );
    assert!(entries
        .windows(2)
        .all(|w| w[0].failed_at_ms() <= w[1].failed_at_ms()));
    assert_eq!(
        entries.iter().map(|e| &e.id).collect::<BTreeSet<_>>().len(),
        entries.len(),
        "entry ids are unique"
    );
    for entry in &entries {
        let record = entry.record.as_ref().expect("a failure record");
        assert_eq!(entry.id, record.id, "a record's entry id is its id");
        assert_eq!(record.kind, FailureKind::Permanent);
        assert!(entry.poison_reason().is_none(), "{entry:?}");
    }

    for limit in 1..=N as usize + 1 {
        let pages = walk_pages(&s.failures, s.queue(), limit).await;
        check_pages(&pages, &entries, limit);
        // Again: the same pages, nothing consumed by the first walk.
        assert_eq!(walk_pages(&s.failures, s.queue(), limit).await, pages);
    }
    // Limit 0 is the default page size, which holds them all.
    let page = s.failures.list(s.queue(), &Page::default()).await.unwrap();
    assert_eq!(ids(&page.entries), ids(&entries));
    assert_eq!(page.next, None);

    let err = s
        .failures
        .list(
            s.queue(),
            &Page {
                after: Some("not a cursor".into()),
                limit: 2,
            },
        )
        .await
        .expect_err("a made-up cursor was accepted");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");

    // The entry a cursor names is purged between two pages: the next page
    // still starts right after it.
    let first = s
        .failures
        .list(
            s.queue(),
            &Page {
                after: None,
                limit: 3,
            },
        )
        .await
        .unwrap();
    assert_eq!(ids(&first.entries), ids(&entries[..3]));
    assert_eq!(s.purge(Purge::One(entries[2].id.clone())).await, 1);
    let rest = s
        .failures
        .list(
            s.queue(),
            &Page {
                after: first.next,
                limit: 10,
            },
        )
        .await
        .unwrap();
    assert_eq!(ids(&rest.entries), ids(&entries[3..]));
    assert_eq!((rest.total, rest.next), (N as usize - 1, None));
    assert_eq!(s.entries().await.len(), N as usize - 1, "reading consumed");
    s.stop().await;
}

/// `show` finds an entry by its message id and by its entry id; an unknown
/// id finds nothing.
pub async fn failures_show_by_message_or_entry_id(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-show", 1, 1).await;
    let failed = s.fail([1, 2]).await;
    let entries = s.entries().await;
    assert_eq!(entries.len(), 2);
    for (message_id, entry) in failed.iter().zip(&entries) {
        let by_message = s.failures.show(s.queue(), message_id).await.unwrap();
        assert_eq!(by_message.as_ref(), Some(entry), "by message id");
        let by_entry = s.failures.show(s.queue(), &entry.id).await.unwrap();
        assert_eq!(by_entry.as_ref(), Some(entry), "by entry id");
        let record = entry.record.as_ref().unwrap();
        let envelope = record.envelope.as_ref().expect("the envelope is kept");
        assert_eq!(&envelope.id, message_id);
        assert_eq!(record.job.as_deref(), Some(s.job.name()));
        assert_eq!(record.queue, s.queue());
        assert!(record.reason.contains("the bug"), "{}", record.reason);
    }
    let work_ids: Vec<_> = entries
        .iter()
        .map(|e| {
            e.record
                .as_ref()
                .unwrap()
                .envelope
                .as_ref()
                .unwrap()
                .payload["id"]
                .clone()
        })
        .collect();
    assert_eq!(work_ids, [1, 2]);
    for unknown in ["no-such-record", "", &jobrail::new_message_id()] {
        assert_eq!(
            s.failures.show(s.queue(), unknown).await.unwrap(),
            None,
            "`{unknown}` names no entry"
        );
    }
    assert_eq!(s.entries().await, entries, "showing consumed");
    s.stop().await;
}

/// Replay sends the record's message back as a new delivery: it runs on a
/// worker at attempt 1, its metadata names the record, the original message
/// and the replay time, and the record is gone.
pub async fn failures_replay_runs_again_with_a_fresh_attempt_count(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-replay", 2, 2).await;
    let original = s.fail([7]).await.remove(0);
    let attempts: Vec<u32> = s.runs_of(&original).iter().map(|r| r.attempt).collect();
    assert_eq!(attempts, [1, 2], "the job used up its deliveries");
    let entry = s.entry_of(&original).await;
    assert_eq!(entry.record.as_ref().unwrap().attempt, 2);

    s.fix();
    let before = now_ms();
    let replayed = s.replay(&original, false).await.unwrap();
    let after = now_ms();
    assert_eq!(replayed.entry_id, entry.id);
    assert_eq!(replayed.queue, s.queue());
    assert_eq!(replayed.message_id, replay_id(&entry.id));
    assert!(s.entries().await.is_empty(), "the record is gone");
    assert_eq!(s.failures.show(s.queue(), &original).await.unwrap(), None);

    let events = s.wait_succeeded(1).await;
    s.settle().await;
    let success = events
        .iter()
        .find(|e| e.kind.name() == "succeeded")
        .unwrap();
    assert_eq!(success.message_id, replayed.message_id);
    assert_eq!(success.attempt, 1);
    let runs = s.runs_of(&replayed.message_id);
    assert_eq!(runs.len(), 1, "the replay ran once: {runs:?}");
    let run = &runs[0];
    assert_eq!((run.id, run.attempt), (7, 1), "a fresh attempt count");
    assert_eq!(run.metadata[REPLAY_OF], entry.id);
    assert_eq!(run.metadata[REPLAY_OF_MESSAGE], original);
    let at: u64 = run.metadata[REPLAYED_AT_MS].parse().unwrap();
    assert!(
        (before..=after).contains(&at),
        "replayed at {at}, between {before} and {after}"
    );
    assert_eq!(
        run.metadata.get(TENANT.0).map(String::as_str),
        Some(TENANT.1),
        "the message's own metadata is kept"
    );
    assert_eq!(s.count("succeeded"), 1);
    assert!(s.entries().await.is_empty());
    s.stop().await;
}

/// Bulk replay and purge (the dashboard's "replay the selection", "purge
/// every record matching"): of 24 records, 16 replayed in one call (an id no
/// longer there among them) run again once each and leave the store; a
/// second bulk replay of the same ids sends nothing more; the other 8 are
/// purged by id in one call.
pub async fn failures_bulk_replay_and_purge_by_ids(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-bulk", 1, 8).await;
    let failed = s.fail(0..24).await;
    assert_eq!(failed.len(), 24);
    let entries = s.entries().await;
    assert_eq!(entries.len(), 24);
    s.fix();
    let (chosen, rest) = entries.split_at(16);
    let mut ids: Vec<String> = chosen.iter().map(|e| e.id.clone()).collect();
    ids.push("no-such-record".into());
    let done = s
        .failures
        .replay_many(s.queue(), &ids, false)
        .await
        .unwrap();
    assert_eq!(done.replayed, 16, "{done:?}");
    assert_eq!(done.missing, 1, "{done:?}");
    assert!(
        done.refused.is_empty() && done.not_sent.is_empty() && done.not_removed.is_empty(),
        "{done:?}"
    );
    let left: BTreeSet<String> = s.entries().await.into_iter().map(|e| e.id).collect();
    let rest_ids: BTreeSet<String> = rest.iter().map(|e| e.id.clone()).collect();
    assert_eq!(left, rest_ids, "exactly the replayed records left");
    s.wait_succeeded(16).await;
    let again = s
        .failures
        .replay_many(s.queue(), &ids, false)
        .await
        .unwrap();
    assert_eq!((again.replayed, again.missing), (0, 17), "{again:?}");
    s.settle().await;
    for entry in chosen {
        let runs = s.runs_of(&replay_id(&entry.id));
        assert_eq!(
            runs.len(),
            1,
            "the replay of {} ran once: {runs:?}",
            entry.id
        );
        assert_eq!(runs[0].attempt, 1);
        assert_eq!(runs[0].metadata[REPLAY_OF], entry.id);
    }
    assert_eq!(s.count("succeeded"), 16);
    let rest_ids: Vec<String> = rest_ids.into_iter().collect();
    assert_eq!(s.failures.purge_ids(s.queue(), &rest_ids).await.unwrap(), 8);
    assert!(s.entries().await.is_empty());
    assert_eq!(s.failures.purge_ids(s.queue(), &rest_ids).await.unwrap(), 0);
    s.stop().await;
}

/// Replaying one record twice in a row: the second is not found, by either
/// id, and one copy is delivered.
pub async fn failures_replay_twice_sends_one_copy(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-replay-twice", 1, 2).await;
    let original = s.fail([3]).await.remove(0);
    let entry = s.entry_of(&original).await;
    s.fix();
    let replayed = s.replay(&entry.id, false).await.unwrap();
    for id in [&entry.id, &original] {
        let err = s
            .replay(id, false)
            .await
            .expect_err("a record was replayed twice");
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
        let err = s
            .replay(id, true)
            .await
            .expect_err("a record was replayed twice (forced)");
        assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    }
    s.wait_succeeded(1).await;
    s.settle().await;
    assert_eq!(s.runs_of(&replayed.message_id).len(), 1, "one copy");
    assert_eq!(s.count("succeeded"), 1);
    assert!(s.entries().await.is_empty());
    s.stop().await;
}

/// Eight operators replay one record at once, each on a connection of its
/// own: exactly one replay succeeds, the others find nothing, and one copy
/// is delivered.
pub async fn failures_concurrent_replays_send_one_copy(backend: &dyn Backend) {
    const OPERATORS: usize = 8;
    let s = Subject::new(backend, "failures-replay-race", 1, 4).await;
    let original = s.fail([5]).await.remove(0);
    let entry = s.entry_of(&original).await;
    s.fix();
    let start = Arc::new(tokio::sync::Barrier::new(OPERATORS));
    let mut tasks = Vec::new();
    for i in 0..OPERATORS {
        let failures = Failures::new(backend.connect().await);
        let (start, queue) = (start.clone(), s.queue().to_string());
        // Half by entry id, half by message id.
        let id = if i % 2 == 0 {
            entry.id.clone()
        } else {
            original.clone()
        };
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            failures.replay(&queue, &id, false).await
        }));
    }
    let mut replayed = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Ok(r) => replayed.push(r),
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotFound, "a losing replay: {e}"),
        }
    }
    assert_eq!(
        replayed.len(),
        1,
        "exactly one replay succeeds: {replayed:?}"
    );
    assert_eq!(replayed[0].entry_id, entry.id);
    assert!(s.entries().await.is_empty(), "the record is gone");

    s.wait_succeeded(1).await;
    s.settle().await;
    let runs = s.runs_of(&replayed[0].message_id);
    assert_eq!(runs.len(), 1, "one copy delivered: {runs:?}");
    assert_eq!(runs[0].attempt, 1);
    assert_eq!(s.count("succeeded"), 1);
    s.stop().await;
}

/// A replay while a worker consumes the queue and other work flows: the
/// replayed job runs once, every other message once.
pub async fn failures_replay_while_a_worker_consumes(backend: &dyn Backend) {
    const OTHERS: u32 = 20;
    let s = Subject::new(backend, "failures-replay-live", 1, 4).await;
    let original = s.fail([0]).await.remove(0);
    s.fix();
    let mut others = BTreeSet::new();
    let mut replayed = None;
    for id in 1..=OTHERS {
        others.insert(s.dispatch(id).await);
        if id == OTHERS / 2 {
            replayed = Some(s.replay(&original, false).await.unwrap());
        }
        tokio::time::sleep(MS(5)).await;
    }
    let replayed = replayed.unwrap();
    let events = s.wait_succeeded(OTHERS as usize + 1).await;
    s.settle().await;
    assert_eq!(s.count("succeeded"), OTHERS as usize + 1, "{events:#?}");
    let succeeded: BTreeSet<String> = s.message_ids("succeeded").into_iter().collect();
    others.insert(replayed.message_id.clone());
    assert_eq!(succeeded, others);
    let runs = s.runs_of(&replayed.message_id);
    assert_eq!(runs.len(), 1, "the replay ran once: {runs:?}");
    assert_eq!((runs[0].id, runs[0].attempt), (0, 1));
    // Each message ran once (the original once, when it failed).
    let mut per_message = BTreeMap::new();
    for run in s.runs() {
        *per_message.entry(run.message_id).or_insert(0) += 1;
    }
    assert!(per_message.values().all(|n| *n == 1), "{per_message:?}");
    assert_eq!(per_message.len(), OTHERS as usize + 2);
    assert!(s.entries().await.is_empty());
    s.stop().await;
}

/// The entries of poison messages (a body that is not an envelope, a
/// payload that does not decode for its job) are listed with a reason;
/// replay is refused as not accepted, naming it, and leaves the record; a
/// forced replay sends the stored body as it was, which fails as poison
/// again: a new record with the same body.
pub async fn failures_poison_replay_is_refused_unless_forced(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-poison", 3, 1).await;
    s.fix();
    let garbage = vec![0xff, b'{', b'n', b'o', 0x00];
    s.h.producer
        .send_raw(
            s.queue(),
            format!("raw-{}", jobrail::new_message_id()),
            garbage.clone(),
            None,
        )
        .await
        .unwrap();
    let undecodable = Envelope::new(s.job.name(), serde_json::json!({"id": "seven"}));
    s.h.producer
        .send_raw(
            s.queue(),
            undecodable.id.clone(),
            undecodable.encode(),
            None,
        )
        .await
        .unwrap();
    s.h.events.wait_count(s.h.patience, "failed", 2).await;

    let entries = s.entries().await;
    assert_eq!(entries.len(), 2, "{entries:#?}");
    let kind = |e: &StoredFailure| e.record.as_ref().map(|r| r.kind);
    let malformed = entries
        .iter()
        .find(|e| kind(e) == Some(FailureKind::MalformedEnvelope))
        .expect("a record of the malformed body");
    let poison = entries
        .iter()
        .find(|e| kind(e) == Some(FailureKind::UndecodablePayload))
        .expect("a record of the undecodable payload");
    assert_eq!(record_message_id(poison), Some(undecodable.id.as_str()));
    let raw = |e: &StoredFailure| {
        e.record
            .as_ref()
            .unwrap()
            .raw_body
            .as_ref()
            .unwrap()
            .to_bytes()
    };
    assert_eq!(raw(malformed), garbage);
    assert_eq!(raw(poison), undecodable.encode());

    for entry in &entries {
        let reason = entry.poison_reason().expect("a poison entry has a reason");
        for _ in 0..2 {
            // Refused, and refused again: the refusal left the entry there.
            let err = s
                .replay(&entry.id, false)
                .await
                .expect_err("a poison record was replayed without force");
            assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
            assert!(
                err.to_string().contains(&reason),
                "{err} (reason: {reason})"
            );
        }
    }
    assert_eq!(
        s.failures.show(s.queue(), &undecodable.id).await.unwrap(),
        Some(poison.clone())
    );
    assert_eq!(
        s.entries().await,
        entries,
        "refused replays changed the store"
    );
    tokio::time::sleep(MS(300)).await;
    assert_eq!(s.count("failed"), 2, "a refused replay sent something");

    for entry in &entries {
        let replayed = s.replay(&entry.id, true).await.unwrap();
        assert_eq!(replayed.entry_id, entry.id);
    }
    s.h.events.wait_count(s.h.patience, "failed", 4).await;
    s.settle().await;
    assert_eq!(s.count("failed"), 4, "each forced replay delivered once");
    assert!(s.runs().is_empty(), "the handler never ran");
    let again = s.entries().await;
    assert_eq!(again.len(), 2, "{again:#?}");
    assert!(
        again
            .iter()
            .all(|e| !entries.iter().any(|old| old.id == e.id)),
        "the replayed entries are gone"
    );
    let mut kinds: Vec<_> = again.iter().map(|e| kind(e).unwrap()).collect();
    kinds.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(
        kinds,
        [
            FailureKind::MalformedEnvelope,
            FailureKind::UndecodablePayload
        ]
    );
    for entry in &again {
        let want = match kind(entry).unwrap() {
            FailureKind::MalformedEnvelope => &garbage,
            _ => &raw(poison),
        };
        assert_eq!(&raw(entry), want, "the stored body was sent as it was");
        assert!(entry.poison_reason().is_some());
    }
    assert_eq!(s.purge(Purge::All).await, 2);
    assert!(s.entries().await.is_empty());
    s.stop().await;
}

/// An entry that is not a failure record (put there by something other
/// than a consumer) is listed with an id of its own and a reason; replay
/// is refused unless forced; forced, its body is sent as it is (not an
/// envelope, so it fails as malformed: a record); purging by its id
/// removes it; purging by time leaves it (it has no time).
pub async fn failures_entries_that_are_not_records(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-foreign", 1, 1).await;
    let failed = s.fail([1]).await;
    let bodies = [
        b"an operator's note, not a record".to_vec(),
        br#"{"v": 1, "queue": "incomplete"}"#.to_vec(),
    ];
    for body in &bodies {
        backend
            .inject_failure_body(s.queue(), body.clone())
            .await
            .unwrap_or_else(|e| panic!("putting a body among the failures: {e}"));
    }
    let entries = s.entries().await;
    assert_eq!(entries.len(), 3, "{entries:#?}");
    // In the order injected (the store may keep them in any order).
    let foreign: Vec<&StoredFailure> = bodies
        .iter()
        .map(|body| {
            let found: Vec<_> = entries.iter().filter(|e| &e.body == body).collect();
            assert_eq!(found.len(), 1, "{entries:#?}");
            found[0]
        })
        .collect();
    for entry in &foreign {
        assert_eq!(entry.record, None, "{entry:?}");
        assert!(entry.poison_reason().is_some());
        let shown = s.failures.show(s.queue(), &entry.id).await.unwrap();
        assert_eq!(shown.as_ref(), Some(*entry));
        let err = s
            .replay(&entry.id, false)
            .await
            .expect_err("an entry that is not a record was replayed");
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    }
    assert_ne!(foreign[0].id, foreign[1].id);
    // By time: the record goes, the entries without a time stay.
    let cut = SystemTime::now() + Duration::from_secs(1);
    assert_eq!(s.purge(Purge::OlderThan(cut)).await, 1);
    let left: BTreeSet<String> = s.entries().await.into_iter().map(|e| e.id).collect();
    assert_eq!(
        left,
        BTreeSet::from([foreign[0].id.clone(), foreign[1].id.clone()])
    );
    assert_eq!(s.failures.show(s.queue(), &failed[0]).await.unwrap(), None);

    // Forced: the note is sent as it is and fails as a malformed message.
    s.fix();
    s.replay(&foreign[0].id, true).await.unwrap();
    s.h.events.wait_count(s.h.patience, "failed", 2).await;
    s.settle().await;
    assert_eq!(s.count("failed"), 2);
    let now = s.entries().await;
    assert_eq!(now.len(), 2, "{now:#?}");
    let record = now
        .iter()
        .find_map(|e| e.record.as_ref())
        .expect("the forced note failed as a record");
    assert_eq!(record.kind, FailureKind::MalformedEnvelope);
    assert_eq!(record.raw_body, Some(RawBody::from_bytes(&bodies[0])));
    assert!(now.iter().any(|e| e.id == foreign[1].id));

    assert_eq!(s.purge(Purge::One(foreign[1].id.clone())).await, 1);
    assert_eq!(s.purge(Purge::One(foreign[1].id.clone())).await, 0);
    assert_eq!(s.entries().await.len(), 1);
    s.stop().await;
}

/// Purge one (by message or entry id), older than a time (records before
/// it go, newer stay), all: each returns how many went, and nothing else is
/// touched (another queue's records, a message waiting in a queue).
pub async fn failures_purge_one_older_than_all(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-purge", 1, 1).await;
    let other = Subject::new(backend, "failures-purge-other", 1, 1).await;
    let kept = other.fail([100]).await;
    // A queue nobody consumes yet, with a message waiting.
    let idle = Harness::on(
        backend,
        s.h.driver.clone(),
        Harness::queue_name("failures-purge-idle"),
    );
    let idle_job = idle.job("failures-purge-idle").build().unwrap();
    idle.producer
        .dispatch(&idle_job)
        .send(&Work { id: 99 })
        .await
        .unwrap();

    let old = s.fail(0..3).await;
    tokio::time::sleep(MS(30)).await;
    let cut = SystemTime::now();
    tokio::time::sleep(MS(30)).await;
    let new = s.fail(3..5).await;
    let entries = s.entries().await;
    assert_eq!(entries.len(), 5);
    let cut_ms = cut.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    for entry in &entries {
        let is_old = old
            .iter()
            .any(|id| Some(id.as_str()) == record_message_id(entry));
        assert_eq!(entry.failed_at_ms() < cut_ms, is_old, "{entry:?}");
    }

    assert_eq!(s.purge(Purge::One("no-such-record".into())).await, 0);
    assert_eq!(
        s.purge(Purge::One(old[0].clone())).await,
        1,
        "by message id"
    );
    let second = s.entry_of(&old[1]).await;
    assert_eq!(
        s.purge(Purge::One(second.id.clone())).await,
        1,
        "by entry id"
    );
    assert_eq!(s.purge(Purge::One(second.id)).await, 0, "already gone");
    let left: Vec<_> = s
        .entries()
        .await
        .iter()
        .map(|e| record_message_id(e).unwrap().to_string())
        .collect();
    assert_eq!(left, [old[2].clone(), new[0].clone(), new[1].clone()]);

    assert_eq!(s.purge(Purge::OlderThan(cut)).await, 1);
    let left: Vec<_> = s
        .entries()
        .await
        .iter()
        .map(|e| record_message_id(e).unwrap().to_string())
        .collect();
    assert_eq!(left, new, "the newer records stay");
    assert_eq!(s.purge(Purge::OlderThan(cut)).await, 0);

    assert_eq!(s.purge(Purge::All).await, 2);
    assert!(s.entries().await.is_empty());
    assert_eq!(s.purge(Purge::All).await, 0);

    // Nothing else was touched.
    let others: Vec<_> = other.entries().await;
    assert_eq!(others.len(), 1);
    assert_eq!(record_message_id(&others[0]), Some(kept[0].as_str()));
    if let Some(admin) = s.h.driver.admin() {
        let depth = admin.depth(&idle.queue).await.unwrap();
        assert_eq!(depth.ready, 1, "the waiting message: {depth:?}");
    }
    assert_eq!(idle.consume_ids(&idle_job, 1).await, [99]);
    s.stop().await;
    other.stop().await;
}

fn last_event<'a>(events: &'a [jobrail::Event], name: &str) -> &'a jobrail::Event {
    events
        .iter()
        .rev()
        .find(|e| e.kind.name() == name)
        .unwrap_or_else(|| panic!("no `{name}` event in {events:#?}"))
}

/// A replayed message that fails again uses up a fresh set of deliveries
/// and ends as a new record whose envelope still names the replay; that
/// record replays in turn once the bug is fixed.
pub async fn failures_replayed_message_that_fails_again(backend: &dyn Backend) {
    let s = Subject::new(backend, "failures-replay-fails", 2, 1).await;
    let original = s.fail([4]).await.remove(0);
    let first = s.entry_of(&original).await;

    // Still broken: the replay fails again, after two deliveries.
    let replayed = s.replay(&original, false).await.unwrap();
    let events = s.h.events.wait_count(s.h.patience, "failed", 2).await;
    let failed = last_event(&events, "failed");
    assert_eq!(failed.message_id, replayed.message_id);
    assert!(
        matches!(&failed.kind, EventKind::Failed { failure } if failure.kind == FailureKind::AttemptsExhausted),
        "{failed:?}"
    );
    let attempts: Vec<u32> = s
        .runs_of(&replayed.message_id)
        .iter()
        .map(|r| r.attempt)
        .collect();
    assert_eq!(attempts, [1, 2], "a fresh set of deliveries");

    let entries = s.entries().await;
    assert_eq!(entries.len(), 1, "{entries:#?}");
    let second = &entries[0];
    assert_ne!(second.id, first.id);
    let record = second.record.as_ref().unwrap();
    assert_eq!(
        record.message_id.as_deref(),
        Some(replayed.message_id.as_str())
    );
    assert_eq!(
        (record.kind, record.attempt),
        (FailureKind::AttemptsExhausted, 2)
    );
    let metadata = &record.envelope.as_ref().unwrap().metadata;
    assert_eq!(metadata[REPLAY_OF], first.id);
    assert_eq!(metadata[REPLAY_OF_MESSAGE], original);
    assert!(
        metadata[REPLAYED_AT_MS].parse::<u64>().is_ok(),
        "{metadata:?}"
    );
    assert_eq!(metadata[TENANT.0], TENANT.1);

    // Fixed: the new record replays like any other.
    s.fix();
    let again = s.replay(&second.id, false).await.unwrap();
    assert_ne!(again.message_id, replayed.message_id);
    s.wait_succeeded(1).await;
    s.settle().await;
    let runs = s.runs_of(&again.message_id);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].attempt, 1);
    assert_eq!(runs[0].metadata[REPLAY_OF], second.id);
    assert!(s.entries().await.is_empty());
    s.stop().await;
}
