//! The pages and the one mutation route.

use std::fmt::Write as _;
use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Extension;
use jobrail::{failure_budget, human, BreakerState, ClaimState, JobSpec, Tick};

use crate::activity::Totals;
use crate::auth::{csrf_matches, same_origin, Role, User};
use crate::html::{ago, cut, esc, now_ms, page, problem, query, time_ms, Nav};
use crate::source::{kind_name, Entry, Source, KINDS};
use crate::Dashboard;

/// Rows per page of the failures list.
pub(crate) const PAGE_SIZE: usize = 50;

const STYLE: &str = include_str!("../assets/style.css");
const SCRIPT: &str = include_str!("../assets/app.js");
const ICON: &str = include_str!("../assets/favicon.svg");

pub(crate) async fn icon() -> Response {
    ([(header::CONTENT_TYPE, "image/svg+xml")], ICON).into_response()
}

pub(crate) async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

pub(crate) async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        SCRIPT,
    )
        .into_response()
}

fn pairs(raw: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn get<'a>(pairs: &'a [(String, String)], key: &str) -> &'a str {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map_or("", |(_, v)| v.as_str())
}

fn num(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn opt(n: Option<u64>) -> String {
    n.map_or_else(|| "<span class=\"muted\">n/a</span>".to_string(), num)
}

// ---------------------------------------------------------------------------
// Overview

pub(crate) async fn overview(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
) -> Html<String> {
    let inner = d.inner();
    let mut body = String::from("<h1>Overview</h1>");
    // Settlements over the last minutes, per source with counters.
    let windows = [
        (Duration::from_secs(60), "1 min"),
        (Duration::from_secs(300), "5 min"),
        (Duration::from_secs(900), "15 min"),
    ];
    let rates: Vec<Vec<Option<(Totals, Duration)>>> = windows
        .iter()
        .map(|(w, _)| inner.activity.rates(&inner.sources, *w))
        .collect();
    let mut rate_rows = String::new();
    for (i, source) in inner.sources.iter().enumerate() {
        if rates[0][i].is_none() {
            continue;
        }
        for (wi, (_, label)) in windows.iter().enumerate() {
            let Some((t, covered)) = rates[wi][i] else {
                continue;
            };
            let covered_note = if covered + Duration::from_secs(5) < windows[wi].0 {
                format!(
                    " <span class=\"muted\">(the dashboard has run {} s)</span>",
                    covered.as_secs()
                )
            } else {
                String::new()
            };
            let _ = write!(
                rate_rows,
                "<tr><td>{src}</td><td>last {label}{covered_note}</td><td class=\"num ok\">{}</td><td class=\"num warn\">{}</td><td class=\"num bad\">{}</td><td class=\"num bad\">{}</td></tr>",
                num(t.succeeded),
                num(t.retried),
                num(t.failed),
                num(t.rejected),
                src = if wi == 0 { esc(source.name()) } else { String::new() },
            );
        }
    }
    body.push_str("<section class=\"card\"><h2>Settlements</h2>");
    if rate_rows.is_empty() {
        body.push_str("<p class=\"muted\">No source has counters: settlement rates are shown for native sources given a registry (a dashboard mounted in the workers' process).</p>");
    } else {
        let _ = write!(body, "<table class=\"grid\" id=\"rates\"><thead><tr><th>source</th><th>window</th><th class=\"num\">succeeded</th><th class=\"num\">retried</th><th class=\"num\">failed</th><th class=\"num\">rejected</th></tr></thead><tbody>{rate_rows}</tbody></table>");
    }
    body.push_str("</section>");

    // Queues.
    body.push_str("<section class=\"card\"><h2>Queues</h2><table class=\"grid\" id=\"queues\"><thead><tr><th>source</th><th>backend</th><th>queue</th><th class=\"num\">ready</th><th class=\"num\">in flight</th><th class=\"num\">delayed</th><th class=\"num\">failure records</th></tr></thead><tbody>");
    for source in &inner.sources {
        let queues = match source.all_queues().await {
            Ok(q) => q,
            Err(e) => {
                let _ = write!(
                    body,
                    "<tr><td>{}</td><td>{}</td><td colspan=\"5\">{}</td></tr>",
                    esc(source.name()),
                    esc(source.backend()),
                    problem(&e)
                );
                continue;
            }
        };
        if queues.is_empty() {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td colspan=\"5\" class=\"muted\">no queues named, and no failure records</td></tr>",
                esc(source.name()),
                esc(source.backend())
            );
        }
        for queue in queues {
            let depth = source.depth(&queue).await;
            let failures = source.entries(&queue).await.map(|e| e.len());
            let (ready, in_flight, delayed) = match &depth {
                Ok(Some(d)) => (num(d.ready), opt(d.in_flight), opt(d.delayed)),
                Ok(None) => (opt(None), opt(None), opt(None)),
                Err(e) => (
                    format!("<span class=\"bad\" title=\"{}\">error</span>", esc(e)),
                    String::new(),
                    String::new(),
                ),
            };
            let failures = match failures {
                Ok(0) => "<span class=\"muted\">0</span>".to_string(),
                Ok(n) => format!(
                    "<a class=\"bad\" href=\"{}/failures{}\">{}</a>",
                    inner.base,
                    query(&[("source", source.name()), ("queue", &queue)]),
                    num(n as u64)
                ),
                Err(e) => format!("<span class=\"bad\" title=\"{}\">error</span>", esc(&e)),
            };
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td><code>{}</code></td><td class=\"num\">{ready}</td><td class=\"num\">{in_flight}</td><td class=\"num\">{delayed}</td><td class=\"num\">{failures}</td></tr>",
                esc(source.name()),
                esc(source.backend()),
                esc(&queue)
            );
        }
    }
    body.push_str("</tbody></table></section>");

    // Breakers.
    let mut breakers = String::new();
    for source in &inner.sources {
        let mut seen = std::collections::BTreeSet::new();
        for spec in &source.jobs {
            let Some(b) = &spec.breaker else { continue };
            if !seen.insert(b.name().to_string()) {
                continue;
            }
            let jobs: Vec<&str> = source
                .jobs
                .iter()
                .filter(|s| s.breaker.as_ref().is_some_and(|x| x.name() == b.name()))
                .map(|s| s.name.as_str())
                .collect();
            let _ = write!(
                breakers,
                "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                esc(source.name()),
                esc(b.name()),
                breaker_badge(b.state()),
                esc(&jobs.join(", "))
            );
        }
    }
    body.push_str("<section class=\"card\"><h2>Breakers</h2>");
    if breakers.is_empty() {
        body.push_str(
            "<p class=\"muted\">No job of a registered source has a circuit breaker.</p>",
        );
    } else {
        let _ = write!(body, "<table class=\"grid\" id=\"breakers\"><thead><tr><th>source</th><th>breaker</th><th>state</th><th>jobs</th></tr></thead><tbody>{breakers}</tbody></table>");
    }
    body.push_str("</section>");
    Html(page(
        inner,
        &user,
        Nav::Overview,
        "Overview",
        &format!("<div data-refresh=\"10\">{body}</div>"),
    ))
}

fn breaker_badge(state: BreakerState) -> &'static str {
    match state {
        BreakerState::Closed => "<span class=\"badge ok\">closed</span>",
        BreakerState::Open => "<span class=\"badge bad\">open</span>",
        BreakerState::HalfOpen => "<span class=\"badge warn\">half-open</span>",
    }
}

// ---------------------------------------------------------------------------
// Jobs

pub(crate) async fn jobs(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
) -> Html<String> {
    let inner = d.inner();
    let mut body = String::from("<h1>Jobs</h1><p class=\"lede\">Each job's failure budget: N in-process attempts per delivery times M deliveries, and the longest a failing job takes to reach its failure record. Successes by the tier that resolved them: a job that recovers mostly in tier one has a flaky dependency; mostly in tier two, flaky infrastructure.</p>");
    let mut any = false;
    for source in &inner.sources {
        if source.jobs.is_empty() {
            continue;
        }
        any = true;
        let stats = source.stats.as_ref().map(|s| s.snapshot());
        let _ = write!(body, "<section class=\"card\"><h2>{} <span class=\"muted\">{}</span></h2><div class=\"scroll\"><table class=\"grid\" id=\"jobs-{}\"><thead><tr><th>job</th><th>queue</th><th class=\"num\" title=\"in-process attempts per delivery x deliveries\">N × M executions</th><th class=\"num\">worst time</th><th>timeout</th><th>breaker</th><th class=\"num\">succeeded</th><th>resolved by</th><th class=\"num\">retried</th><th class=\"num\">failed</th><th class=\"num\">rejected</th><th class=\"num\">executions</th></tr></thead><tbody>",
            esc(source.name()), esc(source.backend()), esc(source.name()));
        for spec in &source.jobs {
            body.push_str(&job_row(spec, source, stats.as_ref()));
        }
        body.push_str("</tbody></table></div>");
        if stats.is_none() {
            body.push_str("<p class=\"muted\">No counters for this source (its jobs were given without their registry): resolutions are not known here.</p>");
        }
        body.push_str("</section>");
    }
    if !any {
        body.push_str("<section class=\"card\"><p class=\"muted\">No source was given its jobs (Source::registry or Source::jobs).</p></section>");
    }
    Html(page(inner, &user, Nav::Jobs, "Jobs", &body))
}

fn job_row(
    spec: &JobSpec,
    source: &Source,
    stats: Option<&std::collections::BTreeMap<String, jobrail::JobStats>>,
) -> String {
    let b = failure_budget(spec, source.redelivery_hint());
    let s = stats.map(|m| m.get(&spec.name).cloned().unwrap_or_default());
    let cell = |v: Option<u64>| match (v, &s) {
        (Some(v), Some(_)) => num(v),
        _ => "<span class=\"muted\">—</span>".to_string(),
    };
    let resolved = match &s {
        Some(s) if s.succeeded() > 0 => {
            let total = s.succeeded() as f64;
            // Widths in steps of 5% (classes of the stylesheet: no inline
            // style, which the pages' content security policy forbids).
            let pct = |n: u64| ((n as f64 * 20.0 / total).round() as u64) * 5;
            format!(
                "<div class=\"tiers\" title=\"first attempt {a}, tier one {b}, tier two {c}\"><span class=\"t0 w{pa}\"></span><span class=\"t1 w{pb}\"></span><span class=\"t2 w{pc}\"></span></div><div class=\"tier-text\">first {a} · tier one {b} · tier two {c}</div>",
                a = num(s.first_attempt),
                b = num(s.tier_one),
                c = num(s.tier_two),
                pa = pct(s.first_attempt),
                pb = pct(s.tier_one),
                pc = pct(s.tier_two),
            )
        }
        Some(_) => "<span class=\"muted\">no success yet</span>".to_string(),
        None => "<span class=\"muted\">—</span>".to_string(),
    };
    format!(
        "<tr data-job=\"{name}\" data-succeeded=\"{succeeded}\"><td><code>{name}</code></td><td><code>{queue}</code></td><td class=\"num\">{budget}</td><td class=\"num\">{worst}</td><td>{timeout}</td><td>{breaker}</td><td class=\"num\">{ok}</td><td class=\"resolved\">{resolved}</td><td class=\"num\">{retried}</td><td class=\"num\">{failed}</td><td class=\"num\">{rejected}</td><td class=\"num\">{executions}</td></tr>",
        name = esc(&spec.name),
        succeeded = s.as_ref().map_or(0, |s| s.succeeded()),
        ok = cell(s.as_ref().map(|s| s.succeeded())),
        queue = esc(&spec.queue),
        budget = match (b.deliveries, b.executions) {
            (Some(m), Some(nm)) => format!("{} × {m} = {}", b.in_process, num(nm)),
            _ => format!("{} × ∞", b.in_process),
        },
        worst = esc(&human(b.time_to_failure())),
        timeout = spec.timeout.map_or("none".into(), |t| esc(&human(Some(t)))),
        breaker = spec
            .breaker
            .as_ref()
            .map_or("—".into(), |br| format!("<code>{}</code> {}", esc(br.name()), breaker_badge(br.state()))),
        retried = cell(s.as_ref().map(|s| s.retried)),
        failed = cell(s.as_ref().map(|s| s.failed)),
        rejected = cell(s.as_ref().map(|s| s.rejected)),
        executions = cell(s.as_ref().map(|s| s.executions)),
    )
}

// ---------------------------------------------------------------------------
// Failures

/// The filter of the failures list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Filter {
    pub(crate) source: String,
    pub(crate) queue: String,
    pub(crate) job: String,
    pub(crate) kind: String,
    /// `1h`, `24h`, `7d` (failed within), `old` (failed more than 7 days ago) or empty.
    pub(crate) age: String,
    /// Text in the reason (or the id, message id, job), case-insensitive.
    pub(crate) text: String,
}

const AGES: [(&str, &str); 5] = [
    ("", "any age"),
    ("1h", "last hour"),
    ("24h", "last 24 hours"),
    ("7d", "last 7 days"),
    ("old", "older than 7 days"),
];

impl Filter {
    pub(crate) fn from_pairs(p: &[(String, String)]) -> Filter {
        Filter {
            source: get(p, "source").to_string(),
            queue: get(p, "queue").to_string(),
            job: get(p, "job").to_string(),
            kind: get(p, "kind").to_string(),
            age: get(p, "age").to_string(),
            text: get(p, "q").trim().to_string(),
        }
    }

    fn pairs(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("source", self.source.as_str()),
            ("queue", self.queue.as_str()),
            ("job", self.job.as_str()),
            ("kind", self.kind.as_str()),
            ("age", self.age.as_str()),
            ("q", self.text.as_str()),
        ]
    }

    fn narrows(&self) -> bool {
        !(self.job.is_empty()
            && self.kind.is_empty()
            && self.age.is_empty()
            && self.text.is_empty())
    }

    pub(crate) fn matches(&self, e: &Entry, now_ms: u64) -> bool {
        if !self.job.is_empty() && e.job.as_deref() != Some(self.job.as_str()) {
            return false;
        }
        if !self.kind.is_empty() {
            let name = e
                .kind
                .as_ref()
                .map(kind_name)
                .unwrap_or_else(|| "not_a_record".into());
            if name != self.kind {
                return false;
            }
        }
        let hour = 3_600_000u64;
        let within = |ms: u64| e.failed_at_ms > 0 && now_ms.saturating_sub(e.failed_at_ms) <= ms;
        let ok = match self.age.as_str() {
            "1h" => within(hour),
            "24h" => within(24 * hour),
            "7d" => within(7 * 24 * hour),
            "old" => e.failed_at_ms > 0 && now_ms.saturating_sub(e.failed_at_ms) > 7 * 24 * hour,
            _ => true,
        };
        if !ok {
            return false;
        }
        if !self.text.is_empty() {
            let needle = self.text.to_lowercase();
            let hay = [
                e.reason.as_str(),
                e.id.as_str(),
                e.message_id.as_deref().unwrap_or(""),
            ];
            if !hay.iter().any(|h| h.to_lowercase().contains(&needle)) {
                return false;
            }
        }
        true
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.job.is_empty() {
            parts.push(format!("job={}", self.job));
        }
        if !self.kind.is_empty() {
            parts.push(format!("kind={}", self.kind));
        }
        if !self.age.is_empty() {
            parts.push(format!("age={}", self.age));
        }
        if !self.text.is_empty() {
            parts.push(format!("text={:?}", self.text));
        }
        if parts.is_empty() {
            "every record".into()
        } else {
            parts.join(" ")
        }
    }
}

/// The source and queue a filter names (the first of each by default).
async fn resolve<'a>(
    d: &'a Dashboard,
    filter: &mut Filter,
) -> Result<(&'a Source, Vec<String>), String> {
    let inner = d.inner();
    let source = if filter.source.is_empty() {
        &inner.sources[0]
    } else {
        inner
            .sources
            .iter()
            .find(|s| s.name() == filter.source)
            .ok_or_else(|| format!("no source named `{}`", filter.source))?
    };
    filter.source = source.name().to_string();
    let queues = source.all_queues().await?;
    if filter.queue.is_empty() {
        filter.queue = queues.first().cloned().unwrap_or_default();
    }
    Ok((source, queues))
}

/// The entries the filter selects, newest first.
pub(crate) async fn matching(
    source: &Source,
    filter: &Filter,
) -> Result<(Vec<Entry>, usize), String> {
    let mut entries = source.entries(&filter.queue).await?;
    let total = entries.len();
    let now = now_ms();
    entries.retain(|e| filter.matches(e, now));
    entries.sort_by(|a, b| (b.failed_at_ms, &b.id).cmp(&(a.failed_at_ms, &a.id)));
    Ok((entries, total))
}

fn select(name: &str, label: &str, options: &[(String, String)], chosen: &str) -> String {
    let mut s = format!("<label>{label} <select name=\"{name}\">");
    for (value, text) in options {
        let _ = write!(
            s,
            "<option value=\"{}\"{}>{}</option>",
            esc(value),
            if value == chosen { " selected" } else { "" },
            esc(text)
        );
    }
    s.push_str("</select></label>");
    s
}

fn hidden(name: &str, value: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
        esc(name),
        esc(value)
    )
}

fn hidden_filter(filter: &Filter) -> String {
    filter.pairs().iter().map(|(k, v)| hidden(k, v)).collect()
}

fn kind_badge(e: &Entry) -> String {
    match &e.kind {
        Some(k) => {
            let name = kind_name(k);
            let class = match name.as_str() {
                "attempts_exhausted" => "warn",
                _ => "bad",
            };
            format!(
                "<span class=\"badge {class}\">{}</span>",
                esc(&name.replace('_', " "))
            )
        }
        None => "<span class=\"badge bad\">not a record</span>".into(),
    }
}

pub(crate) async fn failures(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
    RawQuery(raw): RawQuery,
) -> Html<String> {
    let inner = d.inner();
    let p = pairs(raw.as_deref());
    let mut filter = Filter::from_pairs(&p);
    let page_no: usize = get(&p, "page").parse().unwrap_or(1).max(1);
    let notice = get(&p, "notice").to_string();
    let mut body = String::from("<h1>Failure records</h1>");
    if !notice.is_empty() {
        let _ = write!(
            body,
            "<div class=\"notice\" role=\"status\" id=\"notice\">{}</div>",
            esc(&notice)
        );
    }
    let (source, queues) = match resolve(&d, &mut filter).await {
        Ok(x) => x,
        Err(e) => {
            body.push_str(&problem(&e));
            return Html(page(inner, &user, Nav::Failures, "Failures", &body));
        }
    };
    let (entries, total) = match matching(source, &filter).await {
        Ok(x) => x,
        Err(e) => {
            body.push_str(&problem(&e));
            (Vec::new(), 0)
        }
    };
    // The filter form.
    let sources: Vec<(String, String)> = inner
        .sources
        .iter()
        .map(|s| {
            (
                s.name().to_string(),
                format!("{} ({})", s.name(), s.backend()),
            )
        })
        .collect();
    let mut queue_options: Vec<(String, String)> =
        queues.iter().map(|q| (q.clone(), q.clone())).collect();
    if !queues.contains(&filter.queue) {
        queue_options.push((filter.queue.clone(), filter.queue.clone()));
    }
    let mut jobs: Vec<String> = source.jobs.iter().map(|j| j.name.clone()).collect();
    for e in &entries {
        if let Some(j) = &e.job {
            if !jobs.contains(j) {
                jobs.push(j.clone());
            }
        }
    }
    if !filter.job.is_empty() && !jobs.contains(&filter.job) {
        jobs.push(filter.job.clone());
    }
    let mut job_options = vec![(String::new(), "any job".to_string())];
    job_options.extend(jobs.iter().map(|j| (j.clone(), j.clone())));
    let mut kind_options = vec![(String::new(), "any kind".to_string())];
    kind_options.extend(KINDS.iter().map(|k| {
        let n = kind_name(k);
        (n.clone(), n.replace('_', " "))
    }));
    kind_options.push(("not_a_record".into(), "not a record".into()));
    let age_options: Vec<(String, String)> = AGES
        .iter()
        .map(|(v, t)| (v.to_string(), t.to_string()))
        .collect();
    let _ = write!(
        body,
        "<form class=\"filters card\" method=\"get\" action=\"{base}/failures\" id=\"filters\">{}{}{}{}{}<label>text <input type=\"search\" name=\"q\" value=\"{}\" placeholder=\"in the reason or id\"></label><button type=\"submit\">Filter</button> <a class=\"button quiet\" href=\"{base}/failures{}\">Clear</a></form>",
        select("source", "source", &sources, &filter.source),
        select("queue", "queue", &queue_options, &filter.queue),
        select("job", "job", &job_options, &filter.job),
        select("kind", "kind", &kind_options, &filter.kind),
        select("age", "age", &age_options, &filter.age),
        esc(&filter.text),
        query(&[("source", &filter.source), ("queue", &filter.queue)]),
        base = inner.base,
    );
    let matched = entries.len();
    let pages = matched.div_ceil(PAGE_SIZE).max(1);
    let page_no = page_no.min(pages);
    let shown = &entries[(page_no - 1) * PAGE_SIZE..(page_no * PAGE_SIZE).min(matched)];
    let operator = user.role == Role::Operator;
    let _ = write!(
        body,
        "<p class=\"summary\" id=\"summary\"><strong id=\"matched\">{}</strong> of {} record{} on <code>{}</code> / <code>{}</code>{}</p>",
        num(matched as u64),
        num(total as u64),
        if total == 1 { "" } else { "s" },
        esc(&filter.source),
        esc(&filter.queue),
        if filter.narrows() { format!(" match {}", esc(&filter.describe())) } else { String::new() }
    );
    if operator {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}/failures/action\" data-mutation id=\"bulk\">{}{}",
            inner.base,
            hidden("csrf", &user.csrf),
            hidden_filter(&filter)
        );
    }
    let now = now_ms();
    let _ = write!(
        body,
        "<div class=\"scroll\"><table class=\"grid failures\" id=\"records\"><thead><tr>{}<th>failed</th><th>job</th><th>kind</th><th>reason</th><th class=\"num\">delivery</th><th class=\"num\">runs</th><th>id</th></tr></thead><tbody>",
        if operator { "<th class=\"check\"><input type=\"checkbox\" data-select-all aria-label=\"select every row of this page\"></th>" } else { "" }
    );
    if shown.is_empty() {
        let _ = write!(
            body,
            "<tr><td colspan=\"8\" class=\"empty\">No failure records{}.</td></tr>",
            if filter.narrows() {
                " match this filter"
            } else {
                ""
            }
        );
    }
    for e in shown {
        let link = format!(
            "{}/failures/record{}",
            inner.base,
            query(&[
                ("source", &filter.source),
                ("queue", &filter.queue),
                ("id", &e.id)
            ])
        );
        let _ = write!(
            body,
            "<tr data-id=\"{id}\">{check}<td title=\"{at}\">{ago}</td><td>{job}</td><td>{kind}</td><td class=\"reason\">{reason}{poison}</td><td class=\"num\">{attempt}</td><td class=\"num\">{runs}</td><td><a href=\"{link}\"><code>{short}</code></a></td></tr>",
            id = esc(&e.id),
            check = if operator { format!("<td class=\"check\"><input type=\"checkbox\" name=\"id\" value=\"{}\" aria-label=\"select {}\"></td>", esc(&e.id), esc(&e.id)) } else { String::new() },
            at = time_ms(e.failed_at_ms),
            ago = if e.failed_at_ms == 0 { "—".into() } else { ago(e.failed_at_ms, now) },
            job = e.job.as_deref().map_or("<span class=\"muted\">?</span>".into(), |j| format!("<code>{}</code>", esc(j))),
            kind = kind_badge(e),
            reason = esc(&cut(&e.reason, 160)),
            poison = if e.poison.is_some() { " <span class=\"badge bad\" title=\"replay refused unless forced\">poison</span>" } else { "" },
            attempt = e.attempt,
            runs = e.executions,
            short = esc(&cut(&e.id, 14)),
        );
    }
    body.push_str("</tbody></table></div>");
    if operator {
        let _ = write!(
            body,
            "<div class=\"actions\"><span class=\"muted\">Selected rows:</span> <button name=\"do\" value=\"replay-selected\">Replay selected</button> <button name=\"do\" value=\"purge-selected\" class=\"danger\">Purge selected</button> <span class=\"sep\"></span> <span class=\"muted\">Every record matching the filter ({n}):</span> <button name=\"do\" value=\"replay-matching\"{dis}>Replay all {n}</button> <button name=\"do\" value=\"purge-matching\" class=\"danger\"{dis}>Purge all {n}</button></div></form>",
            n = num(matched as u64),
            dis = if matched == 0 { " disabled" } else { "" }
        );
    }
    // Pages.
    if pages > 1 {
        body.push_str("<nav class=\"pages\" aria-label=\"pages\">");
        let numbers: Vec<String> = (0..=pages).map(|n| n.to_string()).collect();
        for (n, n_text) in numbers.iter().enumerate().skip(1) {
            if pages > 12 && n > 2 && n + 2 < pages && n.abs_diff(page_no) > 2 {
                if n == 3 || n + 3 == pages {
                    body.push_str("<span>…</span>");
                }
                continue;
            }
            let mut link_pairs = filter.pairs();
            link_pairs.push(("page", n_text));
            let _ = write!(
                body,
                "<a href=\"{}/failures{}\"{}>{n}</a>",
                inner.base,
                query(&link_pairs),
                if n == page_no {
                    " class=\"active\" aria-current=\"page\""
                } else {
                    ""
                }
            );
        }
        body.push_str("</nav>");
    }
    Html(page(inner, &user, Nav::Failures, "Failures", &body))
}

pub(crate) async fn record(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
    RawQuery(raw): RawQuery,
) -> Response {
    let inner = d.inner();
    let p = pairs(raw.as_deref());
    let mut filter = Filter::from_pairs(&p);
    let id = get(&p, "id").to_string();
    let mut body = String::new();
    let failed = |status: StatusCode, body: &str| {
        (
            status,
            Html(page(inner, &user, Nav::Failures, "Record", body)),
        )
            .into_response()
    };
    let (source, _) = match resolve(&d, &mut filter).await {
        Ok(x) => x,
        Err(e) => return failed(StatusCode::NOT_FOUND, &problem(&e)),
    };
    let entries = match source.entries(&filter.queue).await {
        Ok(e) => e,
        Err(e) => return failed(StatusCode::BAD_GATEWAY, &problem(&e)),
    };
    let back = format!(
        "{}/failures{}",
        inner.base,
        query(&[("source", &filter.source), ("queue", &filter.queue)])
    );
    let Some(e) = entries
        .into_iter()
        .find(|e| e.id == id || e.message_id.as_deref() == Some(id.as_str()))
    else {
        let _ = write!(
            body,
            "<h1>Record not found</h1>{}<p><a href=\"{back}\">Back to the list</a></p>",
            problem(&format!(
                "no failure record `{id}` on {} / {} (replayed or purged meanwhile?)",
                filter.source, filter.queue
            ))
        );
        return failed(StatusCode::NOT_FOUND, &body);
    };
    let _ = write!(
        body,
        "<p class=\"crumbs\"><a href=\"{back}\">← {} / {}</a></p><h1>Record <code>{}</code></h1>",
        esc(&filter.source),
        esc(&filter.queue),
        esc(&cut(&e.id, 40))
    );
    if let Some(reason) = &e.poison {
        let _ = write!(body, "<div class=\"problem\">Poison: {}. A replay would not run the job again; a forced replay sends the stored body as it is.</div>", esc(reason));
    }
    let mut rows = vec![
        ("entry id", format!("<code>{}</code>", esc(&e.id))),
        (
            "message id",
            e.message_id
                .as_deref()
                .map_or("—".into(), |m| format!("<code>{}</code>", esc(m))),
        ),
        ("queue", format!("<code>{}</code>", esc(&e.queue))),
        (
            "job",
            e.job
                .as_deref()
                .map_or("—".into(), |j| format!("<code>{}</code>", esc(j))),
        ),
        ("kind", kind_badge(&e)),
        (
            "reason",
            format!("<span class=\"reason\">{}</span>", esc(&e.reason)),
        ),
        (
            "failed at",
            format!(
                "{} <span class=\"muted\">{}</span>",
                time_ms(e.failed_at_ms),
                ago(e.failed_at_ms, now_ms())
            ),
        ),
        ("delivery", e.attempt.to_string()),
        ("executions in it", e.executions.to_string()),
    ];
    if let Some(r) = &e.record {
        if let Some(t) = &r.truncated {
            rows.push((
                "truncated",
                format!(
                    "the body was {} bytes (sha256 {}); {} kept",
                    num(t.body_bytes),
                    esc(&t.body_sha256),
                    num(t.kept_bytes)
                ),
            ));
        }
        if let Some(env) = &r.envelope {
            if !env.metadata.is_empty() {
                let meta: Vec<String> = env
                    .metadata
                    .iter()
                    .map(|(k, v)| format!("<code>{}</code> = <code>{}</code>", esc(k), esc(v)))
                    .collect();
                rows.push(("metadata", meta.join("<br>")));
            }
        }
    }
    body.push_str("<section class=\"card\"><table class=\"fields\" id=\"fields\"><tbody>");
    for (k, v) in rows {
        let _ = write!(body, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    body.push_str("</tbody></table></section>");
    body.push_str("<section class=\"card\"><h2>Payload</h2>");
    if inner.show_payloads {
        let payload = e
            .record
            .as_ref()
            .and_then(|r| r.envelope.as_ref())
            .map(|env| serde_json::to_string_pretty(&env.payload).unwrap_or_default())
            .or_else(|| {
                e.record
                    .as_ref()
                    .and_then(|r| r.raw_body.as_ref())
                    .map(|b| serde_json::to_string_pretty(b).unwrap_or_default())
            })
            .or(e.body_text.clone())
            .unwrap_or_else(|| "(none)".into());
        let _ = write!(
            body,
            "<pre class=\"payload\" id=\"payload\">{}</pre>",
            esc(&payload)
        );
    } else {
        body.push_str("<p class=\"muted\" id=\"payload-hidden\">Hidden: payloads may hold personal data or secrets. The dashboard shows them only when it was built with <code>show_payloads(true)</code> (<code>jobrail serve --show-payloads</code>).</p>");
    }
    body.push_str("</section>");
    if user.role == Role::Operator {
        let form = |what: &str, label: &str, class: &str, extra: &str| {
            format!(
                "<form method=\"post\" action=\"{}/failures/action\" data-mutation class=\"inline\">{}{}{}{}<button name=\"do\" value=\"{what}\" class=\"{class}\">{label}</button></form>",
                inner.base,
                hidden("csrf", &user.csrf),
                hidden_filter(&Filter { source: filter.source.clone(), queue: filter.queue.clone(), ..Filter::default() }),
                hidden("id", &e.id),
                extra
            )
        };
        body.push_str("<div class=\"actions\">");
        body.push_str(&form("replay-selected", "Replay", "", ""));
        if e.poison.is_some() {
            body.push_str(&form(
                "replay-selected",
                "Force replay",
                "danger",
                &hidden("force", "1"),
            ));
        }
        body.push_str(&form("purge-selected", "Purge", "danger", ""));
        body.push_str("</div>");
    }
    Html(page(inner, &user, Nav::Failures, "Record", &body)).into_response()
}

/// `POST /failures/action`: a replay or purge, first confirmed, then done.
pub(crate) async fn action(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let inner = d.inner();
    let p = pairs(Some(&body));
    let what = get(&p, "do").to_string();
    let refuse = |status: StatusCode, why: &str| {
        tracing::warn!(
            target: "jobrail_web::audit",
            user = %user.name,
            role = %user.role,
            action = %what,
            refused = why,
            "dashboard mutation refused"
        );
        let html = page(
            inner,
            &user,
            Nav::Failures,
            "Refused",
            &format!("<h1>Refused</h1>{}", problem(why)),
        );
        (status, Html(html)).into_response()
    };
    if user.role != Role::Operator {
        return refuse(
            StatusCode::FORBIDDEN,
            "the read-only role cannot replay or purge",
        );
    }
    if !csrf_matches(&user, get(&p, "csrf")) {
        return refuse(
            StatusCode::FORBIDDEN,
            "the form's CSRF token is missing or wrong: reload the page and try again",
        );
    }
    if !same_origin(&headers) {
        return refuse(StatusCode::FORBIDDEN, "the request came from another site");
    }
    let (replay, matching_scope) = match what.as_str() {
        "replay-selected" => (true, false),
        "purge-selected" => (false, false),
        "replay-matching" => (true, true),
        "purge-matching" => (false, true),
        _ => return refuse(StatusCode::BAD_REQUEST, "unknown action"),
    };
    let force = get(&p, "force") == "1";
    let mut filter = Filter::from_pairs(&p);
    let (source, _) = match resolve(&d, &mut filter).await {
        Ok(x) => x,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, &e),
    };
    let confirmed = get(&p, "confirm") == "yes";
    // Every record matching, confirmed, on a store that replays in one
    // pass: no separate read for the ids.
    if matching_scope && replay && confirmed {
        let started = std::time::Instant::now();
        if let Some(result) = source.replay_matching(&filter, force).await {
            let scope = format!("every record matching {}", filter.describe());
            let (asked, result) = match result {
                Ok((done, matched)) => (matched, Ok(done)),
                Err(e) => (0, Err(e)),
            };
            return finish(
                &d, &user, &filter, true, force, &scope, asked, started, result,
            );
        }
    }
    let ids: Vec<String> = if matching_scope {
        match matching(source, &filter).await {
            Ok((entries, _)) => entries.into_iter().map(|e| e.id).collect(),
            Err(e) => return refuse(StatusCode::BAD_GATEWAY, &e),
        }
    } else {
        let mut ids: Vec<String> = p
            .iter()
            .filter(|(k, _)| k == "id")
            .map(|(_, v)| v.clone())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    };
    let verb = if replay {
        if force {
            "Force-replay"
        } else {
            "Replay"
        }
    } else {
        "Purge"
    };
    let scope = if matching_scope {
        format!("every record matching {}", filter.describe())
    } else {
        "the selected records".to_string()
    };
    let back = format!("{}/failures{}", inner.base, query(&filter.pairs()));
    if ids.is_empty() {
        let html = page(inner, &user, Nav::Failures, "Nothing selected", &format!("<h1>Nothing to do</h1><p>No record was selected (or none matches now).</p><p><a class=\"button\" href=\"{back}\">Back to the list</a></p>"));
        return (StatusCode::BAD_REQUEST, Html(html)).into_response();
    }
    if !confirmed {
        // The confirmation: the same fields, and confirm=yes.
        let mut fields = String::new();
        fields.push_str(&hidden("csrf", &user.csrf));
        fields.push_str(&hidden("do", &what));
        fields.push_str(&hidden("confirm", "yes"));
        if force {
            fields.push_str(&hidden("force", "1"));
        }
        fields.push_str(&hidden_filter(&filter));
        if !matching_scope {
            for id in &ids {
                fields.push_str(&hidden("id", id));
            }
        }
        let listed: String = ids
            .iter()
            .take(10)
            .map(|id| format!("<li><code>{}</code></li>", esc(id)))
            .collect();
        let more = if ids.len() > 10 {
            format!(
                "<li class=\"muted\">and {} more</li>",
                num(ids.len() as u64 - 10)
            )
        } else {
            String::new()
        };
        let consequence = if replay {
            "Each record's job is sent to its queue again as a new message (its attempts counted afresh), then the record is removed. A record whose send fails stays."
        } else {
            "The records are deleted for good: their jobs will not run."
        };
        let html = format!(
            "<h1>{verb} {n} record{s}?</h1><section class=\"card confirm\" id=\"confirm\"><p>{verb} <strong>{n}</strong> record{s} of <code>{src}</code> / <code>{queue}</code>: {scope}{when}.</p><p>{consequence}</p><ul class=\"ids\">{listed}{more}</ul><form method=\"post\" action=\"{base}/failures/action\" data-mutation>{fields}<button type=\"submit\" class=\"{class}\" id=\"confirm-button\">{verb} {n} record{s}</button> <a class=\"button quiet\" href=\"{back}\">Cancel</a></form></section>",
            n = num(ids.len() as u64),
            s = if ids.len() == 1 { "" } else { "s" },
            src = esc(&filter.source),
            queue = esc(&filter.queue),
            scope = esc(&scope),
            when = if matching_scope { " (as they match when you confirm)" } else { "" },
            class = if replay { "primary" } else { "danger" },
            base = inner.base,
        );
        return Html(page(inner, &user, Nav::Failures, "Confirm", &html)).into_response();
    }
    let started = std::time::Instant::now();
    let result = if replay {
        source.replay(&filter.queue, &ids, force).await
    } else {
        source.purge(&filter.queue, &ids).await
    };
    finish(
        &d,
        &user,
        &filter,
        replay,
        force,
        &scope,
        ids.len(),
        started,
        result,
    )
}

/// Logs a mutation's audit line and sends the operator back to the list
/// with what it did.
#[allow(clippy::too_many_arguments)]
fn finish(
    d: &Dashboard,
    user: &User,
    filter: &Filter,
    replay: bool,
    force: bool,
    scope: &str,
    asked: usize,
    started: std::time::Instant,
    result: Result<crate::source::Mutated, String>,
) -> Response {
    let inner = d.inner();
    let verb = if replay {
        if force {
            "Force-replay"
        } else {
            "Replay"
        }
    } else {
        "Purge"
    };
    let notice = match &result {
        Ok(done) => {
            tracing::info!(
                target: "jobrail_web::audit",
                user = %user.name,
                role = %user.role,
                action = if replay { "replay" } else { "purge" },
                force,
                source = %filter.source,
                queue = %filter.queue,
                scope = %scope,
                asked,
                done = done.done,
                refused = done.refused,
                failed = done.failed,
                millis = started.elapsed().as_millis() as u64,
                "dashboard mutation"
            );
            let mut text = format!(
                "{} {} of {} record{}",
                if replay { "Replayed" } else { "Purged" },
                done.done,
                asked,
                if asked == 1 { "" } else { "s" }
            );
            if done.refused > 0 {
                let _ = write!(
                    text,
                    "; {} refused as poison (force to send them as they are)",
                    done.refused
                );
            }
            if done.failed > 0 {
                let _ = write!(text, "; {} failed and stay", done.failed);
            }
            if let Some(problem) = &done.first_problem {
                let _ = write!(text, " ({})", cut(problem, 200));
            }
            text
        }
        Err(e) => {
            tracing::warn!(
                target: "jobrail_web::audit",
                user = %user.name,
                role = %user.role,
                action = if replay { "replay" } else { "purge" },
                source = %filter.source,
                queue = %filter.queue,
                scope = %scope,
                asked,
                error = %e,
                "dashboard mutation failed"
            );
            format!("{} failed: {}", verb, cut(e, 300))
        }
    };
    let mut back_pairs = filter.pairs();
    back_pairs.push(("notice", &notice));
    Redirect::to(&format!("{}/failures{}", inner.base, query(&back_pairs))).into_response()
}

// ---------------------------------------------------------------------------
// Schedules

pub(crate) async fn schedules(
    State(d): State<Dashboard>,
    Extension(user): Extension<User>,
) -> Html<String> {
    let inner = d.inner();
    let mut body = String::from("<h1>Schedules</h1>");
    let now = std::time::SystemTime::now();
    let mut any = false;
    for source in &inner.sources {
        if source.schedules.is_empty() {
            continue;
        }
        any = true;
        let _ = write!(body, "<section class=\"card\"><h2>{} <span class=\"muted\">{}</span></h2><div class=\"scroll\"><table class=\"grid\" id=\"schedules-{}\"><thead><tr><th>schedule</th><th>job → queue</th><th>cron</th><th>zone</th><th>missed</th><th>overlap</th><th>next ticks</th><th>latest due ticks</th></tr></thead><tbody>",
            esc(source.name()), esc(source.backend()), esc(source.name()));
        for s in &source.schedules {
            let next: Vec<String> = s
                .ticks_after(now)
                .take(3)
                .map(|t| esc(&t.to_string()))
                .collect();
            let mut latest = Vec::new();
            for tick in s.last_ticks(now, 3).into_iter().rev() {
                let state = match (&source.claims, s.tick_key(&tick)) {
                    (Some(claims), Some(key)) => match claims.state(&key).await {
                        Ok(ClaimState::Done) => "<span class=\"badge ok\">fired</span>".to_string(),
                        Ok(ClaimState::Held { .. }) => {
                            "<span class=\"badge warn\">firing</span>".to_string()
                        }
                        Ok(ClaimState::Free) => {
                            "<span class=\"badge bad\">not fired</span>".to_string()
                        }
                        Err(e) => format!(
                            "<span class=\"bad\" title=\"{}\">unknown</span>",
                            esc(&e.to_string())
                        ),
                    },
                    _ => "<span class=\"muted\">no claim store given</span>".to_string(),
                };
                latest.push(format!("{} {state}", esc(&tick_text(&tick))));
            }
            let _ = write!(
                body,
                "<tr><td><code>{}</code>{}</td><td><code>{}</code> → <code>{}</code></td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td class=\"ticks\">{}</td><td class=\"ticks\">{}</td></tr>",
                esc(s.name()),
                if s.enabled() { "" } else { " <span class=\"badge warn\">disabled</span>" },
                esc(s.job()),
                esc(s.queue()),
                esc(s.cron()),
                esc(s.time_zone()),
                esc(&s.missed().to_string()),
                esc(&s.overlap().to_string()),
                if next.is_empty() { "none".into() } else { next.join("<br>") },
                if latest.is_empty() { "none".into() } else { latest.join("<br>") },
            );
        }
        body.push_str("</tbody></table></div></section>");
    }
    if !any {
        body.push_str("<section class=\"card\"><p class=\"muted\">No source was given schedules (Source::schedules).</p></section>");
    }
    let _ = write!(body, "<section class=\"card\"><h2>Delayed jobs</h2><p>Jobs dispatched for later wait in their queue's <em>delayed</em> count on the <a href=\"{}/\">overview</a>, where the backend reports it.</p></section>", inner.base);
    Html(page(inner, &user, Nav::Schedules, "Schedules", &body))
}

fn tick_text(tick: &Tick) -> String {
    tick.to_string()
}
