//! The failure store on the `failures` table, and queue depths.

use std::time::Duration;

use async_trait::async_trait;
use jobrail_native::{Admin, ClaimedFailure, DriverError, FailureStore, QueueDepth, StoredFailure};

use super::errors::{read_error, write_error};
use super::topology::quoted;
use super::Inner;

/// How long an operator's claim on a failure entry holds if it is neither
/// removed nor released (its process died).
const CLAIM_HOLD: Duration = Duration::from_secs(60);

fn entry(body: Vec<u8>) -> StoredFailure {
    StoredFailure::from_body(body)
}

#[async_trait]
impl FailureStore for Inner {
    async fn read_failures(&self, queue: &str) -> Result<Vec<StoredFailure>, DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "SELECT body FROM {}.failures WHERE queue = $1 ORDER BY id",
            quoted(&self.config.schema)
        );
        let rows = conn
            .client
            .query(&sql, &[&queue])
            .await
            .map_err(|e| read_error(format!("read the failures of `{queue}`"), e))?;
        Ok(rows.into_iter().map(|r| entry(r.get(0))).collect())
    }

    async fn claim_failure(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<Box<dyn ClaimedFailure>>, DriverError> {
        let conn = self.pool.get().await?;
        let s = quoted(&self.config.schema);
        let sql = format!(
            "UPDATE {s}.failures SET claim = nextval('{s}.leases'), \
               claimed_until = now() + $3::int8 * interval '1 microsecond' \
             WHERE id = (SELECT id FROM {s}.failures \
                         WHERE queue = $1 AND (entry_id = $2 OR message_id = $2) \
                           AND (claimed_until IS NULL OR claimed_until < now()) \
                         ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) \
             RETURNING id, claim, body"
        );
        let hold = super::micros(CLAIM_HOLD);
        let row = conn
            .client
            .query_opt(&sql, &[&queue, &id, &hold])
            .await
            .map_err(|e| write_error(format!("claim failure `{id}` of `{queue}`"), e))?;
        Ok(row.map(|r| {
            Box::new(PgClaimedFailure {
                schema: s.clone(),
                pool: self.pool.clone(),
                row: r.get(0),
                claim: r.get(1),
                entry: entry(r.get(2)),
            }) as Box<dyn ClaimedFailure>
        }))
    }

    async fn remove_failures(&self, queue: &str, ids: &[String]) -> Result<u64, DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "DELETE FROM {}.failures WHERE queue = $1 AND entry_id = ANY($2) \
             AND (claimed_until IS NULL OR claimed_until < now())",
            quoted(&self.config.schema)
        );
        conn.client
            .execute(&sql, &[&queue, &ids])
            .await
            .map_err(|e| write_error(format!("remove failures of `{queue}`"), e))
    }
}

/// An entry one operator claimed: held by its claim token.
struct PgClaimedFailure {
    schema: String,
    pool: std::sync::Arc<super::connection::Pool>,
    row: i64,
    claim: i64,
    entry: StoredFailure,
}

#[async_trait]
impl ClaimedFailure for PgClaimedFailure {
    fn entry(&self) -> &StoredFailure {
        &self.entry
    }

    async fn remove(self: Box<Self>) -> Result<(), DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "DELETE FROM {}.failures WHERE id = $1 AND claim = $2",
            self.schema
        );
        conn.client
            .execute(&sql, &[&self.row, &self.claim])
            .await
            .map_err(|e| write_error("remove a claimed failure", e))?;
        Ok(())
    }

    async fn release(self: Box<Self>) -> Result<(), DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "UPDATE {}.failures SET claim = NULL, claimed_until = NULL \
             WHERE id = $1 AND claim = $2",
            self.schema
        );
        conn.client
            .execute(&sql, &[&self.row, &self.claim])
            .await
            .map_err(|e| write_error("release a claimed failure", e))?;
        Ok(())
    }
}

#[async_trait]
impl Admin for Inner {
    async fn depth(&self, queue: &str) -> Result<QueueDepth, DriverError> {
        let conn = self.pool.get().await?;
        let sql = format!(
            "SELECT count(*) FILTER (WHERE run_at <= now())::int8, \
                    count(*) FILTER (WHERE run_at > now() AND lease IS NOT NULL)::int8, \
                    count(*) FILTER (WHERE run_at > now() AND lease IS NULL)::int8 \
             FROM {}.jobs WHERE queue = $1",
            quoted(&self.config.schema)
        );
        let row = conn
            .client
            .query_one(&sql, &[&queue])
            .await
            .map_err(|e| read_error(format!("count queue `{queue}`"), e))?;
        let count = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
        Ok(QueueDepth::new(count(0), Some(count(1)), Some(count(2))))
    }

    async fn delete_queue(&self, queue: &str) -> Result<(), DriverError> {
        let conn = self.pool.get().await?;
        let s = quoted(&self.config.schema);
        for table in ["jobs", "failures"] {
            let sql = format!("DELETE FROM {s}.{table} WHERE queue = $1");
            conn.client
                .execute(&sql, &[&queue])
                .await
                .map_err(|e| write_error(format!("delete queue `{queue}`"), e))?;
        }
        Ok(())
    }
}
