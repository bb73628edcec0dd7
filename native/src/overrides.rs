//! Operator overrides (tier depths, backoffs) read at start from
//! `JOBRAIL_CONFIG` and the environment ([`apply_env_overrides`]).

use jobrail::{Overrides, PolicyError, Registry};

/// The variable naming the overrides file.
const OVERRIDES_FILE_VAR: &str = "JOBRAIL_CONFIG";

/// Reads the operator's overrides: the TOML file named by `JOBRAIL_CONFIG`
/// (if set), then the `JOBRAIL_JOB__<JOB>__<FIELD>` variables, which win over
/// the file. [`Overrides`] gives both formats.
pub fn overrides_from_env() -> Result<Overrides, PolicyError> {
    let file = match std::env::var_os(OVERRIDES_FILE_VAR) {
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

/// Applies [`overrides_from_env`] to `registry`, all or nothing
/// ([`Registry::apply_overrides`]). Call it before building the consumer, so
/// a typo in a job name or a bad value stops the worker at start.
pub fn apply_env_overrides(registry: &mut Registry) -> Result<(), PolicyError> {
    registry.apply_overrides(&overrides_from_env()?)
}
