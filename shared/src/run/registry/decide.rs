//! The decision for one delivery: decode the envelope, find the handler,
//! decode and validate the payload, run the two tiers and settle
//! ([`Registry::process`]), with the early failures and the event.

use std::sync::Arc;

use crate::model::cancel::CancelToken;
use crate::model::envelope::{Envelope, EnvelopeError, EnvelopeView};
use crate::model::error::JobError;
use crate::model::failure::{Failure, FailureKind};
use crate::model::panic::guard;
use crate::model::record::FailureRecord;
use crate::model::runtime::Runtime;
use crate::observe::event::{Event, EventKind};
use crate::observe::stats::{Count, Resolution, UNREGISTERED_JOBS};
use crate::rules::settle::{
    exceeds_crash_bound, is_shutdown, settle, settle_unknown_name, Decision, Settlement,
    SHUTDOWN_GRACE,
};
use crate::run::context::ContextParts;
use crate::run::executor::run_tiers;

use super::erased::{AnyPayload, ErasedJob};
use super::message::{Known, Message};
use super::report::Meter;
use super::{Incoming, Processed, Registry};

/// What running the handler produced, for the event.
#[derive(Default)]
pub(super) struct RunSummary {
    pub(super) executions: u32,
    pub(super) resolution: Option<Resolution>,
    pub(super) error: Option<String>,
    pub(super) shutdown: bool,
    /// An owned copy of the message id, for the event to take.
    pub(super) message_id: Option<String>,
    /// The job's and queue's names, shared, for the event.
    pub(super) names: Option<(Arc<str>, Arc<str>)>,
}

impl Registry {
    /// [`Registry::process`].
    pub(super) async fn decide(
        &self,
        delivery: Incoming<'_>,
        runtime: &Arc<dyn Runtime>,
        cancel: &CancelToken,
    ) -> Processed {
        // Envelopes as this crate writes them are read in one pass, their
        // payload decoded into the job's type as it is read; anything that
        // read cannot decide alone takes the two passes (a decoder or hook
        // that panics there panics again in the second, which handles it).
        let read = match guard(|| self.read_in_one_pass(delivery.body)) {
            Ok(Some(read)) => read,
            _ => match self.read_in_two_passes(delivery) {
                Ok(read) => read,
                Err(unrunnable) => return *unrunnable,
            },
        };
        let (mut envelope, job, prepared) = read;
        let spec = job.spec();
        let payload = envelope.payload;
        if exceeds_crash_bound(
            spec.retry.max_deliveries,
            delivery.attempt,
            delivery.shutdown_returns,
        ) {
            // Earlier deliveries ended without a settlement (a worker that
            // crashed or was killed mid-job): the cap is spent, so fail
            // without running the handler again.
            let failure = Failure {
                kind: FailureKind::AttemptsExhausted,
                message: format!(
                    "delivery {} exceeds the cap of {} ({}): earlier deliveries ended without a settlement that retries (a worker that crashed, or a rejection the backend returned)",
                    delivery.attempt,
                    spec.retry.max_deliveries,
                    match delivery.shutdown_returns {
                        Some(n) => format!("{n} of them handed back by a graceful shutdown"),
                        None => format!("with {SHUTDOWN_GRACE} delivery of grace: this backend cannot count graceful-shutdown returns"),
                    }
                ),
            };
            return self.finish(
                delivery,
                &envelope,
                Decision::Fail(failure),
                RunSummary::default(),
            );
        }
        let (name, queue) = job.names();
        let parts = Arc::new(ContextParts {
            job: name.clone(),
            queue: if &**queue == delivery.queue {
                queue.clone()
            } else {
                Arc::from(delivery.queue)
            },
            message_id: envelope.id.to_string(),
            attempt: delivery.attempt,
            in_process_limit: spec.tier_one.attempts,
            cancel: cancel.clone(),
            runtime: runtime.clone(),
            // Lent to the context, and given back below.
            metadata: std::mem::take(&mut envelope.metadata),
            state: self.state.clone(),
        });
        // The job's own metric keys when it comes from its own queue (no
        // lookup: the job is in hand).
        let meter = if job.meter().is_for(delivery.queue) {
            Meter::Registered(job)
        } else {
            self.meter(&envelope.job, delivery.queue)
        };
        let mut prepared = Some(prepared);
        let run = run_tiers(
            spec,
            |ctx| job.run(ctx, prepared.take(), payload),
            &parts,
            &meter,
            delivery.deadline,
        )
        .await;
        job.counters()
            .add(Count::Executions, u64::from(run.executions));
        // The event takes the context's copy of the id, and the envelope
        // its metadata back, when no handler kept a context (the usual
        // case); else they are copied.
        let (message_id, names) = match Arc::try_unwrap(parts) {
            Ok(parts) => {
                envelope.metadata = parts.metadata;
                (Some(parts.message_id), (parts.job, parts.queue))
            }
            Err(parts) => {
                envelope.metadata.clone_from(&parts.metadata);
                (None, (parts.job.clone(), parts.queue.clone()))
            }
        };
        let settlement = settle(
            &spec.retry,
            delivery.attempt,
            &run.result,
            cancel.is_cancelled(),
        );
        let resolution = Resolution::classify(
            delivery.attempt,
            spec.retry.max_deliveries,
            run.in_process,
            spec.tier_one.attempts,
        );
        let summary = RunSummary {
            executions: run.executions,
            resolution: Some(resolution),
            error: run.result.as_ref().err().map(JobError::chain_text),
            shutdown: is_shutdown(&run.result, cancel.is_cancelled()),
            message_id,
            names: Some(names),
        };
        self.finish(delivery, &envelope, settlement, summary)
    }

    /// [`EnvelopeView::decode_typed`] with this registry's jobs: the
    /// envelope, its job and its payload decoded and validated, or `None`
    /// where the two passes must decide.
    #[allow(clippy::type_complexity)]
    fn read_in_one_pass<'b>(
        &self,
        body: &'b [u8],
    ) -> Option<(EnvelopeView<'b>, &dyn ErasedJob, AnyPayload)> {
        EnvelopeView::decode_typed(
            body,
            |name| self.jobs.get(name).map(|job| job.as_ref()),
            |job: &&dyn ErasedJob, rest| job.prepare_at(rest),
        )
    }

    /// The envelope read with its payload left raw, the job found, then
    /// the payload decoded and validated: what the one-pass read does, in
    /// two passes, deciding every body it could not. A body no handler can
    /// run, a payload that does not decode or validate, and a validation
    /// hook that panics are decided here.
    #[allow(clippy::type_complexity)]
    fn read_in_two_passes<'b>(
        &self,
        delivery: Incoming<'b>,
    ) -> Result<(EnvelopeView<'b>, &dyn ErasedJob, AnyPayload), Box<Processed>> {
        let (envelope, job) = self.route(delivery)?;
        match guard(|| job.prepare(envelope.payload)) {
            Ok(Ok(prepared)) => Ok((envelope, job, prepared)),
            Ok(Err(failure)) => {
                let envelope = envelope.to_envelope();
                let known = Known::from_envelope(&envelope);
                Err(Box::new(self.fail_early(
                    delivery,
                    known,
                    Some(&envelope),
                    failure,
                )))
            }
            // A validation hook that panics is an ordinary error: retried by
            // the job's policy, with no execution.
            Err(panicked) => {
                let result = Err(JobError::from(panicked));
                let decision = settle(&job.spec().retry, delivery.attempt, &result, false);
                let summary = RunSummary {
                    error: result.as_ref().err().map(JobError::chain_text),
                    ..RunSummary::default()
                };
                Err(Box::new(
                    self.finish(delivery, &envelope, decision, summary),
                ))
            }
        }
    }

    /// The one decision for a body no handler can run, shared by
    /// [`Registry::process`] and [`Registry::crashed`]: a body that is not
    /// an envelope fails at once with its record; an envelope of a job no
    /// handler is registered for follows the unknown-name rule (a retry,
    /// then its record at the cap). Otherwise the envelope (its payload
    /// still raw: nothing of the job's own code has run) and its job.
    #[allow(clippy::type_complexity)]
    pub(super) fn route<'b>(
        &self,
        delivery: Incoming<'b>,
    ) -> Result<(EnvelopeView<'b>, &dyn ErasedJob), Box<Processed>> {
        let envelope = match EnvelopeView::decode(delivery.body) {
            Ok(envelope) => envelope,
            Err(e) => return Err(Box::new(self.malformed(delivery, e))),
        };
        match self.jobs.get(&*envelope.job) {
            Some(job) => Ok((envelope, job.as_ref())),
            None => {
                let settlement = settle_unknown_name(
                    &envelope.job,
                    delivery.attempt,
                    self.unknown_name_attempts,
                    self.unknown_name_delay,
                );
                Err(Box::new(self.finish(
                    delivery,
                    &envelope,
                    settlement,
                    RunSummary::default(),
                )))
            }
        }
    }

    /// A body that is not an envelope (or one of a newer format): a terminal
    /// failure at once, keeping whatever identity the body shows.
    pub(super) fn malformed(&self, delivery: Incoming<'_>, error: EnvelopeError) -> Processed {
        let failure = Failure {
            kind: FailureKind::MalformedEnvelope,
            message: error.to_string(),
        };
        let known = Known::from_body(delivery.body);
        self.fail_early(delivery, known, None, failure)
    }

    pub(super) fn fail_early(
        &self,
        delivery: Incoming<'_>,
        known: Known,
        envelope: Option<&Envelope>,
        failure: Failure,
    ) -> Processed {
        let mut record = FailureRecord::build(
            delivery.queue,
            &failure,
            delivery.attempt,
            0,
            envelope,
            delivery.body,
        );
        record.job.clone_from(&known.job);
        record.message_id.clone_from(&known.message_id);
        let mut event = self.event(
            delivery,
            envelope,
            0,
            EventKind::Failed {
                failure: failure.clone(),
            },
        );
        event.job = Arc::from(known.job.unwrap_or_default());
        event.message_id = known.message_id.unwrap_or_default();
        Processed {
            event,
            settlement: Settlement::Fail(Box::new(record)),
        }
    }

    pub(super) fn finish(
        &self,
        delivery: Incoming<'_>,
        envelope: &impl Message,
        decision: Decision,
        run: RunSummary,
    ) -> Processed {
        let RunSummary {
            executions,
            resolution,
            error,
            shutdown,
            message_id,
            names,
        } = run;
        // Made only for the outcomes that carry it.
        let error =
            move || error.unwrap_or_else(|| format!("unknown job name `{}`", envelope.job()));
        let (kind, settlement) = match decision {
            Decision::Ack => (
                EventKind::Succeeded {
                    resolution: resolution.unwrap_or(Resolution::FirstAttempt),
                },
                Settlement::Ack,
            ),
            Decision::Retry { delay, .. } => (
                EventKind::Retried {
                    delay,
                    error: error(),
                    shutdown,
                },
                Settlement::Retry { delay, shutdown },
            ),
            Decision::Reject => (EventKind::Rejected { error: error() }, Settlement::Reject),
            Decision::Fail(failure) => {
                let record = FailureRecord::build(
                    delivery.queue,
                    &failure,
                    delivery.attempt,
                    executions,
                    Some(&envelope.owned()),
                    delivery.body,
                );
                (
                    EventKind::Failed { failure },
                    Settlement::Fail(Box::new(record)),
                )
            }
        };
        let (job, queue) =
            names.unwrap_or_else(|| (Arc::from(envelope.job()), Arc::from(delivery.queue)));
        let event = Event {
            job,
            message_id: message_id.unwrap_or_else(|| envelope.id().to_string()),
            queue,
            attempt: delivery.attempt,
            executions,
            kind,
            payload: self.include_payload.then(|| envelope.payload_value()),
        };
        Processed { event, settlement }
    }

    pub(super) fn event(
        &self,
        delivery: Incoming<'_>,
        envelope: Option<&impl Message>,
        executions: u32,
        kind: EventKind,
    ) -> Event {
        Event {
            job: envelope.map_or_else(|| Arc::from(""), |e| Arc::from(e.job())),
            message_id: envelope.map(|e| e.id().to_string()).unwrap_or_default(),
            queue: Arc::from(delivery.queue),
            attempt: delivery.attempt,
            executions,
            kind,
            payload: envelope
                .filter(|_| self.include_payload)
                .map(|e| e.payload_value()),
        }
    }

    /// The counters' entry for `job`: its own if registered, else the one
    /// shared entry [`UNREGISTERED_JOBS`] (names from message bodies must
    /// not grow the counters without bound).
    pub(super) fn counted_as<'a>(&self, job: &'a str) -> &'a str {
        if self.jobs.contains_key(job) {
            job
        } else {
            UNREGISTERED_JOBS
        }
    }
}
