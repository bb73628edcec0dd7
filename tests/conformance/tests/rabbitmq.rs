//! The conformance suite against a real RabbitMQ broker (`RABBITMQ_URL`,
//! default `amqp://guest:guest@127.0.0.1:5672/%2f`).
//!
//! Run with `cargo test -p queue-conformance --features rabbitmq --test rabbitmq`.
#![cfg(feature = "rabbitmq")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use queue::FailureRecord;
use queue_conformance::Backend;
use queue_native::{Driver, RabbitConfig, RabbitDriver};

/// Small buckets so the scenarios' delays (tens to hundreds of ms) round up
/// to something short.
const BUCKETS_MS: &[u64] = &[50, 100, 250, 500, 1000, 2000, 5000];

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A backend whose drivers connect to the local broker. Queues declared by
/// its drivers are deleted when it is dropped.
#[derive(Default)]
struct Rabbit {
    drivers: Mutex<Vec<RabbitDriver>>,
}

impl Rabbit {
    fn config() -> RabbitConfig {
        let mut config = RabbitConfig::new(url())
            .delay_buckets(BUCKETS_MS.iter().map(|ms| Duration::from_millis(*ms)));
        config.connection_name = "conformance".into();
        config
    }
}

#[async_trait]
impl Backend for Rabbit {
    async fn connect(&self) -> Arc<dyn Driver> {
        let driver = RabbitDriver::connect(Self::config())
            .await
            .expect("RabbitMQ is reachable at RABBITMQ_URL");
        self.drivers.lock().unwrap().push(driver.clone());
        Arc::new(driver)
    }

    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        let driver = RabbitDriver::connect(Self::config())
            .await
            .expect("RabbitMQ is reachable");
        let records = driver
            .failure_records(queue)
            .await
            .expect("failure queue readable");
        self.drivers.lock().unwrap().push(driver);
        records
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        let drivers = std::mem::take(&mut *self.drivers.lock().unwrap());
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // The test's runtime is multi-threaded: finish cleaning up before it ends.
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                for driver in &drivers {
                    let _ = driver.stop().await;
                }
                if let Ok(cleaner) = RabbitDriver::connect(Self::config()).await {
                    for driver in &drivers {
                        let _ = cleaner.delete_queues(&driver.declared_queues()).await;
                    }
                    let _ = cleaner.stop().await;
                }
            })
        });
    }
}

queue_conformance::conformance_suite!(Rabbit::default());
