//! Postgres: claims that run an effect once ([`PgClaims`]) and the
//! transactional outbox for dispatch ([`Outbox`], [`OutboxRelay`]), through
//! tokio-postgres (re-exported as [`tokio_postgres`], so the client and
//! transaction you pass to [`PgClaims::complete_in`] and
//! [`Outbox::dispatch`] are of the version this crate was built with).
//!
//! - [`PgClaims`]: a [`jobrail::ClaimStore`] on a table. A database effect
//!   and its completion commit together with [`PgClaims::complete_in`]:
//!   exactly once for effects in the same database.
//! - [`Outbox`]: [`Outbox::dispatch`] writes a job into a table inside the
//!   caller's transaction, so it is dispatched if and only if the
//!   transaction commits.
//! - [`OutboxRelay`]: moves committed rows to the broker with the driver's
//!   confirms and marks them sent; a relay that dies between the two sends
//!   them again (at least once, under the same message id).
//!
//! Each type's docs give its guarantees and limits.

mod claims;
mod connect;
mod outbox;
mod relay;

pub use claims::PgClaims;
pub use outbox::{Outbox, OutboxError, DEFAULT_OUTBOX_TABLE, MAX_OUTBOX_TABLE_BYTES};
pub use relay::{OutboxRelay, RelayPass};
pub use tokio_postgres;
