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
}

impl Options {
    /// The defaults, for struct-update syntax in a `const`.
    pub const DEFAULT: Options = Options {
        wrangler: "",
        failure_queue: None,
        concurrency: 1,
        queue_concurrency: &[],
        log_settlements: true,
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
/// variables applied, checked against wrangler.toml (every problem named,
/// with its job and field), the settlement log installed.
pub(crate) fn build_consumer(
    queue: &str,
    mut registry: Registry,
    options: &Options,
    var: &dyn Fn(&str) -> Option<String>,
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
    let checked = check(&registry, options, Some(queue))?;
    let config = checked.edge_config(config);
    if options.log_settlements {
        let inner = registry.current_event_sink();
        // The registry takes an `Arc` on every target; on wasm32 (one
        // thread) the sink need not be `Send`.
        #[allow(clippy::arc_with_non_send_sync)]
        let sink = Arc::new(LogSink::new(inner));
        registry.event_sink(sink);
    }
    EdgeConsumer::with_runtime(registry, config, runtime).map_err(|e| e.to_string())
}

/// Checks `options.wrangler` against the jobs of `registry`: the queues the
/// jobs name, the queues of `options.queue_concurrency` and `queue` (the
/// queue about to be consumed, if given) are all held to every rule of
/// [`Wrangler::check_consumed`]. The error lists every problem, one per line.
pub fn check(
    registry: &Registry,
    options: &Options,
    queue: Option<&str>,
) -> Result<Checked, String> {
    let wrangler = Wrangler::parse(options.wrangler).map_err(|e| format!("wrangler.toml: {e}"))?;
    let mut also: Vec<&str> = options.queue_concurrency.iter().map(|(q, _)| *q).collect();
    also.extend(queue);
    wrangler
        .check_consumed(registry, options.failure_queue, &also)
        .map_err(|problems| {
            let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
            format!(
                "wrangler.toml does not fit the jobs:\n  {}",
                list.join("\n  ")
            )
        })
}
