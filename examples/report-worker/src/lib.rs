//! The report job at the edge.
//!
//! The same job declaration and handler as the native quick start
//! (`report-job`), consumed from the `reports` queue by a Cloudflare Worker.
//! Terminal failures go to the `reports-failed` queue, which this worker also
//! consumes. For the end-to-end tests it keeps a log of every accepted
//! outcome and every failure record in KV and serves it at `GET /log`;
//! `POST /dispatch` enqueues reports through the producer binding.
//!
//! Settings come from `[vars]` in `wrangler.toml`: `EDGE_BUDGET_MS`,
//! `EDGE_RESERVE_MS`, `MAX_RETRIES` (the consumer's `max_retries`, checked
//! against the job's cap at start), `UNKNOWN_NAME_ATTEMPTS`,
//! `UNKNOWN_NAME_RETRY_DELAY_MS` and `PARALLEL_CONCURRENCY` (messages handled
//! at once from `reports-parallel`; `reports` is consumed in order).
#![cfg(target_arch = "wasm32")]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use queue::{Envelope, Event, EventSink, Registry, SettlementError, UnknownNameAttempts};
use queue_edge::{EdgeConfig, EdgeConsumer, EdgeProducer};
use report_job::BuildReport;
use serde::Deserialize;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use worker::{
    console_error, event, worker_sys, Context, Env, Request, Response, Result, RouteContext, Router,
};

/// The producer binding of the work queue.
const REPORTS: &str = "REPORTS";
/// The producer binding of the failure queue.
const FAILED: &str = "FAILED";
/// The KV namespace holding the test log.
const LOG: &str = "LOG";

/// The producer binding of the queue consumed with concurrency.
const REPORTS_PARALLEL: &str = "REPORTS_PARALLEL";

thread_local! {
    static CONSUMER: RefCell<Option<Rc<EdgeConsumer>>> = const { RefCell::new(None) };
    static PARALLEL: RefCell<Option<Rc<EdgeConsumer>>> = const { RefCell::new(None) };
    static PENDING: RefCell<Vec<serde_json::Value>> = const { RefCell::new(Vec::new()) };
}

/// Collects events for the log (flushed to KV after each batch).
struct LogSink;

impl EventSink for LogSink {
    fn emit(&self, event: &Event) {
        push(serde_json::json!({ "at_ms": js_sys::Date::now(), "event": event }));
    }

    fn settlement_failed(&self, event: &Event, error: &SettlementError) {
        push(serde_json::json!({
            "at_ms": js_sys::Date::now(),
            "settlement_failed": event,
            "kind": error.kind().to_string(),
            "error": error.to_string(),
        }));
    }
}

fn push(entry: serde_json::Value) {
    PENDING.with(|p| p.borrow_mut().push(entry));
}

async fn flush(env: &Env) {
    let entries = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let Ok(kv) = env.kv(LOG) else {
        console_error!(
            "no `{LOG}` KV binding: {} log entries dropped",
            entries.len()
        );
        return;
    };
    for entry in entries {
        let key = format!(
            "log:{:015}:{:08x}",
            js_sys::Date::now() as u64,
            (js_sys::Math::random() * f64::from(u32::MAX)) as u32
        );
        match kv.put(&key, entry.to_string()) {
            Ok(put) => {
                if let Err(e) = put.execute().await {
                    console_error!("log write failed: {e}");
                }
            }
            Err(e) => console_error!("log write failed: {e}"),
        }
    }
}

fn var_u64(env: &Env, name: &str) -> Option<u64> {
    env.var(name)
        .ok()
        .and_then(|v| v.to_string().trim().parse().ok())
}

/// The consumer for `reports` (in order) or `reports-parallel` (concurrent).
fn consumer(env: &Env, parallel: bool) -> std::result::Result<Rc<EdgeConsumer>, String> {
    let slot = if parallel { &PARALLEL } else { &CONSUMER };
    if let Some(existing) = slot.with(|c| c.borrow().clone()) {
        return Ok(existing);
    }
    let job = report_job::job().map_err(|e| e.to_string())?;
    let mut registry = Registry::new();
    registry
        .register(&job, report_job::handle)
        .map_err(|e| e.to_string())?;
    if let Some(n) = var_u64(env, "UNKNOWN_NAME_ATTEMPTS") {
        registry.unknown_name_attempts(UnknownNameAttempts::limited(n as u32));
    }
    if let Some(ms) = var_u64(env, "UNKNOWN_NAME_RETRY_DELAY_MS") {
        registry.unknown_name_retry_delay(Duration::from_millis(ms));
    }
    registry.event_sink(Arc::new(LogSink));
    let mut config = EdgeConfig {
        failure_queue: Some(FAILED.to_string()),
        ..EdgeConfig::default()
    };
    if let Some(ms) = var_u64(env, "EDGE_BUDGET_MS") {
        config.budget = Duration::from_millis(ms);
    }
    if let Some(ms) = var_u64(env, "EDGE_RESERVE_MS") {
        config.settlement_reserve = Duration::from_millis(ms);
    }
    config.platform_max_retries = var_u64(env, "MAX_RETRIES").map(|n| n as u32);
    if parallel {
        config.concurrency = var_u64(env, "PARALLEL_CONCURRENCY").unwrap_or(4) as usize;
    }
    let consumer = Rc::new(EdgeConsumer::new(registry, config).map_err(|e| e.to_string())?);
    slot.with(|c| *c.borrow_mut() = Some(consumer.clone()));
    Ok(consumer)
}

/// The queue entry point, exported directly so the consumer can read each
/// message's `attempts`. It never returns an error: every message is settled.
#[wasm_bindgen(wasm_bindgen_futures = ::worker::wasm_bindgen_futures)]
pub async fn queue(
    batch: worker_sys::MessageBatch,
    env: Env,
    _ctx: worker_sys::Context,
) -> std::result::Result<JsValue, JsValue> {
    let name: String = batch.queue().map(String::from).unwrap_or_default();
    if name.ends_with("-failed") {
        // The failure queue: keep each record in the log.
        for message in batch.messages().map(|a| a.to_vec()).unwrap_or_default() {
            let message: worker_sys::Message = message.unchecked_into();
            let body = message
                .body()
                .ok()
                .and_then(|b| b.as_string())
                .unwrap_or_default();
            let record: serde_json::Value =
                serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
            push(serde_json::json!({ "at_ms": js_sys::Date::now(), "failure_record": record }));
            let _ = message.ack();
        }
    } else {
        match consumer(&env, name.ends_with("-parallel")) {
            Ok(consumer) => {
                consumer.consume(&batch, &env).await;
            }
            Err(e) => {
                // A misconfigured worker must not drop work: leave every
                // message for redelivery and say why.
                console_error!("report worker misconfigured, retrying the batch: {e}");
                let _ = batch.retry_all(JsValue::UNDEFINED);
            }
        }
    }
    flush(&env).await;
    Ok(JsValue::UNDEFINED)
}

/// What `POST /dispatch` accepts.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Dispatch {
    /// Reports, sent one by one.
    reports: Vec<BuildReport>,
    /// Reports sent in one batch request.
    batch: Vec<BuildReport>,
    /// Complete envelopes (unknown job names, undecodable payloads).
    envelopes: Vec<Envelope>,
    /// Raw text bodies (malformed envelopes).
    raw: Vec<String>,
    /// Delay for each of `reports` (seconds).
    delay_seconds: u64,
    /// Send to `reports-parallel` instead of `reports`.
    parallel: bool,
}

async fn dispatch(mut req: Request, ctx: RouteContext<()>) -> Result<Response> {
    let body: Dispatch = req.json().await?;
    let binding = if body.parallel {
        REPORTS_PARALLEL
    } else {
        REPORTS
    };
    let producer = EdgeProducer::from_env(&ctx.env, binding)
        .map_err(|e| worker::Error::RustError(e.to_string()))?;
    let job = report_job::job().map_err(|e| worker::Error::RustError(e.to_string()))?;
    let fail = |e: queue_edge::EdgeError| worker::Error::RustError(e.to_string());
    let mut reports = Vec::new();
    let delay = (body.delay_seconds > 0).then(|| Duration::from_secs(body.delay_seconds));
    for report in &body.reports {
        let id = producer
            .dispatch_with(&job, report, delay, Default::default())
            .await
            .map_err(fail)?;
        reports.push(id);
    }
    let batch = if body.batch.is_empty() {
        Vec::new()
    } else {
        producer
            .dispatch_batch(&job, &body.batch)
            .await
            .map_err(fail)?
    };
    let mut envelopes = Vec::new();
    for envelope in &body.envelopes {
        producer
            .send_text(
                String::from_utf8_lossy(&envelope.encode()).into_owned(),
                None,
            )
            .await
            .map_err(fail)?;
        envelopes.push(envelope.id.clone());
    }
    for raw in body.raw {
        producer.send_text(raw, None).await.map_err(fail)?;
    }
    Response::from_json(
        &serde_json::json!({ "reports": reports, "batch": batch, "envelopes": envelopes }),
    )
}

async fn log(_: Request, ctx: RouteContext<()>) -> Result<Response> {
    let kv = ctx.env.kv(LOG)?;
    let mut entries = Vec::new();
    let mut cursor = None;
    loop {
        let mut list = kv.list().prefix("log:".into());
        if let Some(c) = cursor.take() {
            list = list.cursor(c);
        }
        let page = list
            .execute()
            .await
            .map_err(|e| worker::Error::RustError(e.to_string()))?;
        for key in page.keys {
            if let Some(text) = kv
                .get(&key.name)
                .text()
                .await
                .map_err(|e| worker::Error::RustError(e.to_string()))?
            {
                entries.push(
                    serde_json::from_str::<serde_json::Value>(&text)
                        .unwrap_or(serde_json::Value::Null),
                );
            }
        }
        if page.list_complete {
            break;
        }
        cursor = page.cursor;
    }
    Response::from_json(&entries)
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, _ctx: Context) -> Result<Response> {
    Router::new()
        .get("/health", |_, _| Response::ok("ok"))
        .post_async("/dispatch", dispatch)
        .get_async("/log", log)
        .run(req, env)
        .await
}
