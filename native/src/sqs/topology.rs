//! Queue names, resolving and creating queues, and reading a work queue's
//! redrive policy.

use aws_sdk_sqs::types::QueueAttributeName;

use super::connection::bounded;
use super::errors::{config_error, error, is_existing_queue, is_missing_queue, sdk_error};
use super::SqsDriver;
use crate::driver::{DriverError, ErrorKind};
use crate::kit::{failed, lock};

/// Retention of created failure queues: SQS's maximum, 14 days.
const FAILURE_RETENTION_SECONDS: u32 = 14 * 24 * 3600;

/// Which kind of queue a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    Work,
    Failure,
}

/// Whether `name` is a valid standard-queue name.
fn valid_queue_name(name: &str) -> bool {
    (1..=80).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// [`ErrorKind::Config`] for a name SQS would not take.
pub(super) fn check_name(name: &str) -> Result<(), DriverError> {
    if valid_queue_name(name) {
        Ok(())
    } else {
        Err(config_error(format!(
            "`{name}` is not a valid SQS queue name: 1 to 80 characters among A-Z, a-z, 0-9, `-` and `_` \
             (SQS has no `.` in standard queue names, and FIFO queues are not supported)"
        )))
    }
}

impl SqsDriver {
    /// The failure queue of `queue`, if failure queues are configured.
    pub fn failure_queue_name(&self, queue: &str) -> Option<String> {
        self.inner
            .config
            .failure_queue
            .as_ref()
            .map(|p| p.replace("{queue}", queue))
    }

    /// Forgets a queue's URL (after SQS said it does not exist).
    pub(super) fn forget(&self, name: &str) {
        lock(&self.inner.urls).remove(name);
    }

    /// The URL of `name`, creating the queue if configured to.
    pub(super) async fn queue_url(&self, name: &str, role: Role) -> Result<String, DriverError> {
        if let Some(url) = lock(&self.inner.urls).get(name) {
            return Ok(url.clone());
        }
        check_name(name)?;
        let url = match self.lookup(name).await? {
            Some(url) => url,
            None if self.inner.config.create_queues => self.create(name, role).await?,
            None => {
                return Err(config_error(format!(
                "queue `{name}` does not exist and the driver is configured not to create queues"
            )))
            }
        };
        lock(&self.inner.urls).insert(name.to_string(), url.clone());
        Ok(url)
    }

    /// `GetQueueUrl`; `None` if the queue does not exist.
    pub(super) async fn lookup(&self, name: &str) -> Result<Option<String>, DriverError> {
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
                lock(&self.inner.created).insert(name.to_string());
                out.queue_url().map(str::to_string).ok_or_else(|| {
                    error(
                        ErrorKind::Connection,
                        format!("{what}: no URL in the answer"),
                    )
                })
            }
            // Created meanwhile by someone else, with other attributes: use it.
            Err(e) if is_existing_queue(&e) => self.lookup(name).await?.ok_or_else(|| {
                error(
                    ErrorKind::Connection,
                    format!("{what}: SQS says the queue exists, yet GetQueueUrl does not find it"),
                )
            }),
            Err(e) => Err(sdk_error(
                &what,
                e,
                ErrorKind::Config,
                ErrorKind::Connection,
            )),
        }
    }

    /// Resolves (creates) the work queue and its failure queue; returns
    /// their URLs.
    pub(super) async fn resolve_work(
        &self,
        queue: &str,
    ) -> Result<(String, Option<String>), DriverError> {
        let url = self.queue_url(queue, Role::Work).await?;
        let failed = match self.failure_queue_name(queue) {
            Some(name) => Some(self.queue_url(&name, Role::Failure).await?),
            None => None,
        };
        Ok((url, failed))
    }

    /// The `maxReceiveCount` of the work queue's redrive policy (resolving
    /// or creating the queue as a dispatch would); `None` without a policy.
    /// A policy without a readable count is [`ErrorKind::Config`].
    pub(super) async fn max_receive_count(&self, queue: &str) -> Result<Option<u32>, DriverError> {
        let url = self.queue_url(queue, Role::Work).await?;
        let limit = self.inner.config.operation_timeout;
        let what = format!("GetQueueAttributes `{queue}`");
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
            return Ok(None);
        };
        let parsed: serde_json::Value = serde_json::from_str(policy).map_err(|e| {
            failed(
                super::NAME,
                ErrorKind::Config,
                format!("queue `{queue}` has a redrive policy that is not JSON"),
                e,
            )
        })?;
        let max = match &parsed["maxReceiveCount"] {
            serde_json::Value::Number(n) => n.as_u64(),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        };
        match max {
            Some(max) => Ok(Some(u32::try_from(max).unwrap_or(u32::MAX))),
            None => Err(config_error(format!(
                "queue `{queue}` has a redrive policy without a readable maxReceiveCount: {policy}"
            ))),
        }
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
}
