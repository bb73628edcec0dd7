//! A worker for the RabbitMQ crash test (`tests/rabbitmq_extra.rs`).
//!
//! `rabbitmq_kill_worker <queue> <job> <attempt cap>` consumes `<queue>` from
//! `RABBITMQ_URL`; its handler prints `attempt N` on stdout and then waits
//! for shutdown, so the test can SIGKILL the process while the job runs, or
//! send SIGTERM and watch it shut down gracefully: each accepted outcome is
//! printed as `event <name> shutdown=<bool>`, and `stopped` at the end.

#[cfg(not(feature = "rabbitmq"))]
fn main() {
    eprintln!("rabbitmq_kill_worker needs the `rabbitmq` feature of jobrail-conformance");
    std::process::exit(2);
}

#[cfg(feature = "rabbitmq")]
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    use std::sync::Arc;

    use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
    use jobrail_native::{Consumer, Driver};

    let mut args = std::env::args().skip(1);
    let (Some(queue), Some(name), Some(cap)) = (args.next(), args.next(), args.next()) else {
        eprintln!("usage: rabbitmq_kill_worker <queue> <job> <attempt cap>");
        std::process::exit(2);
    };
    let cap: u32 = cap.parse().expect("attempt cap is a number");
    let url = std::env::var("RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let mut config = RabbitConfig::new(url);
    config.connection_name = "kill-worker".into();
    let driver = RabbitDriver::connect(config).await.expect("connect");
    let mut registry = jobrail_conformance::crash::announcing_registry(&queue, &name, cap);
    registry.event_sink(Arc::new(PrintEvents));
    Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(1)
        .build()
        .run_until_signal()
        .await
        .expect("graceful shutdown");
    driver.stop().await.expect("stop the driver");
    println!("stopped");
}

/// Prints each accepted outcome for the parent test.
#[cfg(feature = "rabbitmq")]
struct PrintEvents;

#[cfg(feature = "rabbitmq")]
impl jobrail::EventSink for PrintEvents {
    fn emit(&self, event: &jobrail::Event) {
        use std::io::Write;
        let shutdown = matches!(
            event.kind,
            jobrail::EventKind::Retried { shutdown: true, .. }
        );
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "event {} shutdown={shutdown}", event.kind.name());
        let _ = out.flush();
    }
}
