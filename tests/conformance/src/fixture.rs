//! Broker fixtures: a [`Backend`] for a real broker that tracks every
//! driver a test connects and, when the test ends, stops them and deletes
//! the queues (or streams) they declared, so runs leave nothing behind.
//!
//! A driver plugs in by implementing [`Broker`]; the shipped drivers'
//! implementations are here, behind the same features as the drivers.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use queue::FailureRecord;
use queue_native::{Driver, DriverError};

use crate::harness::Backend;

/// What the fixture needs from a broker driver.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// The driver.
    type Driver: Driver + Clone;
    /// Its configuration.
    type Config: Clone + Send + Sync + 'static;
    /// Where the broker is expected, for failure messages.
    const WHERE: &'static str;
    /// Connects a driver.
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError>;
    /// Failure records transferred for `queue`, without consuming them.
    async fn failure_records(
        driver: &Self::Driver,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, DriverError>;
    /// The queues or streams `driver` declared.
    fn declared(driver: &Self::Driver) -> Vec<String>;
    /// Deletes queues or streams by name.
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError>;
}

/// A [`Backend`] on a real broker that cleans up after itself.
pub struct Fixture<B: Broker> {
    config: B::Config,
    drivers: Mutex<Vec<B::Driver>>,
    extra: Mutex<Vec<String>>,
}

impl<B: Broker> Fixture<B> {
    /// A fixture whose drivers use `config`.
    pub fn new(config: B::Config) -> Self {
        Fixture {
            config,
            drivers: Mutex::default(),
            extra: Mutex::default(),
        }
    }

    /// The configuration (a copy, to adjust for one driver).
    pub fn config(&self) -> B::Config {
        self.config.clone()
    }

    /// A connected, tracked driver.
    pub async fn driver(&self) -> B::Driver {
        self.driver_with(self.config()).await
    }

    /// A tracked driver with another configuration.
    pub async fn driver_with(&self, config: B::Config) -> B::Driver {
        let driver = B::connect(config)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", B::WHERE));
        self.drivers.lock().unwrap().push(driver.clone());
        driver
    }

    /// Deletes `name` too at the end (a queue made outside the driver).
    pub fn delete_later(&self, name: impl Into<String>) {
        self.extra.lock().unwrap().push(name.into());
    }
}

#[async_trait]
impl<B: Broker> Backend for Fixture<B> {
    async fn connect(&self) -> Arc<dyn Driver> {
        Arc::new(self.driver().await)
    }

    async fn failure_records(&self, queue: &str) -> Vec<FailureRecord> {
        let driver = self.driver().await;
        B::failure_records(&driver, queue)
            .await
            .unwrap_or_else(|e| panic!("failure records of `{queue}` unreadable: {e}"))
    }
}

impl<B: Broker> Drop for Fixture<B> {
    fn drop(&mut self) {
        let drivers = std::mem::take(&mut *self.drivers.lock().unwrap());
        let mut names: Vec<String> = drivers.iter().flat_map(B::declared).collect();
        names.extend(std::mem::take(&mut *self.extra.lock().unwrap()));
        names.sort();
        names.dedup();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let config = self.config();
        // Tests run on a multi-threaded runtime: finish cleaning up before it ends.
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                for driver in &drivers {
                    let _ = driver.stop().await;
                }
                if let Ok(cleaner) = B::connect(config).await {
                    let _ = B::delete(&cleaner, &names).await;
                    let _ = cleaner.stop().await;
                }
            })
        });
    }
}

/// RabbitMQ (`queue_native::RabbitDriver`).
#[cfg(feature = "rabbitmq")]
pub struct RabbitMq;

#[cfg(feature = "rabbitmq")]
#[async_trait]
impl Broker for RabbitMq {
    type Driver = queue_native::RabbitDriver;
    type Config = queue_native::RabbitConfig;
    const WHERE: &'static str = "RabbitMQ at RABBITMQ_URL";

    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        queue_native::RabbitDriver::connect(config).await
    }
    async fn failure_records(
        driver: &Self::Driver,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, DriverError> {
        driver.failure_records(queue).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.declared_queues()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_queues(names).await
    }
}

/// NATS JetStream (`queue_native::NatsDriver`).
#[cfg(feature = "nats")]
pub struct Nats;

#[cfg(feature = "nats")]
#[async_trait]
impl Broker for Nats {
    type Driver = queue_native::NatsDriver;
    type Config = queue_native::NatsConfig;
    const WHERE: &'static str = "NATS at NATS_URL";

    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        queue_native::NatsDriver::connect(config).await
    }
    async fn failure_records(
        driver: &Self::Driver,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, DriverError> {
        driver.failure_records(queue).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.declared_streams()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_streams(names).await
    }
}

/// Amazon SQS (`queue_native::SqsDriver`), usually against the emulator.
#[cfg(feature = "sqs")]
pub struct Sqs;

#[cfg(feature = "sqs")]
#[async_trait]
impl Broker for Sqs {
    type Driver = queue_native::SqsDriver;
    type Config = queue_native::SqsConfig;
    const WHERE: &'static str =
        "the SQS emulator at SQS_ENDPOINT (start it with tests/sqs-emulator)";

    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        queue_native::SqsDriver::connect(config).await
    }
    async fn failure_records(
        driver: &Self::Driver,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, DriverError> {
        driver.failure_records(queue).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.created_queues()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_queues(names).await
    }
}
