//! Latency under steady load: a paced dispatcher, a recorder of each job's
//! two latencies (dispatch to handler start, dispatch to acknowledged
//! settlement), percentiles, and the table rows and plot series the
//! latency benchmark writes.
//!
//! Every job carries the time it was dispatched ([`Stamped::sent_ns`],
//! nanoseconds since the process's [`epoch`]); the consuming side reads it
//! back. Both sides of a comparison record through the same [`Recorder`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::plot::Series;
use crate::Spread;

/// The payload of every latency job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Stamped {
    /// A sequence number.
    pub id: u64,
    /// A short string, as the throughput benchmarks' job has.
    pub name: String,
    /// When it was dispatched: nanoseconds since [`epoch`].
    pub sent_ns: u64,
}

/// The envelope as a hand-written consumer decodes it: one pass, the
/// payload typed.
#[derive(Debug, Deserialize)]
pub struct StampedEnvelope {
    /// Message id.
    pub id: String,
    /// Job name.
    pub job: String,
    /// The typed payload.
    pub payload: Stamped,
}

/// The instant every stamp counts from (the first call's).
pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
pub fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// A fresh stamped payload, numbered `id`, dispatched now.
pub fn stamped(id: u64) -> Stamped {
    Stamped {
        id,
        name: "report".into(),
        sent_ns: now_ns(),
    }
}

/// Both latencies of every job of one run, in nanoseconds.
#[derive(Debug, Default)]
pub struct Recorder {
    started: Mutex<Vec<u64>>,
    settled: Mutex<Vec<u64>>,
    /// Message id to dispatch stamp, between the handler's start and the
    /// settlement's event (the facade's sink sees the id, not the payload).
    open: Mutex<HashMap<String, u64>>,
}

impl Recorder {
    /// An empty recorder for `n` jobs.
    pub fn new(n: usize) -> Arc<Recorder> {
        Arc::new(Recorder {
            started: Mutex::new(Vec::with_capacity(n)),
            settled: Mutex::new(Vec::with_capacity(n)),
            open: Mutex::new(HashMap::with_capacity(1024)),
        })
    }

    /// A handler started on a job dispatched at `sent_ns`.
    pub fn started(&self, sent_ns: u64) {
        let now = now_ns();
        self.started
            .lock()
            .unwrap()
            .push(now.saturating_sub(sent_ns));
    }

    /// A job dispatched at `sent_ns` was settled, and the settlement
    /// acknowledged.
    pub fn settled(&self, sent_ns: u64) {
        let now = now_ns();
        self.settled
            .lock()
            .unwrap()
            .push(now.saturating_sub(sent_ns));
    }

    /// A handler started on message `id`, dispatched at `sent_ns`; its
    /// settlement is reported later by id ([`Recorder::settled_id`]).
    pub fn started_id(&self, id: &str, sent_ns: u64) {
        self.started(sent_ns);
        self.open.lock().unwrap().insert(id.to_string(), sent_ns);
    }

    /// Message `id` (seen by [`Recorder::started_id`]) was settled.
    pub fn settled_id(&self, id: &str) {
        let sent = self.open.lock().unwrap().remove(id);
        if let Some(sent_ns) = sent {
            self.settled(sent_ns);
        }
    }

    /// Jobs settled so far.
    pub fn settled_count(&self) -> usize {
        self.settled.lock().unwrap().len()
    }

    /// Handler starts so far.
    pub fn started_count(&self) -> usize {
        self.started.lock().unwrap().len()
    }

    /// The percentiles of both latencies.
    pub fn percentiles(&self) -> (Percentiles, Percentiles) {
        let of = |v: &Mutex<Vec<u64>>| Percentiles::of(&v.lock().unwrap());
        (of(&self.started), of(&self.settled))
    }
}

/// The percentiles reported, as fractions.
pub const PERCENTILES: [f64; 3] = [0.50, 0.99, 0.999];

/// p50, p99 and p99.9 of a sample, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl Percentiles {
    /// The percentiles of `nanos` (nearest rank; zeros when empty).
    pub fn of(nanos: &[u64]) -> Percentiles {
        let mut sorted = nanos.to_vec();
        sorted.sort_unstable();
        let at = |p: f64| {
            if sorted.is_empty() {
                return 0.0;
            }
            let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            sorted[rank - 1] as f64 / 1e6
        };
        Percentiles {
            p50: at(PERCENTILES[0]),
            p99: at(PERCENTILES[1]),
            p999: at(PERCENTILES[2]),
        }
    }

    fn get(&self, i: usize) -> f64 {
        [self.p50, self.p99, self.p999][i]
    }
}

/// What one side's run gave: the percentiles of both latencies and
/// whether the backend held the rate.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SideRun {
    /// Dispatch to handler start.
    pub start: Percentiles,
    /// Dispatch to acknowledged settlement.
    pub settled: Percentiles,
    /// Jobs dispatched.
    pub dispatched: u64,
    /// Jobs settled when the run ended.
    pub settled_count: u64,
    /// The rate the dispatches were confirmed at, jobs per second: the
    /// jobs over the time from the first dispatch to the last confirm.
    pub achieved_rate: f64,
    /// Every job settled within the grace after the last confirm, and the
    /// confirms kept within 5% of the rate.
    pub held: bool,
}

/// Dispatches `rate` jobs a second for `duration` through `dispatch`
/// (each call's future spawned on its own, so that one slow confirm does
/// not hold back the next dispatch: an open loop, as independent clients
/// are), then waits for every dispatch to be confirmed and for every job
/// to be settled, at most `grace` after the last confirm. Each job is
/// stamped just before its dispatch starts. The run held its rate when
/// every job was settled in time and the confirms kept within 5% of the
/// rate.
pub async fn paced<F, Fut>(
    rate: u64,
    duration: Duration,
    grace: Duration,
    recorder: Arc<Recorder>,
    dispatch: F,
) -> SideRun
where
    F: Fn(Stamped) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let total = rate * duration.as_secs().max(1);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut confirms = Vec::with_capacity(total as usize);
    let mut sent = 0u64;
    while sent < total {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as u64 + 1).min(total);
        while sent < due {
            confirms.push(tokio::spawn(dispatch(stamped(sent))));
            sent += 1;
        }
    }
    for confirm in confirms {
        confirm.await.expect("a dispatch panicked");
    }
    let dispatching = started.elapsed();
    let deadline = Instant::now() + grace;
    while recorder.settled_count() < total as usize && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let settled_count = recorder.settled_count() as u64;
    let achieved_rate = total as f64 / dispatching.as_secs_f64().max(1e-9);
    let (start, settled) = recorder.percentiles();
    SideRun {
        start,
        settled,
        dispatched: total,
        settled_count,
        achieved_rate,
        held: settled_count == total && achieved_rate >= rate as f64 * 0.95,
    }
}

/// A boxed future, for the sides' dispatch closures.
pub type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The line kind of a latency comparison.
pub const LATENCY_KIND: &str = "latency";

/// One backend at one rate: both sides over the rounds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    /// [`LATENCY_KIND`].
    pub kind: String,
    /// The backend, e.g. "RabbitMQ".
    pub backend: String,
    /// What the raw side is.
    pub baseline: String,
    /// Jobs dispatched a second.
    pub rate: u64,
    /// Seconds of dispatch per run.
    pub seconds: u64,
    /// The raw client's runs, one per round.
    pub raw: Vec<SideRun>,
    /// The facade's runs, one per round.
    pub facade: Vec<SideRun>,
}

/// Which latency a row reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Dispatch to handler start.
    Start,
    /// Dispatch to acknowledged settlement.
    Settled,
}

impl Measure {
    fn of(self, run: &SideRun) -> Percentiles {
        match self {
            Measure::Start => run.start,
            Measure::Settled => run.settled,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Measure::Start => "handler start",
            Measure::Settled => "settled",
        }
    }
}

/// The target: the facade's p99 at most 1.2 times the raw client's plus
/// 0.5 ms.
pub fn p99_target(raw_p99_ms: f64) -> f64 {
    1.2 * raw_p99_ms + 0.5
}

impl Latency {
    /// The spread over the rounds of percentile `i` of `measure`.
    fn spread(runs: &[SideRun], measure: Measure, i: usize) -> Spread {
        let values: Vec<f64> = runs.iter().map(|r| measure.of(r).get(i)).collect();
        Spread::of(&values)
    }

    /// The Markdown header of [`Latency::rows`].
    pub fn header() -> &'static str {
        "| backend | jobs/s | latency | raw p50 / p99 / p99.9 ms | facade p50 / p99 / p99.9 ms | facade p99 range | target p99 | held (raw, facade) |\n|---|---|---|---|---|---|---|---|"
    }

    /// Two Markdown rows: handler start, then settled. Each percentile is
    /// the median over the rounds; the target compares the medians.
    pub fn rows(&self) -> String {
        let held = |runs: &[SideRun]| {
            let n = runs.iter().filter(|r| r.held).count();
            format!("{n}/{}", runs.len())
        };
        let mut out = vec![];
        for measure in [Measure::Start, Measure::Settled] {
            let raw: Vec<Spread> = (0..3)
                .map(|i| Self::spread(&self.raw, measure, i))
                .collect();
            let facade: Vec<Spread> = (0..3)
                .map(|i| Self::spread(&self.facade, measure, i))
                .collect();
            let target = p99_target(raw[1].median);
            let met = if !self.held() {
                "not held: no comparison"
            } else if facade[1].median <= target {
                "met"
            } else {
                "NOT met"
            };
            out.push(format!(
                "| {} | {} | {} | {} | {} | {} to {} | <= {}: {met} | {}, {} |",
                self.backend,
                self.rate,
                measure.name(),
                triple(&raw),
                triple(&facade),
                ms(facade[1].min),
                ms(facade[1].max),
                ms(target),
                held(&self.raw),
                held(&self.facade),
            ));
        }
        out.join("\n")
    }

    /// Whether both sides held the rate in every round: a backlog that
    /// grows for the whole run measures the backlog, not the latency.
    pub fn held(&self) -> bool {
        self.raw.iter().chain(&self.facade).all(|r| r.held)
    }

    /// Whether both sides held the rate and the facade's median p99 meets
    /// the target for both latencies.
    pub fn met(&self) -> bool {
        self.held()
            && [Measure::Start, Measure::Settled].iter().all(|&m| {
                let raw = Self::spread(&self.raw, m, 1).median;
                Self::spread(&self.facade, m, 1).median <= p99_target(raw)
            })
    }

    /// The settled latency's percentile curves (x = 1 / (1 - percentile):
    /// 2 is p50, 100 p99, 1000 p99.9), raw and facade.
    pub fn series(&self) -> [Series; 2] {
        let curve = |name: String, runs: &[SideRun]| Series {
            name,
            points: PERCENTILES
                .iter()
                .enumerate()
                .map(|(i, p)| (1.0 / (1.0 - p), Self::spread(runs, Measure::Settled, i)))
                .collect(),
        };
        [
            curve(format!("{} raw, {}/s", self.backend, self.rate), &self.raw),
            curve(
                format!("{} jobrail, {}/s", self.backend, self.rate),
                &self.facade,
            ),
        ]
    }
}

fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn triple(s: &[Spread]) -> String {
    format!(
        "{} / {} / {}",
        ms(s[0].median),
        ms(s[1].median),
        ms(s[2].median)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let nanos: Vec<u64> = (1..=1000).map(|i| i * 1_000_000).collect();
        let p = Percentiles::of(&nanos);
        assert_eq!((p.p50, p.p99, p.p999), (500.0, 990.0, 999.0));
        assert_eq!(Percentiles::of(&[]).p99, 0.0);
        assert_eq!(Percentiles::of(&[3_000_000]).p999, 3.0);
    }

    #[test]
    fn the_target_is_relative_plus_half_a_millisecond() {
        let run = |p99: f64| SideRun {
            start: Percentiles {
                p50: 1.0,
                p99,
                p999: p99,
            },
            settled: Percentiles {
                p50: 1.0,
                p99,
                p999: p99,
            },
            dispatched: 1,
            settled_count: 1,
            achieved_rate: 1.0,
            held: true,
        };
        let mut l = Latency {
            kind: LATENCY_KIND.into(),
            backend: "b".into(),
            baseline: "raw".into(),
            rate: 1,
            seconds: 1,
            raw: vec![run(2.0)],
            facade: vec![run(2.9)],
        };
        assert!(l.met(), "2.9 <= 1.2 * 2 + 0.5");
        l.facade = vec![run(3.0)];
        assert!(!l.met(), "3.0 > 2.9");
        assert!(l.rows().contains("NOT met"));
        l.facade = vec![run(2.0)];
        l.raw[0].held = false;
        assert!(!l.met(), "a run that did not hold compares nothing");
        assert!(l.rows().contains("not held"));
    }

    #[test]
    fn settlement_by_id_pairs_with_its_start() {
        let r = Recorder::new(2);
        r.started_id("a", now_ns());
        r.settled_id("b");
        assert_eq!(r.settled_count(), 0, "an unknown id records nothing");
        r.settled_id("a");
        r.settled_id("a");
        assert_eq!((r.started_count(), r.settled_count()), (1, 1));
    }
}
