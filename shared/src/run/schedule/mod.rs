//! Schedules: recurring jobs declared once and fired exactly once per tick
//! across every scheduler ([`Schedule`], [`ScheduleFiring`],
//! [`SchedulesConfig`]).
//!
//! A [`Schedule`] names a job, a payload (or a function of the tick), a
//! cron expression (seconds optional) read in an IANA time zone, and two
//! policies: [`Missed`] for ticks that came due while no scheduler ran,
//! [`Overlap`] for a tick that comes due while the previous tick's job
//! still runs. Its ticks are computed here, daylight-saving transitions
//! included ([`Schedule::next_after`]).
//!
//! [`ScheduleFiring`] is the one rule every scheduler runs (each native
//! worker's, the edge's Cron Trigger handler): a tick is fired by whoever
//! claims `schedule:<name>:<tick in RFC 3339 UTC>` on the shared
//! [`ClaimStore`](crate::ClaimStore), sent through the caller's `send`, and
//! recorded by completing the claim. No leader: a firer that dies holding a
//! tick leaves it to the others when its lease ends.
//!
//! The guide's chapter
//! [schedules](https://github.com/jobrail/jobrail/blob/main/guide/schedules.md)
//! tells the whole story, limits included.

mod config;
mod fire;
mod spec;
mod ticks;

pub use config::{ScheduleEntry, SchedulesConfig};
pub use fire::{
    FireReport, MissedTicks, ScheduleFiring, TickOutcome, TickReport, DEFAULT_GRACE,
    MAX_PENDING_TICKS, SEND_RETRY, SEND_RETRY_HORIZON,
};
pub use spec::{
    validate_schedule_name, Missed, Overlap, Schedule, ScheduleBuilder, ScheduleError, Tick,
    TickDispatch, DEFAULT_TICK_LEASE, MANUAL_TICK, MAX_MISSED_EACH, MAX_SCHEDULE_NAME_BYTES,
    SCHEDULE_METADATA, TICK_METADATA, TRIGGERED_AT_METADATA,
};

#[cfg(all(test, feature = "memory-claims"))]
mod tests;
