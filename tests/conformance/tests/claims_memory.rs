//! The claim-store suite on `MemoryClaims`: every handle shares one store
//! (a clone), as the workers of one process do.

use std::sync::Arc;

use async_trait::async_trait;
use jobrail::{ClaimStore, MemoryClaims};
use jobrail_conformance::claims::ClaimFixture;

struct Memory(MemoryClaims);

#[async_trait]
impl ClaimFixture for Memory {
    async fn open(&self) -> Arc<dyn ClaimStore> {
        Arc::new(self.0.clone())
    }

    fn slack(&self) -> std::time::Duration {
        std::time::Duration::from_millis(50)
    }
}

jobrail_conformance::claim_store_suite!(Memory(MemoryClaims::new()));
