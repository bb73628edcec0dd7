//! Loading operator overrides (tier depths, backoffs) at start.
//!
//! `QUEUE_CONFIG` names an optional TOML file; `QUEUE_JOB__<JOB>__<FIELD>`
//! variables override it. See [`queue::config`] for the format.

use queue::{Overrides, PolicyError, Registry};

/// The variable naming the configuration file.
pub const CONFIG_FILE_VAR: &str = "QUEUE_CONFIG";

/// Reads the file named by `QUEUE_CONFIG` (if set) and the environment.
pub fn overrides_from_env() -> Result<Overrides, PolicyError> {
    let file = match std::env::var_os(CONFIG_FILE_VAR) {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| PolicyError::Invalid {
                job: "*".into(),
                field: "config file".into(),
                reason: format!("cannot read {}: {e}", path.to_string_lossy()),
            })?;
            Overrides::from_toml(&text)?
        }
        None => Overrides::default(),
    };
    Ok(file.merge(Overrides::from_env(std::env::vars())?))
}

/// Applies [`overrides_from_env`] to `registry`.
pub fn apply_env_overrides(registry: &mut Registry) -> Result<(), PolicyError> {
    registry.apply_overrides(&overrides_from_env()?)
}
