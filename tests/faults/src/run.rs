//! The orchestrator: dispatches, spawns workers (its own executable with
//! `worker`), injects the faults, accounts for every dispatched business id
//! and writes the report.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use clap::{Args, ValueEnum};
use futures_util::stream::{self, StreamExt};
use jobrail::{FailureRecord, Job};
use jobrail_native::{DriverError, Producer};
use tokio::time::Instant;

use crate::backend::{Conn, Kind, Target};
use crate::nodes;
use crate::worker::{self, Item, Mode};

#[cfg(feature = "postgres")]
mod partition;
#[cfg(feature = "postgres")]
pub(crate) use partition::{dispatcher, DispatcherArgs};

/// A fault the suite injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub(crate) enum Fault {
    /// Load with workers SIGKILLed and restarted.
    Kill,
    /// The broker stopped and started while a worker consumes.
    Restart,
    /// A handler that aborts the process on every delivery.
    Crash,
    /// A handler running three leases.
    Slow,
    /// Kill load with a handler charging each id once through a Postgres
    /// claim (feature `postgres`); on the Postgres queue, through
    /// transactional completion instead.
    Charge,
    /// The Postgres queue's connections terminated by the server
    /// (`pg_terminate_backend`) under load (Postgres only).
    Terminate,
    /// A clean partition: every worker and the dispatcher cut off from
    /// every server (links down, no reset) for four leases, then healed.
    Partition,
    /// One worker of three cut off for four leases while the others run.
    Isolate,
    /// Every link slow: each chunk held 200 ms, both ways, for four leases.
    SlowLink,
    /// One worker's connections half-open: nothing from the servers reaches
    /// it any more while its own bytes still arrive.
    HalfOpen,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill load",
            Fault::Restart => "broker restart",
            Fault::Crash => "crash loop",
            Fault::Slow => "slow handler",
            Fault::Charge => "exactly-once charge",
            Fault::Terminate => "connections terminated",
            Fault::Partition => "partition",
            Fault::Isolate => "one worker cut off",
            Fault::SlowLink => "slow link",
            Fault::HalfOpen => "half-open connection",
        }
    }

    /// Whether this is a partition fault (network namespaces, root).
    fn partition(self) -> bool {
        matches!(
            self,
            Fault::Partition | Fault::Isolate | Fault::SlowLink | Fault::HalfOpen
        )
    }
}

/// `jobrail-faults run`: the whole suite, or a part of it.
#[derive(Args, Debug, Clone)]
pub(crate) struct RunArgs {
    /// Backends to run on (default: memory and every driver this build has).
    #[arg(long, value_enum, value_delimiter = ',')]
    backend: Vec<Kind>,
    /// Faults to inject (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    fault: Vec<Fault>,
    /// Jobs of the kill-load fault on RabbitMQ and NATS.
    #[arg(long, default_value_t = 5000)]
    jobs: usize,
    /// Jobs of the kill-load fault on SQS (the emulator takes about 15
    /// dispatches a second).
    #[arg(long, default_value_t = 300)]
    sqs_jobs: usize,
    /// Worker kills in the kill-load fault.
    #[arg(long, default_value_t = 6)]
    kills: usize,
    /// Charges of the exactly-once charge fault on RabbitMQ and NATS.
    #[arg(long, default_value_t = 1000)]
    charges: usize,
    /// Charges of the exactly-once charge fault on SQS.
    #[arg(long, default_value_t = 150)]
    sqs_charges: usize,
    /// Worker kills in the exactly-once charge fault.
    #[arg(long, default_value_t = 5)]
    charge_kills: usize,
    /// Jobs of the kill-load and connections-terminated faults on the
    /// Postgres queue (fewer than on the brokers: its workers share the
    /// machine's two cores with the server).
    #[arg(long, default_value_t = 2000)]
    pg_jobs: usize,
    /// Charges of the exactly-once charge fault on the Postgres queue.
    #[arg(long, default_value_t = 500)]
    pg_charges: usize,
    /// Charges of each partition fault (RabbitMQ, NATS, the Postgres queue).
    #[arg(long, default_value_t = 300)]
    partition_charges: usize,
    /// Charges of each partition fault on SQS.
    #[arg(long, default_value_t = 100)]
    sqs_partition_charges: usize,
    /// How long a partition, a cut-off worker or a slow link lasts, in
    /// leases (the lease is 2 s).
    #[arg(long, default_value_t = 4)]
    partition_leases: u32,
    /// Output directory (default: `target/faults` of the build's target directory).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One row of the report.
struct Row {
    backend: Kind,
    fault: Fault,
    dispatched: String,
    executed: String,
    duplicates: String,
    lost: String,
    records: String,
    recovery: String,
    notes: String,
}

impl Row {
    fn na(backend: Kind, fault: Fault, why: &str) -> Row {
        let na = || "n/a".to_string();
        Row {
            backend,
            fault,
            dispatched: na(),
            executed: na(),
            duplicates: na(),
            lost: na(),
            records: na(),
            recovery: na(),
            notes: why.into(),
        }
    }
}

/// One dispatch during an outage.
struct OutageCall {
    backend: Kind,
    what: String,
    outcome: String,
    latency: Duration,
}

/// What one run has: where it writes, its secrets, its results.
struct Suite {
    run: String,
    exe: PathBuf,
    work: PathBuf,
    logs: PathBuf,
    marker: String,
    /// (label, value) of every secret the logs must not show.
    secrets: Vec<(String, String)>,
    rows: Vec<Row>,
    outage: Vec<OutageCall>,
    problems: Vec<String>,
    workers_spawned: usize,
}

fn random_text(n: usize) -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(n)
        .collect()
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Effects and start lines read from a ledger (and, for the charge fault,
/// the charges from its table).
#[derive(Default)]
struct Tally {
    /// Effects per business id (charge fault: rows of the ledger table).
    effects: BTreeMap<u64, usize>,
    starts: BTreeMap<u64, usize>,
    /// `deliver` lines per business id (charge fault).
    deliveries: BTreeMap<u64, usize>,
    /// The worker pid of each id's latest `deliver` line.
    delivered_by: BTreeMap<u64, u32>,
    /// Deliveries whose claim found the charge done.
    skips: usize,
    /// Deliveries whose claim found another holder's live lease.
    held: usize,
    /// Completions refused as too late (the charge rolled back).
    lost_claims: usize,
    /// The highest fence of each id's charges.
    #[cfg(feature = "postgres")]
    fences: BTreeMap<u64, u64>,
    /// Why the ledger table could not be read.
    #[cfg(feature = "postgres")]
    table_error: Option<String>,
}

impl Tally {
    fn read(path: &Path) -> Tally {
        let mut tally = Tally::default();
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("start"), Some(id), Some(_)) => {
                    if let Ok(id) = id.parse() {
                        *tally.starts.entry(id).or_default() += 1;
                    }
                }
                (Some("deliver"), Some(id), Some(pid)) => {
                    if let (Ok(id), Ok(pid)) = (id.parse(), pid.parse()) {
                        *tally.deliveries.entry(id).or_default() += 1;
                        tally.delivered_by.insert(id, pid);
                    }
                }
                (Some("skip"), Some(_), Some(_)) => tally.skips += 1,
                (Some("held"), Some(_), Some(_)) => tally.held += 1,
                (Some("lost"), Some(_), Some(_)) => tally.lost_claims += 1,
                (Some(id), Some(_), None) => {
                    if let Ok(id) = id.parse() {
                        *tally.effects.entry(id).or_default() += 1;
                    }
                }
                _ => {}
            }
        }
        tally
    }

    fn lines(&self) -> usize {
        self.effects.values().sum()
    }

    fn duplicates(&self) -> usize {
        self.effects.values().map(|n| n - 1).sum()
    }

    /// Workers with a delivery under way: the pids of the latest
    /// deliveries of ids that have no effect yet.
    fn busy(&self) -> BTreeSet<u32> {
        self.delivered_by
            .iter()
            .filter(|(id, _)| !self.effects.contains_key(id))
            .map(|(_, pid)| *pid)
            .collect()
    }
}

/// What was dispatched on one queue, and how to read its outcomes.
struct Books {
    queue: String,
    ledger: PathBuf,
    /// Message id -> business id.
    ids: HashMap<String, u64>,
    /// Business ids the backend accepted.
    expected: BTreeSet<u64>,
    /// Business ids whose dispatch outcome is uncertain.
    uncertain: BTreeSet<u64>,
    /// The charge fault's tables: effects are their rows.
    #[cfg(feature = "postgres")]
    charges: Option<crate::charge::Ledger>,
}

/// The accounting at one moment.
struct Account {
    tally: Tally,
    records: Vec<FailureRecord>,
    /// Business ids with a failure record.
    recorded: BTreeSet<u64>,
    missing: BTreeSet<u64>,
}

impl Books {
    fn new(queue: String, ledger: PathBuf) -> Books {
        Books {
            queue,
            ledger,
            ids: HashMap::new(),
            expected: BTreeSet::new(),
            uncertain: BTreeSet::new(),
            #[cfg(feature = "postgres")]
            charges: None,
        }
    }

    /// The ledger file's lines; the effects from the ledger table instead
    /// when the books have one.
    async fn tally(&self) -> Tally {
        #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
        let mut tally = Tally::read(&self.ledger);
        #[cfg(feature = "postgres")]
        if let Some(ledger) = &self.charges {
            match ledger.charges().await {
                Ok(charges) => {
                    tally.effects = charges.iter().map(|(id, c)| (*id, c.rows)).collect();
                    tally.fences = charges.iter().map(|(id, c)| (*id, c.fence)).collect();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading the charges");
                    tally.effects.clear();
                    tally.table_error = Some(e);
                }
            }
        }
        tally
    }

    async fn account(&self, conn: &Conn) -> Account {
        let tally = self.tally().await;
        let records = match conn.failure_records(&self.queue).await {
            Ok(records) => records,
            Err(e) => {
                tracing::warn!(error = %e, "reading failure records");
                vec![]
            }
        };
        let recorded: BTreeSet<u64> = records
            .iter()
            .filter_map(|r| r.message_id.as_ref().and_then(|m| self.ids.get(m)).copied())
            .collect();
        let missing = self
            .expected
            .iter()
            .filter(|id| !tally.effects.contains_key(id) && !recorded.contains(id))
            .copied()
            .collect();
        Account {
            tally,
            records,
            recorded,
            missing,
        }
    }

    /// Polls until every expected id is accounted for or `bound` passes;
    /// the time it was reached.
    async fn wait_accounted(
        &self,
        conn: &Conn,
        bound: Duration,
        records_needed: bool,
    ) -> (Account, Option<Instant>) {
        let deadline = Instant::now() + bound;
        let mut last_records = Instant::now() - Duration::from_secs(10);
        loop {
            // Failure records are read every second (a broker round trip);
            // the ledger every 100 ms.
            let tally = self.tally().await;
            let all_effects = self
                .expected
                .iter()
                .all(|id| tally.effects.contains_key(id));
            if all_effects && !records_needed {
                let account = self.account(conn).await;
                if account.missing.is_empty() {
                    return (account, Some(Instant::now()));
                }
            }
            if last_records.elapsed() >= Duration::from_secs(1) || Instant::now() >= deadline {
                last_records = Instant::now();
                let account = self.account(conn).await;
                if account.missing.is_empty() {
                    return (account, Some(Instant::now()));
                }
                if Instant::now() >= deadline {
                    return (account, None);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The run's worker processes.
struct Workers {
    children: Vec<Child>,
}

impl Workers {
    /// SIGTERM to every worker, SIGKILL after 10 s.
    async fn stop(&mut self) {
        jobrail_conformance::servers::terminate(&mut self.children, Duration::from_secs(10)).await;
        self.children.clear();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How a worker is started.
struct WorkerSpec<'a> {
    target: &'a Target,
    queue: &'a str,
    ledger: &'a Path,
    mode: Mode,
    concurrency: usize,
    cap: u32,
    timeout: Duration,
    slow: Duration,
    panic_id: Option<u64>,
    /// The charge handler's tables.
    tables: Option<&'a crate::charge::Tables>,
    /// The namespace to run in (the partition faults): the worker reaches
    /// its servers through the link's host end.
    netns: Option<&'a crate::netns::Link>,
    tag: String,
}

impl Suite {
    fn spawn(&mut self, spec: &WorkerSpec<'_>) -> Child {
        self.workers_spawned += 1;
        let log = self
            .logs
            .join(format!("{}-{:03}.log", spec.tag, self.workers_spawned));
        let stderr = File::create(&log).expect("create a worker log");
        let mut cmd = match spec.netns {
            Some(link) => link.command(&self.exe),
            None => Command::new(&self.exe),
        };
        // In a namespace, loopback is the namespace's own: every address
        // of a server becomes the link's host end.
        let reach = |url: String| match spec.netns {
            Some(link) => link.rewrite(&url),
            None => url,
        };
        cmd.arg("worker")
            .args(["--backend", spec.target.kind.name()])
            .args(["--queue", spec.queue])
            .args(["--mode", spec.mode.to_possible_value().unwrap().get_name()])
            .arg("--ledger")
            .arg(spec.ledger)
            .args(["--concurrency", &spec.concurrency.to_string()])
            .args(["--cap", &spec.cap.to_string()])
            .args(["--lease-ms", &spec.target.lease.as_millis().to_string()])
            .args(["--timeout-ms", &spec.timeout.as_millis().to_string()])
            .args(["--slow-ms", &spec.slow.as_millis().to_string()]);
        if let Some(id) = spec.panic_id {
            cmd.args(["--panic-id", &id.to_string()]);
        }
        if let Some(tables) = spec.tables {
            cmd.args(["--claims-table", &tables.claims])
                .args(["--ledger-table", &tables.ledger])
                .env(
                    crate::charge::DATABASE_URL_VAR,
                    reach(crate::charge::database_url()),
                );
        }
        cmd.envs(spec.target.env().into_iter().map(|(k, v)| (k, reach(v))))
            .env("RUST_LOG", "debug")
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn a worker")
    }

    fn item(&self, id: u64) -> Item {
        Item {
            id,
            marker: self.marker.clone(),
        }
    }

    /// Dispatches business ids `ids` (16 at a time); every refusal is a
    /// broken expectation.
    async fn dispatch(
        &mut self,
        producer: &Producer,
        job: &Job<Item>,
        books: &mut Books,
        ids: std::ops::Range<u64>,
    ) -> Duration {
        let items: Vec<Item> = ids.map(|id| self.item(id)).collect();
        let (results, took) = paced_dispatch(producer, job, items, Duration::ZERO).await;
        self.settle_dispatches(books, results);
        took
    }

    /// Books the accepted dispatches; every refusal is a broken expectation.
    fn settle_dispatches(&mut self, books: &mut Books, results: Vec<Dispatched>) {
        let mut refused = 0;
        for (id, result) in results {
            match result {
                Ok(message) => {
                    books.ids.insert(message, id);
                    books.expected.insert(id);
                }
                Err(e) => {
                    refused += 1;
                    tracing::error!(error = %e, "dispatch refused");
                }
            }
        }
        if refused > 0 {
            self.problems.push(format!(
                "{}: {refused} dispatches refused on a healthy broker (see the orchestrator log)",
                books.queue
            ));
        }
    }

    /// Five dispatches while the backend is away, 100 ms apart and
    /// concurrent: each one's outcome and latency. Those accepted are
    /// expected; uncertain ones are accounted if they arrive.
    async fn outage_dispatches(
        &mut self,
        kind: Kind,
        producer: &Producer,
        job: &Job<Item>,
        books: &mut Books,
        first_id: u64,
    ) {
        let calls = (0..5u64).map(|i| {
            let item = self.item(first_id + i);
            async move {
                tokio::time::sleep(Duration::from_millis(100 * i)).await;
                let started = Instant::now();
                let result = producer.dispatch(job).send(&item).await;
                (item.id, result, started.elapsed())
            }
        });
        let results = futures_util::future::join_all(calls).await;
        for (i, (id, result, latency)) in results.into_iter().enumerate() {
            let outcome = match result {
                Ok(message) => {
                    books.ids.insert(message, id);
                    books.expected.insert(id);
                    "accepted".to_string()
                }
                Err(e) => {
                    tracing::error!(error = %e, "dispatch during the outage");
                    if e.kind() == jobrail_native::ErrorKind::Uncertain {
                        books.uncertain.insert(id);
                    }
                    format!("{}", e.kind())
                }
            };
            self.outage.push(OutageCall {
                backend: kind,
                what: format!("dispatch {}", i + 1),
                outcome,
                latency,
            });
        }
    }

    fn check_lost(&mut self, kind: Kind, fault: Fault, account: &Account) {
        if !account.missing.is_empty() {
            let sample: Vec<_> = account.missing.iter().take(10).collect();
            self.problems.push(format!(
                "{} {}: LOST {} business ids (first: {sample:?})",
                kind.name(),
                fault.name(),
                account.missing.len()
            ));
        }
    }

    fn row(
        &self,
        kind: Kind,
        fault: Fault,
        books: &Books,
        account: &Account,
        recovery: String,
        notes: String,
    ) -> Row {
        let uncertain_arrived = books
            .uncertain
            .iter()
            .filter(|id| account.tally.effects.contains_key(id))
            .count();
        let mut notes = notes;
        if !books.uncertain.is_empty() {
            notes.push_str(&format!(
                "; {} uncertain dispatches, {uncertain_arrived} of them executed",
                books.uncertain.len()
            ));
        }
        Row {
            backend: kind,
            fault,
            dispatched: books.expected.len().to_string(),
            executed: account
                .tally
                .effects
                .keys()
                .filter(|id| books.expected.contains(id))
                .count()
                .to_string(),
            duplicates: account.tally.duplicates().to_string(),
            lost: account.missing.len().to_string(),
            records: account.records.len().to_string(),
            recovery,
            notes,
        }
    }
}

/// A business id and the outcome of its dispatch.
type Dispatched = (u64, Result<String, DriverError>);

/// Dispatches `items`, 16 at a time, spread evenly over `over` (at once if
/// zero); the outcomes and how long it took.
async fn paced_dispatch(
    producer: &Producer,
    job: &Job<Item>,
    items: Vec<Item>,
    over: Duration,
) -> (Vec<Dispatched>, Duration) {
    let started = Instant::now();
    let step = over / (items.len().max(1) as u32);
    let results = stream::iter(items.into_iter().enumerate())
        .map(|(i, item)| async move {
            tokio::time::sleep_until(started + step * i as u32).await;
            (item.id, producer.dispatch(job).send(&item).await)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    (results, started.elapsed())
}

/// The run's settings for one backend.
struct Env {
    kind: Kind,
    target: Target,
}

/// Runs the suite.
pub(crate) async fn run(args: RunArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let total = Instant::now();
    let exe = std::env::current_exe()?;
    let out = match &args.out {
        Some(out) => out.clone(),
        None => exe
            .parent()
            .and_then(Path::parent)
            .map(|target| target.join("faults"))
            .ok_or("cannot find the target directory: pass --out")?,
    };
    let run = random_text(6).to_lowercase();
    let work = out.join("work");
    let logs = out.join("logs");
    let _ = std::fs::remove_dir_all(&work);
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&logs)?;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("debug"));
    let log = File::create(logs.join("orchestrator.log"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(Mutex::new(log))
        .init();

    let mut backends = if args.backend.is_empty() {
        [Kind::Memory, Kind::Rabbitmq, Kind::Nats, Kind::Sqs]
            .into_iter()
            .filter(|k| k.built())
            .collect()
    } else {
        args.backend.clone()
    };
    backends.sort();
    backends.dedup();
    if let Some(k) = backends.iter().find(|k| !k.built()) {
        return Err(format!(
            "this build has no {} driver: build with `--features {}`",
            k.name(),
            k.feature()
        )
        .into());
    }
    let mut faults = if args.fault.is_empty() {
        let mut all = vec![Fault::Kill, Fault::Restart, Fault::Crash, Fault::Slow];
        if cfg!(feature = "postgres") {
            all.push(Fault::Charge);
        }
        if backends.contains(&Kind::Postgres) {
            all.push(Fault::Terminate);
        }
        all
    } else {
        args.fault.clone()
    };
    faults.sort();
    faults.dedup();
    #[cfg(not(feature = "postgres"))]
    if faults.iter().any(|f| *f == Fault::Charge || f.partition()) {
        return Err(NO_POSTGRES.into());
    }
    if faults.iter().any(|f| f.partition()) {
        crate::netns::Net::available()?;
    }

    let mut suite = Suite {
        run: run.clone(),
        exe,
        work,
        logs,
        marker: format!("MARK{}", random_text(16)),
        secrets: vec![],
        rows: vec![],
        outage: vec![],
        problems: vec![],
        workers_spawned: 0,
    };
    suite
        .secrets
        .push(("payload marker".into(), suite.marker.clone()));
    #[cfg(feature = "postgres")]
    if faults.contains(&Fault::Charge) {
        if let Some(password) = crate::charge::password(&crate::charge::database_url()) {
            suite.secrets.push(("Postgres password".into(), password));
        }
    }
    eprintln!(
        "jobrail-faults run {run}: backends {:?}, faults {:?}",
        backends.iter().map(|k| k.name()).collect::<Vec<_>>(),
        faults.iter().map(|f| f.name()).collect::<Vec<_>>()
    );

    for &kind in &backends {
        let started = Instant::now();
        let env = match setup(&mut suite, kind) {
            Ok(env) => env,
            Err(e) => {
                suite
                    .problems
                    .push(format!("{}: cannot set up: {e}", kind.name()));
                continue;
            }
        };
        // Keeps the run's RabbitMQ user until the backend is done.
        let user = env.1;
        let env = env.0;
        if let Err(e) = install_queue(&env).await {
            suite
                .problems
                .push(format!("{}: cannot set up: {e}", kind.name()));
            continue;
        }
        provoke_connection_error(&mut suite, &env).await;
        for &fault in &faults {
            eprintln!("  {} / {} ...", kind.name(), fault.name());
            let fault_started = Instant::now();
            let result = match fault {
                Fault::Kill => kill_load(&mut suite, &env, &args).await,
                Fault::Restart => restart(&mut suite, &env).await,
                Fault::Crash => crash_loop(&mut suite, &env).await,
                Fault::Slow => slow(&mut suite, &env).await,
                Fault::Charge => charge(&mut suite, &env, &args).await,
                Fault::Terminate => terminate(&mut suite, &env, &args).await,
                #[cfg(feature = "postgres")]
                Fault::Partition | Fault::Isolate | Fault::SlowLink | Fault::HalfOpen => {
                    partition::run(&mut suite, &env, fault, &args).await
                }
                #[cfg(not(feature = "postgres"))]
                Fault::Partition | Fault::Isolate | Fault::SlowLink | Fault::HalfOpen => {
                    Err(NO_POSTGRES.into())
                }
            };
            if let Err(e) = result {
                suite.problems.push(format!(
                    "{} {}: the fault could not run: {e}",
                    kind.name(),
                    fault.name()
                ));
            }
            eprintln!(
                "  {} / {} done in {}",
                kind.name(),
                fault.name(),
                secs(fault_started.elapsed())
            );
        }
        drop(user);
        if let Err(e) = drop_queue(&env).await {
            suite.problems.push(format!("{}: {e}", kind.name()));
        }
        eprintln!("{} done in {}", kind.name(), secs(started.elapsed()));
    }

    let scan = scan_logs(&suite);
    let elapsed = total.elapsed();
    let report = report(&suite, &scan, elapsed);
    println!("{report}");
    std::fs::write(out.join("report.md"), &report)?;
    for p in &suite.problems {
        eprintln!("PROBLEM: {p}");
    }
    Ok(suite.problems.is_empty() && scan.hits.is_empty())
}

/// Connection settings and credentials for `kind`, with the run's secrets.
fn setup(suite: &mut Suite, kind: Kind) -> Result<(Env, Option<nodes::RabbitUser>), String> {
    let lease = Duration::from_secs(3);
    let operation_timeout = Duration::from_secs(10);
    match kind {
        Kind::Memory => Ok((
            Env {
                kind,
                target: Target {
                    kind,
                    url: String::new(),
                    sqs_keys: None,
                    lease,
                    operation_timeout,
                    pg_schema: None,
                    worker: false,
                },
            },
            None,
        )),
        Kind::Rabbitmq => {
            let password = random_text(24);
            suite
                .secrets
                .push(("RabbitMQ password".into(), password.clone()));
            let user =
                nodes::RabbitUser::create(None, &format!("faults-{}", suite.run), &password)?;
            let port = std::env::var("FAULTS_RABBITMQ_PORT")
                .ok()
                .and_then(|p| p.parse().ok())
                .unwrap_or(5672);
            Ok((
                Env {
                    kind,
                    target: Target {
                        kind,
                        url: user.url(port),
                        sqs_keys: None,
                        lease,
                        operation_timeout,
                        pg_schema: None,
                        worker: false,
                    },
                },
                Some(user),
            ))
        }
        Kind::Nats => {
            let password = random_text(24);
            suite
                .secrets
                .push(("NATS password".into(), password.clone()));
            let base = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
            let url = base.replacen("://", &format!("://faults:{password}@"), 1);
            Ok((
                Env {
                    kind,
                    target: Target {
                        kind,
                        url,
                        sqs_keys: None,
                        lease,
                        operation_timeout,
                        pg_schema: None,
                        worker: false,
                    },
                },
                None,
            ))
        }
        Kind::Sqs => {
            let endpoint = std::env::var("SQS_ENDPOINT").map_err(|_| {
                "SQS_ENDPOINT is not set: start the emulator with tests/sqs-emulator and export the URL it prints"
                    .to_string()
            })?;
            let key = format!("AKIA{}", random_text(16).to_uppercase());
            let secret = random_text(40);
            suite.secrets.push((ACCESS_KEY_ID.into(), key.clone()));
            suite
                .secrets
                .push(("AWS secret access key".into(), secret.clone()));
            Ok((
                Env {
                    kind,
                    target: Target {
                        kind,
                        url: endpoint,
                        sqs_keys: Some((key, secret)),
                        lease,
                        operation_timeout,
                        pg_schema: None,
                        worker: false,
                    },
                },
                None,
            ))
        }
        Kind::Postgres => {
            let url = pg_url(suite);
            Ok((
                Env {
                    kind,
                    target: Target {
                        kind,
                        url,
                        sqs_keys: None,
                        lease,
                        operation_timeout,
                        pg_schema: Some(format!("faults_{}", suite.run)),
                        worker: false,
                    },
                },
                None,
            ))
        }
    }
}

/// The Postgres queue's URL: `DATABASE_URL`, with a random password if it
/// has none (trust authentication: the server never asks for it), which
/// joins the secrets no log may show.
#[cfg(feature = "postgres-queue")]
fn pg_url(suite: &mut Suite) -> String {
    let base = crate::charge::database_url();
    let url = match crate::charge::password(&base) {
        Some(_) => base,
        None => with_password(&base, &random_text(24)).unwrap_or(base),
    };
    if let Some(password) = crate::charge::password(&url) {
        if !suite.secrets.iter().any(|(_, v)| *v == password) {
            suite
                .secrets
                .push(("Postgres password (queue)".into(), password));
        }
    }
    url
}

/// Without the Postgres queue (`run` refuses the backend first).
#[cfg(not(feature = "postgres-queue"))]
fn pg_url(_suite: &mut Suite) -> String {
    String::new()
}

/// `url` with `password` for its user, if it is a `postgres://` URL whose
/// user has none.
#[cfg_attr(not(feature = "postgres-queue"), allow(dead_code))]
fn with_password(url: &str, password: &str) -> Option<String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))?;
    let scheme = &url[..url.len() - rest.len()];
    let at = rest.find('@')?;
    let user = &rest[..at];
    if user.contains(':') || user.contains('/') {
        return None;
    }
    Some(format!("{scheme}{user}:{password}{}", &rest[at..]))
}

/// Installs the Postgres queue's schema (the run's own), for the backends
/// that need it.
async fn install_queue(env: &Env) -> Result<(), String> {
    #[cfg(feature = "postgres-queue")]
    if env.kind == Kind::Postgres {
        let config = crate::backend::pg_config(&env.target).map_err(|e| e.to_string())?;
        jobrail_postgres::PgDriver::install(&config)
            .await
            .map_err(|e| format!("installing the schema: {e}"))?;
    }
    let _ = env;
    Ok(())
}

/// Drops the Postgres queue's schema at the end of the backend's faults.
async fn drop_queue(env: &Env) -> Result<(), String> {
    #[cfg(feature = "postgres-queue")]
    if env.kind == Kind::Postgres {
        return drop_schema(&env.target).await;
    }
    let _ = env;
    Ok(())
}

/// Drops `target`'s schema and everything in it.
#[cfg(feature = "postgres-queue")]
async fn drop_schema(target: &Target) -> Result<(), String> {
    let schema = target.pg_schema.as_deref().unwrap_or_default();
    let client = pg_admin(target).await?;
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await
        .map_err(|e| format!("dropping the schema {schema}: {e}"))
}

/// A connection of the orchestrator's own to `target`'s database (its
/// application name is not the workers').
#[cfg(feature = "postgres-queue")]
async fn pg_admin(target: &Target) -> Result<jobrail_postgres::tokio_postgres::Client, String> {
    let config = crate::backend::pg_config(target).map_err(|e| e.to_string())?;
    config
        .connect
        .connect()
        .await
        .map_err(|e| format!("connecting to Postgres: {e}"))
}

/// Connects with the run's credentials to a closed port and logs the error
/// at error level (the log scan then proves it names no secret).
async fn provoke_connection_error(suite: &mut Suite, env: &Env) {
    if matches!(env.kind, Kind::Memory | Kind::Sqs) {
        // SQS: the closed-port dispatches of the restart fault do it.
        return;
    }
    let closed = nodes::free_port();
    let mut target = env.target.clone();
    let url = &env.target.url;
    let Some(at) = url.rfind('@') else { return };
    let rest = &url[at + 1..];
    let after_port = rest.find('/').map(|i| &rest[i..]).unwrap_or("");
    target.url = format!("{}@127.0.0.1:{closed}{after_port}", &url[..at]);
    target.operation_timeout = Duration::from_secs(3);
    let started = Instant::now();
    match Conn::connect(&target).await {
        Ok(conn) => {
            // The NATS driver may connect lazily: a dispatch shows the error.
            let job = worker::job("faults-closed", 1, Duration::from_secs(5));
            let result = Producer::new(conn.driver())
                .dispatch(&job)
                .send(&suite.item(0))
                .await;
            match result {
                Ok(_) => suite.problems.push(format!(
                    "{}: a dispatch to a closed port succeeded",
                    env.kind.name()
                )),
                Err(e) => tracing::error!(error = %e, debug = ?e, "dispatch through a closed port"),
            }
            let _ = conn.driver().stop().await;
        }
        Err(e) => tracing::error!(error = %e, debug = ?e, "connect to a closed port"),
    }
    tracing::debug!(elapsed = ?started.elapsed(), "closed-port check done");
}

fn new_books(suite: &Suite, kind: Kind, fault: &str) -> Books {
    let queue = format!("faults-{}-{}-{fault}", suite.run, kind.name());
    let ledger = suite.work.join(format!("{}-{fault}.ledger", kind.name()));
    let _ = File::create(&ledger);
    Books::new(queue, ledger)
}

/// What one kill-load scenario did.
struct KillRun {
    /// Kills that landed while work remained.
    kills: usize,
    /// Of those, kills of a worker with a delivery under way (aimed runs).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    aimed: usize,
    last_kill: Instant,
    dispatch_time: Duration,
    /// When the workers were started.
    begun: Instant,
    /// When every id was accounted for.
    done: Option<Instant>,
    /// The accounting after the workers stopped.
    account: Account,
}

/// The kill-load scenario on `books`' queue: three workers started with
/// `spec` while business ids `0..n` are dispatched at a pace over the kill
/// window; a random worker SIGKILLed every 0.7–1.5 s and restarted at once,
/// `kills` times (only kills that land while work remains count); then a
/// wait (180 s at most) until every id is accounted for. With `aim`, each
/// kill waits (1 s at most) for a worker with a delivery under way (see
/// [`Tally::busy`]) and kills it, so that few kills miss the handlers.
#[allow(clippy::too_many_arguments)]
async fn kill_run(
    suite: &mut Suite,
    conn: &Conn,
    producer: &Producer,
    job: &Job<Item>,
    books: &mut Books,
    spec: &WorkerSpec<'_>,
    n: u64,
    kills: usize,
    aim: bool,
) -> KillRun {
    // The workers start while the jobs are dispatched.
    let mut workers = Workers {
        children: (0..3).map(|_| suite.spawn(spec)).collect(),
    };
    let begun = Instant::now();
    // The dispatch is paced over the kill window (one kill every 0.7–1.5 s,
    // about 1.1 s on average, plus 1 s) so that work remains at every kill;
    // the kills run meanwhile.
    let window = Duration::from_millis(1100 * kills as u64 + 1000);
    let items: Vec<Item> = (0..n).map(|id| suite.item(id)).collect();
    let paced = paced_dispatch(producer, job, items, window);
    let watched = &*books;
    let killing = async {
        let mut landed = 0;
        let mut aimed = 0;
        let mut last_kill = Instant::now();
        for _ in 0..kills {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(700..=1500))).await;
            // Only kills that land while work remains count.
            if watched.tally().await.effects.len() as u64 >= n {
                break;
            }
            landed += 1;
            let busy = if aim {
                busy_worker(watched, &workers.children).await
            } else {
                None
            };
            aimed += usize::from(busy.is_some());
            let i = busy.unwrap_or_else(|| fastrand::usize(0..workers.children.len()));
            let _ = workers.children[i].kill();
            let _ = workers.children[i].wait();
            last_kill = Instant::now();
            let respawned = suite.spawn(spec);
            workers.children[i] = respawned;
        }
        (landed, aimed, last_kill)
    };
    let ((results, dispatch_time), (landed, aimed, last_kill)) = tokio::join!(paced, killing);
    suite.settle_dispatches(books, results);
    let (_, done) = books
        .wait_accounted(conn, Duration::from_secs(180), false)
        .await;
    workers.stop().await;
    let account = books.account(conn).await;
    KillRun {
        kills: landed,
        aimed,
        last_kill,
        dispatch_time,
        begun,
        done,
        account,
    }
}

/// The index of a worker with a delivery under way, polled every 20 ms
/// for 1 s at most.
async fn busy_worker(books: &Books, children: &[Child]) -> Option<usize> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let busy = books.tally().await.busy();
        let candidates: Vec<usize> = (0..children.len())
            .filter(|i| busy.contains(&children[*i].id()))
            .collect();
        if !candidates.is_empty() {
            return Some(candidates[fastrand::usize(..candidates.len())]);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl KillRun {
    /// The row's note on a shortfall of kills (warned on stderr too).
    fn shortfall(&self, kind: Kind, fault: Fault, wanted: usize, flag: &str) -> String {
        if self.kills >= wanted {
            return String::new();
        }
        eprintln!(
            "  warning: {} {}: the work ended after {} of {wanted} kills (dispatch more with {flag})",
            kind.name(),
            fault.name(),
            self.kills,
        );
        format!(" (the work ended before kill {})", self.kills + 1)
    }

    /// From the last kill until every id was accounted for.
    fn recovery(&self) -> String {
        self.done
            .map_or("not within 180 s".into(), |t| secs(t - self.last_kill))
    }

    /// Jobs per second from the workers' start until all were accounted for.
    fn throughput(&self, n: u64) -> String {
        self.done.map_or(String::new(), |t| {
            format!(
                "{:.0} jobs/s overall",
                n as f64 / (t - self.begun).as_secs_f64()
            )
        })
    }
}

/// Whether `kind` lives in the orchestrator's process (memory), where
/// killing a worker kills the queue: then the fault's row says so.
fn one_process(suite: &mut Suite, kind: Kind, fault: Fault) -> bool {
    if kind != Kind::Memory {
        return false;
    }
    suite.rows.push(Row::na(
        kind,
        fault,
        "the memory driver lives in one process: killing it kills the queue",
    ));
    true
}

/// Kill load: `--jobs` jobs, three workers (concurrency 8), a random worker
/// SIGKILLed every 0.7–1.5 s and restarted at once, `--kills` times. Recovery:
/// from the last kill until every id is accounted for.
async fn kill_load(suite: &mut Suite, env: &Env, args: &RunArgs) -> Result<(), String> {
    let kind = env.kind;
    if one_process(suite, kind, Fault::Kill) {
        return Ok(());
    }
    let n = match kind {
        Kind::Sqs => args.sqs_jobs,
        Kind::Postgres => args.pg_jobs,
        _ => args.jobs,
    } as u64;
    let target = env.target.with_lease(Duration::from_secs(3));
    let conn = Conn::connect(&target).await.map_err(|e| e.to_string())?;
    let producer = Producer::new(conn.driver());
    let mut books = new_books(suite, kind, "kill");
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, 10, Duration::from_secs(60));
    let spec = WorkerSpec {
        target: &target,
        queue: &queue,
        ledger: &ledger,
        mode: Mode::Effect,
        concurrency: 8,
        cap: 10,
        timeout: Duration::from_secs(60),
        slow: Duration::ZERO,
        panic_id: Some(1),
        tables: None,
        netns: None,
        tag: format!("{}-kill", kind.name()),
    };
    let run = kill_run(
        suite, &conn, &producer, &job, &mut books, &spec, n, args.kills, false,
    )
    .await;
    let shortfall = run.shortfall(kind, Fault::Kill, args.kills, "--jobs");
    suite.check_lost(kind, Fault::Kill, &run.account);
    let notes = format!(
        "{} SIGKILLs while work remained{shortfall}, 3 workers x 8; lease {}; dispatch {}; {}",
        run.kills,
        secs(target.lease),
        secs(run.dispatch_time),
        run.throughput(n)
    );
    let row = suite.row(
        kind,
        Fault::Kill,
        &books,
        &run.account,
        run.recovery(),
        notes,
    );
    suite.rows.push(row);
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// Exactly-once charge: the kill-load scenario (`--charges` jobs,
/// `--charge-kills` kills) with the `charge` handler, whose effects are rows
/// of a Postgres table. Every dispatched id must have exactly one row (or a
/// failure record); deliveries must have repeated (the kills exercised
/// redelivery). Recovery: from the last kill until every id has a row or a
/// failure record.
#[cfg(feature = "postgres")]
async fn charge(suite: &mut Suite, env: &Env, args: &RunArgs) -> Result<(), String> {
    let kind = env.kind;
    if one_process(suite, kind, Fault::Charge) {
        return Ok(());
    }
    let n = match kind {
        Kind::Sqs => args.sqs_charges,
        Kind::Postgres => args.pg_charges,
        _ => args.charges,
    } as u64;
    // On the Postgres queue: transactional completion, no claim.
    let tx = kind == Kind::Postgres;
    let target = env.target.with_lease(Duration::from_secs(3));
    let conn = Conn::connect(&target).await.map_err(|e| e.to_string())?;
    let producer = Producer::new(conn.driver());
    let tables = crate::charge::Tables::new(&suite.run, kind.name());
    let ledger_db =
        match crate::charge::Ledger::create(&crate::charge::database_url(), &tables).await {
            Ok(ledger) => ledger,
            Err(e) => {
                let _ = conn.driver().stop().await;
                return Err(e);
            }
        };
    let mut books = new_books(suite, kind, "charge");
    books.charges = Some(ledger_db);
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, 10, Duration::from_secs(60));
    let spec = WorkerSpec {
        target: &target,
        queue: &queue,
        ledger: &ledger,
        mode: if tx { Mode::ChargeTx } else { Mode::Charge },
        concurrency: 8,
        cap: 10,
        timeout: Duration::from_secs(60),
        slow: Duration::ZERO,
        panic_id: None,
        tables: Some(&tables),
        netns: None,
        tag: format!("{}-charge", kind.name()),
    };
    let run = kill_run(
        suite,
        &conn,
        &producer,
        &job,
        &mut books,
        &spec,
        n,
        args.charge_kills,
        true,
    )
    .await;
    let shortfall = run.shortfall(kind, Fault::Charge, args.charge_kills, "--charges");
    let ledger_db = books.charges.take().expect("the books have the tables");
    let account = &run.account;
    let tally = &account.tally;
    let what = format!("{} {}", kind.name(), Fault::Charge.name());
    suite.check_lost(kind, Fault::Charge, account);
    check_charges(suite, &what, tally, |_| 1);
    let charge_duplicates = tally.duplicates();
    let delivery_duplicates: usize = tally.deliveries.values().map(|n| n - 1).sum();
    if run.kills == 0 {
        suite.problems.push(format!(
            "{what}: no kill landed while work remained: the scenario did not run"
        ));
    } else if delivery_duplicates == 0 {
        suite.problems.push(format!(
            "{what}: no delivery was repeated although {} kills landed: the scenario did not exercise redelivery",
            run.kills
        ));
    }
    let undelivered: Vec<u64> = tally
        .effects
        .keys()
        .filter(|id| !tally.deliveries.contains_key(id))
        .copied()
        .collect();
    if !undelivered.is_empty() {
        suite.problems.push(format!(
            "{what}: {} ids charged without a delivery in the ledger file (first: {:?})",
            undelivered.len(),
            &undelivered[..undelivered.len().min(10)]
        ));
    }
    let unexpected = tally
        .effects
        .keys()
        .filter(|id| !books.expected.contains(id))
        .count();
    if unexpected > 0 {
        suite.problems.push(format!(
            "{what}: {unexpected} ids charged that were not accepted for dispatch"
        ));
    }
    let charged: Vec<u64> = tally.effects.keys().copied().collect();
    let done_check = if tx {
        // Every charge committed with its job's completion: no job is left.
        match queue_depth(&conn, &books.queue).await {
            Ok(0) => "no job left in the queue".to_string(),
            Ok(depth) => {
                suite.problems.push(format!(
                    "{what}: {depth} jobs left in the queue after every id was charged"
                ));
                format!("{depth} jobs LEFT in the queue")
            }
            Err(e) => {
                suite
                    .problems
                    .push(format!("{what}: reading the queue's depth: {e}"));
                "depth not checked".into()
            }
        }
    } else {
        match ledger_db.not_done(charged.clone()).await {
            Ok(not_done) if not_done.is_empty() => {
                format!("all {} charged keys done", charged.len())
            }
            Ok(not_done) => {
                suite.problems.push(format!(
                    "{what}: {} charged keys not done in the claim store (first: {:?})",
                    not_done.len(),
                    &not_done[..not_done.len().min(10)]
                ));
                format!("{} charged keys NOT done", not_done.len())
            }
            Err(e) => {
                suite
                    .problems
                    .push(format!("{what}: checking the claims: {e}"));
                "claims not checked".into()
            }
        }
    };
    let retaken = tally.fences.values().filter(|fence| **fence > 1).count();
    let notes = if tx {
        format!(
            "{} SIGKILLs while work remained{shortfall} ({} of a worker with a charge under way), 3 workers x 8; no claim: charge row and the job's completion (complete_in, fenced by the lease) in one transaction; lease {}; dispatch {}; {} deliveries: {} completions refused (lease taken over, rolled back); {retaken} charges by a redelivery (attempt > 1); {done_check}; {}",
            run.kills,
            run.aimed,
            secs(target.lease),
            secs(run.dispatch_time),
            tally.deliveries.values().sum::<usize>(),
            tally.lost_claims,
            run.throughput(n)
        )
    } else {
        format!(
        "{} SIGKILLs while work remained{shortfall} ({} of a worker with a charge under way), 3 workers x 8; broker lease {}, claim lease {}; dispatch {}; {} deliveries: {} found the charge done, {} found it held, {} completions too late (rolled back); {retaken} charges under a retaken claim (fence > 1); {done_check}; {}",
        run.kills,
        run.aimed,
        secs(target.lease),
        secs(crate::charge::LEASE),
        secs(run.dispatch_time),
        tally.deliveries.values().sum::<usize>(),
        tally.skips,
        tally.held,
        tally.lost_claims,
        run.throughput(n)
    )
    };
    let mut row = suite.row(kind, Fault::Charge, &books, account, run.recovery(), notes);
    row.duplicates = format!("{delivery_duplicates} deliveries / {charge_duplicates} charges");
    suite.rows.push(row);
    if let Err(e) = ledger_db.drop_tables().await {
        suite.problems.push(format!("{what}: {e}"));
    }
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// The checks of every charge fault's table: it could be read, and no id
/// has more charge rows than `allowed` says (one, where a claim keyed by
/// the business id guards the charge). The ids charged more, with their
/// rows.
#[cfg(feature = "postgres")]
fn check_charges(
    suite: &mut Suite,
    what: &str,
    tally: &Tally,
    allowed: impl Fn(u64) -> usize,
) -> Vec<(u64, usize)> {
    if let Some(e) = &tally.table_error {
        suite
            .problems
            .push(format!("{what}: the ledger table could not be read: {e}"));
    }
    let doubled: Vec<(u64, usize)> = tally
        .effects
        .iter()
        .filter(|(id, rows)| **rows > allowed(**id))
        .map(|(id, rows)| (*id, *rows))
        .collect();
    if !doubled.is_empty() {
        let extra: usize = doubled.iter().map(|(id, rows)| rows - allowed(*id)).sum();
        suite.problems.push(format!(
            "{what}: DUPLICATE CHARGES: {} ids charged more than allowed, {extra} extra charges (first (id, charges): {:?})",
            doubled.len(),
            &doubled[..doubled.len().min(10)]
        ));
    }
    doubled
}

/// The jobs `queue` holds (ready, in flight and delayed).
#[cfg(feature = "postgres")]
async fn queue_depth(conn: &Conn, queue: &str) -> Result<u64, String> {
    let driver = conn.driver();
    let admin = driver.admin().ok_or("the driver has no admin interface")?;
    let depth = admin.depth(queue).await.map_err(|e| e.to_string())?;
    Ok(depth.ready + depth.in_flight.unwrap_or(0) + depth.delayed.unwrap_or(0))
}

/// Without Postgres there is no charge fault (`run` refuses it first).
#[cfg(not(feature = "postgres"))]
async fn charge(_suite: &mut Suite, _env: &Env, _args: &RunArgs) -> Result<(), String> {
    Err(NO_POSTGRES.into())
}

/// Why the charge fault cannot run in this build.
#[cfg(not(feature = "postgres"))]
const NO_POSTGRES: &str =
    "this build has no Postgres: build jobrail-faults with `--features postgres`";

/// Broker restart: one worker consumes 600 jobs; after 100 effects the
/// broker goes away, five dispatches are timed, the broker comes back.
/// Recovery: from the broker being back until the first new effect.
async fn restart(suite: &mut Suite, env: &Env) -> Result<(), String> {
    let kind = env.kind;
    match kind {
        Kind::Memory => {
            let conn = Conn::connect(&env.target)
                .await
                .map_err(|e| e.to_string())?;
            let producer = Producer::new(conn.driver());
            let mut books = new_books(suite, kind, "restart");
            let job = worker::job(&books.queue, 3, Duration::from_secs(10));
            conn.driver().stop().await.map_err(|e| e.to_string())?;
            suite
                .outage_dispatches(kind, &producer, &job, &mut books, 0)
                .await;
            suite.rows.push(Row::na(
                kind,
                Fault::Restart,
                "no broker to restart; dispatch after the driver is stopped is timed below",
            ));
            Ok(())
        }
        Kind::Sqs => {
            let closed = nodes::free_port();
            let mut target = env.target.clone();
            target.url = format!("http://127.0.0.1:{closed}");
            #[cfg_attr(not(feature = "sqs"), allow(unused_mut, unused_variables))]
            let mut books = new_books(suite, kind, "restart");
            #[cfg_attr(not(feature = "sqs"), allow(unused_variables))]
            let job = worker::job(&books.queue, 3, Duration::from_secs(10));
            let started = Instant::now();
            match Conn::connect(&target).await {
                Ok(conn) => {
                    suite
                        .problems
                        .push("sqs: connected to a closed port".into());
                    let _ = conn.driver().stop().await;
                }
                Err(e) => {
                    tracing::error!(error = %e, debug = ?e, "SQS connect to a closed port");
                    suite.outage.push(OutageCall {
                        backend: kind,
                        what: "connect".into(),
                        outcome: format!("{}", e.kind()),
                        latency: started.elapsed(),
                    });
                }
            }
            #[cfg(feature = "sqs")]
            {
                let conn = Conn::sqs_unconnected(&target).map_err(|e| e.to_string())?;
                let producer = Producer::new(conn.driver());
                suite
                    .outage_dispatches(kind, &producer, &job, &mut books, 0)
                    .await;
                let _ = conn.driver().stop().await;
            }
            suite.rows.push(Row::na(
                kind,
                Fault::Restart,
                "the emulator keeps its state in memory (a restart empties it); dispatch to a closed port is timed below",
            ));
            Ok(())
        }
        Kind::Rabbitmq | Kind::Nats => restart_broker(suite, env).await,
        Kind::Postgres => restart_postgres(suite, env).await,
    }
}

/// The Postgres queue's restart: a private server of its own (the shared
/// one is never restarted), the run's schema installed on it, stopped with
/// `pg_ctl stop -m immediate` mid-load and started again.
#[cfg(feature = "postgres-queue")]
async fn restart_postgres(suite: &mut Suite, env: &Env) -> Result<(), String> {
    let kind = env.kind;
    let dir = std::env::temp_dir().join(format!("jobrail-faults-pg-{}", suite.run));
    let started = Instant::now();
    // fsync off: the fault is the restart, not the disk.
    let server = nodes::PgServer::start(&dir, &["fsync=off", "max_connections=100"])?;
    let mut target = env.target.clone().with_lease(Duration::from_secs(3));
    let password = crate::charge::password(&target.url)
        .map(|p| format!(":{p}"))
        .unwrap_or_default();
    target.url = format!(
        "postgres://postgres{password}@127.0.0.1:{}/postgres",
        server.port
    );
    let where_ = format!(
        "a private server (initdb and start took {}; pg_ctl stop -m immediate, start)",
        secs(started.elapsed())
    );
    let log = server.log();
    let mut broker = Private::Postgres(server);
    let result = match install_queue(&Env {
        kind,
        target: target.clone(),
    })
    .await
    {
        Ok(()) => restart_body(suite, kind, &target, &mut broker, &where_).await,
        Err(e) => Err(format!("on the private server: {e}")),
    };
    // Its log is scanned with the others.
    let _ = std::fs::copy(&log, suite.logs.join("postgres-server.private.log"));
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Without the Postgres queue (`run` refuses the backend first).
#[cfg(not(feature = "postgres-queue"))]
async fn restart_postgres(_suite: &mut Suite, _env: &Env) -> Result<(), String> {
    Err("this build has no Postgres queue".into())
}

/// A broker that can be stopped and started.
enum Private {
    Nats(nodes::NatsServer),
    Rabbit(nodes::RabbitNode, Option<nodes::RabbitUser>),
    /// The shared RabbitMQ node (FAULTS_SHARED_BROKER=1), stop_app/start_app.
    SharedRabbit,
    /// A private Postgres server.
    #[cfg(feature = "postgres-queue")]
    Postgres(nodes::PgServer),
}

impl Private {
    async fn down(&mut self) -> Result<(), String> {
        match self {
            Private::Nats(server) => {
                server.down().await;
                Ok(())
            }
            Private::Rabbit(node, _) => nodes::rabbitmqctl(Some(&node.name), &["stop_app"]),
            Private::SharedRabbit => nodes::rabbitmqctl(None, &["stop_app"]),
            #[cfg(feature = "postgres-queue")]
            Private::Postgres(server) => server.down(),
        }
    }

    async fn up(&mut self) -> Result<(), String> {
        match self {
            Private::Nats(server) => server.up().await,
            Private::Rabbit(node, _) => {
                nodes::rabbitmqctl(Some(&node.name), &["start_app"])?;
                nodes::rabbitmqctl(Some(&node.name), &["await_startup"])?;
                if nodes::wait_port(node.port, Duration::from_secs(20)).await {
                    Ok(())
                } else {
                    Err("the private RabbitMQ node did not listen again".into())
                }
            }
            Private::SharedRabbit => {
                nodes::rabbitmqctl(None, &["start_app"])?;
                nodes::rabbitmqctl(None, &["await_startup"])
            }
            #[cfg(feature = "postgres-queue")]
            Private::Postgres(server) => server.up(),
        }
    }
}

async fn restart_broker(suite: &mut Suite, env: &Env) -> Result<(), String> {
    let kind = env.kind;
    let dir = suite.work.join(format!("{}-broker", kind.name()));
    let mut target = env.target.clone().with_lease(Duration::from_secs(3));
    let mut where_ = String::new();
    let mut broker = match kind {
        Kind::Nats => {
            let server =
                nodes::NatsServer::start(&dir, Some(&suite.logs.join("nats-server.private")))
                    .await?;
            target.url =
                target
                    .url
                    .replacen("127.0.0.1:4222", &format!("127.0.0.1:{}", server.port), 1);
            if !target.url.contains(&format!(":{}", server.port)) {
                return Err(
                    "NATS_URL is not on 127.0.0.1:4222: cannot point it at the private server"
                        .into(),
                );
            }
            where_.push_str("a private nats-server (SIGTERM, restart)");
            Private::Nats(server)
        }
        _ => {
            let started = Instant::now();
            match nodes::RabbitNode::start(&suite.run, &dir).await {
                Ok(node) => {
                    let password = random_text(24);
                    suite
                        .secrets
                        .push(("RabbitMQ password (private node)".into(), password.clone()));
                    let user = nodes::RabbitUser::create(Some(&node.name), "faults", &password)?;
                    target.url = user.url(node.port);
                    where_.push_str(&format!(
                        "a private node (started in {}; stop_app/start_app)",
                        secs(started.elapsed())
                    ));
                    Private::Rabbit(node, Some(user))
                }
                Err(e) if std::env::var("FAULTS_SHARED_BROKER").as_deref() == Ok("1") => {
                    tracing::warn!(error = %e, "falling back to the shared node");
                    where_.push_str(&format!(
                        "the SHARED node (private node failed: {e}; stop_app/start_app)"
                    ));
                    Private::SharedRabbit
                }
                Err(e) => return Err(e),
            }
        }
    };
    let result = restart_body(suite, kind, &target, &mut broker, &where_).await;
    if let Private::Rabbit(_, user) = &mut broker {
        // The user goes with the node; no need to delete it first.
        if let Some(user) = user.take() {
            std::mem::forget(user);
        }
    }
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn restart_body(
    suite: &mut Suite,
    kind: Kind,
    target: &Target,
    broker: &mut Private,
    where_: &str,
) -> Result<(), String> {
    let n = 600;
    let conn = Conn::connect(target).await.map_err(|e| e.to_string())?;
    let producer = Producer::new(conn.driver());
    let mut books = new_books(suite, kind, "restart");
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, 10, Duration::from_secs(60));
    suite.dispatch(&producer, &job, &mut books, 0..n).await;
    let spec = WorkerSpec {
        target,
        queue: &queue,
        ledger: &ledger,
        mode: Mode::Effect,
        concurrency: 4,
        cap: 10,
        timeout: Duration::from_secs(60),
        slow: Duration::ZERO,
        panic_id: None,
        tables: None,
        netns: None,
        tag: format!("{}-restart", kind.name()),
    };
    let mut workers = Workers {
        children: vec![suite.spawn(&spec)],
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Tally::read(&books.ledger).lines() < 100 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = Tally::read(&books.ledger).effects.len();
    let down_at = Instant::now();
    broker.down().await?;
    let stopped_in = down_at.elapsed();
    let during_start = Tally::read(&books.ledger).lines();
    suite
        .outage_dispatches(kind, &producer, &job, &mut books, n)
        .await;
    let outage_len = down_at.elapsed();
    let during = Tally::read(&books.ledger).lines() - during_start;
    // New effects are counted from the start command on; recovery from
    // the moment the broker reports it is up (0 if work already resumed).
    let lines_at_back = Tally::read(&books.ledger).lines();
    let up_at = Instant::now();
    broker.up().await?;
    let back_at = Instant::now();
    let start_took = back_at - up_at;
    let mut first_new = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if Tally::read(&books.ledger).lines() > lines_at_back {
            first_new = Some(back_at.elapsed());
            if Instant::now() <= back_at + Duration::from_millis(20) {
                first_new = Some(Duration::ZERO);
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, done) = books
        .wait_accounted(&conn, Duration::from_secs(120), false)
        .await;
    workers.stop().await;
    let account = books.account(&conn).await;
    suite.check_lost(kind, Fault::Restart, &account);
    if first_new.is_none() {
        suite.problems.push(format!(
            "{} broker restart: no new effect within 60 s of the broker being back",
            kind.name()
        ));
    }
    let recovery = first_new.map_or("none within 60 s".into(), secs);
    let notes = format!(
        "{where_}; broker stopped after {before} effects (stop took {}), away {} (start took {}); {during} effects during the outage; all accounted {} after it was back",
        secs(stopped_in),
        secs(outage_len),
        secs(start_took),
        done.map_or("NOT within 120 s".into(), |t| secs(t - back_at)),
    );
    let row = suite.row(kind, Fault::Restart, &books, &account, recovery, notes);
    suite.rows.push(row);
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// Crash loop: three jobs capped at 2 attempts whose handler aborts the
/// worker on every delivery; the worker is restarted whenever it dies until
/// every job has a failure record (at most 120 s, 80 restarts). Recovery:
/// from the first start until the last failure record.
async fn crash_loop(suite: &mut Suite, env: &Env) -> Result<(), String> {
    let kind = env.kind;
    if kind == Kind::Memory {
        suite.rows.push(Row::na(
            kind,
            Fault::Crash,
            "an abort would kill the orchestrator with the queue in it",
        ));
        return Ok(());
    }
    let cap = 2;
    let target = env.target.with_lease(Duration::from_secs(2));
    let conn = Conn::connect(&target).await.map_err(|e| e.to_string())?;
    let caps = conn.driver().capabilities();
    let allowance = if caps.counts_shutdown_returns {
        0
    } else {
        jobrail::SHUTDOWN_GRACE
    };
    let producer = Producer::new(conn.driver());
    let mut books = new_books(suite, kind, "crash");
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, cap, Duration::from_secs(30));
    suite.dispatch(&producer, &job, &mut books, 0..3).await;
    let spec = WorkerSpec {
        target: &target,
        queue: &queue,
        ledger: &ledger,
        mode: Mode::Abort,
        concurrency: 1,
        cap,
        timeout: Duration::from_secs(30),
        slow: Duration::ZERO,
        panic_id: None,
        tables: None,
        netns: None,
        tag: format!("{}-crash", kind.name()),
    };
    let mut workers = Workers {
        children: vec![suite.spawn(&spec)],
    };
    let mut restarts = 0;
    let mut first_start: Option<Instant> = None;
    let mut last_record_count = 0;
    let mut last_record_at = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last_poll = Instant::now() - Duration::from_secs(1);
    let ended = loop {
        if first_start.is_none() && !Tally::read(&books.ledger).starts.is_empty() {
            first_start = Some(Instant::now());
        }
        if last_poll.elapsed() >= Duration::from_millis(300) {
            last_poll = Instant::now();
            let account = books.account(&conn).await;
            if account.records.len() > last_record_count {
                last_record_count = account.records.len();
                last_record_at = Some(Instant::now());
            }
            if account.recorded.len() == 3 && account.missing.is_empty() {
                break true;
            }
        }
        if Instant::now() >= deadline || restarts >= 80 {
            break false;
        }
        if let Ok(Some(_)) = workers.children[0].try_wait() {
            restarts += 1;
            workers.children[0] = suite.spawn(&spec);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    workers.stop().await;
    let account = books.account(&conn).await;
    suite.check_lost(kind, Fault::Crash, &account);
    let starts: usize = account.tally.starts.values().sum();
    let most = account.tally.starts.values().copied().max().unwrap_or(0);
    let bound = (cap + allowance) as usize;
    if !ended {
        suite.problems.push(format!(
            "{} crash loop: did NOT end: {} of 3 failure records after {restarts} restarts (bound 120 s / 80 restarts)",
            kind.name(),
            account.recorded.len()
        ));
    }
    if account.records.len() != 3 {
        suite.problems.push(format!(
            "{} crash loop: {} failure records, expected 3",
            kind.name(),
            account.records.len()
        ));
    }
    if most > bound {
        suite.problems.push(format!(
            "{} crash loop: a job started {most} times, over its bound of cap {cap} + {allowance}",
            kind.name()
        ));
    }
    if account.tally.lines() > 0 {
        suite.problems.push(format!(
            "{} crash loop: {} effects from a handler that always aborts",
            kind.name(),
            account.tally.lines()
        ));
    }
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for r in &account.records {
        *kinds
            .entry(format!("{:?} at delivery {}", r.kind, r.attempt))
            .or_default() += 1;
    }
    let recovery = match (first_start, last_record_at) {
        (Some(a), Some(b)) if b > a => secs(b - a),
        _ => "n/a".into(),
    };
    let mut row = suite.row(
        kind,
        Fault::Crash,
        &books,
        &account,
        recovery,
        format!(
            "cap {cap}, lease {}; {starts} deliveries started (at most {most} per job; bound cap + {allowance} = {bound}); {restarts} worker restarts; records: {}",
            secs(target.lease),
            kinds
                .iter()
                .map(|(k, n)| format!("{n} x {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    row.executed = format!("0 ({starts} starts)");
    suite.rows.push(row);
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// Slow handler: five jobs whose handler runs 3 leases (lease 2 s, handler
/// 6 s, job timeout 30 s), one worker with concurrency 5; then 5 s more to
/// let a duplicate show. Recovery: from the dispatch until all effects.
async fn slow(suite: &mut Suite, env: &Env) -> Result<(), String> {
    let kind = env.kind;
    match kind {
        Kind::Memory => {
            suite.rows.push(Row::na(
                kind,
                Fault::Slow,
                "no lease: a delivery is held until it is settled",
            ));
            return Ok(());
        }
        Kind::Rabbitmq => {
            suite.rows.push(Row::na(
                kind,
                Fault::Slow,
                "no lease: a delivery is held while the consumer's channel lives",
            ));
            return Ok(());
        }
        _ => {}
    }
    let lease = Duration::from_secs(2);
    let handler = lease * 3;
    let target = env.target.with_lease(lease);
    let conn = Conn::connect(&target).await.map_err(|e| e.to_string())?;
    let producer = Producer::new(conn.driver());
    let mut books = new_books(suite, kind, "slow");
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, 3, Duration::from_secs(30));
    let begun = Instant::now();
    suite.dispatch(&producer, &job, &mut books, 0..5).await;
    let spec = WorkerSpec {
        target: &target,
        queue: &queue,
        ledger: &ledger,
        mode: Mode::Slow,
        concurrency: 5,
        cap: 3,
        timeout: Duration::from_secs(30),
        slow: handler,
        panic_id: None,
        tables: None,
        netns: None,
        tag: format!("{}-slow", kind.name()),
    };
    let mut workers = Workers {
        children: vec![suite.spawn(&spec)],
    };
    let (_, done) = books
        .wait_accounted(&conn, Duration::from_secs(60), false)
        .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    workers.stop().await;
    let account = books.account(&conn).await;
    suite.check_lost(kind, Fault::Slow, &account);
    let recovery = done.map_or("not within 60 s".into(), |t| secs(t - begun));
    let notes = format!(
        "lease {}, handler {} (3 leases), 1 worker x 5; duplicates here mean the lease was not extended",
        secs(lease),
        secs(handler)
    );
    let row = suite.row(kind, Fault::Slow, &books, &account, recovery, notes);
    suite.rows.push(row);
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// Connections terminated (Postgres queue only; no row elsewhere): the
/// kill-load scenario's three workers (concurrency 8) and `--pg-jobs` jobs
/// dispatched at a pace over 6 s, while every 0.5 s the orchestrator
/// terminates every backend of the workers (`pg_terminate_backend` on
/// their application name; its own connections are spared) until every
/// effect is in; mid-fetch, mid-settlement, mid-renewal, the listening
/// connection too. Recovery: from the last termination until every id is
/// accounted for.
async fn terminate(suite: &mut Suite, env: &Env, args: &RunArgs) -> Result<(), String> {
    #[cfg(feature = "postgres-queue")]
    if env.kind == Kind::Postgres {
        return terminate_postgres(suite, env, args).await;
    }
    let _ = (suite, env, args);
    Ok(())
}

#[cfg(feature = "postgres-queue")]
async fn terminate_postgres(suite: &mut Suite, env: &Env, args: &RunArgs) -> Result<(), String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let kind = env.kind;
    let n = args.pg_jobs as u64;
    let target = env.target.with_lease(Duration::from_secs(3));
    let conn = Conn::connect(&target).await.map_err(|e| e.to_string())?;
    let admin = pg_admin(&target).await?;
    let producer = Producer::new(conn.driver());
    let mut books = new_books(suite, kind, "terminate");
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let job = worker::job(&books.queue, 10, Duration::from_secs(60));
    let spec = WorkerSpec {
        target: &target,
        queue: &queue,
        ledger: &ledger,
        mode: Mode::Effect,
        concurrency: 8,
        cap: 10,
        timeout: Duration::from_secs(60),
        slow: Duration::ZERO,
        panic_id: None,
        tables: None,
        netns: None,
        tag: format!("{}-terminate", kind.name()),
    };
    let mut workers = Workers {
        children: (0..3).map(|_| suite.spawn(&spec)).collect(),
    };
    let begun = Instant::now();
    let items: Vec<Item> = (0..n).map(|id| suite.item(id)).collect();
    let dispatched = AtomicBool::new(false);
    let paced = async {
        let result = paced_dispatch(&producer, &job, items, Duration::from_secs(6)).await;
        dispatched.store(true, Ordering::SeqCst);
        result
    };
    let app = format!("{}_worker", target.pg_schema.as_deref().unwrap_or_default());
    let sql = "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
               WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND application_name = $1";
    let watched = &books;
    let terminating = async {
        let (mut rounds, mut terminated, mut errors) = (0usize, 0i64, 0usize);
        let mut last = Instant::now();
        let bound = Instant::now() + Duration::from_secs(60);
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let done = dispatched.load(Ordering::SeqCst)
                && watched.tally().await.effects.len() as u64 >= n;
            if done || Instant::now() >= bound {
                break;
            }
            match admin.query_one(sql, &[&app]).await {
                Ok(row) => {
                    let count: i64 = row.get(0);
                    rounds += 1;
                    terminated += count;
                    if count > 0 {
                        last = Instant::now();
                    }
                }
                Err(e) => {
                    errors += 1;
                    tracing::warn!(error = %e, "pg_terminate_backend");
                }
            }
        }
        (rounds, terminated, errors, last)
    };
    let ((results, dispatch_time), (rounds, terminated, errors, last)) =
        tokio::join!(paced, terminating);
    suite.settle_dispatches(&mut books, results);
    let (_, done) = books
        .wait_accounted(&conn, Duration::from_secs(180), false)
        .await;
    let exited = workers
        .children
        .iter_mut()
        .map(|c| c.try_wait())
        .filter(|status| matches!(status, Ok(Some(_))))
        .count();
    workers.stop().await;
    let account = books.account(&conn).await;
    let what = format!("{} {}", kind.name(), Fault::Terminate.name());
    suite.check_lost(kind, Fault::Terminate, &account);
    if terminated == 0 {
        suite.problems.push(format!(
            "{what}: no worker connection was terminated: the scenario did not run"
        ));
    }
    if exited > 0 {
        suite.problems.push(format!(
            "{what}: {exited} workers exited when their connections were terminated"
        ));
    }
    if errors > 0 {
        suite.problems.push(format!(
            "{what}: {errors} rounds of pg_terminate_backend failed (see the orchestrator log)"
        ));
    }
    let recovery = done.map_or("not within 180 s".into(), |t| secs(t - last));
    let throughput = done.map_or(String::new(), |t| {
        format!("{:.0} jobs/s overall", n as f64 / (t - begun).as_secs_f64())
    });
    let notes = format!(
        "{terminated} worker connections terminated in {rounds} rounds (every 0.5 s while work remained), 3 workers x 8; lease {}; dispatch {}; {throughput}",
        secs(target.lease),
        secs(dispatch_time),
    );
    let row = suite.row(kind, Fault::Terminate, &books, &account, recovery, notes);
    suite.rows.push(row);
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// The label of the AWS access key id: an identifier, not a secret (it
/// travels in every signed request), reported apart; the AWS SDK's own
/// debug output shows it.
const ACCESS_KEY_ID: &str = "AWS access key id";

/// What the log scan found.
struct Scan {
    files: usize,
    lines: usize,
    /// Lines with the payload marker, a password or the secret key: each fails the run.
    hits: Vec<String>,
    /// Lines of the AWS SDK's own crates with the AWS access key id only
    /// (reported, not failing).
    key_id_hits: Vec<String>,
}

/// Scans every log of the run (workers' stderr with their debug traces,
/// the orchestrator's trace, the private brokers' logs) for the payload
/// marker and every credential.
fn scan_logs(suite: &Suite) -> Scan {
    let mut scan = Scan {
        files: 0,
        lines: 0,
        hits: vec![],
        key_id_hits: vec![],
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&suite.logs)
        .map(|dir| dir.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    for file in files {
        let Ok(bytes) = std::fs::read(&file) else {
            continue;
        };
        scan.files += 1;
        let text = String::from_utf8_lossy(&bytes);
        let name = file.file_name().unwrap_or_default().to_string_lossy();
        for (n, line) in text.lines().enumerate() {
            scan.lines += 1;
            let found: Vec<&(String, String)> = suite
                .secrets
                .iter()
                .filter(|(_, value)| line.contains(value.as_str()))
                .collect();
            if found.is_empty() {
                continue;
            }
            let mut masked = line.to_string();
            for (label, value) in &suite.secrets {
                masked = masked.replace(value.as_str(), &format!("<{label}>"));
            }
            let masked: String = masked.chars().take(400).collect();
            let what: Vec<&str> = found.iter().map(|(l, _)| l.as_str()).collect();
            let what = what.join(", ");
            // The AWS SDK's own debug lines print the resolved credentials
            // with the access key id in clear (the secret redacted): reported
            // apart. The key id anywhere else (our code) is a hit.
            let identifier_only = found.iter().all(|(l, _)| l == ACCESS_KEY_ID)
                && SDK_TARGETS.iter().any(|target| line.contains(target));
            let list = if identifier_only {
                &mut scan.key_id_hits
            } else {
                &mut scan.hits
            };
            list.push(format!("{name}:{}: {what} in: {masked}", n + 1));
        }
    }
    scan
}

/// The log targets of the AWS SDK's own crates (their lines carry the
/// target after the span list).
const SDK_TARGETS: &[&str] = &[
    " aws_smithy_runtime",
    " aws_sigv4",
    " aws_smithy_runtime_api",
];

fn report(suite: &Suite, scan: &Scan, elapsed: Duration) -> String {
    let mut out = String::new();
    out.push_str("## Fault suite\n\n");
    out.push_str(&format!(
        "Run `{}`, {} worker processes, {} in total.\n\n",
        suite.run,
        suite.workers_spawned,
        secs(elapsed)
    ));
    out.push_str("| driver | fault | dispatched | executed (distinct) | duplicates | lost | failure records | recovery | notes |\n");
    out.push_str("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
    for r in &suite.rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend.name(),
            r.fault.name(),
            r.dispatched,
            r.executed,
            r.duplicates,
            r.lost,
            r.records,
            r.recovery,
            r.notes.replace('|', "/")
        ));
    }
    if !suite.outage.is_empty() {
        out.push_str("\nDispatch while the backend is away (memory: after the driver is stopped; rabbitmq, nats and postgres: private broker or server stopped; sqs: a closed loopback port):\n\n");
        out.push_str("| driver | call | outcome | latency |\n| --- | --- | --- | ---: |\n");
        for c in &suite.outage {
            out.push_str(&format!(
                "| {} | {} | {} | {:.2} ms |\n",
                c.backend.name(),
                c.what,
                c.outcome,
                c.latency.as_secs_f64() * 1000.0
            ));
        }
    }
    out.push_str(&format!(
        "\nLog scan: {} files, {} lines, searched for the payload marker and {} credentials: {}.\n",
        scan.files,
        scan.lines,
        suite.secrets.len().saturating_sub(1),
        if scan.hits.is_empty() {
            "no hit".to_string()
        } else {
            format!("{} HITS", scan.hits.len())
        }
    ));
    for hit in scan.hits.iter().take(20) {
        out.push_str(&format!("- LEAK {hit}\n"));
    }
    if scan.hits.len() > 20 {
        out.push_str(&format!("- ... and {} more\n", scan.hits.len() - 20));
    }
    if !scan.key_id_hits.is_empty() {
        let files: BTreeSet<&str> = scan
            .key_id_hits
            .iter()
            .filter_map(|h| h.split(':').next())
            .collect();
        out.push_str(&format!(
            "\nThe AWS access key id (an identifier, not the secret) is in {} lines of {} logs, all from the AWS SDK's own crates; the first:\n\n- {}\n",
            scan.key_id_hits.len(),
            files.len(),
            scan.key_id_hits[0]
        ));
    }
    if !suite.problems.is_empty() {
        out.push_str("\nProblems:\n\n");
        for p in &suite.problems {
            out.push_str(&format!("- {p}\n"));
        }
    }
    out.push_str("\nRecovery: kill load, from the last kill until every id is in the ledger or a failure record; broker restart, from the broker being back until the first new effect; crash loop, from the first start until the last failure record; slow handler, from the dispatch until every effect; exactly-once charge, from the last kill until every id has a charge row or a failure record; connections terminated, from the last termination until every id is accounted for. Exactly-once charge duplicates: deliveries beyond one per id (expected) / charge rows beyond one per id (must be 0).\n");
    out
}
