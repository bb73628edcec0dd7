//! The backends a dashboard shows ([`Source`]) and the one view of a
//! failure entry the pages use, whatever keeps it.

use std::collections::BTreeSet;
use std::sync::Arc;

use jobrail::{ClaimStore, FailureKind, FailureRecord, JobSpec, Registry, Schedule, Stats};
use jobrail_native::{Driver, Failures, QueueDepth, StoredFailure};

use crate::edge::EdgeKeeper;

/// A backend to show: the driver of native workers, or an edge worker's
/// failure keeper.
#[derive(Clone)]
pub struct Source {
    pub(crate) name: String,
    pub(crate) kind: Kind,
    pub(crate) queues: Vec<String>,
    pub(crate) jobs: Vec<JobSpec>,
    pub(crate) stats: Option<Arc<Stats>>,
    pub(crate) schedules: Vec<Schedule>,
    pub(crate) claims: Option<Arc<dyn ClaimStore>>,
}

#[derive(Clone)]
pub(crate) enum Kind {
    Native {
        driver: Arc<dyn Driver>,
        failures: Failures,
    },
    Edge(Arc<EdgeKeeper>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("name", &self.name)
            .field("backend", &self.backend())
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl Source {
    /// Native workers' backend: `driver` is a driver of the same backend
    /// and settings the workers use (its failure store and queue depths
    /// are read; replays are sent through it). Name its queues with
    /// [`queue`](Self::queue) or [`registry`](Self::registry).
    pub fn native(name: impl Into<String>, driver: Arc<dyn Driver>) -> Self {
        Source {
            name: name.into(),
            kind: Kind::Native {
                failures: Failures::new(driver.clone()),
                driver,
            },
            queues: Vec::new(),
            jobs: Vec::new(),
            stats: None,
            schedules: Vec::new(),
            claims: None,
        }
    }

    /// A Cloudflare worker's failure keeper (`jobrail_edge::failures`): its
    /// routes at `url` (the worker's address; the keeper's routes under
    /// `/failures`), with the bearer token its `FAILURES_TOKEN` secret
    /// holds. Its records are listed, replayed and purged through those
    /// routes; Cloudflare Queues report no depths to a worker, so the
    /// overview shows the records only.
    pub fn edge(name: impl Into<String>, url: impl Into<String>, token: impl Into<String>) -> Self {
        Source {
            name: name.into(),
            kind: Kind::Edge(Arc::new(EdgeKeeper::new(url.into(), token.into()))),
            queues: Vec::new(),
            jobs: Vec::new(),
            stats: None,
            schedules: Vec::new(),
            claims: None,
        }
    }

    /// A queue to show (repeatable).
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        if !self.queues.contains(&queue) {
            self.queues.push(queue);
        }
        self
    }

    /// The application's jobs: their policies and failure budgets (the
    /// jobs page), their queues, and the counters of their settlements and
    /// tier resolutions (the overview's rates, the jobs page), read live
    /// from the registry's [`Stats`] when the dashboard runs in the
    /// worker's process.
    pub fn registry(mut self, registry: &Registry) -> Self {
        for spec in registry.specs() {
            if !self.queues.contains(&spec.queue) {
                self.queues.push(spec.queue.clone());
            }
            self.jobs.push(spec.clone());
        }
        self.stats = Some(registry.stats().clone());
        self
    }

    /// Job declarations without their counters (a dashboard outside the
    /// workers' process: policies and budgets, no resolutions).
    pub fn jobs(mut self, jobs: impl IntoIterator<Item = JobSpec>) -> Self {
        for spec in jobs {
            if !self.queues.contains(&spec.queue) {
                self.queues.push(spec.queue.clone());
            }
            self.jobs.push(spec);
        }
        self
    }

    /// The schedules the workers run, and the claim store their schedulers
    /// share (whether each of the latest ticks fired is read from it).
    pub fn schedules(
        mut self,
        schedules: impl IntoIterator<Item = Schedule>,
        claims: Option<Arc<dyn ClaimStore>>,
    ) -> Self {
        self.schedules.extend(schedules);
        self.claims = claims;
        self
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The backend's name: the driver's (`rabbitmq`...), or `cloudflare`.
    pub fn backend(&self) -> &str {
        match &self.kind {
            Kind::Native { driver, .. } => driver.name(),
            Kind::Edge(_) => "cloudflare",
        }
    }

    /// The redelivery timing counted in failure budgets of jobs without a
    /// backoff.
    pub(crate) fn redelivery_hint(&self) -> std::time::Duration {
        match &self.kind {
            Kind::Native { driver, .. } => driver.capabilities().redelivery_hint,
            Kind::Edge(_) => std::time::Duration::ZERO,
        }
    }

    /// The queues to show: those named, and at the edge those the keeper's
    /// records name.
    pub(crate) async fn all_queues(&self) -> Result<Vec<String>, String> {
        let mut queues: Vec<String> = self.queues.clone();
        if let Kind::Edge(keeper) = &self.kind {
            let seen: BTreeSet<String> = keeper
                .entries()
                .await?
                .into_iter()
                .map(|e| e.queue)
                .filter(|q| !q.is_empty())
                .collect();
            for q in seen {
                if !queues.contains(&q) {
                    queues.push(q);
                }
            }
        }
        Ok(queues)
    }

    /// The queue's depth: `Ok(None)` where the backend reports none.
    pub(crate) async fn depth(&self, queue: &str) -> Result<Option<QueueDepth>, String> {
        match &self.kind {
            Kind::Native { driver, .. } => match driver.admin() {
                Some(admin) => admin
                    .depth(queue)
                    .await
                    .map(Some)
                    .map_err(|e| e.to_string()),
                None => Ok(None),
            },
            Kind::Edge(_) => Ok(None),
        }
    }

    /// Every failure entry of `queue`.
    pub(crate) async fn entries(&self, queue: &str) -> Result<Vec<Entry>, String> {
        match &self.kind {
            Kind::Native { failures, .. } => Ok(failures
                .all(queue)
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|e| Entry::native(queue, e))
                .collect()),
            Kind::Edge(keeper) => Ok(keeper
                .entries()
                .await?
                .into_iter()
                .filter(|e| e.queue == queue || (e.queue.is_empty() && queue.is_empty()))
                .collect()),
        }
    }

    /// Replays the entries `ids` of `queue`.
    pub(crate) async fn replay(
        &self,
        queue: &str,
        ids: &[String],
        force: bool,
    ) -> Result<Mutated, String> {
        match &self.kind {
            Kind::Native { failures, .. } => {
                let done = failures
                    .replay_many(queue, ids, force)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(mutated(&done))
            }
            Kind::Edge(keeper) => keeper.replay(ids, force).await,
        }
    }

    /// Replays every entry of the filter's queue that it matches, in one
    /// pass where the store can; `None` where the source replays by ids
    /// only (the edge).
    pub(crate) async fn replay_matching(
        &self,
        filter: &crate::pages::Filter,
        force: bool,
    ) -> Option<Result<(Mutated, usize), String>> {
        let Kind::Native { failures, .. } = &self.kind else {
            return None;
        };
        let now = crate::html::now_ms();
        let queue = filter.queue.clone();
        let select =
            move |e: &StoredFailure| filter.matches(&Entry::native(&queue, e.clone()), now);
        Some(
            failures
                .replay_where(&filter.queue, &select, force)
                .await
                .map(|done| (mutated(&done), done.matched))
                .map_err(|e| e.to_string()),
        )
    }

    /// Purges the entries `ids` of `queue`.
    pub(crate) async fn purge(&self, queue: &str, ids: &[String]) -> Result<Mutated, String> {
        match &self.kind {
            Kind::Native { failures, .. } => {
                let n = failures
                    .purge_ids(queue, ids)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Mutated {
                    done: n,
                    ..Mutated::default()
                })
            }
            Kind::Edge(keeper) => keeper.purge(ids).await,
        }
    }
}

fn mutated(done: &jobrail_native::BulkReplay) -> Mutated {
    Mutated {
        done: done.replayed,
        refused: done.refused.len() as u64,
        failed: (done.not_sent.len() + done.not_removed.len()) as u64,
        first_problem: done
            .refused
            .first()
            .or(done.not_sent.first())
            .map(|(id, why)| format!("{id}: {why}"))
            .or_else(|| {
                done.not_removed.first().map(|id| {
                    format!("{id}: sent, but its record stayed (a duplicate if replayed again)")
                })
            }),
    }
}

/// What a replay or purge did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Mutated {
    pub(crate) done: u64,
    /// Poison entries left (replay without force).
    pub(crate) refused: u64,
    /// Entries whose send or removal failed.
    pub(crate) failed: u64,
    pub(crate) first_problem: Option<String>,
}

/// One failure entry, as the pages show it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) id: String,
    pub(crate) queue: String,
    pub(crate) message_id: Option<String>,
    pub(crate) job: Option<String>,
    pub(crate) kind: Option<FailureKind>,
    pub(crate) reason: String,
    pub(crate) attempt: u32,
    pub(crate) executions: u32,
    pub(crate) failed_at_ms: u64,
    pub(crate) poison: Option<String>,
    pub(crate) record: Option<FailureRecord>,
    /// The stored body as text, for an entry that is not a record.
    pub(crate) body_text: Option<String>,
}

impl Entry {
    fn native(queue: &str, stored: StoredFailure) -> Entry {
        let poison = stored.poison_reason();
        match stored.record {
            Some(r) => Entry {
                id: stored.id,
                queue: if r.queue.is_empty() {
                    queue.to_string()
                } else {
                    r.queue.clone()
                },
                message_id: r.message_id.clone(),
                job: r.job.clone(),
                kind: Some(r.kind),
                reason: r.reason.clone(),
                attempt: r.attempt,
                executions: r.executions,
                failed_at_ms: r.failed_at_ms,
                poison,
                record: Some(r),
                body_text: None,
            },
            None => Entry {
                id: stored.id,
                queue: queue.to_string(),
                message_id: None,
                job: None,
                kind: None,
                reason: "not a failure record".into(),
                attempt: 0,
                executions: 0,
                failed_at_ms: 0,
                poison,
                record: None,
                body_text: Some(String::from_utf8_lossy(&stored.body).into_owned()),
            },
        }
    }
}

/// A failure kind's name, as records spell it (`attempts_exhausted`...).
pub(crate) fn kind_name(kind: &FailureKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{kind:?}"))
}

/// Every failure kind, for the filter.
pub(crate) const KINDS: [FailureKind; 6] = [
    FailureKind::Permanent,
    FailureKind::AttemptsExhausted,
    FailureKind::UndecodablePayload,
    FailureKind::MalformedEnvelope,
    FailureKind::UnknownName,
    FailureKind::InvalidPayload,
];
