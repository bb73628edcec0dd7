//! How the claims, the relay and the caller reach Postgres: [`PgConnect`].

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use jobrail_native::kit::{lock, Reconnect};
use rustls::ClientConfig;
use tokio::time::Instant;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

/// The first wait before connecting again after a failed attempt, unless
/// [`PgConnect::reconnect_wait`] sets another.
const FIRST_WAIT: Duration = Duration::from_millis(100);
/// The longest such wait, unless [`PgConnect::reconnect_wait`] sets another.
const MAX_WAIT: Duration = Duration::from_secs(5);

/// The bound on each operation unless [`PgConnect::operation_timeout`]
/// sets another.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);
/// The keepalive idle time tokio-postgres uses when none is set (2 h).
const LIBRARY_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
/// The keepalive idle time a connection gets unless its settings name one.
pub(crate) const KEEPALIVES_IDLE: Duration = Duration::from_secs(10);
/// The wait between keepalive probes unless the settings name one.
pub(crate) const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection is dropped, unless set.
pub(crate) const KEEPALIVES_RETRIES: u32 = 3;
/// How long sent data may stay unacknowledged, unless set.
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Bounds, unless `config` sets its own, how long a connection whose peer
/// went silent (a partition: no reset, nothing answered) stays open:
/// keepalive probes after 10 s idle, every 5 s, dropped after 3 unanswered
/// (25 s), and sent data unacknowledged for 30 s drops it too
/// (`tcp_user_timeout`, Linux). Without them, tokio-postgres would wait on
/// the kernel's defaults: about 2 h 11 min for an idle connection and about
/// 15 min of retransmissions for a busy one, while every query on it waits.
fn silence_bounds(config: &mut Config) {
    if config.get_keepalives_idle() == LIBRARY_KEEPALIVES_IDLE {
        config.keepalives_idle(KEEPALIVES_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVES_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
}

/// Where and how to connect to Postgres: the connection settings, TLS,
/// and the wait between reconnection attempts. [`PgClaims`](crate::PgClaims)
/// and [`OutboxRelay`](crate::OutboxRelay) connect through one, and so can
/// the caller ([`connect`](Self::connect)) for the client it hands to
/// [`Outbox::dispatch`](crate::Outbox::dispatch) or
/// [`PgClaims::complete_in`](crate::PgClaims::complete_in).
///
/// # TLS
///
/// The URL's `sslmode` decides, as tokio-postgres reads it:
///
/// - `require`: TLS through rustls (on ring), or no connection. The
///   server's certificate is checked against the platform's root
///   certificates and the host name, as libpq's `verify-full` does (tokio-postgres
///   knows no `verify-ca` or `verify-full`; rustls always verifies).
///   [`tls`](Self::tls) replaces the roots, say with a private CA's, or adds a
///   client certificate.
/// - `prefer` (the default when the URL names none) and `disable`: no TLS.
///   libpq's `prefer` tries TLS without checking the certificate; this
///   crate does not offer TLS that an attacker in the middle could answer.
///
/// # Reconnection
///
/// A store or relay whose connection the server closed (a restart, a
/// failover, `pg_terminate_backend`) connects again on its next operation.
/// After a failed attempt, the next one waits first: from 100 ms, doubling,
/// up to 5 s ([`reconnect_wait`](Self::reconnect_wait)), on the schedule of
/// [`jobrail_native::kit::Reconnect`], and back to the first wait after a
/// success. A `connect_timeout` in the URL bounds each attempt.
///
/// # A silent server
///
/// A partition leaves a connection open with nothing answering: no reset
/// arrives, and a query on it would wait for the kernel to give up (about
/// 15 minutes of retransmissions, over two hours for an idle connection).
/// Unless the settings name their own, every connection gets TCP
/// keepalives after 10 s idle, every 5 s, three unanswered (the URL's
/// `keepalives_idle`, `keepalives_interval`, `keepalives_retries`), and
/// `tcp_user_timeout` 30 s: a connection whose server went silent is
/// dropped within about 30 s, its query fails, and the next operation
/// connects again.
///
/// ```no_run
/// use jobrail_postgres::{PgClaims, PgConnect};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let connect = PgConnect::new("postgres://app@db.internal/shop?sslmode=require&connect_timeout=5")?;
/// let claims = PgClaims::connect_to(connect.clone(), PgClaims::DEFAULT_TABLE).await?;
/// // A client of the caller's own, for a transaction, on the same settings.
/// let client = connect.connect().await?;
/// # drop((claims, client));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgConnect {
    config: Config,
    tls: Option<Arc<ClientConfig>>,
    first_wait: Duration,
    max_wait: Duration,
    operation_timeout: Duration,
}

impl fmt::Debug for PgConnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio-postgres's Config hides the password in its Debug.
        f.debug_struct("PgConnect")
            .field("config", &self.config)
            .field("custom_tls", &self.tls.is_some())
            .field("first_wait", &self.first_wait)
            .field("max_wait", &self.max_wait)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

impl PgConnect {
    /// The settings of `url`: a `postgres://` URL or a key-value string
    /// (`host=... dbname=... sslmode=require`). An error if it does not
    /// parse (an unknown `sslmode`, say); nothing connects here.
    pub fn new(url: &str) -> Result<PgConnect, tokio_postgres::Error> {
        Config::from_str(url).map(PgConnect::from_config)
    }

    /// The settings of a [`Config`] built in code.
    pub fn from_config(mut config: Config) -> PgConnect {
        silence_bounds(&mut config);
        PgConnect {
            config,
            tls: None,
            first_wait: FIRST_WAIT,
            max_wait: MAX_WAIT,
            operation_timeout: OPERATION_TIMEOUT,
        }
    }

    /// TLS with `config` (its roots, its client certificate) instead of the
    /// platform's roots, for `sslmode=require`.
    pub fn tls(mut self, config: ClientConfig) -> PgConnect {
        self.tls = Some(Arc::new(config));
        self
    }

    /// Waits `first` before the attempt after a failed one, doubling with
    /// each further failure, never more than `max` (default 100 ms and 5 s).
    pub fn reconnect_wait(mut self, first: Duration, max: Duration) -> PgConnect {
        self.first_wait = first;
        self.max_wait = max.max(first);
        self
    }

    /// Bounds each operation of [`PgClaims`](crate::PgClaims) (a claim, a
    /// completion) and each statement of a [`PgDriver`](crate::PgDriver)
    /// connecting through this to `bound` (default 10 s):
    /// past it, the operation fails as a store error (its outcome unknown:
    /// a claim may have been taken, a completion made) and its connection
    /// is dropped, so the next operation connects again instead of
    /// waiting behind a server that stopped answering. Zero is raised to
    /// 1 ms.
    pub fn operation_timeout(mut self, bound: Duration) -> PgConnect {
        self.operation_timeout = bound.max(Duration::from_millis(1));
        self
    }

    /// The bound on each operation ([`operation_timeout`](Self::operation_timeout)).
    pub fn get_operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The connection settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Connects once (with TLS as [`sslmode`](Self#tls) says) and spawns the
    /// task that drives the connection on the current tokio runtime. The
    /// task ends when the client is dropped or the server closes the
    /// connection; the client then reports [`Client::is_closed`] and every
    /// query fails. This makes no second attempt and does not wait.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        let client = if self.config.get_ssl_mode() == SslMode::Require {
            let tls = self.tls.clone().unwrap_or_else(platform_tls);
            let (client, connection) = self
                .config
                .connect(MakeRustlsConnect::new((*tls).clone()))
                .await?;
            tokio::spawn(drive(connection));
            client
        } else {
            let (client, connection) = self.config.connect(NoTls).await?;
            tokio::spawn(drive(connection));
            client
        };
        Ok(client)
    }

    /// Connects once, as [`connect`](Self::connect) does, and forwards the
    /// connection's notifications (`NOTIFY`) to the receiver; the receiver
    /// ends when the connection does.
    pub(crate) async fn connect_listening(
        &self,
    ) -> Result<
        (
            Client,
            tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
        ),
        tokio_postgres::Error,
    > {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        let client = if self.config.get_ssl_mode() == SslMode::Require {
            let tls = self.tls.clone().unwrap_or_else(platform_tls);
            let (client, connection) = self
                .config
                .connect(MakeRustlsConnect::new((*tls).clone()))
                .await?;
            tokio::spawn(forward(connection, sender));
            client
        } else {
            let (client, connection) = self.config.connect(NoTls).await?;
            tokio::spawn(forward(connection, sender));
            client
        };
        Ok((client, receiver))
    }

    /// A dialer on these settings, for a store or relay of its own.
    pub(crate) fn dialer(&self) -> Dialer {
        Dialer {
            connect: self.clone(),
            state: Mutex::new(DialState {
                wait: Reconnect::new(self.first_wait, self.max_wait),
                not_before: None,
            }),
        }
    }
}

/// Runs a connection until it ends.
async fn drive<F>(connection: F)
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>>,
{
    if let Err(error) = connection.await {
        tracing::debug!(%error, "postgres connection ended");
    }
}

/// Runs a connection until it ends, sending its notifications on.
async fn forward<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    sender: tokio::sync::mpsc::UnboundedSender<tokio_postgres::Notification>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    while let Some(message) = futures_util::StreamExt::next(&mut messages).await {
        match message {
            Ok(tokio_postgres::AsyncMessage::Notification(notification)) => {
                let _ = sender.send(notification);
            }
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "postgres listening connection ended");
                return;
            }
        }
    }
}

/// The TLS settings of `sslmode=require` without [`PgConnect::tls`]: rustls
/// on ring with the platform's root certificates, loaded once per process.
fn platform_tls() -> Arc<ClientConfig> {
    static PLATFORM: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    PLATFORM
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            for error in &found.errors {
                tracing::warn!(%error, "postgres TLS: a platform root certificate did not load");
            }
            let mut roots = rustls::RootCertStore::empty();
            let (added, ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::warn!(
                    ignored,
                    "postgres TLS: no platform root certificates; sslmode=require \
                     connections will fail (PgConnect::tls sets roots)"
                );
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("ring supports rustls's default protocol versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
            Arc::new(config)
        })
        .clone()
}

/// Connects again for one store or relay, waiting after a failed attempt
/// as [`PgConnect::reconnect_wait`] says.
pub(crate) struct Dialer {
    connect: PgConnect,
    state: Mutex<DialState>,
}

struct DialState {
    wait: Reconnect,
    /// No attempt before this, after a failed one.
    not_before: Option<Instant>,
}

impl Dialer {
    /// The bound on each operation of the store that dials through this.
    pub(crate) fn operation_timeout(&self) -> Duration {
        self.connect.operation_timeout
    }

    /// One attempt to connect, after what is left of the wait that the last
    /// failed attempt started.
    pub(crate) async fn dial(&self) -> Result<Client, tokio_postgres::Error> {
        let not_before = lock(&self.state).not_before;
        if let Some(at) = not_before {
            tokio::time::sleep_until(at).await;
        }
        let result = self.connect.connect().await;
        let mut state = lock(&self.state);
        match &result {
            Ok(_) => {
                state.wait.succeeded();
                state.not_before = None;
            }
            Err(error) => {
                let wait = state.wait.failed();
                tracing::debug!(%error, ?wait, "postgres: connecting failed; the next attempt waits");
                state.not_before = Some(Instant::now() + wait);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_gets_bounds_on_a_silent_server_unless_it_sets_its_own() {
        let connect = PgConnect::new("postgres://app@db/shop").unwrap();
        let config = connect.config();
        assert_eq!(config.get_keepalives_idle(), KEEPALIVES_IDLE);
        assert_eq!(config.get_keepalives_interval(), Some(KEEPALIVES_INTERVAL));
        assert_eq!(config.get_keepalives_retries(), Some(KEEPALIVES_RETRIES));
        assert_eq!(config.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let connect = PgConnect::new(
            "postgres://app@db/shop?keepalives_idle=60&keepalives_interval=7&keepalives_retries=9&tcp_user_timeout=1000",
        )
        .unwrap();
        let config = connect.config();
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            config.get_keepalives_interval(),
            Some(Duration::from_secs(7))
        );
        assert_eq!(config.get_keepalives_retries(), Some(9));
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(1000))
        );
    }

    #[test]
    fn settings_parse_and_hide_the_password() {
        let connect = PgConnect::new("postgres://app:secret@db.internal/shop?sslmode=require")
            .unwrap()
            .reconnect_wait(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(connect.config().get_ssl_mode(), SslMode::Require);
        assert_eq!(
            connect.max_wait,
            Duration::from_secs(2),
            "max is at least first"
        );
        let shown = format!("{connect:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(PgConnect::new("postgres://db/shop?sslmode=verify-full").is_err());
    }

    #[tokio::test]
    async fn a_failed_attempt_makes_the_next_one_wait() {
        // Nothing listens on port 1 of the loopback: each attempt fails at once.
        let connect = PgConnect::new("postgres://nobody@127.0.0.1:1/none")
            .unwrap()
            .reconnect_wait(Duration::from_millis(300), Duration::from_secs(1));
        let dialer = connect.dialer();
        assert!(dialer.dial().await.is_err());
        let not_before = lock(&dialer.state)
            .not_before
            .expect("a wait after the failure");
        let wait = not_before.saturating_duration_since(Instant::now());
        assert!(
            wait > Duration::from_millis(200) && wait <= Duration::from_millis(300),
            "{wait:?}"
        );
        let started = Instant::now();
        assert!(dialer.dial().await.is_err());
        assert!(started.elapsed() >= wait, "the second attempt waited");
        let not_before = lock(&dialer.state).not_before.unwrap();
        let wait = not_before.saturating_duration_since(Instant::now());
        assert!(wait > Duration::from_millis(500), "doubled: {wait:?}");
    }
}
