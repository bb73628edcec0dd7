//! The relay: publishes committed outbox rows to the broker.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::Mutex;
use tokio_postgres::types::Type;
use tokio_postgres::Client;
use tracing::{debug, warn};

use jobrail_native::{Outgoing, Producer};

use crate::connect::{Dialer, PgConnect};
use crate::outbox::{Outbox, OutboxError};

/// The longest wait between two passes after database errors.
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(30);

/// What one relay pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayPass {
    /// Rows the broker accepted, now marked sent.
    pub sent: usize,
    /// Rows the broker refused or may not have taken: left unsent, with the
    /// attempt and the error recorded, to be tried again after their wait.
    pub failed: usize,
    /// Whether the pass took a full batch, so more rows may be ready now.
    pub more: bool,
}

/// Publishes the committed rows of an [`Outbox`] through a [`Producer`]
/// and marks them sent.
///
/// A pass ([`run_once`](Self::run_once)) is one transaction: it locks up
/// to [`batch_size`](Self::batch_size) unsent rows due for an attempt
/// (`FOR UPDATE SKIP LOCKED`, in id order, so several relays share the
/// table without taking the same row), sends them per queue with
/// [`Producer::send_batch`], which returns once the broker has confirmed
/// or refused each message, marks the accepted rows sent and records the
/// attempt and the error on the others, then commits.
///
/// # At least once
///
/// A row is never deleted unsent, and a row is marked sent only after the
/// broker confirmed it. A failed send, whether certainly not accepted
/// ([`ErrorKind::NotAccepted`](jobrail_native::ErrorKind::NotAccepted)) or perhaps
/// accepted ([`ErrorKind::Uncertain`](jobrail_native::ErrorKind::Uncertain)), leaves
/// the row unsent, and a later pass sends it again after a wait that
/// doubles with each attempt ([`retry_wait`](Self::retry_wait)). A relay
/// that dies between the broker's confirm and the commit of its marks (the
/// process is killed, the connection drops) leaves its transaction to roll
/// back and its locks to be released: the next pass, of this relay or
/// another, sends those rows again under the same message id. Consumers
/// may therefore see a message twice; their handlers must tolerate it,
/// for instance by claiming a business key with [`jobrail::run_once`].
///
/// # Connection
///
/// [`OutboxRelay::new`] connects through a [`PgConnect`] on the first pass
/// and again when the connection is lost (after the
/// [reconnection wait](PgConnect#reconnection) if the last attempt failed);
/// [`OutboxRelay::with_client`] uses the caller's
/// client (whose connection the caller drives) and, once that connection
/// is closed, fails every pass. The relay needs a connection of its own:
/// a pass holds a transaction open while it sends.
pub struct OutboxRelay {
    outbox: Outbox,
    producer: Producer,
    dialer: Option<Dialer>,
    client: Mutex<Option<Client>>,
    batch_size: usize,
    poll_interval: Duration,
    retry_first: Duration,
    retry_max: Duration,
}

impl fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("outbox", &self.outbox)
            .field("reconnects", &self.dialer.is_some())
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("retry_first", &self.retry_first)
            .field("retry_max", &self.retry_max)
            .finish_non_exhaustive()
    }
}

impl OutboxRelay {
    /// A relay of `outbox` that connects through `connect` on its first
    /// pass, and again whenever the connection is lost, and publishes
    /// through `producer`.
    pub fn new(connect: &PgConnect, outbox: Outbox, producer: Producer) -> Self {
        Self::build(Some(connect.dialer()), None, outbox, producer)
    }

    /// A relay of `outbox` on `client`, a connection of its own (see
    /// [Connection](Self#connection)), publishing through `producer`.
    pub fn with_client(client: Client, outbox: Outbox, producer: Producer) -> Self {
        Self::build(None, Some(client), outbox, producer)
    }

    fn build(
        dialer: Option<Dialer>,
        client: Option<Client>,
        outbox: Outbox,
        producer: Producer,
    ) -> Self {
        OutboxRelay {
            outbox,
            producer,
            dialer,
            client: Mutex::new(client),
            batch_size: 100,
            poll_interval: Duration::from_millis(200),
            retry_first: Duration::from_millis(200),
            retry_max: Duration::from_secs(60),
        }
    }

    /// At most `rows` rows per pass (default 100; at least 1).
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows.clamp(1, i64::MAX as usize);
        self
    }

    /// How long [`run`](Self::run) waits after a pass that found less
    /// than a full batch (default 200 ms).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How long a row the broker did not accept waits before its next
    /// attempt: `first` after the first failure, doubling with each
    /// further one, never more than `max` (default 200 ms and 60 s). The
    /// wait keeps a refused row from holding up the rows behind it.
    pub fn retry_wait(mut self, first: Duration, max: Duration) -> Self {
        self.retry_first = first;
        self.retry_max = max.max(first);
        self
    }

    /// The outbox this relay publishes.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// One pass: publishes up to a batch of the unsent rows due for an
    /// attempt, marks the accepted ones sent and records the failures, in
    /// one transaction (see the [type docs](Self)). A database error ends
    /// the pass with [`OutboxError::Database`] and its transaction rolls
    /// back: rows it had published are published again by a later pass.
    pub async fn run_once(&self) -> Result<RelayPass, OutboxError> {
        let mut slot = self.client.lock().await;
        let client = self.ready(&mut slot).await?;
        let result = self.pass(client).await;
        self.after_error(&mut slot, &result);
        result
    }

    /// The pass of [`run_once`](Self::run_once) on `client`.
    async fn pass(&self, client: &mut Client) -> Result<RelayPass, OutboxError> {
        let tx = client.transaction().await?;
        let table = self.outbox.table();
        let quoted = self.outbox.quoted();
        let select = format!(
            "SELECT id, message_id, queue, body, \
                    GREATEST(0, delay_ms - (EXTRACT(EPOCH FROM clock_timestamp() - created_at) * 1000)::bigint) \
             FROM {quoted} \
             WHERE sent_at IS NULL AND (retry_at IS NULL OR retry_at <= clock_timestamp()) \
             ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
        );
        let limit = self.batch_size as i64;
        let rows = tx.query_typed(&select, &[(&limit, Type::INT8)]).await?;
        let more = rows.len() == self.batch_size;

        // One batch per queue, each in id order.
        let mut queues: Vec<(String, Vec<i64>, Vec<Outgoing>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for row in &rows {
            let queue: String = row.try_get(2)?;
            let delay: Option<i64> = row.try_get(4)?;
            let group = *index.entry(queue.clone()).or_insert_with(|| {
                queues.push((queue, Vec::new(), Vec::new()));
                queues.len() - 1
            });
            let (_, ids, batch) = &mut queues[group];
            ids.push(row.try_get(0)?);
            batch.push(Outgoing {
                id: row.try_get(1)?,
                body: row.try_get(3)?,
                delay: delay
                    .filter(|ms| *ms > 0)
                    .map(|ms| Duration::from_millis(ms as u64)),
            });
        }
        let mut sends = Vec::with_capacity(queues.len());
        let mut owners = Vec::with_capacity(queues.len());
        for (queue, ids, batch) in queues {
            sends.push(async move {
                let results = self.producer.send_batch(&queue, batch).await;
                (queue, results)
            });
            owners.push(ids);
        }
        let answers = join_all(sends).await;

        let mut sent: Vec<i64> = Vec::new();
        let mut failed: Vec<i64> = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        for ((queue, results), ids) in answers.into_iter().zip(owners) {
            let mut first_error = None;
            let mut refused = 0usize;
            for (id, result) in ids.into_iter().zip(results) {
                match result {
                    Ok(()) => sent.push(id),
                    Err(error) => {
                        refused += 1;
                        let text = error.to_string();
                        first_error.get_or_insert_with(|| text.clone());
                        failed.push(id);
                        errors.push(text);
                    }
                }
            }
            if let Some(error) = first_error {
                warn!(
                    table,
                    queue, refused, error, "outbox relay: rows not accepted; they stay unsent"
                );
            }
        }

        if !sent.is_empty() {
            let mark = format!(
                "UPDATE {quoted} SET sent_at = clock_timestamp(), attempts = attempts + 1, \
                 last_error = NULL, retry_at = NULL WHERE id = ANY($1)"
            );
            tx.execute_typed(&mark, &[(&sent, Type::INT8_ARRAY)])
                .await?;
        }
        if !failed.is_empty() {
            let record = format!(
                "UPDATE {quoted} AS o SET attempts = o.attempts + 1, last_error = f.error, \
                 retry_at = clock_timestamp() + make_interval(secs => \
                     LEAST($4, $3 * power(2, LEAST(o.attempts, 40)))) \
                 FROM unnest($1::bigint[], $2::text[]) AS f(id, error) WHERE o.id = f.id"
            );
            let first = self.retry_first.as_secs_f64();
            let max = self.retry_max.as_secs_f64();
            tx.execute_typed(
                &record,
                &[
                    (&failed, Type::INT8_ARRAY),
                    (&errors, Type::TEXT_ARRAY),
                    (&first, Type::FLOAT8),
                    (&max, Type::FLOAT8),
                ],
            )
            .await?;
        }
        tx.commit().await?;
        let pass = RelayPass {
            sent: sent.len(),
            failed: failed.len(),
            more,
        };
        if pass.sent + pass.failed > 0 {
            debug!(
                table,
                sent = pass.sent,
                failed = pass.failed,
                "outbox relay pass"
            );
        }
        Ok(pass)
    }

    /// Runs passes until `shutdown` completes: at once after a full batch,
    /// after the [poll interval](Self::poll_interval) otherwise. A pass in
    /// progress is finished, never cut short, so shutdown publishes nothing
    /// twice. A database error is logged and the next pass waits longer
    /// each time (up to 30 s); the relay reconnects where it can. No row
    /// is lost either way: unsent rows wait in the table.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut wait = Duration::ZERO;
        let mut errors = 0u32;
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
            }
            wait = match self.run_once().await {
                Ok(pass) => {
                    errors = 0;
                    if pass.more {
                        Duration::ZERO
                    } else {
                        self.poll_interval
                    }
                }
                Err(error) => {
                    errors = errors.saturating_add(1);
                    let wait = self
                        .poll_interval
                        .max(Duration::from_millis(100))
                        .saturating_mul(1 << errors.min(10))
                        .min(MAX_ERROR_BACKOFF);
                    warn!(
                        table = self.outbox.table(),
                        %error,
                        ?wait,
                        "outbox relay pass failed; unsent rows wait for the next one"
                    );
                    wait
                }
            };
        }
        debug!(table = self.outbox.table(), "outbox relay stopped");
    }

    /// Deletes the rows sent more than `older_than` ago; returns how many.
    /// Unsent rows are never deleted.
    pub async fn purge_sent(&self, older_than: Duration) -> Result<u64, OutboxError> {
        let mut slot = self.client.lock().await;
        let client = self.ready(&mut slot).await?;
        let sql = format!(
            "DELETE FROM {} WHERE sent_at < clock_timestamp() - make_interval(secs => $1)",
            self.outbox.quoted()
        );
        let secs = older_than.as_secs_f64();
        let result = client
            .execute_typed(&sql, &[(&secs, Type::FLOAT8)])
            .await
            .map_err(OutboxError::from);
        self.after_error(&mut slot, &result);
        result
    }

    /// Forgets a connection that `result` shows lost (closed, terminated by
    /// the server, the server shutting down), so the next pass connects
    /// again at once rather than fail on it; only a relay that connects
    /// itself does.
    fn after_error<T>(&self, slot: &mut Option<Client>, result: &Result<T, OutboxError>) {
        let Err(OutboxError::Database(error)) = result else {
            return;
        };
        let lost = error.is_closed()
            || slot.as_ref().is_some_and(Client::is_closed)
            || error.code().is_some_and(|code| {
                let code = code.code();
                code.starts_with("08") || code.starts_with("57P")
            });
        if lost && self.dialer.is_some() {
            debug!(table = self.outbox.table(), %error, "outbox relay: connection lost");
            *slot = None;
        }
    }

    /// The relay's connection, made (again) if there is none or it closed
    /// and the relay has a [`PgConnect`].
    async fn ready<'a>(&self, slot: &'a mut Option<Client>) -> Result<&'a mut Client, OutboxError> {
        if let Some(dialer) = &self.dialer {
            if slot.as_ref().is_none_or(Client::is_closed) {
                *slot = None;
                *slot = Some(dialer.dial().await?);
            }
        }
        slot.as_mut()
            .ok_or_else(|| OutboxError::Invalid("the relay has no connection".into()))
    }
}
