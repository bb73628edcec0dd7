//! jobrail on Postgres: the queue itself ([`PgDriver`]), claims that run an
//! effect once ([`PgClaims`]) and the transactional outbox for dispatch to
//! a broker ([`Outbox`], [`OutboxRelay`]), through tokio-postgres
//! (re-exported as [`tokio_postgres`], so the client and transaction you
//! pass to [`PgDriver::dispatch_in`], [`PgDriver::complete_in`],
//! [`PgClaims::complete_in`] and [`Outbox::dispatch`] are of the version
//! this crate was built with).
//!
//! - [`PgDriver`]: a queue backend on tables of the application's own
//!   database (`FOR UPDATE SKIP LOCKED`, `LISTEN`/`NOTIFY`, fenced leases,
//!   a failures table), with dispatch ([`PgDriver::dispatch_in`]) and
//!   completion ([`PgDriver::complete_in`]) inside the caller's
//!   transaction. `guide/postgres.md` in the repository is its chapter.
//! - [`PgClaims`]: a [`jobrail::ClaimStore`] on a table. A database effect
//!   and its completion commit together with [`PgClaims::complete_in`]:
//!   exactly once for effects in the same database.
//! - [`Outbox`]: [`Outbox::dispatch`] writes a job into a table inside the
//!   caller's transaction, so it is dispatched if and only if the
//!   transaction commits.
//! - [`OutboxRelay`]: moves committed rows to the broker through a
//!   [`jobrail_native::Producer`] with the driver's confirms and marks them
//!   sent; a relay that dies between the two sends them again (at least
//!   once, under the same message id).
//! - [`PgConnect`]: how the store and the relay connect: TLS as the URL's
//!   `sslmode` asks (rustls, re-exported as [`rustls`](mod@rustls)), and
//!   reconnection after a lost connection.
//!
//! Table names follow one rule, checked before any I/O: `table` or
//! `schema.table`, each part `[a-z_][a-z0-9_]*`, the table at most
//! [`MAX_TABLE_BYTES`] bytes, so that the names of its indexes fit
//! Postgres's [`MAX_IDENTIFIER_BYTES`].
//!
//! Each type's docs give its guarantees and limits.

mod claims;
mod connect;
mod driver;
mod outbox;
mod relay;
mod schema;

pub use claims::PgClaims;
pub use connect::PgConnect;
pub use driver::{
    PgConfig, PgDriver, PgTicks, DEFAULT_SCHEMA, MAX_MESSAGE_BYTES_LIMIT, SCHEMA_VERSION,
};
pub use outbox::{Outbox, OutboxError, DEFAULT_OUTBOX_TABLE};
pub use relay::{OutboxRelay, RelayPass};
pub use rustls;
pub use schema::{MAX_IDENTIFIER_BYTES, MAX_TABLE_BYTES};
pub use tokio_postgres;
