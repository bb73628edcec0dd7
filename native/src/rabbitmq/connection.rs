//! The driver's one connection: connecting (and reconnecting on demand),
//! the shared publishing channel, channels for everything else, and a
//! clean stop.

use std::sync::{Arc, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};
use tracing::{debug, info};

use super::acks::AckRuns;
use super::errors::{answer, bounded, error};
use super::RabbitDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::lock;

/// How long [`Driver::stop`](crate::Driver::stop) waits, after a released
/// channel closed, for lapin to remove it from the connection (see
/// `await_released_channels`).
const CHANNEL_REMOVAL_WAIT: Duration = Duration::from_millis(50);

/// How long [`Driver::stop`](crate::Driver::stop) waits at most for
/// released channels to close.
const RELEASED_CHANNELS_WAIT: Duration = Duration::from_secs(2);

/// The live connection and its publishing channel.
pub(super) struct Link {
    connection: Arc<Connection>,
    publisher: Option<Arc<Channel>>,
}

/// Whether a released channel may still have a close in flight.
fn closing(status: &lapin::ChannelStatus) -> bool {
    matches!(
        status.state(),
        lapin::ChannelState::Connected | lapin::ChannelState::Closing
    )
}

impl RabbitDriver {
    /// The live connection, reconnecting if it was lost.
    pub(super) async fn connection(&self) -> Result<Arc<Connection>, DriverError> {
        let mut link = self.inner.link.lock().await;
        self.inner.lifecycle.check_running()?;
        if let Some(link) = link.as_ref() {
            if link.connection.status().connected() {
                return Ok(link.connection.clone());
            }
        }
        let config = &self.inner.config;
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio)
            .with_connection_name(LongString::from(config.connection_name.clone()));
        let limit = config.operation_timeout;
        let connected = tokio::time::timeout(
            limit,
            Connection::connect_with_config(
                &config.connect_url(),
                properties,
                lapin::tcp::OwnedTLSConfig {
                    identity: None,
                    cert_chain: config.ca_certificates.clone(),
                },
            ),
        )
        .await;
        // Only the redacted URL goes into the error: lapin's own error (an
        // I/O, TLS or protocol error) does not quote it.
        let connection = Arc::new(answer(
            limit,
            &format!("cannot connect to {}", config.redacted_url()),
            ErrorKind::Connection,
            connected,
        )?);
        info!(url = %config.redacted_url(), "connected to RabbitMQ");
        // Queues may have been deleted while we were away: declare again.
        lock(&self.inner.declared).clear();
        *link = Some(Link {
            connection: connection.clone(),
            publisher: None,
        });
        Ok(connection)
    }

    /// A channel in confirm mode for publishing, shared by the driver.
    ///
    /// While it is live this reads it under a read lock and nothing else:
    /// concurrent publishes do not wait for each other. Only opening it (or
    /// reconnecting) takes the connection's async mutex.
    pub(super) async fn publisher(&self) -> Result<Arc<Channel>, DriverError> {
        if let Some(channel) = self.live_publisher() {
            return Ok(channel);
        }
        let connection = self.connection().await?;
        let mut link = self.inner.link.lock().await;
        let Some(link) = link
            .as_mut()
            .filter(|l| Arc::ptr_eq(&l.connection, &connection))
        else {
            return Err(error(
                ErrorKind::Connection,
                "the connection was replaced; try again",
            ));
        };
        if let Some(channel) = link.publisher.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let limit = self.inner.config.operation_timeout;
        let channel = bounded(
            limit,
            "opening a channel",
            ErrorKind::Connection,
            connection.create_channel(),
        )
        .await?;
        bounded(
            limit,
            "confirm.select",
            ErrorKind::Connection,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let channel = Arc::new(channel);
        link.publisher = Some(channel.clone());
        *self
            .inner
            .publisher
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(channel.clone());
        Ok(channel)
    }

    /// The publishing channel, if it is open.
    fn live_publisher(&self) -> Option<Arc<Channel>> {
        self.inner
            .publisher
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|c| c.status().connected())
            .cloned()
    }

    /// Tracks a consuming channel's ack runs, so that `stop` drains them.
    pub(super) fn track(&self, runs: &Arc<AckRuns>) {
        let mut all = lock(&self.inner.ack_runs);
        all.retain(|r| r.strong_count() > 0);
        all.push(Arc::downgrade(runs));
    }

    /// Writes every settlement the ack runs still hold (see
    /// [`AckRuns::drain`]), waiting up to `limit` in all.
    async fn drain_ack_runs(&self, limit: Duration) {
        let runs: Vec<_> = lock(&self.inner.ack_runs)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let deadline = tokio::time::Instant::now() + limit;
        for runs in runs {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            runs.drain(left).await;
        }
    }

    /// Opens a channel on the (re-established if needed) connection.
    pub(super) async fn open_channel(&self) -> Result<Channel, DriverError> {
        let connection = self.connection().await?;
        bounded(
            self.inner.config.operation_timeout,
            "opening a channel",
            ErrorKind::Connection,
            connection.create_channel(),
        )
        .await
    }

    /// Records that the caller dropped its handle on `channel`: lapin closes
    /// it in the background once no delivery holds it any more.
    pub(super) fn release(&self, channel: &Channel) {
        self.still_closing().push(channel.status().clone());
    }

    /// The released channels whose close may still be in flight.
    fn still_closing(&self) -> MutexGuard<'_, Vec<lapin::ChannelStatus>> {
        let mut released = lock(&self.inner.released);
        released.retain(closing);
        released
    }

    /// Stops the driver and closes the connection cleanly (see
    /// [`Driver::stop`](crate::Driver::stop)): marks the driver stopped,
    /// waits for released channels to finish closing, closes the
    /// connection, then waits for lapin's IO loop to end.
    pub(super) async fn disconnect(&self) -> Result<(), DriverError> {
        self.inner.lifecycle.stop();
        let limit = self.inner.config.operation_timeout;
        // Settlements requested before the stop are written before the
        // connection closes: nothing settled comes back.
        self.drain_ack_runs(limit.min(RELEASED_CHANNELS_WAIT)).await;
        let link = self.inner.link.lock().await.take();
        *self
            .inner
            .publisher
            .write()
            .unwrap_or_else(PoisonError::into_inner) = None;
        let Some(Link {
            connection,
            publisher,
        }) = link
        else {
            return Ok(());
        };
        self.await_released_channels(limit.min(RELEASED_CHANNELS_WAIT))
            .await;
        let mut closed = Ok(());
        if connection.status().connected() {
            let outcome =
                tokio::time::timeout(limit, connection.close(200, "driver stopped")).await;
            // A channel whose last handle dropped just now (a delivery
            // settled by a task still running) was being closed in the
            // background when the connection began closing; lapin then
            // ends the connection with that error instead of a clean
            // close. The connection is gone either way and everything
            // settled before `stop` was already on the wire.
            closed = match &outcome {
                Ok(Err(lapin::Error::InvalidChannelState(state)))
                    if !connection.status().connected() =>
                {
                    debug!("connection ended without a clean close (a channel was {state:?})");
                    Ok(())
                }
                _ => answer(
                    limit,
                    "closing the connection",
                    ErrorKind::Connection,
                    outcome,
                ),
            };
        }
        drop(publisher);
        Self::await_io_loop(connection, limit).await;
        closed
    }

    /// Waits until every released channel finished closing, or `limit`.
    ///
    /// A channel reads as closed once its `close-ok` arrived, but lapin
    /// removes it from the connection afterwards, in a task of its own. If
    /// the connection closes before that task ran, lapin removes the channel
    /// twice and logs the second removal as a connection error ("invalid
    /// channel") although the close was clean. So this also waits
    /// [`CHANNEL_REMOVAL_WAIT`] once no channel is closing any more.
    async fn await_released_channels(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let pending = self.still_closing().len();
            if pending == 0 {
                // Any channel may have closed just now (a released one, or
                // one the driver closed itself after a declaration).
                tokio::time::sleep(CHANNEL_REMOVAL_WAIT).await;
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                debug!("{pending} released channel(s) still open; closing the connection anyway");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (up to `limit`) for lapin's IO loop of a closed `connection` to
    /// end. lapin answers `close` once the broker confirmed it, while its IO
    /// loop, a thread of its own, still shuts the socket down through the
    /// tokio reactor. A program that returns from `main` right after
    /// [`Driver::stop`](crate::Driver::stop) would shut the runtime down
    /// under that thread, which then logs an I/O error ("the Tokio context
    /// is being shut down") at error level although nothing went wrong. Only
    /// a connection no longer connected is waited for (its loop is ending),
    /// and only if no other handle shares it.
    async fn await_io_loop(connection: Arc<Connection>, limit: Duration) {
        if connection.status().connected() {
            return;
        }
        let Ok(connection) = Arc::try_unwrap(connection) else {
            debug!("the connection is still shared; not waiting for its IO loop");
            return;
        };
        match tokio::time::timeout(limit, tokio::task::spawn_blocking(move || connection.run()))
            .await
        {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => debug!("the connection's IO loop ended with: {e}"),
            Ok(Err(e)) => debug!("waiting for the connection's IO loop failed: {e}"),
            Err(_) => debug!("the connection's IO loop did not end within {limit:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::RabbitConfig;
    use super::*;

    /// Port 1 on loopback: nothing listens, so connecting fails at once.
    const UNREACHABLE: &str = "amqp://guest:hunter2@127.0.0.1:1/%2f";

    #[tokio::test]
    async fn a_failed_connect_keeps_lapin_error_and_hides_the_password() {
        let err = RabbitDriver::connect(RabbitConfig::new(UNREACHABLE))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Connection);
        assert!(err.find::<lapin::Error>().is_some(), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("cannot connect to amqp://guest:***@127.0.0.1:1"),
            "{text}"
        );
        for shown in [
            text,
            format!("{err:?}"),
            format!("{:?}", err.find::<lapin::Error>()),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }
}
