//! Connecting to the backend the worker runs on, configured as the quick
//! start configures it, so the tool reads the failure destinations the
//! worker writes.

use std::sync::Arc;
use std::time::Duration;

use jobrail_native::Driver;

use crate::args::{BackendKind, Connection};
use crate::commands::Output;
use crate::error::CliError;

/// The backend named by `--backend` or `JOBRAIL_BACKEND`, or an error saying
/// how to name one.
pub(crate) fn chosen(connection: &Connection) -> Result<BackendKind, CliError> {
    connection.backend.ok_or_else(|| {
        CliError::usage(
            "no backend: pass --backend memory|rabbitmq|nats|sqs|postgres or set JOBRAIL_BACKEND",
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
        BackendKind::Postgres => postgres(connection).await,
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
        // A retry without a delay comes back one lease later.
        BackendKind::Postgres => (Duration::from_secs(30), "the default lease"),
    }
}

#[cfg(not(all(
    feature = "rabbitmq",
    feature = "nats",
    feature = "sqs",
    feature = "postgres"
)))]
fn not_built(kind: BackendKind) -> CliError {
    CliError::usage(format!(
        "this build of jobrail has no {0} backend (build jobrail-cli with --features {0})",
        kind.name()
    ))
}

#[cfg(any(
    feature = "rabbitmq",
    feature = "nats",
    feature = "sqs",
    feature = "postgres"
))]
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

/// The Postgres driver's settings of the command line, or why they do not
/// fit (`--failure-queue`: the failures are rows of the schema).
#[cfg(feature = "postgres")]
fn pg_config(connection: &Connection) -> Result<jobrail_postgres::PgConfig, CliError> {
    if connection.failure_queue.is_some() {
        return Err(CliError::usage(
            "--failure-queue does not apply to postgres: its failure records are rows of the \
             schema's `failures` table (choose the schema with --schema)",
        ));
    }
    let config = jobrail_postgres::PgConfig::new(&connection.database_url)
        .map_err(|e| CliError::usage(format!("--database-url: {e}")))?
        .schema(connection.schema.clone());
    // The settings (the schema's name) checked without I/O.
    jobrail_postgres::PgDriver::new(config.clone()).map_err(|e| CliError::usage(e.to_string()))?;
    Ok(config)
}

/// Where `config` connects, for messages: hosts, ports and database,
/// never the password.
#[cfg(feature = "postgres")]
fn pg_where(config: &jobrail_postgres::PgConfig) -> String {
    use jobrail_postgres::tokio_postgres::config::Host;
    let settings = config.connect.config();
    let ports = settings.get_ports();
    let hosts: Vec<String> = settings
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                Host::Tcp(name) => name.clone(),
                #[cfg(unix)]
                Host::Unix(path) => path.display().to_string(),
            };
            // One port for every host, or one per host; 5432 when none.
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            format!("{host}:{port}")
        })
        .collect();
    let hosts = if hosts.is_empty() {
        "localhost:5432".to_string()
    } else {
        hosts.join(",")
    };
    format!(
        "Postgres at {hosts}/{}, schema `{}`",
        settings.get_dbname().unwrap_or("(default database)"),
        config.schema_name()
    )
}

#[cfg(feature = "postgres")]
async fn postgres(connection: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    use jobrail_native::ErrorKind;
    use jobrail_postgres::PgDriver;
    let config = pg_config(connection)?;
    let at = pg_where(&config);
    let driver = PgDriver::connect(config)
        .await
        .map_err(|e| match e.kind() {
            // Tables missing or at another version: the error names the fix.
            ErrorKind::Config => {
                let mut message = format!("{at}: {e}");
                if connection.schema != crate::args::DEFAULT_SCHEMA
                    && message.contains("jobrail --backend postgres install")
                {
                    message.push_str(&format!(
                        " (for this schema: jobrail --backend postgres --schema {} install)",
                        connection.schema
                    ));
                }
                CliError::failed(message)
            }
            _ => unreachable(&at, with_causes(&e)),
        })?;
    Ok(Arc::new(driver))
}

/// `e` and its causes (tokio-postgres's "error connecting to server" says
/// why only in its source: connection refused, no such host...).
#[cfg(feature = "postgres")]
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let part = c.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = c.source();
    }
    text
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_: &Connection) -> Result<Arc<dyn Driver>, CliError> {
    Err(not_built(BackendKind::Postgres))
}

/// `jobrail install [--print]`: the Postgres driver's tables, installed
/// (or upgraded) in the schema, or their SQL printed without connecting.
pub(crate) async fn install(connection: &Connection, print: bool) -> Result<Output, CliError> {
    match chosen(connection)? {
        BackendKind::Postgres => install_postgres(connection, print).await,
        other => Err(CliError::usage(format!(
            "`jobrail install` is for --backend postgres only (it creates the Postgres \
             driver's tables); the {} backend has nothing to install",
            other.name()
        ))),
    }
}

#[cfg(feature = "postgres")]
async fn install_postgres(connection: &Connection, print: bool) -> Result<Output, CliError> {
    use jobrail_postgres::{PgDriver, SCHEMA_VERSION};
    use serde_json::json;
    let schema = connection.schema.as_str();
    if print {
        let sql = PgDriver::install_sql(schema).map_err(|e| CliError::usage(e.to_string()))?;
        let json = json!({
            "backend": "postgres",
            "schema": schema,
            "version": SCHEMA_VERSION,
            "sql": sql,
        });
        let mut text = format!(
            "-- jobrail-postgres tables, schema version {SCHEMA_VERSION}, in schema `{schema}`\n\
             -- (what `jobrail --backend postgres install` runs, in one transaction, on an empty database)\n"
        );
        text.push_str(&sql);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        return Ok(Output { text, json });
    }
    let config = pg_config(connection)?;
    let at = pg_where(&config);
    let found = PgDriver::install(&config)
        .await
        .map_err(|e| match e.kind() {
            jobrail_native::ErrorKind::Config => CliError::failed(format!("{at}: {e}")),
            _ => unreachable(&at, with_causes(&e)),
        })?;
    Ok(install_output(&at, schema, found, SCHEMA_VERSION))
}

#[cfg(not(feature = "postgres"))]
async fn install_postgres(_: &Connection, _: bool) -> Result<Output, CliError> {
    Err(not_built(BackendKind::Postgres))
}

/// What `jobrail install` says: the version found and the version now.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn install_output(at: &str, schema: &str, found: i32, now: i32) -> Output {
    let what = match found {
        0 => format!("installed version {now} (found none)"),
        v if v == now => format!("already at version {now}: nothing to do"),
        v => format!("upgraded from version {v} to version {now}"),
    };
    Output {
        text: format!("{at}: {what}\n"),
        json: serde_json::json!({
            "backend": "postgres",
            "schema": schema,
            "found": found,
            "version": now,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn connection(args: &[&str]) -> Connection {
        crate::args::Cli::try_parse_from(
            ["jobrail"]
                .iter()
                .chain(args.iter())
                .chain(["depth", "--queue", "q"].iter()),
        )
        .unwrap()
        .connection
    }

    #[test]
    fn install_is_for_postgres_only() {
        for backend in ["memory", "rabbitmq", "nats", "sqs"] {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let err = rt
                .block_on(install(&connection(&["--backend", backend]), true))
                .unwrap_err();
            assert_eq!(err.status, crate::error::USAGE, "{err}");
            assert!(
                err.message.contains("--backend postgres only")
                    && err.message.contains(&format!("the {backend} backend")),
                "{err}"
            );
        }
    }

    #[test]
    fn install_says_what_it_found() {
        let at = "Postgres at db:5432/shop, schema `jobrail`";
        let out = install_output(at, "jobrail", 0, 1);
        assert_eq!(
            out.text,
            "Postgres at db:5432/shop, schema `jobrail`: installed version 1 (found none)\n"
        );
        assert_eq!(
            out.json,
            serde_json::json!({"backend": "postgres", "schema": "jobrail", "found": 0, "version": 1})
        );
        assert!(install_output(at, "jobrail", 1, 1)
            .text
            .ends_with("already at version 1: nothing to do\n"));
        assert!(install_output(at, "jobrail", 1, 2)
            .text
            .ends_with("upgraded from version 1 to version 2\n"));
    }

    #[test]
    fn postgres_budgets_count_the_default_lease() {
        assert_eq!(
            redelivery_hint(BackendKind::Postgres),
            (Duration::from_secs(30), "the default lease")
        );
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn install_prints_the_sql_without_connecting() {
        // Nothing listens on port 1: --print must not try.
        let conn = connection(&[
            "--backend",
            "postgres",
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
            "--schema",
            "shop_jobs",
        ]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let out = rt.block_on(install(&conn, true)).unwrap();
        let sql = jobrail_postgres::PgDriver::install_sql("shop_jobs").unwrap();
        assert!(out.text.contains(&sql), "{}", out.text);
        assert!(out
            .text
            .contains("CREATE SCHEMA IF NOT EXISTS \"shop_jobs\""));
        assert_eq!(out.json["sql"], sql.as_str());
        assert_eq!(out.json["version"], jobrail_postgres::SCHEMA_VERSION);
        let bad = connection(&["--backend", "postgres", "--schema", "Bad-Name"]);
        let err = rt.block_on(install(&bad, true)).unwrap_err();
        assert_eq!(err.status, crate::error::USAGE, "{err}");
        assert!(err.message.contains("not a schema name"), "{err}");
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_settings_are_checked_and_described() {
        let conn = connection(&[
            "--backend",
            "postgres",
            "--database-url",
            "postgres://app:secret@db.internal:6543/shop",
            "--schema",
            "shop_jobs",
        ]);
        let config = pg_config(&conn).unwrap();
        let at = pg_where(&config);
        assert_eq!(at, "Postgres at db.internal:6543/shop, schema `shop_jobs`");
        assert!(!at.contains("secret"));
        let mut with_pattern = conn.clone();
        with_pattern.failure_queue = Some("{queue}-dead".into());
        let err = pg_config(&with_pattern).unwrap_err();
        assert_eq!(err.status, crate::error::USAGE, "{err}");
        let mut bad_url = conn;
        bad_url.database_url = "postgres://db/shop?sslmode=sometimes".into();
        let err = pg_config(&bad_url).unwrap_err();
        assert!(err.message.starts_with("--database-url: "), "{err}");
        let mut bad_schema = with_pattern;
        bad_schema.failure_queue = None;
        bad_schema.schema = "pg_jobs".into();
        let err = pg_config(&bad_schema).unwrap_err();
        assert_eq!(err.status, crate::error::USAGE, "{err}");
        assert!(err.message.contains("not a schema name"), "{err}");
    }
}
