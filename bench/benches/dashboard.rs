//! The dashboard at scale (jobrail-web; BENCHMARKS.md "The dashboard").
//!
//! - the failures page with 10,000 records on the memory driver: the first
//!   page, a page in the middle, and a page filtered by text, each a whole
//!   request through the router (authentication, the read of every record,
//!   filtering, sorting, the HTML), `BENCH_ROUNDS` x 10 requests each;
//! - bulk replay of 10,000 records (the operator's "replay all matching",
//!   confirmed): on the memory driver and on RabbitMQ, from the request to
//!   its answer, every record sent to the work queue and removed (checked
//!   after each round).
//!
//! Targets (issue 28): a page in under 200 ms on memory; bulk replay of
//! 10,000 in under 10 s on memory and under 60 s on RabbitMQ. Measured here,
//! not asserted in tests.
//!
//! Run: `cargo bench -p jobrail-bench --features rabbitmq --bench dashboard`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use jobrail::{Job, JobContext, JobError, Registry};
use jobrail_bench::{append_result, reset_results, rounds, runtime, selected, size, Spread};
use jobrail_native::{Consumer, Driver, Failures, MemoryDriver, Producer};
use jobrail_web::{Dashboard, Role, Source};
use serde::Serialize;
use tower::ServiceExt;

const BENCH: &str = "dashboard";
const AUTH: &str = "Basic YWxpY2U6YmVuY2g="; // alice:bench

#[derive(Debug, Serialize)]
struct Row {
    bench: &'static str,
    kind: &'static str,
    work: String,
    backend: &'static str,
    records: u64,
    rounds: usize,
    seconds: Spread,
    target_seconds: f64,
}

fn job(queue: &str) -> Job<u32> {
    Job::<u32>::builder("bench-failing")
        .queue(queue)
        .max_deliveries(1)
        .build()
        .expect("job")
}

/// Fails `n` jobs on `queue`: `n` failure records.
async fn fill(driver: &Arc<dyn Driver>, queue: &str, n: u64) {
    let job = job(queue);
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, n: u32| async move {
            Err(JobError::permanent(format!(
                "record {n}: the address bounced"
            )))
        })
        .expect("register");
    let producer = Producer::new(driver.clone());
    let payloads: Vec<u32> = (0..n as u32).collect();
    for chunk in payloads.chunks(1000) {
        for sent in producer.dispatch(&job).send_batch(chunk).await {
            sent.expect("dispatch");
        }
    }
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(64)
        .build()
        .spawn();
    let failures = Failures::new(driver.clone());
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let kept = failures.all(queue).await.expect("read").len() as u64;
        if kept >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {kept} of {n} records after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    consumer.shutdown().await.expect("shutdown");
}

fn dashboard(driver: &Arc<dyn Driver>, queue: &str) -> axum::Router {
    Dashboard::builder()
        .user("alice", "bench", Role::Operator)
        .source(Source::native("bench", driver.clone()).queue(queue))
        .build()
        .expect("dashboard")
        .router()
}

async fn get(router: &axum::Router, uri: &str) -> Duration {
    let started = Instant::now();
    let response = router
        .clone()
        .oneshot(
            Request::get(uri)
                .header(header::AUTHORIZATION, AUTH)
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(response.status(), StatusCode::OK, "{uri}");
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    assert!(body.len() > 1000);
    started.elapsed()
}

/// The operator's CSRF token, from the failures page.
async fn csrf(router: &axum::Router, queue: &str) -> String {
    let response = router
        .clone()
        .oneshot(
            Request::get(format!("/failures?source=bench&queue={queue}"))
                .header(header::AUTHORIZATION, AUTH)
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("answer");
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    let html = String::from_utf8_lossy(&body);
    let at = html.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    html[at..at + 64].to_string()
}

async fn replay_all(router: &axum::Router, queue: &str) -> Duration {
    let token = csrf(router, queue).await;
    let form = format!("csrf={token}&do=replay-matching&confirm=yes&source=bench&queue={queue}");
    let started = Instant::now();
    let response = router
        .clone()
        .oneshot(
            Request::post("/failures/action")
                .header(header::AUTHORIZATION, AUTH)
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Body::from(form))
                .expect("request"),
        )
        .await
        .expect("answer");
    let took = started.elapsed();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let to = response.headers()[header::LOCATION]
        .to_str()
        .unwrap()
        .to_string();
    assert!(to.contains("Replayed+"), "{to}");
    took
}

fn report(row: &Row) {
    println!(
        "| {} | {} | {} | {:.3} s ({:.3}-{:.3}) | < {} s |",
        row.work,
        row.backend,
        row.records,
        row.seconds.median,
        row.seconds.min,
        row.seconds.max,
        row.target_seconds
    );
    append_result(BENCH, row);
}

fn main() {
    reset_results(BENCH);
    let rt = runtime();
    let n = size(10_000);
    let r = rounds();
    println!("| work | backend | records | median (range) | target |\n|---|---|---:|---:|---|");
    if selected("page") {
        rt.block_on(async {
            let driver: Arc<dyn Driver> = Arc::new(MemoryDriver::default());
            fill(&driver, "pages", n).await;
            let router = dashboard(&driver, "pages");
            let pages = (n as usize).div_ceil(50);
            for (work, uri) in [
                (
                    "failures page, the first",
                    "/failures?source=bench&queue=pages".to_string(),
                ),
                (
                    "failures page, one in the middle",
                    format!("/failures?source=bench&queue=pages&page={}", pages / 2),
                ),
                (
                    "failures page, filtered by text",
                    "/failures?source=bench&queue=pages&q=record+77".to_string(),
                ),
            ] {
                let mut times = Vec::new();
                for _ in 0..r * 10 {
                    times.push(get(&router, &uri).await.as_secs_f64());
                }
                report(&Row {
                    bench: BENCH,
                    kind: "timing",
                    work: work.into(),
                    backend: "memory",
                    records: n,
                    rounds: times.len(),
                    seconds: Spread::of(&times),
                    target_seconds: 0.2,
                });
            }
        });
    }
    let replay_rounds = r.min(3);
    if selected("replay") {
        rt.block_on(async {
            let mut times = Vec::new();
            for round in 0..replay_rounds {
                let queue = format!("replay-{round}");
                let driver: Arc<dyn Driver> = Arc::new(MemoryDriver::default());
                fill(&driver, &queue, n).await;
                let router = dashboard(&driver, &queue);
                times.push(replay_all(&router, &queue).await.as_secs_f64());
                assert!(Failures::new(driver.clone())
                    .all(&queue)
                    .await
                    .unwrap()
                    .is_empty());
                assert_eq!(
                    driver.admin().unwrap().depth(&queue).await.unwrap().ready,
                    n
                );
            }
            report(&Row {
                bench: BENCH,
                kind: "timing",
                work: "bulk replay, every record matching".into(),
                backend: "memory",
                records: n,
                rounds: times.len(),
                seconds: Spread::of(&times),
                target_seconds: 10.0,
            });
        });
    }
    #[cfg(feature = "rabbitmq")]
    if selected("replay") {
        rt.block_on(async {
            let url = std::env::var("RABBITMQ_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let mut times = Vec::new();
            for _ in 0..replay_rounds {
                let queue = jobrail_bench::unique("dashboard-replay");
                let driver: Arc<dyn Driver> = Arc::new(
                    jobrail_native::rabbitmq::RabbitDriver::connect(
                        jobrail_native::rabbitmq::RabbitConfig::new(url.clone()),
                    )
                    .await
                    .expect("RabbitMQ"),
                );
                fill(&driver, &queue, n).await;
                let router = dashboard(&driver, &queue);
                times.push(replay_all(&router, &queue).await.as_secs_f64());
                assert!(Failures::new(driver.clone())
                    .all(&queue)
                    .await
                    .unwrap()
                    .is_empty());
                let admin = driver.admin().unwrap();
                assert_eq!(admin.depth(&queue).await.unwrap().ready, n);
                admin.delete_queue(&queue).await.expect("delete");
                driver.stop().await.expect("stop");
            }
            report(&Row {
                bench: BENCH,
                kind: "timing",
                work: "bulk replay, every record matching".into(),
                backend: "rabbitmq",
                records: n,
                rounds: times.len(),
                seconds: Spread::of(&times),
                target_seconds: 60.0,
            });
        });
    }
}
