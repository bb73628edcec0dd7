//! The declaration of a schedule ([`Schedule`], [`ScheduleBuilder`]), its
//! policies ([`Missed`], [`Overlap`]) and its ticks ([`Tick`]).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Datelike, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::model::envelope::Envelope;
use crate::model::job::Job;
use crate::model::runtime::{SystemTime, UNIX_EPOCH};
use crate::run::claim::{validate_claim, MAX_CLAIM_LEASE};

/// The metadata key naming the schedule that fired a job
/// (`jobrail-schedule`), read by handlers through `JobContext::metadata`
/// and by the overlap guard.
pub const SCHEDULE_METADATA: &str = "jobrail-schedule";

/// The metadata key carrying the tick a job was fired for (`jobrail-tick`):
/// the tick's time in RFC 3339, UTC, seconds precision
/// (`2026-03-29T01:00:00Z`), or [`MANUAL_TICK`] for a manual trigger.
pub const TICK_METADATA: &str = "jobrail-tick";

/// The metadata key carrying the time of a manual trigger
/// (`jobrail-triggered-at`, RFC 3339 UTC), set only when
/// [`TICK_METADATA`] is [`MANUAL_TICK`].
pub const TRIGGERED_AT_METADATA: &str = "jobrail-triggered-at";

/// The tick label of a manual trigger (`manual`).
pub const MANUAL_TICK: &str = "manual";

/// The lease a firer holds on a tick while it sends the tick's job: 30 s
/// ([`ScheduleBuilder::lease`]).
pub const DEFAULT_TICK_LEASE: Duration = Duration::from_secs(30);

/// The longest schedule name, in bytes: 128.
pub const MAX_SCHEDULE_NAME_BYTES: usize = 128;

/// The deepest [`Missed::Each`]: 1,000 ticks.
pub const MAX_MISSED_EACH: u32 = 1000;

/// What happens to ticks that came due while no scheduler ran.
///
/// A tick is *missed* when no running scheduler saw it come due (every
/// worker was down, or the schedule was just deployed over a stopped
/// fleet); ticks that came due while a scheduler watched are always fired,
/// whatever the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Missed {
    /// Missed ticks never fire: the schedule resumes with the next tick
    /// (Cloudflare Cron Triggers, graphile-worker without backfill).
    Skip,
    /// The most recent missed tick fires once, unless a tick came due since
    /// the scheduler started (the schedule has resumed by itself). The
    /// default: a daily report missed during an outage runs once when the
    /// workers return, and a frequent schedule does not fire a burst.
    #[default]
    Latest,
    /// Each of the last `n` missed ticks fires, oldest first (1 to
    /// [`MAX_MISSED_EACH`]): a backfill, for schedules whose every tick
    /// matters (billing periods).
    Each(u32),
}

impl fmt::Display for Missed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missed::Skip => f.write_str("skip"),
            Missed::Latest => f.write_str("latest"),
            Missed::Each(n) => write!(f, "each:{n}"),
        }
    }
}

impl FromStr for Missed {
    type Err = ScheduleError;

    /// `skip`, `latest` or `each:<n>`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let missed = match s.trim() {
            "skip" => Missed::Skip,
            "latest" => Missed::Latest,
            other => match other.strip_prefix("each:").or(other.strip_prefix("each ")) {
                Some(n) => Missed::Each(n.trim().parse().map_err(|_| {
                    ScheduleError::Policy(format!("`{s}`: the count of `each:<n>` is not a number"))
                })?),
                None => {
                    return Err(ScheduleError::Policy(format!(
                        "missed-tick policy `{s}`: expected `skip`, `latest` or `each:<n>`"
                    )))
                }
            },
        };
        check_missed(missed)?;
        Ok(missed)
    }
}

fn check_missed(missed: Missed) -> Result<(), ScheduleError> {
    match missed {
        Missed::Each(n) if n == 0 || n > MAX_MISSED_EACH => Err(ScheduleError::Policy(format!(
            "`each:{n}`: the count must be 1 to {MAX_MISSED_EACH}"
        ))),
        _ => Ok(()),
    }
}

/// What happens when a tick comes due while the job of the previous tick
/// still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlap {
    /// The new tick's job starts anyway (cron's behaviour, and Cloudflare
    /// Cron Triggers'). The default: it costs nothing, and most scheduled
    /// jobs are short or idempotent.
    #[default]
    Allow,
    /// The new tick's job is settled as done without running while the
    /// previous one runs (Temporal's `SKIP`). A consumer enforces it with a
    /// claim on `schedule:<name>:running` held while the handler runs
    /// ([`Schedule::running_key`]).
    Skip,
}

impl fmt::Display for Overlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
        })
    }
}

impl FromStr for Overlap {
    type Err = ScheduleError;

    /// `allow` or `skip`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "allow" => Ok(Overlap::Allow),
            "skip" => Ok(Overlap::Skip),
            _ => Err(ScheduleError::Policy(format!(
                "overlap policy `{s}`: expected `allow` or `skip`"
            ))),
        }
    }
}

/// Why a schedule could not be declared, or its payload made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The name is empty, too long or has a character other than ASCII
    /// letters, digits, `-`, `_` and `.` (it goes into claim keys,
    /// `schedule:<name>:<tick>`).
    #[error("schedule name `{name}`: {reason}")]
    Name {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The cron expression does not parse.
    #[error("schedule `{schedule}`: cron expression `{cron}`: {reason}")]
    Cron {
        /// The schedule.
        schedule: String,
        /// The expression given.
        cron: String,
        /// The parser's reason.
        reason: String,
    },
    /// The time zone is not an IANA name (`Europe/Paris`, `UTC`).
    #[error("schedule `{schedule}`: unknown time zone `{zone}` (expected an IANA name such as `Europe/Paris` or `UTC`)")]
    TimeZone {
        /// The schedule.
        schedule: String,
        /// The zone given.
        zone: String,
    },
    /// The payload does not serialize, or none was given for a job whose
    /// payload cannot be `null`.
    #[error("schedule `{schedule}`: payload: {reason}")]
    Payload {
        /// The schedule.
        schedule: String,
        /// What went wrong.
        reason: String,
    },
    /// A policy or lease out of range, or a configuration entry that is
    /// incomplete or malformed.
    #[error("schedule: {0}")]
    Policy(String),
}

/// One tick of a schedule: the instant it came due (whole seconds, UTC), or
/// a manual trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tick {
    unix: i64,
    manual: bool,
}

impl Tick {
    /// The scheduled tick at `time`, truncated to its second.
    pub fn at(time: SystemTime) -> Tick {
        Tick {
            unix: unix_seconds(time),
            manual: false,
        }
    }

    /// The scheduled tick `seconds` after the Unix epoch.
    pub fn from_unix_seconds(seconds: i64) -> Tick {
        Tick {
            unix: seconds,
            manual: false,
        }
    }

    /// A manual trigger at `now` (`jobrail schedules trigger`): its label
    /// is [`MANUAL_TICK`], and it has no claim key.
    pub fn manual(now: SystemTime) -> Tick {
        Tick {
            unix: unix_seconds(now),
            manual: true,
        }
    }

    /// Parses an RFC 3339 time in UTC, seconds precision
    /// (`2026-03-29T01:00:00Z`, as [`Tick::rfc3339`] writes it), or
    /// [`MANUAL_TICK`] (at the epoch).
    pub fn parse(text: &str) -> Option<Tick> {
        if text == MANUAL_TICK {
            return Some(Tick {
                unix: 0,
                manual: true,
            });
        }
        let b = text.as_bytes();
        if b.len() != 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
            return None;
        }
        if b[16] != b':' || b[19] != b'Z' {
            return None;
        }
        let num = |r: std::ops::Range<usize>| text.get(r)?.parse::<u32>().ok();
        let date = chrono::NaiveDate::from_ymd_opt(num(0..4)? as i32, num(5..7)?, num(8..10)?)?;
        let time = date.and_hms_opt(num(11..13)?, num(14..16)?, num(17..19)?)?;
        Some(Tick::from_unix_seconds(time.and_utc().timestamp()))
    }

    /// When the tick came due (for a manual trigger, when it was made).
    pub fn time(&self) -> SystemTime {
        if self.unix >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.unix as u64)
        } else {
            UNIX_EPOCH - Duration::from_secs(self.unix.unsigned_abs())
        }
    }

    /// Seconds since the Unix epoch.
    pub fn unix_seconds(&self) -> i64 {
        self.unix
    }

    /// Whether this is a manual trigger rather than a scheduled tick.
    pub fn is_manual(&self) -> bool {
        self.manual
    }

    /// The tick's time in RFC 3339, UTC, seconds precision:
    /// `2026-03-29T01:00:00Z`.
    pub fn rfc3339(&self) -> String {
        rfc3339(self.unix)
    }

    /// What the tick's job carries in [`TICK_METADATA`]: [`Tick::rfc3339`],
    /// or [`MANUAL_TICK`].
    pub fn label(&self) -> String {
        if self.manual {
            MANUAL_TICK.to_owned()
        } else {
            self.rfc3339()
        }
    }

    /// The tick as a `chrono` time in `zone` (for payload functions that
    /// name the local day, say).
    pub fn in_zone(&self, zone: Tz) -> DateTime<Tz> {
        zone.from_utc_datetime(&utc(self.unix).naive_utc())
    }
}

impl fmt::Display for Tick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

pub(super) fn utc(unix: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(unix, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn rfc3339(unix: i64) -> String {
    let t = utc(unix);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        t.month(),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// Whole seconds since the epoch, rounded down (before the epoch too).
pub(super) fn unix_seconds(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => {
            let d = e.duration();
            let whole = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            -(whole + i64::from(d.subsec_nanos() > 0))
        }
    }
}

type PayloadFn = Arc<dyn Fn(&Tick) -> Result<serde_json::Value, String> + Send + Sync>;

#[derive(Clone)]
enum PayloadSource {
    Value(serde_json::Value),
    Fn(PayloadFn),
}

/// A declared schedule: a job fired on the ticks of a cron expression in a
/// time zone, with a missed-tick and an overlap policy.
///
/// Cheap to clone. Built with [`Schedule::builder`] (for a typed [`Job`]) or
/// [`Schedule::raw`] (a job named by the configuration file); the rule that
/// fires it is [`ScheduleFiring`](crate::ScheduleFiring).
///
/// ```
/// use jobrail::{Job, Missed, Overlap, Schedule};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Digest { kind: String }
///
/// let job = Job::<Digest>::builder("send-digest").queue("mail").build()?;
/// let nightly = Schedule::builder("nightly-digest", &job, "0 30 2 * * *")
///     .time_zone("Europe/Paris")
///     .payload(Digest { kind: "daily".into() })
///     .missed(Missed::Latest)
///     .overlap(Overlap::Skip)
///     .build()?;
/// assert_eq!(nightly.job(), "send-digest");
/// assert_eq!(nightly.queue(), "mail");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Schedule {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    name: String,
    job: String,
    queue: String,
    cron_text: String,
    pub(super) cron: Cron,
    zone_name: String,
    pub(super) zone: Tz,
    missed: Missed,
    overlap: Overlap,
    lease: Duration,
    enabled: bool,
    job_timeout: Option<Duration>,
    payload: PayloadSource,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("name", &self.inner.name)
            .field("job", &self.inner.job)
            .field("queue", &self.inner.queue)
            .field("cron", &self.inner.cron_text)
            .field("time_zone", &self.inner.zone_name)
            .field("missed", &self.inner.missed)
            .field("overlap", &self.inner.overlap)
            .field("enabled", &self.inner.enabled)
            .finish()
    }
}

impl Schedule {
    /// Starts the declaration of schedule `name`, firing `job` on the ticks
    /// of `cron`: five fields (minute hour day-of-month month day-of-week),
    /// or six with seconds first, and an optional year last. The zone
    /// defaults to UTC, the payload to `null` (right for a job of `()`),
    /// the policies to [`Missed::Latest`] and [`Overlap::Allow`].
    pub fn builder<P>(
        name: impl Into<String>,
        job: &Job<P>,
        cron: impl Into<String>,
    ) -> ScheduleBuilder<P> {
        ScheduleBuilder {
            name: name.into(),
            job: job.name().to_owned(),
            queue: job.queue().to_owned(),
            cron: cron.into(),
            zone: "UTC".into(),
            missed: Missed::default(),
            overlap: Overlap::default(),
            lease: DEFAULT_TICK_LEASE,
            enabled: true,
            job_timeout: job.spec().timeout,
            payload: None,
            _payload: PhantomData,
        }
    }

    /// Starts the declaration of a schedule of a job known only by its name
    /// and queue (the configuration file's `[schedules.<name>]`); its
    /// payload is JSON.
    pub fn raw(
        name: impl Into<String>,
        job: impl Into<String>,
        queue: impl Into<String>,
        cron: impl Into<String>,
    ) -> ScheduleBuilder<serde_json::Value> {
        ScheduleBuilder {
            name: name.into(),
            job: job.into(),
            queue: queue.into(),
            cron: cron.into(),
            zone: "UTC".into(),
            missed: Missed::default(),
            overlap: Overlap::default(),
            lease: DEFAULT_TICK_LEASE,
            enabled: true,
            job_timeout: None,
            payload: None,
            _payload: PhantomData,
        }
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The name of the job it fires.
    pub fn job(&self) -> &str {
        &self.inner.job
    }

    /// The queue the job goes to.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }

    /// The cron expression, as given.
    pub fn cron(&self) -> &str {
        &self.inner.cron_text
    }

    /// The time zone's IANA name.
    pub fn time_zone(&self) -> &str {
        &self.inner.zone_name
    }

    /// The time zone.
    pub fn zone(&self) -> Tz {
        self.inner.zone
    }

    /// The missed-tick policy.
    pub fn missed(&self) -> Missed {
        self.inner.missed
    }

    /// The overlap policy.
    pub fn overlap(&self) -> Overlap {
        self.inner.overlap
    }

    /// The lease a firer holds on a tick while it sends the tick's job.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Whether schedulers fire it (a disabled schedule is listed, and can
    /// be triggered by hand).
    pub fn enabled(&self) -> bool {
        self.inner.enabled
    }

    /// The job's timeout, when the schedule was declared from a typed
    /// [`Job`] that has one (the overlap guard's lease follows it).
    pub fn job_timeout(&self) -> Option<Duration> {
        self.inner.job_timeout
    }

    /// The payload of `tick`'s job, as JSON.
    pub fn payload(&self, tick: &Tick) -> Result<serde_json::Value, ScheduleError> {
        match &self.inner.payload {
            PayloadSource::Value(v) => Ok(v.clone()),
            PayloadSource::Fn(f) => f(tick).map_err(|reason| ScheduleError::Payload {
                schedule: self.inner.name.clone(),
                reason,
            }),
        }
    }

    /// The claim key of `tick`: `schedule:<name>:<tick in RFC 3339 UTC>`
    /// (`schedule:nightly-digest:2026-03-29T00:30:00Z`). A manual tick
    /// has none (it is not claimed).
    pub fn tick_key(&self, tick: &Tick) -> Option<String> {
        (!tick.manual).then(|| tick_key(&self.inner.name, tick))
    }

    /// The key that records that some scheduler has seen the schedule
    /// (`schedule:<name>:known`): until it is done, no tick before the
    /// first scheduler started fires.
    pub fn known_key(&self) -> String {
        format!("schedule:{}:known", self.inner.name)
    }

    /// The key held while a tick's job runs under [`Overlap::Skip`]
    /// (`schedule:<name>:running`).
    pub fn running_key(&self) -> String {
        format!("schedule:{}:running", self.inner.name)
    }

    /// What to send for `tick`: the job, queue, payload and the metadata
    /// [`SCHEDULE_METADATA`] and [`TICK_METADATA`] (plus
    /// [`TRIGGERED_AT_METADATA`] for a manual tick).
    pub fn dispatch(&self, tick: &Tick) -> Result<TickDispatch, ScheduleError> {
        let payload = self.payload(tick)?;
        let mut metadata = BTreeMap::new();
        metadata.insert(SCHEDULE_METADATA.to_owned(), self.inner.name.clone());
        metadata.insert(TICK_METADATA.to_owned(), tick.label());
        if tick.manual {
            metadata.insert(TRIGGERED_AT_METADATA.to_owned(), tick.rfc3339());
        }
        Ok(TickDispatch {
            schedule: self.inner.name.clone(),
            job: self.inner.job.clone(),
            queue: self.inner.queue.clone(),
            tick: *tick,
            payload,
            metadata,
        })
    }

    /// This schedule with the fields an entry of the configuration file
    /// sets replaced (cron, zone, policies, payload, enabled, job, queue),
    /// checked as [`ScheduleBuilder::build`] checks them.
    pub fn with_entry(
        &self,
        entry: &crate::run::schedule::config::ScheduleEntry,
    ) -> Result<Schedule, ScheduleError> {
        let inner = &self.inner;
        let mut builder: ScheduleBuilder<serde_json::Value> = ScheduleBuilder {
            name: inner.name.clone(),
            job: entry.job.clone().unwrap_or_else(|| inner.job.clone()),
            queue: entry.queue.clone().unwrap_or_else(|| inner.queue.clone()),
            cron: entry
                .cron
                .clone()
                .unwrap_or_else(|| inner.cron_text.clone()),
            zone: entry
                .time_zone
                .clone()
                .unwrap_or_else(|| inner.zone_name.clone()),
            missed: entry.missed.unwrap_or(inner.missed),
            overlap: entry.overlap.unwrap_or(inner.overlap),
            lease: entry.lease.unwrap_or(inner.lease),
            enabled: entry.enabled.unwrap_or(inner.enabled),
            job_timeout: inner.job_timeout,
            payload: Some(Ok(inner.payload.clone())),
            _payload: PhantomData,
        };
        if let Some(payload) = &entry.payload {
            builder.payload = Some(Ok(PayloadSource::Value(payload.clone())));
        }
        builder.build()
    }

    pub(super) fn cron_pattern(&self) -> &Cron {
        &self.inner.cron
    }
}

pub(super) fn tick_key(name: &str, tick: &Tick) -> String {
    format!("schedule:{name}:{}", tick.rfc3339())
}

/// What to send for one tick ([`Schedule::dispatch`]): the firing rule
/// hands it to the caller's `send`.
#[derive(Debug, Clone, PartialEq)]
pub struct TickDispatch {
    /// The schedule's name.
    pub schedule: String,
    /// The job's name.
    pub job: String,
    /// The job's queue.
    pub queue: String,
    /// The tick.
    pub tick: Tick,
    /// The payload, as JSON.
    pub payload: serde_json::Value,
    /// The metadata to carry: [`SCHEDULE_METADATA`], [`TICK_METADATA`] (and
    /// [`TRIGGERED_AT_METADATA`] for a manual tick).
    pub metadata: BTreeMap<String, String>,
}

/// The namespace of the message ids of scheduled ticks (UUID v5 of the
/// tick's claim key in it).
const TICK_ID_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0xc110_6c50_64f7_4a69_b129_0a84_c328_91c2);

impl TickDispatch {
    /// The message id of this tick's job. A scheduled tick's is derived
    /// from its schedule and its time (a UUID v5 of its claim key,
    /// `schedule:<name>:<tick>`), the same in every scheduler: a tick sent
    /// again, by a scheduler that took it over after another died between
    /// its send and its record, carries the first send's id, and a queue
    /// that drops duplicates by id (NATS JetStream's duplicate window), or
    /// a handler that claims its effect by message id, keeps one. A manual
    /// tick ([`Tick::manual`]) gets a new random id each time.
    pub fn message_id(&self) -> String {
        if self.tick.manual {
            crate::model::envelope::new_message_id()
        } else {
            uuid::Uuid::new_v5(
                &TICK_ID_NAMESPACE,
                tick_key(&self.schedule, &self.tick).as_bytes(),
            )
            .to_string()
        }
    }

    /// The envelope to send: the job, the payload and the metadata, under
    /// [`TickDispatch::message_id`].
    pub fn envelope(&self) -> Envelope {
        // A manual tick keeps the new envelope's random id.
        let mut envelope = Envelope::new(self.job.clone(), self.payload.clone());
        if !self.tick.manual {
            envelope.id = self.message_id();
        }
        envelope.metadata = self.metadata.clone();
        envelope
    }
}

/// A schedule being declared ([`Schedule::builder`], [`Schedule::raw`]).
#[must_use = "a schedule is declared by `build`"]
pub struct ScheduleBuilder<P> {
    name: String,
    job: String,
    queue: String,
    cron: String,
    zone: String,
    missed: Missed,
    overlap: Overlap,
    lease: Duration,
    enabled: bool,
    job_timeout: Option<Duration>,
    payload: Option<Result<PayloadSource, String>>,
    _payload: PhantomData<fn() -> P>,
}

impl<P> fmt::Debug for ScheduleBuilder<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScheduleBuilder")
            .field("name", &self.name)
            .field("job", &self.job)
            .field("cron", &self.cron)
            .field("time_zone", &self.zone)
            .finish()
    }
}

impl<P: Serialize + DeserializeOwned> ScheduleBuilder<P> {
    /// The IANA time zone the cron expression is read in (`Europe/Paris`);
    /// `UTC` by default.
    pub fn time_zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = zone.into();
        self
    }

    /// The payload of every tick's job.
    pub fn payload(mut self, payload: P) -> Self {
        self.payload = Some(
            serde_json::to_value(&payload)
                .map(PayloadSource::Value)
                .map_err(|e| e.to_string()),
        );
        self
    }

    /// The payload of each tick's job, made from the tick (a report of the
    /// day the tick names, say). It must be cheap and must not panic.
    pub fn payload_fn(mut self, f: impl Fn(&Tick) -> P + Send + Sync + 'static) -> Self {
        let f: PayloadFn =
            Arc::new(move |tick: &Tick| serde_json::to_value(f(tick)).map_err(|e| e.to_string()));
        self.payload = Some(Ok(PayloadSource::Fn(f)));
        self
    }

    /// The missed-tick policy ([`Missed::Latest`] by default).
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// The overlap policy ([`Overlap::Allow`] by default).
    pub fn overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// The lease a firer holds on a tick while it sends the tick's job
    /// ([`DEFAULT_TICK_LEASE`]): a firer that dies holding it leaves the
    /// tick to another after this long.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Whether schedulers fire it (`true` by default).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Checks the declaration: the name (see [`ScheduleError::Name`]), the
    /// cron expression, the zone, the policies, the lease and the payload
    /// (none given: `null` must decode as the job's payload).
    pub fn build(self) -> Result<Schedule, ScheduleError> {
        validate_name(&self.name)?;
        let cron = parse_cron(&self.name, &self.cron)?;
        let zone: Tz = self.zone.parse().map_err(|_| ScheduleError::TimeZone {
            schedule: self.name.clone(),
            zone: self.zone.clone(),
        })?;
        check_missed(self.missed)?;
        if self.lease < Duration::from_millis(1) || self.lease > MAX_CLAIM_LEASE {
            return Err(ScheduleError::Policy(format!(
                "schedule `{}`: a tick lease of {:?} is outside 1 ms to {MAX_CLAIM_LEASE:?}",
                self.name, self.lease
            )));
        }
        let payload = match self.payload {
            Some(Ok(payload)) => payload,
            Some(Err(reason)) => {
                return Err(ScheduleError::Payload {
                    schedule: self.name,
                    reason,
                })
            }
            None => {
                if serde_json::from_value::<P>(serde_json::Value::Null).is_err() {
                    return Err(ScheduleError::Payload {
                        schedule: self.name,
                        reason: "no payload given, and the job's payload cannot be `null`: \
                                 set `.payload(...)` or `.payload_fn(...)`"
                            .into(),
                    });
                }
                PayloadSource::Value(serde_json::Value::Null)
            }
        };
        if self.job.is_empty() {
            return Err(ScheduleError::Policy(format!(
                "schedule `{}`: the job name is empty",
                self.name
            )));
        }
        Ok(Schedule {
            inner: Arc::new(Inner {
                name: self.name,
                job: self.job,
                queue: self.queue,
                cron_text: self.cron,
                cron,
                zone_name: zone.name().to_owned(),
                zone,
                missed: self.missed,
                overlap: self.overlap,
                lease: self.lease,
                enabled: self.enabled,
                job_timeout: self.job_timeout,
                payload,
            }),
        })
    }
}

/// Checks a schedule name: 1 to [`MAX_SCHEDULE_NAME_BYTES`] bytes of ASCII
/// letters, digits, `-`, `_` and `.`, so that `schedule:<name>:<tick>` is a claim key every
/// store takes and no two names share a key.
pub fn validate_schedule_name(name: &str) -> Result<(), ScheduleError> {
    validate_name(name)
}

fn validate_name(name: &str) -> Result<(), ScheduleError> {
    let refuse = |reason: String| {
        Err(ScheduleError::Name {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return refuse("the name is empty".into());
    }
    if name.len() > MAX_SCHEDULE_NAME_BYTES {
        return refuse(format!(
            "the name is {} bytes, more than {MAX_SCHEDULE_NAME_BYTES}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return refuse(format!(
            "`{c}` is not allowed: use A-Z, a-z, 0-9, `-`, `_` and `.`"
        ));
    }
    // The longest key the schedule makes must be one every store takes.
    let longest = tick_key(name, &Tick::from_unix_seconds(0));
    if let Err(e) = validate_claim(&longest, DEFAULT_TICK_LEASE) {
        return refuse(e.to_string());
    }
    Ok(())
}

fn parse_cron(schedule: &str, text: &str) -> Result<Cron, ScheduleError> {
    let parser = CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Optional)
        .build();
    parser.parse(text).map_err(|e| ScheduleError::Cron {
        schedule: schedule.to_owned(),
        cron: text.to_owned(),
        reason: e.to_string(),
    })
}
