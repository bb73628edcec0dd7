//! A worker for the RabbitMQ crash test (`tests/rabbitmq_extra.rs`).
//!
//! `rabbitmq_kill_worker <queue> <job> <attempt cap>` consumes `<queue>` from
//! `RABBITMQ_URL`; its handler prints `attempt N` on stdout and then hangs,
//! so the test can SIGKILL the process while the job runs.

#[cfg(not(feature = "rabbitmq"))]
fn main() {
    eprintln!("rabbitmq_kill_worker needs the `rabbitmq` feature of queue-conformance");
    std::process::exit(2);
}

#[cfg(feature = "rabbitmq")]
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    use std::io::Write;
    use std::sync::Arc;

    use queue::{Job, JobContext, Registry};
    use queue_conformance::scenarios::Work;
    use queue_native::{Consumer, RabbitConfig, RabbitDriver};

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
    let job = Job::<Work>::builder(name)
        .queue(queue)
        .retry(cap)
        .build()
        .expect("job");
    let mut registry = Registry::new();
    registry
        .register(&job, |ctx: JobContext, _work: Work| async move {
            {
                let mut out = std::io::stdout().lock();
                writeln!(out, "attempt {}", ctx.attempt()).expect("stdout");
                out.flush().expect("stdout");
            }
            // Hang until the test kills the process.
            std::future::pending::<()>().await;
            Ok(())
        })
        .expect("register");
    let consumer = Consumer::builder(Arc::new(driver), registry)
        .concurrency(1)
        .build()
        .spawn();
    std::future::pending::<()>().await;
    drop(consumer);
}
