//! The claim-store suite on `RedisClaims`: every handle is a connection of
//! its own (`RedisClaims::connect`) to the Redis at `REDIS_URL`
//! (`redis://127.0.0.1:6379` unless set), as separate worker processes
//! would have.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jobrail::ClaimStore;
use jobrail_conformance::claims::ClaimFixture;
use jobrail_redis::RedisClaims;

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

struct Redis;

#[async_trait]
impl ClaimFixture for Redis {
    async fn open(&self) -> Arc<dyn ClaimStore> {
        let store = RedisClaims::connect(&url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(store)
    }

    fn slack(&self) -> Duration {
        Duration::from_millis(200)
    }
}

jobrail_conformance::claim_store_suite!(Redis);
