pub(crate) mod event;
pub(crate) mod metrics;
pub(crate) mod stats;
