//! The quick start: report jobs with injected failures, on the memory driver,
//! or on a broker with `--backend rabbitmq|nats|sqs` (build with the
//! driver's feature; `RABBITMQ_URL`, `NATS_URL`, `SQS_ENDPOINT` point at it),
//! or on Postgres with `--backend postgres` (always built in: jobrail-postgres
//! is a dev-dependency of this crate; `DATABASE_URL` points at it).
//!
//! ```text
//! cargo run -p jobrail-native --example quickstart
//! cargo run -p jobrail-native --example quickstart -- --backend postgres
//! ```
//!
//! On Postgres it uses a schema of its own, `jobrail_quickstart`
//! (`jobrail --backend postgres --schema jobrail_quickstart ...` reads it),
//! installs the tables there if they are missing, and, unless
//! `--consume-only`, first deletes what an earlier run left on its queue
//! (waiting rows and failure records), so each run starts clean.
//!
//! It dispatches one report per behaviour of the example report service,
//! plus a report that fails validation, a poison message and a job name this
//! worker does not know, prints every outcome as the worker settles it, then
//! the failure records, then each job's failure budget and which retry tier
//! resolved its successes.
//!
//! With `--consume-only` it dispatches nothing: it works the queue until it
//! is idle, printing each outcome (a replayed failure record running again,
//! say), and stops.
//!
//! With `--metrics 127.0.0.1:PORT` it serves the worker's metrics in
//! Prometheus's text format at `/metrics` while it runs (add
//! `--metrics-linger SECS` to keep serving that long after the run).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::human;
use jobrail::{
    failure_budget, Envelope, Event, EventKind, EventSink, FailureRecord, Registry, Resolution,
    UnknownNameAttempts,
};
use jobrail_native::{Consumer, Driver, Failures, Producer};
use report_job::{Behaviour, BuildReport};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Prints each outcome as it is accepted, and counts terminal ones.
struct Printer {
    started: Instant,
    names: BTreeMap<String, String>,
    terminal: Mutex<usize>,
    changed: Notify,
}

impl Printer {
    fn label(&self, event: &Event) -> String {
        self.names
            .get(&event.message_id)
            .cloned()
            .unwrap_or_else(|| match event.message_id.as_str() {
                "" => "(unreadable message)".into(),
                // Not dispatched by this run (--consume-only): job and id.
                id => format!("{} {id}", event.job),
            })
    }
}

fn plural(n: u32) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl EventSink for Printer {
    fn emit(&self, event: &Event) {
        let at = self.started.elapsed().as_secs_f32();
        let what = self.label(event);
        let x = event.executions;
        let line = match &event.kind {
            EventKind::Succeeded { resolution } => {
                let tier = match resolution {
                    Resolution::FirstAttempt => "on the first attempt".to_string(),
                    Resolution::TierOne { attempt, of } => {
                        format!("in-process, attempt {attempt} of {of} (tier one)")
                    }
                    Resolution::TierTwo { delivery, of, .. } => {
                        format!("on delivery {delivery} of {of} (tier two)")
                    }
                };
                format!("succeeded {tier}; {x} execution{} this delivery", plural(x))
            }
            EventKind::Retried { delay, error, .. } => format!(
                "delivery {} failed after {x} execution{} ({error}); broker retry in {}",
                event.attempt,
                plural(x),
                delay.map_or("driver default".to_string(), |d| human(Some(d)))
            ),
            EventKind::Rejected { error } => format!("rejected: {error}"),
            EventKind::Failed { failure } => format!(
                "FAILED on delivery {} ({:?}): {}",
                event.attempt, failure.kind, failure.message
            ),
        };
        println!("  {at:5.2}s  {what:<34} {line}");
        if matches!(
            event.kind,
            EventKind::Succeeded { .. } | EventKind::Failed { .. } | EventKind::Rejected { .. }
        ) {
            *self.terminal.lock().unwrap() += 1;
            self.changed.notify_waiters();
        }
    }

    fn settlement_failed(&self, event: &Event, error: &jobrail::SettlementError) {
        println!(
            "  settlement of {} refused by the backend: {error}",
            self.label(event)
        );
    }
}

/// The backend the demo runs on, with a way to read its failure records.
enum Backend {
    Memory(jobrail_native::MemoryDriver),
    #[cfg(feature = "rabbitmq")]
    Rabbit(jobrail_native::rabbitmq::RabbitDriver),
    #[cfg(feature = "nats")]
    Nats(jobrail_native::nats::NatsDriver),
    #[cfg(feature = "sqs")]
    Sqs(jobrail_native::sqs::SqsDriver),
    Postgres(jobrail_postgres::PgDriver),
}

/// The Postgres schema of the quick start: its own, apart from an
/// application's `jobrail`.
const POSTGRES_SCHEMA: &str = "jobrail_quickstart";

/// The backends this build of the example can use.
fn available() -> Vec<&'static str> {
    let mut names = vec!["memory"];
    if cfg!(feature = "rabbitmq") {
        names.push("rabbitmq");
    }
    if cfg!(feature = "nats") {
        names.push("nats");
    }
    if cfg!(feature = "sqs") {
        names.push("sqs");
    }
    names.push("postgres");
    names
}

impl Backend {
    /// Connects to the backend `name`; `fresh`: start from an empty queue
    /// where the backend is the demo's own (Postgres's schema).
    async fn connect(name: &str, fresh: bool) -> Result<Self, Box<dyn std::error::Error>> {
        match name {
            "memory" => Ok(Backend::Memory(jobrail_native::MemoryDriver::default())),
            #[cfg(feature = "rabbitmq")]
            "rabbitmq" => {
                let url = std::env::var("RABBITMQ_URL")
                    .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
                let config = jobrail_native::rabbitmq::RabbitConfig::new(url);
                Ok(Backend::Rabbit(
                    jobrail_native::rabbitmq::RabbitDriver::connect(config).await?,
                ))
            }
            #[cfg(feature = "nats")]
            "nats" => {
                let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
                let config = jobrail_native::nats::NatsConfig::new(url);
                Ok(Backend::Nats(jobrail_native::nats::NatsDriver::connect(config).await?))
            }
            #[cfg(feature = "sqs")]
            "sqs" => {
                let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
                let mut config = jobrail_native::sqs::SqsConfig::new(region);
                // A local emulator (tests/sqs-emulator) takes any static keys.
                if let Ok(endpoint) = std::env::var("SQS_ENDPOINT") {
                    config = config
                        .endpoint(endpoint)
                        .credentials(jobrail_native::sqs::SqsCredentials::fixed("test", "test"));
                }
                Ok(Backend::Sqs(jobrail_native::sqs::SqsDriver::connect(config).await?))
            }
            "postgres" => {
                use jobrail_postgres::{PgConfig, PgDriver};
                let url = std::env::var("DATABASE_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
                let config = PgConfig::new(&url)?.schema(POSTGRES_SCHEMA);
                // The driver never creates its tables: an application runs
                // PgDriver::install from a deploy step (or `jobrail install`).
                PgDriver::install(&config).await?;
                let driver = PgDriver::connect(config).await?;
                if fresh {
                    if let Some(admin) = jobrail_native::Driver::admin(&driver) {
                        admin.delete_queue(report_job::QUEUE).await?;
                    }
                }
                Ok(Backend::Postgres(driver))
            }
            other => Err(format!(
                "unknown backend `{other}`: this build knows {} (build with --features rabbitmq, nats or sqs for more)",
                available().join(", ")
            )
            .into()),
        }
    }

    fn driver(&self) -> Arc<dyn Driver> {
        match self {
            Backend::Memory(d) => Arc::new(d.clone()),
            #[cfg(feature = "rabbitmq")]
            Backend::Rabbit(d) => Arc::new(d.clone()),
            #[cfg(feature = "nats")]
            Backend::Nats(d) => Arc::new(d.clone()),
            #[cfg(feature = "sqs")]
            Backend::Sqs(d) => Arc::new(d.clone()),
            Backend::Postgres(d) => Arc::new(d.clone()),
        }
    }

    async fn failure_records(
        &self,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, Box<dyn std::error::Error>> {
        let entries = Failures::new(self.driver()).all(queue).await?;
        Ok(entries.into_iter().filter_map(|e| e.record).collect())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
                .unwrap_or_else(|_| "off".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    let backend = args
        .iter()
        .position(|a| a == "--backend")
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| std::env::var("JOBRAIL_BACKEND").ok())
        .unwrap_or_else(|| "memory".into());
    let metrics = MetricsEndpoint::from_args(&args)?;
    if let Some(metrics) = &metrics {
        metrics.serve()?;
    }
    let consume = args.iter().any(|a| a == "--consume-only");
    let backend = Backend::connect(&backend, !consume).await?;
    let driver = backend.driver();

    let job = report_job::job()?;
    let mut registry = Registry::new();
    registry.register(&job, report_job::handle)?;
    // Shortened for the demo: an unknown name normally waits 30 s between deliveries, 10 times.
    registry
        .unknown_name_attempts(UnknownNameAttempts::limited(2))
        .unknown_name_retry_delay(Duration::from_millis(500));
    jobrail_native::apply_env_overrides(&mut registry)?;
    if consume {
        return consume_only(driver, registry).await;
    }

    println!(
        "queue quick start on the {} driver, queue `{}`{}\n",
        driver.name(),
        report_job::QUEUE,
        match backend {
            Backend::Postgres(_) => format!(" (schema `{POSTGRES_SCHEMA}`)"),
            _ => String::new(),
        }
    );
    let producer = Producer::new(driver.clone());
    let mut names = BTreeMap::new();
    let behaviours = [
        Behaviour::Healthy,
        Behaviour::Blip,
        Behaviour::BadHost,
        Behaviour::RateLimited,
        Behaviour::Missing,
        Behaviour::Broken,
    ];
    for (i, behaviour) in behaviours.into_iter().enumerate() {
        let report = BuildReport {
            report_id: i as u64 + 1,
            behaviour,
        };
        let id = producer.dispatch(&job).send(&report).await?;
        names.insert(id, format!("report {} ({behaviour:?})", report.report_id));
    }
    let invalid = producer
        .dispatch(&job)
        .send(&BuildReport {
            report_id: 0,
            behaviour: Behaviour::Healthy,
        })
        .await?;
    names.insert(invalid, "report 0 (fails validation)".into());
    let poison = Envelope::new(report_job::NAME, serde_json::json!({"report_id": "seven"}));
    producer
        .send_raw(report_job::QUEUE, poison.id.clone(), poison.encode(), None)
        .await?;
    names.insert(poison.id.clone(), "poison payload".into());
    let unknown = Envelope::new("publish-report", serde_json::json!({"report_id": 1}));
    producer
        .send_raw(
            report_job::QUEUE,
            unknown.id.clone(),
            unknown.encode(),
            None,
        )
        .await?;
    names.insert(unknown.id.clone(), "unknown job `publish-report`".into());
    let total = names.len();
    println!("dispatched {total} messages; outcomes as the worker settles them:\n");

    let printer = Arc::new(Printer {
        started: Instant::now(),
        names,
        terminal: Mutex::new(0),
        changed: Notify::new(),
    });
    registry.event_sink(printer.clone());
    let specs: Vec<_> = registry.specs().cloned().collect();
    let mut consumer = Consumer::builder(driver.clone(), registry).concurrency(4);
    if metrics.is_some() {
        consumer = consumer.queue_depth_every(Duration::from_secs(1));
    }
    let consumer = consumer.build().spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let notified = printer.changed.notified();
        if *printer.terminal.lock().unwrap() >= total {
            break;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            println!("\ngave up waiting after 60 s");
            break;
        }
    }
    let registry = consumer.registry().clone();
    consumer.shutdown().await?;

    // Records of this run only (a broker's failure queue may hold older ones).
    let records: Vec<FailureRecord> = backend
        .failure_records(report_job::QUEUE)
        .await?
        .into_iter()
        .filter(|r| {
            r.message_id
                .as_ref()
                .is_none_or(|id| printer.names.contains_key(id))
        })
        .collect();
    println!("\nfailure records ({}):", records.len());
    for r in &records {
        let what = r.job.clone().unwrap_or_else(|| "?".into());
        println!(
            "  {:<20} {:<15} delivery {} / {} execution{}: {}",
            format!("{:?}", r.kind),
            what,
            r.attempt,
            r.executions,
            plural(r.executions),
            r.reason
        );
    }
    driver.stop().await?;

    let hint = driver.capabilities().redelivery_hint;
    println!("\nfailure budget and resolutions per job:");
    println!(
        "  {:<14} {:>9} {:>10} {:>10} {:>12} {:>9}  {:>5} {:>8} {:>8} {:>6}",
        "job",
        "in-proc N",
        "deliv. M",
        "N x M",
        "worst time",
        "executed",
        "first",
        "tier one",
        "tier two",
        "failed"
    );
    let stats = registry.stats().snapshot();
    for spec in &specs {
        let b = failure_budget(spec, hint);
        let s = stats.get(&spec.name).cloned().unwrap_or_default();
        println!(
            "  {:<14} {:>9} {:>10} {:>10} {:>12} {:>9}  {:>5} {:>8} {:>8} {:>6}",
            spec.name,
            b.in_process,
            b.deliveries.map_or("unlimited".into(), |m| m.to_string()),
            b.executions.map_or("unbounded".into(), |x| x.to_string()),
            human(b.time_to_failure()),
            s.executions,
            s.first_attempt,
            s.tier_one,
            s.tier_two,
            s.failed,
        );
    }
    println!(
        "\n(worst time = tier-one waits in every delivery + tier-two delays + N x M x timeout;"
    );
    println!(" override depths with JOBRAIL_JOB__BUILD_REPORT__TIER_ONE_ATTEMPTS=2 and friends, or a JOBRAIL_CONFIG file)");
    if let Some(metrics) = metrics {
        metrics.linger().await;
    }
    Ok(())
}

/// `--metrics ADDR`: serve the worker's metrics in Prometheus's text format
/// at `http://ADDR/metrics` while the demo runs, and `--metrics-linger SECS`
/// more seconds after it (or until SIGINT/SIGTERM), so a scraper can read
/// the final counts.
struct MetricsEndpoint {
    addr: std::net::SocketAddr,
    linger: Duration,
}

impl MetricsEndpoint {
    fn from_args(args: &[String]) -> Result<Option<Self>, Box<dyn std::error::Error>> {
        let value = |flag: &str| -> Result<Option<&String>, String> {
            match args.iter().position(|a| a == flag) {
                None => Ok(None),
                Some(i) => args
                    .get(i + 1)
                    .map(Some)
                    .ok_or_else(|| format!("{flag} needs a value")),
            }
        };
        let linger =
            match value("--metrics-linger")? {
                None => Duration::ZERO,
                Some(secs) => Duration::from_secs(secs.parse().map_err(|e| {
                    format!("--metrics-linger takes whole seconds, not `{secs}`: {e}")
                })?),
            };
        let Some(addr) = value("--metrics")? else {
            if !linger.is_zero() {
                return Err("--metrics-linger needs --metrics ADDR".into());
            }
            return Ok(None);
        };
        let addr = addr.parse().map_err(|e| {
            format!("--metrics takes an address such as 127.0.0.1:9464, not `{addr}`: {e}")
        })?;
        Ok(Some(MetricsEndpoint { addr, linger }))
    }

    /// Installs the Prometheus recorder with its HTTP listener.
    fn serve(&self) -> Result<(), Box<dyn std::error::Error>> {
        use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
        const SECONDS: &[f64] = &[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ];
        PrometheusBuilder::new()
            .with_http_listener(self.addr)
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)?
            .install()
            .map_err(|e| format!("cannot serve metrics on {}: {e}", self.addr))?;
        jobrail_native::describe_metrics();
        println!("metrics: http://{}/metrics\n", self.addr);
        Ok(())
    }

    /// Keeps serving for the linger time, or until SIGINT/SIGTERM.
    async fn linger(self) {
        if self.linger.is_zero() {
            return;
        }
        println!(
            "\nmetrics: the run is over; serving http://{}/metrics for {} s more",
            self.addr,
            self.linger.as_secs()
        );
        tokio::select! {
            _ = tokio::time::sleep(self.linger) => {}
            _ = jobrail_native::shutdown_signal() => {}
        }
    }
}

/// Forwards events to the printer and notes when the last one came.
struct LastEvent {
    printer: Arc<Printer>,
    at: Mutex<Instant>,
}

impl EventSink for LastEvent {
    fn emit(&self, event: &Event) {
        *self.at.lock().unwrap() = Instant::now();
        self.printer.emit(event);
    }

    fn settlement_failed(&self, event: &Event, error: &jobrail::SettlementError) {
        *self.at.lock().unwrap() = Instant::now();
        self.printer.settlement_failed(event, error);
    }
}

/// `--consume-only`: works the queue, dispatching nothing, until it is
/// idle: no outcome for two seconds and, where the backend reports depths,
/// nothing ready, in flight or delayed. Gives up after 60 s.
async fn consume_only(
    driver: Arc<dyn Driver>,
    mut registry: Registry,
) -> Result<(), Box<dyn std::error::Error>> {
    let queue = report_job::QUEUE;
    println!(
        "consuming queue `{queue}` on the {} driver until it is idle\n",
        driver.name()
    );
    let started = Instant::now();
    let sink = Arc::new(LastEvent {
        printer: Arc::new(Printer {
            started,
            names: BTreeMap::new(),
            terminal: Mutex::new(0),
            changed: Notify::new(),
        }),
        at: Mutex::new(started),
    });
    registry.event_sink(sink.clone());
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(4)
        .build()
        .spawn();
    let quiet = Duration::from_secs(2);
    let deadline = started + Duration::from_secs(60);
    let idle = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if Instant::now() >= deadline {
            break false;
        }
        if sink.at.lock().unwrap().elapsed() < quiet {
            continue;
        }
        let empty = match driver.admin() {
            Some(admin) => {
                let depth = admin.depth(queue).await?;
                depth.ready == 0
                    && depth.in_flight.unwrap_or(0) == 0
                    && depth.delayed.unwrap_or(0) == 0
            }
            // Without depths, a longer silence.
            None => sink.at.lock().unwrap().elapsed() >= quiet * 3,
        };
        if empty {
            break true;
        }
    };
    consumer.shutdown().await?;
    driver.stop().await?;
    let outcomes = *sink.printer.terminal.lock().unwrap();
    if idle {
        println!("\nidle after {outcomes} outcome{}", plural(outcomes as u32));
    } else {
        println!("\ngave up waiting for the queue to empty after 60 s ({outcomes} outcomes)");
    }
    Ok(())
}
