//! HTML: escaping, the page frame, small formatting helpers.

use std::fmt::Write as _;

use crate::auth::User;
use crate::Inner;

/// Text escaped for HTML content and attribute values.
pub(crate) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A query string value, percent-encoded.
pub(crate) fn q(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

/// A query string of pairs (empty values left out).
pub(crate) fn query(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (k, v) in pairs {
        if v.is_empty() {
            continue;
        }
        out.push(if out.is_empty() { '?' } else { '&' });
        let _ = write!(out, "{}={}", q(k), q(v));
    }
    out
}

/// Milliseconds since the epoch as `2026-12-03 14:05:09 UTC`.
pub(crate) fn time_ms(ms: u64) -> String {
    if ms == 0 {
        return "—".into();
    }
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// How long ago, roughly: `42 s`, `5 min`, `3 h`, `2 d`.
pub(crate) fn ago(ms: u64, now_ms: u64) -> String {
    if ms == 0 {
        return String::new();
    }
    let s = now_ms.saturating_sub(ms) / 1000;
    match s {
        0..=59 => format!("{s} s ago"),
        60..=3599 => format!("{} min ago", s / 60),
        3600..=172_799 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86_400),
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Cuts `text` to `max` characters, with an ellipsis.
pub(crate) fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut s: String = text.chars().take(max).collect();
    s.push('…');
    s
}

/// The pages of the navigation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Overview,
    Jobs,
    Failures,
    Schedules,
}

/// A whole page: header, navigation, `body`.
pub(crate) fn page(inner: &Inner, user: &User, nav: Nav, title: &str, body: &str) -> String {
    let base = &inner.base;
    let link = |n: Nav, path: &str, label: &str| {
        format!(
            "<a href=\"{base}{path}\"{}>{label}</a>",
            if n == nav {
                " class=\"active\" aria-current=\"page\""
            } else {
                ""
            }
        )
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>{title} · {brand}</title>\
<link rel=\"icon\" href=\"{base}/assets/favicon.svg\" type=\"image/svg+xml\"><link rel=\"stylesheet\" href=\"{base}/assets/style.css\">\
<script src=\"{base}/assets/app.js\" defer></script></head>\
<body data-role=\"{role}\"><header class=\"top\"><div class=\"brand\"><span class=\"logo\">◆</span> {brand}</div>\
<nav>{o}{j}{f}{s}</nav><div class=\"who\"><span class=\"user\">{user}</span> <span class=\"badge role-{role}\">{role}</span></div></header>\
<main>{body}</main>\
<footer>jobrail-web {version} · {sources} source{plural} · times in UTC</footer></body></html>",
        title = esc(title),
        brand = esc(&inner.title),
        role = user.role.name(),
        user = esc(&user.name),
        o = link(Nav::Overview, "/", "Overview"),
        j = link(Nav::Jobs, "/jobs", "Jobs"),
        f = link(Nav::Failures, "/failures", "Failures"),
        s = link(Nav::Schedules, "/schedules", "Schedules"),
        version = env!("CARGO_PKG_VERSION"),
        sources = inner.sources.len(),
        plural = if inner.sources.len() == 1 { "" } else { "s" },
    )
}

/// An error box.
pub(crate) fn problem(text: &str) -> String {
    format!("<div class=\"problem\" role=\"alert\">{}</div>", esc(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn times_are_civil_utc() {
        assert_eq!(time_ms(0), "—");
        assert_eq!(time_ms(1_000), "1970-01-01 00:00:01 UTC");
        assert_eq!(time_ms(1_796_300_535_000), "2026-12-03 12:22:15 UTC");
        assert_eq!(time_ms(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn queries_leave_empty_values_out() {
        assert_eq!(
            query(&[("a", "1"), ("b", ""), ("c", "x y&z")]),
            "?a=1&c=x+y%26z"
        );
    }
}
