//! When a schedule's ticks come due: its cron expression read in its time
//! zone, daylight-saving transitions included.

use chrono::{DateTime, TimeZone};
use chrono_tz::Tz;

use super::spec::{unix_seconds, utc, Schedule, Tick};
use crate::model::runtime::SystemTime;

impl Schedule {
    fn local(&self, unix: i64) -> DateTime<Tz> {
        self.zone().from_utc_datetime(&utc(unix).naive_utc())
    }

    /// The first tick strictly after `time`, or `None` if the expression
    /// has no more (a year field in the past, a date that never comes).
    ///
    /// Ticks are whole seconds. The rules at daylight-saving transitions:
    ///
    /// - A local time skipped when the clocks go forward: a *fixed-time*
    ///   expression (a single second, minute and hour, `0 30 2 * * *`) fires
    ///   once, at the first instant after the gap (03:00 local on the day
    ///   Paris skips 02:00 to 03:00); an *interval* expression (a wildcard,
    ///   range, list or step in the second, minute or hour field,
    ///   `*/15 * * * *`) has no tick in the gap: its ticks there do not
    ///   exist.
    /// - A local time repeated when the clocks go back: a fixed-time
    ///   expression fires once, at the first occurrence; an interval
    ///   expression fires in both occurrences (02:00, 02:15 ... 02:45 twice
    ///   in Paris, an hour apart).
    pub fn next_after(&self, time: SystemTime) -> Option<Tick> {
        self.next_after_unix(unix_seconds(time))
    }

    pub(super) fn next_after_unix(&self, unix: i64) -> Option<Tick> {
        let from = self.local(unix);
        let next = self
            .cron_pattern()
            .find_next_occurrence(&from, false)
            .ok()?;
        Some(Tick::from_unix_seconds(next.timestamp()))
    }

    /// The last tick at or before `time` (same rules as
    /// [`next_after`](Schedule::next_after)), or `None` if there is none
    /// since year 1.
    pub fn latest_at_or_before(&self, time: SystemTime) -> Option<Tick> {
        self.latest_at_or_before_unix(unix_seconds(time))
    }

    pub(super) fn latest_at_or_before_unix(&self, unix: i64) -> Option<Tick> {
        // A backward search is not always the mirror of the forward one at
        // transitions, so its answer is checked against the forward rules:
        // the forward search from just before it finds the real tick there,
        // then walks on to the last one at or before `unix`.
        let mut probe = unix;
        for _ in 0..8 {
            let candidate = self
                .cron_pattern()
                .find_previous_occurrence(&self.local(probe), true)
                .ok()?
                .timestamp();
            let first = self.next_after_unix(candidate - 1)?;
            if first.unix_seconds() <= unix {
                let mut tick = first;
                while let Some(next) = self.next_after_unix(tick.unix_seconds()) {
                    if next.unix_seconds() > unix {
                        break;
                    }
                    tick = next;
                }
                return Some(tick);
            }
            probe = candidate - 1;
        }
        None
    }

    /// The ticks strictly after `time`, in order (an endless iterator for
    /// most expressions: bound it with `take` or `take_while`).
    pub fn ticks_after(&self, time: SystemTime) -> impl Iterator<Item = Tick> + '_ {
        let mut at = unix_seconds(time);
        std::iter::from_fn(move || {
            let next = self.next_after_unix(at)?;
            at = next.unix_seconds();
            Some(next)
        })
    }

    /// The ticks in `(after, until]`, in order.
    pub fn ticks_between(&self, after: SystemTime, until: SystemTime) -> Vec<Tick> {
        let until = unix_seconds(until);
        self.ticks_after(after)
            .take_while(|t| t.unix_seconds() <= until)
            .collect()
    }

    /// The last `n` ticks at or before `time`, oldest first.
    pub fn last_ticks(&self, time: SystemTime, n: usize) -> Vec<Tick> {
        let mut ticks = Vec::with_capacity(n);
        let mut at = unix_seconds(time);
        while ticks.len() < n {
            let Some(t) = self.latest_at_or_before_unix(at) else {
                break;
            };
            ticks.push(t);
            at = t.unix_seconds() - 1;
        }
        ticks.reverse();
        ticks
    }
}
