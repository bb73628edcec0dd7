//! The connection: made on first use, kept up by async-nats afterwards,
//! watched so that subscriptions and dispatches notice an outage, and
//! closed by `stop`.
//!
//! async-nats reconnects by itself; the driver only sets the wait between
//! its attempts ([`NatsDriver::reconnect`], shared with a subscription
//! that re-declares its consumer) and counts connection generations, so a
//! subscription can tell a pull request sent on a lost connection from one
//! sent on the current one.

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream;
use async_nats::{Client, ConnectOptions, Event};
use tracing::{info, warn};

use super::config::Auth;
use super::errors::{self, error};
use super::{read, write, NatsDriver};
use crate::driver::{DriverError, ErrorKind};
use crate::kit::Reconnect;

/// The first wait before a reconnection attempt; the waits double from
/// there up to [`max_reconnect_backoff`](super::NatsConfig::max_reconnect_backoff).
const FIRST_RECONNECT: Duration = Duration::from_millis(100);

/// How often a pull request waiting out a reconnection looks at the
/// client's state.
const STATE_POLL: Duration = Duration::from_millis(100);

/// Probes missed in a row before the connection is replaced.
const PROBES_MISSED: u32 = 2;

/// Asks the server something it always answers (JetStream's account info)
/// every `every` while `link` lives, each within `every`; after
/// [`PROBES_MISSED`] unanswered in a row, replaces the connection.
///
/// async-nats pings only a connection that is idle: every command resets
/// its ping timer, so a busy worker on a connection that went half-open
/// (its requests reach the server, nothing comes back) would never notice,
/// each request timing out on its own, for as long as the link stays so.
async fn probe(link: std::sync::Weak<Link>, every: Duration, address: String) {
    let mut missed = 0;
    loop {
        tokio::time::sleep(every).await;
        let Some(link) = link.upgrade() else { return };
        if link.client.connection_state() != State::Connected {
            missed = 0;
            continue;
        }
        let answer = tokio::time::timeout(
            every,
            link.client.request("$JS.API.INFO", Default::default()),
        )
        .await;
        let unanswered = match answer {
            Err(_) => true,
            Ok(Err(e)) => e.kind() == async_nats::RequestErrorKind::TimedOut,
            // An answer, or an error the server sent (no responders, no
            // JetStream): the connection carries the server's replies.
            Ok(Ok(_)) => false,
        };
        if !unanswered {
            missed = 0;
            continue;
        }
        missed += 1;
        if missed >= PROBES_MISSED {
            warn!(
                url = %address,
                probes = missed,
                "no answer from NATS on this connection; replacing it"
            );
            missed = 0;
            if let Err(e) = link.client.force_reconnect().await {
                warn!(url = %address, error = %e, "replacing the NATS connection failed");
            }
        }
    }
}

/// The connection and its JetStream context, shared (in an `Arc`) by every
/// operation and delivery.
pub(super) struct Link {
    pub(super) client: Client,
    pub(super) js: jetstream::Context,
}

impl NatsDriver {
    /// The waits between reconnection attempts (of the connection and of a
    /// subscription's consumer).
    pub(super) fn reconnect(&self) -> Reconnect {
        Reconnect::new(FIRST_RECONNECT, self.inner.config.max_reconnect_backoff)
    }

    /// The connection, if made (and not closed).
    pub(super) fn current_link(&self) -> Option<Arc<Link>> {
        read(&self.inner.link).clone()
    }

    /// The connection (async-nats keeps it up by itself once made). Once
    /// made, this is a shared read of the cached `Arc`: concurrent
    /// operations never wait for one another here.
    pub(super) async fn link(&self) -> Result<Arc<Link>, DriverError> {
        self.inner.life.check_running()?;
        if let Some(link) = self.current_link() {
            return Ok(link);
        }
        let _connecting = self.inner.connecting.lock().await;
        self.inner.life.check_running()?;
        if let Some(link) = self.current_link() {
            return Ok(link);
        }
        let config = &self.inner.config;
        let endpoint = &self.inner.endpoint;
        let connections = self.inner.connections.clone();
        let address = endpoint.address.clone();
        let reconnect = self.reconnect();
        let mut options = ConnectOptions::new()
            .name(&config.connection_name)
            .connection_timeout(config.operation_timeout)
            .request_timeout(Some(config.operation_timeout))
            .ping_interval(config.ping_interval)
            .reconnect_delay_callback(move |attempts| {
                reconnect.after(u32::try_from(attempts).unwrap_or(u32::MAX))
            })
            .event_callback(move |event| {
                let connections = connections.clone();
                let address = address.clone();
                async move {
                    match event {
                        Event::Connected => {
                            connections.send_modify(|n| *n += 1);
                            info!(url = %address, "connected to NATS");
                        }
                        Event::Disconnected => {
                            connections.send_modify(|n| *n += 1);
                            warn!(url = %address, "disconnected from NATS; reconnecting");
                        }
                        other => warn!(url = %address, "NATS connection event: {other}"),
                    }
                }
            });
        // The credentials go into the options, never into the address.
        options = match &endpoint.auth {
            Auth::None => options,
            Auth::UserPassword(user, password) => {
                options.user_and_password(user.clone(), password.clone())
            }
            Auth::Token(token) => options.token(token.clone()),
        };
        let client = match tokio::time::timeout(
            config.operation_timeout,
            options.connect(endpoint.address.as_str()),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(errors::connect(&endpoint.address, e)),
            Err(_) => {
                return Err(error(
                    ErrorKind::Connection,
                    format!(
                        "cannot connect to {}: no answer within {:?}",
                        endpoint.address, config.operation_timeout
                    ),
                ))
            }
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(config.operation_timeout)
            .build(client.clone());
        // Known from the greeting: kept for a driver stopped later.
        let max_payload = client.server_info().max_payload;
        self.inner
            .max_payload
            .store(max_payload, std::sync::atomic::Ordering::Release);
        let fresh = Arc::new(Link { client, js });
        *write(&self.inner.link) = Some(fresh.clone());
        tokio::spawn(probe(
            Arc::downgrade(&fresh),
            config.ping_interval,
            endpoint.address.clone(),
        ));
        Ok(fresh)
    }

    /// The connection, if the client is connected now. While it reconnects
    /// every request would wait in its queue until the server is back or the
    /// operation timeout ends, so a publish to `subject` fails at once as not
    /// accepted instead.
    pub(super) async fn connected_link(&self, subject: &str) -> Result<Arc<Link>, DriverError> {
        let link = self.link().await.map_err(DriverError::not_sent)?;
        if link.client.connection_state() != State::Connected {
            return Err(error(
                ErrorKind::NotAccepted,
                format!(
                    "publish to `{subject}` not sent: not connected to NATS at {} (reconnecting)",
                    self.inner.endpoint.address
                ),
            ));
        }
        Ok(link)
    }

    /// Waits, at most the operation timeout, until `link`'s client is
    /// connected, rather than queueing a request for the reconnection.
    pub(super) async fn wait_connected(&self, link: &Link) -> Result<(), DriverError> {
        let mut waited = Duration::ZERO;
        while link.client.connection_state() != State::Connected {
            self.inner.life.check_running()?;
            if waited >= self.inner.config.operation_timeout {
                return Err(error(
                    ErrorKind::Connection,
                    "not connected to NATS (reconnecting)",
                ));
            }
            tokio::time::sleep(STATE_POLL).await;
            waited += STATE_POLL;
        }
        Ok(())
    }

    /// Stops the driver: subscriptions end, and the connection is drained
    /// (within the operation timeout) and closed.
    pub(super) async fn close(&self) -> Result<(), DriverError> {
        self.inner.life.stop();
        let link = {
            let _connecting = self.inner.connecting.lock().await;
            write(&self.inner.link).take()
        };
        if let Some(link) = link {
            let limit = self.inner.config.operation_timeout;
            match tokio::time::timeout(limit, link.client.drain()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(errors::connection("closing the connection", e)),
                Err(_) => {
                    return Err(error(
                        ErrorKind::Connection,
                        format!("closing the connection: no answer within {limit:?}"),
                    ))
                }
            }
        }
        Ok(())
    }
}
