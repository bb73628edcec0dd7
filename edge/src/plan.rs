//! How the rules' settlements map onto Cloudflare Queues. Pure, so it is
//! tested natively.

use std::fmt;
use std::time::Duration;

use queue::{PolicyError, Registry};

/// The longest delay Cloudflare accepts for a retry or a delayed send.
pub const MAX_DELAY: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a misconfigured worker hands each message back for: long
/// enough for an operator to deploy a fix, within the platform's delay limit.
pub(crate) const MISCONFIGURED_RETRY_DELAY: Duration = Duration::from_secs(12 * 60 * 60);

/// Consumer settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeConfig {
    /// Wall-clock time one invocation may spend on a batch, settlement
    /// included. Default 5 minutes, well below the platform's 15-minute limit
    /// for queue consumers.
    pub budget: Duration,
    /// Time kept back at the end of the budget for settling (and for a
    /// failure-queue send). Default 5 s.
    pub settlement_reserve: Duration,
    /// Messages handled at once within one invocation. Default 1 (in order).
    pub concurrency: usize,
    /// A Queue binding that receives failure records before the ack.
    pub failure_queue: Option<String>,
    /// The consumer's `max_retries` from wrangler.toml, when known: the
    /// consumer refuses to start if the platform would give up on a message
    /// before a job's own attempt cap.
    pub platform_max_retries: Option<u32>,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        EdgeConfig {
            budget: Duration::from_secs(300),
            settlement_reserve: Duration::from_secs(5),
            concurrency: 1,
            failure_queue: None,
            platform_max_retries: None,
        }
    }
}

impl EdgeConfig {
    /// Checks the settings against each other and against the registry's jobs.
    pub fn validate(&self, registry: &Registry) -> Result<(), PolicyError> {
        let invalid = |field: &'static str, reason: String| PolicyError::Invalid {
            job: "*".into(),
            field: field.into(),
            reason,
        };
        if self.budget <= self.settlement_reserve {
            return Err(invalid(
                "edge.budget",
                format!(
                    "{:?} must exceed the settlement reserve {:?}",
                    self.budget, self.settlement_reserve
                ),
            ));
        }
        if self.concurrency == 0 {
            return Err(invalid("edge.concurrency", "must be at least 1".into()));
        }
        if let Some(max_retries) = self.platform_max_retries {
            for spec in registry.specs() {
                crate::wrangler::job_max_retries(spec, max_retries)?;
            }
        }
        Ok(())
    }
}

/// What went wrong talking to the platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EdgeErrorKind {
    /// The platform cannot do this (a delay above 24 hours).
    Unsupported,
    /// The request was made but failed; the platform may or may not have acted.
    Uncertain,
    /// The payload could not be encoded.
    Encode,
    /// A binding is missing or of the wrong type.
    Config,
}

/// An error from the edge binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeError {
    /// The kind.
    pub kind: EdgeErrorKind,
    /// What happened.
    pub message: String,
}

impl EdgeError {
    pub(crate) fn new(kind: EdgeErrorKind, message: impl Into<String>) -> Self {
        EdgeError {
            kind,
            message: message.into(),
        }
    }
}

impl EdgeError {
    /// A failed platform call whose effect is unknown.
    pub fn uncertain(what: &str, detail: impl fmt::Display) -> Self {
        EdgeError::new(EdgeErrorKind::Uncertain, format!("{what}: {detail}"))
    }
}

impl fmt::Display for EdgeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            EdgeErrorKind::Unsupported => "unsupported",
            EdgeErrorKind::Uncertain => "outcome uncertain",
            EdgeErrorKind::Encode => "encoding error",
            EdgeErrorKind::Config => "configuration error",
        };
        write!(f, "cloudflare: {kind}: {}", self.message)
    }
}

impl std::error::Error for EdgeError {}

impl From<EdgeError> for queue::SettlementError {
    fn from(err: EdgeError) -> Self {
        let kind = match err.kind {
            EdgeErrorKind::Unsupported => queue::ErrorKind::Unsupported,
            EdgeErrorKind::Uncertain => queue::ErrorKind::Uncertain,
            EdgeErrorKind::Encode => queue::ErrorKind::Encode,
            EdgeErrorKind::Config => queue::ErrorKind::Config,
        };
        queue::SettlementError::new(kind, err)
    }
}

/// A retry delay in whole seconds, rounded up (never shortened). `None`
/// leaves the timing to the consumer's `retry_delay` setting. Above 24 hours
/// the platform cannot hold the message back: an `Unsupported` error.
pub(crate) fn delay_seconds(delay: Option<Duration>) -> Result<Option<u32>, EdgeError> {
    let Some(delay) = delay else { return Ok(None) };
    if delay > MAX_DELAY {
        return Err(EdgeError::new(
            EdgeErrorKind::Unsupported,
            format!("a delay of {delay:?} exceeds Cloudflare's maximum of 24 hours"),
        ));
    }
    let whole = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
    Ok(Some(whole as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use queue::{Job, JobContext};

    #[test]
    fn delays_round_up_to_whole_seconds() {
        assert_eq!(delay_seconds(None), Ok(None));
        assert_eq!(delay_seconds(Some(Duration::ZERO)), Ok(Some(0)));
        assert_eq!(delay_seconds(Some(Duration::from_millis(1))), Ok(Some(1)));
        assert_eq!(
            delay_seconds(Some(Duration::from_millis(2500))),
            Ok(Some(3))
        );
        assert_eq!(delay_seconds(Some(Duration::from_secs(2))), Ok(Some(2)));
        assert_eq!(delay_seconds(Some(MAX_DELAY)), Ok(Some(86_400)));
        let err = delay_seconds(Some(MAX_DELAY + Duration::from_millis(1))).unwrap_err();
        assert_eq!(err.kind, EdgeErrorKind::Unsupported);
        assert!(err.to_string().contains("24 hours"));
    }

    fn registry(cap: u32) -> Registry {
        let job = Job::<u32>::builder("j").retry(cap).build().unwrap();
        let mut r = Registry::new();
        r.register(&job, |_: JobContext, _: u32| async { Ok(()) })
            .unwrap();
        r
    }

    #[test]
    fn refuses_a_platform_cap_below_the_jobs() {
        let config = EdgeConfig {
            platform_max_retries: Some(3),
            ..EdgeConfig::default()
        };
        assert!(
            config.validate(&registry(2)).is_ok(),
            "3 retries = 4 deliveries = a cap of 2 plus the crash bound"
        );
        let err = config.validate(&registry(3)).unwrap_err().to_string();
        assert!(err.contains("max_retries") && err.contains("`j`"), "{err}");
        assert!(
            config.validate(&registry(0)).is_err(),
            "an unlimited job cannot be honoured"
        );
        assert!(
            EdgeConfig::default().validate(&registry(50)).is_ok(),
            "unknown platform cap: not checked"
        );
    }

    #[test]
    fn refuses_a_budget_without_room_to_settle() {
        let config = EdgeConfig {
            budget: Duration::from_secs(1),
            ..EdgeConfig::default()
        };
        assert!(config.validate(&registry(1)).is_err());
        let config = EdgeConfig {
            concurrency: 0,
            ..EdgeConfig::default()
        };
        assert!(config.validate(&registry(1)).is_err());
    }
}
