//! A tick's job and its record in one transaction ([`PgTicks`]).

use async_trait::async_trait;
use jobrail::{ClaimError, TickDispatch};
use jobrail_native::{DriverError, ErrorKind, TickSink};
use tokio::sync::Mutex;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::errors::{read_error, write_error, NAME};
use super::PgDriver;
use crate::PgClaims;

/// Fires schedules' ticks into a Postgres queue with each tick's record in
/// the same transaction: the job's row and the completion of the tick's
/// claim (`schedule:<name>:<tick>` in a [`PgClaims`] table of the same
/// database) commit together, so a scheduler killed at any point leaves
/// either both or neither, and no tick is ever sent twice. Given to
/// [`SchedulerBuilder::sink`](jobrail_native::SchedulerBuilder::sink).
///
/// Without it, a scheduler sends through its producer and then completes
/// the claim: a scheduler killed between the two leaves the tick
/// unrecorded, and another sends it again when the tick lease ends.
///
/// It keeps one connection of its own (opened on the first tick, again
/// after a failure) with the driver's settings. The claims table must be in
/// the queue's database; one elsewhere makes every tick fail (logged, not
/// sent) until it is.
///
/// ```no_run
/// # use std::sync::Arc;
/// # async fn example(config: jobrail_postgres::PgConfig, url: &str, schedule: jobrail::Schedule) -> Result<(), Box<dyn std::error::Error>> {
/// use jobrail_native::{Producer, Scheduler};
/// use jobrail_postgres::{PgClaims, PgDriver, PgTicks};
///
/// let driver = PgDriver::connect(config).await?;
/// let claims = PgClaims::connect(url).await?; // the same database
/// let scheduler = Scheduler::builder(Producer::new(Arc::new(driver.clone())), Arc::new(claims.clone()))
///     .sink(Arc::new(PgTicks::new(driver, claims)))
///     .schedule(schedule)
///     .build()?
///     .spawn();
/// # scheduler.shutdown().await;
/// # Ok(()) }
/// ```
pub struct PgTicks {
    driver: PgDriver,
    claims: PgClaims,
    client: Mutex<Option<Client>>,
}

impl std::fmt::Debug for PgTicks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTicks")
            .field("schema", &self.driver.inner.config.schema)
            .field("claims", &self.claims.table())
            .finish()
    }
}

impl PgTicks {
    /// Ticks sent into `driver`'s queue and recorded in `claims`' table,
    /// one transaction each.
    pub fn new(driver: PgDriver, claims: PgClaims) -> PgTicks {
        PgTicks {
            driver,
            claims,
            client: Mutex::new(None),
        }
    }
}

#[async_trait]
impl TickSink for PgTicks {
    async fn send_and_record(
        &self,
        dispatch: TickDispatch,
        key: &str,
        fence: u64,
    ) -> Result<String, DriverError> {
        let envelope = dispatch.envelope();
        let id = envelope.id.clone();
        let body = envelope.encode();
        self.driver.inner.refuse_oversize(body.len())?;
        let mut slot = self.client.lock().await;
        if slot.as_ref().is_none_or(|c| c.is_closed()) {
            *slot = None;
            let client = self.driver.inner.pool.dial().await?;
            *slot = Some(client);
        }
        let client = slot.as_mut().expect("connected above");
        // Before the commit nothing is stored: every failure up to it is
        // certain (the transaction rolls back when dropped).
        let tx = client
            .transaction()
            .await
            .map_err(|e| read_error("begin a tick's transaction", e))?;
        let delay: i64 = 0;
        tx.execute_typed(
            &self.driver.inner.pool.sql().insert_notify,
            &[
                (&dispatch.queue, Type::TEXT),
                (&id, Type::TEXT),
                (&body, Type::BYTEA),
                (&delay, Type::INT8),
            ],
        )
        .await
        .map_err(|e| read_error("insert a tick's job", e))?;
        match self.claims.complete_in(&tx, key, fence).await {
            Ok(()) => {}
            Err(ClaimError::Lost { .. }) => {
                return Err(DriverError::new(
                    NAME,
                    ErrorKind::NotAccepted,
                    format!("the claim of `{key}` is no longer held by fence {fence}: not sent"),
                ))
            }
            Err(e) => return Err(DriverError::new(NAME, ErrorKind::NotAccepted, e)),
        }
        // A lost connection here may have lost the answer of a commit:
        // uncertain, and the tick is tried again when its lease ends (and
        // found done if it committed).
        tx.commit()
            .await
            .map_err(|e| write_error("commit a tick's job and record", e))?;
        Ok(id)
    }
}
