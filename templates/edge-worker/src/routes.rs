//! The Worker's HTTP routes (wasm32 only), each off until the operator sets
//! its secret: 404 without it, 401 to a request without
//! `Authorization: Bearer <secret>` (`jobrail_edge::routes::Access`). A
//! deployed worker with neither secret serves nothing.
//!
//! - `POST /send`, secret `SEND_TOKEN`: the body (one payload or a JSON
//!   array of them) is dispatched as the job through `SEND_BINDING`; the
//!   answer is `{"ids": [...]}`.
//! - `/failures`, secret `FAILURES_TOKEN`: the failure records kept in D1
//!   (list, show, replay, purge; see `jobrail_edge::failures`).
//!
//! Under `wrangler dev`, put the secrets in `.dev.vars` (kept out of git);
//! once deployed, `npx wrangler secret put SEND_TOKEN`.

use jobrail_edge::failures::FailureKeeper;
use worker::{event, Context, Env, Method, Request, Response};

/// The failure keeper: the failure queue's records in the D1 database
/// `FAILURES_DB`, served under `/failures`; a replay goes back through the
/// job's producer binding.
pub const KEEPER: FailureKeeper = FailureKeeper {
    replay_to: &[(crate::QUEUE, crate::SEND_BINDING)],
    ..FailureKeeper::DEFAULT
};

/// The failure queue's consumer: keeps every record in D1.
pub async fn keep_failures(batch: wasm_bindgen::JsValue, env: Env) {
    KEEPER.keep_batch(batch, &env).await;
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, _ctx: Context) -> worker::Result<Response> {
    if let Some(response) = KEEPER.handle(&req, &env).await {
        return response;
    }
    match (req.method(), req.path().as_str()) {
        (Method::Post, "/send") => {
            let job = crate::job().map_err(|e| worker::Error::RustError(e.to_string()))?;
            jobrail_edge::routes::send(req, &env, "SEND_TOKEN", crate::SEND_BINDING, &job).await
        }
        _ => Response::error("not found", 404),
    }
}
