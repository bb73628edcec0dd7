//! The conformance suite against the in-memory driver.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jobrail::FailureRecord;
use jobrail_conformance::{conformance_suite, Backend};
use jobrail_native::{Driver, MemoryConfig, MemoryDriver};

struct Memory {
    driver: MemoryDriver,
}

impl Memory {
    fn new() -> Self {
        // A maximum delay lets the suite provoke a refused settlement.
        let config = MemoryConfig {
            max_retry_delay: Some(Duration::from_secs(3600)),
        };
        Memory {
            driver: MemoryDriver::new(config),
        }
    }
}

#[async_trait]
impl Backend for Memory {
    async fn connect(&self) -> Arc<dyn Driver> {
        Arc::new(self.driver.clone())
    }

    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        self.driver.failure_records(queue)
    }
}

conformance_suite!(Memory::new());
