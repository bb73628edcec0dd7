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
    triggers: Option<RawTriggers>,
    d1_databases: Vec<RawD1>,
    env: BTreeMap<String, RawEnv>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawEnv {
    queues: RawQueues,
    triggers: Option<RawTriggers>,
    d1_databases: Vec<RawD1>,
}

/// `[triggers]`: the Cron Triggers.
#[derive(Deserialize, Default)]
#[serde(default)]
struct RawTriggers {
    crons: Vec<String>,
}

/// One `[[d1_databases]]` entry (only its binding is read).
#[derive(Deserialize)]
struct RawD1 {
    binding: String,
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
        let section = match env {
            None => RawEnv {
                queues: raw.queues,
                triggers: raw.triggers,
                d1_databases: raw.d1_databases,
            },
            Some(name) => {
                let mut envs = raw.env;
                let mut section = envs
                    .remove(name)
                    .ok_or_else(|| WranglerError::NoEnvironment(name.to_string()))?;
                section.triggers = section.triggers.or(raw.triggers);
                section
            }
        };
        Wrangler::section(env, section)
    }

    /// [`Wrangler::parse_all`].
    pub(super) fn read_all(text: &str) -> Result<Vec<Wrangler>, WranglerError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| WranglerError::Parse(e.to_string()))?;
        let top_triggers = raw.triggers.as_ref().map(|t| RawTriggers {
            crons: t.crons.clone(),
        });
        let top = RawEnv {
            queues: raw.queues,
            triggers: raw.triggers,
            d1_databases: raw.d1_databases,
        };
        let mut sections = vec![Wrangler::section(None, top)?];
        for (name, mut env) in raw.env {
            if env.triggers.is_none() {
                env.triggers = top_triggers.as_ref().map(|t| RawTriggers {
                    crons: t.crons.clone(),
                });
            }
            sections.push(Wrangler::section(Some(&name), env)?);
        }
        Ok(sections)
    }

    /// One section. Wrangler carries `[triggers]` from the top level into
    /// an environment that has none of its own (the callers do), but not
    /// `[[d1_databases]]`.
    fn section(env: Option<&str>, section: RawEnv) -> Result<Wrangler, WranglerError> {
        let consumers = section
            .queues
            .consumers
            .into_iter()
            .map(RawConsumer::settings)
            .collect::<Result<_, _>>()?;
        Ok(Wrangler {
            env: env.map(str::to_string),
            producers: section.queues.producers,
            consumers,
            crons: section.triggers.map(|t| t.crons),
            d1_bindings: section
                .d1_databases
                .into_iter()
                .map(|d| d.binding)
                .collect(),
        })
    }
}
