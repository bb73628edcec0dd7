//! The conformance suite against a real NATS server with JetStream
//! (`NATS_URL`, default `nats://127.0.0.1:4222`).
//!
//! Run with `cargo test -p queue-conformance --features nats --test nats`.
#![cfg(feature = "nats")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use queue::FailureRecord;
use queue_conformance::Backend;
use queue_native::{Driver, NatsConfig, NatsDriver};

/// Short, so that redeliveries after a lost lease come quickly.
const ACK_WAIT: Duration = Duration::from_secs(2);

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A backend whose drivers connect to the local server. Each scenario's
/// queue name is unique, so its streams (`CONFORMANCE_<queue>` and
/// `CONFORMANCE_<queue>_failed`) are too; they are deleted when the backend
/// is dropped.
#[derive(Default)]
struct Nats {
    drivers: Mutex<Vec<NatsDriver>>,
}

impl Nats {
    fn config() -> NatsConfig {
        let mut config = NatsConfig::new(url()).ack_wait(ACK_WAIT);
        config.subject_prefix = "conformance".into();
        config.stream_prefix = "CONFORMANCE".into();
        config.fetch_expiry = Duration::from_secs(2);
        config.connection_name = "conformance".into();
        config
    }
}

#[async_trait]
impl Backend for Nats {
    async fn connect(&self) -> Arc<dyn Driver> {
        let driver = NatsDriver::connect(Self::config())
            .await
            .expect("NATS is reachable at NATS_URL");
        self.drivers.lock().unwrap().push(driver.clone());
        Arc::new(driver)
    }

    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        let driver = NatsDriver::connect(Self::config())
            .await
            .expect("NATS is reachable");
        let records = driver
            .failure_records(queue)
            .await
            .expect("failure stream readable");
        self.drivers.lock().unwrap().push(driver);
        records
    }
}

impl Drop for Nats {
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
                if let Ok(cleaner) = NatsDriver::connect(Self::config()).await {
                    for driver in &drivers {
                        let _ = cleaner.delete_streams(&driver.declared_streams()).await;
                    }
                    let _ = cleaner.stop().await;
                }
            })
        });
    }
}

queue_conformance::conformance_suite!(Nats::default());
