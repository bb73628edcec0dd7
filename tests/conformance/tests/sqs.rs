//! The conformance suite against an SQS emulator (the `moto` server) at
//! `SQS_ENDPOINT`, for example `http://127.0.0.1:4517`.
//!
//! Run with
//! `SQS_ENDPOINT=$(tests/sqs-emulator) cargo test -p queue-conformance --features sqs --test sqs`.
//!
//! Short settings so the scenarios take seconds: a 2 s visibility timeout,
//! 1 s long polls. Every queue a test creates is deleted when it ends.
#![cfg(feature = "sqs")]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use queue::FailureRecord;
use queue_conformance::Backend;
use queue_native::{Driver, SqsConfig, SqsCredentials, SqsDriver};

fn config() -> SqsConfig {
    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "SQS_ENDPOINT is not set: start the emulator with `tests/sqs-emulator` and export \
             SQS_ENDPOINT=<the URL it prints> (e.g. http://127.0.0.1:4517)"
        )
    });
    SqsConfig::new("us-east-1")
        .endpoint(endpoint)
        .credentials(SqsCredentials::fixed("test", "test"))
        .visibility_timeout(Duration::from_secs(2))
        .wait_time(Duration::from_secs(1))
}

async fn connect() -> SqsDriver {
    match SqsDriver::connect(config()).await {
        Ok(driver) => driver,
        Err(e) => panic!(
            "the SQS emulator at SQS_ENDPOINT does not answer ({e}); start it with `tests/sqs-emulator`"
        ),
    }
}

/// A backend whose drivers talk to the emulator. Queues created by its
/// drivers are deleted when it is dropped.
#[derive(Default)]
struct Sqs {
    drivers: Mutex<Vec<SqsDriver>>,
}

#[async_trait]
impl Backend for Sqs {
    async fn connect(&self) -> Arc<dyn Driver> {
        let driver = connect().await;
        self.drivers.lock().unwrap().push(driver.clone());
        Arc::new(driver)
    }

    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        connect()
            .await
            .failure_records(queue)
            .await
            .expect("failure queue readable")
    }
}

impl Drop for Sqs {
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
                if let Ok(cleaner) = SqsDriver::connect(config()).await {
                    for driver in &drivers {
                        let _ = cleaner.delete_queues(&driver.created_queues()).await;
                    }
                }
            })
        });
    }
}

queue_conformance::conformance_suite!(Sqs::default());
