//! The outbox table.

/// The outbox (being built).
#[derive(Debug)]
pub struct Outbox;
