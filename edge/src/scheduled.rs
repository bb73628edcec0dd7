//! The Worker's `scheduled` handler (wasm32): a Cron Trigger fires the
//! declared schedules ([`EdgeScheduler`]), ticks claimed in D1
//! ([`D1Claims`]), jobs sent through the producer binding of each job's
//! queue. Exported by [`crate::consumer!`] with `schedules = FN`.

use std::time::Duration;

use jobrail::{TickDispatch, UNIX_EPOCH};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use worker::Env;

use crate::batch::log_error;
use crate::error::{EdgeError, EdgeErrorKind};
use crate::limits::envelope_text;
use crate::runtime::WorkersRuntime;
use crate::wrangler::Wrangler;
use crate::{D1Claims, EdgeScheduler, Options, ScheduleFired};

impl EdgeScheduler {
    /// Fires the schedules the Cron Trigger `event` fires, as
    /// [`fire`](EdgeScheduler::fire) does: ticks claimed in `claims`, each
    /// tick's job sent through `binding_of(queue)`, the producer binding
    /// of its queue, on the Workers timer. What a `#[event(scheduled)]`
    /// handler of one's own calls (the [`consumer!`](crate::consumer!)
    /// macro's `schedules = FN` writes that handler for you).
    pub async fn fire_event(
        &self,
        event: &worker::ScheduledEvent,
        env: &Env,
        claims: &D1Claims,
        binding_of: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<ScheduleFired> {
        let scheduled = UNIX_EPOCH + Duration::from_millis(event.schedule().max(0.0) as u64);
        let send = |dispatch: TickDispatch| async move {
            let binding = binding_of(&dispatch.queue).ok_or_else(|| {
                EdgeError::new(
                    EdgeErrorKind::Config,
                    format!(
                        "no producer binding to `{}`, the queue of schedule `{}`",
                        dispatch.queue, dispatch.schedule
                    ),
                )
            })?;
            let queue = env.queue(&binding).map_err(|e| {
                EdgeError::new(
                    EdgeErrorKind::Config,
                    format!("queue binding `{binding}`: {e}"),
                )
            })?;
            let envelope = dispatch.envelope();
            let text = envelope_text(&envelope)?;
            queue
                .send(
                    worker::MessageBuilder::new(text)
                        .content_type(worker::QueueContentType::Text)
                        .build(),
                )
                .await
                .map_err(|e| EdgeError::uncertain(&format!("queue `{binding}`"), e))?;
            Ok(envelope.id)
        };
        self.fire(&event.cron(), scheduled, claims, &WorkersRuntime, send)
            .await
    }
}

/// The `scheduled` entry point of a worker declared with `schedules = FN`:
/// never fails (every problem is logged).
#[doc(hidden)]
pub fn entry(event: JsValue, env: JsValue, options: &'static Options) -> js_sys::Promise {
    worker::wasm_bindgen_futures::future_to_promise(async move {
        let env: Env = env.unchecked_into();
        let event = worker::ScheduledEvent::from(
            event.unchecked_into::<worker::worker_sys::ScheduledEvent>(),
        );
        if let Err(e) = run(&event, &env, options).await {
            log_error(&format!(
                "jobrail-edge: the Cron Trigger `{}` fired nothing: {e}",
                event.cron()
            ));
        }
        Ok(JsValue::UNDEFINED)
    })
}

async fn run(event: &worker::ScheduledEvent, env: &Env, options: &Options) -> Result<(), String> {
    let schedules = options
        .schedules
        .ok_or("the worker declares no schedules")?;
    let schedules = schedules().map_err(|e| format!("the schedules do not build: {e}"))?;
    let sections =
        Wrangler::parse_all(options.wrangler).map_err(|e| format!("wrangler.toml: {e}"))?;
    let mut crons: Vec<String> = Vec::new();
    for section in &sections {
        for cron in section.crons() {
            if !crons.contains(cron) {
                crons.push(cron.clone());
            }
        }
    }
    let scheduler = EdgeScheduler::new(schedules, &crons)?;
    let claims = D1Claims::from_env(env, options.schedule_claims).map_err(|e| e.to_string())?;
    // The producer binding of a queue, among the sections' (checked by
    // the wrangler.toml check), that this Worker has.
    let binding_of = |queue: &str| {
        sections
            .iter()
            .filter_map(|s| s.binding_to(queue))
            .find(|b| env.queue(b).is_ok())
            .map(str::to_string)
    };
    scheduler.fire_event(event, env, &claims, &binding_of).await;
    Ok(())
}
