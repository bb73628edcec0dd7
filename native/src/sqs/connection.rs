//! The SDK client, the stopped state, and the bound on every request.
//!
//! SQS keeps no connection for the driver to look after: the SDK's HTTP
//! client opens and reuses connections per request, and its standard
//! retries apply to each one. So there is nothing to reconnect; a request
//! made while the endpoint is down fails on its own (see the module docs,
//! "With the endpoint down"), and the next one tries again.

use std::future::Future;
use std::time::Duration;

use aws_sdk_sqs::config::{
    BehaviorVersion, Credentials, Region, SharedCredentialsProvider, StalledStreamProtectionConfig,
};
use aws_sdk_sqs::error::SdkError;
use aws_sdk_sqs::Client;

use super::errors::{config_error, error, probe_error};
use super::{SqsConfig, SqsCredentials, SqsDriver};
use crate::driver::{DriverError, ErrorKind};

/// The SDK client for `config`: its credentials, endpoint and timeouts.
/// Makes no request.
pub(super) fn client(config: &SqsConfig) -> Result<Client, DriverError> {
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
        .credentials_provider(credentials(&config.credentials)?)
        .http_client(http)
        .timeout_config(timeouts)
        // Every request is bounded by the driver; a long poll sends no
        // bytes for up to 20 s by design.
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled());
    if let Some(endpoint) = &config.endpoint {
        builder = builder.endpoint_url(endpoint.clone());
    }
    Ok(Client::from_conf(builder.build()))
}

/// The SDK's credentials provider for `credentials`; the environment is
/// read now.
fn credentials(credentials: &SqsCredentials) -> Result<SharedCredentialsProvider, DriverError> {
    Ok(match credentials {
        SqsCredentials::Static {
            access_key_id,
            secret_access_key,
            session_token,
        } => SharedCredentialsProvider::new(Credentials::new(
            access_key_id,
            secret_access_key,
            session_token.clone(),
            None,
            "queue-native static",
        )),
        SqsCredentials::Environment => {
            let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
            let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"))
            else {
                return Err(config_error(
                    "credentials from the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set \
                     (or configure static credentials or a provider)",
                ));
            };
            SharedCredentialsProvider::new(Credentials::new(
                id,
                secret,
                var("AWS_SESSION_TOKEN"),
                None,
                "queue-native environment",
            ))
        }
        SqsCredentials::Provider(provider) => provider.clone(),
    })
}

/// A request bounded by `limit`; running out of time is `on_timeout`.
pub(super) async fn bounded<T, E, R>(
    limit: Duration,
    what: &str,
    on_timeout: ErrorKind,
    fut: impl Future<Output = Result<T, SdkError<E, R>>>,
) -> Result<Result<T, SdkError<E, R>>, DriverError> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| error(on_timeout, format!("{what}: no answer within {limit:?}")))
}

impl SqsDriver {
    /// Checks the endpoint and the credentials with one `ListQueues`: a
    /// wrong endpoint is [`ErrorKind::Connection`], refused credentials
    /// [`ErrorKind::Config`].
    pub(super) async fn probe(&self) -> Result<(), DriverError> {
        let limit = self.inner.config.operation_timeout;
        let listed = bounded(
            limit,
            "ListQueues",
            ErrorKind::Connection,
            self.inner
                .client
                .list_queues()
                .queue_name_prefix("queue-native-probe")
                .max_results(1)
                .send(),
        )
        .await?;
        listed.map_err(|e| probe_error("ListQueues", e))?;
        Ok(())
    }

    /// Marks the driver stopped: sends and subscriptions are refused,
    /// subscriptions end, renewals stop, and unsettled messages are left to
    /// their visibility timeout.
    pub(super) fn mark_stopped(&self) {
        self.inner.life.stop();
    }
}
