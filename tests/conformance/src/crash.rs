//! Crash scenarios: a worker process killed mid-job, a connection lost
//! mid-job.
//!
//! The killed-worker scenarios need a backend that keeps a delivery when its
//! consumer dies and counts it (RabbitMQ, NATS), and a worker binary for it
//! (`src/bin/*_kill_worker.rs`) that consumes one queue and prints
//! `attempt N` when its handler starts and one line per accepted outcome.
//! The connection-loss scenario needs a way to cut the connection (a broker
//! command, a proxy).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{FailureKind, Job, JobError, Registry};
use jobrail_native::{ConsumerHandle, ErrorKind};
use tokio::time::Instant;

use crate::harness::{Backend, Calls, Harness};
use crate::scenarios::Work;

/// How long a worker may take to start its handler.
const START: Duration = Duration::from_secs(20);

/// The registry of a kill worker process (`src/bin/*_kill_worker.rs`): the
/// job `name` on `queue`, capped at `cap`, whose handler prints
/// `attempt N` on stdout when it starts, then waits until the consumer
/// cancels it (a graceful shutdown) or the process is killed.
pub fn announcing_registry(queue: &str, name: &str, cap: u32) -> Registry {
    let job = Job::<Work>::builder(name)
        .queue(queue)
        .delivery_cap((cap > 0).then_some(cap))
        .build()
        .expect("job");
    let mut registry = Registry::new();
    registry
        .register(&job, |ctx: jobrail::JobContext, _work: Work| async move {
            {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                writeln!(out, "attempt {}", ctx.attempt()).expect("stdout");
                out.flush().expect("stdout");
            }
            Err(ctx.cancelled().await.into())
        })
        .expect("register");
    registry
}

/// Spawns `worker` with its standard output read line by line on a thread.
fn spawn(mut worker: Command) -> (Child, Receiver<String>) {
    let mut child = worker
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the worker");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Runs `worker` until its handler reports an attempt, SIGKILLs it (no
/// settlement, no clean close) and returns that attempt.
pub fn attempt_before_sigkill(worker: Command) -> u32 {
    let (mut child, lines) = spawn(worker);
    let attempt = lines.recv_timeout(START);
    child.kill().expect("kill the worker");
    child.wait().expect("reap the worker");
    let line = attempt.expect("the worker's handler started");
    line.strip_prefix("attempt ")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("the worker's first line is not `attempt N`: {line}"))
}

/// Runs `worker` until its handler reports an attempt, sends it SIGTERM,
/// and returns every line it printed and whether it exited successfully.
pub fn lines_after_sigterm(worker: Command) -> (Vec<String>, bool) {
    let (mut child, rx) = spawn(worker);
    let mut lines = vec![];
    if let Ok(line) = rx.recv_timeout(START) {
        lines.push(line);
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
        while let Ok(line) = rx.recv_timeout(Duration::from_secs(40)) {
            lines.push(line);
        }
    }
    let _ = child.kill();
    let success = child.wait().expect("reap the worker").success();
    (lines, success)
}

/// A worker SIGKILLed mid-job loses nothing: the backend redelivers the
/// message and the attempt count rises with each abandoned delivery, until
/// the cap turns an ordinary error into a terminal failure with one record.
///
/// `worker(queue, job, cap)` builds the command of a worker process for the
/// job `job` with cap `cap` on `queue`. Returns the queue the scenario used.
pub async fn killed_worker_loses_nothing_and_counts_the_attempt(
    backend: &dyn Backend,
    scenario: &str,
    worker: impl Fn(&str, &str, u32) -> Command + Send + 'static,
) -> String {
    let h = Harness::new(backend, scenario).await;
    let job = h.job("crashy").max_deliveries(3).build().unwrap();
    let id = h
        .producer
        .dispatch(&job)
        .send(&Work { id: 7 })
        .await
        .unwrap();

    let queue = h.queue.clone();
    let seen = tokio::task::spawn_blocking(move || {
        let first = attempt_before_sigkill(worker(&queue, "crashy", 3));
        let second = attempt_before_sigkill(worker(&queue, "crashy", 3));
        (first, second)
    })
    .await
    .unwrap();
    assert_eq!(seen, (1, 2), "each killed delivery counts");

    // The message is still there, and the next delivery is attempt 3.
    let calls = Calls::default();
    let mut registry = Registry::new();
    registry
        .register(
            &job,
            calls.handler(|_, _| Err(JobError::new("still crashing"))),
        )
        .unwrap();
    let consumer = h.start_on(backend.connect().await, registry).await;
    let events = h.events.wait_count(h.patience, "failed", 1).await;
    assert_eq!(calls.attempts(), [3]);
    assert_eq!(events.last().unwrap().message_id, id);
    consumer.shutdown().await.unwrap();
    let records = backend.failure_records(&h.queue).await;
    assert_eq!(records.len(), 1);
    assert_eq!(
        (records[0].kind, records[0].attempt),
        (FailureKind::AttemptsExhausted, 3)
    );
    h.queue.clone()
}

/// A consumer (concurrency 2) whose first message, `Work { id: 0 }`, is
/// still running its first attempt, until the test calls
/// [`release`](Self::release) (or 30 s pass): the moment to cut the
/// connection.
pub struct InterruptedJob {
    /// The scenario's harness.
    pub harness: Harness,
    /// The executions of the interrupted message.
    pub calls: Calls,
    job: Job<Work>,
    consumer: ConsumerHandle,
    /// The interrupted message's id.
    interrupted: String,
    /// Ends the interrupted handler's first attempt.
    release: Arc<tokio::sync::Notify>,
}

impl InterruptedJob {
    /// Starts the consumer, dispatches the slow message and returns once its
    /// handler runs.
    pub async fn start(backend: &dyn Backend, scenario: &str) -> Self {
        let harness = Harness::new(backend, scenario).await;
        let job = harness.job("steady").max_deliveries(5).build().unwrap();
        let started = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let calls = Calls::default();
        let (s, r, c) = (started.clone(), release.clone(), calls.clone());
        let mut registry = Registry::new();
        registry
            .register(&job, move |ctx, work: Work| {
                let (s, r) = (s.clone(), r.clone());
                if work.id == 0 {
                    c.record(&ctx);
                }
                async move {
                    if work.id == 0 && ctx.attempt() == 1 {
                        s.notify_one();
                        let _ = tokio::time::timeout(Duration::from_secs(30), r.notified()).await;
                    }
                    Ok(())
                }
            })
            .unwrap();
        let consumer = harness.start(registry, 2);
        let interrupted = harness
            .producer
            .dispatch(&job)
            .send(&Work { id: 0 })
            .await
            .unwrap();
        tokio::time::timeout(harness.patience, started.notified())
            .await
            .expect("slow handler started");
        InterruptedJob {
            harness,
            calls,
            job,
            consumer,
            interrupted,
            release,
        }
    }

    /// Lets the interrupted handler's first attempt return (once the cut
    /// is made, so it settles after it whatever the cut took).
    pub fn release(&self) {
        self.release.notify_one();
    }

    /// After the cut: five new messages (dispatch retried while the backend
    /// does not take it) all succeed, as does the interrupted one. A
    /// dispatch that was uncertain and repeated may have stored a copy
    /// under its first id too: that copy runs as well (at least once), so
    /// the wait is for every returned id, not for a count.
    pub async fn consumption_resumes(&self) {
        let h = &self.harness;
        let mut ids = BTreeSet::new();
        for id in 1..=5 {
            ids.insert(self.dispatch_retrying(id).await);
        }
        let succeeded = |events: &[jobrail::Event]| -> BTreeSet<String> {
            events
                .iter()
                .filter(|e| e.kind.name() == "succeeded")
                .map(|e| e.message_id.clone())
                .collect()
        };
        h.events
            .wait_for(
                Duration::from_secs(30),
                "every dispatched message and the interrupted one succeeded",
                |all| {
                    let done = succeeded(all);
                    ids.is_subset(&done) && done.contains(&self.interrupted)
                },
            )
            .await;
    }

    /// Dispatches `Work { id }`, retrying for up to 20 s while the backend
    /// did not take it or may not have: the connection was just cut.
    async fn dispatch_retrying(&self, id: u32) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self
                .harness
                .producer
                .dispatch(&self.job)
                .send(&Work { id })
                .await
            {
                Ok(id) => return id,
                Err(e)
                    if Instant::now() < deadline
                        && matches!(e.kind(), ErrorKind::NotAccepted | ErrorKind::Uncertain) =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("dispatch failed: {e}"),
            }
        }
    }

    /// Shuts the consumer down.
    pub async fn finish(self) {
        self.consumer.shutdown().await.unwrap();
    }
}
