//! The SDK client, the stopped state, and the bound on every request.
//!
//! SQS keeps no connection for the driver to look after: the SDK's HTTP
//! client opens and reuses connections per request, and its standard
//! retries apply to each one. So there is nothing to reconnect; a request
//! made while the endpoint is down fails on its own (see the module docs,
//! "With the endpoint down"), and the next one tries again.
//!
//! Credentials reach the SDK as its own credentials provider: fixed keys for
//! [`SqsCredentials::Static`] and [`SqsCredentials::Environment`], and for
//! [`SqsCredentials::Source`] a private adapter that asks the application's
//! [`SqsCredentialSource`] (the SDK caches the keys and asks again before
//! they expire).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{future, ProvideCredentials};
use aws_sdk_sqs::config::{
    BehaviorVersion, Credentials, Region, SharedCredentialsProvider, StalledStreamProtectionConfig,
};
use aws_sdk_sqs::error::SdkError;
use aws_sdk_sqs::Client;

use super::errors::{config_error, error, probe_error};
use super::{SqsConfig, SqsCredentialSource, SqsCredentials, SqsDriver};
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
            "jobrail-native static",
        )),
        SqsCredentials::Environment => {
            let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
            let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"))
            else {
                return Err(config_error(
                    "credentials from the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set \
                     (or configure static credentials or a credential source)",
                ));
            };
            SharedCredentialsProvider::new(Credentials::new(
                id,
                secret,
                var("AWS_SESSION_TOKEN"),
                None,
                "jobrail-native environment",
            ))
        }
        SqsCredentials::Source(source) => {
            SharedCredentialsProvider::new(FromSource(Arc::clone(source)))
        }
    })
}

/// An [`SqsCredentialSource`] as the SDK's credentials provider. A failed
/// call becomes [`CredentialsError::provider_error`] with the source's error
/// as its cause.
struct FromSource(Arc<dyn SqsCredentialSource>);

/// Not the source's own `Debug`, which may hold keys.
impl fmt::Debug for FromSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SqsCredentialSource(..)")
    }
}

impl ProvideCredentials for FromSource {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            let keys = self
                .0
                .keys()
                .await
                .map_err(CredentialsError::provider_error)?;
            Ok(Credentials::new(
                keys.access_key_id,
                keys.secret_access_key,
                keys.session_token,
                keys.expires_at,
                "jobrail-native source",
            ))
        })
    }
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
                .queue_name_prefix("jobrail-native-probe")
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

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::SystemTime;

    use async_trait::async_trait;

    use super::*;
    use crate::driver::{Driver, Outgoing};
    use crate::sqs::SqsKeys;

    /// A source that counts its calls and hands out fixed keys, then fails
    /// from its call number `fails_from` on.
    #[derive(Debug)]
    struct Counting {
        calls: Arc<AtomicUsize>,
        expires_at: Option<SystemTime>,
        fails_from: usize,
    }

    impl Counting {
        fn new(calls: &Arc<AtomicUsize>) -> Self {
            Counting {
                calls: calls.clone(),
                expires_at: None,
                fails_from: usize::MAX,
            }
        }
    }

    #[async_trait]
    impl SqsCredentialSource for Counting {
        async fn keys(&self) -> Result<SqsKeys, jobrail::BoxError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) + 1 >= self.fails_from {
                return Err(Box::new(Sealed));
            }
            let keys =
                SqsKeys::new("AKIDFROMSOURCE", "source-secret").session_token("source-token");
            Ok(match self.expires_at {
                Some(when) => keys.expires_at(when),
                None => keys,
            })
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("the vault is sealed")]
    struct Sealed;

    /// A stand-in for SQS on loopback: answers `ListQueues`, `GetQueueUrl`
    /// and `SendMessage` (SQS's JSON protocol) and keeps each request's
    /// headers. Returns its URL and the headers seen.
    fn fake_sqs() -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (queue_url, kept) = (format!("{url}/000000000000/jobs"), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let (queue_url, kept) = (queue_url.clone(), kept.clone());
                std::thread::spawn(move || serve(stream.unwrap(), &queue_url, &kept));
            }
        });
        (url, seen)
    }

    /// Answers the requests of one connection until it closes.
    fn serve(stream: TcpStream, queue_url: &str, seen: &Mutex<Vec<String>>) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut writer = stream;
        loop {
            let mut head = String::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                if line == "\r\n" {
                    break;
                }
                head.push_str(&line.to_ascii_lowercase());
            }
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |n| n.trim().parse().unwrap());
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let answer = if head.contains("amazonsqs.getqueueurl") {
                format!(r#"{{"QueueUrl":"{queue_url}"}}"#)
            } else if head.contains("amazonsqs.sendmessage") {
                r#"{"MessageId":"m-1","MD5OfMessageBody":"0"}"#.to_string()
            } else {
                "{}".to_string()
            };
            seen.lock().unwrap().push(head);
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/x-amz-json-1.0\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            writer.write_all(reply.as_bytes()).unwrap();
        }
    }

    fn message() -> Outgoing {
        Outgoing {
            id: "m".into(),
            body: b"{}".to_vec(),
            delay: None,
        }
    }

    #[tokio::test]
    async fn a_source_signs_the_requests() {
        let (url, seen) = fake_sqs();
        let calls = Arc::new(AtomicUsize::new(0));
        let source = Counting::new(&calls);
        let config = SqsConfig::new("us-east-1")
            .endpoint(&url)
            .credentials(SqsCredentials::source(source));
        let driver = SqsDriver::connect(config).await.unwrap();
        driver.send("jobs", message()).await.unwrap();

        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen.len(),
            3,
            "ListQueues, GetQueueUrl, SendMessage: {seen:?}"
        );
        for head in &seen {
            assert!(head.contains("credential=akidfromsource/"), "{head}");
            assert!(
                head.contains("x-amz-security-token: source-token"),
                "{head}"
            );
        }
        // Keys without an expiry are kept (15 minutes) between requests.
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_source_is_asked_again_when_its_keys_expire() {
        let (url, _) = fake_sqs();
        let calls = Arc::new(AtomicUsize::new(0));
        // Already within the SDK's margin before expiry: asked for each request.
        let source = Counting {
            expires_at: Some(SystemTime::now() + Duration::from_secs(1)),
            ..Counting::new(&calls)
        };
        let config = SqsConfig::new("us-east-1")
            .endpoint(&url)
            .credentials(SqsCredentials::source(source));
        let driver = SqsDriver::connect(config).await.unwrap();
        driver.send("jobs", message()).await.unwrap();
        assert!(calls.load(Ordering::SeqCst) >= 2, "{calls:?}");
    }

    #[tokio::test]
    async fn a_failing_source_fails_connect() {
        // Nothing listens there: a request that reached it would be a
        // connection error, not a credentials one.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let source = Counting {
            fails_from: 1,
            ..Counting::new(&Arc::default())
        };
        let config = SqsConfig::new("us-east-1")
            .endpoint(&url)
            .credentials(SqsCredentials::source(source));

        let err = SqsDriver::connect(config).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config, "{err}");
        assert!(err.find::<Sealed>().is_some(), "{err:?}");
        assert!(err.find::<CredentialsError>().is_some(), "{err:?}");
        assert!(err.to_string().contains("the vault is sealed"), "{err}");
    }

    #[tokio::test]
    async fn a_send_without_keys_is_not_accepted() {
        let (url, seen) = fake_sqs();
        let calls = Arc::new(AtomicUsize::new(0));
        // Asked for every request (the keys are about to expire): keys for
        // ListQueues and GetQueueUrl, none for SendMessage.
        let source = Counting {
            expires_at: Some(SystemTime::now() + Duration::from_secs(1)),
            fails_from: 3,
            ..Counting::new(&calls)
        };
        let config = SqsConfig::new("us-east-1")
            .endpoint(&url)
            .credentials(SqsCredentials::source(source));
        let driver = SqsDriver::connect(config).await.unwrap();

        let err = driver.send("jobs", message()).await.unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        let seen = seen.lock().unwrap().clone();
        assert!(
            !seen
                .iter()
                .any(|head| head.contains("amazonsqs.sendmessage")),
            "{seen:?}"
        );
        // Certainly not sent: not accepted, rather than uncertain.
        assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
        assert!(err.find::<Sealed>().is_some(), "{err:?}");
    }

    #[test]
    fn keys_hide_the_secret_and_the_token() {
        let keys = SqsKeys::new("AKIDEXAMPLE", "s3cret").session_token("t0ken");
        let shown = format!("{keys:?}");
        assert!(shown.contains("AKIDEXAMPLE"), "{shown}");
        for secret in ["s3cret", "t0ken"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        let shown = format!(
            "{:?}",
            SqsCredentials::source(Counting::new(&Arc::default()))
        );
        assert_eq!(shown, "Source(..)");
    }
}
