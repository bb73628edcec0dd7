//! `jobrail budget`: each job's failure budget from the worker's overrides.
//!
//! The tool has no job declarations of the application, so each job is the
//! library's defaults plus the overrides: the output says so.

use std::fmt::Write as _;
use std::time::Duration;

use jobrail::{
    failure_budget, human, FailureBudget, Job, JobContext, Overrides, PolicyError, Registry,
};
use serde_json::{json, Value};

use crate::commands::Output;
use crate::error::CliError;

/// Where the overrides came from, for the output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Sources {
    /// `JOBRAIL_CONFIG`, when set.
    pub(crate) config_file: Option<String>,
    /// The `JOBRAIL_JOB__...` variables set, by name.
    pub(crate) variables: Vec<String>,
}

/// The redelivery timing counted for jobs without a backoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hint {
    /// The backend it is for (`None`: no backend named).
    pub(crate) backend: Option<&'static str>,
    /// How long.
    pub(crate) wait: Duration,
    /// What the wait is (`the default visibility timeout`).
    pub(crate) what: &'static str,
}

/// What the output says about the numbers' origin.
pub(crate) const DEFAULTS_NOTE: &str =
    "Computed from the library's defaults plus the overrides: the tool does not have the \
application's job declarations, so a field the configuration does not set shows the library's \
default, which the application's code may have changed.";

/// The budget of each job `overrides` names exactly, and of each of `extra`.
pub(crate) fn budget(
    overrides: &Overrides,
    extra: &[String],
    sources: &Sources,
    hint: &Hint,
) -> Result<Output, CliError> {
    let mut names: Vec<String> = overrides.named_jobs().map(str::to_string).collect();
    for name in extra {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    if names.is_empty() {
        return Err(CliError::usage(match &sources.config_file {
            None => "no jobs to compute: JOBRAIL_CONFIG is not set (point it at the worker's overrides file) and no --job was given".to_string(),
            Some(path) => format!("no jobs to compute: {path} names no job ([jobs.<name>] tables) and no --job was given"),
        }));
    }
    let mut registry = Registry::new();
    for name in &names {
        let job = Job::<Value>::builder(name.clone()).build()?;
        registry
            .register(&job, |_: JobContext, _: Value| async { Ok(()) })
            .map_err(|e| CliError::usage(e.to_string()))?;
    }
    registry.apply_overrides(overrides).map_err(|e| match &e {
        PolicyError::Invalid { field, .. } if field == "job" => CliError::usage(format!(
            "{e}: the tool knows only the jobs the file names and those given with --job NAME"
        )),
        _ => CliError::from(e),
    })?;
    let budgets: Vec<FailureBudget> = names
        .iter()
        .filter_map(|name| registry.spec(name))
        .map(|spec| failure_budget(spec, hint.wait))
        .collect();
    Ok(render(&budgets, sources, hint))
}

fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

fn render(budgets: &[FailureBudget], sources: &Sources, hint: &Hint) -> Output {
    let mut text = String::new();
    let _ = writeln!(text, "failure budget per job");
    let _ = writeln!(
        text,
        "  overrides: {}; variables: {}",
        sources
            .config_file
            .as_deref()
            .map_or("JOBRAIL_CONFIG not set".to_string(), |p| format!(
                "JOBRAIL_CONFIG={p}"
            )),
        if sources.variables.is_empty() {
            "no JOBRAIL_JOB__ variables".to_string()
        } else {
            sources.variables.join(", ")
        }
    );
    let _ = match hint.backend {
        Some(backend) => writeln!(
            text,
            "  jobs without a backoff wait {} between deliveries on {backend} ({})",
            human(Some(hint.wait)),
            hint.what
        ),
        None => writeln!(
            text,
            "  no --backend: jobs without a backoff count no wait between deliveries"
        ),
    };
    let _ = writeln!(
        text,
        "\n  {:<20} {:>9} {:>10} {:>10} {:>12} {:>12}",
        "job", "in-proc N", "deliv. M", "N x M", "waiting", "worst time"
    );
    for b in budgets {
        let _ = writeln!(
            text,
            "  {:<20} {:>9} {:>10} {:>10} {:>12} {:>12}",
            b.job,
            b.in_process,
            b.deliveries.map_or("unlimited".into(), |m| m.to_string()),
            b.executions.map_or("unbounded".into(), |x| x.to_string()),
            human(b.waiting),
            human(b.time_to_failure()),
        );
    }
    let _ = writeln!(
        text,
        "\n(worst time = waiting + N x M x timeout; unbounded without a timeout or an attempt cap)"
    );
    let _ = writeln!(text, "{DEFAULTS_NOTE}");
    let json = json!({
        "config_file": sources.config_file,
        "variables": sources.variables,
        "backend": hint.backend,
        "redelivery_hint_ms": hint.wait.as_millis() as u64,
        "note": DEFAULTS_NOTE,
        "jobs": budgets.iter().map(|b| json!({
            "job": b.job,
            "in_process": b.in_process,
            "deliveries": b.deliveries,
            "executions": b.executions,
            "waiting_ms": ms(b.waiting),
            "executing_ms": ms(b.executing),
            "time_to_failure_ms": ms(b.time_to_failure()),
        })).collect::<Vec<_>>(),
    });
    Output { text, json }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint() -> Hint {
        Hint {
            backend: Some("sqs"),
            wait: Duration::from_secs(30),
            what: "the default visibility timeout",
        }
    }

    fn sources() -> Sources {
        Sources {
            config_file: Some("jobs.toml".into()),
            variables: vec![],
        }
    }

    #[test]
    fn jobs_are_the_defaults_plus_the_file() {
        let file = Overrides::from_toml(
            r#"
            [jobs.build-report]
            attempts = 3
            timeout = "10s"
            backoff = { initial = "1s", multiplier = 2.0, max = "10s" }
            tier_one = { attempts = 3, initial = "50ms", max = "200ms", max_wait = "500ms" }

            [jobs.send-mail]
            attempts = 4
            "#,
        )
        .unwrap();
        let out = budget(&file, &[], &sources(), &hint()).unwrap();
        let jobs = out.json["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 2);
        // build-report: N = 3, M = 3; tier one waits 500ms twice per
        // delivery (max_wait beats the backoff), tier two 1s + 2s; nine
        // executions of 10s.
        assert_eq!(jobs[0]["job"], "build-report");
        assert_eq!(jobs[0]["executions"], 9);
        assert_eq!(jobs[0]["waiting_ms"], 3 * 1000 + 3000);
        assert_eq!(jobs[0]["time_to_failure_ms"], 6000 + 90_000);
        // send-mail: the library's defaults (1 in-process attempt, no
        // backoff, no timeout) with 4 deliveries: the backend's 30s between
        // deliveries, no bound on time without a timeout.
        assert_eq!(jobs[1]["job"], "send-mail");
        assert_eq!(jobs[1]["in_process"], 1);
        assert_eq!(jobs[1]["deliveries"], 4);
        assert_eq!(jobs[1]["waiting_ms"], 90_000);
        assert_eq!(jobs[1]["time_to_failure_ms"], Value::Null);
        assert!(out.text.contains("library's defaults"), "{}", out.text);
        assert!(
            out.text.contains("JOBRAIL_CONFIG=jobs.toml"),
            "{}",
            out.text
        );
        assert!(
            out.text.contains("30s between deliveries on sqs"),
            "{}",
            out.text
        );
        let row = out
            .text
            .lines()
            .find(|l| l.contains("build-report"))
            .unwrap();
        assert!(row.ends_with("1m 36s"), "{row}");
    }

    #[test]
    fn environment_overrides_need_their_job_named() {
        let env = Overrides::from_env([(
            "JOBRAIL_JOB__SEND_MAIL__ATTEMPTS".to_string(),
            "7".to_string(),
        )])
        .unwrap();
        let err = budget(&env, &[], &sources(), &hint()).unwrap_err();
        assert!(err.message.contains("no jobs to compute"), "{err}");
        let err = budget(&env, &["resize".into()], &sources(), &hint()).unwrap_err();
        assert!(
            err.message.contains("JOBRAIL_JOB__SEND_MAIL__*") && err.message.contains("--job NAME"),
            "{err}"
        );
        let out = budget(&env, &["send-mail".into()], &sources(), &hint()).unwrap();
        assert_eq!(out.json["jobs"][0]["deliveries"], 7);
    }

    #[test]
    fn invalid_overrides_are_refused() {
        let file =
            Overrides::from_toml("[jobs.build-report]\ntier_one = { attempts = 0 }\n").unwrap();
        let err = budget(&file, &[], &sources(), &hint()).unwrap_err();
        assert!(err.message.contains("tier_one.attempts"), "{err}");
        let err = budget(
            &Overrides::default(),
            &["has space".into()],
            &sources(),
            &hint(),
        )
        .unwrap_err();
        assert!(err.message.contains("not allowed"), "{err}");
    }
}
