//! Schedules on servers: every worker may run a [`Scheduler`]; each tick
//! is dispatched once across all of them ([`jobrail::ScheduleFiring`]),
//! and [`OverlapGuard`] keeps a tick's job from starting while the
//! previous one runs ([`jobrail::Overlap::Skip`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{
    CancelToken, ClaimStore, Instant, Overlap, Runtime, Schedule, ScheduleError, ScheduleFiring,
    SchedulesConfig, Settlement, SystemTime, TickDispatch, TickOutcome, SCHEDULE_METADATA,
};
use tracing::{debug, error, info, warn};

use crate::driver::{Delivery, DriverError, ErrorKind};
use crate::producer::Producer;
use crate::runtime::TokioRuntime;

/// How often a scheduler wakes at most, whatever its schedules say: 1 s
/// ([`SchedulerBuilder::poll`]).
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// The lease of `schedule:<name>:running` while a tick's job runs under
/// [`Overlap::Skip`]: 60 s, renewed every 20 s while the handler runs, so a
/// worker that dies mid-job blocks the schedule's next ticks for at most
/// this long.
pub const RUNNING_LEASE: Duration = Duration::from_secs(60);

/// Where a scheduler reads the wall clock.
#[derive(Clone)]
enum WallClock {
    System,
    /// `epoch` at the runtime's instant `start`, moving with the runtime.
    Runtime {
        epoch: SystemTime,
        start: Instant,
    },
}

/// Builder for a [`Scheduler`] ([`Scheduler::builder`]).
pub struct SchedulerBuilder {
    producer: Producer,
    claims: Arc<dyn ClaimStore>,
    schedules: Vec<Schedule>,
    config: Option<SchedulesConfig>,
    poll: Duration,
    runtime: Arc<dyn Runtime>,
    epoch: Option<SystemTime>,
    sink: Option<Arc<dyn TickSink>>,
}

impl std::fmt::Debug for SchedulerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerBuilder")
            .field("schedules", &self.schedules)
            .field("poll", &self.poll)
            .finish()
    }
}

impl SchedulerBuilder {
    /// Adds a schedule.
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedules.push(schedule);
        self
    }

    /// Adds schedules.
    pub fn schedules(mut self, schedules: impl IntoIterator<Item = Schedule>) -> Self {
        self.schedules.extend(schedules);
        self
    }

    /// Applies a configuration file's `[schedules.<name>]` tables when
    /// built ([`SchedulesConfig::apply`]): they override the schedules of
    /// the same name and declare the others.
    pub fn config(mut self, config: SchedulesConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Reads the `[schedules]` tables of the file `JOBRAIL_CONFIG` names,
    /// if it is set (the file of the job overrides).
    pub fn config_from_env(self) -> Result<Self, ScheduleError> {
        match std::env::var_os("JOBRAIL_CONFIG") {
            None => Ok(self),
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    ScheduleError::Policy(format!("cannot read {}: {e}", path.to_string_lossy()))
                })?;
                Ok(self.config(SchedulesConfig::from_toml(&text)?))
            }
        }
    }

    /// The longest sleep between two passes ([`DEFAULT_POLL`]; at least
    /// 10 ms). A scheduler also wakes at each schedule's next tick and when
    /// a tick held by another scheduler ends its lease. It is the grace of
    /// [`jobrail::Missed::Skip`] after a restart too.
    pub fn poll(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(10));
        self
    }

    /// Replaces the clock and sleep (tests). The wall clock follows it from
    /// the [`epoch`](SchedulerBuilder::epoch) if one is set.
    pub fn runtime(mut self, runtime: Arc<dyn Runtime>) -> Self {
        self.runtime = runtime;
        self
    }

    /// Reads the wall clock as `epoch` plus the runtime's time since the
    /// scheduler started, instead of the system's (tests on virtual time).
    pub fn epoch(mut self, epoch: SystemTime) -> Self {
        self.epoch = Some(epoch);
        self
    }

    /// Sends each tick's job and records the tick fired in one step,
    /// through `sink`, instead of sending through the producer and then
    /// completing the claim. For a queue kept in the claim store's own
    /// database (`jobrail_postgres::PgTicks`: the job's row and the claim's
    /// completion commit in one transaction), this closes the window in
    /// which a scheduler killed after the send leaves the tick unrecorded,
    /// to be sent again by another when its lease ends: each tick's job is
    /// then sent exactly once.
    pub fn sink(mut self, sink: Arc<dyn TickSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Checks the schedules (the configuration applied, names unique).
    pub fn build(self) -> Result<Scheduler, ScheduleError> {
        let schedules = match &self.config {
            Some(config) => config.apply(self.schedules)?,
            None => self.schedules,
        };
        let mut seen = std::collections::BTreeSet::new();
        for s in &schedules {
            if !seen.insert(s.name().to_owned()) {
                return Err(ScheduleError::Policy(format!(
                    "schedule `{}` is declared twice",
                    s.name()
                )));
            }
        }
        let wall = match self.epoch {
            Some(epoch) => WallClock::Runtime {
                epoch,
                start: self.runtime.now(),
            },
            None => WallClock::System,
        };
        Ok(Scheduler {
            producer: self.producer,
            claims: self.claims,
            schedules,
            poll: self.poll,
            runtime: self.runtime,
            wall,
            sink: self.sink,
        })
    }
}

/// Fires schedules' ticks through a [`Producer`], each tick once across
/// every scheduler sharing the claim store.
///
/// Run one in every worker (no leader): each wakes at the next tick of any
/// of its schedules (at most [`poll`](SchedulerBuilder::poll) apart),
/// claims the tick's key `schedule:<name>:<tick>`, sends the job with the
/// metadata `jobrail-schedule` and `jobrail-tick`, and records the tick
/// fired. A scheduler that dies holding a tick's claim leaves it to the
/// others once the tick lease ends ([`jobrail::Schedule::lease`], 30 s by
/// default): the tick is sent at most lease + poll late.
///
/// ```
/// use std::sync::Arc;
/// use jobrail::{Job, MemoryClaims, Schedule};
/// use jobrail_native::{MemoryDriver, Producer, Scheduler};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let job = Job::<()>::builder("purge-sessions").build()?;
/// let driver = Arc::new(MemoryDriver::default());
/// let scheduler = Scheduler::builder(Producer::new(driver.clone()), Arc::new(MemoryClaims::new()))
///     .schedule(Schedule::builder("purge", &job, "*/15 * * * *").build()?)
///     .build()?;
/// let guard = scheduler.overlap_guard(); // for the consumer (`ConsumerBuilder::overlap_guard`)
/// let running = scheduler.spawn();
/// running.shutdown().await;
/// # drop(guard);
/// # Ok(())
/// # }
/// ```
pub struct Scheduler {
    producer: Producer,
    claims: Arc<dyn ClaimStore>,
    schedules: Vec<Schedule>,
    poll: Duration,
    runtime: Arc<dyn Runtime>,
    wall: WallClock,
    sink: Option<Arc<dyn TickSink>>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("schedules", &self.schedules)
            .field("poll", &self.poll)
            .finish()
    }
}

/// A running [`Scheduler`] ([`Scheduler::spawn`]).
#[derive(Debug)]
pub struct SchedulerHandle {
    cancel: CancelToken,
    task: tokio::task::JoinHandle<()>,
}

impl SchedulerHandle {
    /// Stops after the pass in progress (its claims are completed or
    /// released) and waits for it.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }

    /// Stops at once, as a crash would: a tick claimed and not yet
    /// recorded is left to the other schedulers when its lease ends.
    pub fn abort(self) {
        self.task.abort();
    }
}

impl Scheduler {
    /// A scheduler sending through `producer`, claiming ticks on `claims`
    /// (shared by every worker: Postgres, Redis or D1 across processes,
    /// [`jobrail::MemoryClaims`] within one).
    pub fn builder(producer: Producer, claims: Arc<dyn ClaimStore>) -> SchedulerBuilder {
        SchedulerBuilder {
            producer,
            claims,
            schedules: Vec::new(),
            config: None,
            poll: DEFAULT_POLL,
            runtime: Arc::new(TokioRuntime),
            epoch: None,
            sink: None,
        }
    }

    /// The schedules, configuration applied.
    pub fn schedules(&self) -> &[Schedule] {
        &self.schedules
    }

    /// The guard a consumer runs deliveries through so that
    /// [`Overlap::Skip`] schedules never run two ticks' jobs at once.
    pub fn overlap_guard(&self) -> OverlapGuard {
        OverlapGuard::new(self.claims.clone(), self.schedules.iter().cloned())
    }

    fn now(&self) -> SystemTime {
        match &self.wall {
            WallClock::System => SystemTime::now(),
            WallClock::Runtime { epoch, start } => {
                *epoch + self.runtime.now().saturating_duration_since(*start)
            }
        }
    }

    /// Runs in a background task until [`SchedulerHandle::shutdown`].
    pub fn spawn(self) -> SchedulerHandle {
        let cancel = CancelToken::new();
        let token = cancel.clone();
        let task = tokio::spawn(async move { self.run(token).await });
        SchedulerHandle { cancel, task }
    }

    /// Runs until `cancel` is cancelled.
    pub async fn run(self, cancel: CancelToken) {
        let started = self.now();
        let mut firings: Vec<ScheduleFiring> = self
            .schedules
            .iter()
            .map(|s| ScheduleFiring::new(s.clone(), started).grace(self.poll))
            .collect();
        for s in &self.schedules {
            info!(
                schedule = s.name(),
                job = s.job(),
                cron = s.cron(),
                time_zone = s.time_zone(),
                missed = %s.missed(),
                overlap = %s.overlap(),
                enabled = s.enabled(),
                next = ?s.next_after(started).map(|t| t.rfc3339()),
                "schedule"
            );
        }
        let producer = &self.producer;
        let recording = self.sink.as_ref().map(|sink| Recording {
            claims: self.claims.clone(),
            sink: sink.clone(),
            fences: Mutex::default(),
            recorded: Mutex::default(),
        });
        while !cancel.is_cancelled() {
            let now = self.now();
            let mut wake = now + self.poll;
            for firing in &mut firings {
                let certain = |e: &DriverError| e.kind() != ErrorKind::Uncertain;
                let report = match &recording {
                    None => {
                        firing
                            .fire_due(
                                &*self.claims,
                                now,
                                |d: TickDispatch| send(producer, d),
                                certain,
                            )
                            .await
                    }
                    Some(recording) => {
                        let schedule = firing.schedule().clone();
                        firing
                            .fire_due(
                                recording,
                                now,
                                |d: TickDispatch| recording.send(&schedule, d),
                                certain,
                            )
                            .await
                    }
                };
                log_report(firing.schedule(), &report);
                if let Some(at) = report.next_wake {
                    wake = wake.min(at);
                }
            }
            let pause = wake
                .duration_since(self.now())
                .unwrap_or(Duration::ZERO)
                .max(Duration::from_millis(1));
            tokio::select! {
                _ = self.runtime.sleep(pause) => {}
                _ = cancel.cancelled() => break,
            }
        }
    }
}

/// Sends a tick's job and records the tick fired in one step, both or
/// neither ([`SchedulerBuilder::sink`]).
///
/// `jobrail_postgres::PgTicks` is one: the job's row and the completion of
/// the tick's claim in one Postgres transaction.
#[async_trait::async_trait]
pub trait TickSink: Send + Sync {
    /// Sends `dispatch`'s job and completes the claim `key` held under
    /// `fence`, atomically, answering the message id. An error of kind
    /// [`ErrorKind::Uncertain`] says either may have happened (the tick is
    /// then tried again when its lease ends, and finds it done if it was);
    /// any other, that neither did (a claim no longer held by `fence`
    /// included).
    async fn send_and_record(
        &self,
        dispatch: TickDispatch,
        key: &str,
        fence: u64,
    ) -> Result<String, DriverError>;
}

/// The claim store as a scheduler with a [`TickSink`] sees it: a tick's
/// claim is completed by the sink, with its send, so the completion that
/// follows the send only confirms it.
struct Recording {
    claims: Arc<dyn ClaimStore>,
    sink: Arc<dyn TickSink>,
    /// The fence of each tick claimed and not yet sent.
    fences: Mutex<BTreeMap<String, u64>>,
    /// The claims the sink completed, not yet confirmed.
    recorded: Mutex<std::collections::BTreeSet<(String, u64)>>,
}

impl Recording {
    async fn send(
        &self,
        schedule: &Schedule,
        dispatch: TickDispatch,
    ) -> Result<String, DriverError> {
        let key = schedule.tick_key(&dispatch.tick);
        let fence = key
            .as_ref()
            .and_then(|k| self.fences.lock().unwrap().remove(k));
        let (Some(key), Some(fence)) = (key, fence) else {
            return Err(DriverError::new(
                "scheduler",
                ErrorKind::NotAccepted,
                "a tick sent without its claim (a bug: nothing was sent)",
            ));
        };
        let sent = self.sink.send_and_record(dispatch, &key, fence).await?;
        self.recorded.lock().unwrap().insert((key, fence));
        Ok(sent)
    }
}

impl ClaimStore for Recording {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> jobrail::BoxFuture<'a, Result<jobrail::Claim, jobrail::ClaimError>> {
        Box::pin(async move {
            let claim = self.claims.claim(key, lease).await?;
            if let jobrail::Claim::Claimed { fence } = claim {
                self.fences.lock().unwrap().insert(key.to_owned(), fence);
            }
            Ok(claim)
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
    ) -> jobrail::BoxFuture<'a, Result<(), jobrail::ClaimError>> {
        Box::pin(async move {
            let confirmed = self
                .recorded
                .lock()
                .unwrap()
                .remove(&(key.to_owned(), fence));
            if confirmed {
                Ok(())
            } else {
                // A claim completed without a send (the schedule's marks).
                self.fences.lock().unwrap().remove(key);
                self.claims.complete(key, fence).await
            }
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
    ) -> jobrail::BoxFuture<'a, Result<(), jobrail::ClaimError>> {
        self.fences.lock().unwrap().remove(key);
        self.claims.release(key, fence)
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> jobrail::BoxFuture<'a, Result<(), jobrail::ClaimError>> {
        self.claims.extend(key, fence, lease)
    }

    fn state<'a>(
        &'a self,
        key: &'a str,
    ) -> jobrail::BoxFuture<'a, Result<jobrail::ClaimState, jobrail::ClaimError>> {
        self.claims.state(key)
    }
}

async fn send(producer: &Producer, dispatch: TickDispatch) -> Result<String, DriverError> {
    let envelope = dispatch.envelope();
    let id = envelope.id.clone();
    producer
        .send_raw(&dispatch.queue, id.clone(), envelope.encode(), None)
        .await?;
    Ok(id)
}

fn log_report(schedule: &Schedule, report: &jobrail::FireReport<String, DriverError>) {
    let name = schedule.name();
    if report.first_seen {
        info!(
            schedule = name,
            "first scheduler to see the schedule: ticks before now will never fire"
        );
    }
    if let Some(e) = &report.known_error {
        warn!(
            schedule = name,
            "cannot read whether the schedule was seen before (ticks before this worker started wait for it): {e}"
        );
    }
    if let Some(missed) = &report.missed {
        info!(
            schedule = name,
            latest = %missed.latest,
            selected = missed.selected,
            policy = %schedule.missed(),
            "missed ticks found (due while no scheduler ran)"
        );
    }
    for t in &report.ticks {
        let tick = t.tick.rfc3339();
        let counted = match &t.outcome {
            TickOutcome::Fired {
                taken_over: true, ..
            } => Some("taken_over"),
            TickOutcome::Fired { .. } => Some("fired"),
            TickOutcome::FiredUnrecorded { .. } => Some("fired_unrecorded"),
            TickOutcome::SkippedBeforeFirstSeen => Some("skipped_first_seen"),
            TickOutcome::SendFailed { .. } => Some("send_failed"),
            TickOutcome::Payload(_) => Some("payload_failed"),
            TickOutcome::Store(_) => Some("store_error"),
            TickOutcome::GivenUp => Some("given_up"),
            _ => None,
        };
        if let Some(outcome) = counted {
            count(name, outcome);
        }
        match &t.outcome {
            TickOutcome::Fired { sent, taken_over } => {
                if *taken_over {
                    info!(schedule = name, tick, message_id = %sent, "tick fired (taken over from an earlier claim)")
                } else {
                    info!(schedule = name, tick, message_id = %sent, "tick fired")
                }
            }
            TickOutcome::FiredUnrecorded { sent, error } => warn!(
                schedule = name,
                tick,
                message_id = %sent,
                "tick sent but not recorded as fired (another scheduler may send it again): {error}"
            ),
            TickOutcome::AlreadyFired => debug!(schedule = name, tick, "tick fired elsewhere"),
            TickOutcome::Held { remaining } => debug!(
                schedule = name,
                tick,
                ?remaining,
                "tick held by another scheduler; retrying when its lease ends"
            ),
            TickOutcome::SkippedBeforeFirstSeen => info!(
                schedule = name,
                tick, "tick skipped: due before the schedule was first seen"
            ),
            TickOutcome::SendFailed { error, released } => warn!(
                schedule = name,
                tick,
                released,
                kind = %error.kind(),
                "tick not sent: {error}"
            ),
            TickOutcome::Payload(e) => error!(schedule = name, tick, "tick not sent: {e}"),
            TickOutcome::Store(e) => warn!(schedule = name, tick, "claim store failed: {e}"),
            TickOutcome::GivenUp => error!(
                schedule = name,
                tick, "tick given up: it kept failing or stayed held too long"
            ),
            _ => debug!(schedule = name, tick, "tick: {:?}", t.outcome),
        }
    }
}

fn count(schedule: &str, outcome: &'static str) {
    metrics::counter!(
        crate::metrics::SCHEDULE_TICKS,
        "schedule" => schedule.to_owned(),
        "outcome" => outcome
    )
    .increment(1);
}

/// Keeps the jobs of an [`Overlap::Skip`] schedule from running two at
/// once: a consumer given one ([`ConsumerBuilder::overlap_guard`](crate::ConsumerBuilder::overlap_guard))
/// holds `schedule:<name>:running` while a tick's job runs, and settles a
/// delivery of that schedule as done, without running it, while another
/// holds it.
///
/// A delivery is recognised by its `jobrail-schedule` metadata. The claim
/// is taken for [`RUNNING_LEASE`], renewed while the handler runs and
/// released when it returns (whatever the outcome): a worker that dies
/// mid-job blocks the schedule for at most the lease. Other deliveries pass
/// through untouched.
#[derive(Clone)]
pub struct OverlapGuard {
    claims: Arc<dyn ClaimStore>,
    skip: Arc<BTreeMap<String, String>>,
}

impl std::fmt::Debug for OverlapGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OverlapGuard")
            .field("schedules", &self.skip.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The running claim of one delivery (see [`OverlapGuard`]).
pub struct Running {
    claims: Arc<dyn ClaimStore>,
    key: String,
    fence: u64,
    renew: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("key", &self.key)
            .field("fence", &self.fence)
            .finish()
    }
}

impl Running {
    /// Gives the claim back (the job's handler returned).
    pub async fn leave(self) {
        self.renew.abort();
        if let Err(e) = self.claims.release(&self.key, self.fence).await {
            debug!(key = %self.key, "overlap guard: release failed (the lease ends it): {e}");
        }
    }
}

impl OverlapGuard {
    /// A guard for the [`Overlap::Skip`] ones among `schedules`, on
    /// `claims` (the store the schedulers use).
    pub fn new(claims: Arc<dyn ClaimStore>, schedules: impl IntoIterator<Item = Schedule>) -> Self {
        let skip = schedules
            .into_iter()
            .filter(|s| s.overlap() == Overlap::Skip)
            .map(|s| (s.name().to_owned(), s.running_key()))
            .collect();
        OverlapGuard {
            claims,
            skip: Arc::new(skip),
        }
    }

    /// Decides for one delivery: `Some((delivery, running))` to run it
    /// (`running`: the claim to [`leave`](Running::leave) after the
    /// handler, for a guarded schedule), `None` when it was settled here
    /// (skipped for overlap, acknowledged).
    pub async fn enter(
        &self,
        delivery: Box<dyn Delivery>,
    ) -> Option<(Box<dyn Delivery>, Option<Running>)> {
        if self.skip.is_empty() {
            return Some((delivery, None));
        }
        let Some((schedule, tick)) = schedule_of(delivery.body()) else {
            return Some((delivery, None));
        };
        let Some(key) = self.skip.get(&schedule) else {
            return Some((delivery, None));
        };
        match self.claims.claim(key, RUNNING_LEASE).await {
            Ok(jobrail::Claim::Claimed { fence }) => {
                let (claims, renew_key) = (self.claims.clone(), key.clone());
                let renew = tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(RUNNING_LEASE / 3).await;
                        if let Err(e) = claims.extend(&renew_key, fence, RUNNING_LEASE).await {
                            warn!(key = %renew_key, "overlap guard: renewal failed: {e}");
                            if matches!(e, jobrail::ClaimError::Lost { .. }) {
                                break;
                            }
                        }
                    }
                });
                Some((
                    delivery,
                    Some(Running {
                        claims: self.claims.clone(),
                        key: key.clone(),
                        fence,
                        renew,
                    }),
                ))
            }
            Ok(jobrail::Claim::Held { remaining }) => {
                info!(
                    schedule,
                    tick,
                    ?remaining,
                    "tick skipped for overlap: the previous tick's job still runs"
                );
                count(&schedule, "overlap_skipped");
                if let Err(e) = delivery.settle(&Settlement::Ack).await {
                    warn!(schedule, tick, "overlap skip: acknowledgement failed: {e}");
                }
                None
            }
            // Never completed; a store that says so, or fails, lets the
            // job run (allowing an overlap rather than losing a tick).
            Ok(jobrail::Claim::Done) => Some((delivery, None)),
            Err(e) => {
                warn!(
                    schedule,
                    tick, "overlap guard: claim store failed, running anyway: {e}"
                );
                Some((delivery, None))
            }
        }
    }
}

/// The schedule and tick of a delivery's envelope, from its metadata.
fn schedule_of(body: &[u8]) -> Option<(String, String)> {
    #[derive(serde::Deserialize)]
    struct Meta {
        #[serde(default)]
        metadata: BTreeMap<String, String>,
    }
    let mut meta = serde_json::from_slice::<Meta>(body).ok()?.metadata;
    let schedule = meta.remove(SCHEDULE_METADATA)?;
    let tick = meta.remove(jobrail::TICK_METADATA).unwrap_or_default();
    Some((schedule, tick))
}
