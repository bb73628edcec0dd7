//! Claims on Postgres: [`PgClaims`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use jobrail::{validate_claim, BoxFuture, Claim, ClaimError, ClaimState, ClaimStore};
use tokio::sync::Mutex;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, GenericClient, Statement};

use crate::connect::{Dialer, PgConnect};
use crate::schema::{TableName, DONE_INDEX};

/// The oldest done row [`PgClaims::purge_done`] looks back to: 1,000 years
/// (so the cutoff stays within Postgres's timestamps).
const MAX_PURGE_AGE: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// Claims on business keys in a Postgres table: a [`ClaimStore`], through
/// tokio-postgres. See [`jobrail::run_once`] for how a handler uses a
/// claim. Clones share one connection.
///
/// # Data
///
/// One row per business key (table `jobrail_claims` unless
/// [`PgClaims::connect_with_table`] names another, by the
/// [crate's rule](crate); [`PgClaims::install_sql`]
/// prints its DDL):
///
/// | column        | type          |                                              |
/// |---------------|---------------|----------------------------------------------|
/// | `key`         | `text`        | the business key, primary key                |
/// | `fence`       | `bigint`      | the latest claim's fencing token (from 1)    |
/// | `state`       | `text`        | `held` or `done`                             |
/// | `lease_until` | `timestamptz` | the latest lease's end (`-infinity` once released) |
/// | `claimed_at`  | `timestamptz` | when the latest claim was taken              |
/// | `done_at`     | `timestamptz` | when the claim was completed                 |
///
/// # Guarantees
///
/// - Every operation is one conditional statement, atomic in Postgres: a
///   claim is an `INSERT ... ON CONFLICT DO UPDATE ... WHERE` the lease has
///   ended, so two workers racing on a key never both hold it; complete,
///   release and extend are an `UPDATE` that matches only the live claim of
///   that fence ([`ClaimError::Lost`] otherwise).
/// - Effects in the same database run exactly once: record the completion
///   with [`PgClaims::complete_in`] in the transaction of the effect, and
///   the two commit together or not at all.
/// - Other effects (a call to a remote service, an email) run at least
///   once: a process that dies after the effect and before
///   [`ClaimStore::complete`] leaves the key to be claimed again once its
///   lease ends.
///
/// # Limits
///
/// - A lease shorter than the effect lets a second holder in while the
///   first still works: pick a lease longer than the job's timeout, or
///   [`extend`](ClaimStore::extend) it. The fence makes the first holder's
///   completion fail, not its effect.
/// - Leases run on the Postgres server's clock (`clock_timestamp()`), not
///   the worker's.
/// - Done rows stay until [`PgClaims::purge_done`] deletes them; a purged
///   key is a new key, and its effect runs again.
/// - Keys are any UTF-8 text of 1 to [`jobrail::MAX_CLAIM_KEY_BYTES`]
///   bytes except that they cannot hold a NUL character (Postgres text
///   cannot).
///
/// # Connection
///
/// A store holds one connection, made through a [`PgConnect`] (TLS as the
/// URL's `sslmode` says); concurrent operations pipeline on it. When the
/// server closes it, the next operation connects again, after the
/// [reconnection wait](PgConnect#reconnection) if the last attempt failed; an
/// operation interrupted by the loss is tried once more on the new
/// connection (a claim whose answer was lost then finds its own claim
/// and answers [`Claim::Held`]; a completion whose answer was lost finds
/// it recorded and succeeds). Any other failure is [`ClaimError::Store`].
/// A `connect_timeout` in the URL bounds each connection attempt.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use jobrail::{run_once, JobError};
/// use jobrail_postgres::PgClaims;
///
/// # async fn example() -> Result<(), JobError> {
/// let claims = PgClaims::connect("postgres://app@db.internal/shop").await?;
/// // In a handler: the invoice goes out once, however often the job runs.
/// run_once(&claims, "invoice:2024-0042", Duration::from_secs(60), |_fence| async {
///    // send the invoice
///    Ok::<_, JobError>(())
/// })
/// .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgClaims {
    inner: Arc<Inner>,
}

struct Inner {
    dialer: Dialer,
    table: Table,
    sql: Sql,
    /// The connection and its statements; `None` until the next operation
    /// connects again.
    conn: Mutex<Option<Arc<Conn>>>,
}

/// A checked table name, as SQL needs it.
struct Table {
    /// As the caller gave it.
    name: TableName,
    /// Quoted, for SQL: `"schema"."table"` or `"table"`.
    quoted: String,
    /// The quoted name of the index on done rows (in the table's schema).
    done_index: String,
}

/// The statements, written for one table.
struct Sql {
    claim: String,
    read: String,
    complete: String,
    release: String,
    extend: String,
    purge: String,
}

/// One connection and the statements prepared on it.
struct Conn {
    client: Client,
    claim: Statement,
    read: Statement,
    complete: Statement,
    release: Statement,
    extend: Statement,
    purge: Statement,
}

/// A key's row as the read statement sees it.
struct Row {
    state: String,
    fence: i64,
    released: bool,
    /// Microseconds left on a live lease; `None` once it ended.
    remaining: Option<i64>,
}

impl fmt::Debug for PgClaims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the URL: it may carry a password.
        f.debug_struct("PgClaims")
            .field("table", &self.inner.table.name.as_str())
            .finish_non_exhaustive()
    }
}

impl PgClaims {
    /// The table of claims unless [`connect_with_table`](Self::connect_with_table)
    /// names another.
    pub const DEFAULT_TABLE: &'static str = "jobrail_claims";

    /// Connects to the database at `url` (a `postgres://` URL or a
    /// key-value string; TLS as its `sslmode` says, see [`PgConnect`]) and
    /// creates the table [`DEFAULT_TABLE`](Self::DEFAULT_TABLE) if it is
    /// missing. A URL that does not parse is [`ClaimError::Invalid`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use jobrail::{run_once, JobError, Once};
    /// use jobrail_postgres::PgClaims;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let claims = PgClaims::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// let once = run_once(&claims, "charge:order-42", Duration::from_secs(60), |_fence| async {
    ///     // The effect: runs once for this key, across workers and redeliveries.
    ///     Ok::<_, JobError>("receipt-1")
    /// })
    /// .await
    /// .map_err(JobError::into_inner)?;
    /// assert!(matches!(once, Once::Ran(_) | Once::AlreadyDone));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<PgClaims, ClaimError> {
        Self::connect_with_table(url, Self::DEFAULT_TABLE).await
    }

    /// [`connect`](Self::connect), with the claims in `table`, named by the
    /// [crate's rule](crate) (`table` or `schema.table`, each part
    /// `[a-z_][a-z0-9_]*`, the table at most [`MAX_TABLE_BYTES`](crate::MAX_TABLE_BYTES)
    /// bytes; the schema must exist). An unqualified name is found through
    /// the connection's `search_path`. The table is created if it is
    /// missing; creating it from several processes at once is safe.
    pub async fn connect_with_table(url: &str, table: &str) -> Result<PgClaims, ClaimError> {
        let connect = PgConnect::new(url).map_err(|error| {
            ClaimError::Invalid(format!(
                "the Postgres connection settings do not parse: {error}"
            ))
        })?;
        Self::connect_to(connect, table).await
    }

    /// [`connect_with_table`](Self::connect_with_table) through `connect`:
    /// settings built in code, TLS roots of the caller's, other
    /// reconnection waits.
    pub async fn connect_to(connect: PgConnect, table: &str) -> Result<PgClaims, ClaimError> {
        let table = Table::parse(table)?;
        let sql = Sql::new(&table.quoted);
        let store = PgClaims {
            inner: Arc::new(Inner {
                dialer: connect.dialer(),
                table,
                sql,
                conn: Mutex::new(None),
            }),
        };
        store.conn().await?;
        Ok(store)
    }

    /// The DDL of the claims table `table` (checked as
    /// [`connect_with_table`](Self::connect_with_table) does), for those
    /// who run their migrations themselves. Every statement is idempotent.
    pub fn install_sql(table: &str) -> Result<String, ClaimError> {
        Ok(Table::parse(table)?.ddl())
    }

    /// The table of claims, as given.
    pub fn table(&self) -> &str {
        self.inner.table.name.as_str()
    }

    /// Records the completion of the claim `fence` of `key` through
    /// `client`: the caller's connection or, above all, the caller's open
    /// transaction, so that a database effect and its completion commit
    /// together. The table must be reachable from that connection (the
    /// same database, and the same `search_path` for an unqualified name).
    ///
    /// [`ClaimError::Lost`] as [`ClaimStore::complete`] says: the lease
    /// has ended, a newer claim took the key, or it is done. Drop the
    /// transaction then (a rollback): the effect does not happen, and the
    /// newer holder's does. Until the transaction ends, the claim's row is
    /// locked: a concurrent claim of the key waits, then finds it done (a
    /// commit) or held by this claim (a rollback; the lease still runs,
    /// unless it is [released](ClaimStore::release)). If the commit
    /// itself fails, neither happened and the claim is still held.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use jobrail::{Claim, ClaimError, ClaimStore};
    /// use jobrail_postgres::{PgClaims, PgConnect};
    ///
    /// # async fn example() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let connect = PgConnect::new("postgres://app@db.internal/shop")?;
    /// let claims = PgClaims::connect_to(connect.clone(), PgClaims::DEFAULT_TABLE).await?;
    /// let mut client = connect.connect().await?;
    ///
    /// let key = "refund:order-42";
    /// if let Claim::Claimed { fence } = claims.claim(key, Duration::from_secs(60)).await? {
    ///     let tx = client.transaction().await?;
    ///     tx.execute("INSERT INTO refunds (order_id, cents) VALUES (42, 1250)", &[])
    ///         .await?;
    ///     match claims.complete_in(&tx, key, fence).await {
    ///         // The refund and its completion, at once.
    ///         Ok(()) => tx.commit().await?,
    ///         // Too late: dropping `tx` rolls the refund back.
    ///         Err(ClaimError::Lost { .. }) => {}
    ///         Err(other) => return Err(other.into()),
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn complete_in<C>(&self, client: &C, key: &str, fence: u64) -> Result<(), ClaimError>
    where
        C: GenericClient + Sync,
    {
        let Some(db_fence) = held_fence(key, fence) else {
            return Err(lost(key, fence));
        };
        let changed = client
            .execute_typed(
                &self.inner.sql.complete,
                &[(&key, Type::TEXT), (&db_fence, Type::INT8)],
            )
            .await
            .map_err(ClaimError::store)?;
        if changed == 1 {
            Ok(())
        } else {
            Err(lost(key, fence))
        }
    }

    /// Deletes the done rows completed more than `older_than` ago (on the
    /// server's clock) and says how many. How long to keep them is the
    /// application's choice, but a purged key is a new key: a redelivery
    /// of its job after the purge runs the effect again. Keep done rows
    /// longer than any job may be redelivered, and longer than the longest
    /// lease (a stale holder of a purged key's old fence could pass for the
    /// new claim's).
    pub async fn purge_done(&self, older_than: Duration) -> Result<u64, ClaimError> {
        let age = micros(older_than.min(MAX_PURGE_AGE));
        self.with_conn(|conn, _| async move { conn.client.execute(&conn.purge, &[&age]).await })
            .await
    }

    /// The live connection, connecting (and preparing the statements)
    /// first if there is none or the server closed it.
    async fn conn(&self) -> Result<Arc<Conn>, ClaimError> {
        let mut slot = self.inner.conn.lock().await;
        if let Some(conn) = slot.as_ref() {
            if !conn.client.is_closed() {
                return Ok(conn.clone());
            }
        }
        *slot = None;
        let conn = Arc::new(Conn::open(&self.inner).await.map_err(ClaimError::store)?);
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets `conn` (if it is still the current one), so that the next
    /// operation connects again.
    async fn forget(&self, conn: &Arc<Conn>) {
        let mut slot = self.inner.conn.lock().await;
        if slot
            .as_ref()
            .is_some_and(|current| Arc::ptr_eq(current, conn))
        {
            *slot = None;
        }
    }

    /// Runs `op` on the connection; if the connection was lost under it,
    /// once more on a new one (`op`'s second argument says it is the
    /// second try).
    async fn with_conn<T, F, Fut>(&self, op: F) -> Result<T, ClaimError>
    where
        F: Fn(Arc<Conn>, bool) -> Fut,
        Fut: Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let bound = self.inner.dialer.operation_timeout();
        let conn = tokio::time::timeout(bound, self.conn())
            .await
            .map_err(|_| {
                ClaimError::Store(
                    format!("no connection to Postgres within {bound:?} (a silent server?)").into(),
                )
            })??;
        let first = match tokio::time::timeout(bound, op(conn.clone(), false)).await {
            Ok(result) => result,
            Err(_) => return Err(self.silent(&conn, bound).await),
        };
        match first {
            Ok(value) => Ok(value),
            Err(error) if connection_lost(&error, &conn) => {
                tracing::debug!(%error, "postgres claims: connection lost, trying once more");
                self.forget(&conn).await;
                let conn = self.conn().await?;
                match tokio::time::timeout(bound, op(conn.clone(), true)).await {
                    Ok(result) => result.map_err(ClaimError::store),
                    Err(_) => Err(self.silent(&conn, bound).await),
                }
            }
            Err(error) => Err(ClaimError::store(error)),
        }
    }

    /// An operation on `conn` got no answer within `bound`: the connection
    /// is dropped (the next operation connects again), and the outcome is
    /// unknown.
    async fn silent(&self, conn: &Arc<Conn>, bound: Duration) -> ClaimError {
        self.forget(conn).await;
        tracing::warn!(
            ?bound,
            "postgres claims: no answer within the operation timeout; dropping the connection"
        );
        ClaimError::Store(
            format!(
                "no answer from Postgres within {bound:?} (the connection is dropped and the next \
                 operation connects again; whether this one was applied is unknown)"
            )
            .into(),
        )
    }

    async fn claim_now(&self, key: &str, lease: Duration) -> Result<Claim, ClaimError> {
        validate_claim(key, lease)?;
        if key.contains('\0') {
            return Err(ClaimError::Invalid(
                "the key holds a NUL character, which Postgres text cannot".into(),
            ));
        }
        let lease = micros(lease);
        self.with_conn(|conn, _| async move {
            // A row that vanished (purged) or a lease that ended between the
            // two statements: the claim may succeed now, so try again.
            for _ in 0..3 {
                if let Some(row) = conn.client.query_opt(&conn.claim, &[&key, &lease]).await? {
                    let fence: i64 = row.get(0);
                    return Ok(Claim::Claimed {
                        fence: fence as u64,
                    });
                }
                match conn.read(key).await? {
                    Some(row) if row.state == "done" => return Ok(Claim::Done),
                    Some(Row {
                        remaining: Some(left),
                        ..
                    }) => {
                        return Ok(Claim::Held {
                            remaining: Duration::from_micros(left.max(0) as u64),
                        })
                    }
                    _ => continue,
                }
            }
            Ok(Claim::Held {
                remaining: Duration::ZERO,
            })
        })
        .await
    }

    async fn complete_now(&self, key: &str, fence: u64) -> Result<(), ClaimError> {
        let Some(db_fence) = held_fence(key, fence) else {
            return Err(lost(key, fence));
        };
        self.change(key, fence, |conn, retry| async move {
            if conn
                .client
                .execute(&conn.complete, &[&key, &db_fence])
                .await?
                == 1
            {
                return Ok(true);
            }
            // On the second try, the first may have gone through.
            Ok(retry
                && conn
                    .read(key)
                    .await?
                    .is_some_and(|row| row.state == "done" && row.fence == db_fence))
        })
        .await
    }

    async fn release_now(&self, key: &str, fence: u64) -> Result<(), ClaimError> {
        let Some(db_fence) = held_fence(key, fence) else {
            return Err(lost(key, fence));
        };
        self.change(key, fence, |conn, retry| async move {
            if conn
                .client
                .execute(&conn.release, &[&key, &db_fence])
                .await?
                == 1
            {
                return Ok(true);
            }
            Ok(retry
                && conn.read(key).await?.is_some_and(|row| {
                    row.state == "held" && row.fence == db_fence && row.released
                }))
        })
        .await
    }

    async fn extend_now(&self, key: &str, fence: u64, lease: Duration) -> Result<(), ClaimError> {
        validate_claim(key, lease)?;
        let Some(db_fence) = held_fence(key, fence) else {
            return Err(lost(key, fence));
        };
        let lease = micros(lease);
        // Extending twice (a second try) only moves the end again.
        self.change(key, fence, |conn, _| async move {
            Ok(conn
                .client
                .execute(&conn.extend, &[&key, &db_fence, &lease])
                .await?
                == 1)
        })
        .await
    }

    async fn state_now(&self, key: &str) -> Result<ClaimState, ClaimError> {
        if key.contains('\0') {
            return Ok(ClaimState::Free);
        }
        self.with_conn(|conn, _| async move {
            Ok(match conn.read(key).await? {
                Some(row) if row.state == "done" => ClaimState::Done,
                Some(Row {
                    remaining: Some(left),
                    ..
                }) => ClaimState::Held {
                    remaining: Duration::from_micros(left.max(0) as u64),
                },
                _ => ClaimState::Free,
            })
        })
        .await
    }

    /// Runs a change of the claim `fence` that answers whether it applied:
    /// [`ClaimError::Lost`] when it did not.
    async fn change<F, Fut>(&self, key: &str, fence: u64, op: F) -> Result<(), ClaimError>
    where
        F: Fn(Arc<Conn>, bool) -> Fut,
        Fut: Future<Output = Result<bool, tokio_postgres::Error>>,
    {
        if self.with_conn(op).await? {
            Ok(())
        } else {
            Err(lost(key, fence))
        }
    }
}

impl ClaimStore for PgClaims {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        Box::pin(self.claim_now(key, lease))
    }

    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.complete_now(key, fence))
    }

    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.release_now(key, fence))
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.extend_now(key, fence, lease))
    }

    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        Box::pin(self.state_now(key))
    }
}

impl Conn {
    /// Connects, creates the table if it is missing and prepares the
    /// statements.
    async fn open(inner: &Inner) -> Result<Conn, tokio_postgres::Error> {
        let client = inner.dialer.dial().await?;
        ensure_table(&client, &inner.table).await?;
        let sql = &inner.sql;
        let (claim, read, complete, release, extend, purge) = tokio::try_join!(
            client.prepare_typed(&sql.claim, &[Type::TEXT, Type::INT8]),
            client.prepare_typed(&sql.read, &[Type::TEXT]),
            client.prepare_typed(&sql.complete, &[Type::TEXT, Type::INT8]),
            client.prepare_typed(&sql.release, &[Type::TEXT, Type::INT8]),
            client.prepare_typed(&sql.extend, &[Type::TEXT, Type::INT8, Type::INT8]),
            client.prepare_typed(&sql.purge, &[Type::INT8]),
        )?;
        Ok(Conn {
            client,
            claim,
            read,
            complete,
            release,
            extend,
            purge,
        })
    }

    /// The row of `key`, if there is one.
    async fn read(&self, key: &str) -> Result<Option<Row>, tokio_postgres::Error> {
        Ok(self
            .client
            .query_opt(&self.read, &[&key])
            .await?
            .map(|row| Row {
                state: row.get(0),
                fence: row.get(1),
                released: row.get(2),
                remaining: row.get(3),
            }))
    }
}

/// Creates the table (and its index) unless it exists. Two processes doing
/// so at once can collide in the catalog (a unique violation, or "already
/// exists"): the loser looks again and finds the table.
async fn ensure_table(client: &Client, table: &Table) -> Result<(), tokio_postgres::Error> {
    let ddl = table.ddl();
    let mut attempt = 0;
    loop {
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.quoted])
            .await?
            .get(0);
        if exists {
            return Ok(());
        }
        // One simple query: the table and its index commit together.
        match client.batch_execute(&ddl).await {
            Ok(()) => return Ok(()),
            Err(error) if attempt < 3 && creation_race(&error) => attempt += 1,
            Err(error) => return Err(error),
        }
    }
}

fn creation_race(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(code) if *code == SqlState::UNIQUE_VIOLATION
            || *code == SqlState::DUPLICATE_TABLE
            || *code == SqlState::DUPLICATE_OBJECT
    )
}

/// Whether `error` means the connection is gone (closed, terminated by the
/// server, or the server shutting down).
fn connection_lost(error: &tokio_postgres::Error, conn: &Conn) -> bool {
    if error.is_closed() || conn.client.is_closed() {
        return true;
    }
    error.code().is_some_and(|code| {
        let code = code.code();
        code.starts_with("08") || code.starts_with("57P")
    })
}

/// The fence as stored, if `key` and `fence` could name a claim at all.
fn held_fence(key: &str, fence: u64) -> Option<i64> {
    if key.is_empty() || key.len() > jobrail::MAX_CLAIM_KEY_BYTES || key.contains('\0') {
        return None;
    }
    i64::try_from(fence).ok().filter(|f| *f >= 1)
}

fn lost(key: &str, fence: u64) -> ClaimError {
    ClaimError::Lost {
        key: key.to_owned(),
        fence,
    }
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

impl Table {
    fn parse(table: &str) -> Result<Table, ClaimError> {
        let name = TableName::parse(table).map_err(|e| ClaimError::Invalid(e.to_string()))?;
        Ok(Table {
            quoted: name.quoted(),
            done_index: name.index(DONE_INDEX),
            name,
        })
    }

    fn ddl(&self) -> String {
        let Table {
            quoted, done_index, ..
        } = self;
        format!(
            "CREATE TABLE IF NOT EXISTS {quoted} (\n    \
                key text COLLATE \"C\" PRIMARY KEY,\n    \
                fence bigint NOT NULL,\n    \
                state text NOT NULL CHECK (state IN ('held', 'done')),\n    \
                lease_until timestamptz NOT NULL,\n    \
                claimed_at timestamptz NOT NULL,\n    \
                done_at timestamptz\n\
             );\n\
             CREATE INDEX IF NOT EXISTS {done_index} ON {quoted} (done_at) WHERE state = 'done';\n"
        )
    }
}

impl Sql {
    fn new(t: &str) -> Sql {
        const MICROS: &str = "interval '1 microsecond'";
        Sql {
            // $1 key, $2 lease in microseconds. Takes a new key, or one whose
            // lease ended (expired or released), with the next fence.
            claim: format!(
                "INSERT INTO {t} AS c (key, fence, state, lease_until, claimed_at) \
                 VALUES ($1, 1, 'held', clock_timestamp() + $2 * {MICROS}, clock_timestamp()) \
                 ON CONFLICT (key) DO UPDATE \
                 SET fence = c.fence + 1, \
                     lease_until = clock_timestamp() + $2 * {MICROS}, \
                     claimed_at = clock_timestamp() \
                 WHERE c.state = 'held' AND c.lease_until <= clock_timestamp() \
                 RETURNING c.fence"
            ),
            // $1 key: state, fence, released, microseconds left on a live lease.
            read: format!(
                "SELECT c.state, c.fence, c.lease_until = '-infinity'::timestamptz, \
                        CASE WHEN c.lease_until > n.now \
                             THEN (extract(epoch FROM c.lease_until - n.now) * 1000000)::bigint \
                        END \
                 FROM {t} AS c, (SELECT clock_timestamp() AS now) AS n \
                 WHERE c.key = $1"
            ),
            // $1 key, $2 fence.
            complete: format!(
                "UPDATE {t} SET state = 'done', done_at = clock_timestamp() \
                 WHERE key = $1 AND fence = $2 AND state = 'held' \
                   AND lease_until > clock_timestamp()"
            ),
            // $1 key, $2 fence. The fence stays, so the next claim's is higher.
            release: format!(
                "UPDATE {t} SET lease_until = '-infinity' \
                 WHERE key = $1 AND fence = $2 AND state = 'held' \
                   AND lease_until > clock_timestamp()"
            ),
            // $1 key, $2 fence, $3 lease in microseconds.
            extend: format!(
                "UPDATE {t} SET lease_until = clock_timestamp() + $3 * {MICROS} \
                 WHERE key = $1 AND fence = $2 AND state = 'held' \
                   AND lease_until > clock_timestamp()"
            ),
            // $1 age in microseconds.
            purge: format!(
                "DELETE FROM {t} \
                 WHERE state = 'done' AND done_at < clock_timestamp() - $1 * {MICROS}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_follow_the_crate_rule() {
        let long = Table::parse(&format!("s.{}", "a".repeat(55))).unwrap();
        assert_eq!(long.quoted, format!("\"s\".\"{}\"", "a".repeat(55)));
        assert_eq!(long.done_index, format!("\"{}_done_at\"", "a".repeat(55)));
        assert!(long.ddl().contains(&format!(
            "CREATE INDEX IF NOT EXISTS {} ON {} (done_at)",
            long.done_index, long.quoted
        )));
        let err = match Table::parse(&"a".repeat(56)) {
            Err(ClaimError::Invalid(why)) => why,
            _ => panic!("a 56-byte table is refused"),
        };
        assert!(err.contains("more than 55"), "{err}");
        assert!(matches!(Table::parse("a.b.c"), Err(ClaimError::Invalid(_))));
    }

    #[test]
    fn fences_and_keys_that_cannot_be_held() {
        assert_eq!(held_fence("k", 1), Some(1));
        assert_eq!(held_fence("k", 0), None);
        assert_eq!(held_fence("k", u64::MAX), None);
        assert_eq!(held_fence("a\0b", 1), None);
        assert_eq!(held_fence("", 1), None);
    }
}
