//! Broker fixtures: a [`Backend`] for a real broker that tracks every
//! driver a test connects and, when the test ends, stops them and deletes
//! the queues (or streams) they declared, so runs leave nothing behind.
//!
//! A driver plugs in by implementing [`Broker`]; the shipped drivers'
//! implementations are here, behind the same features as the drivers.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use jobrail_native::{Driver, DriverError};

use crate::harness::{Backend, Hooks, Unreachable};

/// What the fixture needs from a broker driver.
#[async_trait]
pub trait Broker: Send + Sync + 'static {
    /// The driver.
    type Driver: Driver + Clone;
    /// Its configuration (whose `Debug` must hide secrets).
    type Config: Clone + Debug + Send + Sync + 'static;
    /// Where the broker is expected, for failure messages.
    const WHERE: &'static str;
    /// A driver, without I/O.
    fn new(config: Self::Config) -> Result<Self::Driver, DriverError>;
    /// Connects a driver.
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError>;
    /// Puts `body` among `queue`'s failure entries as it is
    /// ([`Backend::inject_failure_body`]). Failure records themselves are
    /// read through the driver's failure store.
    async fn inject_failure_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError>;
    /// Puts `body` on the work queue `queue` as it is, through the
    /// broker's own client, with none of the facade's checks (its size
    /// limit included) ([`Backend::inject_body`]).
    async fn inject_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError>;
    /// The queues or streams `driver` declared.
    fn declared(driver: &Self::Driver) -> Vec<String>;
    /// Deletes queues or streams by name.
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError>;

    /// `config` with a short hold on deliveries ([`Backend::short_hold`]);
    /// `None` (the default) where the broker holds none.
    fn short_hold(config: &Self::Config) -> Option<Self::Config> {
        let _ = config;
        None
    }

    /// `config` for a driver on which the broker ends a message after
    /// `deliveries` deliveries ([`Backend::delivery_limited`]); `None` (the
    /// default) where it has no such limit.
    fn delivery_limited(config: &Self::Config, deliveries: u32) -> Option<Self::Config> {
        let _ = (config, deliveries);
        None
    }

    /// Prepares `queue` for [`delivery_limited`](Self::delivery_limited)
    /// where the limit belongs to the queue rather than to the driver's
    /// configuration; returns the names to delete afterwards. The default
    /// prepares nothing.
    async fn limit_queue(config: &Self::Config, queue: &str, deliveries: u32) -> Vec<String> {
        let _ = (config, queue, deliveries);
        Vec::new()
    }

    /// Configurations holding secrets, pointed where nothing listens, and
    /// the secrets ([`Backend::unreachable`]); `None` (the default) where
    /// the configuration holds none.
    fn unreachable(config: &Self::Config) -> Option<(Vec<Self::Config>, Vec<String>)> {
        let _ = config;
        None
    }
}

/// A loopback address nothing listens on (a port bound, then released).
pub fn closed_address() -> String {
    format!("127.0.0.1:{}", crate::servers::free_port())
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

    async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        B::inject_failure_body(&self.driver().await, queue, body).await
    }

    async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        B::inject_body(&self.driver().await, queue, body).await
    }

    fn hooks(&self) -> Hooks {
        Hooks {
            short_hold: B::short_hold(&self.config).is_some(),
            delivery_limit: B::delivery_limited(&self.config, 2).is_some(),
            unreachable: B::unreachable(&self.config).is_some(),
            inject_failure_body: true,
            inject_body: true,
        }
    }

    async fn short_hold(&self) -> Option<Arc<dyn Driver>> {
        let config = B::short_hold(&self.config)?;
        Some(Arc::new(self.driver_with(config).await))
    }

    async fn delivery_limited(&self, queue: &str, deliveries: u32) -> Option<Arc<dyn Driver>> {
        let config = B::delivery_limited(&self.config, deliveries)?;
        for name in B::limit_queue(&config, queue, deliveries).await {
            self.delete_later(name);
        }
        Some(Arc::new(self.driver_with(config).await))
    }

    async fn unreachable(&self) -> Option<Unreachable> {
        let (configs, secrets) = B::unreachable(&self.config)?;
        let mut unreachable = Unreachable {
            secrets,
            configs: configs.iter().map(|c| format!("{c:?}")).collect(),
            drivers: Vec::new(),
            connected: Vec::new(),
        };
        for config in configs {
            let driver = B::new(config.clone())
                .unwrap_or_else(|e| panic!("a driver is made without I/O: {e}"));
            unreachable.drivers.push(Arc::new(driver));
            let connected = B::connect(config).await;
            unreachable
                .connected
                .push(connected.map(|d| Arc::new(d) as Arc<dyn Driver>));
        }
        Some(unreachable)
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

/// RabbitMQ (`jobrail_native::rabbitmq::RabbitDriver`).
#[cfg(feature = "rabbitmq")]
pub struct RabbitMq;

#[cfg(feature = "rabbitmq")]
#[async_trait]
impl Broker for RabbitMq {
    type Driver = jobrail_native::rabbitmq::RabbitDriver;
    type Config = jobrail_native::rabbitmq::RabbitConfig;
    const WHERE: &'static str = "RabbitMQ at RABBITMQ_URL";

    fn new(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::rabbitmq::RabbitDriver::new(config)
    }
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::rabbitmq::RabbitDriver::connect(config).await
    }
    async fn inject_failure_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_failure_body(queue, body).await
    }
    async fn inject_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_body(queue, body).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.declared_queues()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_queues(names).await
    }

    /// A quorum queue's delivery limit counts returns: it gives one
    /// delivery more than the limit.
    fn delivery_limited(config: &Self::Config, deliveries: u32) -> Option<Self::Config> {
        let mut config = config.clone();
        config.delivery_limit = Some(deliveries.checked_sub(1)?);
        Some(config)
    }

    fn unreachable(config: &Self::Config) -> Option<(Vec<Self::Config>, Vec<String>)> {
        const SECRET: &str = "conformance-rabbit-secret";
        // The same scheme: a TLS configuration keeps its certificates.
        let scheme = config.url.split_once("://").map_or("amqp", |(s, _)| s);
        let mut unreachable = config.clone();
        unreachable.url = format!("{scheme}://guest:{SECRET}@{}/%2f", closed_address());
        Some((vec![unreachable], vec![SECRET.into()]))
    }
}

/// NATS JetStream (`jobrail_native::nats::NatsDriver`).
#[cfg(feature = "nats")]
pub struct Nats;

#[cfg(feature = "nats")]
#[async_trait]
impl Broker for Nats {
    type Driver = jobrail_native::nats::NatsDriver;
    type Config = jobrail_native::nats::NatsConfig;
    const WHERE: &'static str = "NATS at NATS_URL";

    fn new(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::nats::NatsDriver::new(config)
    }
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::nats::NatsDriver::connect(config).await
    }
    async fn inject_failure_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_failure_body(queue, body).await
    }
    async fn inject_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_body(queue, body).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.declared_streams()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_streams(names).await
    }

    /// AckWait of one second.
    fn short_hold(config: &Self::Config) -> Option<Self::Config> {
        Some(config.clone().ack_wait(std::time::Duration::from_secs(1)))
    }

    /// The consumer's MaxDeliver.
    fn delivery_limited(config: &Self::Config, deliveries: u32) -> Option<Self::Config> {
        let mut config = config.clone();
        config.max_deliver = Some(deliveries);
        Some(config)
    }

    /// A user and password, and a token, in the URL.
    fn unreachable(config: &Self::Config) -> Option<(Vec<Self::Config>, Vec<String>)> {
        const PASSWORD: &str = "conformance-nats-password";
        const TOKEN: &str = "conformance-nats-token";
        let at = |credentials: &str| {
            let mut unreachable = config.clone();
            unreachable.url = format!("nats://{credentials}@{}", closed_address());
            unreachable.operation_timeout = std::time::Duration::from_secs(2);
            unreachable
        };
        Some((
            vec![at(&format!("ada:{PASSWORD}")), at(TOKEN)],
            vec![PASSWORD.into(), TOKEN.into()],
        ))
    }
}

/// The emulator at `SQS_ENDPOINT` (start it with `tests/sqs-emulator`),
/// with its `test` keys and short settings so scenarios take seconds: a
/// 2 s visibility timeout, 1 s long polls.
#[cfg(feature = "sqs")]
pub fn sqs_emulator_config() -> jobrail_native::sqs::SqsConfig {
    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "SQS_ENDPOINT is not set: start the emulator with `tests/sqs-emulator` and export \
             SQS_ENDPOINT=<the URL it prints> (e.g. http://127.0.0.1:4517)"
        )
    });
    jobrail_native::sqs::SqsConfig::new("us-east-1")
        .endpoint(endpoint)
        .credentials(jobrail_native::sqs::SqsCredentials::fixed("test", "test"))
        .visibility_timeout(std::time::Duration::from_secs(2))
        .wait_time(std::time::Duration::from_secs(1))
        // Short, so the suite's longer delays are carried in steps.
        .max_dispatch_delay(std::time::Duration::from_secs(1))
}

/// Amazon SQS (`jobrail_native::sqs::SqsDriver`), usually against the emulator.
#[cfg(feature = "sqs")]
pub struct Sqs;

#[cfg(feature = "sqs")]
#[async_trait]
impl Broker for Sqs {
    type Driver = jobrail_native::sqs::SqsDriver;
    type Config = jobrail_native::sqs::SqsConfig;
    const WHERE: &'static str =
        "the SQS emulator at SQS_ENDPOINT (start it with tests/sqs-emulator)";

    fn new(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::sqs::SqsDriver::new(config)
    }
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_native::sqs::SqsDriver::connect(config).await
    }
    async fn inject_failure_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_failure_body(queue, body).await
    }
    async fn inject_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_body(queue, body).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.created_queues()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_queues(names).await
    }

    /// The visibility timeout, two seconds.
    fn short_hold(config: &Self::Config) -> Option<Self::Config> {
        Some(
            config
                .clone()
                .visibility_timeout(std::time::Duration::from_secs(2)),
        )
    }

    /// The limit belongs to the queue (its redrive policy).
    fn delivery_limited(config: &Self::Config, _deliveries: u32) -> Option<Self::Config> {
        Some(config.clone())
    }

    /// Creates `queue` with a redrive policy whose `maxReceiveCount` is
    /// `deliveries`, and its dead-letter queue.
    async fn limit_queue(config: &Self::Config, queue: &str, deliveries: u32) -> Vec<String> {
        let dead_letters = format!("{queue}-dlq");
        Self::new(config.clone())
            .unwrap_or_else(|e| panic!("a driver is made without I/O: {e}"))
            .create_queue_with_redrive(queue, &dead_letters, deliveries)
            .await
            .unwrap_or_else(|e| panic!("creating `{queue}` with a redrive policy: {e}"));
        vec![queue.to_string(), dead_letters]
    }

    /// Static keys and a session token.
    fn unreachable(config: &Self::Config) -> Option<(Vec<Self::Config>, Vec<String>)> {
        const ACCESS_KEY: &str = "AKIACONFORMANCEPROBE";
        const SECRET_KEY: &str = "conformanceProbeSecret/0123456789abcdef";
        const TOKEN: &str = "conformanceProbeSessionToken0123456789";
        let mut unreachable = config.clone();
        unreachable.endpoint = Some(format!("http://{}", closed_address()));
        unreachable.operation_timeout = std::time::Duration::from_secs(1);
        unreachable.credentials = jobrail_native::sqs::SqsCredentials::Static {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: Some(TOKEN.into()),
        };
        Some((
            vec![unreachable],
            vec![ACCESS_KEY.into(), SECRET_KEY.into(), TOKEN.into()],
        ))
    }
}

/// The Postgres queue (`jobrail_postgres::PgDriver`), in a schema of the
/// suite's own, installed (idempotently) before each driver connects.
#[cfg(feature = "postgres")]
pub struct Postgres;

/// The suite's Postgres settings: the database at `DATABASE_URL` (default
/// `postgres://postgres@127.0.0.1:5432/test`), schema `schema`, a lease of
/// two seconds (a retry without a delay comes back one lease later, so the
/// scenarios take seconds) and a size limit of 256 KiB so that the size
/// scenarios run with small bodies.
#[cfg(feature = "postgres")]
pub fn postgres_config(schema: &str) -> jobrail_postgres::PgConfig {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let mut config = jobrail_postgres::PgConfig::new(&url)
        .unwrap_or_else(|e| panic!("DATABASE_URL: {e}"))
        .schema(schema);
    config.max_message_bytes = 256 * 1024;
    config.lease(std::time::Duration::from_secs(2))
}

#[cfg(feature = "postgres")]
#[async_trait]
impl Broker for Postgres {
    type Driver = jobrail_postgres::PgDriver;
    type Config = jobrail_postgres::PgConfig;
    const WHERE: &'static str = "Postgres at DATABASE_URL";

    fn new(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_postgres::PgDriver::new(config)
    }
    async fn connect(config: Self::Config) -> Result<Self::Driver, DriverError> {
        jobrail_postgres::PgDriver::install(&config).await?;
        jobrail_postgres::PgDriver::connect(config).await
    }
    async fn inject_failure_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_failure_body(queue, body).await
    }
    async fn inject_body(
        driver: &Self::Driver,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<(), DriverError> {
        driver.inject_body(queue, body).await
    }
    fn declared(driver: &Self::Driver) -> Vec<String> {
        driver.declared_queues()
    }
    async fn delete(cleaner: &Self::Driver, names: &[String]) -> Result<(), DriverError> {
        cleaner.delete_queues(names).await
    }

    /// A lease of one second (the shortest there is).
    fn short_hold(config: &Self::Config) -> Option<Self::Config> {
        Some(config.clone().lease(std::time::Duration::from_secs(1)))
    }

    /// A password in the URL, pointed where nothing listens.
    fn unreachable(config: &Self::Config) -> Option<(Vec<Self::Config>, Vec<String>)> {
        const PASSWORD: &str = "conformance-postgres-password";
        let url = format!("postgres://app:{PASSWORD}@{}/test", closed_address());
        let mut unreachable = jobrail_postgres::PgConfig::new(&url)
            .unwrap_or_else(|e| panic!("a URL that parses: {e}"))
            .schema(config.schema_name());
        unreachable.connect = unreachable.connect.clone().reconnect_wait(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(10),
        );
        Some((vec![unreachable], vec![PASSWORD.into()]))
    }
}
