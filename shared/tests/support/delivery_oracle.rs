//! One body through the pipeline a host uses ([`Registry::deliver`]) and a
//! check of how it ended. Shared by the property test (`tests/decoder.rs`)
//! and the fuzz target (`fuzz/`), which include this file.
//!
//! The rule checked, whatever the bytes:
//!
//! - a valid envelope for the registered job whose payload fits its type
//!   runs the handler once and is acknowledged;
//! - a valid envelope for a job this registry does not know is retried by
//!   the unknown-name rule (a delivery below its cap), without running;
//! - anything else ends in exactly one terminal failure, whose record keeps
//!   the message: the raw body byte for byte when the envelope did not
//!   decode, the decoded envelope when only the payload did not fit;
//!
//! and nothing panics: one settlement is requested, one event emitted.
//!
//! [`Pipeline::check_crashed`] checks the crash report of the same body
//! ([`Registry::settle_crashed`], what the edge calls after a panic aborted
//! the instance) against [`Registry::deliver`] on the same delivery: a body
//! that is not a known job's envelope is settled exactly as `deliver` settles
//! it (a malformed envelope's failure record, the unknown-name retry or, at
//! its cap, its failure record), a known job's as one failed execution; the
//! crash report never runs anything.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use jobrail::{
    CancelToken, Envelope, Event, EventKind, EventSink, FailureKind, Job, JobContext, RawBody,
    Registry, Runtime, Settlement, VirtualRuntime,
};
use serde::Deserialize;

#[path = "handle.rs"]
mod handle;

use handle::Handle;

/// The registered job's name.
pub(crate) const JOB: &str = "order";

/// The registered job's payload.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
pub(crate) struct Order {
    /// Order number.
    pub(crate) id: u64,
    /// Line items.
    pub(crate) items: Vec<String>,
    /// An optional note.
    pub(crate) note: Option<String>,
}

#[derive(Default)]
struct Sink(Mutex<Vec<Event>>);

impl EventSink for Sink {
    fn emit(&self, event: &Event) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// A registry with the one job, its handler counting executions.
pub(crate) struct Pipeline {
    registry: Registry,
    runs: Arc<AtomicU32>,
    events: Arc<Sink>,
    runtime: Arc<dyn Runtime>,
}

impl Default for Pipeline {
    fn default() -> Self {
        Self::new()
    }
}

/// How a body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Ran and acknowledged.
    Ran,
    /// Retried by the unknown-name rule.
    UnknownName,
    /// One terminal failure of this kind.
    Failed(FailureKind),
}

impl Pipeline {
    /// The registry of one job, `order`, with three attempts.
    pub(crate) fn new() -> Self {
        let job = Job::<Order>::builder(JOB)
            .max_deliveries(3)
            .build()
            .unwrap();
        let runs = Arc::new(AtomicU32::new(0));
        let counter = runs.clone();
        let mut registry = Registry::new();
        registry
            .register(&job, move |_: JobContext, _: Order| {
                counter.fetch_add(1, Ordering::SeqCst);
                async { Ok(()) }
            })
            .unwrap();
        let events = Arc::new(Sink::default());
        registry.event_sink(events.clone());
        Pipeline {
            registry,
            runs,
            events,
            runtime: Arc::new(VirtualRuntime::new()),
        }
    }

    /// Settles `body` on delivery `attempt` through `deliver` and, apart,
    /// through `settle_crashed` (see the module docs for the rule checked).
    pub(crate) fn check_crashed(&self, body: &[u8], attempt: u32) {
        let settle = |crashed: bool| {
            self.runs.store(0, Ordering::SeqCst);
            let seen = Arc::new(Mutex::new(Vec::new()));
            let handle = Handle::new(body.to_vec(), &seen).at(attempt);
            let delivered = futures_executor::block_on(async {
                if crashed {
                    self.registry
                        .settle_crashed("orders", handle, "boom", &self.runtime)
                        .await
                } else {
                    self.registry
                        .deliver("orders", handle, &self.runtime, &CancelToken::new())
                        .await
                }
            });
            assert!(delivered.outcome.is_ok(), "{:?}", delivered.outcome);
            let seen = seen.lock().unwrap().clone();
            assert_eq!(seen.len(), 1, "exactly one settlement: {seen:?}");
            let runs = self.runs.load(Ordering::SeqCst);
            (seen[0].clone(), delivered.processed.event, runs)
        };
        let (processed, processed_event, _) = settle(false);
        let (crashed, crashed_event, runs) = settle(true);
        assert_eq!(runs, 0, "a crash report runs nothing");
        let known = Envelope::decode(body).is_ok_and(|envelope| envelope.job == JOB);
        let shown = || String::from_utf8_lossy(body).into_owned();
        if known {
            // One failed execution, by the job's policy (3 attempts).
            assert_eq!(crashed_event.executions, 1, "{}", shown());
            match &crashed {
                Settlement::Retry {
                    delay: _,
                    shutdown: false,
                } => assert!(attempt < 3, "attempt {attempt}: {crashed:?}"),
                Settlement::Fail(record) => {
                    assert!(attempt >= 3, "attempt {attempt}: {record:?}");
                    assert_eq!(record.executions, 1);
                }
                other => panic!("{}: a crashed execution settled as {other:?}", shown()),
            }
            return;
        }
        assert_eq!(
            crashed_event.kind.name(),
            processed_event.kind.name(),
            "{}",
            shown()
        );
        assert_eq!(crashed_event.executions, 0);
        assert_eq!(
            (&crashed_event.job, &crashed_event.message_id),
            (&processed_event.job, &processed_event.message_id)
        );
        match (&processed, &crashed) {
            (Settlement::Fail(a), Settlement::Fail(b)) => {
                assert_eq!(
                    (a.kind, &a.reason, &a.raw_body, &a.envelope, a.attempt),
                    (b.kind, &b.reason, &b.raw_body, &b.envelope, b.attempt),
                    "{}",
                    shown()
                );
                assert_eq!((&a.job, &a.message_id), (&b.job, &b.message_id));
            }
            (a, b) => assert_eq!(a, b, "{}", shown()),
        }
    }

    /// Delivers `body` once and checks how it ended against the rule above;
    /// panics (failing the test or the fuzz run) if it did not.
    pub(crate) fn check(&self, body: &[u8]) -> Ending {
        self.runs.store(0, Ordering::SeqCst);
        self.events.0.lock().unwrap().clear();
        let settlements = Arc::new(Mutex::new(Vec::new()));
        let handle = Handle::new(body.to_vec(), &settlements);
        let delivered = futures_executor::block_on(self.registry.deliver(
            "orders",
            handle,
            &self.runtime,
            &CancelToken::new(),
        ));
        assert!(delivered.outcome.is_ok(), "{:?}", delivered.outcome);
        let settlements = settlements.lock().unwrap().clone();
        assert_eq!(
            settlements.len(),
            1,
            "exactly one settlement: {settlements:?}"
        );
        let events = self.events.0.lock().unwrap().clone();
        assert_eq!(events.len(), 1, "exactly one event: {events:?}");
        let runs = self.runs.load(Ordering::SeqCst);

        let expected = match Envelope::decode(body) {
            Err(_) => None,
            Ok(envelope) if envelope.job != JOB => Some((envelope, Ending::UnknownName)),
            Ok(envelope) => {
                let fits = serde_json::from_value::<Order>(envelope.payload.clone()).is_ok();
                let ending = if fits {
                    Ending::Ran
                } else {
                    Ending::Failed(FailureKind::UndecodablePayload)
                };
                Some((envelope, ending))
            }
        };
        match (expected, &settlements[0]) {
            (None, Settlement::Fail(record)) => {
                assert_eq!(record.kind, FailureKind::MalformedEnvelope, "{record:?}");
                assert_eq!(
                    record.raw_body,
                    Some(RawBody::from_bytes(body)),
                    "the raw body is kept"
                );
                assert_eq!(record.raw_body.as_ref().unwrap().to_bytes(), body);
                assert!(record.envelope.is_none());
                assert_eq!(runs, 0);
                assert!(
                    matches!(events[0].kind, EventKind::Failed { .. }),
                    "{events:?}"
                );
                Ending::Failed(record.kind)
            }
            (Some((envelope, Ending::Failed(kind))), Settlement::Fail(record)) => {
                assert_eq!(record.kind, kind, "{record:?}");
                assert_eq!(
                    record.envelope.as_ref(),
                    Some(&envelope),
                    "the envelope is kept"
                );
                assert_eq!(runs, 0, "a payload that does not fit never runs");
                assert!(
                    matches!(events[0].kind, EventKind::Failed { .. }),
                    "{events:?}"
                );
                Ending::Failed(kind)
            }
            (
                Some((_, Ending::UnknownName)),
                Settlement::Retry {
                    delay: Some(_),
                    shutdown: false,
                },
            ) => {
                assert_eq!(runs, 0);
                Ending::UnknownName
            }
            (Some((_, Ending::Ran)), Settlement::Ack) => {
                assert_eq!(runs, 1, "a valid message runs once");
                Ending::Ran
            }
            (expected, settlement) => panic!(
                "body {:?} expected {:?}, settled with {settlement:?}",
                String::from_utf8_lossy(body),
                expected.map(|(_, ending)| ending)
            ),
        }
    }
}
