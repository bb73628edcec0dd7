//! The driver's settings: [`PgConfig`].

use std::fmt;
use std::time::Duration;

use jobrail_native::DriverError;

use super::errors::config_error;
use crate::connect::PgConnect;

/// The schema [`PgConfig::new`] uses.
pub const DEFAULT_SCHEMA: &str = "jobrail";

/// The largest body [`PgConfig::max_message_bytes`] allows: Postgres keeps
/// at most 1 GB in one `bytea` value; this leaves room for the row.
pub const MAX_MESSAGE_BYTES_LIMIT: usize = 1_000_000_000;

/// How [`PgDriver`](super::PgDriver) reaches Postgres and holds its
/// deliveries.
///
/// ```
/// use std::time::Duration;
/// use jobrail_postgres::PgConfig;
///
/// let config = PgConfig::new("postgres://app:secret@db.internal/shop")?
///     .schema("jobs")
///     .lease(Duration::from_secs(60));
/// assert_eq!(config.schema_name(), "jobs");
/// assert!(!format!("{config:?}").contains("secret"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct PgConfig {
    /// Where and how to connect (TLS, reconnection waits).
    pub connect: PgConnect,
    pub(crate) schema: String,
    /// How long a delivery holds its row before another worker may take
    /// it: renewed at half this while the handler runs. Default 30 s; at
    /// least 1 s.
    pub lease: Duration,
    /// How often an idle subscription looks at the table when no
    /// notification came: the fallback for a lost `LISTEN` connection and
    /// for notifications the server did not send. Delays and ends of
    /// leases are waited for exactly, not polled. Default 2 s.
    pub poll_interval: Duration,
    /// The most rows one fetch takes, within the subscription's prefetch.
    /// Default 64.
    pub fetch_batch: usize,
    /// The connections the driver opens for its statements (fetches,
    /// settlements, renewals, dispatches), each pipelining many
    /// statements, besides the one that listens. Default 2.
    pub connections: usize,
    /// The largest encoded envelope dispatched, in bytes. Default 16 MiB;
    /// at most [`MAX_MESSAGE_BYTES_LIMIT`].
    pub max_message_bytes: usize,
    /// How long one statement of the driver may wait for a row lock
    /// (`lock_timeout`) before it fails and the settlement is retried
    /// later: a lock a handler's own transaction holds on its row
    /// ([`PgDriver::complete_in`](super::PgDriver::complete_in)). Default 5 s.
    pub lock_timeout: Duration,
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConfig")
            .field("connect", &self.connect)
            .field("schema", &self.schema)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("fetch_batch", &self.fetch_batch)
            .field("connections", &self.connections)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("lock_timeout", &self.lock_timeout)
            .finish()
    }
}

impl PgConfig {
    /// The settings of `url` (a `postgres://` URL or key-value string, as
    /// [`PgConnect::new`] reads it) with every default: schema `jobrail`.
    /// [`ErrorKind::Config`](jobrail_native::ErrorKind::Config) when the URL
    /// does not parse.
    pub fn new(url: &str) -> Result<PgConfig, DriverError> {
        let connect = PgConnect::new(url)
            .map_err(|e| config_error(format!("the Postgres URL does not parse: {e}")))?;
        Ok(PgConfig::with_connect(connect))
    }

    /// The settings of a [`PgConnect`] built in code.
    pub fn with_connect(connect: PgConnect) -> PgConfig {
        PgConfig {
            connect,
            schema: DEFAULT_SCHEMA.into(),
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(2),
            fetch_batch: 64,
            connections: 2,
            max_message_bytes: 16 << 20,
            lock_timeout: Duration::from_secs(5),
        }
    }

    /// The tables in schema `name` (`[a-z_][a-z0-9_]*`, at most 63 bytes;
    /// checked when the driver is made). Several applications, or a test
    /// and the application, share a database by each using a schema of
    /// its own.
    pub fn schema(mut self, name: impl Into<String>) -> PgConfig {
        self.schema = name.into();
        self
    }

    /// The schema.
    pub fn schema_name(&self) -> &str {
        &self.schema
    }

    /// [`lease`](Self::lease), as a builder.
    pub fn lease(mut self, lease: Duration) -> PgConfig {
        self.lease = lease;
        self
    }

    /// Checks every setting, before any I/O.
    pub(crate) fn validate(&self) -> Result<(), DriverError> {
        check_schema(&self.schema)?;
        if self.lease < Duration::from_secs(1) {
            return Err(config_error(format!(
                "lease of {:?} is under 1 s: a delivery renews its lease at half of it, and a \
                 shorter one would be taken over by another worker between renewals",
                self.lease
            )));
        }
        if self.poll_interval.is_zero() {
            return Err(config_error(
                "poll_interval is zero: an idle subscription would query the table in a loop",
            ));
        }
        if self.fetch_batch == 0 {
            return Err(config_error(
                "fetch_batch is zero: no fetch would take a row",
            ));
        }
        if self.connections == 0 {
            return Err(config_error("connections is zero: no statement could run"));
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > MAX_MESSAGE_BYTES_LIMIT {
            return Err(config_error(format!(
                "max_message_bytes of {} is outside 1..={MAX_MESSAGE_BYTES_LIMIT} (Postgres keeps \
                 at most 1 GB in one value)",
                self.max_message_bytes
            )));
        }
        if self.lock_timeout.is_zero() {
            return Err(config_error(
                "lock_timeout is zero: Postgres reads zero as no timeout, and a statement \
                 waiting on a handler's transaction would hold up the connection's others",
            ));
        }
        Ok(())
    }
}

/// Checks a schema name: an unquoted lowercase identifier Postgres keeps
/// whole.
pub(crate) fn check_schema(name: &str) -> Result<(), DriverError> {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    let rest_ok = bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !first_ok || !rest_ok || name.len() > crate::MAX_IDENTIFIER_BYTES || name.starts_with("pg_")
    {
        return Err(config_error(format!(
            "`{}` is not a schema name jobrail-postgres accepts: [a-z_][a-z0-9_]*, at most {} \
             bytes, not starting with `pg_` (reserved by Postgres)",
            name.escape_debug(),
            crate::MAX_IDENTIFIER_BYTES
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_before_any_io() {
        let base = PgConfig::new("postgres://app@db/shop").unwrap();
        assert!(base.validate().is_ok());
        for (config, says) in [
            (base.clone().schema("Jobs"), "not a schema name"),
            (base.clone().schema("pg_jobs"), "reserved"),
            (base.clone().schema("a".repeat(64)), "at most 63"),
            (base.clone().lease(Duration::from_millis(999)), "under 1 s"),
            (
                PgConfig {
                    fetch_batch: 0,
                    ..base.clone()
                },
                "fetch_batch",
            ),
            (
                PgConfig {
                    max_message_bytes: MAX_MESSAGE_BYTES_LIMIT + 1,
                    ..base.clone()
                },
                "1 GB",
            ),
            (
                PgConfig {
                    lock_timeout: Duration::ZERO,
                    ..base.clone()
                },
                "lock_timeout",
            ),
        ] {
            let err = config.validate().unwrap_err();
            assert_eq!(err.kind(), jobrail_native::ErrorKind::Config);
            assert!(err.to_string().contains(says), "{err}");
        }
        assert!(PgConfig::new("postgres://db/shop?sslmode=verify-full").is_err());
    }
}
