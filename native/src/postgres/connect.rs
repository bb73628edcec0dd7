//! One connection to Postgres, its I/O driven by a tokio task.

use tokio_postgres::{Client, NoTls};

/// Connects to `url` (no TLS) and spawns the task that drives the
/// connection on the current tokio runtime. The task ends when the client
/// is dropped or the server closes the connection; the client then reports
/// [`Client::is_closed`] and every query fails.
pub(crate) async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "postgres connection ended");
        }
    });
    Ok(client)
}
