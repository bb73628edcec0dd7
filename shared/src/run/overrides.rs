//! Operator overrides of tier depths and backoffs ([`Overrides`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::model::job::JobSpec;
use crate::model::policy::{Backoff, PolicyError};
use crate::run::registry::Registry;

/// The environment variable prefix for overrides.
pub(crate) const ENV_PREFIX: &str = "JOBRAIL_JOB__";

/// Overrides for one job. Every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct JobOverride {
    /// Tier two: total deliveries.
    pub attempts: Option<u32>,
    /// Per-execution timeout (`"0s"`: none).
    pub timeout: Option<String>,
    /// Tier-two backoff.
    pub backoff: Option<BackoffOverride>,
    /// Tier one.
    pub tier_one: Option<TierOneOverride>,
}

/// An exponential backoff, field by field.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BackoffOverride {
    /// First delay.
    pub initial: Option<String>,
    /// Growth factor.
    pub multiplier: Option<f64>,
    /// Cap (`"0s"`: none).
    pub max: Option<String>,
}

/// Tier one, field by field.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TierOneOverride {
    /// Executions per delivery.
    pub attempts: Option<u32>,
    /// First in-process delay.
    pub initial: Option<String>,
    /// Growth factor.
    pub multiplier: Option<f64>,
    /// Cap on in-process delays.
    pub max: Option<String>,
    /// Longest retry-after tier one waits for.
    pub max_wait: Option<String>,
}

/// A set of overrides, by job.
///
/// Why: the right retry depth depends on what the retried operation costs,
/// and that changes faster than code is deployed. Overrides let an operator
/// retune a job without a rebuild. They are applied and validated when the
/// worker starts: a typo in a job name or a bad value is a startup error that
/// names the job and the field, not a silent default.
///
/// File (TOML):
///
/// ```toml
/// [jobs.build-report]
/// attempts = 5                      # tier two: deliveries
/// timeout = "30s"
/// backoff = { initial = "2s", multiplier = 2.0, max = "10s" }
/// tier_one = { attempts = 3, initial = "100ms", multiplier = 2.0, max = "1s", max_wait = "5s" }
/// ```
///
/// Environment: `JOBRAIL_JOB__<JOB>__<FIELD>=value`, where `<JOB>` is the job
/// name upper-cased with `-` and `.` as `_`, and `<FIELD>` is one of
/// `ATTEMPTS`, `TIMEOUT`, `BACKOFF_INITIAL`, `BACKOFF_MULTIPLIER`,
/// `BACKOFF_MAX`, `TIER_ONE_ATTEMPTS`, `TIER_ONE_INITIAL`,
/// `TIER_ONE_MULTIPLIER`, `TIER_ONE_MAX`, `TIER_ONE_MAX_WAIT`. The environment
/// wins over the file. Durations read like `250ms`, `2s`, `1m 30s`.
///
/// Applying is all or nothing: when one override is refused, no job's
/// policy changes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// Keyed by exact job name (file) or by the normalised name (environment).
    jobs: BTreeMap<JobKey, JobOverride>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum JobKey {
    Exact(String),
    Env(String),
}

impl JobKey {
    fn matches(&self, name: &str) -> bool {
        match self {
            JobKey::Exact(exact) => exact == name,
            JobKey::Env(env) => *env == env_name(name),
        }
    }
    fn describe(&self) -> String {
        match self {
            JobKey::Exact(name) => name.clone(),
            JobKey::Env(name) => format!("{ENV_PREFIX}{name}__*"),
        }
    }
}

fn env_name(job: &str) -> String {
    job.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The fields of a job's table, of its `backoff` and of its `tier_one`.
const JOB_FIELDS: &[&str] = &["attempts", "timeout", "backoff", "tier_one"];
const BACKOFF_FIELDS: &[&str] = &["initial", "multiplier", "max"];
const TIER_ONE_FIELDS: &[&str] = &["attempts", "initial", "multiplier", "max", "max_wait"];

/// One field's value, or an error naming the job and the field.
fn field<T: serde::de::DeserializeOwned>(
    job: &str,
    name: String,
    value: toml::Value,
) -> Result<T, PolicyError> {
    value.try_into().map_err(|e: toml::de::Error| {
        PolicyError::invalid(job, name, e.message().trim().to_string())
    })
}

/// A table's entries, or an error naming the job and the field.
fn table(job: &str, name: String, value: toml::Value) -> Result<toml::Table, PolicyError> {
    match value {
        toml::Value::Table(table) => Ok(table),
        other => Err(PolicyError::invalid(
            job,
            name,
            format!("expected a table, found {}", other.type_str()),
        )),
    }
}

fn unknown(job: &str, name: String, allowed: &[&str]) -> PolicyError {
    let allowed: Vec<String> = allowed.iter().map(|f| format!("`{f}`")).collect();
    PolicyError::invalid(
        job,
        name,
        format!("unknown field; expected one of {}", allowed.join(", ")),
    )
}

/// Reads one `[jobs.<job>]` table field by field, so that an error names the
/// job and the field rather than only a position in the file.
fn job_override(job: &str, value: toml::Value) -> Result<JobOverride, PolicyError> {
    let mut o = JobOverride::default();
    for (key, value) in table(job, format!("jobs.{job}"), value)? {
        match key.as_str() {
            "attempts" => o.attempts = Some(field(job, key, value)?),
            "timeout" => o.timeout = Some(field(job, key, value)?),
            "backoff" => {
                let b = o.backoff.get_or_insert_with(Default::default);
                for (key, value) in table(job, key, value)? {
                    let name = format!("backoff.{key}");
                    match key.as_str() {
                        "initial" => b.initial = Some(field(job, name, value)?),
                        "multiplier" => b.multiplier = Some(field(job, name, value)?),
                        "max" => b.max = Some(field(job, name, value)?),
                        _ => return Err(unknown(job, name, BACKOFF_FIELDS)),
                    }
                }
            }
            "tier_one" => {
                let t = o.tier_one.get_or_insert_with(Default::default);
                for (key, value) in table(job, key, value)? {
                    let name = format!("tier_one.{key}");
                    match key.as_str() {
                        "attempts" => t.attempts = Some(field(job, name, value)?),
                        "initial" => t.initial = Some(field(job, name, value)?),
                        "multiplier" => t.multiplier = Some(field(job, name, value)?),
                        "max" => t.max = Some(field(job, name, value)?),
                        "max_wait" => t.max_wait = Some(field(job, name, value)?),
                        _ => return Err(unknown(job, name, TIER_ONE_FIELDS)),
                    }
                }
            }
            _ => return Err(unknown(job, key, JOB_FIELDS)),
        }
    }
    Ok(o)
}

impl Overrides {
    /// Parses a TOML configuration file's text.
    ///
    /// An error names the job and the field (`attempts`, `backoff.initial`,
    /// an unknown key with the allowed ones listed); errors outside any job's
    /// table (invalid TOML, an unknown top-level key) name job `*`.
    pub fn from_toml(text: &str) -> Result<Self, PolicyError> {
        let file: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            PolicyError::invalid("*", "config file", e.to_string())
        })?;
        let mut jobs = BTreeMap::new();
        for (key, value) in file {
            // `[schedules.<name>]` tables are the schedules' (read by
            // `SchedulesConfig::from_toml`), not job overrides.
            if key == "schedules" {
                continue;
            }
            if key != "jobs" {
                return Err(PolicyError::invalid(
                    "*",
                    "config file",
                    format!("unknown top-level key `{key}`; expected `jobs` or `schedules`"),
                ));
            }
            for (job, value) in table("*", key, value)? {
                let o = job_override(&job, value)?;
                jobs.insert(JobKey::Exact(job), o);
            }
        }
        Ok(Overrides { jobs })
    }

    /// Reads `JOBRAIL_JOB__<JOB>__<FIELD>` variables; others are ignored.
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, PolicyError> {
        let mut jobs: BTreeMap<JobKey, JobOverride> = BTreeMap::new();
        for (key, value) in vars {
            let Some(rest) = key.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let Some((job, field)) = rest.split_once("__") else {
                return Err(PolicyError::invalid(
                    "*",
                    "environment",
                    format!("`{key}` is not {ENV_PREFIX}<JOB>__<FIELD>"),
                ));
            };
            let o = jobs.entry(JobKey::Env(job.to_string())).or_default();
            let num = |f: &'static str| {
                value
                    .trim()
                    .parse::<u32>()
                    .map_err(|e| PolicyError::invalid(job, f, format!("`{value}`: {e}")))
            };
            let float = |f: &'static str| {
                value
                    .trim()
                    .parse::<f64>()
                    .map_err(|e| PolicyError::invalid(job, f, format!("`{value}`: {e}")))
            };
            let text = Some(value.clone());
            match field {
                "ATTEMPTS" => o.attempts = Some(num("attempts")?),
                "TIMEOUT" => o.timeout = text,
                "BACKOFF_INITIAL" => o.backoff.get_or_insert_with(Default::default).initial = text,
                "BACKOFF_MULTIPLIER" => {
                    o.backoff.get_or_insert_with(Default::default).multiplier =
                        Some(float("backoff.multiplier")?)
                }
                "BACKOFF_MAX" => o.backoff.get_or_insert_with(Default::default).max = text,
                "TIER_ONE_ATTEMPTS" => {
                    o.tier_one.get_or_insert_with(Default::default).attempts =
                        Some(num("tier_one.attempts")?)
                }
                "TIER_ONE_INITIAL" => {
                    o.tier_one.get_or_insert_with(Default::default).initial = text
                }
                "TIER_ONE_MULTIPLIER" => {
                    o.tier_one.get_or_insert_with(Default::default).multiplier =
                        Some(float("tier_one.multiplier")?)
                }
                "TIER_ONE_MAX" => o.tier_one.get_or_insert_with(Default::default).max = text,
                "TIER_ONE_MAX_WAIT" => {
                    o.tier_one.get_or_insert_with(Default::default).max_wait = text
                }
                other => {
                    return Err(PolicyError::invalid(
                        job,
                        "environment",
                        format!("unknown field `{other}` in `{key}`"),
                    ))
                }
            }
        }
        Ok(Overrides { jobs })
    }

    /// Adds `other`'s overrides on top of these (other wins per job key).
    pub fn merge(mut self, other: Overrides) -> Self {
        self.jobs.extend(other.jobs);
        self
    }

    /// Whether there is nothing to apply.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The job names given exactly (a file's `[jobs.<name>]` tables), in
    /// name order. Environment variables name a job only by its normalised
    /// form (`BUILD_REPORT`), so their jobs are not listed.
    pub fn named_jobs(&self) -> impl Iterator<Item = &str> {
        self.jobs.keys().filter_map(|key| match key {
            JobKey::Exact(name) => Some(name.as_str()),
            JobKey::Env(_) => None,
        })
    }
}

fn duration(job: &str, field: &'static str, text: &str) -> Result<Duration, PolicyError> {
    humantime::parse_duration(text.trim())
        .map_err(|e| PolicyError::invalid(job, field, format!("`{text}` is not a duration: {e}")))
}

fn multiplier(job: &str, field: &'static str, m: f64) -> Result<f64, PolicyError> {
    if m.is_finite() && m >= 0.0 {
        Ok(m)
    } else {
        Err(PolicyError::invalid(
            job,
            field,
            format!("{m} must be a finite, non-negative number"),
        ))
    }
}

fn exponential(
    job: &str,
    current: &Option<Backoff>,
    prefix: [&'static str; 3],
    initial: &Option<String>,
    mult: Option<f64>,
    max: &Option<String>,
) -> Result<Backoff, PolicyError> {
    let (mut i, mut m, mut x) = match current {
        Some(Backoff::Exponential {
            initial,
            multiplier,
            max,
        }) => (*initial, *multiplier, *max),
        _ => (Duration::from_secs(1), 2.0, Duration::ZERO),
    };
    if let Some(text) = initial {
        i = duration(job, prefix[0], text)?;
    }
    if let Some(v) = mult {
        m = multiplier(job, prefix[1], v)?;
    }
    if let Some(text) = max {
        x = duration(job, prefix[2], text)?;
    }
    Ok(Backoff::exponential(i, m, x))
}

impl Registry {
    /// Applies `overrides` to the registered jobs and re-validates them.
    /// A key naming no registered job is an error (it is usually a typo).
    ///
    /// All or nothing: every job's new policy is computed and validated
    /// before any is changed, so a refused override leaves every policy as
    /// it was.
    pub fn apply_overrides(&mut self, overrides: &Overrides) -> Result<(), PolicyError> {
        // Keys apply in order (the file's exact names before the
        // environment's), so one job's changes accumulate in one copy.
        let mut updated: BTreeMap<String, JobSpec> = BTreeMap::new();
        for (key, o) in &overrides.jobs {
            let current = self
                .specs()
                .find(|spec| key.matches(&spec.name))
                .ok_or_else(|| {
                    PolicyError::invalid(
                        &key.describe(),
                        "job",
                        "configuration names a job that is not registered",
                    )
                })?;
            let spec = updated
                .entry(current.name.clone())
                .or_insert_with(|| current.clone());
            apply(spec, o)?;
        }
        for spec in updated.values() {
            spec.validate()?;
        }
        for (name, spec) in updated {
            *self.spec_mut(&name).expect("found above") = spec;
        }
        Ok(())
    }
}

/// Applies one job's overrides to `spec` (a copy: validation comes after).
fn apply(spec: &mut JobSpec, o: &JobOverride) -> Result<(), PolicyError> {
    let name = spec.name.clone();
    let job = name.as_str();
    if let Some(attempts) = o.attempts {
        if attempts == 0 {
            // As `.max_deliveries(0)` is refused at build: a cap of no
            // deliveries would silently mean no cap at all.
            return Err(PolicyError::invalid(
                job,
                "attempts",
                "0 deliveries is no cap; a job without one is declared `.uncapped()` in code",
            ));
        }
        spec.retry.max_deliveries = attempts;
        spec.cap_chosen = true;
    }
    if let Some(text) = &o.timeout {
        let t = duration(job, "timeout", text)?;
        spec.timeout = (!t.is_zero()).then_some(t);
    }
    if let Some(b) = &o.backoff {
        spec.retry.backoff = Some(exponential(
            job,
            &spec.retry.backoff,
            ["backoff.initial", "backoff.multiplier", "backoff.max"],
            &b.initial,
            b.multiplier,
            &b.max,
        )?);
    }
    if let Some(t) = &o.tier_one {
        if let Some(attempts) = t.attempts {
            spec.tier_one.attempts = attempts;
        }
        spec.tier_one.backoff = exponential(
            job,
            &Some(spec.tier_one.backoff.clone()),
            ["tier_one.initial", "tier_one.multiplier", "tier_one.max"],
            &t.initial,
            t.multiplier,
            &t.max,
        )?;
        if let Some(text) = &t.max_wait {
            spec.tier_one.max_wait = duration(job, "tier_one.max_wait", text)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Job, JobContext};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn registry() -> Registry {
        let job = Job::<()>::builder("build-report")
            .max_deliveries(3)
            .build()
            .unwrap();
        let mut r = Registry::new();
        r.register(&job, |_: JobContext, _: ()| async { Ok(()) })
            .unwrap();
        r
    }

    #[test]
    fn file_overrides_apply() {
        let mut r = registry();
        let o = Overrides::from_toml(
            r#"
            [jobs.build-report]
            attempts = 5
            timeout = "30s"
            backoff = { initial = "2s", multiplier = 2.0, max = "10s" }
            tier_one = { attempts = 3, initial = "100ms", max_wait = "1s" }
            "#,
        )
        .unwrap();
        r.apply_overrides(&o).unwrap();
        let spec = r.spec("build-report").unwrap();
        assert_eq!(spec.retry.max_deliveries, 5);
        assert_eq!(spec.timeout, Some(Duration::from_secs(30)));
        assert_eq!(
            spec.retry.backoff.as_ref().unwrap().delay(5),
            Duration::from_secs(10)
        );
        assert_eq!(spec.tier_one.attempts, 3);
        assert_eq!(spec.tier_one.backoff.delay(2), Duration::from_millis(100));
        assert_eq!(spec.tier_one.max_wait, Duration::from_secs(1));
    }

    #[test]
    fn named_jobs_are_the_exact_names() {
        let file =
            Overrides::from_toml("[jobs.send-mail]\nattempts = 2\n[jobs.build-report]\n").unwrap();
        let env =
            Overrides::from_env([("JOBRAIL_JOB__RESIZE__ATTEMPTS".to_string(), "4".to_string())])
                .unwrap();
        let merged = file.merge(env);
        let names: Vec<&str> = merged.named_jobs().collect();
        assert_eq!(names, ["build-report", "send-mail"]);
    }

    #[test]
    fn env_overrides_win_over_the_file() {
        let mut r = registry();
        let file = Overrides::from_toml("[jobs.build-report]\nattempts = 5\n").unwrap();
        let env = Overrides::from_env([
            (
                "JOBRAIL_JOB__BUILD_REPORT__ATTEMPTS".to_string(),
                "7".to_string(),
            ),
            (
                "JOBRAIL_JOB__BUILD_REPORT__TIER_ONE_ATTEMPTS".to_string(),
                "2".to_string(),
            ),
            ("PATH".to_string(), "/bin".to_string()),
        ])
        .unwrap();
        r.apply_overrides(&file.merge(env)).unwrap();
        let spec = r.spec("build-report").unwrap();
        assert_eq!((spec.retry.max_deliveries, spec.tier_one.attempts), (7, 2));
    }

    #[test]
    fn errors_name_the_job_and_field() {
        let mut r = registry();
        let o = Overrides::from_toml("[jobs.build-report]\ntier_one = { attempts = 0 }\n").unwrap();
        let err = r.apply_overrides(&o).unwrap_err().to_string();
        assert!(
            err.contains("build-report") && err.contains("tier_one.attempts"),
            "{err}"
        );

        let o = Overrides::from_toml("[jobs.build-report]\ntimeout = \"soon\"\n").unwrap();
        let err = r.apply_overrides(&o).unwrap_err().to_string();
        assert!(
            err.contains("build-report") && err.contains("timeout"),
            "{err}"
        );

        let o = Overrides::from_toml("[jobs.build-reprot]\nattempts = 1\n").unwrap();
        let err = r.apply_overrides(&o).unwrap_err().to_string();
        assert!(
            err.contains("build-reprot") && err.contains("not registered"),
            "{err}"
        );

        let err = Overrides::from_toml("[jobs.x]\nattempts = \"three\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`x`") && err.contains("`attempts`"), "{err}");
        let err = Overrides::from_toml("[jobs.x]\nretries = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("retries"), "{err}");

        let err = Overrides::from_env([("JOBRAIL_JOB__X__ATTEMPTS".to_string(), "-1".to_string())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`X`") && err.contains("attempts"), "{err}");
        let err = Overrides::from_env([("JOBRAIL_JOB__X__RETRIES".to_string(), "1".to_string())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("RETRIES"), "{err}");
    }

    fn two_jobs() -> Registry {
        let mut r = Registry::new();
        for name in ["build-report", "send-mail"] {
            let job = Job::<()>::builder(name).max_deliveries(3).build().unwrap();
            r.register(&job, |_: JobContext, _: ()| async { Ok(()) })
                .unwrap();
        }
        r
    }

    /// (attempts, timeout, tier-one attempts, tier-one max_wait) per job.
    fn snapshot(r: &Registry) -> Vec<(u32, Option<Duration>, u32, Duration)> {
        r.specs()
            .map(|s| {
                (
                    s.retry.max_deliveries,
                    s.timeout,
                    s.tier_one.attempts,
                    s.tier_one.max_wait,
                )
            })
            .collect()
    }

    #[test]
    fn a_refused_override_changes_nothing() {
        let mut r = two_jobs();
        let before = snapshot(&r);
        // The first job's override is valid, the second job's is not.
        let o = Overrides::from_toml(
            "[jobs.build-report]\nattempts = 7\n[jobs.send-mail]\ntimeout = \"soon\"\n",
        )
        .unwrap();
        let err = r.apply_overrides(&o).unwrap_err().to_string();
        assert!(
            err.contains("send-mail") && err.contains("timeout"),
            "{err}"
        );
        assert_eq!(snapshot(&r), before, "nothing applied");

        // A later field of the same job fails validation.
        let o = Overrides::from_toml(
            "[jobs.build-report]\nattempts = 7\ntimeout = \"9s\"\ntier_one = { attempts = 0 }\n",
        )
        .unwrap();
        let err = r.apply_overrides(&o).unwrap_err().to_string();
        assert!(err.contains("tier_one.attempts"), "{err}");
        assert_eq!(snapshot(&r), before, "nothing applied");

        // A valid file and an invalid environment variable.
        let env = Overrides::from_env([(
            "JOBRAIL_JOB__SEND_MAIL__TIER_ONE_MAX_WAIT".to_string(),
            "later".to_string(),
        )])
        .unwrap();
        let file =
            Overrides::from_toml("[jobs.build-report]\ntier_one = { attempts = 4 }\n").unwrap();
        assert!(r.apply_overrides(&file.merge(env)).is_err());
        assert_eq!(snapshot(&r), before, "nothing applied");
    }

    #[test]
    fn an_override_of_zero_deliveries_is_refused_as_in_code() {
        // `.max_deliveries(0)` is refused at build; an operator's 0 would
        // remove the cap as silently, so it is refused too, from the file
        // and from the environment alike, and nothing is applied.
        let mut r = registry();
        let before = snapshot(&r);
        let file = Overrides::from_toml("[jobs.build-report]\nattempts = 0\n").unwrap();
        let err = r.apply_overrides(&file).unwrap_err();
        let text = err.to_string();
        assert_eq!(
            invalid(err),
            ("build-report".to_string(), "attempts".to_string())
        );
        assert!(text.contains("uncapped"), "{text}");
        let env = Overrides::from_env([(
            "JOBRAIL_JOB__BUILD_REPORT__ATTEMPTS".to_string(),
            "0".to_string(),
        )])
        .unwrap();
        assert!(r.apply_overrides(&env).is_err());
        assert_eq!(snapshot(&r), before, "nothing applied");
    }

    fn invalid(err: PolicyError) -> (String, String) {
        match err {
            PolicyError::Invalid { job, field, .. } => (job, field.to_string()),
        }
    }

    #[test]
    fn file_errors_name_the_job_and_the_field() {
        let cases = [
            (
                "[jobs.build-report]\nattempts = \"three\"\n",
                "build-report",
                "attempts",
            ),
            (
                "[jobs.build-report]\ntimeout = 30\n",
                "build-report",
                "timeout",
            ),
            (
                "[jobs.build-report]\nbackoff = { initial = 2 }\n",
                "build-report",
                "backoff.initial",
            ),
            (
                "[jobs.build-report]\nbackoff = { multiplier = \"x\" }\n",
                "build-report",
                "backoff.multiplier",
            ),
            (
                "[jobs.send-mail]\ntier_one = { attempts = -1 }\n",
                "send-mail",
                "tier_one.attempts",
            ),
            (
                "[jobs.send-mail.tier_one]\nmax_wait = true\n",
                "send-mail",
                "tier_one.max_wait",
            ),
            (
                "[jobs.build-report]\nretries = 3\n",
                "build-report",
                "retries",
            ),
            (
                "[jobs.build-report]\nbackoff = { start = \"1s\" }\n",
                "build-report",
                "backoff.start",
            ),
            (
                "[jobs.build-report]\nbackoff = \"2s\"\n",
                "build-report",
                "backoff",
            ),
            (
                "[jobs]\nbuild-report = 3\n",
                "build-report",
                "jobs.build-report",
            ),
        ];
        for (text, job, field) in cases {
            let err = Overrides::from_toml(text).unwrap_err();
            assert_eq!(
                invalid(err.clone()),
                (job.to_string(), field.to_string()),
                "{text}: {err}"
            );
        }
        let err = Overrides::from_toml("[jobs.build-report]\nretries = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`attempts`") && err.contains("`tier_one`"),
            "the allowed fields are listed: {err}"
        );
        let err = Overrides::from_toml("[jobs.x]\nattempts = \"three\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("three"), "the value is quoted: {err}");

        // Top-level errors stay consumer-wide.
        for text in ["retries = 3\n", "jobs = 3\n", "[jobs.x\n"] {
            let err = Overrides::from_toml(text).unwrap_err();
            assert_eq!(invalid(err.clone()).0, "*", "{text}: {err}");
        }
    }
}
