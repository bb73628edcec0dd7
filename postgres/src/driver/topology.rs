//! The tables: what [`PgDriver::install`](super::PgDriver::install) creates
//! and upgrades, and the check [`PgDriver::connect`](super::PgDriver::connect)
//! makes that they are there, at the version this driver needs.
//!
//! Everything lives in one schema (default `jobrail`):
//!
//! - `jobs`: one row per message waiting, delayed or held. `run_at` is when
//!   it may be fetched: its dispatch time, its delay's end, or, while a
//!   delivery holds it, the end of that delivery's lease. `lease` is the
//!   holder's fencing token (from the sequence `leases`), NULL when no
//!   delivery holds it. `attempts` counts deliveries (a fetch adds one),
//!   `shutdowns` the deliveries a graceful shutdown handed back. A
//!   finished message's row is deleted, so the table holds only what is
//!   still to do.
//! - `failures`: the failure records, per queue, in the order stored, with
//!   the entry's id, its message id and an operator's claim.
//! - `migrations`: the versions applied.
//!
//! Workers are woken by `NOTIFY` on the channel `jobrail.<schema>`
//! (payload: the queue), sent by the driver after its own inserts and, in
//! [`PgDriver::dispatch_in`](super::PgDriver::dispatch_in), by the caller's
//! transaction when it commits. There is no trigger: a notifying commit
//! takes a lock that every other notifying commit of the database waits
//! for, so the driver coalesces its notifications (one in flight per
//! queue) instead of sending one per insert. Rows inserted by other means
//! are found by the next poll.

use jobrail_native::DriverError;
use tokio_postgres::GenericClient;

use super::errors::{config_error, read_error, write_error};
use crate::schema::advisory_key;

/// The schema version this driver reads and writes.
pub const SCHEMA_VERSION: i32 = 1;

/// The migrations, in order: version and the statements that bring the
/// schema from the version before to it. `{s}` is the quoted schema.
const MIGRATIONS: &[(i32, &str)] = &[(
    1,
    "CREATE SEQUENCE {s}.leases;
CREATE TABLE {s}.jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    message_id text NOT NULL,
    body bytea NOT NULL,
    run_at timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    shutdowns integer NOT NULL DEFAULT 0,
    lease bigint,
    created_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 70);
CREATE INDEX jobs_fetch ON {s}.jobs (queue, run_at, id);
CREATE TABLE {s}.failures (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    entry_id text NOT NULL,
    message_id text,
    body bytea NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT now(),
    claim bigint,
    claimed_until timestamptz
);
CREATE INDEX failures_queue ON {s}.failures (queue, id);
",
)];

/// The schema quoted for SQL.
pub(crate) fn quoted(schema: &str) -> String {
    format!("\"{schema}\"")
}

/// The notification channel of `schema`.
pub(crate) fn channel(schema: &str) -> String {
    format!("jobrail.{schema}")
}

/// The SQL that installs the schema from nothing, or upgrades it from
/// `from` (0: nothing installed) to [`SCHEMA_VERSION`], recording each
/// version in `migrations`. Every statement is idempotent in effect: the
/// versions already applied are skipped by `from`.
pub(crate) fn install_sql(schema: &str, from: i32) -> String {
    let s = quoted(schema);
    let channel = format!("'{}'", channel(schema));
    let mut sql = format!(
        "CREATE SCHEMA IF NOT EXISTS {s};\n\
         CREATE TABLE IF NOT EXISTS {s}.migrations (\n    \
         version integer PRIMARY KEY,\n    \
         applied_at timestamptz NOT NULL DEFAULT now()\n);\n"
    );
    for (version, statements) in MIGRATIONS.iter().filter(|(v, _)| *v > from) {
        sql.push_str(&format!("-- version {version}\n"));
        sql.push_str(&statements.replace("{s}", &s).replace("{channel}", &channel));
        sql.push_str(&format!(
            "INSERT INTO {s}.migrations (version) VALUES ({version});\n"
        ));
    }
    sql
}

/// The version installed in `schema`, 0 when nothing is.
pub(crate) async fn installed_version(
    client: &impl GenericClient,
    schema: &str,
) -> Result<i32, DriverError> {
    let table = format!("{}.migrations", quoted(schema));
    let row = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(|e| read_error("read the installed schema version", e))?;
    if !row.get::<_, bool>(0) {
        return Ok(0);
    }
    let row = client
        .query_one(
            &format!("SELECT coalesce(max(version), 0) FROM {table}"),
            &[],
        )
        .await
        .map_err(|e| read_error("read the installed schema version", e))?;
    Ok(row.get(0))
}

/// Installs or upgrades `schema` to [`SCHEMA_VERSION`] in one transaction
/// under an advisory lock (workers installing at once do not race); says
/// which version it found. A schema newer than this driver is refused.
pub(crate) async fn install(
    client: &mut tokio_postgres::Client,
    schema: &str,
) -> Result<i32, DriverError> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| write_error("begin the install transaction", e))?;
    tx.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&advisory_key("jobrail-queue:", schema)],
    )
    .await
    .map_err(|e| write_error("take the install lock", e))?;
    let found = installed_version(&tx, schema).await?;
    if found > SCHEMA_VERSION {
        return Err(newer(schema, found));
    }
    if found < SCHEMA_VERSION {
        tx.batch_execute(&install_sql(schema, found))
            .await
            .map_err(|e| write_error(format!("install schema `{schema}`"), e))?;
    }
    tx.commit()
        .await
        .map_err(|e| write_error("commit the install", e))?;
    Ok(found)
}

/// Refuses to run on `schema` unless it is at [`SCHEMA_VERSION`].
pub(crate) async fn check(client: &impl GenericClient, schema: &str) -> Result<(), DriverError> {
    let found = installed_version(client, schema).await?;
    match found {
        v if v == SCHEMA_VERSION => Ok(()),
        0 => Err(config_error(format!(
            "the jobrail tables are not installed in schema `{schema}`: run \
             `PgDriver::install` once (or apply `PgDriver::install_sql` with your migration \
             tool, or `jobrail --backend postgres install`); the driver never creates them on \
             its own"
        ))),
        v if v < SCHEMA_VERSION => Err(config_error(format!(
            "schema `{schema}` is at version {v}, this driver needs version {SCHEMA_VERSION}: \
             run `PgDriver::install` to upgrade it (or apply `PgDriver::upgrade_sql({v})`)"
        ))),
        v => Err(newer(schema, v)),
    }
}

fn newer(schema: &str, found: i32) -> DriverError {
    config_error(format!(
        "schema `{schema}` is at version {found}, newer than this driver's {SCHEMA_VERSION}: \
         upgrade jobrail-postgres"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_install_names_everything_under_the_schema() {
        let sql = install_sql("app_jobs", 0);
        assert!(sql.contains("CREATE TABLE \"app_jobs\".jobs"), "{sql}");
        assert!(sql.contains("INSERT INTO \"app_jobs\".migrations (version) VALUES (1)"));
        assert!(!sql.contains("{s}") && !sql.contains("{channel}"));
        assert!(
            !sql.contains("TRIGGER"),
            "no trigger: notifications are the driver's"
        );
        let upgrade = install_sql("app_jobs", SCHEMA_VERSION);
        assert!(
            !upgrade.contains("CREATE TABLE \"app_jobs\".jobs"),
            "{upgrade}"
        );
    }
}
