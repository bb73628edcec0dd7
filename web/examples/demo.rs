//! A worker with the dashboard mounted, and failures to look at: the browser
//! tests' server (tests/web), and a way to see the dashboard in a minute.
//!
//! ```text
//! cargo run -p jobrail-web --example demo                       # memory
//! cargo run -p jobrail-web --example demo -- --backend rabbitmq # RABBITMQ_URL
//! ```
//!
//! It declares four jobs (one fired every 5 seconds by a schedule), dispatches jobs that fail in different ways
//! (permanently with several reasons, by running out of deliveries) and
//! some that succeed, waits until every failure record is kept, then serves
//! the dashboard (users `alice`, operator, and `bob`, read-only; passwords
//! from `DEMO_OPERATOR_PASSWORD` and `DEMO_READER_PASSWORD`, default
//! `alice-password` and `bob-password`) and prints `DASHBOARD_URL=...`.
//! A replayed record's job succeeds (its handler sees the replay metadata),
//! so a replay shows up as a success on the jobs page.
//!
//! With `--edge URL` (token in `EDGE_TOKEN`), an edge worker's failure
//! keeper is a second source. With `--count N` it makes N failure records
//! on `reports` besides the others (the scale checks). It runs until
//! standard input closes or it is interrupted, then deletes what it made on
//! a broker.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{
    BreakerConfig, CircuitBreaker, Job, JobContext, JobError, MemoryClaims, Missed, Registry,
    Schedule, REPLAY_OF,
};
use jobrail_native::{Consumer, Driver, Failures, Producer};
use jobrail_web::{Dashboard, Role, Source};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Report {
    customer: u32,
    why: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Image {
    id: u32,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,jobrail_web::audit=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let backend = arg(&args, "--backend").unwrap_or_else(|| "memory".into());
    let listen = arg(&args, "--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let count: usize = arg(&args, "--count").map_or(Ok(0), |c| c.parse())?;
    let edge = arg(&args, "--edge");
    // Queue names of this run: a broker may hold an earlier run's.
    let suffix = if backend == "memory" {
        String::new()
    } else {
        format!("-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
    };
    let reports_q = format!("reports{suffix}");
    let images_q = format!("images{suffix}");

    let driver: Arc<dyn Driver> = match backend.as_str() {
        "memory" => Arc::new(jobrail_native::MemoryDriver::default()),
        "rabbitmq" => {
            let url = std::env::var("RABBITMQ_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            Arc::new(
                jobrail_native::rabbitmq::RabbitDriver::connect(
                    jobrail_native::rabbitmq::RabbitConfig::new(url),
                )
                .await?,
            )
        }
        other => return Err(format!("--backend {other}: memory or rabbitmq").into()),
    };

    let send_report = Job::<Report>::builder("send-report")
        .queue(reports_q.clone())
        .max_deliveries(3)
        .tier_one(2)
        .build()?;
    let resize = Job::<Image>::builder("resize-image")
        .queue(images_q.clone())
        .max_deliveries(2)
        .backoff(Duration::from_millis(50), 2.0, Duration::from_millis(200))
        .timeout(Duration::from_secs(30))
        .build()?;
    let crm = CircuitBreaker::new("crm", BreakerConfig::default())?;
    let sync_crm = Job::<u32>::builder("sync-crm")
        .queue(reports_q.clone())
        .breaker(crm)
        .build()?;
    let heartbeat = Job::<()>::builder("heartbeat")
        .queue(reports_q.clone())
        .build()?;
    let mut registry = Registry::new();
    registry.register(&heartbeat, |_ctx: JobContext, _: ()| async move { Ok(()) })?;
    registry.register(&send_report, |ctx: JobContext, r: Report| async move {
        if ctx.metadata().contains_key(REPLAY_OF) {
            return Ok(());
        }
        Err(JobError::permanent(format!(
            "customer {}: {}",
            r.customer, r.why
        )))
    })?;
    registry.register(&resize, |ctx: JobContext, image: Image| async move {
        if ctx.metadata().contains_key(REPLAY_OF) {
            return Ok(());
        }
        Err(JobError::new(format!(
            "image {}: the thumbnail service timed out",
            image.id
        )))
    })?;
    registry.register(&sync_crm, |_ctx: JobContext, _n: u32| async move { Ok(()) })?;

    // The dashboard's view of the jobs (their counters live on), then the
    // registry goes to the consumer.
    let source = Source::native("workers", driver.clone()).registry(&registry);
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    let producer = Producer::new(driver.clone());
    let reasons = [
        "no email address on file",
        "the template `monthly-summary` is missing",
        "mailbox quota exceeded at the provider",
    ];
    let mut expected = 0usize;
    for i in 0..9u32 {
        producer
            .dispatch(&send_report)
            .send(&Report {
                customer: 1000 + i,
                why: reasons[i as usize % 3].into(),
            })
            .await?;
        expected += 1;
    }
    for i in 0..3u32 {
        producer
            .dispatch(&resize)
            .send(&Image { id: 70 + i })
            .await?;
    }
    for i in 0..20u32 {
        producer.dispatch(&sync_crm).send(&i).await?;
    }
    // Extra records for the scale checks, in batches.
    let mut left = count;
    while left > 0 {
        let n = left.min(500);
        let batch: Vec<Report> = (0..n)
            .map(|i| Report {
                customer: (count - left + i) as u32,
                why: "bulk: the address bounced".into(),
            })
            .collect();
        for sent in producer.dispatch(&send_report).send_batch(&batch).await {
            sent?;
        }
        left -= n;
        expected += n;
    }
    let failures = Failures::new(driver.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let reports = failures.all(&reports_q).await?.len();
        let images = failures.all(&images_q).await?.len();
        if reports >= expected && images >= 3 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "only {reports} of {expected} report and {images} of 3 image records after 120 s"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let digest = Schedule::builder("nightly-digest", &send_report, "0 30 2 * * *")
        .time_zone("Europe/Berlin")
        .missed(Missed::Latest)
        .payload(Report {
            customer: 0,
            why: "digest".into(),
        })
        .build()?;
    let cleanup = Schedule::builder("purge-old-images", &resize, "0 */15 * * * *")
        .payload(Image { id: 0 })
        .build()?;
    let beat = Schedule::builder("heartbeat", &heartbeat, "*/5 * * * * *").build()?;
    let claims: Arc<dyn jobrail::ClaimStore> = Arc::new(MemoryClaims::new());
    // A scheduler fires the heartbeat (the others are daily and quarter-hourly).
    let scheduler =
        jobrail_native::Scheduler::builder(Producer::new(driver.clone()), claims.clone())
            .schedule(beat.clone())
            .build()?
            .spawn();

    let operator =
        std::env::var("DEMO_OPERATOR_PASSWORD").unwrap_or_else(|_| "alice-password".into());
    let reader = std::env::var("DEMO_READER_PASSWORD").unwrap_or_else(|_| "bob-password".into());
    let mut builder = Dashboard::builder()
        .user("alice", operator, Role::Operator)
        .user("bob", reader, Role::ReadOnly)
        .source(source.schedules([beat, digest, cleanup], Some(claims)));
    if let Some(url) = edge {
        let token = std::env::var("EDGE_TOKEN").map_err(|_| "--edge needs EDGE_TOKEN")?;
        builder = builder.source(Source::edge("edge", url, token));
    }
    let dashboard = builder.build()?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("DASHBOARD_URL=http://{}", listener.local_addr()?);
    println!("QUEUES={reports_q},{images_q}");
    let server = axum::serve(listener, dashboard.router());
    let stdin_closed = async {
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin()
                .read_line(&mut sink)
                .map(|n| n > 0)
                .unwrap_or(false)
            {
                sink.clear();
            }
        })
        .await;
    };
    tokio::select! {
        r = server.into_future() => r?,
        _ = stdin_closed => {}
        _ = jobrail_native::shutdown_signal() => {}
    }
    scheduler.shutdown().await;
    consumer.shutdown().await?;
    if let Some(admin) = driver.admin() {
        if backend != "memory" {
            admin.delete_queue(&reports_q).await?;
            admin.delete_queue(&images_q).await?;
        }
    }
    driver.stop().await?;
    Ok(())
}
