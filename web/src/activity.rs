//! Settlement rates over the last minutes, from samples of each native
//! source's [`Stats`] taken every 10 seconds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use jobrail::Stats;

use crate::source::Source;

/// How often the counters are sampled.
pub(crate) const EVERY: Duration = Duration::from_secs(10);
/// The longest window shown: 15 minutes (and one sample more).
const KEEP: usize = 15 * 6 + 1;

/// Settlements counted in a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) succeeded: u64,
    pub(crate) retried: u64,
    pub(crate) failed: u64,
    pub(crate) rejected: u64,
}

impl Totals {
    fn of(stats: &Stats) -> Totals {
        let mut t = Totals::default();
        for s in stats.snapshot().values() {
            t.succeeded += s.succeeded();
            t.retried += s.retried;
            t.failed += s.failed;
            t.rejected += s.rejected;
        }
        t
    }

    fn minus(self, earlier: Totals) -> Totals {
        Totals {
            succeeded: self.succeeded.saturating_sub(earlier.succeeded),
            retried: self.retried.saturating_sub(earlier.retried),
            failed: self.failed.saturating_sub(earlier.failed),
            rejected: self.rejected.saturating_sub(earlier.rejected),
        }
    }
}

type Samples = Mutex<VecDeque<(Instant, Vec<Option<Totals>>)>>;

#[derive(Default)]
pub(crate) struct Activity {
    samples: Arc<Samples>,
    started: AtomicBool,
}

fn sample(stats: &[Option<Arc<Stats>>]) -> Vec<Option<Totals>> {
    stats.iter().map(|s| s.as_deref().map(Totals::of)).collect()
}

impl Activity {
    /// Starts sampling (once), on the current tokio runtime if there is one.
    pub(crate) fn start(&self, sources: &[Source]) {
        let stats: Vec<Option<Arc<Stats>>> = sources.iter().map(|s| s.stats.clone()).collect();
        if stats.iter().all(Option::is_none) || self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.started.store(false, Ordering::SeqCst);
            return;
        };
        record(&self.samples, &stats);
        let weak: Weak<Samples> = Arc::downgrade(&self.samples);
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(samples) = weak.upgrade() else {
                    return;
                };
                record(&samples, &stats);
            }
        });
    }

    /// For each source, what was settled in about the last `window` (less
    /// when the dashboard has not run that long: the window covered is
    /// returned beside it). `None` for a source without counters.
    pub(crate) fn rates(
        &self,
        sources: &[Source],
        window: Duration,
    ) -> Vec<Option<(Totals, Duration)>> {
        let stats: Vec<Option<Arc<Stats>>> = sources.iter().map(|s| s.stats.clone()).collect();
        let now = Instant::now();
        let current = sample(&stats);
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        // The oldest sample within the window (or the oldest of all).
        let base = samples
            .iter()
            .find(|(at, _)| now.duration_since(*at) <= window + EVERY / 2)
            .or(samples.front());
        current
            .into_iter()
            .enumerate()
            .map(|(i, now_totals)| {
                let now_totals = now_totals?;
                match base {
                    Some((at, totals)) => {
                        let earlier = totals.get(i).copied().flatten().unwrap_or_default();
                        Some((now_totals.minus(earlier), now.duration_since(*at)))
                    }
                    None => Some((Totals::default(), Duration::ZERO)),
                }
            })
            .collect()
    }
}

fn record(samples: &Samples, stats: &[Option<Arc<Stats>>]) {
    let taken = sample(stats);
    let mut samples = samples.lock().unwrap_or_else(|e| e.into_inner());
    samples.push_back((Instant::now(), taken));
    while samples.len() > KEEP {
        samples.pop_front();
    }
}
