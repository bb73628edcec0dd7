//! Ack runs: the settlements of one consuming channel, written by one task,
//! with every run of acks that may be merged sent as one
//! `basic.ack multiple=true`.
//!
//! A multiple ack of tag `N` acknowledges every tag up to `N` that the
//! channel still holds unacknowledged, so it may only cover tags whose
//! settlement is an ack. The channel's [`AckRuns`] knows every delivery
//! handed out on it (`running`, with the time it was handed out), the acks
//! requested and not yet written, and the nacks and rejects requested and
//! not yet written. One task (started when there is something to write,
//! ending when there is nothing) writes them, in this order each turn:
//!
//! 1. every requested nack and reject, one frame each, so that they reach the
//!    broker before any multiple ack written after them;
//! 2. the *run*: every requested ack whose tag is below the lowest delivery
//!    still running, as one ack of the run's highest tag (`multiple` when the
//!    run has more than one tag). Every tag it covers is one whose ack was
//!    requested (or one settled earlier), never a delivery still running nor
//!    one nacked or rejected. A run is written once half the prefetch waits
//!    (as a loop acking every 32 messages at prefetch 64 does), once no
//!    delivery is running (nothing would join it), or once its oldest ack
//!    waited the gap wait; until then it grows;
//! 3. the acks above a running delivery (a gap in tag order) wait for it to
//!    settle, but at most the gap wait
//!    ([`RabbitConfig::ack_gap_wait`](super::RabbitConfig::ack_gap_wait),
//!    default [`GAP_WAIT`]) from when that delivery was handed
//!    out, and only while fewer than half the prefetch wait: past either,
//!    or once the subscription is closing or the driver stopping, they are
//!    written one by one (`multiple = false`), so a slow handler never holds
//!    back the acks of the others for longer, and waiting never holds the
//!    broker's whole window (which would stall the deliveries).
//!
//! A settlement's future resolves once its frame was written (or failed, as
//! [`ErrorKind::Connection`](crate::driver::ErrorKind::Connection), like a
//! single ack). The task owns the writes, so a settlement whose future is
//! dropped still has its frame written, and nothing requested is left
//! behind: [`AckRuns::drain`] (from `close` and the driver's `stop`) writes
//! what is waiting at once and waits for it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::Channel;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use super::errors::{error, failed};
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

/// How long acks above a delivery still running wait for it, counted from
/// when that delivery was handed out, before they are written one by one
/// (the default of [`RabbitConfig::ack_gap_wait`](super::RabbitConfig::ack_gap_wait)).
pub(super) const GAP_WAIT: Duration = Duration::from_millis(5);

/// What became of a written frame.
type Outcome = Result<(), Failure>;

/// Why a frame could not be written (cloned to every settlement of a run).
#[derive(Clone, Debug)]
pub(super) enum Failure {
    /// lapin refused or lost it.
    Lapin(lapin::Error),
    /// No answer within the operation timeout.
    Timeout(Duration),
}

impl Failure {
    /// The settlement's error: [`ErrorKind::Connection`], as for any
    /// settlement frame, keeping lapin's error as the source.
    pub(super) fn into_error(self, doing: &str) -> DriverError {
        match self {
            Failure::Lapin(cause) => failed(ErrorKind::Connection, doing, cause),
            Failure::Timeout(limit) => error(
                ErrorKind::Connection,
                format!("{doing}: no answer within {limit:?}"),
            ),
        }
    }
}

/// A settlement other than an ack, written singly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Single {
    /// `basic.nack` with requeue.
    Requeue,
    /// `basic.reject` without requeue.
    Reject,
}

type Waiter = Option<oneshot::Sender<Outcome>>;

#[derive(Default)]
struct State {
    /// Handed out, no settlement requested yet: tag and when.
    running: BTreeMap<u64, Instant>,
    /// Acks requested, not yet written, with when.
    acks: BTreeMap<u64, (Instant, Waiter)>,
    /// Nacks and rejects requested, not yet written, in request order.
    singles: Vec<(u64, Single, Waiter)>,
    /// A writer task is running.
    writing: bool,
    /// Closing or stopping: no waiting on gaps.
    eager: bool,
    /// How long acks wait behind a running delivery.
    gap_wait: Duration,
    /// How many acks may wait behind a running delivery: half the prefetch
    /// (at least 1), so that waiting never holds the whole window.
    most_waiting: usize,
}

/// One turn's frames.
#[derive(Default)]
struct Turn {
    singles: Vec<(u64, Single, Waiter)>,
    /// The run: its highest tag and the waiters of every tag in it.
    run: Option<(u64, Vec<Waiter>)>,
    /// Acks above a gap, written one by one.
    lone: Vec<(u64, Waiter)>,
}

enum Next {
    Write(Turn),
    Wait(Instant),
    Idle,
}

impl State {
    fn next(&mut self, now: Instant) -> Next {
        let mut turn = Turn {
            singles: std::mem::take(&mut self.singles),
            ..Turn::default()
        };
        let lowest = self.running.first_key_value().map(|(t, at)| (*t, *at));
        let oldest = self.acks.values().map(|(at, _)| *at).min();
        let mut wait: Option<Instant> = None;
        // The run: every ack below the lowest running delivery, written once
        // it is worth a frame (half the prefetch), once nothing else runs,
        // or once its oldest ack waited the gap wait.
        if let Some(oldest) = oldest {
            let run_due = oldest + self.gap_wait;
            if self.eager
                || lowest.is_none()
                || self.acks.len() >= self.most_waiting
                || now >= run_due
            {
                let below = match lowest {
                    Some((tag, _)) => {
                        let above = self.acks.split_off(&tag);
                        std::mem::replace(&mut self.acks, above)
                    }
                    None => std::mem::take(&mut self.acks),
                };
                if let Some((&last, _)) = below.last_key_value() {
                    turn.run = Some((last, below.into_values().map(|(_, w)| w).collect()));
                }
            } else {
                wait = Some(run_due);
            }
        }
        // Acks above a running delivery: one by one once that delivery ran
        // the gap wait, or once half the prefetch waits behind it.
        if let (Some((tag, since)), false) = (lowest, self.acks.is_empty()) {
            let gap_due = since + self.gap_wait;
            let above = self.acks.range(tag..).count();
            if self.eager || now >= gap_due || above >= self.most_waiting {
                let above = self.acks.split_off(&tag);
                turn.lone = above.into_iter().map(|(t, (_, w))| (t, w)).collect();
            } else if above > 0 {
                wait = Some(wait.map_or(gap_due, |w| w.min(gap_due)));
            }
        }
        if turn.singles.is_empty() && turn.run.is_none() && turn.lone.is_empty() {
            match wait {
                Some(deadline) => Next::Wait(deadline),
                None => Next::Idle,
            }
        } else {
            Next::Write(turn)
        }
    }

    fn idle(&self) -> bool {
        !self.writing && self.acks.is_empty() && self.singles.is_empty()
    }
}

/// The settlements of one consuming channel (see the module documentation).
pub(super) struct AckRuns {
    channel: Channel,
    limit: Duration,
    state: Mutex<State>,
    wake: Notify,
}

impl AckRuns {
    /// The ack runs of `channel` (consumed with `prefetch`), acks waiting
    /// up to `gap_wait` behind a running delivery, each frame bounded by
    /// `limit`.
    pub(super) fn new(
        channel: Channel,
        prefetch: u16,
        gap_wait: Duration,
        limit: Duration,
    ) -> Arc<AckRuns> {
        Arc::new(AckRuns {
            channel,
            limit,
            state: Mutex::new(State {
                gap_wait,
                most_waiting: usize::from(prefetch / 2).max(1),
                ..State::default()
            }),
            wake: Notify::new(),
        })
    }

    /// The channel the deliveries came on.
    pub(super) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Records a delivery handed out with `tag`.
    pub(super) fn handed_out(&self, tag: u64) {
        lock(&self.state).running.insert(tag, Instant::now());
    }

    /// Requests an ack of `tag` and waits until it was written.
    pub(super) async fn ack(self: &Arc<Self>, tag: u64) -> Result<(), DriverError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = lock(&self.state);
            state.running.remove(&tag);
            state.acks.insert(tag, (Instant::now(), Some(tx)));
            self.start(&mut state);
        }
        self.outcome(rx, "basic.ack").await
    }

    /// Requests a nack or reject of `tag` and waits until it was written.
    pub(super) async fn single(
        self: &Arc<Self>,
        tag: u64,
        kind: Single,
    ) -> Result<(), DriverError> {
        let (tx, rx) = oneshot::channel();
        self.request_single(tag, kind, Some(tx));
        let doing = match kind {
            Single::Requeue => "basic.nack",
            Single::Reject => "basic.reject",
        };
        self.outcome(rx, doing).await
    }

    /// Requests a nack with requeue of `tag` without waiting (a delivery
    /// dropped unsettled). Needs a tokio runtime; without one the delivery
    /// stays a gap, and its message returns when the channel closes.
    pub(super) fn requeue_later(self: &Arc<Self>, tag: u64) {
        if tokio::runtime::Handle::try_current().is_ok() {
            self.request_single(tag, Single::Requeue, None);
        }
    }

    /// Requests a nack with requeue of `tag` once `hold` has passed (a
    /// delivery whose settlement failed: handed straight back, it could
    /// loop). Until then the delivery counts as running, so no multiple ack
    /// covers it. Needs a tokio runtime, as [`requeue_later`](Self::requeue_later).
    pub(super) fn requeue_after(self: &Arc<Self>, tag: u64, hold: Duration) {
        if tokio::runtime::Handle::try_current().is_ok() {
            let runs = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                runs.request_single(tag, Single::Requeue, None);
            });
        }
    }

    fn request_single(self: &Arc<Self>, tag: u64, kind: Single, waiter: Waiter) {
        let mut state = lock(&self.state);
        state.running.remove(&tag);
        state.singles.push((tag, kind, waiter));
        self.start(&mut state);
    }

    async fn outcome(
        &self,
        rx: oneshot::Receiver<Outcome>,
        doing: &str,
    ) -> Result<(), DriverError> {
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(failure)) => Err(failure.into_error(doing)),
            // The writer ended without answering: only when the runtime shuts down.
            Err(_) => Err(error(
                ErrorKind::Connection,
                format!("{doing}: the settlement writer ended before writing it"),
            )),
        }
    }

    /// Starts the writer, or wakes it.
    fn start(self: &Arc<Self>, state: &mut State) {
        if state.writing {
            self.wake.notify_one();
        } else {
            state.writing = true;
            tokio::spawn(self.clone().write());
        }
    }

    /// Writes what is waiting at once (acks above gaps too) from now on, and
    /// waits (up to `limit`) until nothing requested is left unwritten.
    pub(super) async fn drain(self: &Arc<Self>, limit: Duration) {
        {
            let mut state = lock(&self.state);
            state.eager = true;
            if state.idle() {
                return;
            }
            if !state.writing {
                self.start(&mut state);
            } else {
                self.wake.notify_one();
            }
        }
        let deadline = Instant::now() + limit;
        while !lock(&self.state).idle() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The writer: turns until nothing is left.
    async fn write(self: Arc<Self>) {
        loop {
            let next = lock(&self.state).next(Instant::now());
            let turn = match next {
                Next::Write(turn) => turn,
                Next::Wait(deadline) => {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = tokio::time::sleep_until(deadline) => {}
                    }
                    continue;
                }
                Next::Idle => {
                    let mut state = lock(&self.state);
                    // Something may have arrived since `next`.
                    if state.acks.is_empty() && state.singles.is_empty() {
                        state.writing = false;
                        return;
                    }
                    continue;
                }
            };
            self.turn(turn).await;
        }
    }

    async fn turn(&self, turn: Turn) {
        for (tag, kind, waiter) in turn.singles {
            let outcome = match kind {
                Single::Requeue => {
                    self.bounded(self.channel.basic_nack(
                        tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    ))
                    .await
                }
                Single::Reject => {
                    self.bounded(
                        self.channel
                            .basic_reject(tag, BasicRejectOptions { requeue: false }),
                    )
                    .await
                }
            };
            answer(waiter, outcome);
        }
        if let Some((last, waiters)) = turn.run {
            let multiple = waiters.len() > 1;
            let outcome = self
                .bounded(self.channel.basic_ack(last, BasicAckOptions { multiple }))
                .await;
            for waiter in waiters {
                answer(waiter, outcome.clone());
            }
        }
        for (tag, waiter) in turn.lone {
            let outcome = self
                .bounded(self.channel.basic_ack(tag, BasicAckOptions::default()))
                .await;
            answer(waiter, outcome);
        }
    }

    async fn bounded(
        &self,
        frame: impl std::future::Future<Output = lapin::Result<()>>,
    ) -> Outcome {
        match tokio::time::timeout(self.limit, frame).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(cause)) => Err(Failure::Lapin(cause)),
            Err(_) => Err(Failure::Timeout(self.limit)),
        }
    }
}

fn answer(waiter: Waiter, outcome: Outcome) {
    if let Some(waiter) = waiter {
        let _ = waiter.send(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Acks requested at `at`.
    fn state_at(at: Instant, running: &[(u64, Instant)], acks: &[u64]) -> State {
        State {
            running: running.iter().copied().collect(),
            acks: acks.iter().map(|t| (*t, (at, None))).collect(),
            gap_wait: GAP_WAIT,
            most_waiting: 32,
            ..State::default()
        }
    }

    fn run_of(next: Next) -> (Option<u64>, usize, Vec<u64>) {
        match next {
            Next::Write(turn) => (
                turn.run.as_ref().map(|(t, _)| *t),
                turn.run.map_or(0, |(_, w)| w.len()),
                turn.lone.iter().map(|(t, _)| *t).collect(),
            ),
            _ => panic!("nothing to write"),
        }
    }

    #[test]
    fn a_run_stops_below_the_lowest_running_delivery() {
        let now = Instant::now();
        let mut s = state_at(now, &[(3, now)], &[1, 2, 4, 5]);
        // Two acks and a delivery still running: the run waits to grow, up
        // to the gap wait.
        assert!(matches!(s.next(now), Next::Wait(d) if d == now + GAP_WAIT));
        // Then it is written, up to 2; 4 and 5 wait for 3 as long.
        assert_eq!(run_of(s.next(now + GAP_WAIT)), (Some(2), 2, vec![4, 5]));
        assert!(matches!(s.next(now + GAP_WAIT), Next::Idle));
    }

    #[test]
    fn a_run_is_written_at_half_the_prefetch_or_when_nothing_runs() {
        let now = Instant::now();
        let mut s = state_at(now, &[(40, now)], &(1..33).collect::<Vec<_>>());
        assert_eq!(run_of(s.next(now)), (Some(32), 32, vec![]));
        let mut s = state_at(now, &[], &[1, 2]);
        assert_eq!(run_of(s.next(now)), (Some(2), 2, vec![]));
    }

    #[test]
    fn a_nack_is_written_before_the_run_and_never_covered_as_running() {
        let now = Instant::now();
        let mut s = state_at(now, &[], &[2, 3]);
        s.singles.push((1, Single::Requeue, None));
        match s.next(now) {
            Next::Write(turn) => {
                assert_eq!(turn.singles.len(), 1);
                assert_eq!(turn.run.as_ref().map(|(t, w)| (*t, w.len())), Some((3, 2)));
            }
            _ => panic!("nothing to write"),
        }
    }

    #[test]
    fn half_the_prefetch_waiting_behind_a_gap_is_written_at_once() {
        let now = Instant::now();
        let mut s = state_at(now, &[(1, now)], &(2..34).collect::<Vec<_>>());
        assert_eq!(run_of(s.next(now)).2.len(), 32);
        let mut s = state_at(now, &[(1, now)], &(2..33).collect::<Vec<_>>());
        assert!(matches!(s.next(now), Next::Wait(_)));
    }

    #[test]
    fn eager_writes_everything_at_once() {
        let now = Instant::now();
        let mut s = state_at(now, &[(1, now)], &[2, 3]);
        s.eager = true;
        assert_eq!(run_of(s.next(now)), (None, 0, vec![2, 3]));
        let mut s = state_at(now, &[(3, now)], &[1, 2]);
        s.eager = true;
        assert_eq!(run_of(s.next(now)), (Some(2), 2, vec![]));
    }
}
