//! The backend's answer reported ([`Registry::settled`]): counted, metered
//! and emitted only when accepted; the metric keys of a delivery ([`Meter`]).

use std::sync::Arc;

use crate::model::backend::SettlementError;
use crate::observe::event::EventKind;
use crate::observe::metrics::JobMeter;
use crate::observe::stats::{Count, Resolution};

use super::erased::ErasedJob;
use super::{Processed, Registry};

impl Registry {
    /// [`Registry::settled`].
    pub(super) fn report_answer(
        &self,
        processed: &Processed,
        outcome: Result<(), &SettlementError>,
    ) {
        let meter = self.meter(&processed.event.job, &processed.event.queue);
        self.report(processed, outcome, &meter);
    }

    /// The metrics of a delivery of `job` from `queue`: the registered
    /// job's keys when it is registered for that queue, else keys made for
    /// the delivery (under [`UNREGISTERED_JOBS`] for a name no handler is
    /// registered for).
    pub(crate) fn meter(&self, job: &str, queue: &str) -> Meter<'_> {
        if let Some(registered) = self.jobs.get(job) {
            if registered.meter().is_for(queue) {
                return Meter::Registered(registered.as_ref());
            }
        }
        let job = self.counted_as(job);
        let mut others = self.other_meters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(meter) = others.get(queue).and_then(|by_job| by_job.get(job)) {
            return Meter::Shared(meter.clone());
        }
        let meter = Arc::new(JobMeter::new(job, queue));
        others
            .entry(queue.to_string())
            .or_default()
            .insert(job.to_string(), meter.clone());
        Meter::Shared(meter)
    }

    /// [`Registry::settled`], with the delivery's metrics looked up once.
    pub(crate) fn report(
        &self,
        processed: &Processed,
        outcome: Result<(), &SettlementError>,
        meter: &Meter<'_>,
    ) {
        let event = &processed.event;
        let counters = match meter {
            Meter::Registered(job) => job.counters(),
            Meter::Shared(_) => match self.jobs.get(&*event.job) {
                Some(job) => job.counters(),
                None => &self.unregistered,
            },
        };
        meter.settled(&event.kind, &processed.settlement, outcome);
        match outcome {
            Ok(()) => {
                let count = match &event.kind {
                    EventKind::Succeeded { resolution } => match resolution {
                        Resolution::FirstAttempt => Count::FirstAttempt,
                        Resolution::TierOne { .. } => Count::TierOne,
                        Resolution::TierTwo { .. } => Count::TierTwo,
                    },
                    EventKind::Retried { .. } => Count::Retried,
                    EventKind::Rejected { .. } => Count::Rejected,
                    EventKind::Failed { .. } => Count::Failed,
                };
                counters.add(count, 1);
                if let Some(sink) = &self.sink {
                    sink.emit(event);
                }
            }
            Err(error) => {
                counters.add(Count::SettlementErrors, 1);
                if let Some(sink) = &self.sink {
                    sink.settlement_failed(event, error);
                }
            }
        }
    }
}

/// The metric keys of one delivery: its registered job's, or shared ones
/// made at the first delivery of another job and queue.
pub(crate) enum Meter<'a> {
    /// The registered job's own (its counters come with it).
    Registered(&'a dyn ErasedJob),
    Shared(Arc<JobMeter>),
}

impl std::ops::Deref for Meter<'_> {
    type Target = JobMeter;

    fn deref(&self) -> &JobMeter {
        match self {
            Meter::Registered(job) => job.meter(),
            Meter::Shared(meter) => meter,
        }
    }
}
