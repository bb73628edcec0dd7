//! Connecting a backend with the suite's settings, shared by the
//! orchestrator and its workers (they must agree on the topology: prefixes,
//! lease), reading failure records and deleting a run's queues.

use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use jobrail::FailureRecord;
use jobrail_native::{Driver, DriverError};

/// The environment variable carrying the broker URL (with the run's
/// credentials) or the SQS endpoint to a worker.
pub(crate) const URL_VAR: &str = "FAULTS_URL";
/// The SQS access key id a worker uses.
pub(crate) const SQS_KEY_VAR: &str = "FAULTS_SQS_KEY_ID";
/// The SQS secret access key a worker uses.
pub(crate) const SQS_SECRET_VAR: &str = "FAULTS_SQS_SECRET";
/// The bound on each broker round trip a worker uses, in ms.
pub(crate) const OPERATION_TIMEOUT_VAR: &str = "FAULTS_OPERATION_TIMEOUT_MS";
/// The schema of the Postgres queue a worker uses.
pub(crate) const PG_SCHEMA_VAR: &str = "FAULTS_PG_SCHEMA";

/// A backend the suite can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub(crate) enum Kind {
    /// The in-process memory driver.
    Memory,
    /// RabbitMQ (feature `rabbitmq`).
    Rabbitmq,
    /// NATS JetStream (feature `nats`).
    Nats,
    /// SQS, usually the emulator (feature `sqs`).
    Sqs,
    /// The Postgres queue driver, `PgDriver` (feature `postgres-queue`).
    Postgres,
}

impl Kind {
    /// The name used in the report and in queue names.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::Rabbitmq => "rabbitmq",
            Kind::Nats => "nats",
            Kind::Sqs => "sqs",
            Kind::Postgres => "postgres",
        }
    }

    /// The Cargo feature of jobrail-faults that builds the driver.
    pub(crate) fn feature(self) -> &'static str {
        match self {
            Kind::Postgres => "postgres-queue",
            other => other.name(),
        }
    }

    /// Whether this build has the driver.
    pub(crate) fn built(self) -> bool {
        match self {
            Kind::Memory => true,
            Kind::Rabbitmq => cfg!(feature = "rabbitmq"),
            Kind::Nats => cfg!(feature = "nats"),
            Kind::Sqs => cfg!(feature = "sqs"),
            Kind::Postgres => cfg!(feature = "postgres-queue"),
        }
    }
}

/// Where and how to connect.
#[derive(Clone)]
pub(crate) struct Target {
    /// The backend.
    pub(crate) kind: Kind,
    /// The broker URL (credentials included) or the SQS endpoint.
    pub(crate) url: String,
    /// SQS static keys.
    pub(crate) sqs_keys: Option<(String, String)>,
    /// NATS AckWait / SQS visibility timeout (ignored elsewhere).
    pub(crate) lease: Duration,
    /// Bound on each broker round trip (the drivers' default is 10 s).
    pub(crate) operation_timeout: Duration,
    /// The Postgres queue's schema (the run's own).
    pub(crate) pg_schema: Option<String>,
    /// Whether a worker process connects (Postgres: its connections carry
    /// the application name `<schema>_worker`, the orchestrator's
    /// `<schema>_orchestrator`, so that only the workers' are terminated).
    #[cfg_attr(not(feature = "postgres-queue"), allow(dead_code))]
    pub(crate) worker: bool,
}

impl Target {
    /// The target a worker was started with (see [`Target::env`]).
    pub(crate) fn from_env(kind: Kind, lease: Duration) -> Self {
        let keys = match (std::env::var(SQS_KEY_VAR), std::env::var(SQS_SECRET_VAR)) {
            (Ok(k), Ok(s)) => Some((k, s)),
            _ => None,
        };
        Target {
            kind,
            url: std::env::var(URL_VAR).unwrap_or_default(),
            sqs_keys: keys,
            lease,
            operation_timeout: std::env::var(OPERATION_TIMEOUT_VAR)
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map_or(Duration::from_secs(10), Duration::from_millis),
            pg_schema: std::env::var(PG_SCHEMA_VAR).ok(),
            worker: true,
        }
    }

    /// The environment a worker needs to connect like this target.
    pub(crate) fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (URL_VAR, self.url.clone()),
            (
                OPERATION_TIMEOUT_VAR,
                self.operation_timeout.as_millis().to_string(),
            ),
        ];
        if let Some((k, s)) = &self.sqs_keys {
            env.push((SQS_KEY_VAR, k.clone()));
            env.push((SQS_SECRET_VAR, s.clone()));
        }
        if let Some(schema) = &self.pg_schema {
            env.push((PG_SCHEMA_VAR, schema.clone()));
        }
        env
    }

    /// A copy with another lease.
    pub(crate) fn with_lease(&self, lease: Duration) -> Self {
        let mut t = self.clone();
        t.lease = lease;
        t
    }
}

/// The SQS settings of `target`.
#[cfg(feature = "sqs")]
fn sqs_config(target: &Target) -> jobrail_native::sqs::SqsConfig {
    let (key, secret) = target
        .sqs_keys
        .clone()
        .unwrap_or_else(|| ("test".into(), "test".into()));
    let mut config = jobrail_native::sqs::SqsConfig::new("us-east-1")
        .endpoint(target.url.clone())
        .credentials(jobrail_native::sqs::SqsCredentials::fixed(key, secret))
        .visibility_timeout(Duration::from_secs(target.lease.as_secs().max(1)))
        .wait_time(Duration::from_secs(1));
    config.operation_timeout = target.operation_timeout;
    config
}

/// The Postgres queue settings of `target`: its schema, its lease, the
/// application name of its role, reconnection waits of 50 ms to 1 s.
#[cfg(feature = "postgres-queue")]
pub(crate) fn pg_config(target: &Target) -> Result<jobrail_postgres::PgConfig, DriverError> {
    use jobrail_postgres::{tokio_postgres, PgConfig, PgConnect};
    let config_error =
        |e: String| DriverError::new("jobrail-faults", jobrail_native::ErrorKind::Config, e);
    let schema = target
        .pg_schema
        .clone()
        .ok_or_else(|| config_error("the Postgres queue target has no schema".into()))?;
    let mut config: tokio_postgres::Config = target
        .url
        .parse()
        .map_err(|e| config_error(format!("the Postgres URL does not parse: {e}")))?;
    let role = if target.worker {
        "worker"
    } else {
        "orchestrator"
    };
    config.application_name(format!("{schema}_{role}"));
    config.connect_timeout(Duration::from_secs(5));
    let connect = PgConnect::from_config(config)
        .reconnect_wait(Duration::from_millis(50), Duration::from_secs(1))
        .operation_timeout(target.operation_timeout);
    let mut config = PgConfig::with_connect(connect)
        .schema(schema)
        .lease(target.lease.max(Duration::from_secs(1)));
    config.poll_interval = Duration::from_millis(500);
    Ok(config)
}

/// A connected driver of any kind.
#[derive(Clone)]
pub(crate) enum Conn {
    Memory(jobrail_native::MemoryDriver),
    #[cfg(feature = "rabbitmq")]
    Rabbit(jobrail_native::rabbitmq::RabbitDriver),
    #[cfg(feature = "nats")]
    Nats(jobrail_native::nats::NatsDriver),
    #[cfg(feature = "sqs")]
    Sqs(jobrail_native::sqs::SqsDriver),
    #[cfg(feature = "postgres-queue")]
    Postgres(jobrail_postgres::PgDriver),
}

fn not_built(kind: Kind) -> DriverError {
    DriverError::new(
        "jobrail-faults",
        jobrail_native::ErrorKind::Config,
        format!(
            "this build has no {} driver: build jobrail-faults with `--features {}`",
            kind.name(),
            kind.feature()
        ),
    )
}

impl Conn {
    /// Connects `target` with the suite's settings.
    pub(crate) async fn connect(target: &Target) -> Result<Conn, DriverError> {
        #[allow(unused_variables)]
        let lease = target.lease;
        match target.kind {
            Kind::Memory => Ok(Conn::Memory(jobrail_native::MemoryDriver::default())),
            #[cfg(feature = "rabbitmq")]
            Kind::Rabbitmq => {
                let mut config = jobrail_native::rabbitmq::RabbitConfig::new(target.url.clone());
                config.connection_name = "jobrail-faults".into();
                config.operation_timeout = target.operation_timeout;
                config.confirm_timeout = target.operation_timeout;
                config.max_reconnect_backoff = Duration::from_secs(1);
                Ok(Conn::Rabbit(
                    jobrail_native::rabbitmq::RabbitDriver::connect(config).await?,
                ))
            }
            #[cfg(feature = "nats")]
            Kind::Nats => {
                let mut config =
                    jobrail_native::nats::NatsConfig::new(target.url.clone()).ack_wait(lease);
                config.stream_prefix = "FAULTS".into();
                config.subject_prefix = "faults".into();
                config.fetch_expiry = Duration::from_secs(2);
                config.operation_timeout = target.operation_timeout;
                config.max_reconnect_backoff = Duration::from_secs(1);
                config.connection_name = "jobrail-faults".into();
                Ok(Conn::Nats(
                    jobrail_native::nats::NatsDriver::connect(config).await?,
                ))
            }
            #[cfg(feature = "sqs")]
            Kind::Sqs => Ok(Conn::Sqs(
                jobrail_native::sqs::SqsDriver::connect(sqs_config(target)).await?,
            )),
            #[cfg(feature = "postgres-queue")]
            Kind::Postgres => Ok(Conn::Postgres(
                jobrail_postgres::PgDriver::connect(pg_config(target)?).await?,
            )),
            #[allow(unreachable_patterns)]
            other => Err(not_built(other)),
        }
    }

    /// A driver that makes no request before it is used (SQS only; the
    /// others connect): to time dispatches against an endpoint that is down.
    #[cfg(feature = "sqs")]
    pub(crate) fn sqs_unconnected(target: &Target) -> Result<Conn, DriverError> {
        Ok(Conn::Sqs(jobrail_native::sqs::SqsDriver::new(sqs_config(
            target,
        ))?))
    }

    /// The driver.
    pub(crate) fn driver(&self) -> Arc<dyn Driver> {
        match self {
            Conn::Memory(d) => Arc::new(d.clone()),
            #[cfg(feature = "rabbitmq")]
            Conn::Rabbit(d) => Arc::new(d.clone()),
            #[cfg(feature = "nats")]
            Conn::Nats(d) => Arc::new(d.clone()),
            #[cfg(feature = "sqs")]
            Conn::Sqs(d) => Arc::new(d.clone()),
            #[cfg(feature = "postgres-queue")]
            Conn::Postgres(d) => Arc::new(d.clone()),
        }
    }

    /// The failure records of `queue`, read without consuming them, through
    /// the operator's API.
    pub(crate) async fn failure_records(
        &self,
        queue: &str,
    ) -> Result<Vec<FailureRecord>, DriverError> {
        let entries = jobrail_native::Failures::new(self.driver())
            .all(queue)
            .await?;
        Ok(entries.into_iter().filter_map(|e| e.record).collect())
    }

    /// Deletes what a run declared on `queue` (the work queue or stream, its
    /// failure destination, hold queues) through the driver's admin
    /// interface.
    pub(crate) async fn delete(&self, queue: &str) -> Result<(), DriverError> {
        match self.driver().admin() {
            Some(admin) => admin.delete_queue(queue).await,
            None => Ok(()),
        }
    }
}
