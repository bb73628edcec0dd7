//! Settings for the RabbitMQ driver.

use std::fmt;
use std::time::Duration;

use super::errors::config_error;
use super::DEFAULT_DELAY_BUCKETS;
use crate::driver::DriverError;

/// RabbitMQ's default `max_message_size` (since 3.8): 128 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 134_217_728;

/// The AMQP heartbeat the driver asks for by default
/// ([`RabbitConfig::heartbeat`]): a silent connection is closed after twice
/// this, 20 s.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

/// Settings for [`RabbitDriver`](super::RabbitDriver).
///
/// `Debug` never shows the password in [`url`](Self::url).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail_native::ErrorKind;
/// use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
///
/// let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
///     // Retry delays round up to one of these; a longer one is refused.
///     .delay_buckets([Duration::from_secs(1), Duration::from_secs(30), Duration::from_secs(600)])
///     .failure_queue(Some("{queue}.failed"));
/// // `new` checks the settings and connects on first use.
/// let driver = RabbitDriver::new(config)?;
/// assert_eq!(driver.config().delay_buckets.len(), 3);
///
/// // A bucket that is not a whole number of milliseconds is a configuration error.
/// let bad = RabbitConfig::new("amqp://127.0.0.1").delay_buckets([Duration::from_micros(1500)]);
/// assert_eq!(RabbitDriver::new(bad).unwrap_err().kind(), ErrorKind::Config);
/// # Ok::<(), jobrail_native::DriverError>(())
/// ```
#[derive(Clone)]
pub struct RabbitConfig {
    /// `amqp://user:password@host:port/vhost` (or `amqps://` with the
    /// `rabbitmq-tls` feature). The vhost `/` is written `%2f`.
    pub url: String,
    /// The delay buckets: one hold queue per bucket and work queue, created
    /// when first used. A retry delay rounds up to the next bucket; a delay
    /// above the largest is refused ([`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported)).
    /// Sorted and deduplicated by [`RabbitDriver::new`](super::RabbitDriver::new);
    /// each bucket must be a whole number of milliseconds between 1 ms and
    /// `u32::MAX` ms.
    pub delay_buckets: Vec<Duration>,
    /// The failure queue for a work queue, `{queue}` replaced by the work
    /// queue's name (default `{queue}.failed`). `None`: terminal failures are
    /// rejected without requeue and logged at error level.
    pub failure_queue: Option<String>,
    /// How long to wait for a publisher confirm before the outcome is
    /// reported as uncertain.
    pub confirm_timeout: Duration,
    /// Bound on every other broker round trip (connect, declare, ack...).
    pub operation_timeout: Duration,
    /// Longest wait between reconnection attempts of a subscription.
    pub max_reconnect_backoff: Duration,
    /// The AMQP heartbeat asked for (default [`DEFAULT_HEARTBEAT`], 10 s;
    /// whole seconds; zero leaves it to the broker, whose default is 60 s).
    /// The connection sends a heartbeat every half of it and is closed, and
    /// its deliveries handed back, once nothing has arrived from the broker
    /// for twice as long: this bounds how long a silent connection (a
    /// partition, a half-open link) goes unnoticed, on both sides, since the
    /// broker uses the same value. The broker's lower value wins; a
    /// `heartbeat=` in the URL wins over this.
    pub heartbeat: Duration,
    /// `x-delivery-limit` set on work queues. `None` (default, recommended):
    /// none, so the broker never drops a message on its own (RabbitMQ 3.x
    /// quorum queues have no default limit). The limit counts returns to
    /// the queue, so it allows one delivery more than its value; the driver
    /// reports that as
    /// [`Capabilities::max_deliveries`](crate::Capabilities::max_deliveries),
    /// and a consumer refuses to start when it is below what one of its
    /// registry's jobs (or the unknown-name rule) needs, naming the job
    /// ([`jobrail::check_delivery_limit`]): the broker would otherwise drop a
    /// message before the facade's cap, with no failure record.
    pub delivery_limit: Option<u32>,
    /// The broker's `consumer_timeout` (default 30 min, RabbitMQ's default):
    /// it must equal the `consumer_timeout` setting in the broker's
    /// rabbitmq.conf or advanced.config. The broker closes the channel of a
    /// delivery unacknowledged for longer (checked about once a minute) and
    /// redelivers its message while the handler may still be running, and
    /// RabbitMQ 3.10 has no per-queue override. A consumer therefore refuses
    /// to start a job whose longest hold on one delivery (its timeout times
    /// its in-process attempts, plus the tier-one waits between them) does
    /// not fit in it with [`CONSUMER_TIMEOUT_MARGIN`](super::CONSUMER_TIMEOUT_MARGIN)
    /// to spare. A job with no timeout is accepted with a warning: nothing
    /// bounds its handler, so it is the application's to finish in time.
    pub consumer_timeout: Duration,
    /// The largest message body, in bytes, the broker accepts: it must
    /// equal the broker's `max_message_size` (rabbitmq.conf; 134,217,728
    /// bytes, 128 MiB, by default since RabbitMQ 3.8, which is this
    /// default). Reported as
    /// [`Capabilities::max_message_bytes`](crate::Capabilities::max_message_bytes),
    /// so a longer body is refused before anything is sent instead of
    /// closing the publishing channel on the broker.
    pub max_message_bytes: usize,
    /// How long a delivery whose settlement failed (a retry delay above the
    /// largest bucket, a republish or failure record the broker did not
    /// confirm) is held unacknowledged before it is returned to its queue
    /// (default [`jobrail::REFUSED_SETTLEMENT_HOLD`], 30 s): RabbitMQ has no
    /// lease of its own, and a message handed straight back would be
    /// redelivered at once, again and again. Reported as
    /// [`Capabilities::refused_hold`](crate::Capabilities::refused_hold). It
    /// keeps a prefetch slot while held; a closed channel returns it sooner.
    pub refused_hold: Duration,
    /// How long acks wait behind a delivery still running (lower in the
    /// channel's tag order) to be merged with it into one
    /// `basic.ack multiple=true`, counted from when that delivery was
    /// handed out (default 5 ms). Past it, they are written one by one,
    /// so a slow handler holds back the others' acks by at most this much;
    /// closing the subscription or stopping the driver writes them at once.
    /// See the module documentation, "Ack runs".
    pub ack_gap_wait: Duration,
    /// The connection name shown by the broker (`rabbitmqctl list_connections name`).
    pub connection_name: String,
    /// Extra certificate authorities to trust for `amqps://`, PEM-encoded
    /// (one or more `BEGIN CERTIFICATE` blocks), in addition to the
    /// platform's roots: for a broker whose certificate a private CA signed.
    /// Only with an `amqps://` URL.
    pub ca_certificates: Option<String>,
}

impl RabbitConfig {
    /// Defaults for `url`: the default bucket ladder, `{queue}.failed`.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitConfig {
            url: url.into(),
            delay_buckets: DEFAULT_DELAY_BUCKETS
                .iter()
                .map(|s| Duration::from_secs(*s))
                .collect(),
            failure_queue: Some("{queue}.failed".into()),
            confirm_timeout: Duration::from_secs(10),
            operation_timeout: Duration::from_secs(10),
            max_reconnect_backoff: Duration::from_secs(5),
            heartbeat: DEFAULT_HEARTBEAT,
            delivery_limit: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            consumer_timeout: Duration::from_secs(30 * 60),
            refused_hold: jobrail::REFUSED_SETTLEMENT_HOLD,
            ack_gap_wait: super::acks::GAP_WAIT,
            connection_name: "jobrail-native".into(),
            ca_certificates: None,
        }
    }

    /// Replaces the delay buckets.
    pub fn delay_buckets(mut self, buckets: impl IntoIterator<Item = Duration>) -> Self {
        self.delay_buckets = buckets.into_iter().collect();
        self
    }

    /// Trusts the certificate authorities in `pem` too (see
    /// [`ca_certificates`](Self::ca_certificates)).
    pub fn ca_certificates(mut self, pem: impl Into<String>) -> Self {
        self.ca_certificates = Some(pem.into());
        self
    }

    /// Replaces the failure queue pattern (`None`: no failure queue).
    pub fn failure_queue(mut self, pattern: Option<&str>) -> Self {
        self.failure_queue = pattern.map(str::to_string);
        self
    }

    /// The URL the connection opens: [`url`](Self::url) with
    /// `heartbeat=` added from [`heartbeat`](Self::heartbeat) unless the URL
    /// has one (or the heartbeat is zero).
    pub(super) fn connect_url(&self) -> String {
        let has_query = self.url.contains('?');
        if self.heartbeat.is_zero() || self.url.contains("heartbeat=") {
            return self.url.clone();
        }
        let separator = if has_query { '&' } else { '?' };
        format!(
            "{}{separator}heartbeat={}",
            self.url,
            self.heartbeat.as_secs()
        )
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    pub(super) fn validate(&mut self) -> Result<(), DriverError> {
        let scheme = self
            .url
            .split("://")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        if let Some(pem) = &self.ca_certificates {
            if scheme != "amqps" {
                return Err(config_error(format!(
                    "CA certificates are set but `{}` does not use TLS: use an amqps:// URL",
                    self.redacted_url()
                )));
            }
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(config_error(
                    "ca_certificates holds no PEM certificate (no `-----BEGIN CERTIFICATE-----` block)",
                ));
            }
        }
        match scheme.as_str() {
            "amqp" => {}
            "amqps" if cfg!(feature = "rabbitmq-tls") => {}
            "amqps" => {
                return Err(config_error(format!(
                    "`{}` needs TLS: enable the `rabbitmq-tls` feature of jobrail-native",
                    self.redacted_url()
                )))
            }
            _ => {
                return Err(config_error(format!(
                    "`{}` is not an amqp:// or amqps:// URL",
                    self.redacted_url()
                )))
            }
        }
        self.url.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            // The parser's message may quote the URL: do not pass it on.
            let _ = e;
            config_error(format!("`{}` is not a valid AMQP URL", self.redacted_url()))
        })?;
        if self.heartbeat.subsec_nanos() != 0 || self.heartbeat.as_secs() > u64::from(u16::MAX) {
            return Err(config_error(format!(
                "heartbeat must be a whole number of seconds up to {} s (zero: the broker's), not {:?}",
                u16::MAX,
                self.heartbeat
            )));
        }
        if self.delay_buckets.is_empty() {
            return Err(config_error("at least one delay bucket is required"));
        }
        self.delay_buckets.sort();
        self.delay_buckets.dedup();
        for bucket in &self.delay_buckets {
            if bucket.is_zero()
                || bucket.subsec_nanos() % 1_000_000 != 0
                || bucket.as_millis() > u128::from(u32::MAX)
            {
                return Err(config_error(format!(
                    "delay bucket {bucket:?} must be a whole number of milliseconds between 1 ms and {} ms",
                    u32::MAX
                )));
            }
        }
        if let Some(pattern) = &self.failure_queue {
            if !pattern.contains("{queue}") {
                return Err(config_error(format!(
                    "failure queue pattern `{pattern}` must contain `{{queue}}` (one failure queue per work queue)"
                )));
            }
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > 536_870_912 {
            return Err(config_error(format!(
                "max_message_bytes {} must be between 1 and 536,870,912 (512 MiB, RabbitMQ's largest \
                 max_message_size); set it to the broker's max_message_size",
                self.max_message_bytes
            )));
        }
        if self.consumer_timeout <= super::CONSUMER_TIMEOUT_MARGIN {
            return Err(config_error(format!(
                "consumer_timeout {:?} leaves no time for a handler: it must exceed {:?} (and equal the \
                 broker's consumer_timeout setting)",
                self.consumer_timeout,
                super::CONSUMER_TIMEOUT_MARGIN
            )));
        }
        if self.confirm_timeout.is_zero() || self.operation_timeout.is_zero() {
            return Err(config_error("timeouts must be positive"));
        }
        if self.refused_hold.is_zero() {
            return Err(config_error(
                "refused_hold must be positive: a delivery whose settlement failed would come back at \
                 once, again and again",
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &self.redacted_url())
            .field("delay_buckets", &self.delay_buckets)
            .field("failure_queue", &self.failure_queue)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("max_reconnect_backoff", &self.max_reconnect_backoff)
            .field("heartbeat", &self.heartbeat)
            .field("delivery_limit", &self.delivery_limit)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("consumer_timeout", &self.consumer_timeout)
            .field("refused_hold", &self.refused_hold)
            .field("ack_gap_wait", &self.ack_gap_wait)
            .field("connection_name", &self.connection_name)
            .field(
                "ca_certificates",
                &self.ca_certificates.as_ref().map(|pem| {
                    format!(
                        "{} certificate(s)",
                        pem.matches("BEGIN CERTIFICATE").count()
                    )
                }),
            )
            .finish()
    }
}

/// `scheme://user:secret@host/...` -> `scheme://user:***@host/...`.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparseable URL>".into();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{tail}")
            } else {
                format!("{scheme}://{user}@{host}{tail}")
            }
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heartbeat_goes_into_the_url_unless_it_names_one() {
        let config = RabbitConfig::new("amqp://u:p@host:5672/%2f");
        assert_eq!(
            config.connect_url(),
            "amqp://u:p@host:5672/%2f?heartbeat=10"
        );
        let mut config = RabbitConfig::new("amqp://host/%2f?frame_max=8192");
        config.heartbeat = Duration::from_secs(3);
        assert_eq!(
            config.connect_url(),
            "amqp://host/%2f?frame_max=8192&heartbeat=3"
        );
        let config = RabbitConfig::new("amqp://host/%2f?heartbeat=30");
        assert_eq!(config.connect_url(), "amqp://host/%2f?heartbeat=30");
        let mut config = RabbitConfig::new("amqp://host/%2f");
        config.heartbeat = Duration::ZERO;
        assert_eq!(config.connect_url(), "amqp://host/%2f");
    }

    #[test]
    fn a_heartbeat_not_in_whole_seconds_is_refused() {
        for bad in [Duration::from_millis(1500), Duration::from_secs(70_000)] {
            let mut config = RabbitConfig::new("amqp://host/%2f");
            config.heartbeat = bad;
            let err = config.validate().unwrap_err();
            assert_eq!(err.kind(), crate::ErrorKind::Config);
            assert!(err.to_string().contains("heartbeat"), "{err}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqps://u:p@ss@host"), "amqps://u:***@host");
        assert_eq!(redact("amqp://host:5672"), "amqp://host:5672");
        let config = RabbitConfig::new("amqp://guest:s3cret@localhost/%2f");
        assert!(!format!("{config:?}").contains("s3cret"));
    }

    #[test]
    fn validation() {
        let mut c = RabbitConfig::new("amqp://guest:guest@localhost/%2f").delay_buckets([
            Duration::from_secs(5),
            Duration::from_secs(1),
            Duration::from_secs(5),
        ]);
        c.validate().unwrap();
        assert_eq!(
            c.delay_buckets,
            [Duration::from_secs(1), Duration::from_secs(5)]
        );
        // A low delivery limit is the consumer's to refuse, against the
        // registry's own jobs (jobrail::check_delivery_limit).
        let mut c = RabbitConfig {
            delivery_limit: Some(3),
            ..RabbitConfig::new("amqp://localhost")
        };
        c.validate().unwrap();
        let mut c = RabbitConfig::new("http://localhost");
        assert!(c.validate().is_err());
        let mut c = RabbitConfig::new("amqp://localhost").delay_buckets([]);
        assert!(c.validate().is_err());
        let mut c =
            RabbitConfig::new("amqp://localhost").delay_buckets([Duration::from_micros(1500)]);
        assert!(c.validate().is_err());
    }

    #[test]
    fn ca_certificates_need_tls_and_a_certificate() {
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let mut c = RabbitConfig::new("amqp://u:secret@localhost").ca_certificates(pem);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("amqps://"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let mut c = RabbitConfig::new("amqps://localhost").ca_certificates("not a certificate");
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("no PEM certificate"), "{err}");
        let c = RabbitConfig::new("amqps://localhost").ca_certificates(pem);
        assert!(format!("{c:?}").contains("1 certificate(s)"));
    }
}
