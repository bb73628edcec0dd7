//! The keeper in a Worker: the D1 table, the failure-queue consumer and the
//! operator routes.

use std::cell::RefCell;

use serde::Deserialize;
use wasm_bindgen::{JsCast, JsValue};
use worker::{console_error, D1Database, D1PreparedStatement, Env, Request, Response};

use super::{FailureKeeper, KeptFailure, Purge, Route, RouteError};
use crate::js::{body_bytes, describe, JsMessage};
use crate::limits::check_message_size;
use crate::producer::EdgeProducer;

/// What [`FailureKeeper::keep_batch`] did with one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeptBatch {
    /// Messages stored (or already stored) and acknowledged.
    pub stored: u32,
    /// Messages handed back to the platform for another delivery because
    /// they could not be stored.
    pub retried: u32,
}

/// A row of the table.
#[derive(Deserialize)]
struct Row {
    id: String,
    platform_id: String,
    stored_at_ms: f64,
    claimed_at_ms: Option<f64>,
    body: String,
    body_encoding: String,
}

impl Row {
    fn entry(&self) -> KeptFailure {
        let bytes = match self.body_encoding.as_str() {
            "hex" => jobrail::RawBody::Hex(self.body.clone()).to_bytes(),
            "base64" => jobrail::RawBody::Base64(self.body.clone()).to_bytes(),
            _ => self.body.clone().into_bytes(),
        };
        let mut entry =
            KeptFailure::from_message(&bytes, &self.platform_id, self.stored_at_ms as u64);
        entry.id = self.id.clone();
        entry.claimed_at_ms = self.claimed_at_ms.map(|ms| ms as u64);
        entry
    }
}

fn now_ms() -> u64 {
    js_sys::Date::now() as u64
}

fn num(value: u64) -> JsValue {
    JsValue::from_f64(value as f64)
}

fn text(value: &str) -> JsValue {
    JsValue::from_str(value)
}

fn failed(what: &str, e: impl std::fmt::Display) -> String {
    format!("failure keeper: {what}: {e}")
}

/// A JSON answer with `status`.
fn json(status: u16, value: &serde_json::Value) -> worker::Result<Response> {
    Ok(Response::from_json(value)?.with_status(status))
}

fn refusal(error: RouteError) -> worker::Result<Response> {
    json(error.status, &serde_json::json!({ "error": error.message }))
}

fn server_error(message: String) -> worker::Result<Response> {
    console_error!("{message}");
    refusal(RouteError::new(500, message))
}

thread_local! {
    /// Tables this instance has already created (or found).
    static READY: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// A claimed entry: only this claim's token deletes or releases it.
struct Claim {
    row: Row,
    token: String,
}

impl FailureKeeper {
    fn statement(
        &self,
        db: &D1Database,
        sql: &str,
        args: &[JsValue],
    ) -> Result<D1PreparedStatement, String> {
        db.prepare(sql.replace("{T}", self.table))
            .bind(args)
            .map_err(|e| failed("binding a statement", e))
    }

    /// The database, with the table created on this instance's first use.
    async fn open(&self, env: &Env) -> Result<D1Database, String> {
        self.validate()?;
        let db = env.d1(self.database).map_err(|e| {
            failed(
                &format!(
                    "no D1 binding `{}` (add a [[d1_databases]] entry)",
                    self.database
                ),
                e,
            )
        })?;
        if READY.with(|r| r.borrow().iter().any(|t| t == self.table)) {
            return Ok(db);
        }
        let schema = [
            "CREATE TABLE IF NOT EXISTS {T} (
                id TEXT PRIMARY KEY,
                message_id TEXT,
                queue TEXT NOT NULL,
                is_record INTEGER NOT NULL,
                failed_at_ms INTEGER NOT NULL,
                stored_at_ms INTEGER NOT NULL,
                platform_id TEXT NOT NULL,
                body TEXT NOT NULL,
                body_encoding TEXT NOT NULL,
                claimed_at_ms INTEGER,
                claim_token TEXT
            )",
            "CREATE INDEX IF NOT EXISTS {T}_order ON {T} (failed_at_ms, id)",
            "CREATE INDEX IF NOT EXISTS {T}_message ON {T} (message_id)",
        ];
        let statements = schema
            .iter()
            .map(|sql| self.statement(&db, sql, &[]))
            .collect::<Result<Vec<_>, _>>()?;
        db.batch(statements)
            .await
            .map_err(|e| failed(&format!("creating table `{}`", self.table), e))?;
        READY.with(|r| r.borrow_mut().push(self.table.to_string()));
        Ok(db)
    }

    /// Consumes a batch of the failure queue (the batch object as the
    /// platform passed it, e.g. to [`consumer!`](crate::consumer)'s
    /// `other_queues`): stores every message in one D1 transaction, then
    /// acknowledges them all; if the write fails, every message is retried
    /// (a record already stored is not stored twice). Entries that are not
    /// failure records are kept as poison entries.
    pub async fn keep_batch(&self, batch: JsValue, env: &Env) -> KeptBatch {
        let messages: Vec<JsMessage> = js_sys::Reflect::get(&batch, &"messages".into())
            .ok()
            .and_then(|m| m.dyn_into::<js_sys::Array>().ok())
            .map(|a| a.iter().map(|m| m.unchecked_into()).collect())
            .unwrap_or_default();
        if messages.is_empty() {
            return KeptBatch::default();
        }
        let now = now_ms();
        let stored = match self.open(env).await {
            Ok(db) => {
                let statements = messages
                    .iter()
                    .map(|message| {
                        let platform_id = message.id();
                        let bytes = body_bytes(&message.body());
                        let entry = KeptFailure::from_message(&bytes, &platform_id, now);
                        let (body, encoding) = match jobrail::RawBody::from_bytes(&bytes) {
                            jobrail::RawBody::Utf8(text) => (text, "utf8"),
                            jobrail::RawBody::Base64(data) => (data, "base64"),
                            jobrail::RawBody::Hex(hex) => (hex, "hex"),
                        };
                        self.statement(
                            &db,
                            "INSERT OR IGNORE INTO {T} (id, message_id, queue, is_record, failed_at_ms,
                                stored_at_ms, platform_id, body, body_encoding)
                             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                            &[
                                text(&entry.id),
                                entry.message_id.as_deref().map_or(JsValue::NULL, text),
                                text(&entry.queue),
                                num(u64::from(entry.record.is_some())),
                                num(entry.failed_at_ms),
                                num(now),
                                text(&platform_id),
                                text(&body),
                                text(encoding),
                            ],
                        )
                    })
                    .collect::<Result<Vec<_>, _>>();
                match statements {
                    Ok(statements) => db
                        .batch(statements)
                        .await
                        .map(|_| ())
                        .map_err(|e| failed("storing failure records", e)),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        let count = messages.len() as u32;
        match stored {
            Ok(()) => {
                for message in &messages {
                    if let Err(e) = message.ack() {
                        console_error!("failure keeper: ack failed: {}", describe(&e));
                    }
                }
                KeptBatch {
                    stored: count,
                    retried: 0,
                }
            }
            Err(e) => {
                console_error!("{e}; the {count} messages are retried");
                for message in &messages {
                    let _ = message.retry(&JsValue::UNDEFINED);
                }
                KeptBatch {
                    stored: 0,
                    retried: count,
                }
            }
        }
    }

    /// Serves the operator routes: `None` when the request's path is not
    /// under [`prefix`](FailureKeeper::prefix), so the caller routes it
    /// elsewhere. Every answer is JSON; refusals are `{"error": ...}`.
    pub async fn handle(&self, req: &Request, env: &Env) -> Option<worker::Result<Response>> {
        let url = req.url().ok()?;
        let route = self.route(req.method().as_ref(), url.path(), url.query().unwrap_or(""))?;
        Some(self.serve(req, env, route).await)
    }

    /// The token check ([`crate::routes::Access`]): 404 without the secret,
    /// 401 without the token.
    fn refused(&self, req: &Request, env: &Env) -> Option<RouteError> {
        let (status, text) = crate::routes::Access::check(req, env, self.token).refusal()?;
        Some(RouteError::new(status, text))
    }

    async fn serve(
        &self,
        req: &Request,
        env: &Env,
        route: Result<Route, RouteError>,
    ) -> worker::Result<Response> {
        if let Some(refused) = self.refused(req, env) {
            return refusal(refused);
        }
        let route = match route {
            Ok(route) => route,
            Err(e) => return refusal(e),
        };
        let db = match self.open(env).await {
            Ok(db) => db,
            Err(e) => return server_error(e),
        };
        let answer = match route {
            Route::List { after, limit } => self.list(&db, after, limit).await,
            Route::Show(id) => self.show(&db, &id).await,
            Route::Replay { id, force, queue } => {
                self.replay(&db, env, &id, force, queue.as_deref()).await
            }
            Route::Purge(which) => self.purge(&db, which).await,
        };
        match answer {
            Ok((status, body)) => json(status, &body),
            Err(e) => server_error(e),
        }
    }

    async fn rows(&self, statement: D1PreparedStatement, what: &str) -> Result<Vec<Row>, String> {
        statement
            .all()
            .await
            .and_then(|r| match r.error() {
                Some(e) => Err(worker::Error::RustError(e)),
                None => r.results::<Row>(),
            })
            .map_err(|e| failed(what, e))
    }

    async fn changes(&self, statement: D1PreparedStatement, what: &str) -> Result<u64, String> {
        let result = statement.run().await.map_err(|e| failed(what, e))?;
        let meta = result.meta().map_err(|e| failed(what, e))?;
        Ok(meta.and_then(|m| m.changes).unwrap_or(0) as u64)
    }

    async fn list(
        &self,
        db: &D1Database,
        after: Option<(u64, String)>,
        limit: u32,
    ) -> Result<(u16, serde_json::Value), String> {
        let (at, id) = match &after {
            Some((at, id)) => (num(*at), text(id)),
            None => (JsValue::NULL, JsValue::NULL),
        };
        let page = self.statement(
            db,
            "SELECT * FROM {T}
             WHERE ?1 IS NULL OR failed_at_ms > ?1 OR (failed_at_ms = ?1 AND id > ?2)
             ORDER BY failed_at_ms, id LIMIT ?3",
            &[at, id, num(u64::from(limit) + 1)],
        )?;
        let mut rows = self.rows(page, "listing failure records").await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let total: Option<f64> = self
            .statement(db, "SELECT COUNT(*) AS n FROM {T}", &[])?
            .first(Some("n"))
            .await
            .map_err(|e| failed("counting failure records", e))?;
        let entries: Vec<KeptFailure> = rows.iter().map(Row::entry).collect();
        let next = more
            .then(|| {
                entries
                    .last()
                    .map(|e| format!("{}:{}", e.failed_at_ms, e.id))
            })
            .flatten();
        Ok((
            200,
            serde_json::json!({
                "entries": entries,
                "next": next,
                "total": total.unwrap_or(0.0) as u64,
            }),
        ))
    }

    async fn show(&self, db: &D1Database, id: &str) -> Result<(u16, serde_json::Value), String> {
        let statement = self.statement(
            db,
            "SELECT * FROM {T} WHERE id = ?1 OR message_id = ?1 ORDER BY failed_at_ms, id LIMIT 1",
            &[text(id)],
        )?;
        Ok(
            match self
                .rows(statement, "reading a failure record")
                .await?
                .first()
            {
                Some(row) => (200, serde_json::to_value(row.entry()).unwrap_or_default()),
                None => not_found(id),
            },
        )
    }

    /// Claims the oldest entry matching `id` that no live claim holds.
    async fn claim(&self, db: &D1Database, id: &str) -> Result<Option<Claim>, String> {
        let now = now_ms();
        let token = format!(
            "{:08x}{:08x}{:x}",
            (js_sys::Math::random() * f64::from(u32::MAX)) as u32,
            (js_sys::Math::random() * f64::from(u32::MAX)) as u32,
            now
        );
        let lapsed = now.saturating_sub(self.claim_hold_ms);
        let statement = self.statement(
            db,
            "UPDATE {T} SET claimed_at_ms = ?2, claim_token = ?3
             WHERE id = (SELECT id FROM {T}
                         WHERE (id = ?1 OR message_id = ?1)
                           AND (claimed_at_ms IS NULL OR claimed_at_ms < ?4)
                         ORDER BY failed_at_ms, id LIMIT 1)
               AND (claimed_at_ms IS NULL OR claimed_at_ms < ?4)
             RETURNING *",
            &[text(id), num(now), text(&token), num(lapsed)],
        )?;
        let mut rows = self.rows(statement, "claiming a failure record").await?;
        Ok(rows.pop().map(|row| Claim { row, token }))
    }

    async fn release(&self, db: &D1Database, claim: &Claim) -> Result<(), String> {
        let statement = self.statement(
            db,
            "UPDATE {T} SET claimed_at_ms = NULL, claim_token = NULL WHERE id = ?1 AND claim_token = ?2",
            &[text(&claim.row.id), text(&claim.token)],
        )?;
        self.changes(statement, "releasing a claim")
            .await
            .map(|_| ())
    }

    async fn remove(&self, db: &D1Database, claim: &Claim) -> Result<u64, String> {
        let statement = self.statement(
            db,
            "DELETE FROM {T} WHERE id = ?1 AND claim_token = ?2",
            &[text(&claim.row.id), text(&claim.token)],
        )?;
        self.changes(statement, "deleting a failure record").await
    }

    async fn replay(
        &self,
        db: &D1Database,
        env: &Env,
        id: &str,
        force: bool,
        queue: Option<&str>,
    ) -> Result<(u16, serde_json::Value), String> {
        let Some(claim) = self.claim(db, id).await? else {
            return Ok(not_found(id));
        };
        let entry = claim.row.entry();
        let message = match entry.replay_message(force, queue, now_ms()) {
            Ok(message) => message,
            Err(refused) => {
                self.release(db, &claim).await?;
                return Ok(error_body(refused));
            }
        };
        let refused = |status: u16, message: String| error_body(RouteError::new(status, message));
        let Some(binding) = self.binding_for(&message.queue) else {
            self.release(db, &claim).await?;
            return Ok(refused(
                422,
                format!(
                    "no producer binding for queue `{}`: list it in the keeper's replay_to",
                    message.queue
                ),
            ));
        };
        let producer = match EdgeProducer::from_env(env, binding) {
            Ok(producer) => producer,
            Err(e) => {
                self.release(db, &claim).await?;
                return Ok(refused(500, e.to_string()));
            }
        };
        if let Err(e) = check_message_size(&message.text) {
            // Certainly not sent: the entry goes back as it was.
            self.release(db, &claim).await?;
            return Ok(refused(422, e.to_string()));
        }
        if let Err(e) = producer.send_text(message.text.clone(), None).await {
            // Perhaps sent: the claim lapses on its own, so an immediate
            // second replay cannot add a copy.
            return Ok(refused(
                502,
                format!(
                    "the send to `{}` failed and may or may not have gone ({e}); entry `{}` stays claimed for {} ms",
                    message.queue, entry.id, self.claim_hold_ms
                ),
            ));
        }
        if let Err(e) = self.remove(db, &claim).await {
            return Ok(refused(
                500,
                format!(
                    "sent as `{}`, but entry `{}` was not deleted ({e}): it stays claimed for {} ms, and a replay after that sends a second copy",
                    message.message_id, entry.id, self.claim_hold_ms
                ),
            ));
        }
        Ok((
            200,
            serde_json::json!({
                "entry_id": entry.id,
                "message_id": message.message_id,
                "queue": message.queue,
            }),
        ))
    }

    async fn purge(
        &self,
        db: &D1Database,
        which: Purge,
    ) -> Result<(u16, serde_json::Value), String> {
        let lapsed = num(now_ms().saturating_sub(self.claim_hold_ms));
        let purged = match which {
            Purge::One(id) => match self.claim(db, &id).await? {
                Some(claim) => self.remove(db, &claim).await?,
                None => return Ok(not_found(&id)),
            },
            Purge::All => {
                let statement = self.statement(
                    db,
                    "DELETE FROM {T} WHERE claimed_at_ms IS NULL OR claimed_at_ms < ?1",
                    &[lapsed],
                )?;
                self.changes(statement, "purging failure records").await?
            }
            Purge::OlderThanMs(before) => {
                let statement = self.statement(
                    db,
                    "DELETE FROM {T} WHERE is_record = 1 AND failed_at_ms < ?2
                       AND (claimed_at_ms IS NULL OR claimed_at_ms < ?1)",
                    &[lapsed, num(before)],
                )?;
                self.changes(statement, "purging failure records").await?
            }
        };
        Ok((200, serde_json::json!({ "purged": purged })))
    }
}

fn error_body(error: RouteError) -> (u16, serde_json::Value) {
    (error.status, serde_json::json!({ "error": error.message }))
}

fn not_found(id: &str) -> (u16, serde_json::Value) {
    error_body(RouteError::new(
        404,
        format!("no failure record `{id}` (or a replay holds it)"),
    ))
}
