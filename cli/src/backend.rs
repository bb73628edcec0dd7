//! Connecting to the backend the worker runs on, configured as the quick
//! start configures it, so the tool reads the failure destinations the
//! worker writes.

use std::sync::Arc;
use std::time::Duration;

use jobrail_native::Driver;

use crate::args::{BackendKind, Connection};
use crate::error::CliError;

/// The backend named by `--backend` or `JOBRAIL_BACKEND`, or an error saying
/// how to name one.
pub(crate) fn chosen(connection: &Connection) -> Result<BackendKind, CliError> {
    connection.backend.ok_or_else(|| {
        CliError::usage(
            "no backend: pass --backend memory|rabbitmq|nats|sqs or set JOBRAIL_BACKEND",
        )
    })
}

/// Connects to the chosen backend.
pub(crate) async fn connect(connection: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    let kind = chosen(connection)?;
    match kind {
        BackendKind::Memory => Ok(Arc::new(jobrail_native::MemoryDriver::default())),
        BackendKind::Rabbitmq => rabbitmq(connection).await,
        BackendKind::Nats => nats(connection).await,
        BackendKind::Sqs => sqs(connection).await,
    }
}

/// What the backend waits before redelivering a message the worker left
/// to its timing (a visibility timeout, an ack wait), at the driver's
/// default settings: the budget counts it for jobs without a backoff.
pub(crate) fn redelivery_hint(kind: BackendKind) -> (Duration, &'static str) {
    match kind {
        BackendKind::Memory | BackendKind::Rabbitmq => {
            (Duration::ZERO, "redelivered at once when no delay is set")
        }
        BackendKind::Nats => (Duration::from_secs(30), "the default ack wait"),
        BackendKind::Sqs => (Duration::from_secs(30), "the default visibility timeout"),
    }
}

#[cfg(not(all(feature = "rabbitmq", feature = "nats", feature = "sqs")))]
fn not_built(kind: BackendKind) -> CliError {
    CliError::usage(format!(
        "this build of jobrail has no {0} backend (build jobrail-cli with --features {0})",
        kind.name()
    ))
}

fn unreachable(what: &str, e: impl std::fmt::Display) -> CliError {
    CliError::failed(format!("cannot connect to {what}: {e}"))
}

#[cfg(feature = "rabbitmq")]
async fn rabbitmq(connection: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
    let mut config = RabbitConfig::new(connection.rabbitmq_url.clone());
    if let Some(pattern) = &connection.failure_queue {
        config = config.failure_queue(Some(pattern));
    }
    let at = config.redacted_url();
    let driver = RabbitDriver::connect(config)
        .await
        .map_err(|e| unreachable(&format!("RabbitMQ at {at}"), e))?;
    Ok(Arc::new(driver))
}

#[cfg(not(feature = "rabbitmq"))]
async fn rabbitmq(_: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    Err(not_built(BackendKind::Rabbitmq))
}

#[cfg(feature = "nats")]
async fn nats(connection: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    use jobrail_native::nats::{NatsConfig, NatsDriver};
    let mut config = NatsConfig::new(connection.nats_url.clone());
    if let Some(pattern) = &connection.failure_queue {
        config = config.failure_subject(Some(pattern));
    }
    let at = config.redacted_url();
    let driver = NatsDriver::connect(config)
        .await
        .map_err(|e| unreachable(&format!("NATS at {at}"), e))?;
    Ok(Arc::new(driver))
}

#[cfg(not(feature = "nats"))]
async fn nats(_: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    Err(not_built(BackendKind::Nats))
}

#[cfg(feature = "sqs")]
async fn sqs(connection: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};
    let mut config = SqsConfig::new(connection.region.clone());
    // As the quick start: an emulator takes any static keys.
    if let Some(endpoint) = &connection.sqs_endpoint {
        config = config
            .endpoint(endpoint.clone())
            .credentials(SqsCredentials::fixed("test", "test"));
    }
    if let Some(pattern) = &connection.failure_queue {
        config = config.failure_queue(Some(pattern));
    }
    // The tool reads what a worker created; it creates nothing.
    config.create_queues = false;
    let at = match &config.endpoint {
        Some(endpoint) => format!("SQS at {endpoint}"),
        None => format!("SQS in {}", config.region),
    };
    let driver = SqsDriver::connect(config)
        .await
        .map_err(|e| unreachable(&at, e))?;
    Ok(Arc::new(driver))
}

#[cfg(not(feature = "sqs"))]
async fn sqs(_: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    Err(not_built(BackendKind::Sqs))
}
