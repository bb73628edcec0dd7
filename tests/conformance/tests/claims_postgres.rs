//! The claim-store suite on `PgClaims`, on the Postgres at `DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`), in the default
//! table. Every handle is a new store with a connection of its own, so a
//! handle dropped mid-work closes its connection as a dead worker's would.
//!
//! Run with `cargo test -p jobrail-conformance --features postgres --test claims_postgres`.

use std::sync::Arc;

use async_trait::async_trait;
use jobrail::ClaimStore;
use jobrail_conformance::claims::ClaimFixture;
use jobrail_postgres::PgClaims;

struct Postgres {
    url: String,
}

#[async_trait]
impl ClaimFixture for Postgres {
    async fn open(&self) -> Arc<dyn ClaimStore> {
        let store = PgClaims::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("connect to Postgres at DATABASE_URL: {e}"));
        Arc::new(store)
    }
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

jobrail_conformance::claim_store_suite!(Postgres {
    url: database_url()
});
