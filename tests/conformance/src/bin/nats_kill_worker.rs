//! A worker for the NATS crash test (`tests/nats_extra.rs`).
//!
//! `nats_kill_worker <queue> <job> <attempt cap> <stream prefix> <subject prefix> <ack wait ms>`
//! consumes `<queue>` from `NATS_URL` with the given topology settings (they
//! must match the test's, or the driver reports a conflicting consumer); its
//! handler prints `attempt N` on stdout and then hangs (nothing cancels it),
//! so the test can SIGKILL the process while the job runs.

#[cfg(not(feature = "nats"))]
fn main() {
    eprintln!("nats_kill_worker needs the `nats` feature of jobrail-conformance");
    std::process::exit(2);
}

#[cfg(feature = "nats")]
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    use std::sync::Arc;
    use std::time::Duration;

    use jobrail_native::nats::{NatsConfig, NatsDriver};
    use jobrail_native::Consumer;

    let args: Vec<String> = std::env::args().skip(1).collect();
    let [queue, name, cap, stream_prefix, subject_prefix, ack_wait_ms] = args.as_slice() else {
        eprintln!(
            "usage: nats_kill_worker <queue> <job> <attempt cap> <stream prefix> <subject prefix> <ack wait ms>"
        );
        std::process::exit(2);
    };
    let cap: u32 = cap.parse().expect("attempt cap is a number");
    let ack_wait: u64 = ack_wait_ms.parse().expect("ack wait is a number of ms");
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let mut config = NatsConfig::new(url).ack_wait(Duration::from_millis(ack_wait));
    config.stream_prefix = stream_prefix.clone();
    config.subject_prefix = subject_prefix.clone();
    config.connection_name = "kill-worker".into();
    let driver = NatsDriver::connect(config).await.expect("connect");
    let registry = jobrail_conformance::crash::announcing_registry(queue, name, cap);
    // Runs until killed; a consumer that cannot subscribe says why and exits.
    let ended = Consumer::builder(Arc::new(driver), registry)
        .concurrency(1)
        .build()
        .run(jobrail::CancelToken::new())
        .await;
    eprintln!("nats_kill_worker: the consumer ended: {ended:?}");
    std::process::exit(1);
}
