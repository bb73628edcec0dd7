//! Schedules in the configuration file (`[schedules.<name>]` tables,
//! [`SchedulesConfig`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::spec::{validate_schedule_name, Missed, Overlap, Schedule, ScheduleError};

/// The keys a `[schedules.<name>]` table may have.
const KEYS: &[&str] = &[
    "job",
    "queue",
    "cron",
    "time_zone",
    "missed",
    "overlap",
    "payload",
    "enabled",
    "lease",
];

/// One `[schedules.<name>]` table: every field optional. For a schedule
/// declared in code it overrides what it sets ([`Schedule::with_entry`]);
/// on its own it declares a schedule, and then needs `job` and `cron`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScheduleEntry {
    /// The job's name.
    pub job: Option<String>,
    /// The job's queue (`default` for a schedule the file declares).
    pub queue: Option<String>,
    /// The cron expression.
    pub cron: Option<String>,
    /// The IANA time zone.
    pub time_zone: Option<String>,
    /// The missed-tick policy: `skip`, `latest` or `each:<n>`.
    pub missed: Option<Missed>,
    /// The overlap policy: `allow` or `skip`.
    pub overlap: Option<Overlap>,
    /// The payload, as JSON (a TOML value or table, or a string of JSON).
    pub payload: Option<serde_json::Value>,
    /// Whether schedulers fire it.
    pub enabled: Option<bool>,
    /// The tick lease (`"30s"`).
    pub lease: Option<Duration>,
}

/// The `[schedules.<name>]` tables of a configuration file (the file
/// `JOBRAIL_CONFIG` names, which also holds the `[jobs.<name>]`
/// overrides).
///
/// ```
/// use jobrail::{Job, Missed, Schedule, SchedulesConfig};
///
/// let file = r#"
/// [schedules.nightly-digest]
/// cron = "0 30 2 * * *"
/// time_zone = "Europe/Paris"
/// missed = "each:3"
///
/// [schedules.purge]
/// job = "purge-sessions"
/// queue = "maintenance"
/// cron = "*/15 * * * *"
/// payload = { older_than_days = 30 }
/// "#;
/// let config = SchedulesConfig::from_toml(file)?;
/// let job = Job::<()>::builder("send-digest").build()?;
/// let in_code = vec![Schedule::builder("nightly-digest", &job, "0 0 3 * * *").build()?];
/// let schedules = config.apply(in_code)?;
/// assert_eq!(schedules.len(), 2);
/// assert_eq!(schedules[0].cron(), "0 30 2 * * *");
/// assert_eq!(schedules[0].missed(), Missed::Each(3));
/// assert_eq!(schedules[1].job(), "purge-sessions");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulesConfig {
    entries: BTreeMap<String, ScheduleEntry>,
}

fn policy(name: &str, reason: impl std::fmt::Display) -> ScheduleError {
    ScheduleError::Policy(format!("[schedules.{name}]: {reason}"))
}

impl SchedulesConfig {
    /// Reads the `[schedules]` tables of a configuration file's text;
    /// other top-level tables (`[jobs]`) are left to their readers.
    pub fn from_toml(text: &str) -> Result<Self, ScheduleError> {
        let file: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ScheduleError::Policy(format!("config file: {e}")))?;
        let mut entries = BTreeMap::new();
        let Some(schedules) = file.get("schedules") else {
            return Ok(SchedulesConfig { entries });
        };
        let toml::Value::Table(schedules) = schedules else {
            return Err(ScheduleError::Policy(
                "config file: `schedules` must be a table of `[schedules.<name>]` tables".into(),
            ));
        };
        for (name, value) in schedules {
            validate_schedule_name(name)?;
            let toml::Value::Table(table) = value else {
                return Err(policy(name, "must be a table"));
            };
            entries.insert(name.clone(), entry(name, table)?);
        }
        Ok(SchedulesConfig { entries })
    }

    /// The entries, by name.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &ScheduleEntry)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The entry of schedule `name`.
    pub fn get(&self, name: &str) -> Option<&ScheduleEntry> {
        self.entries.get(name)
    }

    /// Whether the file has no schedules.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The schedules `declared` in code with the file's entries applied to
    /// those it names, followed by the schedules only the file declares
    /// (each needs `job` and `cron`), in name order. A file entry that is
    /// incomplete or invalid is an error, naming it.
    pub fn apply(&self, declared: Vec<Schedule>) -> Result<Vec<Schedule>, ScheduleError> {
        let mut out = Vec::with_capacity(declared.len() + self.entries.len());
        for schedule in declared {
            match self.entries.get(schedule.name()) {
                Some(entry) => out.push(schedule.with_entry(entry)?),
                None => out.push(schedule),
            }
        }
        for (name, entry) in &self.entries {
            if out.iter().any(|s| s.name() == name) {
                continue;
            }
            out.push(declare(name, entry)?);
        }
        Ok(out)
    }

    /// The schedules the file declares on its own (every entry, each
    /// needing `job` and `cron`): what the CLI lists.
    pub fn schedules(&self) -> Result<Vec<Schedule>, ScheduleError> {
        self.apply(Vec::new())
    }
}

fn declare(name: &str, entry: &ScheduleEntry) -> Result<Schedule, ScheduleError> {
    let (Some(job), Some(cron)) = (&entry.job, &entry.cron) else {
        return Err(policy(
            name,
            "a schedule declared in the file needs `job` and `cron`",
        ));
    };
    let queue = entry.queue.clone().unwrap_or_else(|| "default".into());
    let base = Schedule::raw(name, job.clone(), queue, cron.clone()).build()?;
    base.with_entry(entry)
}

fn entry(name: &str, table: &toml::Table) -> Result<ScheduleEntry, ScheduleError> {
    let mut e = ScheduleEntry::default();
    for (key, value) in table {
        let string = || match value {
            toml::Value::String(s) => Ok(s.clone()),
            other => Err(policy(
                name,
                format!("`{key}` must be a string, not {}", other.type_str()),
            )),
        };
        match key.as_str() {
            "job" => e.job = Some(string()?),
            "queue" => e.queue = Some(string()?),
            "cron" => e.cron = Some(string()?),
            "time_zone" => e.time_zone = Some(string()?),
            "missed" => {
                e.missed = Some(
                    string()?
                        .parse()
                        .map_err(|err: ScheduleError| policy(name, err))?,
                )
            }
            "overlap" => {
                e.overlap = Some(
                    string()?
                        .parse()
                        .map_err(|err: ScheduleError| policy(name, err))?,
                )
            }
            "enabled" => match value {
                toml::Value::Boolean(b) => e.enabled = Some(*b),
                other => {
                    return Err(policy(
                        name,
                        format!("`enabled` must be a boolean, not {}", other.type_str()),
                    ))
                }
            },
            "lease" => {
                let text = string()?;
                let lease = humantime::parse_duration(&text)
                    .map_err(|err| policy(name, format!("`lease` = {text:?}: {err}")))?;
                e.lease = Some(lease);
            }
            "payload" => {
                e.payload = Some(match value {
                    // A string is JSON text.
                    toml::Value::String(s) => serde_json::from_str(s).map_err(|err| {
                        policy(name, format!("`payload` is a string but not JSON: {err}"))
                    })?,
                    other => serde_json::to_value(other)
                        .map_err(|err| policy(name, format!("`payload`: {err}")))?,
                })
            }
            other => {
                return Err(policy(
                    name,
                    format!("unknown key `{other}`; expected one of {}", KEYS.join(", ")),
                ))
            }
        }
    }
    Ok(e)
}
