//! The failure keeper: a worker's terminal failure records, kept in D1 and
//! operable over HTTP (list, show, replay, purge).
//!
//! A consumer built with [`consumer!`](crate::consumer) sends each terminal
//! failure as a [`jobrail::FailureRecord`] to its failure queue. A
//! [`FailureKeeper`] is the other end of that queue and the operator's view
//! of what arrived there:
//!
//! - `FailureKeeper::keep_batch` (wasm32) consumes the failure queue: it
//!   stores every message in a D1 table and acknowledges it only once the
//!   write succeeded (a failed write is retried by the platform). A body that
//!   is not a failure record is kept too, as a poison entry. A record
//!   delivered twice is stored once (its record id is the key).
//! - `FailureKeeper::handle` (wasm32) serves the operator routes under
//!   [`FailureKeeper::prefix`], each behind the bearer token held in the
//!   secret [`FailureKeeper::token`]: without the secret the routes answer
//!   404, with a wrong or missing token 401.
//!
//! | Route | What it does |
//! |---|---|
//! | `GET /failures?limit=N&after=CURSOR` | one page, oldest first: `{entries, next, total}` |
//! | `GET /failures/ID` | one entry, by entry id or original message id |
//! | `POST /failures/ID/replay[?force=true][&queue=Q]` | sends it again, then deletes it |
//! | `DELETE /failures/ID` | purges one entry |
//! | `DELETE /failures?all=true` | purges every entry |
//! | `DELETE /failures?older_than_ms=T` | purges records that failed before `T` (ms since the epoch) |
//!
//! # Replay
//!
//! The conventions are those of `jobrail_native::Failures`, so an operator
//! reads the same metadata on every backend: the record's envelope goes back
//! to its queue (through the producer binding [`FailureKeeper::replay_to`]
//! names for it) with a new message id, [`replay_id`] of the entry id, and
//! the metadata [`REPLAY_OF`] (the entry id), [`REPLAY_OF_MESSAGE`] (the
//! original message id) and [`REPLAYED_AT_MS`]. It is a new message: the
//! platform counts its attempts from 1 again.
//!
//! A replay first claims the entry in one D1 statement (`UPDATE ... WHERE
//! id = ? AND claim is free`; D1 runs statements one at a time, so of two
//! concurrent replays exactly one gets it and the other answers 404), then
//! sends, then deletes the entry. A crash between the send and the delete
//! leaves the entry claimed; the claim lapses after
//! [`FailureKeeper::claim_hold_ms`] and a second replay would send a second
//! copy: a duplicate, never a loss. A send refused before anything left
//! (the message is above the platform's size limit) gives the claim back at
//! once.
//!
//! Poison entries (not a record, a malformed envelope, a payload that did not
//! decode for its job, a record without an envelope) are refused with the
//! reason (409) unless `force=true`, which sends the stored body as it was;
//! an entry that names no queue needs `queue=Q` as well.
//!
//! # Wiring it
//!
//! ```ignore
//! const KEEPER: jobrail_edge::failures::FailureKeeper = jobrail_edge::failures::FailureKeeper {
//!     database: "FAILURES_DB",
//!     replay_to: &[("emails", "EMAILS")],
//!     ..jobrail_edge::failures::FailureKeeper::DEFAULT
//! };
//!
//! async fn failure_queue(batch: JsValue, env: worker::Env) {
//!     KEEPER.keep_batch(batch, &env).await;
//! }
//! jobrail_edge::consumer!(jobs, options = OPTIONS, other_queues = failure_queue);
//!
//! #[worker::event(fetch)]
//! async fn fetch(req: Request, env: Env, _: Context) -> worker::Result<Response> {
//!     if let Some(response) = KEEPER.handle(&req, &env).await {
//!         return response;
//!     }
//!     Response::error("not found", 404)
//! }
//! ```
//!
//! with, in wrangler.toml, a `[[d1_databases]]` entry whose `binding` is
//! [`FailureKeeper::database`], a consumer entry for the failure queue (with
//! a `dead_letter_queue`, so that a record the keeper could not store after
//! every retry is still kept by the platform), and the operator secret
//! (`wrangler secret put FAILURES_TOKEN`). The table is created on first use.

use std::collections::BTreeMap;

use jobrail::{FailureKind, FailureRecord, RawBody};
use serde::Serialize;

#[cfg(target_arch = "wasm32")]
mod d1;

pub use jobrail::{replay_id, REPLAYED_AT_MS, REPLAY_OF, REPLAY_OF_MESSAGE};

/// Where a worker keeps its failure records and how operators reach them.
/// Build one as a `const` from [`FailureKeeper::DEFAULT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureKeeper {
    /// The D1 binding (`[[d1_databases]] binding`).
    pub database: &'static str,
    /// The table in it; created on first use. Letters, digits and `_`.
    pub table: &'static str,
    /// The secret holding the operator's bearer token. Unset: the routes
    /// answer 404.
    pub token: &'static str,
    /// Where the routes live (`/failures`, `/failures/ID`...).
    pub prefix: &'static str,
    /// Work queue -> the producer binding a replay sends through.
    pub replay_to: &'static [(&'static str, &'static str)],
    /// How long a replay's claim holds an entry if the replay never
    /// finishes (the worker died between sending and deleting).
    pub claim_hold_ms: u64,
}

impl FailureKeeper {
    /// Binding `FAILURES_DB`, table `jobrail_failures`, secret
    /// `FAILURES_TOKEN`, routes under `/failures`, no replay bindings, a
    /// claim hold of 60 s.
    pub const DEFAULT: FailureKeeper = FailureKeeper {
        database: "FAILURES_DB",
        table: "jobrail_failures",
        token: "FAILURES_TOKEN",
        prefix: "/failures",
        replay_to: &[],
        claim_hold_ms: 60_000,
    };

    /// Why these settings cannot work, if they cannot.
    pub fn validate(&self) -> Result<(), String> {
        let table_ok = self
            .table
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !table_ok {
            return Err(format!(
                "failure keeper: table `{}` must be letters, digits and `_`, not starting with a digit",
                self.table
            ));
        }
        if !self.prefix.starts_with('/') || self.prefix.len() < 2 || self.prefix.ends_with('/') {
            return Err(format!(
                "failure keeper: prefix `{}` must start with `/` and not end with one",
                self.prefix
            ));
        }
        if self.database.is_empty() || self.token.is_empty() {
            return Err(
                "failure keeper: the database binding and the token secret need names".into(),
            );
        }
        if self.claim_hold_ms == 0 {
            return Err("failure keeper: claim_hold_ms must be positive".into());
        }
        Ok(())
    }

    /// The producer binding for `queue`.
    pub fn binding_for(&self, queue: &str) -> Option<&'static str> {
        self.replay_to
            .iter()
            .find(|(q, _)| *q == queue)
            .map(|(_, b)| *b)
    }

    /// What a request is asking for, or `None` when its path is not under
    /// [`prefix`](Self::prefix). `query` is the URL's query without `?`.
    pub fn route(
        &self,
        method: &str,
        path: &str,
        query: &str,
    ) -> Option<Result<Route, RouteError>> {
        let rest = path.strip_prefix(self.prefix)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return None;
        }
        let rest = rest.trim_start_matches('/');
        let query = parse_query(query);
        let segments: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect()
        };
        Some(route(method, &segments, &query))
    }
}

/// An operator request, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A page, oldest first.
    List {
        /// Entries after this cursor (a previous page's `next`).
        after: Option<(u64, String)>,
        /// At most this many (1 to 500; default 50).
        limit: u32,
    },
    /// One entry, by entry id or message id.
    Show(String),
    /// Send one entry again, then delete it.
    Replay {
        /// Entry id or message id.
        id: String,
        /// Send a poison entry's stored body as it is.
        force: bool,
        /// The queue to send to, instead of the record's.
        queue: Option<String>,
    },
    /// Purge.
    Purge(Purge),
}

/// Which entries to purge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purge {
    /// The oldest entry matching this id (entry id or message id).
    One(String),
    /// Every entry (but those a replay holds).
    All,
    /// Records that failed before this time, in ms since the epoch
    /// (entries that are not records have no time and stay).
    OlderThanMs(u64),
}

/// A request the routes refuse: the status and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteError {
    /// The HTTP status.
    pub status: u16,
    /// The reason, for the operator.
    pub message: String,
}

impl RouteError {
    fn new(status: u16, message: impl Into<String>) -> Self {
        RouteError {
            status,
            message: message.into(),
        }
    }
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn flag(query: &BTreeMap<String, String>, name: &str) -> Result<bool, RouteError> {
    match query.get(name).map(String::as_str) {
        None | Some("false") | Some("0") => Ok(false),
        Some("true") | Some("1") | Some("") => Ok(true),
        Some(other) => Err(RouteError::new(
            400,
            format!("`{name}` is true or false, not `{other}`"),
        )),
    }
}

fn number(query: &BTreeMap<String, String>, name: &str) -> Result<Option<u64>, RouteError> {
    query
        .get(name)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| RouteError::new(400, format!("`{name}` is a whole number, not `{v}`")))
        })
        .transpose()
}

/// Parses a page cursor, `FAILED_AT_MS:ID`.
pub fn parse_cursor(cursor: &str) -> Option<(u64, String)> {
    let (at, id) = cursor.split_once(':')?;
    Some((at.parse().ok()?, id.to_string()))
}

fn route(
    method: &str,
    segments: &[&str],
    query: &BTreeMap<String, String>,
) -> Result<Route, RouteError> {
    let method = method.to_ascii_uppercase();
    match (method.as_str(), segments) {
        ("GET", []) => {
            let limit = number(query, "limit")?.unwrap_or(50);
            if !(1..=500).contains(&limit) {
                return Err(RouteError::new(400, "`limit` is from 1 to 500"));
            }
            let after = match query.get("after") {
                None => None,
                Some(c) => Some(parse_cursor(c).ok_or_else(|| {
                    RouteError::new(400, format!("`{c}` is not a page cursor (a page's `next`)"))
                })?),
            };
            Ok(Route::List {
                after,
                limit: limit as u32,
            })
        }
        ("GET", [id]) if !id.is_empty() => Ok(Route::Show(percent_decode(id))),
        ("POST", [id, "replay"]) if !id.is_empty() => Ok(Route::Replay {
            id: percent_decode(id),
            force: flag(query, "force")?,
            queue: query.get("queue").filter(|q| !q.is_empty()).cloned(),
        }),
        ("DELETE", [id]) if !id.is_empty() => Ok(Route::Purge(Purge::One(percent_decode(id)))),
        ("DELETE", []) => {
            let all = flag(query, "all")?;
            let older = number(query, "older_than_ms")?;
            match (all, older) {
                (true, None) => Ok(Route::Purge(Purge::All)),
                (false, Some(ms)) => Ok(Route::Purge(Purge::OlderThanMs(ms))),
                (true, Some(_)) => Err(RouteError::new(
                    400,
                    "give `all=true` or `older_than_ms=T`, not both",
                )),
                (false, None) => Err(RouteError::new(
                    400,
                    "purging needs `all=true` or `older_than_ms=T` (or an id in the path)",
                )),
            }
        }
        (_, [] | [_] | [_, "replay"]) => Err(RouteError::new(
            405,
            format!("{method} is not a method of this route"),
        )),
        _ => Err(RouteError::new(404, "no such failure route")),
    }
}

/// One kept entry: a failure record, or a message of the failure queue that
/// is not one.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeptFailure {
    /// The entry's id: the record's id, or for a body that is not a record
    /// (or a record without an id) `h` and a hash of the platform's message
    /// id and the body, so that two such messages are two entries.
    pub id: String,
    /// The original message id, when the envelope decoded.
    pub message_id: Option<String>,
    /// The queue it failed on (empty for an entry that is not a record).
    pub queue: String,
    /// The job name, when known.
    pub job: Option<String>,
    /// Why it failed (`None`: not a record).
    pub kind: Option<FailureKind>,
    /// When it failed, ms since the epoch (0: not a record).
    pub failed_at_ms: u64,
    /// When the keeper stored it.
    pub stored_at_ms: u64,
    /// When a replay claimed it, while the claim holds.
    pub claimed_at_ms: Option<u64>,
    /// Why a replay would not run the job again (`None`: replayable).
    pub poison: Option<String>,
    /// The record, when the entry is one.
    pub record: Option<FailureRecord>,
    /// The body as it arrived, when it is not a record.
    pub body: Option<RawBody>,
}

impl KeptFailure {
    /// The entry for a failure-queue message: `body` as received, the
    /// platform's `message_id`, stored at `stored_at_ms`.
    pub fn from_message(body: &[u8], platform_id: &str, stored_at_ms: u64) -> Self {
        let record = FailureRecord::decode(body).ok();
        let id = match &record {
            Some(r) if !r.id.is_empty() => r.id.clone(),
            _ => {
                let mut keyed = platform_id.as_bytes().to_vec();
                keyed.push(0);
                keyed.extend_from_slice(body);
                jobrail::failure_entry_id(&keyed, None)
            }
        };
        let mut kept = KeptFailure {
            id,
            message_id: record.as_ref().and_then(|r| r.message_id.clone()),
            queue: record.as_ref().map(|r| r.queue.clone()).unwrap_or_default(),
            job: record.as_ref().and_then(|r| r.job.clone()),
            kind: record.as_ref().map(|r| r.kind),
            failed_at_ms: record.as_ref().map_or(0, |r| r.failed_at_ms),
            stored_at_ms,
            claimed_at_ms: None,
            poison: None,
            body: record.is_none().then(|| RawBody::from_bytes(body)),
            record,
        };
        kept.poison = kept.poison_reason();
        kept
    }

    /// Why replaying it would not run the job again, if it would not.
    pub fn poison_reason(&self) -> Option<String> {
        jobrail::poison_reason(self.record.as_ref())
    }

    /// The body as stored (the record's JSON, or the message as it came).
    pub fn stored_body(&self) -> Vec<u8> {
        match (&self.record, &self.body) {
            (_, Some(raw)) => raw.to_bytes(),
            (Some(record), None) => record.encode(),
            (None, None) => Vec::new(),
        }
    }

    /// The message a replay sends at `now_ms`: its id, queue and text.
    /// `queue` overrides the record's queue. Refused (409) for a poison
    /// entry unless `force`, then the stored body goes as it is; refused
    /// (422) when no queue is known (an entry that is not a record names
    /// none).
    pub fn replay_message(
        &self,
        force: bool,
        queue: Option<&str>,
        now_ms: u64,
    ) -> Result<ReplayMessage, RouteError> {
        let message_id = replay_id(&self.id);
        let queue = queue.unwrap_or(&self.queue).to_string();
        let poison = self.poison_reason();
        if let (Some(reason), false) = (&poison, force) {
            return Err(RouteError::new(
                409,
                format!(
                    "entry `{}` is not replayed: {reason} (force=true sends the stored body as it is)",
                    self.id
                ),
            ));
        }
        if queue.is_empty() {
            return Err(RouteError::new(
                422,
                format!(
                    "entry `{}` names no queue: give `queue=Q` to say where it goes",
                    self.id
                ),
            ));
        }
        let stored = self.stored_body();
        let replay = jobrail::replay_message(&self.id, self.record.as_ref(), &stored, true, now_ms)
            .expect("a forced replay is never refused");
        let body = replay.body;
        Ok(ReplayMessage {
            message_id,
            queue,
            text: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// What a replay sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReplayMessage {
    /// The new message's id ([`replay_id`] of the entry id; a forced poison
    /// body keeps whatever it holds).
    pub message_id: String,
    /// The queue it goes to.
    pub queue: String,
    /// The body.
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail::{Envelope, Failure};

    const KEEPER: FailureKeeper = FailureKeeper {
        replay_to: &[("reports", "REPORTS")],
        ..FailureKeeper::DEFAULT
    };

    fn record(kind: FailureKind, body: &[u8]) -> FailureRecord {
        let envelope = Envelope::decode(body).ok();
        FailureRecord::build(
            "reports",
            &Failure {
                kind,
                message: "it broke".into(),
            },
            3,
            1,
            envelope.as_ref(),
            body,
        )
    }

    fn envelope() -> Envelope {
        Envelope::new("build-report", serde_json::json!({"report_id": 7}))
    }

    #[test]
    fn a_record_is_kept_under_its_own_id_and_replays_with_the_native_metadata() {
        let envelope = envelope();
        let record = record(FailureKind::Permanent, &envelope.encode());
        let kept = KeptFailure::from_message(&record.encode(), "platform-1", 5);
        assert_eq!(kept.id, record.id);
        assert_eq!(kept.message_id.as_deref(), Some(envelope.id.as_str()));
        assert_eq!(kept.queue, "reports");
        assert_eq!(kept.poison, None);
        let replay = kept.replay_message(false, None, 1234).unwrap();
        assert_eq!(replay.message_id, format!("replay-{}", record.id));
        assert_eq!(replay.queue, "reports");
        let sent = Envelope::decode(replay.text.as_bytes()).unwrap();
        assert_eq!(sent.id, replay.message_id);
        assert_eq!(sent.payload, envelope.payload);
        assert_eq!(sent.metadata[REPLAY_OF], record.id);
        assert_eq!(sent.metadata[REPLAY_OF_MESSAGE], envelope.id);
        assert_eq!(sent.metadata[REPLAYED_AT_MS], "1234");
        // The same bytes decode the same way whichever the platform id.
        assert_eq!(
            KeptFailure::from_message(&record.encode(), "other", 9).id,
            kept.id
        );
    }

    #[test]
    fn poison_is_refused_unless_forced_then_sent_as_it_came() {
        let raw = b"{not an envelope";
        let record = record(FailureKind::MalformedEnvelope, raw);
        let kept = KeptFailure::from_message(&record.encode(), "p", 5);
        let refused = kept.replay_message(false, None, 1).unwrap_err();
        assert_eq!(refused.status, 409);
        assert!(refused.message.contains("malformed"), "{}", refused.message);
        let forced = kept.replay_message(true, None, 1).unwrap();
        assert_eq!(forced.text.as_bytes(), raw);
    }

    #[test]
    fn a_body_that_is_no_record_is_a_poison_entry_of_its_own() {
        let one = KeptFailure::from_message(b"hello", "m1", 5);
        let two = KeptFailure::from_message(b"hello", "m2", 5);
        assert_ne!(one.id, two.id, "two messages, two entries");
        assert!(one.id.starts_with('h'));
        assert_eq!(one.record, None);
        assert_eq!(one.body, Some(RawBody::Utf8("hello".into())));
        assert_eq!(
            one.poison.as_deref(),
            Some("the entry is not a failure record")
        );
        assert_eq!(one.replay_message(false, None, 1).unwrap_err().status, 409);
        assert_eq!(one.replay_message(true, None, 1).unwrap_err().status, 422);
        let forced = one.replay_message(true, Some("reports"), 1).unwrap();
        assert_eq!(
            (forced.queue.as_str(), forced.text.as_str()),
            ("reports", "hello")
        );
        // Bytes that are not UTF-8 are kept byte for byte.
        let bytes = KeptFailure::from_message(&[0xff, 0x01], "m3", 5);
        assert_eq!(bytes.stored_body(), vec![0xff, 0x01]);
    }

    #[test]
    fn routes_parse_and_refuse_clearly() {
        let r = |m: &str, p: &str, q: &str| KEEPER.route(m, p, q);
        assert_eq!(r("GET", "/log", ""), None);
        assert_eq!(r("GET", "/failuresx", ""), None);
        assert_eq!(
            r("GET", "/failures", ""),
            Some(Ok(Route::List {
                after: None,
                limit: 50
            }))
        );
        assert_eq!(
            r("GET", "/failures/", "limit=2&after=17%3Aabc"),
            Some(Ok(Route::List {
                after: Some((17, "abc".into())),
                limit: 2
            }))
        );
        assert_eq!(
            r("GET", "/failures/abc", ""),
            Some(Ok(Route::Show("abc".into())))
        );
        assert_eq!(
            r("POST", "/failures/abc/replay", "force=true&queue=reports"),
            Some(Ok(Route::Replay {
                id: "abc".into(),
                force: true,
                queue: Some("reports".into())
            }))
        );
        assert_eq!(
            r("DELETE", "/failures/abc", ""),
            Some(Ok(Route::Purge(Purge::One("abc".into()))))
        );
        assert_eq!(
            r("DELETE", "/failures", "all=true"),
            Some(Ok(Route::Purge(Purge::All)))
        );
        assert_eq!(
            r("DELETE", "/failures", "older_than_ms=99"),
            Some(Ok(Route::Purge(Purge::OlderThanMs(99))))
        );
        let status = |m: &str, p: &str, q: &str| r(m, p, q).unwrap().unwrap_err().status;
        assert_eq!(status("DELETE", "/failures", ""), 400);
        assert_eq!(
            status("DELETE", "/failures", "all=true&older_than_ms=1"),
            400
        );
        assert_eq!(status("DELETE", "/failures", "older_than_ms=soon"), 400);
        assert_eq!(status("GET", "/failures", "limit=0"), 400);
        assert_eq!(status("GET", "/failures", "after=nope"), 400);
        assert_eq!(status("POST", "/failures/abc/replay", "force=maybe"), 400);
        assert_eq!(status("PUT", "/failures/abc", ""), 405);
        assert_eq!(status("GET", "/failures/a/b/c", ""), 404);
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(KEEPER.validate(), Ok(()));
        assert_eq!(KEEPER.binding_for("reports"), Some("REPORTS"));
        assert_eq!(KEEPER.binding_for("other"), None);
        for bad in [
            FailureKeeper {
                table: "x; DROP TABLE y",
                ..KEEPER
            },
            FailureKeeper {
                table: "1abc",
                ..KEEPER
            },
            FailureKeeper {
                prefix: "failures",
                ..KEEPER
            },
            FailureKeeper {
                prefix: "/failures/",
                ..KEEPER
            },
            FailureKeeper {
                claim_hold_ms: 0,
                ..KEEPER
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
