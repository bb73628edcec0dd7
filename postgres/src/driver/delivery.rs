//! Consumption: a subscription's fetches (`FOR UPDATE SKIP LOCKED`, woken
//! by `NOTIFY`, polling as a fallback), each delivery's lease and its
//! renewal, and settlements fenced by the lease's token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jobrail::Settlement;
use jobrail_native::kit::Reconnect;
use jobrail_native::{Delivery, DriverError, ErrorKind, StoredFailure, Subscription};
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::errors::{fenced, read_error, write_error};
use super::{micros, HeldKey, Inner};

/// A subscription: a task that fetches while the prefetch has room, and
/// the deliveries it fetched, in order.
pub(crate) struct PgSubscription {
    inner: Arc<Inner>,
    deliveries: mpsc::Receiver<Result<PgDelivery, DriverError>>,
    close: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl PgSubscription {
    pub(crate) fn start(inner: Arc<Inner>, queue: &str, prefetch: usize) -> PgSubscription {
        let prefetch = prefetch.max(1);
        let (sender, deliveries) = mpsc::channel(prefetch);
        let (close, closed) = watch::channel(false);
        let wake = inner.waiters.register(queue);
        let task = tokio::spawn(fetch_loop(
            inner.clone(),
            queue.to_owned(),
            prefetch,
            sender,
            wake,
            closed,
        ));
        PgSubscription {
            inner,
            deliveries,
            close,
            task,
        }
    }
}

impl Drop for PgSubscription {
    fn drop(&mut self) {
        let _ = self.close.send(true);
        self.task.abort();
    }
}

#[async_trait]
impl Subscription for PgSubscription {
    async fn next(&mut self) -> Option<Result<Box<dyn Delivery>, DriverError>> {
        // Cancel-safe: a delivery stays in the channel until received.
        let mut delivery = match self.deliveries.recv().await? {
            Ok(delivery) => delivery,
            Err(error) => return Some(Err(error)),
        };
        delivery.handed_out = true;
        self.inner.hold(&delivery);
        Some(Ok(Box::new(delivery)))
    }

    async fn close(&mut self) {
        let _ = self.close.send(true);
        // Deliveries fetched and not handed out go back, uncounted, as
        // their drop releases them.
        self.deliveries.close();
        while let Ok(delivery) = self.deliveries.try_recv() {
            drop(delivery);
        }
    }
}

/// Fetches while the prefetch has room; waits for a notification, the next
/// row's due time or the poll interval when the queue has nothing due.
async fn fetch_loop(
    inner: Arc<Inner>,
    queue: String,
    prefetch: usize,
    sender: mpsc::Sender<Result<PgDelivery, DriverError>>,
    wake: Arc<Notify>,
    mut closed: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(prefetch));
    let mut stopped = inner.life.watch();
    let mut wait = Reconnect::new(Duration::from_millis(50), Duration::from_secs(5));
    let batch = prefetch.min(inner.config.fetch_batch);
    loop {
        let first = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            _ = closed.changed() => return,
            _ = stopped.changed() => return,
        };
        let mut permits = vec![first];
        take_free(&slots, &mut permits, batch);
        // While deliveries are out, a quarter of a batch is worth a short
        // wait: slots come back in runs as acknowledgements return in
        // batches, and one fetch per slot would cost a commit per job.
        let want = (batch / 4).max(1);
        if permits.len() < want && slots.available_permits() + permits.len() < prefetch {
            let gather = tokio::time::sleep(GATHER);
            tokio::pin!(gather);
            while permits.len() < want {
                tokio::select! {
                    permit = slots.clone().acquire_owned() => match permit {
                        Ok(permit) => permits.push(permit),
                        Err(_) => return,
                    },
                    _ = &mut gather => break,
                }
                take_free(&slots, &mut permits, batch);
            }
        }
        if *closed.borrow() || inner.life.is_stopped() {
            return;
        }
        match inner.fetch(&queue, permits.len()).await {
            Ok(rows) if rows.is_empty() => {
                drop(permits);
                wait.succeeded();
                let pause = match inner.next_due(&queue).await {
                    Ok(Some(due)) => due.min(inner.config.poll_interval),
                    Ok(None) | Err(_) => inner.config.poll_interval,
                };
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(pause) => {}
                    _ = closed.changed() => return,
                    _ = stopped.changed() => return,
                }
            }
            Ok(rows) => {
                wait.succeeded();
                let mut permits = permits.into_iter();
                for row in rows {
                    let permit = permits
                        .next()
                        .expect("a fetch takes at most one row per slot");
                    let delivery = PgDelivery::new(inner.clone(), &queue, row, permit);
                    if sender.send(Ok(delivery)).await.is_err() {
                        // The subscription is gone: the delivery it did not
                        // take went back with the failed send.
                        return;
                    }
                }
            }
            Err(error) => {
                drop(permits);
                let pause = wait.failed();
                tracing::debug!(%error, queue, ?pause, "postgres: fetch failed; trying again");
                if error.kind() != jobrail_native::ErrorKind::Connection
                    && sender.send(Err(error)).await.is_err()
                {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = closed.changed() => return,
                    _ = stopped.changed() => return,
                }
            }
        }
    }
}

/// The longest a fetch waits for a quarter of a batch of free slots while
/// deliveries are out.
const GATHER: Duration = Duration::from_millis(2);

/// Takes every free slot, up to `batch` in all.
fn take_free(slots: &Arc<Semaphore>, permits: &mut Vec<OwnedSemaphorePermit>, batch: usize) {
    while permits.len() < batch {
        match slots.clone().try_acquire_owned() {
            Ok(permit) => permits.push(permit),
            Err(_) => break,
        }
    }
}

/// A row a fetch took.
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) message_id: String,
    pub(crate) body: Vec<u8>,
    pub(crate) attempts: i32,
    pub(crate) shutdowns: i32,
    pub(crate) lease: i64,
}

/// One held row: settled through its lease's token.
pub(crate) struct PgDelivery {
    inner: Arc<Inner>,
    queue: String,
    row: Row,
    /// Set when a handler's transaction deleted the row
    /// ([`PgDriver::complete_in`](super::PgDriver::complete_in)).
    pub(crate) completed: Arc<AtomicBool>,
    /// Set by the renewal when the lease was found taken over.
    lost: Arc<AtomicBool>,
    renewal: JoinHandle<()>,
    /// Whether the consumer received it (else a drop gives its attempt back).
    handed_out: bool,
    settled: bool,
    _slot: OwnedSemaphorePermit,
}

impl PgDelivery {
    fn new(inner: Arc<Inner>, queue: &str, row: Row, slot: OwnedSemaphorePermit) -> PgDelivery {
        let lost = Arc::new(AtomicBool::new(false));
        let renewal = tokio::spawn(renew(
            inner.clone(),
            row.id,
            row.lease,
            queue.to_owned(),
            lost.clone(),
        ));
        PgDelivery {
            inner,
            queue: queue.to_owned(),
            row,
            completed: Arc::new(AtomicBool::new(false)),
            lost,
            renewal,
            handed_out: false,
            settled: false,
            _slot: slot,
        }
    }

    pub(crate) fn key(&self) -> HeldKey {
        (
            self.queue.clone(),
            self.row.message_id.clone(),
            self.attempt(),
        )
    }

    pub(crate) fn row_id(&self) -> i64 {
        self.row.id
    }

    pub(crate) fn lease(&self) -> i64 {
        self.row.lease
    }

    /// The answer to a statement that matched no row held under this
    /// lease: done already if a handler's transaction completed it and the
    /// row is gone; refused (fenced) otherwise.
    async fn unmatched(&self, what: &str) -> Result<(), DriverError> {
        if self.completed.load(Ordering::SeqCst) && !self.inner.row_exists(self.row.id).await? {
            return Ok(());
        }
        Err(fenced(what, &self.queue, &self.row.message_id))
    }
}

impl Drop for PgDelivery {
    fn drop(&mut self) {
        self.renewal.abort();
        if self.handed_out {
            self.inner.unhold(&self.key());
        }
        if self.settled || self.lost.load(Ordering::SeqCst) {
            return;
        }
        // Given back unsettled: due again now. A delivery the consumer
        // never received gives its attempt back; one it received keeps it,
        // as a crash would.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = self.inner.clone();
        let queue = self.queue.clone();
        let (id, lease) = (self.row.id, self.row.lease);
        let taken_back = i32::from(!self.handed_out);
        runtime.spawn(async move {
            match inner.release(id, lease, taken_back).await {
                Ok(()) => inner.announce(&queue),
                Err(error) => {
                    tracing::debug!(%error, "postgres: an unsettled delivery was not released; it comes back when its lease ends");
                }
            }
        });
    }
}

/// Extends the lease every half lease until aborted; marks it lost when
/// the row is no longer held under its token.
async fn renew(inner: Arc<Inner>, id: i64, lease: i64, queue: String, lost: Arc<AtomicBool>) {
    let every = inner.config.lease / 2;
    loop {
        tokio::time::sleep(every).await;
        match inner.renew(id, lease).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(queue, "postgres: a delivery's lease was taken over before it was renewed; its settlement will be refused");
                lost.store(true, Ordering::SeqCst);
                return;
            }
            Err(error) => {
                tracing::debug!(%error, queue, "postgres: renewing a lease failed; trying again at the next renewal");
            }
        }
    }
}

#[async_trait]
impl Delivery for PgDelivery {
    fn body(&self) -> &[u8] {
        &self.row.body
    }

    fn attempt(&self) -> u32 {
        u32::try_from(self.row.attempts).unwrap_or(0)
    }

    fn shutdown_returns(&self) -> Option<u32> {
        Some(u32::try_from(self.row.shutdowns).unwrap_or(0))
    }

    async fn settle(mut self: Box<Self>, settlement: &Settlement) -> Result<(), DriverError> {
        self.renewal.abort();
        self.settled = true;
        let (id, lease) = (self.row.id, self.row.lease);
        let conn = self.inner.pool.get().await?;
        match settlement {
            Settlement::Ack | Settlement::Reject => {
                drop(conn);
                if !self.inner.acks().delete(id, lease).await? {
                    return self.unmatched(settlement.name()).await;
                }
            }
            Settlement::Retry { delay, shutdown } => {
                // Without a delay, the backend's own timing: one lease, as
                // a broker's visibility timeout or ack wait would.
                let delay = micros(delay.unwrap_or(self.inner.config.lease));
                let shutdowns = i32::from(*shutdown);
                let bound = self.inner.config.connect.get_operation_timeout();
                let n = conn
                    .within(bound, ErrorKind::Uncertain, "retry", async {
                        conn.client
                            .execute(&conn.retry, &[&id, &lease, &delay, &shutdowns])
                            .await
                            .map_err(|e| write_error("retry: set the row's run time", e))
                    })
                    .await?;
                if n == 0 {
                    return self.unmatched("retry").await;
                }
                if delay == 0 {
                    self.inner.announce(&self.queue);
                }
            }
            Settlement::Fail(record) => {
                let body = record.encode_within(self.inner.config.max_message_bytes);
                let entry = StoredFailure::from_body(body);
                let message_id = entry.record.as_ref().and_then(|r| r.message_id.clone());
                let bound = self.inner.config.connect.get_operation_timeout();
                let n = conn
                    .within(bound, ErrorKind::Uncertain, "fail", async {
                        conn.client
                            .execute(
                                &conn.fail,
                                &[&id, &lease, &entry.id, &message_id, &entry.body],
                            )
                            .await
                            .map_err(|e| write_error("fail: move the row to the failures", e))
                    })
                    .await?;
                if n == 0 {
                    return self.unmatched("fail").await;
                }
            }
        }
        Ok(())
    }
}

impl Inner {
    /// Takes up to `n` due rows of `queue`.
    pub(crate) async fn fetch(&self, queue: &str, n: usize) -> Result<Vec<Row>, DriverError> {
        self.life.check_running()?;
        let conn = self.pool.get().await?;
        let limit = i64::try_from(n).unwrap_or(i64::MAX);
        let lease = micros(self.config.lease);
        let bound = self.config.connect.get_operation_timeout();
        // A fetch takes rows: unanswered, it may have taken some, which
        // come back when their lease ends.
        let rows = conn
            .within(bound, ErrorKind::Connection, "fetch", async {
                conn.client
                    .query(&conn.fetch, &[&queue, &limit, &lease])
                    .await
                    .map_err(|e| read_error(format!("fetch from queue `{queue}`"), e))
            })
            .await?;
        let mut rows: Vec<Row> = rows
            .into_iter()
            .map(|r| Row {
                id: r.get(0),
                message_id: r.get(1),
                body: r.get(2),
                attempts: r.get(3),
                shutdowns: r.get(4),
                lease: r.get(5),
            })
            .collect();
        rows.sort_by_key(|r| r.id);
        Ok(rows)
    }

    /// How long until `queue`'s next row is due; `None` when it has none.
    async fn next_due(&self, queue: &str) -> Result<Option<Duration>, DriverError> {
        let conn = self.pool.get().await?;
        let bound = self.config.connect.get_operation_timeout();
        let row = conn
            .within(
                bound,
                ErrorKind::Connection,
                "read the next due time",
                async {
                    conn.client
                        .query_one(&conn.next_due, &[&queue])
                        .await
                        .map_err(|e| read_error("read the next due time", e))
                },
            )
            .await?;
        Ok(row
            .get::<_, Option<i64>>(0)
            .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))))
    }

    /// Extends a lease; `false` when the row is no longer held under it.
    async fn renew(&self, id: i64, lease: i64) -> Result<bool, DriverError> {
        let conn = self.pool.get().await?;
        let bound = self.config.connect.get_operation_timeout();
        let row = conn
            .within(bound, ErrorKind::Uncertain, "renew a lease", async {
                conn.client
                    .query_one(&conn.renew, &[&id, &lease, &micros(self.config.lease)])
                    .await
                    .map_err(|e| write_error("renew a lease", e))
            })
            .await?;
        Ok(row.get::<_, i64>(0) == 1 || row.get::<_, bool>(1))
    }

    /// Gives a held row back, due now, `taken_back` attempts fewer.
    async fn release(&self, id: i64, lease: i64, taken_back: i32) -> Result<(), DriverError> {
        let conn = self.pool.get().await?;
        let bound = self.config.connect.get_operation_timeout();
        conn.within(bound, ErrorKind::Uncertain, "release a delivery", async {
            conn.client
                .execute(&conn.release, &[&id, &lease, &taken_back])
                .await
                .map_err(|e| write_error("release a delivery", e))
        })
        .await?;
        Ok(())
    }

    async fn row_exists(&self, id: i64) -> Result<bool, DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}.jobs WHERE id = $1)",
            super::topology::quoted(&self.config.schema)
        );
        let bound = self.config.connect.get_operation_timeout();
        let row = conn
            .within(bound, ErrorKind::Connection, "look the row up", async {
                conn.client
                    .query_one(&sql, &[&id])
                    .await
                    .map_err(|e| read_error("look the row up", e))
            })
            .await?;
        Ok(row.get(0))
    }
}
