//! The consumer's settings ([`EdgeConfig`]) and their validation. Pure, so
//! it is tested natively.

use std::time::Duration;

use jobrail::{PolicyError, Registry};

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
                crate::wrangler::job_max_retries(spec, &spec.queue, max_retries)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jobrail::{Job, JobContext};

    fn registry(cap: u32) -> Registry {
        let job = Job::<u32>::builder("j")
            .delivery_cap((cap > 0).then_some(cap))
            .build()
            .unwrap();
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
