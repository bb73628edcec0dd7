//! Schedules fired by Cloudflare Cron Triggers ([`EdgeScheduler`]).
//!
//! The same [`jobrail::Schedule`] declarations as natively, fired by the
//! Worker's `scheduled` event through the same rule
//! ([`jobrail::ScheduleFiring`]): each tick is claimed as
//! `schedule:<name>:<tick>` in D1 (`D1Claims` at the edge), sent through the producer binding of the job's queue, and the
//! claim completed, so a trigger delivered twice (or a native scheduler on
//! the same store) dispatches the tick once.
//!
//! # Which trigger fires which schedule
//!
//! Cron Triggers are UTC, five fields, minute resolution. A schedule whose
//! own expression is that (time zone `UTC`, five fields, or six with a
//! seconds field of `0`) fires from a trigger of its own expression when
//! `[triggers] crons` lists it. Any other schedule (another time zone, a
//! year field), and a UTC one without its own trigger, fires from the
//! every-minute trigger `* * * * *`: each minute its ticks of that minute
//! are fired. A seconds field other than `0` cannot be honoured at minute
//! resolution and is refused, as is [`Overlap::Skip`]
//! (the edge consumer does not guard overlapping runs). The wrangler.toml
//! check ([`check_triggers`]) holds `[triggers] crons` to the declared
//! schedules both ways.
//!
//! # One trigger
//!
//! A trigger at scheduled time `t` fires the ticks of the minute `t` falls
//! in (`t` rounded down to the minute: the platform's triggers are on the
//! minute; a test trigger at another time fires that minute's ticks). The
//! rule runs as a scheduler that started watching one second before that
//! minute, so the minute's own tick is never taken for a missed one, and
//! the schedule's [`Missed`](jobrail::Missed) policy applies to what came
//! before: under the every-minute trigger a tick whose minute's trigger
//! the platform dropped is fired by the next trigger with
//! [`Missed::Latest`](jobrail::Missed::Latest) (and the last `n` with
//! `Each(n)`); a schedule fired by its own trigger is seen only at its own
//! ticks, so only `Each(n)` makes up a dropped one there. A tick another
//! invocation holds (the same trigger delivered twice) is waited for, up
//! to its lease, and found fired.

use std::future::Future;
use std::time::Duration;

use jobrail::{
    ClaimStore, FireReport, Overlap, PolicyError, Runtime, Schedule, ScheduleFiring, SystemTime,
    TickDispatch, TickOutcome, UNIX_EPOCH,
};

use crate::batch::{log_error, log_info, Wall};
use crate::error::EdgeError;
use crate::wrangler::Wrangler;

/// The every-minute Cron Trigger, which fires every schedule a trigger of
/// its own cannot.
pub const EVERY_MINUTE: &str = "* * * * *";

/// How many times one trigger goes back to ticks another invocation held
/// or whose send failed, each after the wait the rule asks for (at most a
/// tick's lease).
const RETRY_PASSES: usize = 3;

/// A cron expression with its fields separated by one space.
fn normalized(cron: &str) -> String {
    cron.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn is_utc(zone: &str) -> bool {
    matches!(
        zone,
        "UTC" | "Etc/UTC" | "GMT" | "Etc/GMT" | "Etc/Universal" | "Universal" | "Etc/Zulu" | "Zulu"
    )
}

/// The Cron Trigger expression that fires `schedule` on its own: its
/// expression as five UTC fields, if it is one.
pub fn own_trigger(schedule: &Schedule) -> Option<String> {
    if !is_utc(schedule.time_zone()) {
        return None;
    }
    let fields: Vec<&str> = schedule.cron().split_whitespace().collect();
    match fields.len() {
        5 => Some(fields.join(" ")),
        6 if fields[0] == "0" => Some(fields[1..].join(" ")),
        _ => None,
    }
}

/// Why the edge cannot fire `schedule` as declared, if it cannot.
pub fn refusal(schedule: &Schedule) -> Option<String> {
    let fields: Vec<&str> = schedule.cron().split_whitespace().collect();
    if fields.len() >= 6 && fields[0] != "0" {
        return Some(format!(
            "schedule `{}`: its cron `{}` has a seconds field (`{}`), but Cron Triggers fire at \
             minute resolution: at the edge a schedule ticks on whole minutes (a seconds field of \
             `0`, or five fields)",
            schedule.name(),
            schedule.cron(),
            fields[0]
        ));
    }
    if schedule.overlap() == Overlap::Skip {
        return Some(format!(
            "schedule `{}`: overlap = skip is not enforced at the edge (the queue consumer does \
             not guard a tick's job against the previous one's); use overlap = allow, or fire it \
             from a native scheduler",
            schedule.name()
        ));
    }
    None
}

/// The trigger among `crons` that fires `schedule`: its own expression if
/// listed, else [`EVERY_MINUTE`] if listed.
pub fn covering_trigger(schedule: &Schedule, crons: &[String]) -> Option<String> {
    let listed = |cron: &str| crons.iter().any(|c| normalized(c) == cron);
    match own_trigger(schedule) {
        Some(own) if listed(&own) => Some(own),
        _ => listed(EVERY_MINUTE).then(|| EVERY_MINUTE.to_string()),
    }
}

/// Holds one section's `[triggers] crons` to the declared `schedules`
/// (the wrangler.toml check of a worker that declares schedules):
///
/// - `triggers.crons`: a schedule the edge cannot fire ([`refusal`]), an
///   enabled schedule no trigger fires ([`covering_trigger`]), a trigger
///   that fires no schedule (the every-minute one included, when every
///   schedule has a trigger of its own), a name declared twice;
/// - `wrangler.queues.producers`: a schedule's queue without a producer
///   binding to send its ticks' jobs through;
/// - `wrangler.d1_databases`: no `[[d1_databases]]` entry with the
///   binding `claims` (where the ticks are claimed).
///
/// Every problem names the schedule or the trigger.
pub fn check_triggers(
    wrangler: &Wrangler,
    schedules: &[Schedule],
    claims: &str,
) -> Vec<PolicyError> {
    let invalid = |field: &str, reason: String| PolicyError::Invalid {
        job: "*".into(),
        field: field.to_string().into(),
        reason,
    };
    let table = match wrangler.env() {
        None => "[triggers]".to_string(),
        Some(env) => format!("[env.{env}.triggers]"),
    };
    let producers = match wrangler.env() {
        None => "[[queues.producers]]".to_string(),
        Some(env) => format!("[[env.{env}.queues.producers]]"),
    };
    let crons = wrangler.crons();
    let mut problems = Vec::new();
    let mut used = Vec::new();
    for (i, schedule) in schedules.iter().enumerate() {
        if schedules[..i].iter().any(|s| s.name() == schedule.name()) {
            problems.push(invalid(
                "triggers.crons",
                format!("schedule `{}` is declared twice", schedule.name()),
            ));
            continue;
        }
        if let Some(reason) = refusal(schedule) {
            problems.push(invalid("triggers.crons", reason));
            continue;
        }
        match covering_trigger(schedule, crons) {
            Some(trigger) => used.push(trigger),
            None if !schedule.enabled() => {}
            None => {
                let add = match own_trigger(schedule) {
                    Some(own) => format!("\"{own}\" (its own) or \"{EVERY_MINUTE}\""),
                    None => format!("\"{EVERY_MINUTE}\""),
                };
                problems.push(invalid(
                    "triggers.crons",
                    format!(
                        "schedule `{}` (cron `{}`, time zone {}) is fired by no Cron Trigger: add {add} to {table} crons",
                        schedule.name(),
                        schedule.cron(),
                        schedule.time_zone()
                    ),
                ));
            }
        }
        if wrangler.binding_to(schedule.queue()).is_none() {
            problems.push(invalid(
                "wrangler.queues.producers",
                format!(
                    "schedule `{}` sends job `{}` to `{}`, but no {producers} entry sends to `{}`: add one with queue = \"{}\" and a binding",
                    schedule.name(),
                    schedule.job(),
                    schedule.queue(),
                    schedule.queue(),
                    schedule.queue()
                ),
            ));
        }
    }
    for cron in crons {
        let cron = normalized(cron);
        if used.contains(&cron) {
            continue;
        }
        let reason = if cron == EVERY_MINUTE && !schedules.is_empty() {
            format!(
                "{table} crons has \"{EVERY_MINUTE}\", which no declared schedule needs (each has a trigger of its own): remove it"
            )
        } else {
            format!(
                "{table} crons has \"{cron}\", which fires no declared schedule: remove it, or declare a schedule with cron \"{cron}\" in UTC"
            )
        };
        problems.push(invalid("triggers.crons", reason));
    }
    if !schedules.is_empty() && !wrangler.has_d1_binding(claims) {
        let d1 = match wrangler.env() {
            None => "[[d1_databases]]".to_string(),
            Some(env) => format!("[[env.{env}.d1_databases]]"),
        };
        problems.push(invalid(
            "wrangler.d1_databases",
            format!(
                "schedules claim each tick in the D1 database bound as `{claims}`, but no {d1} entry has binding = \"{claims}\""
            ),
        ));
    }
    problems
}

/// What one trigger did for one schedule.
#[derive(Debug)]
pub struct ScheduleFired {
    /// The schedule's name.
    pub schedule: String,
    /// The rule's report of each pass, in order (more than one when it
    /// went back to ticks another invocation held).
    pub passes: Vec<FireReport<String, EdgeError>>,
}

impl ScheduleFired {
    /// How many of its ticks this trigger sent.
    pub fn sent(&self) -> usize {
        self.passes.iter().map(FireReport::sent).sum()
    }

    /// Every tick looked at and what happened to it, over all passes.
    pub fn outcomes(
        &self,
    ) -> impl Iterator<Item = (&jobrail::Tick, &TickOutcome<String, EdgeError>)> {
        self.passes
            .iter()
            .flat_map(|p| p.ticks.iter().map(|t| (&t.tick, &t.outcome)))
    }
}

/// The schedules a Worker fires from its Cron Triggers. See the
/// [module documentation](self).
///
/// ```
/// use jobrail::{Job, Schedule};
/// use jobrail_edge::EdgeScheduler;
///
/// let job = Job::<()>::builder("purge").queue("maintenance").build()?;
/// let nightly = Schedule::builder("nightly-purge", &job, "0 3 * * *").build()?;
/// let paris = Schedule::builder("paris-digest", &job, "30 7 * * *")
///     .time_zone("Europe/Paris")
///     .build()?;
/// let crons = ["0 3 * * *".to_string(), "* * * * *".to_string()];
/// let scheduler = EdgeScheduler::new(vec![nightly, paris], &crons)?;
/// let names = |cron| -> Vec<String> {
///     scheduler.fired_by(cron).iter().map(|s| s.name().to_string()).collect()
/// };
/// assert_eq!(names("0 3 * * *"), ["nightly-purge"]);
/// assert_eq!(names("* * * * *"), ["paris-digest"]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct EdgeScheduler {
    schedules: Vec<Schedule>,
    crons: Vec<String>,
    pub(crate) wall: Wall,
}

impl std::fmt::Debug for EdgeScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeScheduler")
            .field("schedules", &self.schedules)
            .field("crons", &self.crons)
            .finish()
    }
}

impl EdgeScheduler {
    /// The `schedules`, fired from the Cron Triggers `crons` (the Worker's
    /// `[triggers] crons`). Refuses a schedule the edge cannot fire
    /// ([`refusal`]) and a name declared twice.
    pub fn new(schedules: Vec<Schedule>, crons: &[String]) -> Result<Self, String> {
        let mut problems = Vec::new();
        for (i, schedule) in schedules.iter().enumerate() {
            if schedules[..i].iter().any(|s| s.name() == schedule.name()) {
                problems.push(format!("schedule `{}` is declared twice", schedule.name()));
            }
            problems.extend(refusal(schedule));
        }
        if !problems.is_empty() {
            return Err(problems.join("\n"));
        }
        Ok(EdgeScheduler {
            schedules,
            crons: crons.iter().map(|c| normalized(c)).collect(),
            wall: Wall::System,
        })
    }

    /// Every schedule.
    pub fn schedules(&self) -> &[Schedule] {
        &self.schedules
    }

    /// The enabled schedules the trigger `cron` fires.
    pub fn fired_by(&self, cron: &str) -> Vec<&Schedule> {
        let cron = normalized(cron);
        self.schedules
            .iter()
            .filter(|s| s.enabled())
            .filter(|s| covering_trigger(s, &self.crons).as_deref() == Some(cron.as_str()))
            .collect()
    }

    /// Fires, for the trigger `cron` at its scheduled time `scheduled`,
    /// the ticks of that minute (and the missed ones the policies pick) of
    /// every schedule it fires, each claimed once on `claims`. `send`
    /// sends one tick's job and answers its message id; an error of kind
    /// other than [`Uncertain`](crate::EdgeErrorKind::Uncertain) certainly
    /// sent nothing (the tick is given back at once). Ticks another
    /// invocation holds are gone back to, after `runtime`'s sleep, as the
    /// rule asks (at most three times). Logs one line per tick
    /// (`jobrail-edge schedule {...}`).
    pub async fn fire<S, F, Fut>(
        &self,
        cron: &str,
        scheduled: SystemTime,
        claims: &S,
        runtime: &dyn Runtime,
        mut send: F,
    ) -> Vec<ScheduleFired>
    where
        S: ClaimStore + ?Sized,
        F: FnMut(TickDispatch) -> Fut,
        Fut: Future<Output = Result<String, EdgeError>>,
    {
        let minute = floor_minute(scheduled);
        let watching_since = minute - Duration::from_secs(1);
        let mut fired = Vec::new();
        for schedule in self.fired_by(cron) {
            let mut firing = ScheduleFiring::new(schedule.clone(), watching_since);
            let mut passes = Vec::new();
            let mut now = minute;
            for pass in 0..=RETRY_PASSES {
                let report = firing
                    .fire_due(claims, now, &mut send, |e: &EdgeError| {
                        e.kind != crate::EdgeErrorKind::Uncertain
                    })
                    .await;
                log_report(schedule.name(), cron, &report);
                let retry = report.ticks.iter().any(|t| {
                    matches!(
                        t.outcome,
                        TickOutcome::Held { .. }
                            | TickOutcome::SendFailed { .. }
                            | TickOutcome::Store(_)
                    )
                });
                let wake = report.next_wake;
                passes.push(report);
                let limit = now + schedule.lease() + Duration::from_secs(1);
                match wake {
                    Some(at) if retry && pass < RETRY_PASSES && at <= limit => {
                        let wait = at.duration_since(now).unwrap_or_default();
                        runtime.sleep(wait).await;
                        now = self.now().max(at);
                    }
                    _ => break,
                }
            }
            fired.push(ScheduleFired {
                schedule: schedule.name().to_string(),
                passes,
            });
        }
        fired
    }

    fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.wall.now_ms())
    }
}

/// `time` rounded down to its minute.
fn floor_minute(time: SystemTime) -> SystemTime {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    UNIX_EPOCH + Duration::from_secs(secs - secs % 60)
}

/// One line per tick of a pass.
fn log_report(schedule: &str, cron: &str, report: &FireReport<String, EdgeError>) {
    for tick in &report.ticks {
        let (outcome, message_id, error) = match &tick.outcome {
            TickOutcome::Fired { sent, .. } => ("fired", Some(sent.as_str()), None),
            TickOutcome::FiredUnrecorded { sent, error } => (
                "fired-unrecorded",
                Some(sent.as_str()),
                Some(error.to_string()),
            ),
            TickOutcome::AlreadyFired => ("already-fired", None, None),
            TickOutcome::Held { .. } => ("held", None, None),
            TickOutcome::SkippedBeforeFirstSeen => ("skipped-before-first-seen", None, None),
            TickOutcome::SendFailed { error, .. } => ("send-failed", None, Some(error.to_string())),
            TickOutcome::Payload(e) => ("payload-failed", None, Some(e.to_string())),
            TickOutcome::Store(e) => ("store-failed", None, Some(e.to_string())),
            TickOutcome::GivenUp => ("given-up", None, None),
            _ => ("other", None, None),
        };
        let line = format!(
            "jobrail-edge schedule {}",
            serde_json::json!({
                "schedule": schedule,
                "trigger": cron,
                "tick": tick.tick.label(),
                "outcome": outcome,
                "message_id": message_id,
                "error": error,
            })
        );
        if error.is_some() {
            log_error(&line);
        } else {
            log_info(&line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail::{Job, Missed};

    fn job() -> Job<()> {
        Job::<()>::builder("purge").queue("jobs").build().unwrap()
    }

    fn schedule(name: &str, cron: &str, zone: &str) -> Schedule {
        Schedule::builder(name, &job(), cron)
            .time_zone(zone)
            .build()
            .unwrap()
    }

    fn crons(list: &[&str]) -> Vec<String> {
        list.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn a_utc_five_field_schedule_has_a_trigger_of_its_own() {
        assert_eq!(
            own_trigger(&schedule("a", "0  3 * * *", "UTC")).as_deref(),
            Some("0 3 * * *")
        );
        assert_eq!(
            own_trigger(&schedule("a", "0 0 3 * * *", "UTC")).as_deref(),
            Some("0 3 * * *"),
            "a seconds field of 0 is five fields"
        );
        assert_eq!(
            own_trigger(&schedule("a", "0 3 * * *", "Europe/Paris")),
            None
        );
        assert_eq!(own_trigger(&schedule("a", "0 0 3 * * * 2030", "UTC")), None);
    }

    #[test]
    fn seconds_and_overlap_skip_are_refused() {
        let seconds = schedule("s", "30 * * * * *", "UTC");
        let err = EdgeScheduler::new(vec![seconds], &[]).unwrap_err();
        assert!(
            err.contains("seconds field") && err.contains("`s`"),
            "{err}"
        );
        let skip = Schedule::builder("k", &job(), "* * * * *")
            .overlap(Overlap::Skip)
            .build()
            .unwrap();
        assert!(EdgeScheduler::new(vec![skip], &[])
            .unwrap_err()
            .contains("overlap"));
        let twice = vec![
            schedule("t", "* * * * *", "UTC"),
            schedule("t", "0 * * * *", "UTC"),
        ];
        assert!(EdgeScheduler::new(twice, &[])
            .unwrap_err()
            .contains("twice"));
    }

    #[test]
    fn a_schedule_fires_from_its_own_trigger_else_every_minute() {
        let list = vec![
            schedule("own", "0 3 * * *", "UTC"),
            schedule("paris", "0 3 * * *", "Europe/Paris"),
            schedule("hourly", "0 * * * *", "UTC"),
        ];
        let with_own =
            EdgeScheduler::new(list.clone(), &crons(&["0 3 * * *", "* * * * *"])).unwrap();
        let names = |s: &EdgeScheduler, cron: &str| -> Vec<String> {
            s.fired_by(cron)
                .iter()
                .map(|s| s.name().to_string())
                .collect()
        };
        assert_eq!(names(&with_own, "0 3 * * *"), ["own"]);
        assert_eq!(names(&with_own, "*  * * * *"), ["paris", "hourly"]);
        assert!(names(&with_own, "5 5 * * *").is_empty());
        let minute_only = EdgeScheduler::new(list, &crons(&["* * * * *"])).unwrap();
        assert_eq!(names(&minute_only, "* * * * *"), ["own", "paris", "hourly"]);
    }

    #[test]
    fn minutes_round_down() {
        let t = UNIX_EPOCH + Duration::from_millis(1_800_000_037_123);
        assert_eq!(
            floor_minute(t),
            UNIX_EPOCH + Duration::from_secs(1_800_000_000)
        );
        let _ = Missed::Latest;
    }
}
