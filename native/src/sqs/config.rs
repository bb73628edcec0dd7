//! Settings for the SQS driver: the configuration, where its credentials
//! come from, and their validation.
//!
//! Credentials are described with the driver's own types ([`SqsKeys`],
//! [`SqsCredentialSource`]) rather than the AWS SDK's, so the public API
//! does not change when the SDK does; the driver hands them to the SDK.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::errors::config_error;
use super::MAX_VISIBILITY;
use crate::driver::DriverError;

/// Where the driver's AWS credentials come from. `Debug` never shows a key.
#[derive(Clone)]
#[non_exhaustive]
pub enum SqsCredentials {
    /// Fixed keys (for an emulator, or keys loaded by the application).
    Static {
        /// The access key id.
        access_key_id: String,
        /// The secret access key.
        secret_access_key: String,
        /// A session token, for temporary credentials.
        session_token: Option<String>,
    },
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, if set,
    /// `AWS_SESSION_TOKEN`, read when the driver is created (the default).
    Environment,
    /// Keys fetched, and fetched again before they expire, from an
    /// [`SqsCredentialSource`]: temporary credentials from a role, a
    /// secrets store, or any provider of the AWS SDK wrapped in a few lines
    /// (see [`SqsCredentialSource`]). Build it with
    /// [`SqsCredentials::source`].
    Source(Arc<dyn SqsCredentialSource>),
}

impl SqsCredentials {
    /// Fixed keys without a session token.
    pub fn fixed(access_key_id: impl Into<String>, secret_access_key: impl Into<String>) -> Self {
        SqsCredentials::Static {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
        }
    }

    /// Keys from `source`, asked when the driver needs them (see
    /// [`SqsCredentialSource`]).
    pub fn source(source: impl SqsCredentialSource + 'static) -> Self {
        SqsCredentials::Source(Arc::new(source))
    }
}

impl fmt::Debug for SqsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SqsCredentials::Static { session_token, .. } => f
                .debug_struct("Static")
                .field("access_key_id", &"***")
                .field("secret_access_key", &"***")
                .field("session_token", &session_token.as_ref().map(|_| "***"))
                .finish(),
            SqsCredentials::Environment => f.write_str("Environment"),
            // The source's own `Debug` may hold keys: it is not shown.
            SqsCredentials::Source(_) => f.write_str("Source(..)"),
        }
    }
}

/// One set of AWS keys, as an [`SqsCredentialSource`] returns them.
///
/// `Debug` shows the access key id (an identifier, as AWS's own tools show
/// it) and the expiry, never the secret key or the session token.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqsKeys {
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// A session token, for temporary credentials.
    pub session_token: Option<String>,
    /// When the keys stop working, for temporary credentials. The driver
    /// asks its source again shortly before then. `None`: the keys do not
    /// expire, and the source is asked again every 15 minutes.
    pub expires_at: Option<SystemTime>,
}

impl SqsKeys {
    /// Keys without a session token or an expiry.
    pub fn new(access_key_id: impl Into<String>, secret_access_key: impl Into<String>) -> Self {
        SqsKeys {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
            expires_at: None,
        }
    }

    /// Adds a session token.
    pub fn session_token(mut self, token: impl Into<String>) -> Self {
        self.session_token = Some(token.into());
        self
    }

    /// Adds an expiry.
    pub fn expires_at(mut self, when: SystemTime) -> Self {
        self.expires_at = Some(when);
        self
    }
}

impl fmt::Debug for SqsKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsKeys")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"***")
            .field("session_token", &self.session_token.as_ref().map(|_| "***"))
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Where [`SqsCredentials::Source`] gets its keys: implement it to fetch
/// keys from a role, a secrets store, or a provider of the AWS SDK.
///
/// The driver calls [`keys`](Self::keys) before its first request and
/// reuses the keys until shortly (10 seconds or so) before their
/// [`expires_at`](SqsKeys::expires_at), or for 15 minutes when they have no
/// expiry; then the next request asks again. Nothing is kept from a call
/// that failed: the next request asks again.
///
/// A call that fails fails the request that needed the keys, which is not
/// sent, with the source's error kept in its cause chain (reach it with
/// [`DriverError::find`]): [`SqsDriver::connect`](super::SqsDriver::connect)
/// fails with [`ErrorKind::Config`](crate::ErrorKind::Config), as for
/// credentials SQS refuses, and a dispatch with
/// [`ErrorKind::NotAccepted`](crate::ErrorKind::NotAccepted). A call has 5
/// seconds (the SDK's limit): a slower one fails the request as an endpoint
/// that does not answer would ([`ErrorKind::Connection`](crate::ErrorKind::Connection)
/// from `connect`, possibly [`ErrorKind::Uncertain`](crate::ErrorKind::Uncertain)
/// from a dispatch).
///
/// # Example
///
/// Keys loaded from somewhere the application knows (a secrets store...):
///
/// ```
/// use async_trait::async_trait;
/// use jobrail_native::sqs::{SqsCredentialSource, SqsKeys};
/// use jobrail_native::sqs::{SqsConfig, SqsCredentials};
///
/// #[derive(Debug)]
/// struct Vault;
///
/// #[async_trait]
/// impl SqsCredentialSource for Vault {
///     async fn keys(&self) -> Result<SqsKeys, jobrail::BoxError> {
///         // Fetch them here; they may carry a session token and an expiry.
///         Ok(SqsKeys::new("AKIDEXAMPLE", "secret").session_token("token"))
///     }
/// }
///
/// let config = SqsConfig::new("eu-west-1").credentials(SqsCredentials::source(Vault));
/// ```
///
/// The default chain of the `aws-config` crate (profiles, SSO, instance
/// and container roles) fits the same way: keep its
/// `SharedCredentialsProvider` in the source, and in `keys` call its
/// `provide_credentials().await?` and copy the access key id, secret,
/// session token and expiry into an [`SqsKeys`].
#[async_trait]
pub trait SqsCredentialSource: Send + Sync + fmt::Debug {
    /// Fresh keys, or why there are none.
    async fn keys(&self) -> Result<SqsKeys, jobrail::BoxError>;
}

/// Settings for [`SqsDriver`](super::SqsDriver).
///
/// There is no setting for the attempt caps: a work queue's redrive policy
/// is read from SQS, and a consumer checks its `maxReceiveCount` against
/// the registry's own jobs when it starts, naming the job that needs more
/// (see the [module documentation](super#delivery-limit)).
///
/// `Debug` never shows credentials.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use jobrail_native::sqs::{SqsConfig, SqsCredentials, SqsDriver};
///
/// let config = SqsConfig::new("us-east-1")
///     // An emulator or a VPC endpoint; without it, AWS's endpoint for the region.
///     .endpoint("http://127.0.0.1:4517")
///     .credentials(SqsCredentials::fixed("test", "test"))
///     .visibility_timeout(Duration::from_secs(60))
///     .failure_queue(Some("{queue}-failed"));
/// // `new` checks the settings and makes no request.
/// let _driver = SqsDriver::new(config)?;
///
/// // Visibility timeouts are whole seconds from 1 s to 12 h.
/// let bad = SqsConfig::new("us-east-1")
///     .credentials(SqsCredentials::fixed("test", "test"))
///     .visibility_timeout(Duration::from_millis(1500));
/// assert!(SqsDriver::new(bad).is_err());
/// # Ok::<(), jobrail_native::DriverError>(())
/// ```
#[derive(Clone, Debug)]
pub struct SqsConfig {
    /// The region (`us-east-1`...).
    pub region: String,
    /// An endpoint replacing the region's (an emulator such as
    /// `http://127.0.0.1:4517`, or a VPC endpoint). `None`: AWS's endpoint
    /// for [`region`](Self::region).
    pub endpoint: Option<String>,
    /// Where the credentials come from (default: the environment).
    pub credentials: SqsCredentials,
    /// How long a received message stays invisible to other consumers. Every
    /// receive asks for it, and the driver renews it every half of it while a
    /// handler runs (never past 12 h after the receive). A whole number of
    /// seconds, 1 s to 12 h; default 30 s. It is also how long a message
    /// retried without a delay, rejected, or whose settlement failed waits
    /// before it is delivered again, at most.
    pub visibility_timeout: Duration,
    /// Long-polling wait of each `ReceiveMessage` call: a whole number of
    /// seconds, 0 to 20 s; default 20 s.
    pub wait_time: Duration,
    /// Whether missing work and failure queues are created (standard queues,
    /// with [`visibility_timeout`](Self::visibility_timeout); failure queues
    /// keep messages 14 days). Default `true`. When `false`, a missing queue
    /// is an [`ErrorKind::Config`](crate::ErrorKind::Config) error.
    pub create_queues: bool,
    /// The failure queue for a work queue, `{queue}` replaced by the work
    /// queue's name (default `{queue}-failed`). `None`: terminal failures are
    /// logged at error level and deleted.
    pub failure_queue: Option<String>,
    /// Bound on every request (a receive gets the wait time on top). A send
    /// that does not finish within it is reported as uncertain.
    pub operation_timeout: Duration,
    /// The longest dispatch delay one message carries (`DelaySeconds`): a
    /// whole number of seconds, 1 s to SQS's 900 s (the default). A longer
    /// delay is carried in steps of this much
    /// ([`Capabilities::max_dispatch_delay`](crate::Capabilities::max_dispatch_delay)):
    /// 96 messages per day of delay at 900 s. Shorter steps are for tests.
    pub max_dispatch_delay: Duration,
}

impl SqsConfig {
    /// Defaults for `region`, credentials from the environment.
    pub fn new(region: impl Into<String>) -> Self {
        SqsConfig {
            region: region.into(),
            endpoint: None,
            credentials: SqsCredentials::Environment,
            visibility_timeout: Duration::from_secs(30),
            wait_time: Duration::from_secs(20),
            create_queues: true,
            failure_queue: Some("{queue}-failed".into()),
            operation_timeout: Duration::from_secs(10),
            max_dispatch_delay: Duration::from_secs(super::MAX_DELAY_SECONDS),
        }
    }

    /// Replaces the endpoint.
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.endpoint = Some(url.into());
        self
    }

    /// Replaces the credentials.
    pub fn credentials(mut self, credentials: SqsCredentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// Replaces the visibility timeout.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        self.visibility_timeout = timeout;
        self
    }

    /// Replaces the long-polling wait.
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = wait;
        self
    }

    /// Replaces the longest dispatch delay one message carries.
    pub fn max_dispatch_delay(mut self, max: Duration) -> Self {
        self.max_dispatch_delay = max;
        self
    }

    /// Replaces the failure queue pattern (`None`: no failure queue).
    pub fn failure_queue(mut self, pattern: Option<&str>) -> Self {
        self.failure_queue = pattern.map(str::to_string);
        self
    }

    pub(super) fn validate(&self) -> Result<(), DriverError> {
        let whole = |d: Duration| d.subsec_nanos() == 0;
        if !whole(self.visibility_timeout)
            || self.visibility_timeout.is_zero()
            || self.visibility_timeout > MAX_VISIBILITY
        {
            return Err(config_error(format!(
                "visibility timeout {:?} must be a whole number of seconds between 1 s and 12 h",
                self.visibility_timeout
            )));
        }
        if !whole(self.wait_time) || self.wait_time > Duration::from_secs(20) {
            return Err(config_error(format!(
                "wait time {:?} must be a whole number of seconds between 0 and 20 s",
                self.wait_time
            )));
        }
        if self.region.is_empty() {
            return Err(config_error("a region is required (us-east-1...)"));
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(config_error(format!(
                    "endpoint `{endpoint}` must be an http:// or https:// URL"
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
        if !whole(self.max_dispatch_delay)
            || self.max_dispatch_delay.is_zero()
            || self.max_dispatch_delay > Duration::from_secs(super::MAX_DELAY_SECONDS)
        {
            return Err(config_error(format!(
                "max dispatch delay {:?} must be a whole number of seconds between 1 s and {} s",
                self.max_dispatch_delay,
                super::MAX_DELAY_SECONDS
            )));
        }
        if self.operation_timeout.is_zero() {
            return Err(config_error("the operation timeout must be positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_never_shown() {
        let config = SqsConfig::new("us-east-1").credentials(SqsCredentials::Static {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "s3cret".into(),
            session_token: Some("t0ken".into()),
        });
        let shown = format!("{config:?}");
        for secret in ["AKIDEXAMPLE", "s3cret", "t0ken"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }

    #[test]
    fn validation() {
        SqsConfig::new("us-east-1").validate().unwrap();
        let bad = [
            SqsConfig::new("us-east-1").visibility_timeout(Duration::from_millis(1500)),
            SqsConfig::new("us-east-1").visibility_timeout(Duration::ZERO),
            SqsConfig::new("us-east-1").visibility_timeout(Duration::from_secs(43_201)),
            SqsConfig::new("us-east-1").wait_time(Duration::from_secs(21)),
            SqsConfig::new("us-east-1").failure_queue(Some("failures")),
            SqsConfig::new("us-east-1").endpoint("127.0.0.1:4517"),
            SqsConfig::new(""),
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
