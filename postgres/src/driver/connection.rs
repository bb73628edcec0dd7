//! The driver's connections: a few clients that pipeline its statements,
//! each with the statements prepared, opened again after the server closed
//! one; and the connection that listens for new jobs.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use jobrail_native::kit::{lock, Reconnect};
use jobrail_native::{DriverError, ErrorKind};
use tokio::sync::Notify;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Statement};

use super::errors::{connect_error, read_error};
use super::topology::{channel, check, quoted};
use super::PgConfig;
use crate::connect::Dialer;

/// One connection and its prepared statements.
pub(crate) struct Conn {
    pub(crate) client: Client,
    /// An operation on it went unanswered past the operation timeout: the
    /// pool opens another in its place.
    silent: AtomicBool,
    pub(crate) fetch: Statement,
    pub(crate) next_due: Statement,
    pub(crate) renew: Statement,
    pub(crate) delete_many: Statement,
    pub(crate) notify: Statement,
    pub(crate) retry: Statement,
    pub(crate) release: Statement,
    pub(crate) fail: Statement,
    pub(crate) insert_many: Statement,
}

/// The SQL of every statement, for one schema.
pub(crate) struct Sql {
    pub(crate) fetch: String,
    pub(crate) next_due: String,
    pub(crate) renew: String,
    pub(crate) delete_many: String,
    pub(crate) notify: String,
    pub(crate) retry: String,
    pub(crate) release: String,
    pub(crate) fail: String,
    pub(crate) insert_many: String,
    /// Deletes a held row inside a caller's transaction (`complete_in`).
    pub(crate) complete: String,
    /// Inserts a row and notifies, inside a caller's transaction.
    pub(crate) insert_notify: String,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Sql {
        let s = quoted(schema);
        let channel = channel(schema);
        Sql {
            // Rows due, oldest first, that no other transaction has locked;
            // each gets a new fencing token, one more attempt, and its
            // lease's end as its run time.
            fetch: format!(
                "WITH picked AS (\
                   SELECT id FROM {s}.jobs WHERE queue = $1 AND run_at <= now() \
                   ORDER BY run_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 UPDATE {s}.jobs AS j SET attempts = j.attempts + 1, \
                   lease = nextval('{s}.leases'), \
                   run_at = now() + $3::int8 * interval '1 microsecond' \
                 FROM picked WHERE j.id = picked.id \
                 RETURNING j.id, j.message_id, j.body, j.attempts, j.shutdowns, j.lease"
            ),
            // Microseconds until the queue's next row is due (a delay or a
            // lease ending), NULL when the queue is empty.
            next_due: format!(
                "SELECT (extract(epoch FROM min(run_at) - now()) * 1000000)::int8 \
                 FROM {s}.jobs WHERE queue = $1"
            ),
            // Extends a lease still held; a row locked by the handler's own
            // transaction is skipped (not waited for) and reported held.
            renew: format!(
                "WITH u AS (UPDATE {s}.jobs SET run_at = now() + $3::int8 * interval '1 microsecond' \
                   WHERE id = (SELECT id FROM {s}.jobs WHERE id = $1 AND lease = $2 \
                               FOR UPDATE SKIP LOCKED) RETURNING 1) \
                 SELECT (SELECT count(*) FROM u)::int8, \
                        EXISTS (SELECT 1 FROM {s}.jobs WHERE id = $1 AND lease = $2)"
            ),
            delete_many: format!(
                "DELETE FROM {s}.jobs AS j USING unnest($1::int8[], $2::int8[]) AS d(id, lease) \
                 WHERE j.id = d.id AND j.lease = d.lease RETURNING j.id"
            ),
            notify: format!("SELECT pg_notify('{channel}', $1)"),
            retry: format!(
                "UPDATE {s}.jobs SET lease = NULL, \
                   run_at = now() + $3::int8 * interval '1 microsecond', shutdowns = shutdowns + $4 \
                 WHERE id = $1 AND lease = $2"
            ),
            // A delivery given back unsettled: due now, with `$3` attempts
            // taken back (1 for a message never handed to a handler).
            release: format!(
                "UPDATE {s}.jobs SET lease = NULL, run_at = now(), \
                   attempts = greatest(attempts - $3, 0) \
                 WHERE id = $1 AND lease = $2"
            ),
            fail: format!(
                "WITH d AS (DELETE FROM {s}.jobs WHERE id = $1 AND lease = $2 RETURNING queue) \
                 INSERT INTO {s}.failures (queue, entry_id, message_id, body) \
                 SELECT queue, $3, $4, $5 FROM d"
            ),
            insert_many: format!(
                "INSERT INTO {s}.jobs (queue, message_id, body, run_at) \
                 SELECT m.queue, m.id, m.body, now() + m.delay * interval '1 microsecond' \
                 FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[]) \
                   AS m(queue, id, body, delay)"
            ),
            complete: format!("DELETE FROM {s}.jobs WHERE id = $1 AND lease = $2"),
            // Inside the caller's transaction: the notification goes out
            // when it commits, and never if it rolls back.
            insert_notify: format!(
                "WITH i AS (INSERT INTO {s}.jobs (queue, message_id, body, run_at) \
                   VALUES ($1, $2, $3, now() + $4::int8 * interval '1 microsecond') RETURNING queue) \
                 SELECT pg_notify('{channel}', queue) FROM i"
            ),
        }
    }
}

impl Conn {
    async fn open(dialer: &Dialer, sql: &Sql, config: &PgConfig) -> Result<Conn, DriverError> {
        let client = dialer.dial().await.map_err(connect_error)?;
        let lock_ms = config.lock_timeout.as_millis().max(1);
        client
            .batch_execute(&format!("SET lock_timeout = {lock_ms}"))
            .await
            .map_err(|e| read_error("set lock_timeout", e))?;
        let prepare = |text: &str, types: &[Type]| {
            let client = &client;
            let text = text.to_owned();
            let types = types.to_vec();
            async move {
                client
                    .prepare_typed(&text, &types)
                    .await
                    .map_err(|e| read_error("prepare the driver's statements", e))
            }
        };
        use Type as T;
        let fetch = prepare(&sql.fetch, &[T::TEXT, T::INT8, T::INT8]).await?;
        let next_due = prepare(&sql.next_due, &[T::TEXT]).await?;
        let renew = prepare(&sql.renew, &[T::INT8, T::INT8, T::INT8]).await?;
        let delete_many = prepare(&sql.delete_many, &[T::INT8_ARRAY, T::INT8_ARRAY]).await?;
        let notify = prepare(&sql.notify, &[T::TEXT]).await?;
        let retry = prepare(&sql.retry, &[T::INT8, T::INT8, T::INT8, T::INT4]).await?;
        let release = prepare(&sql.release, &[T::INT8, T::INT8, T::INT4]).await?;
        let fail = prepare(&sql.fail, &[T::INT8, T::INT8, T::TEXT, T::TEXT, T::BYTEA]).await?;
        let insert_many = prepare(
            &sql.insert_many,
            &[T::TEXT_ARRAY, T::TEXT_ARRAY, T::BYTEA_ARRAY, T::INT8_ARRAY],
        )
        .await?;
        Ok(Conn {
            client,
            silent: AtomicBool::new(false),
            fetch,
            next_due,
            renew,
            delete_many,
            notify,
            retry,
            release,
            fail,
            insert_many,
        })
    }
}

/// The driver's statement connections, used in turn.
pub(crate) struct Pool {
    dialer: Dialer,
    sql: Sql,
    config: PgConfig,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Conn>>>>,
    next: AtomicUsize,
}

impl Pool {
    pub(crate) fn new(config: &PgConfig) -> Pool {
        Pool {
            dialer: config.connect.dialer(),
            sql: Sql::new(&config.schema),
            config: config.clone(),
            slots: (0..config.connections)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next: AtomicUsize::new(0),
        }
    }

    /// The bound on each statement.
    pub(crate) fn operation_timeout(&self) -> Duration {
        self.config.connect.get_operation_timeout()
    }

    pub(crate) fn sql(&self) -> &Sql {
        &self.sql
    }

    /// A live connection, the next in turn, opened (and checked against
    /// the schema, for the first) if it is not.
    pub(crate) async fn get(&self) -> Result<Arc<Conn>, DriverError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let mut slot = self.slots[n].lock().await;
        if let Some(conn) = slot.as_ref() {
            if !conn.client.is_closed() && !conn.silent.load(Ordering::SeqCst) {
                return Ok(conn.clone());
            }
        }
        *slot = None;
        let bound = self.config.connect.get_operation_timeout();
        let opened = tokio::time::timeout(bound, Conn::open(&self.dialer, &self.sql, &self.config))
            .await
            .map_err(|_| silent_error(ErrorKind::Connection, "connect to Postgres", bound))?;
        let conn = Arc::new(opened?);
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Connects one connection and checks that the schema is installed at
    /// this driver's version.
    pub(crate) async fn check(&self) -> Result<(), DriverError> {
        let client = self.dialer.dial().await.map_err(connect_error)?;
        check(&client, &self.config.schema).await
    }

    /// A connection of the caller's own (install).
    pub(crate) async fn dial(&self) -> Result<Client, DriverError> {
        self.dialer.dial().await.map_err(connect_error)
    }
}

impl Conn {
    /// Runs `op`, a statement on this connection, within the operation
    /// timeout `bound`. Past it the connection is marked silent (the pool
    /// replaces it; its statements in flight fail the same way) and the
    /// statement fails with `kind`: [`ErrorKind::Uncertain`] for one that
    /// changes something (it may have been applied), else
    /// [`ErrorKind::Connection`].
    pub(crate) async fn within<T>(
        &self,
        bound: Duration,
        kind: ErrorKind,
        doing: &str,
        op: impl Future<Output = Result<T, DriverError>>,
    ) -> Result<T, DriverError> {
        match tokio::time::timeout(bound, op).await {
            Ok(result) => result,
            Err(_) => {
                self.silent.store(true, Ordering::SeqCst);
                tracing::warn!(
                    ?bound,
                    doing,
                    "postgres: no answer within the operation timeout; replacing the connection"
                );
                Err(silent_error(kind, doing, bound))
            }
        }
    }
}

/// The error of a statement that got no answer within `bound`.
fn silent_error(kind: ErrorKind, doing: &str, bound: Duration) -> DriverError {
    DriverError::new(
        super::errors::NAME,
        kind,
        format!(
            "{doing}: no answer from Postgres within {bound:?} (the connection is replaced; \
             a silent server, a partition or a half-open link)"
        ),
    )
}

/// Who waits for new jobs on which queue: the listener wakes them.
#[derive(Default)]
pub(crate) struct Waiters {
    by_queue: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
}

impl Waiters {
    /// A wake-up for `queue`, signalled on every notification for it.
    pub(crate) fn register(&self, queue: &str) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        let mut by_queue = lock(&self.by_queue);
        let list = by_queue.entry(queue.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&notify));
        notify
    }

    /// Wakes every subscription of `queue` (a stored wake-up where one is
    /// not waiting yet).
    pub(crate) fn wake(&self, queue: &str) {
        let by_queue = lock(&self.by_queue);
        if let Some(list) = by_queue.get(queue) {
            for waiter in list.iter().filter_map(Weak::upgrade) {
                waiter.notify_one();
            }
        }
    }

    /// Wakes every subscription (the listener reconnected: notifications
    /// may have been missed).
    pub(crate) fn wake_all(&self) {
        let by_queue = lock(&self.by_queue);
        for waiter in by_queue.values().flatten().filter_map(Weak::upgrade) {
            waiter.notify_one();
        }
    }
}

/// Listens on the schema's channel until `stopped`, waking the waiters of
/// each notified queue, connecting again after a lost connection (the
/// subscriptions poll meanwhile).
pub(crate) async fn listen(
    config: PgConfig,
    waiters: Arc<Waiters>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let channel = channel(&config.schema);
    let mut wait = Reconnect::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        if *stopped.borrow() {
            return;
        }
        let session = async {
            let (client, notifications) = config.connect.connect_listening().await?;
            client
                .batch_execute(&format!("LISTEN \"{channel}\""))
                .await?;
            Ok::<_, tokio_postgres::Error>((client, notifications))
        };
        let outcome = tokio::select! {
            _ = stopped.changed() => return,
            outcome = session => outcome,
        };
        match outcome {
            Ok((_client, mut notifications)) => {
                wait.succeeded();
                // What was dispatched while no one listened.
                waiters.wake_all();
                loop {
                    tokio::select! {
                        _ = stopped.changed() => return,
                        notification = notifications.recv() => match notification {
                            Some(n) => waiters.wake(n.payload()),
                            None => break,
                        },
                    }
                }
                tracing::debug!("postgres: the listening connection ended; connecting again");
            }
            Err(error) => {
                let pause = wait.failed();
                tracing::debug!(%error, ?pause, "postgres: cannot listen; subscriptions poll meanwhile");
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// Notifications for the driver's own writes, coalesced per queue: at most
/// one `NOTIFY` in flight for a queue; writes that finish meanwhile are
/// announced by one more once it returns. Each notification is sent after
/// the writes it announces committed, so a woken worker finds them.
#[derive(Default)]
pub(crate) struct Announcer {
    queues: Mutex<HashMap<String, Announcing>>,
}

#[derive(Default)]
struct Announcing {
    /// A notification is being sent.
    running: bool,
    /// A write finished since it started.
    again: bool,
}

impl Announcer {
    /// Says that `queue` has new rows due: wakes this driver's own
    /// subscriptions of it at once, and the other workers' through
    /// `NOTIFY`.
    pub(crate) fn announce(self: &Arc<Self>, pool: &Arc<Pool>, waiters: &Waiters, queue: &str) {
        waiters.wake(queue);
        {
            let mut queues = lock(&self.queues);
            let state = queues.entry(queue.to_owned()).or_default();
            if state.running {
                state.again = true;
                return;
            }
            state.running = true;
        }
        let (announcer, pool, queue) = (self.clone(), pool.clone(), queue.to_owned());
        tokio::spawn(async move {
            loop {
                let sent = match pool.get().await {
                    Ok(conn) => conn
                        .client
                        .execute(&conn.notify, &[&queue])
                        .await
                        .map(|_| ()),
                    Err(error) => {
                        tracing::debug!(%error, queue, "postgres: no notification sent; other workers find the rows at their next poll");
                        Ok(())
                    }
                };
                if let Err(error) = sent {
                    tracing::debug!(%error, queue, "postgres: no notification sent; other workers find the rows at their next poll");
                }
                let mut queues = lock(&announcer.queues);
                let state = queues.entry(queue.clone()).or_default();
                if state.again {
                    state.again = false;
                } else {
                    state.running = false;
                    return;
                }
            }
        });
    }
}
