//! Claims on Postgres.

/// Claims on Postgres (being built).
#[derive(Debug)]
pub struct PgClaims;
