//! The report job at the edge.
//!
//! The same job declaration and handler as the native quick start
//! (`report-job`), consumed from the `reports` queue by a Cloudflare Worker.
//! Terminal failures go to the `reports-failed` queue, which this worker also
//! consumes: a [`jobrail_edge::failures::FailureKeeper`] keeps each record in
//! the D1 database `FAILURES_DB` and serves the operator routes under
//! `/failures` (list, show, replay to `reports` or `reports-parallel`,
//! purge), behind the secret `FAILURES_TOKEN`. For the end-to-end tests it
//! also keeps a log of every accepted outcome and every failure record in KV
//! and serves it at `GET /log`; `POST /dispatch` enqueues reports through the
//! producer binding.
//!
//! The consumer is wired with [`jobrail_edge::consumer!`]: the consumer
//! settings come from the repository's `wrangler.toml` (embedded, and checked
//! against the job by the `wrangler_toml_fits_the_jobs` test the macro
//! adds); `reports-parallel` is consumed four messages at a time, `reports`
//! in order. Operators tune `EDGE_BUDGET_MS`, `EDGE_RESERVE_MS`,
//! `UNKNOWN_NAME_ATTEMPTS` and `UNKNOWN_NAME_RETRY_DELAY_MS` in `[vars]`.
//!
//! The worker also shows effects that happen once at the edge: a
//! [`jobrail_edge::D1Claims`] on the D1 database `CLAIMS_DB`, used through
//! the same claim API as natively. `POST /claims` runs one operation of the
//! store (`{"op": "claim"|"complete"|"release"|"extend"|"state", "key",
//! "lease_ms", "fence"}`) and answers every claim and error as JSON, with
//! status 200 (4xx only for a malformed request): `{"claim": "claimed",
//! "fence": 3}`, `{"claim": "done"}`, `{"claim": "held", "remaining_ms":
//! 900}`, `{"ok": true}`, `{"state": "free"|"held"|"done", "remaining_ms"}`,
//! `{"error": "lost"|"invalid"|"store", "message": ...}`. `POST
//! /claims/run-once` (`{"key", "lease_ms", "work_ms"}`) runs
//! [`jobrail::run_once`] with an effect that takes `work_ms` and appends a
//! row to the table `claim_effects`: `{"once": "ran", "fence": 3}`,
//! `{"once": "already_done"}`, or `{"once": "retry", "retry_after_ms": ...}`
//! while another invocation holds the key; `GET /claims/effects?key=K` lists
//! the effects of `K`. `POST /claims/complete-with` (`{"key", "fence",
//! "effects", "fail"}`) completes the claim `fence` together with `effects`
//! rows appended to `claim_effects` (and, with `"fail": true`, a statement
//! that fails), in one batch through
//! [`jobrail_edge::D1Claims::complete_with`]: `{"ok": true, "inserted": 2}`,
//! or an error as above, when no row was written. The conformance suite of
//! claim stores runs on D1 through these routes.
//!
//! `POST /dispatch-unique` (`{"key", "window_ms", "report_id"}`) sends a
//! healthy report through [`jobrail_edge::Dispatch::unique`]
//! on `CLAIMS_DB`, unless one with the same key went out within the window:
//! `{"dispatched": id}` or `{"duplicate": remaining_ms}`, an error as above
//! (`{"error": "dispatch", ...}` for the send's own). The log's events keep
//! their report's id (and nothing else of the payload), so a test finds the
//! runs of a report by it.
//!
//! The worker also fires a schedule from its Cron Trigger (`[triggers]
//! crons = ["* * * * *"]`): `report-every-minute` sends a healthy report
//! each minute whose `report_id` is the tick's Unix time in seconds, each
//! tick claimed once in `CLAIMS_DB` ([`jobrail_edge::EdgeScheduler`]), so
//! a trigger delivered twice sends it once. `wrangler dev` fires the
//! trigger only when asked (`/cdn-cgi/handler/scheduled?cron=...&time=...`).
//!
//! The test routes (`POST /dispatch`, `/dispatch-unique`, `GET /log`,
//! `/claims`) are off unless the operator sets the secret
//! `TEST_ROUTES_TOKEN` (`wrangler secret put TEST_ROUTES_TOKEN`); a request
//! must then carry it as `Authorization: Bearer <token>`. Without the
//! secret, or without the right token, they answer 404 and 401, so a
//! deployed worker opens nothing to strangers.

use jobrail::Registry;

/// The jobs this worker runs: the report job and its handler.
pub fn jobs() -> Result<Registry, String> {
    let job = report_job::job().map_err(|e| e.to_string())?;
    let mut registry = Registry::new();
    registry
        .register(&job, report_job::handle)
        .map_err(|e| e.to_string())?;
    // The test log's events name their report by its id (the sink keeps that
    // field of the payload and drops the rest: payloads may hold secrets).
    #[cfg(target_arch = "wasm32")]
    registry
        .event_sink(std::sync::Arc::new(edge::LogSink))
        .events_include_payload(true);
    Ok(registry)
}

/// The schedules this worker fires from its Cron Triggers: a healthy
/// report every minute, named by its tick (Unix seconds).
pub fn schedules() -> Result<Vec<jobrail::Schedule>, String> {
    let job = report_job::job().map_err(|e| e.to_string())?;
    let every_minute = jobrail::Schedule::builder("report-every-minute", &job, "* * * * *")
        .payload_fn(|tick| report_job::BuildReport {
            report_id: u64::try_from(tick.unix_seconds()).unwrap_or(1),
            behaviour: report_job::Behaviour::Healthy,
        })
        .build()
        .map_err(|e| e.to_string())?;
    Ok(vec![every_minute])
}

jobrail_edge::consumer!(
    jobs,
    options = jobrail_edge::Options {
        failure_queue: Some("FAILED"),
        queue_concurrency: &[("reports-parallel", 4)],
        ..jobrail_edge::Options::DEFAULT
    },
    wrangler = "../../wrangler.toml",
    other_queues = edge::failure_queue,
    after_batch = edge::flush,
    schedules = schedules,
);

/// The Worker-only parts: the KV log, the test routes.
#[cfg(target_arch = "wasm32")]
mod edge {
    use std::time::Duration;

    use jobrail::{
        run_once, Claim, ClaimError, ClaimState, ClaimStore, Envelope, Event, EventSink, JobError,
        Once, Outcome, SettlementError, UniqueDispatch, UniqueDispatchError,
    };
    use jobrail_edge::failures::FailureKeeper;
    use jobrail_edge::{D1Claims, EdgeProducer};
    use report_job::{Behaviour, BuildReport};
    use serde::Deserialize;
    use serde_json::json;
    use wasm_bindgen::prelude::*;
    use wasm_bindgen::JsCast;
    use worker::{
        console_error, event, worker_sys, Context, Env, Request, Response, Result, RouteContext,
        Router,
    };

    /// The producer binding of the work queue.
    const REPORTS: &str = "REPORTS";
    /// The KV namespace holding the test log.
    const LOG: &str = "LOG";
    /// The producer binding of the failure queue.
    const FAILED: &str = "FAILED";
    /// The producer binding of the queue consumed with concurrency.
    const REPORTS_PARALLEL: &str = "REPORTS_PARALLEL";
    /// The secret that turns the test routes on.
    const TOKEN: &str = "TEST_ROUTES_TOKEN";
    /// The D1 binding of the claims (and of the run-once route's effects).
    const CLAIMS_DB: &str = "CLAIMS_DB";

    /// The failure records: kept in D1 (`FAILURES_DB`), replayed through the
    /// producer binding of the queue they failed on, served under
    /// `/failures` to holders of the `FAILURES_TOKEN` secret.
    const KEEPER: FailureKeeper = FailureKeeper {
        replay_to: &[("reports", REPORTS), ("reports-parallel", REPORTS_PARALLEL)],
        ..FailureKeeper::DEFAULT
    };

    /// Log entries not yet written to KV. Kept on the JavaScript side so that
    /// entries logged before a panic in the same batch survive the instance
    /// reset that follows it.
    fn pending() -> js_sys::Array {
        let global = js_sys::global();
        let key = JsValue::from_str("__reportWorkerPendingLog");
        match js_sys::Reflect::get(&global, &key) {
            Ok(existing) if existing.is_instance_of::<js_sys::Array>() => existing.unchecked_into(),
            _ => {
                let fresh = js_sys::Array::new();
                let _ = js_sys::Reflect::set(&global, &key, &fresh);
                fresh
            }
        }
    }

    /// Collects events for the log (flushed to KV after each batch).
    pub(crate) struct LogSink;

    impl EventSink for LogSink {
        fn emit(&self, event: &Event) {
            push(serde_json::json!({ "at_ms": js_sys::Date::now(), "event": logged(event) }));
        }

        fn settlement_failed(&self, event: &Event, error: &SettlementError) {
            push(serde_json::json!({
                "at_ms": js_sys::Date::now(),
                "settlement_failed": logged(event),
                "kind": error.kind().to_string(),
                "error": error.to_string(),
            }));
        }
    }

    /// An event as the log keeps it: of the payload, only the report's id.
    fn logged(event: &Event) -> serde_json::Value {
        let mut event = serde_json::json!(event);
        if let Some(payload) = event.get_mut("payload") {
            *payload = serde_json::json!({ "report_id": payload["report_id"] });
        }
        event
    }

    fn push(entry: serde_json::Value) {
        pending().push(&JsValue::from_str(&entry.to_string()));
    }

    pub(crate) async fn flush(env: Env) {
        let list = pending();
        let taken = list.slice(0, list.length());
        list.set_length(0);
        let entries: Vec<String> = taken.iter().filter_map(|e| e.as_string()).collect();
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

    /// The failure queue: each record goes to the test log, and to the
    /// keeper, which stores it and then acknowledges it.
    pub(crate) async fn failure_queue(batch: JsValue, env: Env) {
        let messages: worker_sys::MessageBatch = batch.clone().unchecked_into();
        for message in messages.messages().map(|a| a.to_vec()).unwrap_or_default() {
            let message: worker_sys::Message = message.unchecked_into();
            let body = message
                .body()
                .ok()
                .and_then(|b| b.as_string())
                .unwrap_or_default();
            let record: serde_json::Value =
                serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
            push(serde_json::json!({ "at_ms": js_sys::Date::now(), "failure_record": record }));
        }
        KEEPER.keep_batch(batch, &env).await;
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
        /// Raw text bodies sent straight to the failure queue (entries the
        /// failure keeper must keep although they are not records).
        failed_raw: Vec<String>,
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
        let fail = |e: jobrail_edge::EdgeError| worker::Error::RustError(e.to_string());
        let mut reports = Vec::new();
        let delay = Duration::from_secs(body.delay_seconds);
        for report in &body.reports {
            let id = producer
                .dispatch(&job)
                .delay(delay)
                .send(report)
                .await
                .map_err(fail)?;
            reports.push(id);
        }
        let batch = if body.batch.is_empty() {
            Vec::new()
        } else {
            producer
                .dispatch(&job)
                .send_batch(&body.batch)
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
        if !body.failed_raw.is_empty() {
            let failed = EdgeProducer::from_env(&ctx.env, FAILED).map_err(fail)?;
            for raw in body.failed_raw {
                failed.send_text(raw, None).await.map_err(fail)?;
            }
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

    /// What `POST /claims` accepts: one operation of the claim store.
    #[derive(Deserialize)]
    struct ClaimOp {
        /// `claim`, `complete`, `release` or `extend`.
        op: String,
        /// The business key.
        key: String,
        /// The lease (claim, extend), in milliseconds (fractions allowed).
        #[serde(default)]
        lease_ms: Option<f64>,
        /// The claim's fence (complete, release, extend).
        #[serde(default)]
        fence: Option<u64>,
    }

    /// A refusal of a malformed request.
    fn bad_request(message: impl std::fmt::Display) -> Result<Response> {
        Ok(Response::from_json(&json!({
            "error": "bad request",
            "message": message.to_string(),
        }))?
        .with_status(400))
    }

    /// The duration of the request's field `name`, given in milliseconds.
    fn millis(name: &str, ms: Option<f64>) -> std::result::Result<Duration, String> {
        let ms = ms.ok_or(format!("`{name}` is missing"))?;
        Duration::try_from_secs_f64(ms / 1000.0).map_err(|e| format!("`{name}` {ms}: {e}"))
    }

    /// A claim error as JSON (the native adapter maps it back).
    fn claim_error(e: &ClaimError) -> serde_json::Value {
        match e {
            ClaimError::Lost { key, fence } => {
                json!({ "error": "lost", "key": key, "fence": fence, "message": e.to_string() })
            }
            ClaimError::Invalid(message) => json!({ "error": "invalid", "message": message }),
            ClaimError::Store(cause) => json!({ "error": "store", "message": cause.to_string() }),
            other => json!({ "error": "store", "message": other.to_string() }),
        }
    }

    fn claims_store(env: &Env) -> Result<D1Claims> {
        D1Claims::from_env(env, CLAIMS_DB).map_err(|e| worker::Error::RustError(e.to_string()))
    }

    async fn claims(mut req: Request, ctx: RouteContext<()>) -> Result<Response> {
        let op: ClaimOp = match req.json().await {
            Ok(op) => op,
            Err(e) => return bad_request(e),
        };
        let store = claims_store(&ctx.env)?;
        let key = op.key.as_str();
        let answer = match op.op.as_str() {
            "claim" => {
                let lease = match millis("lease_ms", op.lease_ms) {
                    Ok(lease) => lease,
                    Err(e) => return bad_request(e),
                };
                match store.claim(key, lease).await {
                    Ok(Claim::Claimed { fence }) => json!({ "claim": "claimed", "fence": fence }),
                    Ok(Claim::Done) => json!({ "claim": "done" }),
                    Ok(Claim::Held { remaining }) => json!({
                        "claim": "held",
                        "remaining_ms": u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
                    }),
                    Err(e) => claim_error(&e),
                }
            }
            "state" => match store.state(key).await {
                Ok(ClaimState::Free) => json!({ "state": "free" }),
                Ok(ClaimState::Done) => json!({ "state": "done" }),
                Ok(ClaimState::Held { remaining }) => json!({
                    "state": "held",
                    "remaining_ms": u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
                }),
                Err(e) => claim_error(&e),
            },
            "complete" | "release" | "extend" => {
                let Some(fence) = op.fence else {
                    return bad_request(format!("`{}` needs a `fence`", op.op));
                };
                let done = match op.op.as_str() {
                    "complete" => store.complete(key, fence).await,
                    "release" => store.release(key, fence).await,
                    _ => match millis("lease_ms", op.lease_ms) {
                        Ok(lease) => store.extend(key, fence, lease).await,
                        Err(e) => return bad_request(e),
                    },
                };
                match done {
                    Ok(()) => json!({ "ok": true }),
                    Err(e) => claim_error(&e),
                }
            }
            other => return bad_request(format!("unknown op `{other}`")),
        };
        Response::from_json(&answer)
    }

    /// What `POST /claims/run-once` accepts.
    #[derive(Deserialize)]
    struct RunOnce {
        /// The business key.
        key: String,
        /// The claim's lease, in milliseconds.
        lease_ms: f64,
        /// How long the effect takes before it records itself.
        #[serde(default)]
        work_ms: u64,
    }

    /// The effects table's schema.
    const EFFECTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS claim_effects (
        key TEXT NOT NULL, fence INTEGER NOT NULL, at_ms INTEGER NOT NULL)";

    /// A handler's view: the same `run_once` as natively, with an effect
    /// that appends a row to `claim_effects` (the test counts them).
    async fn claims_run_once(mut req: Request, ctx: RouteContext<()>) -> Result<Response> {
        let body: RunOnce = match req.json().await {
            Ok(body) => body,
            Err(e) => return bad_request(e),
        };
        let lease = match millis("lease_ms", Some(body.lease_ms)) {
            Ok(lease) => lease,
            Err(e) => return bad_request(e),
        };
        let store = claims_store(&ctx.env)?;
        let db = ctx.env.d1(CLAIMS_DB)?;
        let (db, key) = (&db, body.key.as_str());
        let effect = |fence: u64| async move {
            worker::Delay::from(Duration::from_millis(body.work_ms)).await;
            let fail = |e: worker::Error| JobError::new(format!("recording the effect: {e}"));
            let insert = db
                .prepare("INSERT INTO claim_effects (key, fence, at_ms) VALUES (?1, ?2, ?3)")
                .bind(&[
                    key.into(),
                    JsValue::from_f64(fence as f64),
                    JsValue::from_f64(js_sys::Date::now()),
                ])
                .map_err(fail)?;
            db.batch(vec![db.prepare(EFFECTS_TABLE), insert])
                .await
                .map_err(fail)?;
            Ok::<_, JobError>(fence)
        };
        let answer = match run_once(&store, key, lease, effect).await {
            Ok(Once::Ran(fence)) => json!({ "once": "ran", "fence": fence }),
            Ok(Once::AlreadyDone) => json!({ "once": "already_done" }),
            Err(e) => match e.outcome() {
                Outcome::RetryAfter(delay) => json!({
                    "once": "retry",
                    "retry_after_ms": u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                    "message": e.to_string(),
                }),
                _ => json!({ "once": "error", "message": e.to_string() }),
            },
        };
        Response::from_json(&answer)
    }

    /// What `POST /claims/complete-with` accepts.
    #[derive(Deserialize)]
    struct CompleteWith {
        /// The business key.
        key: String,
        /// The claim's fence.
        fence: u64,
        /// How many rows to append to `claim_effects` with the completion.
        #[serde(default = "one")]
        effects: u32,
        /// Whether to end the batch with a statement that fails.
        #[serde(default)]
        fail: bool,
    }

    fn one() -> u32 {
        1
    }

    /// Completes a claim with database effects in one batch: the rows, and
    /// the completion, commit together or not at all.
    async fn claims_complete_with(mut req: Request, ctx: RouteContext<()>) -> Result<Response> {
        let body: CompleteWith = match req.json().await {
            Ok(body) => body,
            Err(e) => return bad_request(e),
        };
        let store = claims_store(&ctx.env)?;
        let db = store.database();
        let key = body.key.as_str();
        let mut effects = vec![db.prepare(EFFECTS_TABLE)];
        for n in 0..body.effects {
            effects.push(
                db.prepare(
                    "INSERT INTO claim_effects (key, fence, at_ms) VALUES (?1, ?2, ?3) \
                     RETURNING fence",
                )
                .bind(&[
                    key.into(),
                    JsValue::from_f64(body.fence as f64),
                    JsValue::from_f64(js_sys::Date::now() + f64::from(n)),
                ])?,
            );
        }
        if body.fail {
            // NOT NULL constraint failed: claim_effects.fence.
            effects.push(
                db.prepare("INSERT INTO claim_effects (key, fence, at_ms) VALUES (?1, NULL, 0)")
                    .bind(&[key.into()])?,
            );
        }
        let answer = match store.complete_with(key, body.fence, effects).await {
            Ok(results) => {
                let mut inserted = 0;
                for result in &results {
                    inserted += result.results::<serde_json::Value>()?.len();
                }
                json!({ "ok": true, "inserted": inserted })
            }
            Err(e) => claim_error(&e),
        };
        Response::from_json(&answer)
    }

    /// A row of `claim_effects` (D1 hands numbers over as doubles).
    #[derive(Deserialize)]
    struct Effect {
        fence: f64,
        at_ms: f64,
    }

    async fn claims_effects(req: Request, ctx: RouteContext<()>) -> Result<Response> {
        let url = req.url()?;
        let Some((_, key)) = url.query_pairs().find(|(name, _)| name == "key") else {
            return bad_request("`key` is missing");
        };
        let db = ctx.env.d1(CLAIMS_DB)?;
        let select = db
            .prepare("SELECT fence, at_ms FROM claim_effects WHERE key = ?1 ORDER BY at_ms")
            .bind(&[key.as_ref().into()])?;
        let results = db.batch(vec![db.prepare(EFFECTS_TABLE), select]).await?;
        let effects: Vec<Effect> = match results.get(1) {
            Some(result) => result.results()?,
            None => Vec::new(),
        };
        let effects: Vec<_> = effects
            .iter()
            .map(|e| json!({ "fence": e.fence as u64, "at_ms": e.at_ms as u64 }))
            .collect();
        Response::from_json(&json!({ "effects": effects }))
    }

    /// What `POST /dispatch-unique` accepts.
    #[derive(Deserialize)]
    struct DispatchUnique {
        /// The uniqueness key.
        key: String,
        /// The window, in milliseconds (fractions allowed).
        window_ms: f64,
        /// The report to send (a healthy one).
        report_id: u64,
    }

    /// One report through `Dispatch::unique` on `CLAIMS_DB`.
    async fn dispatch_unique(mut req: Request, ctx: RouteContext<()>) -> Result<Response> {
        let body: DispatchUnique = match req.json().await {
            Ok(body) => body,
            Err(e) => return bad_request(e),
        };
        let window = match millis("window_ms", Some(body.window_ms)) {
            Ok(window) => window,
            Err(e) => return bad_request(e),
        };
        let fail = |e: jobrail_edge::EdgeError| worker::Error::RustError(e.to_string());
        let producer = EdgeProducer::from_env(&ctx.env, REPORTS).map_err(fail)?;
        let job = report_job::job().map_err(|e| worker::Error::RustError(e.to_string()))?;
        let store = claims_store(&ctx.env)?;
        let report = BuildReport {
            report_id: body.report_id,
            behaviour: Behaviour::Healthy,
        };
        let answer = match producer
            .dispatch(&job)
            .unique(&store, &body.key, window)
            .send(&report)
            .await
        {
            Ok(UniqueDispatch::Dispatched(id)) => json!({ "dispatched": id }),
            Ok(UniqueDispatch::Duplicate { remaining }) => json!({
                "duplicate": u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
            }),
            Err(UniqueDispatchError::Claim(e)) => claim_error(&e),
            Err(UniqueDispatchError::Dispatch(e)) => json!({
                "error": "dispatch",
                "kind": format!("{:?}", e.kind),
                "message": e.to_string(),
            }),
            Err(other) => json!({ "error": "unknown", "message": other.to_string() }),
        };
        Response::from_json(&answer)
    }

    /// `Some(response)` refusing the request unless the operator set the
    /// secret and the request carries it (404 and 401).
    fn refused(req: &Request, env: &Env) -> Option<Result<Response>> {
        jobrail_edge::routes::refused(jobrail_edge::routes::Access::check(req, env, TOKEN))
    }

    #[event(fetch)]
    async fn fetch(req: Request, env: Env, _ctx: Context) -> Result<Response> {
        if let Some(response) = KEEPER.handle(&req, &env).await {
            return response;
        }
        if req.path() != "/health" {
            if let Some(response) = refused(&req, &env) {
                return response;
            }
        }
        Router::new()
            .get("/health", |_, _| Response::ok("ok"))
            .post_async("/dispatch", dispatch)
            .post_async("/dispatch-unique", dispatch_unique)
            .get_async("/log", log)
            .post_async("/claims", claims)
            .post_async("/claims/run-once", claims_run_once)
            .post_async("/claims/complete-with", claims_complete_with)
            .get_async("/claims/effects", claims_effects)
            .run(req, env)
            .await
    }
}
