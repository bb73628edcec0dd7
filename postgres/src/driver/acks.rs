//! Acknowledgements, batched: the deletes of finished rows that arrive
//! while earlier ones are in flight go together in one statement, so that
//! a busy worker commits once per batch rather than once per job, and an
//! idle one deletes each row at once.
//!
//! A batch is one `DELETE ... USING unnest(ids, leases) ... RETURNING id`:
//! each acknowledgement learns whether its own row matched (held under its
//! lease) from the ids returned. One batch is in flight at a time; what
//! arrives meanwhile goes in the next (group commit: the busier the worker,
//! the larger the batches, the fewer the commits). A statement that
//! fails fails every acknowledgement of its batch with the same error.

use std::collections::HashSet;
use std::sync::Arc;

use jobrail_native::{DriverError, ErrorKind};
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::connection::Pool;
use super::errors::{write_error, NAME};

/// The batches in flight at once. One measured fastest (bench/benches/postgres.rs):
/// a second batch in flight halves the batches and doubles the commits.
const IN_FLIGHT: usize = 1;

/// The most rows one batch deletes.
const MAX_BATCH: usize = 512;

/// One acknowledgement waiting for its batch: the row, its lease, and
/// where to send whether the row was deleted.
struct Ack {
    id: i64,
    lease: i64,
    done: oneshot::Sender<Result<bool, Arc<DriverError>>>,
}

/// The queue of acknowledgements, and the task that runs their batches.
pub(crate) struct Acks {
    sender: mpsc::UnboundedSender<Ack>,
}

impl Acks {
    pub(crate) fn start(pool: Arc<Pool>) -> Acks {
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(pool, receiver, IN_FLIGHT));
        Acks { sender }
    }

    /// Deletes row `id` if it is still held under `lease`; `Ok(false)`
    /// when it is not (the lease was taken over, or the row is gone).
    pub(crate) async fn delete(&self, id: i64, lease: i64) -> Result<bool, DriverError> {
        let (done, answer) = oneshot::channel();
        self.sender
            .send(Ack { id, lease, done })
            .map_err(|_| stopped())?;
        match answer.await {
            Ok(Ok(deleted)) => Ok(deleted),
            Ok(Err(error)) => Err(DriverError::new(NAME, error.kind(), error)),
            Err(_) => Err(stopped()),
        }
    }
}

fn stopped() -> DriverError {
    DriverError::new(
        NAME,
        jobrail_native::ErrorKind::Stopped,
        "the acknowledgement task has ended",
    )
}

async fn run(pool: Arc<Pool>, mut receiver: mpsc::UnboundedReceiver<Ack>, in_flight: usize) {
    let slots = Arc::new(Semaphore::new(in_flight));
    while let Some(first) = receiver.recv().await {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        // Everything that arrived while waiting for a slot goes along.
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match receiver.try_recv() {
                Ok(ack) => batch.push(ack),
                Err(_) => break,
            }
        }
        let pool = pool.clone();
        tokio::spawn(async move {
            let outcome = delete_batch(&pool, &batch).await;
            drop(slot);
            match outcome {
                Ok(deleted) => {
                    for ack in batch {
                        let _ = ack.done.send(Ok(deleted.contains(&ack.id)));
                    }
                }
                Err(error) => {
                    let error = Arc::new(error);
                    for ack in batch {
                        let _ = ack.done.send(Err(error.clone()));
                    }
                }
            }
        });
    }
}

async fn delete_batch(pool: &Pool, batch: &[Ack]) -> Result<HashSet<i64>, DriverError> {
    let conn = pool.get().await?;
    let ids: Vec<i64> = batch.iter().map(|a| a.id).collect();
    let leases: Vec<i64> = batch.iter().map(|a| a.lease).collect();
    let bound = pool.operation_timeout();
    let rows = conn
        .within(bound, ErrorKind::Uncertain, "acknowledge", async {
            conn.client
                .query(&conn.delete_many, &[&ids, &leases])
                .await
                .map_err(|e| write_error("acknowledge: delete the rows", e))
        })
        .await?;
    Ok(rows.into_iter().map(|r| r.get(0)).collect())
}
