//! Reading wrangler.toml: the file as toml reads it, each section's queue
//! settings with the platform's defaults filled in ([`Wrangler::parse`],
//! [`Wrangler::parse_env`], [`Wrangler::parse_all`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::*;

/// The file as toml reads it: only the keys this module uses (serde skips
/// the rest).
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawFile {
    queues: RawQueues,
    env: BTreeMap<String, RawEnv>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawEnv {
    queues: RawQueues,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawQueues {
    producers: Vec<Producer>,
    consumers: Vec<RawConsumer>,
}

#[derive(Deserialize)]
struct RawConsumer {
    queue: String,
    max_batch_size: Option<u32>,
    /// Seconds; the platform takes a number, so a fraction is accepted.
    max_batch_timeout: Option<f64>,
    max_retries: Option<u32>,
    retry_delay: Option<u32>,
    dead_letter_queue: Option<String>,
    max_concurrency: Option<u32>,
}

impl RawConsumer {
    fn settings(self) -> Result<ConsumerSettings, WranglerError> {
        let max_batch_timeout = match self.max_batch_timeout {
            None => DEFAULT_MAX_BATCH_TIMEOUT,
            Some(seconds) => {
                Duration::try_from_secs_f64(seconds).map_err(|_| WranglerError::Invalid {
                    queue: self.queue.clone(),
                    field: "max_batch_timeout",
                    reason: format!("{seconds} is not a number of seconds"),
                })?
            }
        };
        Ok(ConsumerSettings {
            max_batch_size: self.max_batch_size.unwrap_or(DEFAULT_MAX_BATCH_SIZE),
            max_batch_timeout,
            max_retries: self.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
            retry_delay: self
                .retry_delay
                .map_or(DEFAULT_RETRY_DELAY, |s| Duration::from_secs(s.into())),
            dead_letter_queue: self.dead_letter_queue,
            max_concurrency: self.max_concurrency,
            queue: self.queue,
        })
    }
}

impl Wrangler {
    /// [`Wrangler::parse_env`].
    pub(super) fn read_env(text: &str, env: Option<&str>) -> Result<Wrangler, WranglerError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| WranglerError::Parse(e.to_string()))?;
        let queues = match env {
            None => raw.queues,
            Some(name) => {
                let mut envs = raw.env;
                envs.remove(name)
                    .ok_or_else(|| WranglerError::NoEnvironment(name.to_string()))?
                    .queues
            }
        };
        Wrangler::section(env, queues)
    }

    /// [`Wrangler::parse_all`].
    pub(super) fn read_all(text: &str) -> Result<Vec<Wrangler>, WranglerError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| WranglerError::Parse(e.to_string()))?;
        let mut sections = vec![Wrangler::section(None, raw.queues)?];
        for (name, env) in raw.env {
            sections.push(Wrangler::section(Some(&name), env.queues)?);
        }
        Ok(sections)
    }

    fn section(env: Option<&str>, queues: RawQueues) -> Result<Wrangler, WranglerError> {
        let consumers = queues
            .consumers
            .into_iter()
            .map(RawConsumer::settings)
            .collect::<Result<_, _>>()?;
        Ok(Wrangler {
            env: env.map(str::to_string),
            producers: queues.producers,
            consumers,
        })
    }
}
