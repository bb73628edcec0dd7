//! `PgClaims` beyond the claim-store suite, on the Postgres at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`): the
//! completion in the caller's transaction (`complete_in`) commits and rolls
//! back with the effect, a concurrent claim waits for that transaction, the
//! store connects again after the server closes its connection, table names
//! are checked, and `purge_done`.
//!
//! Each test uses tables of its own and drops them at the end.
//!
//! Run with `cargo test -p jobrail-conformance --features postgres --test claims_postgres_extra`.

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Claim, ClaimError, ClaimStore};
use jobrail_conformance::claims::unique_key;
use jobrail_postgres::PgClaims;
use tokio_postgres::{Client, NoTls};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A client of our own, outside the store.
async fn client() -> Client {
    let (client, connection) = tokio_postgres::connect(&database_url(), NoTls)
        .await
        .expect("connect to Postgres at DATABASE_URL");
    tokio::spawn(connection);
    client
}

/// A table name no other test or run uses.
fn unique_table(what: &str) -> String {
    let id = jobrail::new_message_id().replace('-', "");
    format!("jobrail_test_{what}_{}", &id[..12])
}

/// A claims table of its own and a table for the effect.
struct Setup {
    claims: PgClaims,
    client: Client,
    claims_table: String,
    effects: String,
}

impl Setup {
    async fn new(what: &str) -> Setup {
        let claims_table = unique_table(what);
        let effects = format!("{claims_table}_effects");
        let claims = PgClaims::connect_with_table(&database_url(), &claims_table)
            .await
            .unwrap();
        let client = client().await;
        client
            .batch_execute(&format!(
                "CREATE TABLE {effects} (key text PRIMARY KEY, note text NOT NULL)"
            ))
            .await
            .unwrap();
        Setup {
            claims,
            client,
            claims_table,
            effects,
        }
    }

    /// Another store on the same table, with a connection of its own.
    async fn other(&self) -> PgClaims {
        PgClaims::connect_with_table(&database_url(), &self.claims_table)
            .await
            .unwrap()
    }

    async fn effect_rows(&self, key: &str) -> i64 {
        self.client
            .query_one(
                &format!("SELECT count(*) FROM {} WHERE key = $1", self.effects),
                &[&key],
            )
            .await
            .unwrap()
            .get(0)
    }

    async fn drop_tables(self) {
        self.client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}",
                self.effects, self.claims_table
            ))
            .await
            .unwrap();
    }
}

fn fence(claim: Claim) -> u64 {
    match claim {
        Claim::Claimed { fence } => fence,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

const LEASE: Duration = Duration::from_secs(30);

/// The effect and its completion commit together: the effect's row exists
/// and the key is done, seen from another connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_commits_with_the_effect() {
    let mut setup = Setup::new("commit").await;
    let key = unique_key("pg-commit");
    let f = fence(setup.claims.claim(&key, LEASE).await.unwrap());
    let effects = setup.effects.clone();
    let tx = setup.client.transaction().await.unwrap();
    tx.execute(
        &format!("INSERT INTO {effects} (key, note) VALUES ($1, 'refund')"),
        &[&key],
    )
    .await
    .unwrap();
    setup.claims.complete_in(&tx, &key, f).await.unwrap();
    // Not committed yet: the completion is not visible elsewhere.
    let watcher = client().await;
    let state: String = watcher
        .query_one(
            &format!("SELECT state FROM {} WHERE key = $1", setup.claims_table),
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "held");
    tx.commit().await.unwrap();

    assert_eq!(setup.effect_rows(&key).await, 1);
    let other = setup.other().await;
    assert_eq!(other.claim(&key, LEASE).await.unwrap(), Claim::Done);
    // The completion used the claim: it cannot be completed again.
    assert!(matches!(
        setup.claims.complete(&key, f).await,
        Err(ClaimError::Lost { .. })
    ));
    setup.drop_tables().await;
}

/// A rolled-back transaction leaves neither the effect nor the completion:
/// the claim is still held until it is released (or its lease ends), then
/// the key is claimed again with a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_leaves_neither() {
    let mut setup = Setup::new("rollback").await;
    let effects = setup.effects.clone();
    let other = setup.other().await;

    // Released after the rollback.
    let key = unique_key("pg-rollback");
    let f = fence(setup.claims.claim(&key, LEASE).await.unwrap());
    {
        let tx = setup.client.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {effects} (key, note) VALUES ($1, 'refund')"),
            &[&key],
        )
        .await
        .unwrap();
        setup.claims.complete_in(&tx, &key, f).await.unwrap();
        tx.rollback().await.unwrap();
    }
    assert_eq!(setup.effect_rows(&key).await, 0);
    assert!(matches!(
        other.claim(&key, LEASE).await.unwrap(),
        Claim::Held { .. }
    ));
    setup.claims.release(&key, f).await.unwrap();
    let g = fence(other.claim(&key, LEASE).await.unwrap());
    assert!(g > f);

    // Dropped (rolled back) without a release: free once the lease ends.
    let key = unique_key("pg-rollback-lease");
    let lease = Duration::from_millis(800);
    let f = fence(setup.claims.claim(&key, lease).await.unwrap());
    {
        let tx = setup.client.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {effects} (key, note) VALUES ($1, 'refund')"),
            &[&key],
        )
        .await
        .unwrap();
        setup.claims.complete_in(&tx, &key, f).await.unwrap();
        drop(tx);
    }
    assert_eq!(setup.effect_rows(&key).await, 0);
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let g = fence(other.claim(&key, LEASE).await.unwrap());
    assert!(g > f);
    setup.drop_tables().await;
}

/// A completion whose lease ended, or whose key a newer claim took, fails
/// in the transaction; the caller drops the transaction and its effect is
/// gone with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_with_a_lost_lease_fails_and_the_effect_rolls_back() {
    let mut setup = Setup::new("lost").await;
    let effects = setup.effects.clone();
    let other = setup.other().await;

    let expired = unique_key("pg-lost-expired");
    let lease = Duration::from_millis(300);
    let f = fence(setup.claims.claim(&expired, lease).await.unwrap());
    tokio::time::sleep(lease + Duration::from_millis(200)).await;

    let taken = unique_key("pg-lost-taken");
    let old = fence(setup.claims.claim(&taken, lease).await.unwrap());
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let new = fence(other.claim(&taken, LEASE).await.unwrap());
    assert!(new > old);

    for (key, fence) in [(&expired, f), (&taken, old)] {
        let tx = setup.client.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {effects} (key, note) VALUES ($1, 'refund')"),
            &[key],
        )
        .await
        .unwrap();
        let result = setup.claims.complete_in(&tx, key, fence).await;
        assert!(
            matches!(result, Err(ClaimError::Lost { .. })),
            "{key}: expected Lost, got {result:?}"
        );
        drop(tx);
        assert_eq!(setup.effect_rows(key).await, 0, "{key}");
    }
    // The expired key is free; the taken one is still the newer holder's.
    assert!(fence(other.claim(&expired, LEASE).await.unwrap()) > f);
    assert!(matches!(
        setup.claims.claim(&taken, LEASE).await.unwrap(),
        Claim::Held { .. }
    ));
    other.complete(&taken, new).await.unwrap();
    setup.drop_tables().await;
}

/// While the transaction that completes a claim is open, a concurrent
/// claim of the key waits on its row; it then sees the key done (a commit)
/// or held (a rollback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_claim_waits_for_the_transaction() {
    let mut setup = Setup::new("wait").await;
    let effects = setup.effects.clone();
    let other = Arc::new(setup.other().await);

    for commit in [true, false] {
        let key = unique_key(if commit {
            "pg-wait-commit"
        } else {
            "pg-wait-rollback"
        });
        let f = fence(setup.claims.claim(&key, LEASE).await.unwrap());
        let tx = setup.client.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {effects} (key, note) VALUES ($1, 'refund')"),
            &[&key],
        )
        .await
        .unwrap();
        setup.claims.complete_in(&tx, &key, f).await.unwrap();

        let waiting = tokio::spawn({
            let (other, key) = (other.clone(), key.clone());
            async move { other.claim(&key, LEASE).await }
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !waiting.is_finished(),
            "the claim did not wait for the open transaction"
        );
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let seen = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the claim still waits after the transaction ended")
            .unwrap()
            .unwrap();
        if commit {
            assert_eq!(seen, Claim::Done);
            assert_eq!(setup.effect_rows(&key).await, 1);
        } else {
            assert!(matches!(seen, Claim::Held { .. }), "got {seen:?}");
            assert_eq!(setup.effect_rows(&key).await, 0);
        }
    }
    setup.drop_tables().await;
}

/// A store whose connection the test can find (by its application name)
/// and end, from an administrator's connection.
struct Watched {
    claims: PgClaims,
    admin: Client,
    app: String,
    table: String,
}

impl Watched {
    async fn new() -> Watched {
        let app = unique_table("app");
        let table = unique_table("reconnect");
        let base = database_url();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}application_name={app}");
        let claims = PgClaims::connect_with_table(&url, &table).await.unwrap();
        Watched {
            claims,
            admin: client().await,
            app,
            table,
        }
    }

    /// The backends of the store, with what they wait for.
    async fn backends(&self) -> Vec<(i32, Option<String>)> {
        self.admin
            .query(
                "SELECT pid, wait_event_type FROM pg_stat_activity WHERE application_name = $1",
                &[&self.app],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }

    /// Ends the store's one connection (and waits until its backend is
    /// gone); its pid.
    async fn terminate(&self) -> i32 {
        let backends = self.backends().await;
        assert_eq!(
            backends.len(),
            1,
            "the store holds one connection: {backends:?}"
        );
        let pid = backends[0].0;
        let done: bool = self
            .admin
            .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(done, "the backend did not end");
        pid
    }

    /// Waits until the store's backend waits for a lock.
    async fn until_blocked(&self) {
        for _ in 0..100 {
            let backends = self.backends().await;
            if backends
                .iter()
                .any(|(_, wait)| wait.as_deref() == Some("Lock"))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the store's statement never waited for the lock");
    }

    async fn drop_table(self) {
        drop(self.claims);
        self.admin
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", self.table))
            .await
            .unwrap();
    }
}

/// The server closes the store's idle connection (an administrator, a
/// restart): the next operations connect again and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_connects_again_after_the_server_closes_its_connection() {
    let watched = Watched::new().await;
    let claims = &watched.claims;
    let key = unique_key("pg-reconnect");
    let f = fence(claims.claim(&key, LEASE).await.unwrap());
    let first = watched.terminate().await;
    claims.complete(&key, f).await.unwrap();
    assert_eq!(claims.claim(&key, LEASE).await.unwrap(), Claim::Done);

    let key = unique_key("pg-reconnect-2");
    let g = fence(claims.claim(&key, LEASE).await.unwrap());
    let second = watched.terminate().await;
    assert_ne!(first, second, "a new connection");
    tokio::time::sleep(Duration::from_millis(300)).await;
    claims.extend(&key, g, LEASE).await.unwrap();
    let third = watched.terminate().await;
    assert_ne!(second, third, "a new connection");
    claims.release(&key, g).await.unwrap();
    assert!(fence(claims.claim(&key, LEASE).await.unwrap()) > g);
    assert_eq!(watched.backends().await.len(), 1);
    watched.drop_table().await;
}

/// The server ends the store's connection while a claim, then a
/// completion, is under way (waiting for a row another transaction
/// locked): each is tried again on a new connection and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_cut_off_by_the_lost_connection_is_tried_again() {
    let watched = Watched::new().await;
    let mut locker = client().await;
    let claims = watched.claims.clone();
    let table = watched.table.clone();
    let key = unique_key("pg-cut-off");
    let lease = Duration::from_millis(300);
    let f = fence(claims.claim(&key, lease).await.unwrap());
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let lock = format!("SELECT 1 FROM {table} WHERE key = $1 FOR UPDATE");

    // A claim of the expired key, cut off while it waits for the row.
    let tx = locker.transaction().await.unwrap();
    tx.query_one(&lock, &[&key]).await.unwrap();
    let claiming = tokio::spawn({
        let (claims, key) = (claims.clone(), key.clone());
        async move { claims.claim(&key, LEASE).await }
    });
    watched.until_blocked().await;
    watched.terminate().await;
    tx.rollback().await.unwrap();
    let g = fence(claiming.await.unwrap().unwrap());
    assert!(g > f);

    // A completion, cut off the same way.
    let tx = locker.transaction().await.unwrap();
    tx.query_one(&lock, &[&key]).await.unwrap();
    let completing = tokio::spawn({
        let (claims, key) = (claims.clone(), key.clone());
        async move { claims.complete(&key, g).await }
    });
    watched.until_blocked().await;
    watched.terminate().await;
    tx.rollback().await.unwrap();
    completing.await.unwrap().unwrap();
    assert_eq!(claims.claim(&key, LEASE).await.unwrap(), Claim::Done);
    drop(claims);
    watched.drop_table().await;
}

/// A server that cannot be reached is a store error, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_a_store_error() {
    let result = PgClaims::connect("postgres://postgres@127.0.0.1:1/test").await;
    assert!(
        matches!(result, Err(ClaimError::Store(_))),
        "got {result:?}"
    );
}

/// Table names that are not plain lowercase identifiers are refused before
/// any connection is made; a schema-qualified name works, and several
/// stores creating one table at once all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_are_checked_and_tables_created_once() {
    // An unreachable server: a refusal here came before any I/O.
    let nowhere = "postgres://postgres@127.0.0.1:1/test";
    for bad in [
        "",
        "Claims",
        "claims-2024",
        "1claims",
        "a.b.c",
        "claims; DROP TABLE users",
        "\"claims\"",
        &"c".repeat(64),
    ] {
        let result = PgClaims::connect_with_table(nowhere, bad).await;
        assert!(
            matches!(result, Err(ClaimError::Invalid(_))),
            "{bad:?}: got {result:?}"
        );
        assert!(matches!(
            PgClaims::install_sql(bad),
            Err(ClaimError::Invalid(_))
        ));
    }
    let ddl = PgClaims::install_sql("jobs.claims").unwrap();
    assert!(
        ddl.contains("CREATE TABLE IF NOT EXISTS \"jobs\".\"claims\""),
        "{ddl}"
    );

    // Several stores starting at once on a table that does not exist yet.
    let schema = unique_table("schema");
    let admin = client().await;
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    let table = format!("{schema}.claims");
    let starts: Vec<_> = (0..6)
        .map(|_| {
            let table = table.clone();
            tokio::spawn(async move { PgClaims::connect_with_table(&database_url(), &table).await })
        })
        .collect();
    let mut stores = Vec::new();
    for start in starts {
        stores.push(start.await.unwrap().unwrap());
    }
    assert_eq!(stores[0].table(), table);

    let key = unique_key("pg-schema");
    let f = fence(stores[1].claim(&key, LEASE).await.unwrap());
    stores[2].complete(&key, f).await.unwrap();
    let row = admin
        .query_one(
            &format!("SELECT fence, state FROM {table} WHERE key = $1"),
            &[&key],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, String>(1)),
        (f as i64, "done".to_owned())
    );
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}

/// Keys cannot hold a NUL character (Postgres text cannot): refused as
/// invalid, and never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_nul_are_refused() {
    let claims = PgClaims::connect(&database_url()).await.unwrap();
    let key = format!("{}\0tail", unique_key("pg-nul"));
    assert!(matches!(
        claims.claim(&key, LEASE).await,
        Err(ClaimError::Invalid(_))
    ));
    assert!(matches!(
        claims.complete(&key, 1).await,
        Err(ClaimError::Lost { .. })
    ));
}

/// `purge_done` deletes the done rows older than its age and nothing else;
/// a purged key is new again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_done_deletes_old_done_rows() {
    let setup = Setup::new("purge").await;
    let claims = &setup.claims;
    let table = setup.claims_table.clone();
    let (old, recent, held) = (
        unique_key("pg-purge-old"),
        unique_key("pg-purge-recent"),
        unique_key("pg-purge-held"),
    );
    for key in [&old, &recent] {
        let f = fence(claims.claim(key, LEASE).await.unwrap());
        claims.complete(key, f).await.unwrap();
    }
    fence(claims.claim(&held, LEASE).await.unwrap());
    // Two hours ago, for the old one; the held row looks old too.
    setup
        .client
        .execute(
            &format!(
                "UPDATE {table} SET done_at = clock_timestamp() - interval '2 hours' \
                 WHERE key = $1"
            ),
            &[&old],
        )
        .await
        .unwrap();
    setup
        .client
        .execute(
            &format!(
                "UPDATE {table} SET claimed_at = clock_timestamp() - interval '2 hours' \
                 WHERE key = $1"
            ),
            &[&held],
        )
        .await
        .unwrap();

    assert_eq!(
        claims
            .purge_done(Duration::from_secs(3 * 3600))
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        claims.purge_done(Duration::from_secs(3600)).await.unwrap(),
        1
    );
    assert_eq!(
        claims.purge_done(Duration::from_secs(3600)).await.unwrap(),
        0
    );
    // A purged key is a new key; the others are as they were.
    assert_eq!(
        claims.claim(&old, LEASE).await.unwrap(),
        Claim::Claimed { fence: 1 }
    );
    assert_eq!(claims.claim(&recent, LEASE).await.unwrap(), Claim::Done);
    assert!(matches!(
        claims.claim(&held, LEASE).await.unwrap(),
        Claim::Held { .. }
    ));
    // Every done row, however recent, with an age of zero; an age beyond
    // any timestamp is no error.
    assert_eq!(claims.purge_done(Duration::MAX).await.unwrap(), 0);
    assert_eq!(claims.purge_done(Duration::ZERO).await.unwrap(), 1);
    assert_eq!(
        claims.claim(&recent, LEASE).await.unwrap(),
        Claim::Claimed { fence: 1 }
    );
    setup.drop_tables().await;
}
