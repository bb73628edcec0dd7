//! The commands, on a connected driver: each returns what to print, as text
//! and as JSON.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jobrail::human;
use jobrail_native::{Driver, Failures, Page, Purge, QueueDepth, StoredFailure};
use serde_json::{json, Value};

use crate::args::Failed;
use crate::error::CliError;

/// What a command prints: `text` for people, `json` with `--json`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Output {
    /// Lines for people, ending in a line break.
    pub(crate) text: String,
    /// The same, for programs.
    pub(crate) json: Value,
}

/// Runs `jobrail failed ...` on `driver`.
pub(crate) async fn failed(driver: Arc<dyn Driver>, command: Failed) -> Result<Output, CliError> {
    let backend = driver.name();
    let failures = Failures::new(driver);
    match command {
        Failed::List {
            queue,
            limit,
            after,
        } => {
            let page = failures
                .list(
                    &queue,
                    &Page {
                        after,
                        limit: usize::from(limit),
                    },
                )
                .await?;
            Ok(list_output(
                backend,
                &queue,
                &page.entries,
                page.total,
                page.next.as_deref(),
            ))
        }
        Failed::Show { queue, id } => match failures.show(&queue, &id).await? {
            Some(entry) => Ok(show_output(backend, &queue, &entry, SystemTime::now())),
            None => Err(no_record(&queue, &id)),
        },
        Failed::Replay { queue, id, force } => {
            let replayed = failures.replay(&queue, &id, force).await?;
            Ok(Output {
                text: format!(
                    "replayed failure record `{}` to queue `{}` as message `{}`; the record is removed\n",
                    replayed.entry_id, replayed.queue, replayed.message_id
                ),
                json: json!({
                    "backend": backend,
                    "queue": replayed.queue,
                    "replayed": replayed.entry_id,
                    "message_id": replayed.message_id,
                }),
            })
        }
        Failed::Purge {
            queue,
            id,
            all,
            older_than,
        } => {
            let which = purge_selection(id, all, older_than, SystemTime::now())?;
            let purged = failures.purge(&queue, &which).await?;
            if let (Purge::One(id), 0) = (&which, purged) {
                return Err(no_record(&queue, id));
            }
            let what = match &which {
                Purge::One(id) => format!("record `{id}`"),
                Purge::All => "every record".to_string(),
                Purge::OlderThan(before) => {
                    format!("records that failed before {}", rfc3339(*before))
                }
            };
            Ok(Output {
                text: format!(
                    "purged {purged} failure record{} of queue `{queue}` ({what})\n",
                    plural(purged)
                ),
                json: json!({ "backend": backend, "queue": queue, "purged": purged }),
            })
        }
    }
}

fn no_record(queue: &str, id: &str) -> CliError {
    CliError::not_found(format!(
        "no failure record `{id}` on queue `{queue}` (neither a record id nor a message id there)"
    ))
}

/// The purge selection of the command line (exactly one is given: clap
/// checks it).
fn purge_selection(
    id: Option<String>,
    all: bool,
    older_than: Option<Duration>,
    now: SystemTime,
) -> Result<Purge, CliError> {
    match (id, all, older_than) {
        (Some(id), false, None) => Ok(Purge::One(id)),
        (None, true, None) => Ok(Purge::All),
        // An age reaching before 1970 selects nothing older: no record is.
        (None, false, Some(age)) => Ok(Purge::OlderThan(
            now.checked_sub(age).unwrap_or(UNIX_EPOCH).max(UNIX_EPOCH),
        )),
        _ => Err(CliError::usage(
            "purge takes exactly one of --id, --all and --older-than",
        )),
    }
}

/// Runs `jobrail depth`.
pub(crate) async fn depth(driver: Arc<dyn Driver>, queue: &str) -> Result<Output, CliError> {
    let backend = driver.name();
    let admin = driver.admin().ok_or_else(|| {
        CliError::failed(format!("the {backend} driver does not report queue depths"))
    })?;
    let depth = admin.depth(queue).await?;
    Ok(depth_output(backend, queue, &depth))
}

pub(crate) fn depth_output(backend: &str, queue: &str, depth: &QueueDepth) -> Output {
    let part = |n: Option<u64>, what: &str| match n {
        Some(n) => format!("{n} {what}"),
        None => format!("{what}: not reported"),
    };
    Output {
        text: format!(
            "queue `{queue}` ({backend}): {} ready, {}, {}\n",
            depth.ready,
            part(depth.in_flight, "in flight"),
            part(depth.delayed, "delayed")
        ),
        json: json!({
            "backend": backend,
            "queue": queue,
            "ready": depth.ready,
            "in_flight": depth.in_flight,
            "delayed": depth.delayed,
        }),
    }
}

fn plural(n: impl Into<u64>) -> &'static str {
    if n.into() == 1 {
        ""
    } else {
        "s"
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn at_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// The record's failure kind as JSON names it (`attempts_exhausted`), or
/// why the entry has none.
fn kind_name(entry: &StoredFailure) -> String {
    match &entry.record {
        Some(record) => serde_json::to_value(record.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{:?}", record.kind)),
        None => "not_a_record".to_string(),
    }
}

/// At most `max` characters of the first line of `text`.
fn clip(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or_default();
    if line.chars().count() <= max && !text.contains('\n') {
        return line.to_string();
    }
    let kept: String = line.chars().take(max.saturating_sub(3)).collect();
    format!("{kept}...")
}

/// An entry as JSON: its id, kind, time, whether it is poison, the record
/// (or the body, for an entry that is not one).
pub(crate) fn entry_json(entry: &StoredFailure) -> Value {
    let mut value = json!({
        "id": entry.id,
        "kind": kind_name(entry),
        "message_id": entry.record.as_ref().and_then(|r| r.message_id.clone()),
        "job": entry.record.as_ref().and_then(|r| r.job.clone()),
        "failed_at": entry.record.as_ref().map(|r| rfc3339(at_ms(r.failed_at_ms))),
        "replayable": entry.poison_reason().is_none(),
        "poison": entry.poison_reason(),
        "record": entry.record,
    });
    if entry.record.is_none() {
        value["body"] = Value::String(String::from_utf8_lossy(&entry.body).into_owned());
    }
    value
}

/// `failed list`'s output.
pub(crate) fn list_output(
    backend: &str,
    queue: &str,
    entries: &[StoredFailure],
    total: usize,
    next: Option<&str>,
) -> Output {
    let mut text = String::new();
    if total == 0 {
        let _ = writeln!(text, "queue `{queue}` ({backend}): no failure records");
    } else {
        let _ = writeln!(
            text,
            "queue `{queue}` ({backend}): {} failure record{}, {} listed, oldest first\n",
            total,
            plural(total as u64),
            entries.len()
        );
        let _ = writeln!(
            text,
            "{:<36}  {:<20}  {:<21}  {:<14}  {:>8}  REASON",
            "ID", "FAILED AT (UTC)", "KIND", "JOB", "DELIVERY"
        );
        for entry in entries {
            let (at, job, attempt, reason) = match &entry.record {
                Some(r) => (
                    rfc3339(at_ms(r.failed_at_ms)),
                    r.job.clone().unwrap_or_else(|| "?".into()),
                    r.attempt.to_string(),
                    r.reason.clone(),
                ),
                None => (
                    "?".into(),
                    "?".into(),
                    "?".into(),
                    String::from_utf8_lossy(&entry.body).into_owned(),
                ),
            };
            let mark = if entry.poison_reason().is_some() {
                " *"
            } else {
                ""
            };
            let _ = writeln!(
                text,
                "{:<36}  {:<20}  {:<21}  {:<14}  {:>8}  {}",
                entry.id,
                at,
                format!("{}{mark}", kind_name(entry)),
                job,
                attempt,
                clip(&reason, 60)
            );
        }
        if entries.iter().any(|e| e.poison_reason().is_some()) {
            let _ = writeln!(
                text,
                "\n* poison or not replayable as is: `jobrail failed show` says why; replay needs --force"
            );
        }
        if let Some(next) = next {
            let _ = writeln!(
                text,
                "\nmore: jobrail failed list --queue {queue} --after {next}"
            );
        }
    }
    Output {
        text,
        json: json!({
            "backend": backend,
            "queue": queue,
            "total": total,
            "next": next,
            "entries": entries.iter().map(entry_json).collect::<Vec<_>>(),
        }),
    }
}

/// `failed show`'s output.
pub(crate) fn show_output(
    backend: &str,
    queue: &str,
    entry: &StoredFailure,
    now: SystemTime,
) -> Output {
    let mut text = String::new();
    let mut field = |name: &str, value: &str| {
        let _ = writeln!(text, "{name:<12} {value}");
    };
    field("record", &entry.id);
    field("queue", &format!("{queue} ({backend})"));
    match &entry.record {
        Some(r) => {
            field(
                "message",
                r.message_id.as_deref().unwrap_or("(did not decode)"),
            );
            field("job", r.job.as_deref().unwrap_or("(did not decode)"));
            field("kind", &kind_name(entry));
            let at = at_ms(r.failed_at_ms);
            let ago = now
                .duration_since(at)
                .map(|d| format!(" ({} ago)", human(Some(Duration::from_secs(d.as_secs())))))
                .unwrap_or_default();
            field("failed at", &format!("{}{ago}", rfc3339(at)));
            field(
                "delivery",
                &format!(
                    "{}, {} execution{} in it",
                    r.attempt,
                    r.executions,
                    plural(r.executions)
                ),
            );
            field("reason", &r.reason);
        }
        None => field("kind", "not a failure record"),
    }
    field(
        "replay",
        &match entry.poison_reason() {
            None => "yes: jobrail failed replay sends the envelope back as a new message".into(),
            Some(reason) => format!("refused without --force: {reason}"),
        },
    );
    match entry.record.as_ref() {
        Some(r) => {
            if let Some(envelope) = &r.envelope {
                let pretty = serde_json::to_string_pretty(envelope).unwrap_or_default();
                let _ = writeln!(text, "envelope\n{}", indent(&pretty));
            }
            if let Some(raw) = &r.raw_body {
                let _ = writeln!(
                    text,
                    "raw body\n{}",
                    indent(&String::from_utf8_lossy(&raw.to_bytes()))
                );
            }
        }
        None => {
            let _ = writeln!(
                text,
                "body\n{}",
                indent(&String::from_utf8_lossy(&entry.body))
            );
        }
    }
    let mut json = entry_json(entry);
    json["backend"] = json!(backend);
    json["queue"] = json!(queue);
    Output { text, json }
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    use jobrail::{Envelope, FailureKind, FailureRecord, RawBody};

    fn record(kind: FailureKind, failed_at_ms: u64) -> FailureRecord {
        let envelope = Envelope::new("build-report", json!({"report_id": 5}));
        FailureRecord {
            v: 1,
            id: format!("rec-{failed_at_ms}"),
            queue: "reports".into(),
            message_id: Some(envelope.id.clone()),
            job: Some("build-report".into()),
            kind,
            reason: "report 5 is missing\nsecond line".into(),
            attempt: 2,
            executions: 3,
            failed_at_ms,
            envelope: Some(envelope),
            raw_body: None,
            truncated: None,
        }
    }

    fn entry(record: &FailureRecord) -> StoredFailure {
        StoredFailure::from_body(serde_json::to_vec(record).unwrap())
    }

    const NOW_MS: u64 = 1_700_000_100_000;

    fn now() -> SystemTime {
        at_ms(NOW_MS)
    }

    #[test]
    fn an_empty_list_says_so() {
        let out = list_output("nats", "reports", &[], 0, None);
        assert_eq!(out.text, "queue `reports` (nats): no failure records\n");
        assert_eq!(out.json["total"], 0);
        assert_eq!(out.json["entries"], json!([]));
    }

    #[test]
    fn a_list_has_one_line_per_entry_and_marks_poison() {
        let ok = entry(&record(FailureKind::Permanent, 1_700_000_000_000));
        let mut poison = record(FailureKind::UndecodablePayload, 1_700_000_050_000);
        poison.reason = "invalid type: string \"seven\", expected u64".into();
        let poison = entry(&poison);
        let junk = StoredFailure::from_body(b"not json".to_vec());
        let out = list_output(
            "rabbitmq",
            "reports",
            &[junk.clone(), ok, poison],
            4,
            Some("1700000050000:rec-1700000050000"),
        );
        let lines: Vec<&str> = out.text.lines().collect();
        assert_eq!(
            lines[0],
            "queue `reports` (rabbitmq): 4 failure records, 3 listed, oldest first"
        );
        assert!(lines[2].starts_with("ID "), "{}", out.text);
        let row = |id: &str| {
            *lines
                .iter()
                .find(|l| l.starts_with(id))
                .unwrap_or_else(|| panic!("no row for {id}: {}", out.text))
        };
        let ok_row = row("rec-1700000000000");
        assert!(ok_row.contains("2023-11-14T22:13:20Z"), "{ok_row}");
        assert!(ok_row.contains("permanent "), "{ok_row}");
        assert!(ok_row.contains("build-report"), "{ok_row}");
        assert!(ok_row.ends_with("report 5 is missing..."), "{ok_row}");
        assert!(row("rec-1700000050000").contains("undecodable_payload *"));
        assert!(row(&junk.id).contains("not_a_record *"));
        assert!(out.text.contains("replay needs --force"));
        assert!(out.text.contains(
            "more: jobrail failed list --queue reports --after 1700000050000:rec-1700000050000"
        ));

        assert_eq!(out.json["total"], 4);
        assert_eq!(out.json["next"], "1700000050000:rec-1700000050000");
        let entries = out.json["entries"].as_array().unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0]["body"], "not json");
        assert_eq!(entries[0]["record"], Value::Null);
        assert_eq!(entries[1]["id"], "rec-1700000000000");
        assert_eq!(entries[1]["kind"], "permanent");
        assert_eq!(entries[1]["replayable"], true);
        assert_eq!(entries[1]["failed_at"], "2023-11-14T22:13:20Z");
        assert_eq!(entries[1]["record"]["envelope"]["payload"]["report_id"], 5);
        assert_eq!(entries[2]["replayable"], false);
        assert!(entries[2]["poison"]
            .as_str()
            .unwrap()
            .contains("did not decode"));
    }

    #[test]
    fn show_prints_the_envelope_and_whether_replay_works() {
        let r = record(FailureKind::AttemptsExhausted, 1_700_000_000_000);
        let out = show_output("sqs", "reports", &entry(&r), now());
        assert!(
            out.text.starts_with("record       rec-1700000000000\n"),
            "{}",
            out.text
        );
        assert!(out.text.contains("queue        reports (sqs)\n"));
        assert!(out.text.contains(&format!(
            "message      {}\n",
            r.message_id.as_deref().unwrap()
        )));
        assert!(out.text.contains("kind         attempts_exhausted\n"));
        assert!(out
            .text
            .contains("failed at    2023-11-14T22:13:20Z (1m 40s ago)\n"));
        assert!(out.text.contains("delivery     2, 3 executions in it\n"));
        assert!(out.text.contains("replay       yes"));
        assert!(out.text.contains("envelope\n  {\n"));
        assert!(out.text.contains("\"report_id\": 5"));
        assert_eq!(out.json["queue"], "reports");
        assert_eq!(out.json["backend"], "sqs");

        let mut poison = record(FailureKind::MalformedEnvelope, 1_700_000_000_000);
        poison.envelope = None;
        poison.message_id = None;
        poison.job = None;
        poison.raw_body = Some(RawBody::from_bytes(b"{\"half"));
        let out = show_output("sqs", "reports", &entry(&poison), now());
        assert!(out.text.contains("message      (did not decode)\n"));
        assert!(out.text.contains(
            "replay       refused without --force: poison: the message is not an envelope"
        ));
        assert!(out.text.contains("raw body\n  {\"half\n"), "{}", out.text);
    }

    #[test]
    fn depth_says_what_the_backend_does_not_report() {
        let out = depth_output("sqs", "reports", &QueueDepth::new(3, Some(1), None));
        assert_eq!(
            out.text,
            "queue `reports` (sqs): 3 ready, 1 in flight, delayed: not reported\n"
        );
        assert_eq!(
            out.json,
            json!({"backend": "sqs", "queue": "reports", "ready": 3, "in_flight": 1, "delayed": null})
        );
    }

    #[test]
    fn purge_selections() {
        let n = now();
        assert_eq!(
            purge_selection(None, false, Some(Duration::from_secs(100)), n).unwrap(),
            Purge::OlderThan(at_ms(NOW_MS - 100_000))
        );
        assert_eq!(purge_selection(None, true, None, n).unwrap(), Purge::All);
        assert_eq!(
            purge_selection(Some("x".into()), false, None, n).unwrap(),
            Purge::One("x".into())
        );
        assert_eq!(
            purge_selection(None, false, Some(Duration::from_secs(NOW_MS)), n).unwrap(),
            Purge::OlderThan(UNIX_EPOCH)
        );
        assert!(purge_selection(None, false, None, n).is_err());
    }

    #[test]
    fn clip_keeps_the_first_line() {
        assert_eq!(clip("short", 10), "short");
        assert_eq!(clip("exactly ten", 11), "exactly ten");
        assert_eq!(clip("a longer line of text", 10), "a longe...");
        assert_eq!(clip("one\ntwo", 10), "one...");
    }

    /// The commands on the memory driver's failure store, with records a
    /// worker left.
    #[tokio::test]
    async fn list_page_show_replay_and_purge_on_the_memory_driver() {
        use jobrail::{JobError, Registry};
        use jobrail_native::{Consumer, MemoryDriver, Producer};

        let memory = MemoryDriver::default();
        let driver: Arc<dyn Driver> = Arc::new(memory.clone());
        let job = jobrail::Job::<u64>::builder("count")
            .queue("q")
            .build()
            .unwrap();
        let producer = Producer::new(driver.clone());
        for n in 1..=3u64 {
            producer.dispatch(&job).send(&n).await.unwrap();
        }
        let mut registry = Registry::new();
        registry
            .register(&job, |_, n: u64| async move {
                Err(JobError::permanent(format!("n = {n}")))
            })
            .unwrap();
        let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while memory.failure_records("q").len() < 3 {
            assert!(std::time::Instant::now() < deadline, "no failure records");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        consumer.shutdown().await.unwrap();

        let list = |limit: u16, after: Option<String>| {
            failed(
                driver.clone(),
                Failed::List {
                    queue: "q".into(),
                    limit,
                    after,
                },
            )
        };
        let first = list(2, None).await.unwrap().json;
        assert_eq!(first["total"], 3);
        assert_eq!(first["entries"].as_array().unwrap().len(), 2);
        let next = first["next"].as_str().unwrap().to_string();
        let second = list(2, Some(next)).await.unwrap().json;
        assert_eq!(second["entries"].as_array().unwrap().len(), 1);
        assert_eq!(second["next"], Value::Null);
        let err = list(2, Some("nonsense".into())).await.unwrap_err();
        assert!(err.message.contains("not a page cursor"), "{err}");

        let id = first["entries"][0]["id"].as_str().unwrap().to_string();
        let message_id = first["entries"][0]["message_id"]
            .as_str()
            .unwrap()
            .to_string();
        let shown = failed(
            driver.clone(),
            Failed::Show {
                queue: "q".into(),
                id: message_id.clone(),
            },
        )
        .await
        .unwrap();
        assert_eq!(shown.json["id"], id.as_str());
        assert!(
            shown.text.contains("reason       permanent failure: n = "),
            "{}",
            shown.text
        );

        let replay = || {
            failed(
                driver.clone(),
                Failed::Replay {
                    queue: "q".into(),
                    id: id.clone(),
                    force: false,
                },
            )
        };
        let replayed = replay().await.unwrap();
        assert_eq!(replayed.json["message_id"], format!("replay-{id}"));
        assert_eq!(memory.ready("q"), 1, "the replay is on the queue");
        let again = replay().await.unwrap_err();
        assert_eq!(again.status, crate::error::NOT_FOUND, "{again}");

        let purge = |id: Option<String>, all: bool| {
            failed(
                driver.clone(),
                Failed::Purge {
                    queue: "q".into(),
                    id,
                    all,
                    older_than: None,
                },
            )
        };
        let err = purge(Some(id.clone()), false).await.unwrap_err();
        assert_eq!(err.status, crate::error::NOT_FOUND, "{err}");
        let purged = purge(None, true).await.unwrap();
        assert_eq!(purged.json["purged"], 2);
        assert_eq!(
            purged.text,
            "purged 2 failure records of queue `q` (every record)\n"
        );
        assert_eq!(list(50, None).await.unwrap().json["total"], 0);

        let depth = depth(driver.clone(), "q").await.unwrap();
        assert_eq!(depth.json["ready"], 1);
    }
}
