//! `ClaimStore::state` on `PgClaims`: free, held with its remaining lease,
//! done; read without changing anything. Needs Postgres at `DATABASE_URL`
//! (default postgres://postgres@127.0.0.1:5432/test); skipped, loudly, when
//! it is not reachable and `CI` is not set.

use std::time::Duration;

use jobrail::{Claim, ClaimState, ClaimStore};
use jobrail_postgres::PgClaims;

#[tokio::test]
async fn state_reads_a_key_without_claiming_it() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let claims = match PgClaims::connect(&url).await {
        Ok(claims) => claims,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("SKIPPED: Postgres not reachable at {url}: {e}");
            return;
        }
        Err(e) => panic!("Postgres not reachable at {url}: {e}"),
    };
    let key = format!(
        "state-test:{}:{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    );
    assert_eq!(claims.state(&key).await.unwrap(), ClaimState::Free);
    assert_eq!(
        claims.state(&key).await.unwrap(),
        ClaimState::Free,
        "reading claims nothing"
    );
    let Claim::Claimed { fence } = claims.claim(&key, Duration::from_secs(30)).await.unwrap()
    else {
        panic!("a fresh key is claimed");
    };
    match claims.state(&key).await.unwrap() {
        ClaimState::Held { remaining } => {
            assert!(remaining <= Duration::from_secs(30) && remaining > Duration::from_secs(20))
        }
        other => panic!("held, not {other:?}"),
    }
    claims.release(&key, fence).await.unwrap();
    assert_eq!(
        claims.state(&key).await.unwrap(),
        ClaimState::Free,
        "released"
    );
    let Claim::Claimed { fence } = claims.claim(&key, Duration::from_secs(30)).await.unwrap()
    else {
        panic!("a released key is claimed");
    };
    claims.complete(&key, fence).await.unwrap();
    assert_eq!(claims.state(&key).await.unwrap(), ClaimState::Done);
    // A lease that ended reads free.
    let short = format!("{key}:short");
    claims
        .claim(&short, Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(claims.state(&short).await.unwrap(), ClaimState::Free);
}
