//! The rule that fires a schedule's due ticks exactly once across every
//! scheduler sharing a claim store ([`ScheduleFiring`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use super::spec::{unix_seconds, Missed, Schedule, Tick, TickDispatch};
use crate::model::runtime::SystemTime;
use crate::run::claim::{Claim, ClaimError, ClaimState, ClaimStore, MIN_HELD_RETRY};
use crate::run::schedule::spec::ScheduleError;

/// How late a tick may be and still count as one a scheduler saw come due
/// when it starts: 1 s ([`ScheduleFiring::grace`]). A scheduler restarted
/// within a second of a tick still fires it under [`Missed::Skip`].
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);

/// On a first deploy, the first firer marks as fired the ticks of the last
/// minute before it started (and the policy's reach before that), so that
/// firers started a little later, with a grace of up to a minute, never fire
/// a tick from before the schedule was first seen.
const FIRST_SEEN_GRACE: Duration = Duration::from_secs(60);

/// After a send that certainly failed, the tick is tried again this much
/// later: 1 s.
pub const SEND_RETRY: Duration = Duration::from_secs(1);

/// A tick whose send keeps failing is given up once it is this old: 24 h.
pub const SEND_RETRY_HORIZON: Duration = Duration::from_secs(24 * 3600);

/// How many ticks a scheduler retries at once at most (held by another
/// firer, or whose send failed): 1,000; beyond, the oldest are given up.
pub const MAX_PENDING_TICKS: usize = 1000;

/// What happened to one tick in a pass of [`ScheduleFiring::fire_due`].
#[derive(Debug)]
#[non_exhaustive]
pub enum TickOutcome<T, E> {
    /// This firer claimed the tick, sent its job (`sent` is what `send`
    /// returned) and recorded it as fired. `taken_over`: the tick had been
    /// claimed before (a firer that died holding it, or gave it back after
    /// a failed send).
    Fired {
        /// What `send` returned (a message id).
        sent: T,
        /// Whether an earlier claim of the tick existed.
        taken_over: bool,
    },
    /// The job was sent but the completion was not recorded (the lease
    /// ended first, or the store failed): another firer may send it again
    /// once the lease ends.
    FiredUnrecorded {
        /// What `send` returned.
        sent: T,
        /// Why the completion failed.
        error: ClaimError,
    },
    /// Another firer fired it already.
    AlreadyFired,
    /// Another firer holds it for `remaining` more: this firer tries again
    /// then, and fires it itself if the holder died.
    Held {
        /// Until the holder's lease ends.
        remaining: Duration,
    },
    /// Marked as fired without sending, because it came due before the
    /// schedule was first seen by any scheduler (first deploy).
    SkippedBeforeFirstSeen,
    /// The send failed. `released`: it certainly did not go out and the
    /// claim was given back (tried again after [`SEND_RETRY`]); otherwise
    /// the claim is kept until its lease ends, and the tick is sent again
    /// then (by this firer or another).
    SendFailed {
        /// The send's error.
        error: E,
        /// Whether the claim was given back.
        released: bool,
    },
    /// The payload could not be made (a payload function's serialization
    /// failed): the claim was given back and the tick is not retried.
    Payload(ScheduleError),
    /// The claim store failed: the tick is tried again after
    /// [`SEND_RETRY`].
    Store(ClaimError),
    /// Given up: it was still held, or kept failing, when it became older
    /// than [`SEND_RETRY_HORIZON`], or more than [`MAX_PENDING_TICKS`]
    /// were pending.
    GivenUp,
}

/// One tick and what happened to it.
#[derive(Debug)]
pub struct TickReport<T, E> {
    /// The tick.
    pub tick: Tick,
    /// What happened.
    pub outcome: TickOutcome<T, E>,
}

/// Ticks found missed in a pass (due while no scheduler watched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissedTicks {
    /// The latest missed tick.
    pub latest: Tick,
    /// How many of them the policy selected to fire (the others are
    /// skipped).
    pub selected: usize,
}

/// What one pass of [`ScheduleFiring::fire_due`] did.
#[derive(Debug)]
pub struct FireReport<T, E> {
    /// Each tick looked at, in order.
    pub ticks: Vec<TickReport<T, E>>,
    /// Ticks found missed, if any.
    pub missed: Option<MissedTicks>,
    /// This firer was the first to see the schedule (it recorded
    /// `schedule:<name>:known`): earlier ticks will never fire.
    pub first_seen: bool,
    /// The claim store failed while reading or recording whether the
    /// schedule was seen before (`schedule:<name>:known`): ticks before
    /// this firer started are not fired until it answers.
    pub known_error: Option<ClaimError>,
    /// When the next pass is needed: the next tick, or the earliest
    /// retry. `None`: never (a disabled schedule, or no more ticks).
    pub next_wake: Option<SystemTime>,
}

impl<T, E> FireReport<T, E> {
    fn new() -> Self {
        FireReport {
            ticks: Vec::new(),
            missed: None,
            first_seen: false,
            known_error: None,
            next_wake: None,
        }
    }

    /// How many ticks this pass sent.
    pub fn sent(&self) -> usize {
        self.ticks
            .iter()
            .filter(|t| {
                matches!(
                    t.outcome,
                    TickOutcome::Fired { .. } | TickOutcome::FiredUnrecorded { .. }
                )
            })
            .count()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Not asked yet, or the store did not answer / another firer is
    /// recording it: ticks up to `since` never fire; asked again at `retry`.
    Pending { retry: Option<SystemTime> },
    /// Some scheduler saw the schedule before: the missed policy applies.
    SeenBefore,
    /// This firer recorded it: ticks up to `since` never fire.
    FirstSeen,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    at: SystemTime,
}

/// The firing rule of one schedule, as one scheduler runs it: every native
/// worker's scheduler and the edge's Cron Trigger handler call
/// [`fire_due`](ScheduleFiring::fire_due) on their own instance, on a claim
/// store they share, and each tick is sent once.
///
/// Each pass:
///
/// 1. The first pass asks the store whether any scheduler saw the schedule
///    before (`schedule:<name>:known` done). If none did, this firer
///    records it, after marking the ticks before it started that any
///    policy could reach as fired without sending them: a first deploy
///    never fires the past. (If one of those ticks, or of the policy's
///    reach plus three before the start, reads as fired through
///    [`ClaimStore::state`], the schedule was seen before and a store that
///    expires done marks forgot `known`: it is recorded again, nothing
///    marked.) The marks are written newest first: a first firer killed
///    part way leaves the last tick before its start marked, and the firer
///    that takes `known` over when its lease ends finishes the marks from
///    that tick down, so the past never fires and the ticks after that
///    first start are fired by the missed policy.
/// 2. The due ticks: those that came due since this firer started watching
///    (less [`grace`](ScheduleFiring::grace)) and since its last pass, and
///    are at most a live window old (twice the tick lease plus the grace);
///    they always fire. Older ones (before it started, or while it was
///    stalled) are *missed*: [`Missed`] picks which fire.
/// 3. Each tick is claimed (`schedule:<name>:<tick>`, for the schedule's
///    [lease](Schedule::lease)). Claimed: the job is sent, then the claim
///    completed. Held: another firer is at it; this one retries when the
///    lease ends, and fires it if the holder died. Done: fired already.
///
/// A firer that dies holding a tick delays it by at most the lease plus
/// the time to the other firers' next pass.
#[derive(Debug, Clone)]
pub struct ScheduleFiring {
    schedule: Schedule,
    since: i64,
    grace: Duration,
    known: Known,
    settled_through: Option<i64>,
    pending: BTreeMap<Tick, Pending>,
}

impl ScheduleFiring {
    /// The rule for `schedule`, for a firer that started watching at
    /// `watching_since` (a worker's start; at the edge, the Cron Trigger's
    /// scheduled time).
    pub fn new(schedule: Schedule, watching_since: SystemTime) -> Self {
        ScheduleFiring {
            schedule,
            since: unix_seconds(watching_since),
            grace: DEFAULT_GRACE,
            known: Known::Pending { retry: None },
            settled_through: None,
            pending: BTreeMap::new(),
        }
    }

    /// Ticks up to `grace` before the firer started count as seen, not
    /// missed ([`DEFAULT_GRACE`]; a scheduler polling every `p` passes `p`).
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn live_window(&self) -> i64 {
        secs_up(self.schedule.lease().saturating_mul(2) + self.grace)
    }

    /// When the next pass is needed after `now`: the next tick of the
    /// schedule, or the earliest retry, whichever is first. `None` for a
    /// disabled schedule with nothing pending, or one without more ticks.
    pub fn next_wake(&self, now: SystemTime) -> Option<SystemTime> {
        let next_tick = if self.schedule.enabled() {
            self.schedule.next_after(now).map(|t| t.time())
        } else {
            None
        };
        let retry = self.pending.values().map(|p| p.at).min();
        let known = match self.known {
            Known::Pending { retry } if self.schedule.enabled() => retry,
            _ => None,
        };
        [next_tick, retry, known].into_iter().flatten().min()
    }

    /// Fires the ticks due at `now`, each once across every firer of the
    /// store.
    ///
    /// `send` sends one tick's job ([`TickDispatch`]: job, queue, payload,
    /// metadata) and answers what it sent (a message id) or an error, which
    /// `certainly_unsent` reads: `true` (refused before anything went out)
    /// gives the tick back at once, `false` (it may have gone out) keeps it
    /// claimed until its lease ends.
    pub async fn fire_due<S, T, E, F, Fut, C>(
        &mut self,
        claims: &S,
        now: SystemTime,
        mut send: F,
        certainly_unsent: C,
    ) -> FireReport<T, E>
    where
        S: ClaimStore + ?Sized,
        F: FnMut(TickDispatch) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        C: Fn(&E) -> bool,
    {
        let mut report = FireReport::new();
        let now_s = unix_seconds(now);
        if !self.schedule.enabled() {
            self.settled_through = Some(now_s);
            report.next_wake = self.next_wake(now);
            return report;
        }
        self.resolve_known(claims, now, &mut report).await;
        if report.known_error.is_some() && self.settled_through.is_none() {
            // The store does not answer: nothing can be claimed anyway, and
            // the ticks before the start wait for it to say whether the
            // schedule was seen before (the missed policy, or a first
            // deploy's marks).
            report.next_wake = self.next_wake(now);
            return report;
        }
        let floor = match self.known {
            Known::SeenBefore => None,
            Known::Pending { .. } | Known::FirstSeen => Some(self.since),
        };
        let grace = secs_up(self.grace);
        let mut live_from = (self.since - grace).max(now_s - self.live_window());
        if let Some(settled) = self.settled_through {
            live_from = live_from.max(settled);
        }
        if let Some(floor) = floor {
            live_from = live_from.max(floor);
        }
        let live: Vec<Tick> = self
            .schedule
            .ticks_after(Tick::from_unix_seconds(live_from).time())
            .take_while(|t| t.unix_seconds() <= now_s)
            .collect();
        let missed_after = match (self.settled_through, floor) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let mut to_fire: Vec<Tick> = Vec::new();
        if missed_after.is_none_or(|after| after < live_from) {
            if let Some(latest) = self.schedule.latest_at_or_before_unix(live_from) {
                if missed_after.is_none_or(|after| latest.unix_seconds() > after) {
                    let selected: Vec<Tick> = match self.schedule.missed() {
                        Missed::Skip => Vec::new(),
                        Missed::Latest if live.is_empty() => vec![latest],
                        Missed::Latest => Vec::new(),
                        Missed::Each(n) => self
                            .schedule
                            .last_ticks(latest.time(), n as usize)
                            .into_iter()
                            .filter(|t| missed_after.is_none_or(|after| t.unix_seconds() > after))
                            .collect(),
                    };
                    report.missed = Some(MissedTicks {
                        latest,
                        selected: selected.len(),
                    });
                    to_fire.extend(selected);
                }
            }
        }
        to_fire.extend(live);
        // Retries that are due.
        let horizon = now_s - secs_up(SEND_RETRY_HORIZON);
        let due: Vec<Tick> = self
            .pending
            .iter()
            .filter(|(_, p)| p.at <= now)
            .map(|(t, _)| *t)
            .collect();
        for tick in due {
            if tick.unix_seconds() < horizon {
                self.pending.remove(&tick);
                report.ticks.push(TickReport {
                    tick,
                    outcome: TickOutcome::GivenUp,
                });
            } else {
                to_fire.push(tick);
            }
        }
        to_fire.sort();
        to_fire.dedup();
        for tick in to_fire {
            let outcome = self
                .fire_one(claims, tick, now, &mut send, &certainly_unsent)
                .await;
            report.ticks.push(TickReport { tick, outcome });
        }
        while self.pending.len() > MAX_PENDING_TICKS {
            if let Some((&tick, _)) = self.pending.iter().next() {
                self.pending.remove(&tick);
                report.ticks.push(TickReport {
                    tick,
                    outcome: TickOutcome::GivenUp,
                });
            }
        }
        self.settled_through = Some(self.settled_through.map_or(now_s, |s| s.max(now_s)));
        report.next_wake = self.next_wake(now);
        report
    }

    async fn fire_one<S, T, E, F, Fut, C>(
        &mut self,
        claims: &S,
        tick: Tick,
        now: SystemTime,
        send: &mut F,
        certainly_unsent: &C,
    ) -> TickOutcome<T, E>
    where
        S: ClaimStore + ?Sized,
        F: FnMut(TickDispatch) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        C: Fn(&E) -> bool,
    {
        let key = super::spec::tick_key(self.schedule.name(), &tick);
        let lease = self.schedule.lease();
        self.pending.remove(&tick);
        let fence = match claims.claim(&key, lease).await {
            Err(e) => {
                self.retry(tick, now + SEND_RETRY);
                return TickOutcome::Store(e);
            }
            Ok(Claim::Done) => return TickOutcome::AlreadyFired,
            Ok(Claim::Held { remaining }) => {
                self.retry(tick, now + remaining.max(MIN_HELD_RETRY));
                return TickOutcome::Held { remaining };
            }
            Ok(Claim::Claimed { fence }) => fence,
        };
        let dispatch = match self.schedule.dispatch(&tick) {
            Ok(dispatch) => dispatch,
            Err(e) => {
                let _ = claims.release(&key, fence).await;
                return TickOutcome::Payload(e);
            }
        };
        match send(dispatch).await {
            Ok(sent) => match claims.complete(&key, fence).await {
                Ok(()) => TickOutcome::Fired {
                    sent,
                    taken_over: fence > 1,
                },
                Err(error) => TickOutcome::FiredUnrecorded { sent, error },
            },
            Err(error) => {
                let released =
                    certainly_unsent(&error) && claims.release(&key, fence).await.is_ok();
                if released {
                    self.retry(tick, now + SEND_RETRY);
                } else {
                    self.retry(tick, now + lease);
                }
                TickOutcome::SendFailed { error, released }
            }
        }
    }

    fn retry(&mut self, tick: Tick, at: SystemTime) {
        self.pending.insert(tick, Pending { at });
    }

    /// How many ticks before a start the missed policy reaches.
    fn reach(&self) -> usize {
        match self.schedule.missed() {
            Missed::Each(n) => n as usize,
            _ => 1,
        }
    }

    /// The ticks a first sight at `since` marks fired, in order: every
    /// tick of the minute (or the grace, if longer) before it, and the
    /// policy's reach before that. Another firer's missed ticks end at or
    /// after its start less its grace, and it started after this one: the
    /// reach of its policy before `since` is the last `n` ticks before
    /// `since - grace`, and every tick after that.
    fn first_sight_marks(&self, since: i64) -> Vec<Tick> {
        let grace = self.grace.max(FIRST_SEEN_GRACE);
        let from = Tick::from_unix_seconds(since - secs_up(grace)).time();
        let until = Tick::from_unix_seconds(since).time();
        let mut marks = self.schedule.last_ticks(from, self.reach());
        marks.extend(
            self.schedule
                .ticks_between(from, until)
                .into_iter()
                .take(super::spec::MAX_MISSED_EACH as usize),
        );
        marks.sort();
        marks.dedup();
        marks
    }

    /// Step 1: whether some scheduler saw the schedule before.
    async fn resolve_known<S, T, E>(
        &mut self,
        claims: &S,
        now: SystemTime,
        report: &mut FireReport<T, E>,
    ) where
        S: ClaimStore + ?Sized,
    {
        match self.known {
            Known::SeenBefore | Known::FirstSeen => return,
            Known::Pending { retry: Some(at) } if at > now => return,
            Known::Pending { .. } => {}
        }
        let key = self.schedule.known_key();
        let lease = self.schedule.lease();
        match claims.claim(&key, lease).await {
            Ok(Claim::Done) => self.known = Known::SeenBefore,
            Ok(Claim::Held { remaining }) => {
                self.known = Known::Pending {
                    retry: Some(now + remaining.max(MIN_HELD_RETRY)),
                }
            }
            Err(e) => {
                report.known_error = Some(e);
                self.known = Known::Pending {
                    retry: Some(now + SEND_RETRY),
                };
            }
            Ok(Claim::Claimed { fence }) => {
                // The first to see it: the ticks before `since` that a
                // policy of any firer could reach are marked fired.
                let mut marks = self.first_sight_marks(self.since);
                // A store whose done marks expire (Redis, after its
                // `done_ttl`) forgets `known` too: a tick of the reach read
                // as fired says the schedule was seen before, and `known`
                // is recorded again without marking anything. Or a first
                // firer died while marking (`known` claimed before, fence
                // above 1): it marks newest first, so the newest tick read
                // as fired is the last before its start, and this firer
                // finishes its marks from there; the ticks after it came
                // due while a scheduler watched, and the missed policy
                // fires them.
                let since = Tick::from_unix_seconds(self.since).time();
                let mut probes = self.schedule.last_ticks(since, self.reach() + 3);
                probes.extend(marks.iter().copied());
                probes.sort();
                probes.dedup();
                let mut newest_fired = None;
                for tick in probes.iter().rev() {
                    let tick_key = super::spec::tick_key(self.schedule.name(), tick);
                    if let Ok(ClaimState::Done) = claims.state(&tick_key).await {
                        newest_fired = Some(*tick);
                        break;
                    }
                }
                let seen_before = newest_fired.is_some();
                match newest_fired {
                    None => {}
                    Some(last) if fence > 1 => {
                        marks = self.first_sight_marks(last.unix_seconds());
                    }
                    Some(_) => marks.clear(),
                }
                // Newest first: a firer killed part way leaves the last
                // tick before its start marked, which tells the next one
                // where the past ends.
                let mut failed = None;
                let mut marked = Vec::new();
                for tick in marks.iter().rev() {
                    let tick_key = super::spec::tick_key(self.schedule.name(), tick);
                    let result = match claims.claim(&tick_key, lease).await {
                        Ok(Claim::Claimed { fence }) => claims.complete(&tick_key, fence).await,
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    };
                    match result {
                        Ok(()) => marked.push(*tick),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                for tick in marked.into_iter().rev() {
                    report.ticks.push(TickReport {
                        tick,
                        outcome: TickOutcome::SkippedBeforeFirstSeen,
                    });
                }
                let completed = match failed {
                    None => claims.complete(&key, fence).await,
                    Some(e) => Err(e),
                };
                match completed {
                    Ok(()) if seen_before => self.known = Known::SeenBefore,
                    Ok(()) => {
                        self.known = Known::FirstSeen;
                        report.first_seen = true;
                    }
                    Err(e) => {
                        let _ = claims.release(&key, fence).await;
                        report.known_error = Some(e);
                        self.known = Known::Pending {
                            retry: Some(now + SEND_RETRY),
                        };
                    }
                }
            }
        }
    }
}

/// Whole seconds, rounded up.
fn secs_up(d: Duration) -> i64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i64::try_from(s).unwrap_or(i64::MAX / 4)
}
