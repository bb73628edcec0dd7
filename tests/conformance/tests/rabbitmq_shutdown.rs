//! A clean shutdown on RabbitMQ logs no error: a program that consumes,
//! shuts its consumer down, stops the driver and returns (dropping its tokio
//! runtime) must not leave lapin's IO loop to report the runtime's shutdown
//! as an I/O error. Before `stop` waited for that loop, about one run in
//! two logged `error doing IO ... Tokio 1.x context ... being shutdown`.
//!
//! Its own test binary: it installs a global subscriber that collects every
//! error-level event of the process, lapin's included.
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq --test rabbitmq_shutdown`.
#![cfg(feature = "rabbitmq")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{Job, JobContext, Registry};
use jobrail_conformance::scenarios::Work;
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Consumer, Driver, Producer};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Rounds of connect, consume, shutdown, stop and runtime drop.
const ROUNDS: usize = 12;

/// Keeps the target and message of every error-level event, with the
/// lapin events that led to it.
#[derive(Default)]
struct Log {
    errors: Vec<String>,
    recent: std::collections::VecDeque<String>,
}

struct Errors(Arc<Mutex<Log>>);

impl<S: Subscriber> Layer<S> for Errors {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if !self.0.is_empty() {
                    self.0.push(' ');
                }
                self.0.push_str(&format!("{}={value:?}", field.name()));
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        let meta = event.metadata();
        let line = format!("{} {}: {}", meta.level(), meta.target(), message.0);
        let mut log = self.0.lock().unwrap();
        if *meta.level() == Level::ERROR {
            let context: Vec<String> = log.recent.drain(..).collect();
            log.errors
                .push(format!("{line}\n  after:\n    {}", context.join("\n    ")));
        } else if meta.target().starts_with("lapin") || meta.target().starts_with("queue") {
            if log.recent.len() == 40 {
                log.recent.pop_front();
            }
            log.recent.push_back(line);
        }
    }
}

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

#[test]
fn a_clean_shutdown_logs_no_error() {
    let log = Arc::new(Mutex::new(Log::default()));
    tracing_subscriber::registry()
        .with(Errors(log.clone()))
        .try_init()
        .expect("the only subscriber of this test binary");
    let queue = format!("shutdown-clean-{}", std::process::id());
    for round in 0..ROUNDS {
        // A runtime per round, dropped at the end as `main` returning drops its own.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let queue = queue.clone();
        runtime.block_on(async move {
            let mut config = RabbitConfig::new(url());
            config.connection_name = "shutdown-clean".into();
            let driver = Arc::new(RabbitDriver::connect(config).await.expect("connect"));
            let job = Job::<Work>::builder("clean")
                .queue(queue.clone())
                .build()
                .expect("job");
            let done = Arc::new(tokio::sync::Semaphore::new(0));
            let mut registry = Registry::new();
            let seen = done.clone();
            registry
                .register(&job, move |_: JobContext, _: Work| {
                    let seen = seen.clone();
                    async move {
                        seen.add_permits(1);
                        Ok(())
                    }
                })
                .expect("register");
            let producer = Producer::new(driver.clone());
            for id in 0..5 {
                producer
                    .dispatch(&job)
                    .send(&Work { id })
                    .await
                    .expect("dispatch");
            }
            let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
            let all = tokio::time::timeout(Duration::from_secs(30), done.acquire_many(5)).await;
            all.expect("the five jobs ran").expect("semaphore").forget();
            consumer.shutdown().await.expect("consumer shutdown");
            if round == ROUNDS - 1 {
                driver
                    .delete_queues(&driver.declared_queues())
                    .await
                    .expect("delete the queue");
            }
            driver.stop().await.expect("driver stop");
        });
        drop(runtime);
        // lapin's own threads log after the runtime is gone, if at all.
        std::thread::sleep(Duration::from_millis(100));
    }
    let errors = &log.lock().unwrap().errors;
    assert!(
        errors.is_empty(),
        "{} error-level events in {ROUNDS} clean shutdowns:\n{}",
        errors.len(),
        errors.join("\n")
    );
}
