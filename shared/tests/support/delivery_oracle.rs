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
        let job = Job::<Order>::builder(JOB).retry(3).build().unwrap();
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
