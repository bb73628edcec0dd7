//! Settings for the NATS JetStream driver.

use std::fmt;
use std::time::Duration;

use super::errors::config_error;
use crate::driver::DriverError;

/// How often the NATS connection is checked by default
/// ([`NatsConfig::ping_interval`]): a silent connection is replaced within
/// about four intervals, 20 s.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(5);

/// Settings for [`NatsDriver`](super::NatsDriver).
///
/// `Debug` never shows the password or token in [`url`](Self::url).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail_native::nats::{NatsConfig, NatsDriver};
///
/// let config = NatsConfig::new("nats://127.0.0.1:4222")
///     // How long a delivery is held before the server redelivers it; the
///     // driver renews it while the handler runs.
///     .ack_wait(Duration::from_secs(60))
///     .failure_subject(Some("{prefix}.{queue}.failed"));
/// assert_eq!(config.stream_prefix, "QUEUE");
/// // `new` checks the settings and connects on first use.
/// let _driver = NatsDriver::new(config)?;
/// # Ok::<(), jobrail_native::DriverError>(())
/// ```
#[derive(Clone)]
pub struct NatsConfig {
    /// `nats://host:port`, optionally with credentials:
    /// `nats://user:password@host:port` or `nats://token@host:port`
    /// (`tls://` for TLS). Credentials may be percent-encoded.
    pub url: String,
    /// The first subject token(s): queue `Q` is stored under the subject
    /// `<subject_prefix>.Q` (default `queue`).
    pub subject_prefix: String,
    /// The first part of stream names: queue `Q` is stored in the stream
    /// `<stream_prefix>_Q` (default `QUEUE`), with `.`, `*`, `>`, `/`, `\`
    /// and whitespace in `Q` replaced by `_`.
    pub stream_prefix: String,
    /// The durable pull consumer every worker of a queue shares
    /// (default `queue-worker`).
    pub consumer_name: String,
    /// How long the server waits for a settlement (or a `Progress` renewal)
    /// before redelivering (default 30 s). Deliveries are renewed every half
    /// of it while they are handled.
    pub ack_wait: Duration,
    /// The consumer's `MaxDeliver`. `None` (default, recommended): unlimited
    /// (`-1`), so the server never stops redelivering a message on its own.
    /// If set, it must be positive, and a consumer refuses to start when it
    /// is below what a job of the queue needs: the job's attempt cap plus
    /// one ([`jobrail::deliveries_needed`]), checked against the registry's
    /// own jobs ([`jobrail::check_delivery_limit`]).
    pub max_deliver: Option<u32>,
    /// The failure subject of a queue, `{queue}` replaced by the queue's
    /// name and `{prefix}` by [`subject_prefix`](Self::subject_prefix)
    /// (default `{prefix}.{queue}.failed`). Records published there are kept
    /// in a failure stream (`<work stream>_failed`, limits retention). `None`:
    /// terminal failures are logged at error level and acknowledged.
    pub failure_subject: Option<String>,
    /// How long an operator's claim on a failure record (a replay or purge
    /// under way) holds it at most (default 2 minutes): a claim whose
    /// process crashed before it removed or released the record lapses
    /// after this long, and the record can be claimed again. It must
    /// comfortably exceed a replay (a dispatch and a removal, each within
    /// [`operation_timeout`](Self::operation_timeout)): a claim that lapses
    /// while its replay is still running lets a second replay send a
    /// duplicate, so a hold shorter than three operation timeouts is raised
    /// to that ([`effective_claim_hold`](Self::effective_claim_hold)). It
    /// is the age limit of the claims stream (see the module
    /// documentation), updated when it differs.
    pub claim_hold: Duration,
    /// Bound on every server round trip: connect, API requests, publish
    /// acknowledgements, double acks.
    pub operation_timeout: Duration,
    /// How long one pull request waits on the server for messages before a
    /// fresh one is sent (default 5 s).
    pub fetch_expiry: Duration,
    /// Longest wait between reconnection attempts (of the connection and of a
    /// subscription's consumer).
    pub max_reconnect_backoff: Duration,
    /// How often the connection is checked (default
    /// [`DEFAULT_PING_INTERVAL`], 5 s): the client pings an idle
    /// connection at this interval (more than two pings unanswered and it
    /// is replaced), and the driver asks the server for its account info
    /// at this interval, busy or not (two left unanswered for an interval
    /// each and it is replaced), so a silent connection (a partition, a
    /// half-open link) is noticed within about four intervals, 20 s. The
    /// server pings on its own schedule (`ping_interval`, 2 min by default,
    /// two unanswered) before it drops the connection and its
    /// subscriptions' pull requests. The probe is a request to
    /// `$JS.API.INFO` (JetStream's account info): the driver's user needs
    /// permission to publish to it, as to the rest of `$JS.API.>`.
    /// At least 100 ms.
    pub ping_interval: Duration,
    /// The connection name shown by the server (`/connz`).
    pub connection_name: String,
    /// How a dispatch with a delay is held until it is due (default
    /// [`DelayMechanism::Auto`]: the server's message schedules on
    /// nats-server 2.12 or later, the driver's relay on older servers). See
    /// the module documentation, "Delayed dispatch".
    pub delay_mechanism: DelayMechanism,
}

/// How the NATS driver holds a delayed dispatch until it is due
/// ([`NatsConfig::delay_mechanism`]).
///
/// Every driver of a queue (producers and workers) should use the same
/// mechanism; a worker runs the relay of a queue whatever its own setting
/// once the queue has a hold stream, so messages held by either mechanism
/// are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DelayMechanism {
    /// Chosen by the server's version, read from its greeting when a queue
    /// is declared: [`Schedules`](Self::Schedules) on nats-server 2.12 or
    /// later, [`Relay`](Self::Relay) on older ones.
    #[default]
    Auto,
    /// The server's message schedules (`Nats-Schedule: @at ...`, ADR-51):
    /// the server stores the message and publishes it to the work subject
    /// when it is due. Needs nats-server 2.12 or later: on an older server
    /// a queue's declaration fails with
    /// [`ErrorKind::Config`](crate::ErrorKind::Config).
    Schedules,
    /// The driver's relay, on any server: the message waits in a hold
    /// stream, and a relay inside each worker moves it to the work subject
    /// when it is due.
    Relay,
}

impl NatsConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            subject_prefix: "queue".into(),
            stream_prefix: "QUEUE".into(),
            consumer_name: "queue-worker".into(),
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            failure_subject: Some("{prefix}.{queue}.failed".into()),
            claim_hold: Duration::from_secs(120),
            operation_timeout: Duration::from_secs(10),
            fetch_expiry: Duration::from_secs(5),
            max_reconnect_backoff: Duration::from_secs(5),
            ping_interval: DEFAULT_PING_INTERVAL,
            connection_name: "jobrail-native".into(),
            delay_mechanism: DelayMechanism::Auto,
        }
    }

    /// Replaces the delay mechanism (see [`DelayMechanism`]).
    pub fn delay_mechanism(mut self, mechanism: DelayMechanism) -> Self {
        self.delay_mechanism = mechanism;
        self
    }

    /// Replaces the AckWait.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Replaces the failure subject pattern (`None`: no failure subject).
    pub fn failure_subject(mut self, pattern: Option<&str>) -> Self {
        self.failure_subject = pattern.map(str::to_string);
        self
    }

    /// The URL with its password or token replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    pub(super) fn validate(&self) -> Result<Endpoint, DriverError> {
        let endpoint = Endpoint::parse(&self.url)
            .map_err(|why| config_error(format!("`{}` {why}", self.redacted_url())))?;
        if !valid_subject(&self.subject_prefix) {
            return Err(config_error(format!(
                "subject prefix `{}` is not a valid subject (no spaces, `*`, `>` or empty tokens)",
                self.subject_prefix
            )));
        }
        if !valid_name(&self.stream_prefix) {
            return Err(config_error(format!(
                "stream prefix `{}` is not a valid stream name",
                self.stream_prefix
            )));
        }
        if !valid_name(&self.consumer_name) {
            return Err(config_error(format!(
                "consumer name `{}` is not a valid consumer name",
                self.consumer_name
            )));
        }
        if let Some(pattern) = &self.failure_subject {
            if !pattern.contains("{queue}") {
                return Err(config_error(format!(
                    "failure subject pattern `{pattern}` must contain `{{queue}}` (one failure subject per queue)"
                )));
            }
            let sample = pattern
                .replace("{prefix}", &self.subject_prefix)
                .replace("{queue}", "q");
            if !valid_subject(&sample) {
                return Err(config_error(format!(
                    "failure subject pattern `{pattern}` does not make a valid subject"
                )));
            }
        }
        // Whether MaxDeliver leaves room for every job is checked by the
        // consumer, against the registry's own jobs.
        if self.max_deliver == Some(0) {
            return Err(config_error("MaxDeliver must be positive (or unset)"));
        }
        if self.ping_interval < Duration::from_millis(100) {
            return Err(config_error(format!(
                "ping_interval {:?} is too short (at least 100 ms)",
                self.ping_interval
            )));
        }
        if self.ack_wait < Duration::from_millis(100) {
            return Err(config_error(format!(
                "AckWait {:?} is too short (at least 100 ms)",
                self.ack_wait
            )));
        }
        if self.operation_timeout.is_zero() || self.fetch_expiry < Duration::from_millis(100) {
            return Err(config_error(
                "the operation timeout must be positive and the fetch expiry at least 100 ms",
            ));
        }
        if self.claim_hold < Duration::from_secs(1) {
            return Err(config_error(format!(
                "the claim hold {:?} is too short: at least 1 s, so a replay finishes before its \
                 claim lapses",
                self.claim_hold
            )));
        }
        Ok(endpoint)
    }
}

impl NatsConfig {
    /// The claim hold in force: [`claim_hold`](Self::claim_hold), raised to
    /// three operation timeouts when it is shorter.
    pub fn effective_claim_hold(&self) -> Duration {
        self.claim_hold
            .max(self.operation_timeout.saturating_mul(3))
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &self.redacted_url())
            .field("subject_prefix", &self.subject_prefix)
            .field("stream_prefix", &self.stream_prefix)
            .field("consumer_name", &self.consumer_name)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("failure_subject", &self.failure_subject)
            .field("claim_hold", &self.claim_hold)
            .field("operation_timeout", &self.operation_timeout)
            .field("fetch_expiry", &self.fetch_expiry)
            .field("max_reconnect_backoff", &self.max_reconnect_backoff)
            .field("ping_interval", &self.ping_interval)
            .field("connection_name", &self.connection_name)
            .field("delay_mechanism", &self.delay_mechanism)
            .finish()
    }
}

/// Credentials taken out of the URL.
#[derive(Clone)]
pub(super) enum Auth {
    None,
    UserPassword(String, String),
    Token(String),
}

/// Where to connect, with the credentials separated from the address (so the
/// address can appear in errors and logs).
#[derive(Clone)]
pub(super) struct Endpoint {
    /// `scheme://host:port`, no credentials.
    pub(super) address: String,
    pub(super) auth: Auth,
}

impl fmt::Debug for Endpoint {
    /// The address only: never the credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    fn parse(url: &str) -> Result<Endpoint, &'static str> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err("is not a nats:// or tls:// URL");
        };
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "nats" && scheme != "tls" {
            return Err("is not a nats:// or tls:// URL");
        }
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        if !tail.is_empty() && tail != "/" {
            return Err("must not have a path or query");
        }
        let (auth, host) = match authority.rsplit_once('@') {
            Some((userinfo, host)) => {
                let auth = match userinfo.split_once(':') {
                    Some((user, password)) => {
                        Auth::UserPassword(percent_decode(user)?, percent_decode(password)?)
                    }
                    None => Auth::Token(percent_decode(userinfo)?),
                };
                (auth, host)
            }
            None => (Auth::None, authority),
        };
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err("has no host");
        }
        Ok(Endpoint {
            address: format!("{scheme}://{host}"),
            auth,
        })
    }
}

fn percent_decode(s: &str) -> Result<String, &'static str> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("has a malformed percent-encoding in its credentials")?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "has credentials that are not UTF-8")
}

/// A subject without wildcards: dot-separated, non-empty tokens, no spaces.
pub(super) fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty() && !token.contains(char::is_whitespace) && !token.contains(['*', '>'])
        })
}

/// A stream or consumer name.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.contains(char::is_whitespace)
        && !name.contains(['.', '*', '>', '/', '\\'])
}

/// `scheme://user:secret@host` -> `scheme://user:***@host`;
/// `scheme://token@host` -> `scheme://***@host`.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparseable URL>".into();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => format!("{scheme}://***@{host}{tail}"),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ping_interval_too_short_to_run_is_refused() {
        let mut config = NatsConfig::new("nats://localhost:4222");
        assert_eq!(config.ping_interval, DEFAULT_PING_INTERVAL);
        config.ping_interval = Duration::ZERO;
        let err = config.validate().unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Config);
        assert!(err.to_string().contains("ping_interval"), "{err}");
    }

    #[test]
    fn credentials_are_redacted_and_separated() {
        assert_eq!(
            redact("nats://ada:s3cret@127.0.0.1:4222"),
            "nats://ada:***@127.0.0.1:4222"
        );
        assert_eq!(redact("nats://tok3n@host:4222"), "nats://***@host:4222");
        assert_eq!(redact("nats://host:4222"), "nats://host:4222");
        let config = NatsConfig::new("nats://ada:s3cret@localhost:4222");
        assert!(!format!("{config:?}").contains("s3cret"));
        let endpoint = config.validate().unwrap();
        assert_eq!(endpoint.address, "nats://localhost:4222");
        assert!(
            matches!(endpoint.auth, Auth::UserPassword(ref u, ref p) if u == "ada" && p == "s3cret")
        );
        let endpoint = NatsConfig::new("nats://t%40k@localhost")
            .validate()
            .unwrap();
        assert!(matches!(endpoint.auth, Auth::Token(ref t) if t == "t@k"));
    }

    #[test]
    fn delay_mechanism_is_chosen_by_the_server_unless_set() {
        let config = NatsConfig::new("nats://localhost");
        assert_eq!(config.delay_mechanism, DelayMechanism::Auto);
        let config = config.delay_mechanism(DelayMechanism::Relay);
        assert_eq!(config.delay_mechanism, DelayMechanism::Relay);
        assert!(format!("{config:?}").contains("delay_mechanism: Relay"));
        assert!(config.validate().is_ok());
    }

    #[test]
    fn validation() {
        assert!(NatsConfig::new("nats://127.0.0.1:4222").validate().is_ok());
        assert!(NatsConfig::new("amqp://127.0.0.1").validate().is_err());
        assert!(NatsConfig::new("127.0.0.1:4222").validate().is_err());
        let err = NatsConfig::new("http://u:hunter2@x")
            .validate()
            .err()
            .unwrap();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let mut c = NatsConfig::new("nats://localhost");
        c.max_deliver = Some(0);
        assert!(c.validate().unwrap_err().to_string().contains("MaxDeliver"));
        // Whether it is enough for the jobs is the consumer's check.
        c.max_deliver = Some(3);
        assert!(c.validate().is_ok());
        let c = NatsConfig::new("nats://localhost").failure_subject(Some("failed"));
        assert!(c.validate().is_err());
        let c = NatsConfig::new("nats://localhost").ack_wait(Duration::ZERO);
        assert!(c.validate().is_err());
        let mut c = NatsConfig::new("nats://localhost");
        c.claim_hold = Duration::from_secs(20);
        c.operation_timeout = Duration::from_secs(30);
        assert!(c.validate().is_ok());
        assert_eq!(c.effective_claim_hold(), Duration::from_secs(90));
        c.operation_timeout = Duration::from_secs(2);
        assert_eq!(c.effective_claim_hold(), Duration::from_secs(20));
        c.claim_hold = Duration::from_millis(900);
        c.operation_timeout = Duration::from_millis(100);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("claim hold 900ms is too short"), "{err}");
        assert!(valid_subject("queue.a-b.c"));
        assert!(!valid_subject("queue..c"));
        assert!(!valid_subject("queue.*"));
        assert!(!valid_subject("queue. x"));
        assert!(valid_name("QUEUE_a-b"));
        assert!(!valid_name("QUEUE.a"));
    }
}
