//! The partition faults: workers and a dispatcher in network namespaces of
//! their own ([`crate::netns`]), cut off from their broker and their claim
//! store without a reset, slowed down, or left with half-open connections.
//!
//! Every fault runs the exactly-once charge (claims on Postgres, or on the
//! Postgres queue transactional completion) with three workers
//! (concurrency 4), each in its own namespace, and a dispatcher process in a
//! fourth, which dispatches `--partition-charges` business ids at a steady
//! pace over 6 s plus the fault's length and repeats each refused or uncertain dispatch every
//! 300 ms until it is accepted (an uncertain one may then arrive twice: a
//! duplicate message, never a second charge). Leases are 2 s (broker lease
//! and claim lease); each operation is bounded by 3 s. Two seconds after
//! the start (as soon as worker 0 has a charge under way, 2 s at most):
//!
//! - **partition**: the four links go down for `--partition-leases`
//!   leases, then up again;
//! - **one worker cut off**: worker 0's link goes down as long, the other
//!   two keep consuming: its deliveries return to them when their lease
//!   lapses, its claims are taken over, and when it comes back its late
//!   completions must be refused (fencing: a `lost` line, rolled back);
//! - **slow link**: every link holds each chunk 200 ms, both ways, as long;
//! - **half-open connection**: every connection of worker 0 and of the
//!   dispatcher open at that moment stops forwarding from the servers (for
//!   good: a connection whose return path died never recovers); the
//!   processes must notice and connect again, within 60 s.
//!
//! Then every id must be accounted for (a charge row or a failure record),
//! none charged twice, every dispatch attempt answered within the
//! operation timeout plus 2 s, and no worker may have exited. Recovery is
//! measured from the heal (half-open: from the fault) to the first charge
//! made after it (by the cut-off worker, for the faults that cut one) and
//! to the last id accounted for.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, SystemTime};

use clap::Args;
use futures_util::stream::{self, StreamExt};
use jobrail_native::Producer;
use tokio::time::Instant;

use super::{
    check_charges, new_books, secs, Books, Env, Fault, Row, RunArgs, Suite, WorkerSpec, Workers,
};
use crate::backend::{Conn, Kind, Target};
use crate::netns::Net;
use crate::worker::{self, Item, Mode};

/// The broker lease and the claim lease of the partition faults.
const LEASE: Duration = Duration::from_secs(2);
/// The bound on each round trip.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(3);
/// What a dispatch attempt may take beyond the operation timeout.
const SLACK: Duration = Duration::from_secs(2);
/// The environment variable carrying the payload marker to the dispatcher.
const MARKER_VAR: &str = "FAULTS_MARKER";

/// `jobrail-faults dispatcher`: dispatches business ids at a steady pace,
/// repeating each until it is accepted, and writes every attempt to a file
/// (started by the partition faults, inside a namespace).
#[derive(Args, Debug, Clone)]
pub(crate) struct DispatcherArgs {
    /// The backend (its URL and keys come from the orchestrator's environment).
    #[arg(long, value_enum)]
    backend: Kind,
    /// The queue to dispatch to.
    #[arg(long)]
    queue: String,
    /// Business ids `0..jobs`.
    #[arg(long)]
    jobs: u64,
    /// Spread over this long, in ms.
    #[arg(long)]
    over_ms: u64,
    /// Gives an id up after this long, in ms.
    #[arg(long, default_value_t = 120_000)]
    give_up_ms: u64,
    /// The attempts file: `<outcome> <id> <message id or -> <ms>` a line.
    #[arg(long)]
    out: PathBuf,
}

/// Runs the dispatcher.
pub(crate) async fn dispatcher(args: DispatcherArgs) -> Result<(), Box<dyn std::error::Error>> {
    let target = Target::from_env(args.backend, LEASE);
    let conn = Conn::connect(&target).await?;
    let producer = Producer::new(conn.driver());
    let job = worker::job(&args.queue, 10, Duration::from_secs(60));
    let out = worker::open_ledger(&args.out);
    let marker = std::env::var(MARKER_VAR).unwrap_or_default();
    let started = Instant::now();
    let step = Duration::from_millis(args.over_ms) / (args.jobs.max(1) as u32);
    let give_up = Duration::from_millis(args.give_up_ms);
    let (producer, job, out, marker) = (&producer, &job, &out, &marker);
    stream::iter(0..args.jobs)
        .map(|id| async move {
            tokio::time::sleep_until(started + step * id as u32).await;
            let item = Item {
                id,
                marker: marker.clone(),
            };
            let first = Instant::now();
            loop {
                let attempt = Instant::now();
                let result = producer.dispatch(job).send(&item).await;
                let ms = attempt.elapsed().as_millis();
                match result {
                    Ok(message) => {
                        worker::append(out, &format!("ok {id} {message} {ms}\n"));
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, id, "dispatch refused");
                        worker::append(out, &format!("{:?} {id} - {ms}\n", e.kind()));
                        if first.elapsed() >= give_up {
                            worker::append(out, &format!("gave-up {id} - 0\n"));
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                }
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    conn.driver().stop().await?;
    Ok(())
}

/// The dispatcher's attempts, read back.
#[derive(Default)]
struct Attempts {
    /// Attempts in all.
    total: usize,
    /// Accepted.
    ok: usize,
    /// Refused, by error kind.
    refused: std::collections::BTreeMap<String, usize>,
    /// The slowest attempt.
    slowest: Duration,
    /// Ids given up on.
    gave_up: Vec<u64>,
    /// Uncertain attempts per id: each may have stored a copy.
    uncertain: std::collections::BTreeMap<u64, usize>,
}

/// Reads the dispatcher's file into `books` (accepted and uncertain ids).
fn read_attempts(path: &std::path::Path, books: &mut Books) -> Attempts {
    let mut attempts = Attempts::default();
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [outcome, id, message, ms] = words[..] else {
            continue;
        };
        let (Ok(id), Ok(ms)) = (id.parse::<u64>(), ms.parse::<u64>()) else {
            continue;
        };
        if outcome == "gave-up" {
            attempts.gave_up.push(id);
            continue;
        }
        attempts.total += 1;
        attempts.slowest = attempts.slowest.max(Duration::from_millis(ms));
        if outcome == "ok" {
            attempts.ok += 1;
            books.ids.insert(message.to_string(), id);
            books.expected.insert(id);
        } else {
            *attempts.refused.entry(outcome.to_string()).or_default() += 1;
            if outcome == "Uncertain" {
                books.uncertain.insert(id);
                *attempts.uncertain.entry(id).or_default() += 1;
            }
        }
    }
    attempts
}

/// The loopback port of a server URL (`...127.0.0.1:PORT...`).
fn loopback_port(url: &str) -> Option<u16> {
    let rest = &url[url.find("127.0.0.1:")? + "127.0.0.1:".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn slug(fault: Fault) -> &'static str {
    match fault {
        Fault::Partition => "partition",
        Fault::Isolate => "isolate",
        Fault::SlowLink => "slowlink",
        _ => "halfopen",
    }
}

/// Runs one partition fault on `env`'s backend.
pub(super) async fn run(
    suite: &mut Suite,
    env: &Env,
    fault: Fault,
    args: &RunArgs,
) -> Result<(), String> {
    let kind = env.kind;
    if kind == Kind::Memory {
        suite.rows.push(Row::na(
            kind,
            fault,
            "the memory driver lives in one process: there is no network to cut",
        ));
        return Ok(());
    }
    let database = crate::charge::database_url();
    let mut ports = vec![];
    for url in [&env.target.url, &database] {
        let port = loopback_port(url).ok_or_else(|| {
            "the partition faults reach their servers on 127.0.0.1 (with a port in the URL)"
                .to_string()
        })?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    let net = Net::create(4, &ports).await?;
    let result = cell(suite, env, fault, args, &net).await;
    drop(net);
    result
}

/// The fault's body, on the namespaces of `net` (workers on links 0..3,
/// the dispatcher on link 3).
async fn cell(
    suite: &mut Suite,
    env: &Env,
    fault: Fault,
    args: &RunArgs,
    net: &Net,
) -> Result<(), String> {
    let kind = env.kind;
    let n = match kind {
        Kind::Sqs => args.sqs_partition_charges,
        _ => args.partition_charges,
    } as u64;
    let hold = LEASE * args.partition_leases;
    let tx = kind == Kind::Postgres;
    let mut target = env.target.with_lease(LEASE);
    target.operation_timeout = OPERATION_TIMEOUT;
    // The orchestrator's own connection (on loopback, never cut).
    let conn = Conn::connect(&env.target.with_lease(LEASE))
        .await
        .map_err(|e| e.to_string())?;
    let tables =
        crate::charge::Tables::new(&suite.run, &format!("{}_{}", kind.name(), slug(fault)));
    let ledger_db =
        match crate::charge::Ledger::create(&crate::charge::database_url(), &tables).await {
            Ok(ledger) => ledger,
            Err(e) => {
                let _ = conn.driver().stop().await;
                return Err(e);
            }
        };
    let mut books = new_books(suite, kind, slug(fault));
    books.charges = Some(ledger_db);
    let (queue, ledger) = (books.queue.clone(), books.ledger.clone());
    let tag = format!("{}-{}", kind.name(), slug(fault));
    let mut workers = Workers { children: vec![] };
    for link in &net.links[..3] {
        let spec = WorkerSpec {
            target: &target,
            queue: &queue,
            ledger: &ledger,
            mode: if tx { Mode::ChargeTx } else { Mode::Charge },
            concurrency: 4,
            cap: 10,
            timeout: Duration::from_secs(60),
            slow: Duration::ZERO,
            panic_id: None,
            tables: Some(&tables),
            netns: Some(link),
            tag: tag.clone(),
        };
        workers.children.push(suite.spawn(&spec));
    }
    let attempts_path = suite.work.join(format!("{tag}.dispatches"));
    // The dispatch lasts past the heal, so that work remains after it.
    let over = Duration::from_secs(6) + hold;
    let mut dispatcher =
        spawn_dispatcher(suite, &target, net, &queue, n, over, &attempts_path, &tag)?;
    let begun = Instant::now();

    // The fault, two seconds in, once worker 0 has a charge under way (2 s
    // at most), so that the fault lands in the middle of its work.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let worker0 = workers.children[0].id();
    let aim_bound = Instant::now() + Duration::from_secs(2);
    let mut aimed = false;
    while Instant::now() < aim_bound {
        if books.tally().await.busy().contains(&worker0) {
            aimed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at_fault = Instant::now();
    let mut noticed = None;
    let fault_note;
    match fault {
        Fault::Partition => {
            for k in 0..4 {
                net.cut(k)?;
            }
            tokio::time::sleep(hold).await;
            for k in 0..4 {
                net.heal(k)?;
            }
            fault_note = format!("every link down {}", secs(hold));
        }
        Fault::Isolate => {
            net.cut(0)?;
            tokio::time::sleep(hold).await;
            net.heal(0)?;
            fault_note = format!("worker 0's link down {}", secs(hold));
        }
        Fault::SlowLink => {
            for link in &net.links {
                link.delay(Duration::from_millis(200));
            }
            tokio::time::sleep(hold).await;
            for link in &net.links {
                link.delay(Duration::ZERO);
            }
            fault_note = format!("every chunk held 200 ms both ways for {}", secs(hold));
        }
        _ => {
            let before = net.links[0].connections();
            net.links[0].half_open();
            net.links[3].half_open();
            let bound = Instant::now() + Duration::from_secs(60);
            while Instant::now() < bound && net.links[0].connections() == before {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            noticed = (net.links[0].connections() > before).then(|| net.links[0].last_accept());
            if noticed.is_none() {
                suite.problems.push(format!(
                    "{tag}: worker 0 did not connect again within 60 s of its connections going half-open (a silent connection never noticed)"
                ));
            }
            fault_note = format!(
                "worker 0's and the dispatcher's connections half-open (server to client), {} connections before, {} after",
                before,
                net.links[0].connections()
            );
        }
    }
    let healed = Instant::now();
    let healed_wall = SystemTime::now();

    // The dispatcher ends once every id was accepted (or given up on).
    let dispatch_bound = Instant::now() + Duration::from_secs(150);
    loop {
        match dispatcher.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    suite
                        .problems
                        .push(format!("{tag}: the dispatcher exited with {status}"));
                }
                break;
            }
            Ok(None) if Instant::now() < dispatch_bound => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ => {
                let _ = dispatcher.kill();
                let _ = dispatcher.wait();
                suite.problems.push(format!(
                    "{tag}: the dispatcher had not finished after 150 s"
                ));
                break;
            }
        }
    }
    let attempts = read_attempts(&attempts_path, &mut books);
    let (_, done) = books
        .wait_accounted(&conn, Duration::from_secs(180), false)
        .await;
    // No worker may have died of the fault.
    for (i, child) in workers.children.iter_mut().enumerate() {
        if let Ok(Some(status)) = child.try_wait() {
            suite.problems.push(format!(
                "{tag}: worker {i} exited during the fault ({status})"
            ));
        }
    }
    workers.stop().await;
    let account = books.account(&conn).await;
    let ledger_db = books.charges.take().expect("the books have the tables");
    let tally = &account.tally;

    // What must hold.
    suite.check_lost(kind, fault, &account);
    // With claims (the brokers), the key is the business id: one charge
    // whatever was dispatched. On the Postgres queue the guard is the job
    // (its completion commits with its charge), and a dispatch repeated
    // after an uncertain one may have stored a second job: each uncertain
    // attempt allows one more charge of its id, no more.
    let allowed = |id: u64| {
        if tx {
            1 + attempts.uncertain.get(&id).copied().unwrap_or(0)
        } else {
            1
        }
    };
    let doubled = check_charges(suite, &tag, tally, allowed);
    let repeated_jobs: usize = tally
        .effects
        .iter()
        .filter(|(_, rows)| **rows > 1)
        .map(|(_, rows)| rows - 1)
        .sum();
    let unexpected = tally
        .effects
        .keys()
        .filter(|id| !books.expected.contains(id) && !books.uncertain.contains(id))
        .count();
    if unexpected > 0 {
        suite.problems.push(format!(
            "{tag}: {unexpected} ids charged that were neither accepted nor uncertain"
        ));
    }
    if attempts.slowest > OPERATION_TIMEOUT + SLACK {
        suite.problems.push(format!(
            "{tag}: a dispatch took {} (the operation timeout is {}): it blocked past its bound",
            secs(attempts.slowest),
            secs(OPERATION_TIMEOUT)
        ));
    }
    if !attempts.gave_up.is_empty() {
        suite.problems.push(format!(
            "{tag}: {} ids were never accepted in 120 s of attempts (first: {:?})",
            attempts.gave_up.len(),
            &attempts.gave_up[..attempts.gave_up.len().min(10)]
        ));
    }
    if attempts.ok as u64 + attempts.gave_up.len() as u64 != n {
        suite.problems.push(format!(
            "{tag}: the dispatcher accounted for {} of {n} ids",
            attempts.ok + attempts.gave_up.len()
        ));
    }

    // Recovery.
    let cut_off = matches!(fault, Fault::Isolate | Fault::HalfOpen).then_some(worker0);
    let since = match noticed {
        Some(noticed) => SystemTime::now() - (Instant::now() - noticed.min(Instant::now())),
        None => healed_wall,
    };
    let first = match ledger_db.first_charge_after(since, cut_off).await {
        Ok(Some(at)) => {
            let since = since
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64();
            format!("{:.1} s", (at - since).max(0.0))
        }
        Ok(None) => "none".into(),
        Err(e) => {
            suite.problems.push(format!("{tag}: {e}"));
            "?".into()
        }
    };
    let drained = done.map_or("not within 180 s".to_string(), |t| {
        secs(t.saturating_duration_since(healed))
    });
    let recovery = match fault {
        Fault::HalfOpen => format!(
            "noticed {}, first charge by it {first}, drained {drained}",
            noticed.map_or("never".to_string(), |t| secs(t - at_fault))
        ),
        Fault::Isolate => format!("first charge by it {first}, drained {drained}"),
        _ => format!("first charge {first}, drained {drained}"),
    };
    let refused: Vec<String> = attempts
        .refused
        .iter()
        .map(|(kind, count)| format!("{count} {kind}"))
        .collect();
    let uncertain_twice = books
        .uncertain
        .iter()
        .filter(|id| tally.deliveries.get(id).copied().unwrap_or(0) > 1)
        .count();
    let retaken = tally.fences.values().filter(|fence| **fence > 1).count();
    let notes = format!(
        "{fault_note}{}{}; 3 workers x 4 in namespaces, dispatcher in a fourth; lease {}, operation timeout {}; dispatch attempts {} ({} accepted{}{}), slowest {}; {} uncertain ids repeated ({uncertain_twice} delivered more than once); {} deliveries: {} completions refused as too late (rolled back), {} found the charge done, {} held; {retaken} charges under a retaken {}; {} s in all",
        if aimed { ", with a charge of worker 0 under way" } else { "" },
        if tx && repeated_jobs > 0 {
            format!("; {repeated_jobs} second charges, each of an id whose dispatch was repeated after an uncertain one (a second job: complete_in guards a job, not a business id)")
        } else {
            String::new()
        },
        secs(LEASE),
        secs(OPERATION_TIMEOUT),
        attempts.total,
        attempts.ok,
        if refused.is_empty() { "" } else { ", " },
        refused.join(", "),
        secs(attempts.slowest),
        books.uncertain.len(),
        tally.deliveries.values().sum::<usize>(),
        tally.lost_claims,
        tally.skips,
        tally.held,
        if tx { "lease (attempt > 1)" } else { "claim (fence > 1)" },
        begun.elapsed().as_secs(),
    );
    let delivery_duplicates: usize = tally.deliveries.values().map(|n| n - 1).sum();
    let charge_duplicates = tally.duplicates();
    let mut row = suite.row(kind, fault, &books, &account, recovery, notes);
    row.duplicates = format!(
        "{delivery_duplicates} deliveries / {charge_duplicates} charges, {} doubled",
        doubled.len()
    );
    suite.rows.push(row);
    if let Err(e) = ledger_db.drop_tables().await {
        suite.problems.push(format!("{tag}: {e}"));
    }
    let _ = conn.delete(&books.queue).await;
    let _ = conn.driver().stop().await;
    Ok(())
}

/// Starts the dispatcher in the namespace of link 3.
#[allow(clippy::too_many_arguments)]
fn spawn_dispatcher(
    suite: &mut Suite,
    target: &Target,
    net: &Net,
    queue: &str,
    n: u64,
    over: Duration,
    out: &std::path::Path,
    tag: &str,
) -> Result<Child, String> {
    let link = &net.links[3];
    let _ = File::create(out);
    let log = suite.logs.join(format!("{tag}-dispatcher.log"));
    let stderr = File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
    link.command(&suite.exe)
        .arg("dispatcher")
        .args(["--backend", target.kind.name()])
        .args(["--queue", queue])
        .args(["--jobs", &n.to_string()])
        .args(["--over-ms", &over.as_millis().to_string()])
        .arg("--out")
        .arg(out)
        .envs(target.env().into_iter().map(|(k, v)| (k, link.rewrite(&v))))
        .env(MARKER_VAR, &suite.marker)
        .env("RUST_LOG", "debug")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("cannot start the dispatcher: {e}"))
}
