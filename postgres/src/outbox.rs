//! The outbox table: jobs written in the caller's transaction.

use std::fmt;

use jobrail::{encode_envelope, Job};
use serde::Serialize;
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use jobrail_native::DispatchOptions;

use crate::schema::{advisory_key, TableName, UNSENT_INDEX};

/// The table [`Outbox::new`] uses.
pub const DEFAULT_OUTBOX_TABLE: &str = "jobrail_outbox";

/// An error from the outbox or its relay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The payload did not encode: nothing was written.
    #[error("outbox: the payload does not encode: {0}")]
    Encode(#[source] serde_json::Error),
    /// The database refused a statement or the connection failed.
    #[error("outbox: database: {0}")]
    Database(#[from] tokio_postgres::Error),
    /// A setting or an argument is not valid (a table name, say); found
    /// before any I/O.
    #[error("outbox: {0}")]
    Invalid(String),
}

/// Writes jobs into an outbox table, in the caller's transaction.
///
/// # The pattern
///
/// A handler or a request that changes business rows and dispatches a job
/// has two writes to make, to two systems: if it dispatches first and the
/// transaction rolls back, a job runs for a change that never happened; if
/// it commits first and the process dies before the dispatch, the job is
/// lost. The outbox makes the dispatch part of the transaction:
/// [`Outbox::dispatch`] encodes the job's envelope exactly as
/// [`Producer::dispatch`](jobrail_native::Producer::dispatch) does and INSERTs it as
/// a row, through the caller's own client or transaction. The row commits
/// with the business change or vanishes with it. An [`OutboxRelay`]
/// publishes committed rows to the broker afterwards and marks them sent.
///
/// ```no_run
/// # async fn example(mut client: jobrail_postgres::tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use jobrail::Job;
/// use jobrail_postgres::Outbox;
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Ship { order: i64 }
///
/// let ship = Job::<Ship>::builder("ship").queue("shipping").build()?;
/// let outbox = Outbox::new();
/// outbox.install(&client).await?; // once, or install_sql() in a migration
///
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&42_i64]).await?;
/// outbox.dispatch(&tx, &ship, &Ship { order: 42 }).await?;
/// tx.commit().await?; // the job exists from here on, and only from here
/// # Ok(()) }
/// ```
///
/// # Guarantees and limits
///
/// - **At least once.** A committed row is published until the relay has
///   marked it sent; it is never deleted unsent. A relay that dies between
///   the broker's confirm and its mark (the process is killed, the database
///   connection drops) leaves its transaction to roll back, and the next
///   pass publishes those rows again, under the same message id. Consumers
///   therefore need handlers that tolerate a duplicate: claim a business key
///   with [`jobrail::run_once`].
/// - **Order.** One relay pass publishes the rows it took in id order, per
///   queue. Across passes, across relays and across retries there is no
///   order: a row the broker refused waits for its retry while later rows go
///   ahead, and two relays publish disjoint batches side by side.
/// - **Delays.** A delay ([`DispatchOptions::delay`]) counts from the
///   dispatch: the relay hands the broker what is left of it. Like
///   [`Producer`](jobrail_native::Producer), it needs a backend that delays
///   ([`Capabilities::delayed_dispatch`](jobrail_native::Capabilities::delayed_dispatch));
///   on one that cannot, the row stays unsent with the refusal as its last
///   error.
/// - **Refusals.** What can be known without the broker is refused at
///   dispatch, before any write: a payload that does not encode. What only
///   the broker knows (a message over its size limit, a delay it cannot
///   honour, an outage) is found by the relay, which records the attempt
///   and the error on the row and retries it with a growing wait.
///
/// # The table
///
/// One row per job: `id` (bigint identity: the relay's order),
/// `message_id`, `queue`, `body` (the encoded envelope, bytea), `delay_ms`,
/// `created_at`, `sent_at` (NULL until published), `attempts`, `last_error`
/// and `retry_at` (when a refused row may be tried again). Sent rows stay
/// until [`OutboxRelay::purge_sent`] removes them.
///
/// [`OutboxRelay`]: crate::OutboxRelay
/// [`OutboxRelay::purge_sent`]: crate::OutboxRelay::purge_sent
/// [`DispatchOptions::delay`]: jobrail_native::DispatchOptions::delay
#[derive(Clone, PartialEq, Eq)]
pub struct Outbox {
    table: TableName,
    /// The table's name quoted for SQL.
    quoted: String,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.table.as_str())
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

impl Outbox {
    /// The outbox in the table `jobrail_outbox` ([`DEFAULT_OUTBOX_TABLE`]).
    pub fn new() -> Self {
        Outbox::with_table(DEFAULT_OUTBOX_TABLE).expect("the default table name is valid")
    }

    /// The outbox in the table `name`, named by the [crate's rule](crate):
    /// `table` or `schema.table` (`jobs.outbox`), each part a lowercase
    /// letter or `_`, then lowercase letters, digits and `_`, the table at
    /// most [`MAX_TABLE_BYTES`](crate::MAX_TABLE_BYTES) bytes; anything
    /// else is [`OutboxError::Invalid`], naming the rule.
    pub fn with_table(name: impl Into<String>) -> Result<Self, OutboxError> {
        let table =
            TableName::parse(&name.into()).map_err(|e| OutboxError::Invalid(e.to_string()))?;
        Ok(Outbox {
            quoted: table.quoted(),
            table,
        })
    }

    /// The table's name, as given.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The table's name quoted for SQL.
    pub(crate) fn quoted(&self) -> &str {
        &self.quoted
    }

    /// The DDL that creates the table and its index if they are missing,
    /// for migration tools. Running it again changes nothing.
    pub fn install_sql(&self) -> String {
        let table = &self.quoted;
        let index = self.table.index(UNSENT_INDEX);
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (\n\
             \x20   id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n\
             \x20   message_id text NOT NULL UNIQUE,\n\
             \x20   queue text NOT NULL,\n\
             \x20   body bytea NOT NULL,\n\
             \x20   delay_ms bigint,\n\
             \x20   created_at timestamptz NOT NULL DEFAULT now(),\n\
             \x20   sent_at timestamptz,\n\
             \x20   attempts integer NOT NULL DEFAULT 0,\n\
             \x20   last_error text,\n\
             \x20   retry_at timestamptz\n\
             );\n\
             CREATE INDEX IF NOT EXISTS {index} ON {table} (id) WHERE sent_at IS NULL;\n"
        )
    }

    /// Creates the table and its index if they are missing
    /// ([`install_sql`](Self::install_sql)), under a transaction-scoped
    /// advisory lock so that processes installing at once do not race. On
    /// a transaction, the table exists for others once it commits.
    pub async fn install(&self, client: &impl GenericClient) -> Result<(), OutboxError> {
        let lock = advisory_key("jobrail-outbox:", self.table.as_str());
        let ddl = self.install_sql();
        client
            .batch_execute(&format!(
                "DO $jobrail$ BEGIN\n\
                 PERFORM pg_advisory_xact_lock({lock});\n\
                 {ddl}\
                 END $jobrail$;"
            ))
            .await?;
        Ok(())
    }

    /// Writes `payload` as `job` into the outbox through `client` (a
    /// [`tokio_postgres::Transaction`] to dispatch with a business change,
    /// or a client in autocommit); returns the message id, which the
    /// message keeps however often the relay publishes it. Nothing reaches
    /// the broker here: the row is published once it is committed.
    pub async fn dispatch<P: Serialize>(
        &self,
        client: &impl GenericClient,
        job: &Job<P>,
        payload: &P,
    ) -> Result<String, OutboxError> {
        self.dispatch_with(client, job, payload, DispatchOptions::default())
            .await
    }

    /// [`dispatch`](Self::dispatch) with options: a delay, counted from now
    /// (see [Guarantees and limits](Self#guarantees-and-limits)), and metadata carried in the
    /// envelope.
    pub async fn dispatch_with<P: Serialize>(
        &self,
        client: &impl GenericClient,
        job: &Job<P>,
        payload: &P,
        options: DispatchOptions,
    ) -> Result<String, OutboxError> {
        let delay_ms = match options.delay.filter(|d| !d.is_zero()) {
            None => None,
            Some(delay) => Some(i64::try_from(delay.as_millis().max(1)).map_err(|_| {
                OutboxError::Invalid(format!("a delay of {delay:?} is too long to store"))
            })?),
        };
        let (id, body) =
            encode_envelope(job.name(), payload, &options.metadata).map_err(OutboxError::Encode)?;
        let sql = format!(
            "INSERT INTO {} (message_id, queue, body, delay_ms) VALUES ($1, $2, $3, $4)",
            self.quoted
        );
        let queue = job.queue();
        client
            .execute_typed(
                &sql,
                &[
                    (&id, Type::TEXT),
                    (&queue, Type::TEXT),
                    (&body, Type::BYTEA),
                    (&delay_ms, Type::INT8),
                ],
            )
            .await?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_follow_the_crate_rule() {
        assert!(Outbox::with_table("a".repeat(55)).is_ok());
        match Outbox::with_table("a".repeat(56)) {
            Err(OutboxError::Invalid(why)) => assert!(why.contains("more than 55"), "{why}"),
            other => panic!("a 56-byte table is refused: {other:?}"),
        }
        assert!(matches!(
            Outbox::with_table("Outbox"),
            Err(OutboxError::Invalid(_))
        ));
    }

    #[test]
    fn the_index_lives_beside_the_table() {
        let outbox = Outbox::with_table("jobs.outbox").unwrap();
        assert!(outbox
            .install_sql()
            .contains("CREATE INDEX IF NOT EXISTS \"outbox_unsent\" ON \"jobs\".\"outbox\""));
        assert_eq!(Outbox::new().table(), DEFAULT_OUTBOX_TABLE);
    }

    #[test]
    fn install_locks_are_stable_and_per_table() {
        let key = |table| advisory_key("jobrail-outbox:", table);
        assert_eq!(key("a"), key("a"));
        assert_ne!(key("a"), key("b"));
        assert!(key("jobrail_outbox") >= 0);
        assert_ne!(key("jobrail"), advisory_key("jobrail-queue:", "jobrail"));
    }
}
