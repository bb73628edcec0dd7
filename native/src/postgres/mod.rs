//! Postgres: claims that run an effect once ([`PgClaims`]) and the
//! transactional outbox for dispatch ([`Outbox`], [`OutboxRelay`]), through
//! tokio-postgres.

mod claims;
mod connect;
mod outbox;
mod relay;

pub use claims::PgClaims;
pub use outbox::Outbox;
pub use relay::OutboxRelay;
