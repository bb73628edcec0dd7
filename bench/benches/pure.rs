//! The pure path: what the rules cost for one successful delivery.
//!
//! - facade: `Registry::process` (envelope decode, lookup, payload decode,
//!   tier-one executor, settlement decision, event) and `Registry::settled`
//!   (counters, metrics, event sink) for each body;
//! - baseline: one `serde_json::from_slice` of the same body into a struct
//!   mirroring the envelope with the payload typed, then the same handler
//!   called with a context made once.
//!
//! 50,000 deliveries per round (5,000 under `BENCH_QUICK=1`), both sides on a
//! tokio worker in interleaved rounds. Target (issue 13): at most 1.5x the
//! baseline, and below 400 ns per job on the reference machine.
//!
//! Run: `cargo bench -p jobrail-bench --bench pure`.

use std::sync::Arc;

use jobrail::{CancelToken, Envelope, Incoming, Job, JobContext, Registry, Runtime};
use jobrail_bench::work::{handler, TypedEnvelope, Work};
use jobrail_bench::{
    count_allocations, on_worker, reset_results, runtime, selected, size, time_on_worker,
    Allocations, Comparison, Counting,
};
use jobrail_native::TokioRuntime;

/// Counts allocations in an untimed pass of each side.
#[global_allocator]
static ALLOC: Counting = Counting;

const BENCH: &str = "pure";
/// The target per job, on the reference machine.
const TARGET_NS: f64 = 400.0;

fn bodies(n: u64) -> Arc<Vec<Vec<u8>>> {
    Arc::new(
        (0..n)
            .map(|id| {
                Envelope::new("work", serde_json::json!({"id": id, "name": "report"})).encode()
            })
            .collect(),
    )
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let n = size(50_000);
    let work = format!("`Registry::process` + `settled`, {n} successful deliveries");
    if !selected(&work) {
        return;
    }
    let bodies = bodies(n);

    let job = Job::<Work>::builder("work").build().unwrap();
    let mut registry = Registry::new();
    registry.register(&job, handler).unwrap();
    let registry = Arc::new(registry);
    let jobrail_runtime: Arc<dyn Runtime> = Arc::new(TokioRuntime);
    let cancel = CancelToken::new();

    let comparison = Comparison::new(
        BENCH,
        &work,
        "one-pass typed `serde_json::from_slice` + handler call",
        n,
    )
    .target(1.5)
    .run(
        |_| {
            let ctx = JobContext::detached(jobrail_runtime.clone());
            time_on_worker(&rt, baseline(bodies.clone(), ctx))
        },
        |_| {
            let facade = facade(
                bodies.clone(),
                registry.clone(),
                jobrail_runtime.clone(),
                cancel.clone(),
            );
            time_on_worker(&rt, facade)
        },
    );
    comparison.report();
    assert_eq!(
        registry.stats().job("work").first_attempt,
        n * comparison.facade_secs.len() as u64,
        "every delivery succeeded"
    );

    // Allocations per delivery, counted outside the clock (the context
    // the baseline reuses is made before the count).
    let ctx = JobContext::detached(jobrail_runtime.clone());
    let (base, ()) = count_allocations(|| on_worker(&rt, baseline(bodies.clone(), ctx)));
    let pass = facade(bodies.clone(), registry, jobrail_runtime, cancel);
    let (ours, ()) = count_allocations(|| on_worker(&rt, pass));
    Allocations::new(&work, n, base, ours).report(BENCH);

    let facade = jobrail_bench::Spread::of(&comparison.facade_secs);
    let each_ns = facade.median * 1e9 / n as f64;
    println!(
        "facade: {each_ns:.0} ns/job (median; range {:.0} to {:.0}); target below {TARGET_NS:.0} ns/job on the reference machine: {}",
        facade.min * 1e9 / n as f64,
        facade.max * 1e9 / n as f64,
        if each_ns < TARGET_NS { "met" } else { "NOT met" }
    );
}

/// The baseline's round: one typed parse of each body, then the handler.
async fn baseline(bodies: Arc<Vec<Vec<u8>>>, ctx: JobContext) {
    for body in bodies.iter() {
        let envelope: TypedEnvelope = serde_json::from_slice(body).unwrap();
        std::hint::black_box((&envelope.id, &envelope.job, &envelope.metadata));
        handler(ctx.clone(), envelope.payload).await.unwrap();
    }
}

/// The facade's round: `process` and `settled` for each body.
async fn facade(
    bodies: Arc<Vec<Vec<u8>>>,
    registry: Arc<Registry>,
    runtime: Arc<dyn Runtime>,
    cancel: CancelToken,
) {
    for body in bodies.iter() {
        let delivery = Incoming {
            queue: "default",
            body,
            attempt: 1,
            shutdown_returns: None,
            deadline: None,
        };
        let processed = registry.process(delivery, &runtime, &cancel).await;
        registry.settled(&processed, Ok(()));
    }
}
