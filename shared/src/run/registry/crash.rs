//! Deliveries the handler did not settle itself: deferred before running
//! ([`Registry::defer`]), whose execution brought the host down
//! ([`Registry::crashed`]), or whose processing panicked outside the handler
//! (`Registry::recover`).

use std::time::Duration;

use crate::model::envelope::Envelope;
use crate::model::error::JobError;
use crate::model::error::Panicked;
use crate::model::policy::PANICKED_BACKOFF_DELAY;
use crate::observe::event::EventKind;
use crate::observe::stats::Count;
use crate::rules::settle::{settle, Settlement};

use super::decide::RunSummary;
use super::message::Known;
use super::{Incoming, Processed, Registry};

impl Registry {
    /// A delivery the consumer will not run now (the edge's invocation budget
    /// ran low before it started): a zero-delay retry without execution,
    /// reported like the shutdown rule. The backend still counts the delivery.
    pub fn defer(&self, delivery: Incoming<'_>, reason: &str) -> Processed {
        let envelope = Envelope::decode(delivery.body).ok();
        let kind = EventKind::Retried {
            delay: Some(Duration::ZERO),
            error: reason.to_string(),
            shutdown: true,
        };
        Processed {
            event: self.event(delivery, envelope.as_ref(), 0, kind),
            settlement: Settlement::Retry {
                delay: Some(Duration::ZERO),
                shutdown: true,
            },
        }
    }

    /// The settlement of a delivery whose execution brought its host down (a
    /// handler panic on a target where panics abort, such as wasm32): decided
    /// as if that one execution had returned the panic as its error, so the
    /// job's retry policy and cap apply as they do where panics unwind. The
    /// host calls it once it is running again, before anything else runs the
    /// delivery. A body that is not a known job's envelope is settled as
    /// [`Registry::process`] settles it (the same decision: a malformed
    /// envelope's failure record, the unknown-name retry and, at its cap, its
    /// record), without running anything. A known job's payload is not
    /// decoded again: its decoder may be what brought the host down.
    pub fn crashed(&self, delivery: Incoming<'_>, panic_message: &str) -> Processed {
        let (envelope, job) = match self.route(delivery) {
            Ok(routed) => routed,
            Err(unrunnable) => return *unrunnable,
        };
        let spec = job.spec();
        let result: Result<(), JobError> = Err(JobError::from(Panicked::new(
            panic_message.to_string(),
            String::new(),
        )));
        // The execution counts on the job's attached breaker as a caught
        // panic does.
        crate::run::executor::feed_breaker(spec, &result);
        let decision = settle(&spec.retry, delivery.attempt, &result, false);
        job.counters().add(Count::Executions, 1);
        self.meter(&envelope.job, delivery.queue)
            .crashed_execution();
        let summary = RunSummary {
            executions: 1,
            resolution: None,
            error: result.as_ref().err().map(JobError::chain_text),
            shutdown: false,
            message_id: None,
        };
        self.finish(delivery, &envelope, decision, summary)
    }

    /// The settlement of a delivery whose processing panicked outside the
    /// handler (a defect of the facade): a retry after
    /// [`PANICKED_BACKOFF_DELAY`], never at once.
    pub(crate) fn recover(&self, delivery: Incoming<'_>, panicked: &Panicked) -> Processed {
        let known = Known::from_body(delivery.body);
        let delay = Some(PANICKED_BACKOFF_DELAY);
        let mut event = self.event(
            delivery,
            None::<&Envelope>,
            0,
            EventKind::Retried {
                delay,
                error: panicked.to_string(),
                shutdown: false,
            },
        );
        event.job = known.job.unwrap_or_default();
        event.message_id = known.message_id.unwrap_or_default();
        Processed {
            event,
            settlement: Settlement::Retry {
                delay,
                shutdown: false,
            },
        }
    }
}
