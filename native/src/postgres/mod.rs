//! Postgres: claims that run an effect once ([`PgClaims`]) and the
//! transactional outbox for dispatch ([`Outbox`], [`OutboxRelay`]), through
//! tokio-postgres.

mod claims;
mod connect;
mod outbox;
mod relay;

pub use claims::PgClaims;
pub use outbox::{Outbox, OutboxError, DEFAULT_OUTBOX_TABLE, MAX_OUTBOX_TABLE_BYTES};
pub use relay::{OutboxRelay, RelayPass};
