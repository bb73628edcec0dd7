//! The Worker side of the batch loop: the platform's message and binding
//! objects, the panic hook, and the entry points the [`crate::consumer!`]
//! macro exports.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Once};
use std::time::Duration;

use jobrail::{BoxFuture, Instant, PolicyError, Registry};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use worker::Env;

use crate::batch::{Bindings, EdgeConsumer, Progress, QueueMessage};
use crate::error::{EdgeError, EdgeErrorKind};
use crate::js::{body_bytes, describe, retry_options, JsMessage};
use crate::runtime::WorkersRuntime;
use crate::settings::EdgeConfig;

#[wasm_bindgen(module = "/js/invocation.js")]
extern "C" {
    /// The JavaScript record of one invocation (survives an abort).
    #[derive(Clone)]
    pub type Invocation;

    #[wasm_bindgen(constructor)]
    fn new(batch: &JsValue, env: &JsValue) -> Invocation;

    #[wasm_bindgen(method, getter)]
    fn batch(this: &Invocation) -> JsValue;

    #[wasm_bindgen(method, getter)]
    fn env(this: &Invocation) -> JsValue;

    #[wasm_bindgen(method, getter, js_name = crashedId)]
    fn crashed_id(this: &Invocation) -> Option<String>;

    #[wasm_bindgen(method, getter, js_name = crashMessage)]
    fn crash_message(this: &Invocation) -> Option<String>;

    #[wasm_bindgen(method, js_name = elapsedMs)]
    fn elapsed_ms(this: &Invocation) -> f64;

    #[wasm_bindgen(method, js_name = setActive)]
    fn set_active(this: &Invocation, id: &str, active: bool);

    #[wasm_bindgen(method)]
    fn settled(this: &Invocation, id: &str);

    #[wasm_bindgen(method, js_name = isSettled)]
    fn is_settled(this: &Invocation, id: &str) -> bool;

    /// Reports a panic to every invocation in flight.
    #[wasm_bindgen(js_name = reportPanic)]
    fn report_panic(message: &str);

    fn drive(
        invocation: &Invocation,
        first: js_sys::Promise,
        resume: &JsValue,
        reset: &JsValue,
    ) -> js_sys::Promise;
}

// The module's own exports, as the bundler sees them: the resume entry point
// the `consumer!` macro exports, and wasm-bindgen's instance reset.
#[wasm_bindgen(raw_module = "./index.js")]
extern "C" {
    #[wasm_bindgen(thread_local_v2, js_name = __queue_edge_resume)]
    static RESUME: JsValue;
    #[wasm_bindgen(thread_local_v2, js_name = __wbg_reset_state)]
    static RESET: JsValue;
}

static HOOK: Once = Once::new();

fn install_panic_hook() {
    HOOK.call_once(|| {
        // Chained after the hook of the `worker` crate (installed at start),
        // which marks the instance for reset.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = match info.payload().downcast_ref::<&str>() {
                Some(s) => (*s).to_string(),
                None => info
                    .payload()
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| info.to_string()),
            };
            let location = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let text = format!("{message}{location}");
            report_panic(&text);
            previous(info);
        }));
    });
}

impl Progress for Invocation {
    fn current(&self, id: &str, active: bool) {
        self.set_active(id, active);
    }

    fn settled(&self, id: &str) {
        Invocation::settled(self, id);
    }
}

impl QueueMessage for JsMessage {
    fn id(&self) -> String {
        JsMessage::id(self)
    }

    fn attempts(&self) -> u32 {
        JsMessage::attempts(self) as u32
    }

    fn body(&self) -> Vec<u8> {
        body_bytes(&JsMessage::body(self))
    }

    fn ack(&self) -> Result<(), EdgeError> {
        JsMessage::ack(self).map_err(|e| EdgeError::uncertain("ack", describe(&e)))
    }

    fn retry(&self, delay_seconds: Option<u32>) -> Result<(), EdgeError> {
        JsMessage::retry(self, &retry_options(delay_seconds))
            .map_err(|e| EdgeError::uncertain("retry", describe(&e)))
    }
}

/// The Worker's `env`, for failure-queue sends and delay steps.
struct EnvBindings<'e>(&'e Env);

impl EnvBindings<'_> {
    async fn send(&self, binding: &str, text: String, delay: Option<u32>) -> Result<(), EdgeError> {
        let queue = self.0.queue(binding).map_err(|e| {
            EdgeError::new(
                EdgeErrorKind::Config,
                format!("queue binding `{binding}`: {e}"),
            )
        })?;
        let mut message =
            worker::MessageBuilder::new(text).content_type(worker::QueueContentType::Text);
        if let Some(seconds) = delay {
            message = message.delay_seconds(seconds);
        }
        queue
            .send(message.build())
            .await
            .map_err(|e| EdgeError::uncertain(&format!("queue `{binding}`"), e))
    }
}

impl Bindings for EnvBindings<'_> {
    fn send_text<'a>(
        &'a self,
        binding: &'a str,
        text: String,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        Box::pin(self.send(binding, text, None))
    }

    fn send_text_delayed<'a>(
        &'a self,
        binding: &'a str,
        text: String,
        delay_seconds: u32,
    ) -> BoxFuture<'a, Result<(), EdgeError>> {
        Box::pin(self.send(binding, text, Some(delay_seconds)))
    }
}

impl EdgeConsumer {
    /// A consumer of `registry`'s jobs on the Workers timer; refuses an
    /// inconsistent configuration.
    pub fn new(registry: Registry, config: EdgeConfig) -> Result<Self, PolicyError> {
        install_panic_hook();
        Self::with_runtime(registry, config, Arc::new(WorkersRuntime))
    }
}

/// The messages of `batch` that `invocation` has not settled yet.
fn messages(batch: &JsValue, invocation: &Invocation) -> Vec<JsMessage> {
    let list = js_sys::Reflect::get(batch, &"messages".into()).unwrap_or(JsValue::UNDEFINED);
    js_sys::Array::from(&list)
        .iter()
        .map(|m| m.unchecked_into::<JsMessage>())
        .filter(|m| !invocation.is_settled(&JsMessage::id(m)))
        .collect()
}

type LocalFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

/// A worker declared with [`crate::consumer!`].
#[doc(hidden)]
pub struct WorkerSpec {
    /// The jobs and their handlers.
    pub jobs: fn() -> Result<Registry, String>,
    /// The options, wrangler.toml included.
    pub options: crate::Options,
    /// Handles batches of queues no job names.
    pub other_queues: Option<fn(JsValue, Env) -> LocalFuture>,
    /// Runs after each batch (before the invocation returns).
    pub after_batch: Option<fn(Env) -> LocalFuture>,
}

/// Whether `queue` is consumed with the jobs (a queue a job names, or one
/// listed in `Options::queue_concurrency`), rather than by `other_queues`.
/// The jobs' queues are read once per instance.
fn consumed_with_jobs(queue: &str, spec: &WorkerSpec) -> bool {
    thread_local! {
        static JOB_QUEUES: RefCell<Option<Option<Vec<String>>>> = const { RefCell::new(None) };
    }
    if spec
        .options
        .queue_concurrency
        .iter()
        .any(|(q, _)| *q == queue)
        // A queue no section of the embedded wrangler.toml consumes comes
        // from a configuration the check never saw: the jobs' consumer
        // refuses it (and hands it back), the other queues' hook never
        // sees it.
        || !crate::options::declares_consumer(spec.options.wrangler, queue)
    {
        return true;
    }
    JOB_QUEUES.with(|cache| {
        let mut cache = cache.borrow_mut();
        let queues = cache.get_or_insert_with(|| (spec.jobs)().ok().map(|r| r.queues()));
        // A registry that does not build is reported by the consumer itself.
        queues
            .as_ref()
            .is_none_or(|queues| queues.iter().any(|q| q == queue))
    })
}

thread_local! {
    static CONSUMERS: RefCell<std::collections::HashMap<String, Rc<EdgeConsumer>>> =
        RefCell::new(std::collections::HashMap::new());
}

fn consumer_for(queue: &str, env: &Env, spec: &WorkerSpec) -> Result<Rc<EdgeConsumer>, String> {
    if let Some(existing) = CONSUMERS.with(|c| c.borrow().get(queue).cloned()) {
        return Ok(existing);
    }
    install_panic_hook();
    let registry = (spec.jobs)()?;
    // Once per isolate and queue, when its consumer is built: a job whose
    // delivery cap was never chosen.
    for warning in registry.warnings() {
        worker::console_warn!("jobrail: queue {queue}: {warning}");
    }
    let var = |name: &str| env.var(name).ok().map(|v| v.to_string());
    let bound = |binding: &str| env.queue(binding).is_ok();
    let consumer = Rc::new(crate::options::build_consumer(
        queue,
        registry,
        &spec.options,
        &var,
        &bound,
        Arc::new(WorkersRuntime),
    )?);
    CONSUMERS.with(|c| c.borrow_mut().insert(queue.to_string(), consumer.clone()));
    Ok(consumer)
}

/// The `queue` entry point: runs `batch`, resuming after a panic in one
/// message's code. Exported by the [`crate::consumer!`] macro.
#[doc(hidden)]
pub fn entry(batch: JsValue, env: JsValue, spec: &'static WorkerSpec) -> js_sys::Promise {
    install_panic_hook();
    let invocation = Invocation::new(&batch, &env);
    let first = run(invocation.clone(), spec);
    RESUME.with(|resume| RESET.with(|reset| drive(&invocation, first, resume, reset)))
}

/// The resume entry point, called by the invocation driver in a fresh
/// instance after a crash.
#[doc(hidden)]
pub fn resume(invocation: JsValue, spec: &'static WorkerSpec) -> js_sys::Promise {
    install_panic_hook();
    run(invocation.unchecked_into(), spec)
}

fn run(invocation: Invocation, spec: &'static WorkerSpec) -> js_sys::Promise {
    worker::wasm_bindgen_futures::future_to_promise(async move {
        let env: Env = invocation.env().unchecked_into();
        let batch = invocation.batch();
        let queue = js_sys::Reflect::get(&batch, &"queue".into())
            .ok()
            .and_then(|q| q.as_string())
            .unwrap_or_default();
        if let Some(other) = spec.other_queues {
            if !consumed_with_jobs(&queue, spec) {
                other(batch, env.clone()).await;
                if let Some(after) = spec.after_batch {
                    after(env).await;
                }
                return Ok(JsValue::UNDEFINED);
            }
        }
        let started =
            Instant::now() - Duration::from_millis(invocation.elapsed_ms().max(0.0) as u64);
        let crashed_id = invocation.crashed_id();
        let crash_message = invocation.crash_message().unwrap_or_default();
        let crashed = crashed_id.as_deref().map(|id| (id, crash_message.as_str()));
        match consumer_for(&queue, &env, spec) {
            Ok(consumer) => {
                consumer
                    .consume_observed(
                        &queue,
                        messages(&batch, &invocation),
                        &EnvBindings(&env),
                        started,
                        crashed,
                        &invocation,
                    )
                    .await;
            }
            Err(e) => {
                crate::batch::hand_back_misconfigured(&queue, &messages(&batch, &invocation), &e);
            }
        }
        if let Some(after) = spec.after_batch {
            after(env).await;
        }
        Ok(JsValue::UNDEFINED)
    })
}
