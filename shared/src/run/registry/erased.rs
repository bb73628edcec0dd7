//! A job whose payload type is erased ([`ErasedJob`]), so handlers of
//! different types live in one registry: the typed job behind it decodes,
//! validates and runs.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use serde::de::DeserializeOwned;

use crate::model::error::JobError;
use crate::model::failure::{Failure, FailureKind};
use crate::model::job::{Job, JobSpec};
use crate::model::maybe_send::{BoxFuture, MaybeSend, MaybeSync};
use crate::observe::metrics::JobMeter;
use crate::observe::stats::Counters;
use crate::run::context::JobContext;

pin_project_lite::pin_project! {
    /// A payload decoded for its job's handler (when the delivery is
    /// prepared), then, in the same allocation, the handler's first
    /// execution that took it: one box holds both, one after the other.
    #[project = FirstRunProj]
    enum FirstRun<P, Fut> {
        Payload { payload: Option<P> },
        Running { #[pin] future: Fut },
    }
}

impl<P, Fut: Future> Future for FirstRun<P, Fut> {
    type Output = Fut::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Fut::Output> {
        match self.project() {
            FirstRunProj::Running { future } => future.poll(cx),
            FirstRunProj::Payload { .. } => unreachable!("a first run is polled once started"),
        }
    }
}

/// A payload decoded for its job's handler, its type erased: decoded once,
/// when the delivery is prepared, and handed to the first execution (a
/// [`FirstRun`], whose box the execution's future reuses).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) type AnyPayload = Box<dyn Any + Send>;
/// A payload decoded for its job's handler, its type erased.
#[cfg(target_arch = "wasm32")]
pub(crate) type AnyPayload = Box<dyn Any>;

/// A job whose payload type has been erased, so handlers of different types
/// can live in one registry.
pub(crate) trait ErasedJob: MaybeSend + MaybeSync {
    fn spec(&self) -> &JobSpec;
    fn spec_mut(&mut self) -> &mut JobSpec;
    /// The keys of its metrics on its queue.
    fn meter(&self) -> &JobMeter;
    /// Its counters in the registry's [`Stats`].
    fn counters(&self) -> &Counters;
    /// Its name and queue, shared with the contexts of its deliveries.
    fn names(&self) -> (&Arc<str>, &Arc<str>);
    /// Decodes the raw JSON payload (once) and validates it, without
    /// running anything.
    fn prepare(&self, payload: &str) -> Result<AnyPayload, Failure>;
    /// Decodes the payload at the start of `rest` (the rest of an
    /// envelope's body) and validates it, as [`ErasedJob::prepare`] does
    /// its text, with the bytes the payload took: the one-pass read
    /// ([`EnvelopeView::decode_typed`](crate::model::envelope::EnvelopeView::decode_typed)).
    /// `None` if it does not decode or validate: the two-pass read then
    /// decides, with its errors.
    fn prepare_at(&self, rest: &[u8]) -> Option<(AnyPayload, usize)>;
    /// Starts one execution: with the payload `prepare` decoded (the first
    /// execution), or decoding `payload` again (a tier-one retry).
    fn run(
        &self,
        ctx: JobContext,
        prepared: Option<AnyPayload>,
        payload: &str,
    ) -> BoxFuture<'static, Result<(), JobError>>;
}

pub(super) struct TypedJob<P, H> {
    pub(super) spec: JobSpec,
    pub(super) meter: JobMeter,
    pub(super) counters: Arc<Counters>,
    pub(super) name: Arc<str>,
    pub(super) queue: Arc<str>,
    pub(super) job: Job<P>,
    pub(super) handler: H,
}

impl<P, H, Fut> ErasedJob for TypedJob<P, H>
where
    P: DeserializeOwned + MaybeSend + 'static,
    H: Fn(JobContext, P) -> Fut + MaybeSend + MaybeSync + 'static,
    Fut: Future<Output = Result<(), JobError>> + MaybeSend + 'static,
{
    fn spec(&self) -> &JobSpec {
        &self.spec
    }

    fn spec_mut(&mut self) -> &mut JobSpec {
        &mut self.spec
    }

    fn meter(&self) -> &JobMeter {
        &self.meter
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn names(&self) -> (&Arc<str>, &Arc<str>) {
        (&self.name, &self.queue)
    }

    fn prepare(&self, payload: &str) -> Result<AnyPayload, Failure> {
        let typed: P = serde_json::from_str(payload).map_err(|e| Failure {
            kind: FailureKind::UndecodablePayload,
            message: format!(
                "payload does not decode as job `{}`: {}",
                self.spec.name,
                crate::model::redact::json_error_unplaced(&e)
            ),
        })?;
        self.job.validate_payload(&typed).map_err(|e| Failure {
            kind: FailureKind::InvalidPayload,
            message: format!("payload failed validation: {e}"),
        })?;
        Ok(Box::new(FirstRun::<P, Fut>::Payload {
            payload: Some(typed),
        }))
    }

    fn prepare_at(&self, rest: &[u8]) -> Option<(AnyPayload, usize)> {
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<P>();
        let typed = values.next()?.ok()?;
        let used = values.byte_offset();
        self.job.validate_payload(&typed).ok()?;
        let first = FirstRun::<P, Fut>::Payload {
            payload: Some(typed),
        };
        Some((Box::new(first), used))
    }

    fn run(
        &self,
        ctx: JobContext,
        prepared: Option<AnyPayload>,
        payload: &str,
    ) -> BoxFuture<'static, Result<(), JobError>> {
        if let Some(mut first) = prepared.and_then(|p| p.downcast::<FirstRun<P, Fut>>().ok()) {
            if let FirstRun::Payload { payload } = &mut *first {
                if let Some(typed) = payload.take() {
                    // The payload's box becomes the execution's.
                    *first = FirstRun::Running {
                        future: (self.handler)(ctx, typed),
                    };
                    return Box::into_pin(first);
                }
            }
        }
        match serde_json::from_str::<P>(payload) {
            Ok(typed) => Box::pin((self.handler)(ctx, typed)),
            Err(e) => Box::pin(std::future::ready(Err(JobError::permanent(e)))),
        }
    }
}
