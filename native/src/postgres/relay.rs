//! The relay.

/// The relay (being built).
#[derive(Debug)]
pub struct OutboxRelay;
