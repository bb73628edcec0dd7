//! An edge worker's failure keeper, through its JSON routes
//! (`jobrail_edge::failures`): `GET /failures` page by page,
//! `POST /failures/ID/replay`, `DELETE /failures/ID`, each with the bearer
//! token.

use std::time::Duration;

use jobrail::{FailureKind, FailureRecord};
use serde::Deserialize;

use crate::source::{Entry, Mutated};

/// How long one request to the keeper may take.
const TIMEOUT: Duration = Duration::from_secs(15);
/// The keeper's largest page.
const PAGE: u32 = 500;
/// The most entries read from one keeper for one page view.
pub(crate) const MAX_ENTRIES: usize = 100_000;

pub(crate) struct EdgeKeeper {
    base: String,
    token: String,
    agent: ureq::Agent,
}

#[derive(Deserialize)]
struct ListAnswer {
    entries: Vec<Kept>,
    next: Option<String>,
}

#[derive(Deserialize)]
struct Kept {
    id: String,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    queue: String,
    #[serde(default)]
    job: Option<String>,
    #[serde(default)]
    kind: Option<FailureKind>,
    #[serde(default)]
    failed_at_ms: u64,
    #[serde(default)]
    poison: Option<String>,
    #[serde(default)]
    record: Option<FailureRecord>,
    #[serde(default)]
    body: Option<serde_json::Value>,
}

/// A path segment, percent-encoded (everything but `A-Z a-z 0-9 - . _ ~`).
fn encode(segment: &str) -> String {
    const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(segment, SEGMENT).to_string()
}

impl EdgeKeeper {
    pub(crate) fn new(url: String, token: String) -> Self {
        EdgeKeeper {
            base: url.trim_end_matches('/').to_string(),
            token,
            agent: ureq::AgentBuilder::new().timeout(TIMEOUT).build(),
        }
    }

    fn request(&self, method: &str, path: &str) -> ureq::Request {
        self.agent
            .request(method, &format!("{}{path}", self.base))
            .set("authorization", &format!("Bearer {}", self.token))
    }

    fn problem(&self, what: &str, error: ureq::Error) -> String {
        match error {
            ureq::Error::Status(status, response) => {
                let body = response.into_string().unwrap_or_default();
                let message = serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                    .unwrap_or(body);
                format!(
                    "the edge keeper at {} answered {status} to {what}: {message}",
                    self.base
                )
            }
            ureq::Error::Transport(t) => {
                format!(
                    "the edge keeper at {} did not answer {what}: {t}",
                    self.base
                )
            }
        }
    }

    fn list_blocking(&self) -> Result<Vec<Entry>, String> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut request = self
                .request("GET", "/failures")
                .query("limit", &PAGE.to_string());
            if let Some(cursor) = &after {
                request = request.query("after", cursor);
            }
            let answer: ListAnswer = request
                .call()
                .map_err(|e| self.problem("a list", e))?
                .into_json()
                .map_err(|e| {
                    format!(
                        "the edge keeper at {} sent a list that is not one: {e}",
                        self.base
                    )
                })?;
            for kept in answer.entries {
                out.push(entry(kept));
            }
            match answer.next {
                Some(next) if out.len() < MAX_ENTRIES => after = Some(next),
                _ => break,
            }
        }
        Ok(out)
    }

    pub(crate) async fn entries(self: &std::sync::Arc<Self>) -> Result<Vec<Entry>, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.list_blocking())
            .await
            .map_err(|e| format!("the edge keeper's request stopped: {e}"))?
    }

    pub(crate) async fn replay(
        self: &std::sync::Arc<Self>,
        ids: &[String],
        force: bool,
    ) -> Result<Mutated, String> {
        self.each(ids, "a replay", move |me, id| {
            let mut request = me.request("POST", &format!("/failures/{}/replay", encode(id)));
            if force {
                request = request.query("force", "true");
            }
            request.call().map(|_| 1).map_err(Box::new)
        })
        .await
    }

    pub(crate) async fn purge(
        self: &std::sync::Arc<Self>,
        ids: &[String],
    ) -> Result<Mutated, String> {
        self.each(ids, "a purge", |me, id| {
            me.request("DELETE", &format!("/failures/{}", encode(id)))
                .call()
                .map(|response| {
                    response
                        .into_json::<serde_json::Value>()
                        .ok()
                        .and_then(|v| v.get("purged").and_then(|p| p.as_u64()))
                        .unwrap_or(1)
                })
                .map_err(Box::new)
        })
        .await
    }

    /// Sends one request per id, one after another, on the blocking pool:
    /// the count each answered, 409 (a poison record a replay refuses)
    /// counted as refused, 404 (gone meanwhile: replayed or purged by
    /// another operator) as nothing, anything else as failed.
    async fn each(
        self: &std::sync::Arc<Self>,
        ids: &[String],
        what: &'static str,
        call: impl Fn(&EdgeKeeper, &str) -> Result<u64, Box<ureq::Error>> + Send + 'static,
    ) -> Result<Mutated, String> {
        let me = self.clone();
        let ids = ids.to_vec();
        tokio::task::spawn_blocking(move || {
            let mut done = Mutated::default();
            for id in &ids {
                let problem = match call(&me, id).map_err(|e| *e) {
                    Ok(n) => {
                        done.done += n;
                        continue;
                    }
                    Err(ureq::Error::Status(404, _)) => continue,
                    Err(e @ ureq::Error::Status(409, _)) => {
                        done.refused += 1;
                        me.problem(what, e)
                    }
                    Err(e) => {
                        done.failed += 1;
                        me.problem(what, e)
                    }
                };
                if done.first_problem.is_none() {
                    done.first_problem = Some(format!("{id}: {problem}"));
                }
            }
            Ok(done)
        })
        .await
        .map_err(|e| format!("the edge keeper's requests stopped: {e}"))?
    }
}

fn entry(kept: Kept) -> Entry {
    let (reason, attempt, executions) = match &kept.record {
        Some(r) => (r.reason.clone(), r.attempt, r.executions),
        None => ("not a failure record".to_string(), 0, 0),
    };
    let body_text = kept.body.map(|b| match b {
        serde_json::Value::String(s) => s,
        other => other.to_string(),
    });
    Entry {
        id: kept.id,
        queue: kept.queue,
        message_id: kept.message_id,
        job: kept.job,
        kind: kept.kind,
        reason,
        attempt,
        executions,
        failed_at_ms: kept.failed_at_ms,
        poison: kept.poison,
        record: kept.record,
        body_text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(encode("abc-1_2.3~"), "abc-1_2.3~");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn a_kept_entry_reads_as_an_entry() {
        let kept: Kept = serde_json::from_value(serde_json::json!({
            "id": "h1", "queue": "", "failed_at_ms": 0, "stored_at_ms": 5,
            "poison": "not a failure record", "body": {"text": "garbage"}
        }))
        .unwrap();
        let e = entry(kept);
        assert_eq!(e.reason, "not a failure record");
        assert!(e.body_text.unwrap().contains("garbage"));
    }
}
