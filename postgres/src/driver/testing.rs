//! Helpers for the conformance and fault suites (feature `testing`): the
//! queues a driver used, deleting them, and putting rows where the driver
//! itself never would. Not a supported API.

use jobrail_native::DriverError;

use super::errors::write_error;
use super::topology::quoted;
use super::PgDriver;
use jobrail_native::kit::lock;

impl PgDriver {
    /// Every queue this driver dispatched to or subscribed to.
    pub fn declared_queues(&self) -> Vec<String> {
        lock(&self.inner.queues).iter().cloned().collect()
    }

    /// Deletes every row of `queues`, waiting and failed.
    pub async fn delete_queues(&self, queues: &[String]) -> Result<(), DriverError> {
        for queue in queues {
            jobrail_native::Admin::delete_queue(self.inner.as_ref(), queue).await?;
        }
        Ok(())
    }

    /// Inserts `body` among `queue`'s failures as it is.
    pub async fn inject_failure_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let entry = jobrail_native::StoredFailure::from_body(body);
        let message_id = entry.record.as_ref().and_then(|r| r.message_id.clone());
        let conn = self.inner.pool.get().await?;
        let sql = format!(
            "INSERT INTO {}.failures (queue, entry_id, message_id, body) VALUES ($1, $2, $3, $4)",
            quoted(&self.inner.config.schema)
        );
        conn.client
            .execute(&sql, &[&queue, &entry.id, &message_id, &entry.body])
            .await
            .map_err(|e| write_error("insert a failure body", e))?;
        Ok(())
    }

    /// Inserts `body` on the work queue `queue` as it is, with no check of
    /// the driver's own (its size limit included).
    pub async fn inject_body(&self, queue: &str, body: Vec<u8>) -> Result<(), DriverError> {
        let conn = self.inner.pool.get().await?;
        let id = format!("injected-{}", body.len());
        conn.client
            .execute(
                &conn.insert_many,
                &[&vec![queue], &vec![id], &vec![body], &vec![0_i64]],
            )
            .await
            .map_err(|e| write_error("insert a body", e))?;
        self.inner.declared(queue);
        Ok(())
    }
}
