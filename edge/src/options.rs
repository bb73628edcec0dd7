//! What a worker's consumer is built from: the jobs (in Rust), the consumer
//! settings (in wrangler.toml, embedded at build time), and a few options.
//! Pure, so the native harness builds consumers exactly as the Worker does.

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Registry, Runtime, UnknownNameAttempts};

use crate::batch::EdgeConsumer;
use crate::log::LogSink;
use crate::settings::EdgeConfig;
use crate::wrangler::{Checked, Wrangler};

/// A worker's schedules ([`Options::schedules`]), or why they do not build.
pub type SchedulesFn = fn() -> Result<Vec<jobrail::Schedule>, String>;

/// Options of a worker built with [`crate::consumer!`].
///
/// An operator may retune a deployed worker without rebuilding it through
/// Worker variables (in `[vars]` or with `wrangler --var`), read when the
/// consumer is built: `EDGE_BUDGET_MS` and `EDGE_RESERVE_MS`
/// ([`EdgeConfig::budget`](crate::EdgeConfig::budget) and
/// [`EdgeConfig::settlement_reserve`](crate::EdgeConfig::settlement_reserve)),
/// `EDGE_CONCURRENCY` (overrides `concurrency`), `UNKNOWN_NAME_ATTEMPTS` and
/// `UNKNOWN_NAME_RETRY_DELAY_MS` (the registry's unknown-name cap and delay).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// The text of the worker's wrangler.toml (the macro embeds it). The
    /// consumer settings it declares are checked against the jobs.
    pub wrangler: &'static str,
    /// A producer binding that receives failure records before the ack.
    pub failure_queue: Option<&'static str>,
    /// Messages handled at once per invocation (default 1: in order).
    pub concurrency: usize,
    /// Per-queue overrides of `concurrency`. A queue listed here is consumed
    /// with the jobs even if no job names it (a second queue the producers
    /// send the same jobs to), and held to the same wrangler.toml checks.
    pub queue_concurrency: &'static [(&'static str, usize)],
    /// Log every settlement as one structured line (default on).
    pub log_settlements: bool,
    /// The schedules the Worker fires from its Cron Triggers
    /// ([`EdgeScheduler`](crate::EdgeScheduler)): set by the
    /// [`consumer!`](crate::consumer!) macro's `schedules = FN`, which also
    /// exports the `scheduled` handler. When set, the wrangler.toml check
    /// holds `[triggers] crons` to them
    /// ([`check_triggers`](crate::schedules::check_triggers)).
    pub schedules: Option<SchedulesFn>,
    /// The D1 binding the schedules' ticks are claimed in (default
    /// `CLAIMS_DB`, a `[[d1_databases]]` entry).
    pub schedule_claims: &'static str,
}

impl Options {
    /// The defaults, for struct-update syntax in a `const`.
    pub const DEFAULT: Options = Options {
        wrangler: "",
        failure_queue: None,
        concurrency: 1,
        queue_concurrency: &[],
        log_settlements: true,
        schedules: None,
        schedule_claims: "CLAIMS_DB",
    };
}

impl Default for Options {
    fn default() -> Self {
        Options::DEFAULT
    }
}

/// Worker variables an operator may set (see [`Options`]). The native
/// harness refuses any other name.
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
pub(crate) const VARIABLES: &[&str] = &[
    "EDGE_BUDGET_MS",
    "EDGE_RESERVE_MS",
    "EDGE_CONCURRENCY",
    "UNKNOWN_NAME_ATTEMPTS",
    "UNKNOWN_NAME_RETRY_DELAY_MS",
];

/// Builds the consumer of `queue`: the registry with the operator's
/// variables applied, checked against the sections of wrangler.toml the
/// Worker can be running with (every problem named, with its section, job
/// and field), the settlement log installed. `var` reads the Worker's
/// variables and `bound` says whether a producer binding exists.
///
/// The Worker cannot see which configuration it was started with, only its
/// bindings and variables, so it checks every section of the embedded
/// wrangler.toml (the top level and each `[env.*]`) that consumes `queue`
/// with those bindings ([`Wrangler::could_be_running`]). None:
/// it was started from a configuration the check never saw (`wrangler dev
/// -c other.toml`, say), whose consumer settings it cannot know, and it
/// refuses to build a consumer (the batch is handed back).
pub(crate) fn build_consumer(
    queue: &str,
    mut registry: Registry,
    options: &Options,
    var: &dyn Fn(&str) -> Option<String>,
    bound: &dyn Fn(&str) -> bool,
    runtime: Arc<dyn Runtime>,
) -> Result<EdgeConsumer, String> {
    let number = |name: &str| -> Result<Option<u64>, String> {
        match var(name) {
            None => Ok(None),
            Some(text) => text
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| format!("variable {name} = {text:?} is not a whole number")),
        }
    };
    if let Some(n) = number("UNKNOWN_NAME_ATTEMPTS")? {
        let n =
            u32::try_from(n).map_err(|_| format!("UNKNOWN_NAME_ATTEMPTS = {n} is too large"))?;
        registry.unknown_name_attempts(UnknownNameAttempts::limited(n));
    }
    if let Some(ms) = number("UNKNOWN_NAME_RETRY_DELAY_MS")? {
        registry.unknown_name_retry_delay(Duration::from_millis(ms));
    }
    let mut config = EdgeConfig {
        failure_queue: options.failure_queue.map(str::to_string),
        concurrency: options
            .queue_concurrency
            .iter()
            .find(|(q, _)| *q == queue)
            .map_or(options.concurrency, |(_, n)| *n),
        ..EdgeConfig::default()
    };
    if let Some(ms) = number("EDGE_BUDGET_MS")? {
        config.budget = Duration::from_millis(ms);
    }
    if let Some(ms) = number("EDGE_RESERVE_MS")? {
        config.settlement_reserve = Duration::from_millis(ms);
    }
    if let Some(n) = number("EDGE_CONCURRENCY")? {
        config.concurrency = n as usize;
    }
    let checked = check_running(&registry, options, queue, bound)?;
    let config = checked.edge_config(config);
    if options.log_settlements {
        let inner = registry.current_event_sink();
        // The registry takes an `Arc` on every target; on wasm32 (one
        // thread) the sink need not be `Send`.
        #[allow(clippy::arc_with_non_send_sync)]
        let sink = Arc::new(LogSink::new(inner));
        registry.event_sink(sink);
    }
    let mut consumer =
        EdgeConsumer::with_runtime(registry, config, runtime).map_err(|e| e.to_string())?;
    for (queue, binding) in checked.queue_bindings() {
        consumer = consumer.with_queue_binding(queue, binding);
    }
    Ok(consumer)
}

/// Checks the top level of `options.wrangler` against the jobs of
/// `registry`: the queues the jobs name, the queues of
/// `options.queue_concurrency` and `queue` (the queue about to be consumed,
/// if given) are all held to every rule of [`Wrangler::check_consumed`].
/// The error lists every problem, one per line. [`check_file`] checks every
/// section; a Worker checks the sections it can be running with.
pub fn check(
    registry: &Registry,
    options: &Options,
    queue: Option<&str>,
) -> Result<Checked, String> {
    let wrangler = Wrangler::parse(options.wrangler).map_err(|e| format!("wrangler.toml: {e}"))?;
    check_section(registry, options, &wrangler, queue, "wrangler.toml")
}

/// One section held to the rules, its problems listed under `file` and the
/// section's name.
fn check_section(
    registry: &Registry,
    options: &Options,
    wrangler: &Wrangler,
    queue: Option<&str>,
    file: &str,
) -> Result<Checked, String> {
    let mut also: Vec<&str> = options.queue_concurrency.iter().map(|(q, _)| *q).collect();
    also.extend(queue);
    let place = match wrangler.env() {
        None => file.to_string(),
        Some(_) => format!("{file}, {}", wrangler.section_name()),
    };
    let checked = wrangler.check_consumed(registry, options.failure_queue, &also);
    let mut problems = match &checked {
        Ok(_) => Vec::new(),
        Err(problems) => problems.iter().map(ToString::to_string).collect(),
    };
    if let Some(schedules) = options.schedules {
        match schedules() {
            Ok(schedules) => problems.extend(
                crate::schedules::check_triggers(wrangler, &schedules, options.schedule_claims)
                    .iter()
                    .map(ToString::to_string),
            ),
            Err(e) => problems.push(format!("the schedules do not build: {e}")),
        }
    }
    match checked {
        Ok(checked) if problems.is_empty() => Ok(checked),
        _ => Err(format!(
            "{place} does not fit the jobs:\n  {}",
            problems.join("\n  ")
        )),
    }
}

/// The check a Worker runs for `queue` (see [`build_consumer`]): every
/// section of the embedded wrangler.toml it can be running with must fit
/// the jobs, and there must be one. Of several, the one whose consumers give
/// up first decides the platform's `max_retries`.
fn check_running(
    registry: &Registry,
    options: &Options,
    queue: &str,
    bound: &dyn Fn(&str) -> bool,
) -> Result<Checked, String> {
    let sections =
        Wrangler::parse_all(options.wrangler).map_err(|e| format!("wrangler.toml: {e}"))?;
    let mut checked: Option<Checked> = None;
    for section in sections.iter().filter(|s| s.could_be_running(queue, bound)) {
        let this = check_section(registry, options, section, Some(queue), "wrangler.toml")?;
        if checked
            .as_ref()
            .is_none_or(|c| this.platform_max_retries() < c.platform_max_retries())
        {
            checked = Some(this);
        }
    }
    checked.ok_or_else(|| {
        format!(
            "the worker consumes `{queue}` from a configuration its wrangler.toml check never saw: no \
             section of the wrangler.toml built into it (the top level or an [env.*]) consumes \
             `{queue}` with the producer bindings this worker has, so its max_retries \
             and dead-letter queue are unknown; start it from a checked configuration (wrangler.toml, \
             or --env with one of its [env.*] sections), or put this configuration in wrangler.toml as \
             an [env.*] section"
        )
    })
}

/// Whether any section of the wrangler configuration `text` (the top level
/// or an `[env.*]`) has a consumer entry for `queue`. A text that does not
/// parse declares nothing.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub(crate) fn declares_consumer(text: &str, queue: &str) -> bool {
    Wrangler::parse_all(text)
        .map(|sections| sections.iter().any(|s| s.consumer(queue).is_some()))
        .unwrap_or(false)
}

/// Checks every section of the wrangler configuration `text` (named `file`
/// in messages) against the jobs: the top level, and each `[env.*]` that
/// declares queue consumers (one that declares none consumes nothing, and
/// is not a consumer of these jobs). Returns the sections checked; the
/// error lists every problem of every section.
pub fn check_file(
    registry: &Registry,
    options: &Options,
    text: &str,
    file: &str,
) -> Result<Vec<String>, String> {
    let sections = Wrangler::parse_all(text).map_err(|e| format!("{file}: {e}"))?;
    let mut checked = Vec::new();
    let mut problems = Vec::new();
    for section in &sections {
        if section.env().is_some() && section.consumers().is_empty() {
            continue;
        }
        match check_section(registry, options, section, None, file) {
            Ok(_) => checked.push(match section.env() {
                None => file.to_string(),
                Some(_) => format!("{file}, {}", section.section_name()),
            }),
            Err(problem) => problems.push(problem),
        }
    }
    if problems.is_empty() {
        Ok(checked)
    } else {
        Err(problems.join("\n"))
    }
}

/// Checks every wrangler configuration a Worker can be started with from
/// `dir`, its directory: `embedded` (the file the worker embeds, named
/// `embedded_name`) and every other TOML file there that is a wrangler
/// configuration (one with `main`, `compatibility_date` or `queues`), each
/// with all its sections ([`check_file`]), so that `wrangler dev -c
/// other.toml` or `--env staging` cannot start a build whose consumer
/// settings the check never saw. A `wrangler.json` or `wrangler.jsonc`
/// there is refused: the check reads TOML only. What the consumer macro's
/// native test runs (the build command runs it first). Returns what was
/// checked, one line each.
#[cfg(not(target_arch = "wasm32"))]
pub fn check_directory(
    registry: &Registry,
    options: &Options,
    dir: &std::path::Path,
    embedded_name: &str,
) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    // (name, text) of every configuration to check, the embedded one first.
    let mut files = vec![(embedded_name.to_string(), options.wrangler.to_string())];
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut paths: Vec<std::path::PathBuf> =
        entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name == embedded_name || !path.is_file() {
            continue;
        }
        if name == "wrangler.json" || name == "wrangler.jsonc" {
            problems.push(format!(
                "{name}: a wrangler configuration this check cannot read (it reads TOML): write it \
                 as a wrangler.toml [env.*] section, or the worker could be started with consumer \
                 settings nobody checked"
            ));
            continue;
        }
        if !name.ends_with(".toml") || name == "Cargo.toml" {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        match toml::from_str::<toml::Table>(&text) {
            Ok(table)
                if ["main", "compatibility_date", "queues"]
                    .iter()
                    .any(|key| table.contains_key(*key)) =>
            {
                files.push((name.to_string(), text));
            }
            Ok(_) => {}
            Err(e) if name.starts_with("wrangler") => problems.push(format!("{name}: {e}")),
            Err(_) => {}
        }
    }
    let mut checked = Vec::new();
    for (name, text) in &files {
        match check_file(registry, options, text, name) {
            Ok(sections) => checked.extend(sections),
            Err(problem) => problems.push(problem),
        }
    }
    if problems.is_empty() {
        Ok(checked)
    } else {
        Err(problems.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jobrail::{Job, JobContext, UnknownNameAttempts, VirtualRuntime};

    use super::*;

    fn registry() -> Registry {
        let job = Job::<u32>::builder("send-welcome-email")
            .queue("emails")
            .max_deliveries(5)
            .backoff(Duration::from_secs(1), 2.0, Duration::from_secs(60))
            .build()
            .unwrap();
        let mut registry = Registry::new();
        registry
            .register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
        registry.unknown_name_attempts(UnknownNameAttempts::limited(3));
        registry
    }

    /// A consumer of `queue` giving `max_retries`, with a dead-letter
    /// queue or not, and the producer binding `binding` to it.
    fn consumer(table: &str, queue: &str, max_retries: u32, dlq: bool, binding: &str) -> String {
        let dlq = if dlq {
            format!("dead_letter_queue = \"{queue}-dlq\"\n")
        } else {
            String::new()
        };
        format!(
            "[[{table}queues.producers]]\nqueue = \"{queue}\"\nbinding = \"{binding}\"\n\n\
             [[{table}queues.consumers]]\nqueue = \"{queue}\"\nmax_retries = {max_retries}\n{dlq}\n"
        )
    }

    const GOOD: &str =
        "name = \"w\"\nmain = \"build/index.js\"\ncompatibility_date = \"2026-04-20\"\n\n";

    fn options(text: &'static str) -> Options {
        Options {
            wrangler: text,
            ..Options::DEFAULT
        }
    }

    fn leak(text: String) -> &'static str {
        Box::leak(text.into_boxed_str())
    }

    /// Before: only the top level was checked, so an `[env.staging]` that
    /// drops messages passed.
    #[test]
    fn every_environment_is_checked() {
        let text = leak(format!(
            "{GOOD}{}{}",
            consumer("", "emails", 10, true, "EMAILS"),
            consumer("env.staging.", "emails", 1, false, "EMAILS")
        ));
        assert!(
            check(&registry(), &options(text), None).is_ok(),
            "the top level fits"
        );
        let err = check_file(&registry(), &options(text), text, "wrangler.toml").unwrap_err();
        assert!(err.contains("wrangler.toml, [env.staging]"), "{err}");
        assert!(
            err.contains("max_retries = 1") && err.contains("dead_letter_queue"),
            "{err}"
        );
        assert!(
            !err.contains("wrangler.toml does not fit"),
            "the top level fits: {err}"
        );
        // An environment without consumers consumes nothing: not checked.
        let text = leak(format!(
            "{GOOD}{}[env.docs]\nname = \"docs\"\n",
            consumer("", "emails", 10, true, "EMAILS")
        ));
        let checked = check_file(&registry(), &options(text), text, "wrangler.toml").unwrap();
        assert_eq!(checked, ["wrangler.toml"]);
    }

    /// Before: `wrangler dev -c other.toml` was never checked.
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn every_configuration_of_the_directory_is_checked() {
        let dir = std::env::temp_dir().join(format!(
            "jobrail-edge-check-{}-{}",
            std::process::id(),
            jobrail::new_message_id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let good = leak(format!(
            "{GOOD}{}",
            consumer("", "emails", 10, true, "EMAILS")
        ));
        std::fs::write(dir.join("wrangler.toml"), good).unwrap();
        std::fs::write(dir.join("Cargo.toml"), "[package]\nname = \"w\"\n").unwrap();
        std::fs::write(dir.join("rustfmt.toml"), "edition = \"2021\"\n").unwrap();
        let checked = check_directory(&registry(), &options(good), &dir, "wrangler.toml").unwrap();
        assert_eq!(checked, ["wrangler.toml"]);

        let other = format!("{GOOD}{}", consumer("", "emails", 1, false, "EMAILS"));
        std::fs::write(dir.join("other.toml"), other).unwrap();
        let err = check_directory(&registry(), &options(good), &dir, "wrangler.toml").unwrap_err();
        assert!(err.contains("other.toml does not fit"), "{err}");
        std::fs::remove_file(dir.join("other.toml")).unwrap();

        std::fs::write(dir.join("wrangler.jsonc"), "{}").unwrap();
        let err = check_directory(&registry(), &options(good), &dir, "wrangler.toml").unwrap_err();
        assert!(
            err.contains("wrangler.jsonc") && err.contains("TOML"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn build(text: &'static str, queue: &str, bindings: &[&str]) -> Result<EdgeConsumer, String> {
        let bound = |binding: &str| bindings.contains(&binding);
        build_consumer(
            queue,
            registry(),
            &Options {
                log_settlements: false,
                ..options(text)
            },
            &|_| None,
            &bound,
            Arc::new(VirtualRuntime::new()),
        )
    }

    /// A Worker checks the sections it can be running with, and refuses
    /// (the batch is handed back) when it can be running with none: a
    /// configuration its check never saw.
    #[test]
    fn a_worker_refuses_a_configuration_its_check_never_saw() {
        let text = leak(format!(
            "{GOOD}{}{}",
            consumer("", "emails", 10, true, "EMAILS"),
            consumer("env.staging.", "emails", 10, true, "EMAILS_STAGING")
        ));
        assert!(build(text, "emails", &["EMAILS"]).is_ok());
        assert!(build(text, "emails", &["EMAILS_STAGING"]).is_ok());
        // Another queue, or other bindings: none of the sections.
        for (queue, bindings) in [
            ("emails-other", &["EMAILS"][..]),
            ("emails", &["OTHER"][..]),
            ("emails", &[][..]),
        ] {
            let err = build(text, queue, bindings).err().expect("refused");
            assert!(err.contains("never saw"), "{queue}: {err}");
        }
        // A section the Worker can be running with that does not fit.
        let text = leak(format!(
            "{GOOD}{}{}",
            consumer("", "emails", 10, true, "EMAILS"),
            consumer("env.staging.", "emails", 1, false, "EMAILS")
        ));
        let err = build(text, "emails", &["EMAILS"]).err().expect("refused");
        assert!(err.contains("[env.staging]"), "{err}");
        // Which queues some section consumes (a batch of any other goes to
        // the jobs' consumer, which refuses it).
        assert!(declares_consumer(text, "emails"));
        assert!(!declares_consumer(text, "emails-other"));
        assert!(!declares_consumer("not toml [", "emails"));
    }
}
