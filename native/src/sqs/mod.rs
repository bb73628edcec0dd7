//! The Amazon SQS driver (feature `sqs`), on aws-sdk-sqs with tokio.
//!
//! # Queues
//!
//! A facade queue `Q` is the SQS queue named `Q` in the configured region
//! (or at the configured endpoint). Its failure queue is `Q-failed` unless
//! [`SqsConfig::failure_queue`] says otherwise. Both are resolved on the
//! first `send` or `subscribe` (`GetQueueUrl`) and, with
//! [`create_queues`](SqsConfig::create_queues) (the default), created if
//! missing: standard queues (FIFO queues are not supported), the work queue
//! with the configured visibility timeout, the failure queue with the
//! longest retention (14 days).
//!
//! SQS queue names are 1 to 80 characters among `A-Z a-z 0-9 - _`. The
//! facade also allows `.`: such a name is refused with
//! [`ErrorKind::Config`] rather than mapped, since a mapping (`.` to `-`)
//! could make two facade queues share one SQS queue.
//!
//! A work queue with a redrive policy (`RedrivePolicy`, native dead-lettering)
//! whose `maxReceiveCount` is below [`SqsConfig::largest_attempt_cap`] plus
//! one ([`queue::deliveries_needed`]: the extra receive is the one on which
//! the facade records a message that crashed its worker every time) is
//! refused with [`ErrorKind::Config`]: SQS would move a message to its
//! dead-letter queue before the facade ends it.
//!
//! # Dispatch
//!
//! `SendMessage`. SQS bodies are text with a restricted character set; a
//! body that is not such text (bytes that are not UTF-8, control
//! characters) travels base64-encoded, marked by the message attribute
//! [`ENCODING_ATTRIBUTE`] = `base64`, and is decoded on receipt. A delay is
//! SQS's `DelaySeconds`, rounded up to whole seconds (never shortened); a
//! delay above 900 s is refused with [`ErrorKind::Unsupported`]. A request
//! that fails before it is sent (invalid input, no connection) or that SQS
//! answers with an error (a queue that does not exist...) is
//! [`ErrorKind::NotAccepted`]; one that fails after it may have been sent
//! (connection lost, no answer within
//! [`operation_timeout`](SqsConfig::operation_timeout), unreadable answer)
//! is [`ErrorKind::Uncertain`]. The SDK's standard retries apply first.
//!
//! # Consumption
//!
//! A subscription long-polls `ReceiveMessage` (wait
//! [`wait_time`](SqsConfig::wait_time), at most `min(prefetch, 10)`
//! messages, visibility [`visibility_timeout`](SqsConfig::visibility_timeout))
//! only when the consumer asks for a delivery, and buffers what one call
//! returned. The call runs in its own task, so `next()` is cancel-safe: a
//! dropped `next()` leaves the call and its messages to the next `next()`.
//!
//! # Attempts
//!
//! The attempt is SQS's `ApproximateReceiveCount`, which rises on every
//! receive, including after a crash or a lost connection, plus the message
//! attribute [`ATTEMPTS_ATTRIBUTE`] (`queue-attempts`, Number, 0 when
//! absent). That attribute is set only on the copy a graceful shutdown sends
//! (see below): it carries the receives the message consumed before that
//! copy, since a new message starts its receive count afresh. A second
//! attribute, [`SHUTDOWNS_ATTRIBUTE`] (`queue-shutdowns`, Number), counts the
//! deliveries a graceful shutdown handed back
//! ([`Delivery::shutdown_returns`](crate::Delivery::shutdown_returns)): they
//! do not consume the job's cap, while a crash (no settlement, so only the
//! receive count rises) does.
//!
//! # Leases
//!
//! From the moment a message is received, a background task extends its
//! visibility (`ChangeMessageVisibility` to the visibility timeout) every
//! half visibility timeout, never past 12 hours after the receive (SQS's
//! cap), so a handler longer than the visibility timeout is not delivered
//! twice. The renewal stops when the delivery is settled or dropped.
//! [`Delivery::deadline`](crate::Delivery::deadline) reports the 12-hour
//! limit. A delivery dropped unsettled (or a message buffered by a dropped
//! subscription) is made visible again at once (`ChangeMessageVisibility`
//! 0, best effort; failing that it comes back when its visibility ends); its
//! receive count has risen.
//!
//! # Settlements
//!
//! - Ack: `DeleteMessage`.
//! - Retry with a delay: `ChangeMessageVisibility` to the delay rounded up to
//!   whole seconds (zero: visible at once). A delay that would end more than
//!   12 hours after the receive is refused with [`ErrorKind::Unsupported`];
//!   the message stays and comes back when its current visibility ends.
//! - Retry without a delay: no request; the message comes back when its
//!   current visibility ends (at most one visibility timeout). These keep
//!   the same message, so its carried attributes stay valid.
//! - Retry from a graceful shutdown (always without delay): `SendMessage` of
//!   a copy (same body and encoding) to the work queue with
//!   `queue-attempts` = this delivery's attempt and `queue-shutdowns`
//!   incremented, then `DeleteMessage` of the original: SQS cannot change a
//!   message's attributes, and a visibility change would count as a receive.
//!   If the copy is not accepted the error is returned and the original is
//!   left; it comes back when its visibility ends, with a higher receive
//!   count. A crash between the copy and the delete duplicates the message,
//!   never loses it.
//! - Reject: no request; the message comes back when its visibility ends,
//!   and the queue's own redrive policy (if any) decides its fate. SQS has no
//!   way to drop a message other than deleting it.
//! - Fail: `SendMessage` of [`FailureRecord::encode`] to the failure queue,
//!   then `DeleteMessage`. With no failure queue configured the record's
//!   reason is logged at error level and the message deleted. The transfer
//!   and the delete are not atomic: a crash between them duplicates the
//!   record, never loses it.
//!
//! # Credentials
//!
//! Static keys, the standard environment variables, or any
//! credentials provider (see [`SqsCredentials`]). The driver's own `Debug`
//! output, log lines and errors (connection errors included) never show the
//! keys, the session token or a message body. The secret key appears
//! nowhere, not even in the SDK's own logs. The SDK's debug and trace lines
//! (targets `aws_smithy_runtime` and `aws_sigv4`) do show the access key id,
//! and at trace level the session token and request bodies: keep those
//! targets at `info` or above in production.
//!
//! # With the endpoint down
//!
//! A dispatch while nothing answers at the endpoint fails at once (the
//! connection is refused) with [`ErrorKind::NotAccepted`]; an endpoint that
//! accepts connections but never answers is bounded by
//! [`operation_timeout`](SqsConfig::operation_timeout) (default 10 s).

mod config;
mod delivery;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region, StalledStreamProtectionConfig};
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use queue::FailureRecord;
use tokio::sync::watch;
use tracing::warn;

/// The SDK this driver is built on, for tooling and tests that need a
/// request the driver does not make (see [`SqsDriver::client`]).
pub use aws_sdk_sqs;
pub use config::{SqsConfig, SqsCredentials};
use delivery::SqsSubscription;

use crate::driver::{Capabilities, Driver, DriverError, ErrorKind, Outgoing, Subscription};

const NAME: &str = "sqs";

/// The message attribute marking a base64-encoded body (value `base64`).
pub const ENCODING_ATTRIBUTE: &str = "queue-body-encoding";
/// The message attribute (Number) carrying the receives a message consumed
/// before it was sent again by a graceful shutdown.
pub const ATTEMPTS_ATTRIBUTE: &str = "queue-attempts";
/// The message attribute (Number) counting deliveries a graceful shutdown
/// handed back (see [`queue::exceeds_crash_bound`]).
pub const SHUTDOWNS_ATTRIBUTE: &str = "queue-shutdowns";
/// The longest dispatch delay SQS supports, in seconds.
pub const MAX_DELAY_SECONDS: u64 = 900;
/// SQS's cap on a message's invisibility, counted from its receive.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);
/// Retention of created failure queues: SQS's maximum, 14 days.
const FAILURE_RETENTION_SECONDS: u32 = 14 * 24 * 3600;

fn config_error(message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, ErrorKind::Config, message.into())
}

fn error(kind: ErrorKind, message: impl Into<String>) -> DriverError {
    DriverError::new(NAME, kind, message.into())
}

/// Whole seconds, rounding up (never shortening a delay).
fn ceil_seconds(delay: Duration) -> u64 {
    delay.as_secs() + u64::from(delay.subsec_nanos() > 0)
}

/// Whether `name` is a valid standard-queue name.
fn valid_queue_name(name: &str) -> bool {
    (1..=80).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Where an SDK request failed, for choosing an [`ErrorKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Certainly not sent: the request could not be built or no connection
    /// could be made.
    NotSent,
    /// SQS answered with an error: it did not act on the request.
    Refused,
    /// Sent, outcome unknown (connection lost, timeout, unreadable answer).
    Unknown,
}

fn failure_of<E, R>(err: &SdkError<E, R>) -> Failure {
    match err {
        SdkError::ConstructionFailure(_) => Failure::NotSent,
        SdkError::ServiceError(_) => Failure::Refused,
        SdkError::DispatchFailure(dispatch) if dispatch.is_user() => Failure::NotSent,
        SdkError::DispatchFailure(dispatch) if connect_failed(dispatch.as_connector_error()) => {
            Failure::NotSent
        }
        _ => Failure::Unknown,
    }
}

/// Whether the connection itself could not be made (so nothing was sent).
fn connect_failed(connector: Option<&aws_sdk_sqs::error::ConnectorError>) -> bool {
    let Some(connector) = connector else {
        return false;
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(connector);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable
            ) {
                return true;
            }
        }
        // hyper-util's legacy client says `client error (Connect)` when the
        // connection could not be established.
        if e.to_string().contains("(Connect)") {
            return true;
        }
        source = e.source();
    }
    false
}

/// The service error's code (`QueueDoesNotExist`...), if SQS answered.
fn code_of<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Option<&str> {
    match err {
        SdkError::ServiceError(service) => service.err().code(),
        _ => None,
    }
}

fn is_missing_queue<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    matches!(
        code_of(err),
        Some("QueueDoesNotExist" | "AWS.SimpleQueueService.NonExistentQueue" | "NonExistentQueue")
    )
}

/// An SDK error as a driver error: refused or not sent -> `refused`, sent
/// with an unknown outcome -> `unknown`.
fn sdk_error<E, R>(
    what: &str,
    err: SdkError<E, R>,
    refused: ErrorKind,
    unknown: ErrorKind,
) -> DriverError
where
    E: std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    let kind = match failure_of(&err) {
        Failure::NotSent | Failure::Refused => refused,
        Failure::Unknown => unknown,
    };
    error(kind, format!("{what}: {}", chain_text(&err)))
}

/// An error and its sources, `: `-separated (without the raw response the
/// SDK's `Debug` output carries).
fn chain_text(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

/// A request bounded by `limit`; running out of time is `on_timeout`.
async fn bounded<T, E, R>(
    limit: Duration,
    what: &str,
    on_timeout: ErrorKind,
    fut: impl Future<Output = Result<T, SdkError<E, R>>>,
) -> Result<Result<T, SdkError<E, R>>, DriverError> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| error(on_timeout, format!("{what}: no answer within {limit:?}")))
}

/// A body as SQS message text, and whether it had to be base64-encoded.
fn encode_body(body: &[u8]) -> (String, bool) {
    let allowed = |c: char| matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..);
    match std::str::from_utf8(body) {
        Ok(text) if !text.is_empty() && text.chars().all(allowed) => (text.to_string(), false),
        _ => (aws_smithy_types::base64::encode(body), true),
    }
}

/// The original bytes of a received body.
fn decode_body(text: &str, base64: bool) -> Vec<u8> {
    if base64 {
        match aws_smithy_types::base64::decode(text) {
            Ok(bytes) => return bytes,
            Err(e) => warn!("a body marked base64 does not decode ({e}); passing it on as is"),
        }
    }
    text.as_bytes().to_vec()
}

pub(crate) struct Inner {
    config: SqsConfig,
    client: Client,
    /// Queue name -> URL.
    urls: Mutex<HashMap<String, String>>,
    /// Queues this driver created.
    created: Mutex<BTreeSet<String>>,
    stopped: watch::Sender<bool>,
}

/// The SQS driver. Clones share one client.
///
/// See the [module documentation](self) for the mapping and guarantees.
#[derive(Clone)]
pub struct SqsDriver {
    inner: Arc<Inner>,
}

impl fmt::Debug for SqsDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsDriver")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Which kind of queue a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Work,
    Failure,
}

impl SqsDriver {
    /// A driver with `config`; makes no request. Fails with
    /// [`ErrorKind::Config`] on an invalid configuration or, for
    /// [`SqsCredentials::Environment`], missing variables.
    pub fn new(config: SqsConfig) -> Result<Self, DriverError> {
        config.validate()?;
        let credentials = match &config.credentials {
            SqsCredentials::Static {
                access_key_id,
                secret_access_key,
                session_token,
            } => aws_sdk_sqs::config::SharedCredentialsProvider::new(Credentials::new(
                access_key_id,
                secret_access_key,
                session_token.clone(),
                None,
                "queue-native static",
            )),
            SqsCredentials::Environment => {
                let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
                let (Some(id), Some(secret)) =
                    (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"))
                else {
                    return Err(config_error(
                        "credentials from the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set \
                         (or configure static credentials or a provider)",
                    ));
                };
                aws_sdk_sqs::config::SharedCredentialsProvider::new(Credentials::new(
                    id,
                    secret,
                    var("AWS_SESSION_TOKEN"),
                    None,
                    "queue-native environment",
                ))
            }
            SqsCredentials::Provider(provider) => provider.clone(),
        };
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let timeouts = aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
            .connect_timeout(config.operation_timeout)
            .build();
        let mut builder = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(config.region.clone()))
            .credentials_provider(credentials)
            .http_client(http)
            .timeout_config(timeouts)
            // Every request is bounded by the driver; a long poll sends no
            // bytes for up to 20 s by design.
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled());
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint.clone());
        }
        let client = Client::from_conf(builder.build());
        let (stopped, _) = watch::channel(false);
        Ok(SqsDriver {
            inner: Arc::new(Inner {
                config,
                client,
                urls: Mutex::default(),
                created: Mutex::default(),
                stopped,
            }),
        })
    }

    /// A driver with `config` whose endpoint and credentials were checked
    /// now (`ListQueues`): a wrong endpoint is [`ErrorKind::Connection`],
    /// refused credentials [`ErrorKind::Config`].
    pub async fn connect(config: SqsConfig) -> Result<Self, DriverError> {
        let driver = Self::new(config)?;
        let limit = driver.inner.config.operation_timeout;
        let listed = bounded(
            limit,
            "ListQueues",
            ErrorKind::Connection,
            driver
                .inner
                .client
                .list_queues()
                .queue_name_prefix("queue-native-probe")
                .max_results(1)
                .send(),
        )
        .await?;
        // Refused by the service (credentials, region) or impossible to
        // build: the settings are wrong. Not sent for want of a connection,
        // or no answer: the endpoint is down or unreachable, a connection
        // error the caller may retry.
        listed.map_err(|e| {
            let kind = match &e {
                SdkError::ConstructionFailure(_) | SdkError::ServiceError(_) => ErrorKind::Config,
                _ => ErrorKind::Connection,
            };
            sdk_error("ListQueues", e, kind, kind)
        })?;
        Ok(driver)
    }

    /// The configuration in force.
    pub fn config(&self) -> &SqsConfig {
        &self.inner.config
    }

    /// The SDK client (for requests the driver does not make: queue
    /// attributes, purges...).
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The failure queue of `queue`, if failure queues are configured.
    pub fn failure_queue_name(&self, queue: &str) -> Option<String> {
        self.inner
            .config
            .failure_queue
            .as_ref()
            .map(|p| p.replace("{queue}", queue))
    }

    fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_stopped(&self) -> bool {
        *self.inner.stopped.borrow()
    }

    fn check_running(&self) -> Result<(), DriverError> {
        if self.is_stopped() {
            Err(error(ErrorKind::Stopped, "the sqs driver has been stopped"))
        } else {
            Ok(())
        }
    }

    fn check_name(name: &str) -> Result<(), DriverError> {
        if valid_queue_name(name) {
            Ok(())
        } else {
            Err(config_error(format!(
                "`{name}` is not a valid SQS queue name: 1 to 80 characters among A-Z, a-z, 0-9, `-` and `_` \
                 (SQS has no `.` in standard queue names, and FIFO queues are not supported)"
            )))
        }
    }

    /// Forgets a queue's URL (after SQS said it does not exist).
    fn forget(&self, name: &str) {
        Self::lock(&self.inner.urls).remove(name);
    }

    /// The URL of `name`, creating the queue if configured to. A work queue's
    /// redrive policy is checked against the largest attempt cap.
    async fn queue_url(&self, name: &str, role: Role) -> Result<String, DriverError> {
        if let Some(url) = Self::lock(&self.inner.urls).get(name) {
            return Ok(url.clone());
        }
        Self::check_name(name)?;
        let url = match self.lookup(name).await? {
            Some(url) => url,
            None if self.inner.config.create_queues => self.create(name, role).await?,
            None => {
                return Err(config_error(format!(
                "queue `{name}` does not exist and the driver is configured not to create queues"
            )))
            }
        };
        if role == Role::Work {
            self.check_redrive(name, &url).await?;
        }
        Self::lock(&self.inner.urls).insert(name.to_string(), url.clone());
        Ok(url)
    }

    /// `GetQueueUrl`; `None` if the queue does not exist.
    async fn lookup(&self, name: &str) -> Result<Option<String>, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let what = format!("GetQueueUrl `{name}`");
        let answer = bounded(
            limit,
            &what,
            ErrorKind::Connection,
            self.inner.client.get_queue_url().queue_name(name).send(),
        )
        .await?;
        match answer {
            Ok(out) => Ok(out.queue_url().map(str::to_string)),
            Err(e) if is_missing_queue(&e) => Ok(None),
            Err(e) => Err(sdk_error(
                &what,
                e,
                ErrorKind::Connection,
                ErrorKind::Connection,
            )),
        }
    }

    async fn create(&self, name: &str, role: Role) -> Result<String, DriverError> {
        let limit = self.inner.config.operation_timeout;
        let what = format!("CreateQueue `{name}`");
        let mut request = self.inner.client.create_queue().queue_name(name);
        request = match role {
            Role::Work => request.attributes(
                QueueAttributeName::VisibilityTimeout,
                self.inner.config.visibility_timeout.as_secs().to_string(),
            ),
            Role::Failure => request.attributes(
                QueueAttributeName::MessageRetentionPeriod,
                FAILURE_RETENTION_SECONDS.to_string(),
            ),
        };
        let answer = bounded(limit, &what, ErrorKind::Connection, request.send()).await?;
        match answer {
            Ok(out) => {
                Self::lock(&self.inner.created).insert(name.to_string());
                out.queue_url().map(str::to_string).ok_or_else(|| {
                    error(
                        ErrorKind::Connection,
                        format!("{what}: no URL in the answer"),
                    )
                })
            }
            // Created meanwhile by someone else, with other attributes: use it.
            Err(e)
                if code_of(&e).is_some_and(|c| {
                    c.contains("QueueNameExists") || c.contains("QueueAlreadyExists")
                }) =>
            {
                self.lookup(name).await?.ok_or_else(|| {
                    error(
                        ErrorKind::Connection,
                        format!(
                            "{what}: SQS says the queue exists, yet GetQueueUrl does not find it"
                        ),
                    )
                })
            }
            Err(e) => Err(sdk_error(
                &what,
                e,
                ErrorKind::Config,
                ErrorKind::Connection,
            )),
        }
    }

    /// Refuses a redrive policy that would dead-letter before the facade's cap.
    async fn check_redrive(&self, name: &str, url: &str) -> Result<(), DriverError> {
        let limit = self.inner.config.operation_timeout;
        let what = format!("GetQueueAttributes `{name}`");
        let answer = bounded(
            limit,
            &what,
            ErrorKind::Connection,
            self.inner
                .client
                .get_queue_attributes()
                .queue_url(url)
                .attribute_names(QueueAttributeName::RedrivePolicy)
                .send(),
        )
        .await?
        .map_err(|e| sdk_error(&what, e, ErrorKind::Connection, ErrorKind::Connection))?;
        let Some(policy) = answer
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::RedrivePolicy))
        else {
            return Ok(());
        };
        let parsed: serde_json::Value = serde_json::from_str(policy).map_err(|e| {
            config_error(format!(
                "queue `{name}` has a redrive policy that is not JSON ({e})"
            ))
        })?;
        let max = match &parsed["maxReceiveCount"] {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        };
        let cap = self.inner.config.largest_attempt_cap;
        let needed = u64::from(queue::deliveries_needed(cap, true).unwrap_or(0));
        match max {
            Some(max) if max < needed => Err(config_error(format!(
                "queue `{name}` has a redrive policy with maxReceiveCount {max}, below {needed} (the largest attempt \
                 cap {cap} plus the delivery that records a message which crashed its worker every time): SQS would \
                 move messages to its dead-letter queue before the facade ends them; raise it or remove the policy"
            ))),
            Some(_) => Ok(()),
            None => Err(config_error(format!(
                "queue `{name}` has a redrive policy without a readable maxReceiveCount: {policy}"
            ))),
        }
    }

    /// Resolves (creates) the work queue and its failure queue; returns
    /// their URLs.
    async fn resolve_work(&self, queue: &str) -> Result<(String, Option<String>), DriverError> {
        let url = self.queue_url(queue, Role::Work).await?;
        let failed = match self.failure_queue_name(queue) {
            Some(name) => Some(self.queue_url(&name, Role::Failure).await?),
            None => None,
        };
        Ok((url, failed))
    }

    /// `SendMessage` of `body` to `url` (base64 if needed), with the Number
    /// message attributes `counts`.
    async fn send_body(
        &self,
        queue: &str,
        url: &str,
        body: &[u8],
        delay_seconds: u64,
        counts: &[(&str, u32)],
    ) -> Result<(), DriverError> {
        let (text, base64) = encode_body(body);
        let mut request = self
            .inner
            .client
            .send_message()
            .queue_url(url)
            .message_body(text);
        if delay_seconds > 0 {
            request = request.delay_seconds(delay_seconds as i32);
        }
        let attribute = |data_type: &str, value: String| {
            MessageAttributeValue::builder()
                .data_type(data_type)
                .string_value(value)
                .build()
                .map_err(|e| {
                    error(
                        ErrorKind::NotAccepted,
                        format!("SendMessage to `{queue}`: {e}"),
                    )
                })
        };
        if base64 {
            request = request
                .message_attributes(ENCODING_ATTRIBUTE, attribute("String", "base64".into())?);
        }
        for (name, count) in counts {
            request = request.message_attributes(*name, attribute("Number", count.to_string())?);
        }
        let what = format!("SendMessage to `{queue}`");
        let limit = self.inner.config.operation_timeout;
        match bounded(limit, &what, ErrorKind::Uncertain, request.send()).await? {
            Ok(_) => Ok(()),
            Err(e) => {
                if is_missing_queue(&e) {
                    self.forget(queue);
                }
                Err(sdk_error(
                    &what,
                    e,
                    ErrorKind::NotAccepted,
                    ErrorKind::Uncertain,
                ))
            }
        }
    }

    /// Terminal failure records on `queue`'s failure queue.
    ///
    /// Receives every message (short polls, each message hidden for 30 s
    /// while the others are read), then makes them all visible again, so the
    /// records stay. A concurrent reader of the failure queue can therefore
    /// miss records, and on SQS itself a short poll samples only some
    /// servers: this is a helper for tests and tooling, not an exact count.
    /// Messages that are not failure records are skipped with a warning.
    /// Does not create the failure queue: a missing one has no records.
    pub async fn failure_records(&self, queue: &str) -> Result<Vec<FailureRecord>, DriverError> {
        let Some(failed) = self.failure_queue_name(queue) else {
            return Ok(Vec::new());
        };
        Self::check_name(&failed)?;
        let Some(url) = self.lookup(&failed).await? else {
            return Ok(Vec::new());
        };
        let limit = self.inner.config.operation_timeout;
        let client = &self.inner.client;
        let mut records = Vec::new();
        let mut receipts = Vec::new();
        let result = async {
            loop {
                let out = bounded(
                    limit,
                    "ReceiveMessage (failure records)",
                    ErrorKind::Connection,
                    client
                        .receive_message()
                        .queue_url(&url)
                        .max_number_of_messages(10)
                        .visibility_timeout(30)
                        .wait_time_seconds(0)
                        .message_attribute_names(ENCODING_ATTRIBUTE)
                        .send(),
                )
                .await?
                .map_err(|e| {
                    sdk_error("ReceiveMessage (failure records)", e, ErrorKind::Connection, ErrorKind::Connection)
                })?;
                let messages = out.messages();
                if messages.is_empty() {
                    return Ok::<_, DriverError>(());
                }
                for message in messages {
                    if let Some(receipt) = message.receipt_handle() {
                        receipts.push(receipt.to_string());
                    }
                    let body = decode_body(message.body().unwrap_or_default(), delivery::is_base64(message));
                    match FailureRecord::decode(&body) {
                        Ok(record) => records.push(record),
                        Err(e) => {
                            warn!(queue = %failed, "skipping a message that is not a failure record: {e}")
                        }
                    }
                }
            }
        }
        .await;
        for receipt in receipts {
            let released = bounded(
                limit,
                "ChangeMessageVisibility",
                ErrorKind::Connection,
                client
                    .change_message_visibility()
                    .queue_url(&url)
                    .receipt_handle(receipt)
                    .visibility_timeout(0)
                    .send(),
            )
            .await;
            if !matches!(released, Ok(Ok(_))) {
                warn!(queue = %failed, "a failure record read stays hidden for 30 s: could not make it visible again");
            }
        }
        result.map(|()| records)
    }

    /// Every queue this driver created (work and failure queues).
    pub fn created_queues(&self) -> Vec<String> {
        Self::lock(&self.inner.created).iter().cloned().collect()
    }

    /// Deletes `names` (for tests and tooling), whatever they hold. Names
    /// that do not exist are skipped.
    pub async fn delete_queues(&self, names: &[String]) -> Result<(), DriverError> {
        let limit = self.inner.config.operation_timeout;
        for name in names {
            Self::check_name(name)?;
            self.forget(name);
            let Some(url) = self.lookup(name).await? else {
                continue;
            };
            let what = format!("DeleteQueue `{name}`");
            let answer = bounded(
                limit,
                &what,
                ErrorKind::Connection,
                self.inner.client.delete_queue().queue_url(url).send(),
            )
            .await?;
            match answer {
                Ok(_) => {}
                Err(e) if is_missing_queue(&e) => {}
                Err(e) => {
                    return Err(sdk_error(
                        &what,
                        e,
                        ErrorKind::Connection,
                        ErrorKind::Connection,
                    ))
                }
            }
            Self::lock(&self.inner.created).remove(name);
        }
        Ok(())
    }
}

#[async_trait]
impl Driver for SqsDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_retry_delay: Some(MAX_VISIBILITY),
            delayed_dispatch: true,
            reject_drops: false,
            redelivery_hint: self.inner.config.visibility_timeout,
            counts_abandoned_deliveries: true,
            counts_shutdown_returns: true,
            // SQS's 262,144 bytes count message attributes too: 64 stay free for a retry's counts.
            max_message_bytes: Some(262_144 - 64),
            max_deliveries: None,
        }
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.check_running()?;
        let delay_seconds = message.delay.map(ceil_seconds).unwrap_or(0);
        if delay_seconds > MAX_DELAY_SECONDS {
            return Err(error(
                ErrorKind::Unsupported,
                format!(
                    "dispatch delay {:?} exceeds SQS's maximum of {MAX_DELAY_SECONDS} s",
                    message.delay.unwrap_or_default()
                ),
            ));
        }
        let url = self
            .queue_url(queue, Role::Work)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::Config
                | ErrorKind::Unsupported
                | ErrorKind::Stopped
                | ErrorKind::NotAccepted => e,
                _ => error(ErrorKind::NotAccepted, format!("not sent: {e}")),
            })?;
        self.send_body(queue, &url, &message.body, delay_seconds, &[])
            .await
    }

    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.check_running()?;
        let (url, failure_url) = self.resolve_work(queue).await?;
        Ok(Box::new(SqsSubscription::new(
            self.clone(),
            queue,
            url,
            failure_url,
            prefetch,
        )))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.stopped.send_replace(true);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_queue_name("cf-ack-1234abcd"));
        assert!(valid_queue_name("Work_Queue-2"));
        assert!(valid_queue_name(&"a".repeat(80)));
        assert!(!valid_queue_name(&"a".repeat(81)));
        assert!(!valid_queue_name(""));
        assert!(!valid_queue_name("reports.daily"));
        assert!(!valid_queue_name("jobs.fifo"));
        assert!(!valid_queue_name("with space"));
    }

    #[test]
    fn delays_round_up() {
        assert_eq!(ceil_seconds(Duration::ZERO), 0);
        assert_eq!(ceil_seconds(Duration::from_millis(1)), 1);
        assert_eq!(ceil_seconds(Duration::from_millis(1200)), 2);
        assert_eq!(ceil_seconds(Duration::from_secs(900)), 900);
        assert_eq!(ceil_seconds(Duration::from_nanos(900_000_000_001)), 901);
    }

    #[test]
    fn bodies_round_trip() {
        for body in [
            &b"{\"v\":1}"[..],
            "caf\u{e9} \u{1F600}\n\t".as_bytes(),
            &[0xff, b'{', b'x', 0x00],
            b"nul \0 inside",
            b"",
            "\u{FFFE}".as_bytes(),
        ] {
            let (text, base64) = encode_body(body);
            assert_eq!(decode_body(&text, base64), body, "{body:?}");
        }
        assert!(!encode_body(b"{\"v\":1}").1);
        assert!(encode_body(&[0xff]).1);
        assert!(encode_body(b"a\0b").1);
        assert!(encode_body(b"\x07").1);
    }
}
