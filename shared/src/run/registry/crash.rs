//! Deliveries the handler did not settle itself: deferred before running
//! ([`Registry::defer`]), whose execution brought the host down
//! ([`Registry::crashed`]), or whose processing panicked outside the handler
//! (`Registry::recover`).

use std::sync::Arc;
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
    /// [`Registry::defer`].
    pub(super) fn decide_deferred(&self, delivery: Incoming<'_>, reason: &str) -> Processed {
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

    /// [`Registry::crashed`].
    pub(super) fn decide_crashed(&self, delivery: Incoming<'_>, panic_message: &str) -> Processed {
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
            names: None,
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
        event.job = Arc::from(known.job.unwrap_or_default());
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
