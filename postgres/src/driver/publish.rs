//! Dispatch: one INSERT per message, one multi-row INSERT per batch, and
//! the same INSERT inside a caller's transaction.

use std::sync::Arc;

use jobrail::{encode_envelope, Job};
use jobrail_native::{DispatchOptions, DriverError, ErrorKind, Outgoing};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::errors::{write_error, NAME};
use super::{micros, Inner, PgDriver};

impl Inner {
    /// Stores one message through the batched inserts ([`Sends`]).
    pub(crate) async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.life.check_running()?;
        self.refuse_oversize(message.body.len())?;
        self.sends().send(queue, message).await?;
        self.declared(queue);
        self.announce(queue);
        Ok(())
    }

    /// One INSERT for every message within the size limit; the others are
    /// refused alone, before any I/O.
    pub(crate) async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let mut results: Vec<Option<Result<(), DriverError>>> = Vec::with_capacity(messages.len());
        let (mut ids, mut bodies, mut delays) = (Vec::new(), Vec::new(), Vec::new());
        for message in messages {
            if let Err(error) = self
                .life
                .check_running()
                .and_then(|()| self.refuse_oversize(message.body.len()))
            {
                results.push(Some(Err(error)));
                continue;
            }
            ids.push(message.id);
            bodies.push(message.body);
            delays.push(micros(message.delay.unwrap_or_default()));
            results.push(None);
        }
        if !ids.is_empty() {
            let outcome = match self.pool.get().await {
                Err(error) => Err(error.not_sent()),
                Ok(conn) => conn
                    .client
                    .execute(
                        &conn.insert_many,
                        &[&vec![queue; ids.len()], &ids, &bodies, &delays],
                    )
                    .await
                    .map(|_| ())
                    .map_err(|e| write_error(format!("insert a batch into queue `{queue}`"), e)),
            };
            if outcome.is_ok() {
                self.declared(queue);
                self.announce(queue);
            }
            let error = outcome.err().map(std::sync::Arc::new);
            for slot in results.iter_mut().filter(|r| r.is_none()) {
                *slot = Some(match &error {
                    None => Ok(()),
                    Some(error) => Err(DriverError::new(NAME, error.kind(), error.clone())),
                });
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every message has a result"))
            .collect()
    }

    pub(super) fn refuse_oversize(&self, len: usize) -> Result<(), DriverError> {
        self.capabilities().refuse_oversize(NAME, len)
    }
}

impl PgDriver {
    /// Dispatches `payload` as `job` through `client`: a
    /// [`tokio_postgres::Transaction`] of the caller's, so the job exists
    /// if and only if that transaction commits (no outbox, no relay), or a
    /// client in autocommit. Returns the message id. The envelope is the
    /// one [`Producer::dispatch`](jobrail_native::Producer::dispatch)
    /// sends. The statement notifies the workers, at commit: a notifying
    /// commit waits for the database's other notifying commits, so keep
    /// bulk dispatch to [`Producer`](jobrail_native::Producer) (whose
    /// notifications the driver coalesces) where it need not be
    /// transactional.
    ///
    /// ```no_run
    /// # async fn example(driver: jobrail_postgres::PgDriver, mut client: jobrail_postgres::tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
    /// use jobrail::Job;
    ///
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Ship { order: i64 }
    /// let ship = Job::<Ship>::builder("ship").queue("shipping").build()?;
    ///
    /// let tx = client.transaction().await?;
    /// tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&42_i64]).await?;
    /// driver.dispatch_in(&tx, &ship, &Ship { order: 42 }).await?;
    /// tx.commit().await?; // the job exists from here on, and only from here
    /// # Ok(()) }
    /// ```
    pub async fn dispatch_in<P: Serialize>(
        &self,
        client: &impl GenericClient,
        job: &Job<P>,
        payload: &P,
    ) -> Result<String, DriverError> {
        self.dispatch_in_with(client, job, payload, DispatchOptions::default())
            .await
    }

    /// [`dispatch_in`](Self::dispatch_in) with options: a delay (counted,
    /// on the server's clock, from the start of the caller's transaction:
    /// Postgres's `now()`) and metadata.
    pub async fn dispatch_in_with<P: Serialize>(
        &self,
        client: &impl GenericClient,
        job: &Job<P>,
        payload: &P,
        options: DispatchOptions,
    ) -> Result<String, DriverError> {
        let (id, body) = encode_envelope(job.name(), payload, &options.metadata)
            .map_err(|e| DriverError::new(NAME, ErrorKind::Encode, e))?;
        self.inner.refuse_oversize(body.len())?;
        let delay = micros(options.delay.unwrap_or_default());
        let queue = job.queue();
        client
            .execute_typed(
                &self.inner.pool.sql().insert_notify,
                &[
                    (&queue, Type::TEXT),
                    (&id, Type::TEXT),
                    (&body, Type::BYTEA),
                    (&delay, Type::INT8),
                ],
            )
            .await
            .map_err(|e| write_error(format!("insert into queue `{queue}` in a transaction"), e))?;
        Ok(id)
    }
}

/// The most messages one batched insert stores.
const MAX_SEND_BATCH: usize = 1_000;
/// The most body bytes one batched insert carries (a larger message goes
/// alone).
const MAX_SEND_BATCH_BYTES: usize = 8 << 20;

/// One message waiting for its batch.
struct Pending {
    queue: String,
    message: Outgoing,
    done: oneshot::Sender<Result<(), Arc<DriverError>>>,
}

/// Single dispatches, batched: the messages sent while the insert before
/// them is in flight go together in one multi-row `INSERT` (one commit for
/// all of them), so concurrent dispatches share their commits; a lone one
/// is inserted at once. A failed insert fails every message of its batch
/// with the same error (none of them was stored, or, when the connection
/// was lost, any may have been).
pub(crate) struct Sends {
    sender: mpsc::UnboundedSender<Pending>,
    /// The bound on one dispatch, its wait for the batch before it included.
    bound: std::time::Duration,
}

impl Sends {
    pub(crate) fn start(pool: Arc<super::connection::Pool>) -> Sends {
        let (sender, receiver) = mpsc::unbounded_channel();
        let bound = pool.operation_timeout();
        tokio::spawn(run_sends(pool, receiver));
        Sends { sender, bound }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let (done, answer) = oneshot::channel();
        let stopped = || DriverError::new(NAME, ErrorKind::Stopped, "the dispatch task has ended");
        self.sender
            .send(Pending {
                queue: queue.to_owned(),
                message,
                done,
            })
            .map_err(|_| stopped())?;
        // A batch before this one may be waiting on a silent server: the
        // dispatch answers within the operation timeout all the same. Its
        // message may still be stored after that (Uncertain).
        match tokio::time::timeout(self.bound, answer).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(error))) => Err(DriverError::new(NAME, error.kind(), error)),
            Ok(Err(_)) => Err(stopped()),
            Err(_) => Err(DriverError::new(
                NAME,
                ErrorKind::Uncertain,
                format!(
                    "dispatch to `{queue}`: no answer from Postgres within {:?}; the message \
                     may still be stored",
                    self.bound
                ),
            )),
        }
    }
}

async fn run_sends(
    pool: Arc<super::connection::Pool>,
    mut receiver: mpsc::UnboundedReceiver<Pending>,
) {
    let mut next: Option<Pending> = None;
    loop {
        let first = match next.take() {
            Some(pending) => pending,
            None => match receiver.recv().await {
                Some(pending) => pending,
                None => return,
            },
        };
        let mut bytes = first.message.body.len();
        let mut batch = vec![first];
        while batch.len() < MAX_SEND_BATCH && bytes < MAX_SEND_BATCH_BYTES {
            match receiver.try_recv() {
                Ok(pending) if bytes + pending.message.body.len() > MAX_SEND_BATCH_BYTES => {
                    next = Some(pending);
                    break;
                }
                Ok(pending) => {
                    bytes += pending.message.body.len();
                    batch.push(pending);
                }
                Err(_) => break,
            }
        }
        let outcome = insert_rows(&pool, &batch).await.map_err(Arc::new);
        for pending in batch {
            let _ = pending.done.send(outcome.clone());
        }
    }
}

async fn insert_rows(pool: &super::connection::Pool, batch: &[Pending]) -> Result<(), DriverError> {
    let conn = pool.get().await.map_err(DriverError::not_sent)?;
    let queues: Vec<&str> = batch.iter().map(|p| p.queue.as_str()).collect();
    let ids: Vec<&str> = batch.iter().map(|p| p.message.id.as_str()).collect();
    let bodies: Vec<&[u8]> = batch.iter().map(|p| p.message.body.as_slice()).collect();
    let delays: Vec<i64> = batch
        .iter()
        .map(|p| micros(p.message.delay.unwrap_or_default()))
        .collect();
    let bound = pool.operation_timeout();
    conn.within(bound, ErrorKind::Uncertain, "dispatch", async {
        conn.client
            .execute(&conn.insert_many, &[&queues, &ids, &bodies, &delays])
            .await
            .map(|_| ())
            .map_err(|e| write_error(format!("insert {} message(s)", batch.len()), e))
    })
    .await
}
