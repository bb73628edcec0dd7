//! The conformance suite against the Postgres queue (`PgDriver`) on the
//! database at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), in the schema
//! `jobrail_conformance`, installed by the fixture.
//!
//! Run with `cargo test -p jobrail-conformance --features postgres --test postgres`.
//!
//! Every queue a test used is emptied when it ends.

use jobrail_conformance::fixture::{postgres_config, Fixture, Postgres};

jobrail_conformance::conformance_suite!(Fixture::<Postgres>::new(postgres_config(
    "jobrail_conformance"
)));
