//! `RedisClaims` beyond the claim-store suite: the done mark's lifetime, a
//! lost fencing counter, connections killed or cut, odd keys, prefixes,
//! and bad URLs, on the Redis at `REDIS_URL` (`redis://127.0.0.1:6379`
//! unless set). Every test puts its keys under a prefix of its own.

use std::time::Duration;

use jobrail::{Claim, ClaimError, ClaimStore, MAX_CLAIM_KEY_BYTES};
use jobrail_conformance::servers::Relay;
use jobrail_redis::RedisClaims;
use redis::aio::MultiplexedConnection;
use redis::AsyncCommands;

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A prefix no other test or run uses.
fn prefix(test: &str) -> String {
    format!("jobrail-test:{test}:{}:", jobrail::new_message_id())
}

async fn store(prefix: &str) -> RedisClaims {
    RedisClaims::connect(&url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .with_prefix(prefix)
}

/// A plain connection for looking at (and breaking) what the store wrote.
async fn raw() -> MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn claimed(store: &RedisClaims, key: &str, lease: Duration) -> u64 {
    match store.claim(key, lease).await {
        Ok(Claim::Claimed { fence }) => fence,
        other => panic!("claim `{key}`: expected Claimed, got {other:?}"),
    }
}

fn assert_lost(result: Result<(), ClaimError>, what: &str) {
    assert!(
        matches!(result, Err(ClaimError::Lost { .. })),
        "{what}: expected ClaimError::Lost, got {result:?}"
    );
}

/// The Redis keys are the documented ones: `{prefix}{key}` holding
/// `held:<fence>` with the lease, then `done:<fence>` with the done TTL,
/// and the counter `{prefix}{key}:fence` outliving both.
#[tokio::test]
async fn the_data_is_as_documented() {
    let prefix = prefix("data");
    let done_ttl = Duration::from_secs(3600);
    let store = store(&prefix).await.done_ttl(done_ttl);
    let mut raw = raw().await;
    let (claim_key, counter_key) = (
        format!("{prefix}{{order-7}}"),
        format!("{prefix}{{order-7}}:fence"),
    );

    let lease = Duration::from_secs(30);
    let fence = claimed(&store, "order-7", lease).await;
    assert_eq!(fence, 1);
    let value: String = raw.get(&claim_key).await.unwrap();
    assert_eq!(value, "held:1");
    let left: i64 = raw.pttl(&claim_key).await.unwrap();
    assert!(left > 25_000 && left <= 30_000, "lease pttl {left}");
    let counter: String = raw.get(&counter_key).await.unwrap();
    assert_eq!(counter, "1");
    let counter_left: i64 = raw.pttl(&counter_key).await.unwrap();
    assert!(
        counter_left > 3_600_000,
        "the counter must outlive lease and done mark: pttl {counter_left}"
    );

    store.complete("order-7", fence).await.unwrap();
    let value: String = raw.get(&claim_key).await.unwrap();
    assert_eq!(value, "done:1");
    let left: i64 = raw.pttl(&claim_key).await.unwrap();
    assert!(left > 3_590_000 && left <= 3_600_000, "done pttl {left}");
    let counter_left: i64 = raw.pttl(&counter_key).await.unwrap();
    assert!(
        counter_left > left,
        "counter {counter_left} ms, done mark {left} ms"
    );
}

/// Once the done mark's TTL has passed, the key can be claimed again, with
/// a higher fence.
#[tokio::test]
async fn a_done_mark_expires_after_its_ttl() {
    let prefix = prefix("done-ttl");
    let store = store(&prefix).await.done_ttl(Duration::from_millis(400));
    assert_eq!(store.done_mark_ttl(), Duration::from_millis(400));
    let lease = Duration::from_secs(30);
    let first = claimed(&store, "report-1", lease).await;
    store.complete("report-1", first).await.unwrap();
    assert_eq!(store.claim("report-1", lease).await.unwrap(), Claim::Done);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.claim("report-1", lease).await.unwrap(),
        Claim::Done,
        "the done mark went early"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = claimed(&store, "report-1", lease).await;
    assert!(second > first, "fence {second} after {first}");
    // The first holder's completion, however late, is still refused.
    assert_lost(store.complete("report-1", first).await, "an old completion");
}

/// A lost fencing counter: held and done keys still answer as they should,
/// and a holder's operation puts the counter back; with the claim key gone
/// too, fences restart at 1 (as documented).
#[tokio::test]
async fn a_lost_fence_counter() {
    let prefix = prefix("lost-counter");
    let (a, b) = (store(&prefix).await, store(&prefix).await);
    let mut raw = raw().await;
    let counter = |key: &str| format!("{prefix}{{{key}}}:fence");
    let lease = Duration::from_secs(30);

    // Held: the key answers held, the holder completes, and its completion
    // puts the counter back.
    let f = claimed(&a, "held", lease).await;
    let _: () = raw.del(counter("held")).await.unwrap();
    assert!(matches!(
        b.claim("held", lease).await.unwrap(),
        Claim::Held { .. }
    ));
    assert_lost(a.complete("held", f + 1).await, "a fence never given");
    a.complete("held", f).await.unwrap();
    let restored: Option<u64> = raw.get(counter("held")).await.unwrap();
    assert_eq!(restored, Some(f));
    let counter_left: i64 = raw.pttl(counter("held")).await.unwrap();
    assert!(
        counter_left > 0,
        "the restored counter expires: {counter_left}"
    );

    // Done: the key answers done without its counter.
    let _: () = raw.del(counter("held")).await.unwrap();
    assert_eq!(b.claim("held", lease).await.unwrap(), Claim::Done);

    // A release (and an extension) put a lost counter back too: the next
    // fence is still higher.
    let f1 = claimed(&a, "free", lease).await;
    a.release("free", f1).await.unwrap();
    let f2 = claimed(&a, "free", lease).await;
    assert_eq!(f2, f1 + 1);
    let _: () = raw.del(counter("free")).await.unwrap();
    a.extend("free", f2, lease).await.unwrap();
    let _: () = raw.del(counter("free")).await.unwrap();
    a.release("free", f2).await.unwrap();
    let f3 = claimed(&b, "free", lease).await;
    assert_eq!(f3, f2 + 1, "the counter was put back by the release");

    // Counter and claim key both gone: fences restart.
    b.release("free", f3).await.unwrap();
    let _: () = raw.del(counter("free")).await.unwrap();
    assert_eq!(claimed(&b, "free", lease).await, 1);
}

/// The store's connection is killed by the server (`CLIENT KILL ID`): a
/// call may fail with a store error, never panics, and the manager's new
/// connection serves the next calls, with the claims intact.
#[tokio::test]
async fn a_killed_connection_is_replaced() {
    let prefix = prefix("killed");
    let client = redis::Client::open(url()).unwrap();
    let mut manager = redis::aio::ConnectionManager::new(client).await.unwrap();
    let store = RedisClaims::from_manager(manager.clone()).with_prefix(&prefix);
    let lease = Duration::from_secs(30);
    let f = claimed(&store, "k", lease).await;

    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut manager)
        .await
        .unwrap();
    let mut raw = raw().await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(killed, 1, "the store's connection was not found");

    let mut store_errors = 0;
    let mut answer = None;
    for _ in 0..20 {
        match store.claim("k", lease).await {
            Ok(claim) => {
                answer = Some(claim);
                break;
            }
            Err(ClaimError::Store(e)) => {
                store_errors += 1;
                eprintln!("after the kill: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("after the kill: expected a store error, got {other:?}"),
        }
    }
    assert!(
        matches!(answer, Some(Claim::Held { .. })),
        "no answer after {store_errors} store errors: {answer:?}"
    );
    let new_id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut manager)
        .await
        .unwrap();
    assert_ne!(new_id, id, "the connection was not replaced");
    store.complete("k", f).await.unwrap();
    assert_eq!(store.claim("k", lease).await.unwrap(), Claim::Done);
}

/// Redis goes away (a relay in front of it stops): calls fail with store
/// errors in bounded time; when it is back, calls work again.
#[tokio::test]
async fn redis_going_away_and_coming_back() {
    let prefix = prefix("away");
    let mut relay = Relay::start(Relay::address_of(&url())).await;
    let store = RedisClaims::connect(&relay.url_for(&url()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .with_prefix(&prefix);
    let lease = Duration::from_secs(30);
    let f = claimed(&store, "k", lease).await;

    relay.go_down().await;
    for attempt in 0..2 {
        let result = tokio::time::timeout(Duration::from_secs(30), store.complete("k", f))
            .await
            .unwrap_or_else(|_| panic!("attempt {attempt}: no answer in 30 s"));
        match result {
            Err(ClaimError::Store(e)) => eprintln!("while down: {e}"),
            other => panic!("attempt {attempt} while down: expected a store error, got {other:?}"),
        }
    }

    relay.come_back().await;
    let mut completed = false;
    for _ in 0..50 {
        match store.complete("k", f).await {
            Ok(()) => {
                completed = true;
                break;
            }
            Err(ClaimError::Store(_)) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(other) => panic!("after coming back: {other:?}"),
        }
    }
    assert!(completed, "no call worked after Redis came back");
    assert_eq!(store.claim("k", lease).await.unwrap(), Claim::Done);
}

/// Keys with bytes that mean something to Redis, to Lua or to the key
/// layout are keys of their own, stored under exactly their own name.
#[tokio::test]
async fn odd_keys_are_keys_of_their_own() {
    let prefix = prefix("odd");
    let store = store(&prefix).await;
    let mut raw = raw().await;
    let lease = Duration::from_secs(30);
    let longest = "é".repeat(MAX_CLAIM_KEY_BYTES / 2);
    let keys = [
        "x",
        "x}",
        "x}:fence",
        "x:fence",
        "{x}",
        "}",
        "{",
        "a b\tc\nd\r\n",
        "held:1",
        "done:1",
        "') .. redis.call('SET', KEYS[1], 'injected') --",
        "]]..\"%s%d\\0",
        "\0nul\0",
        "ünï🦀code",
        "*",
        "?[a-z]",
        longest.as_str(),
    ];
    let mut fences = Vec::new();
    for key in keys {
        fences.push(claimed(&store, key, lease).await);
    }
    assert!(
        fences.iter().all(|&f| f == 1),
        "every key starts at 1: {fences:?}"
    );
    for (i, key) in keys.iter().enumerate() {
        let stored: Option<String> = raw.get(format!("{prefix}{{{key}}}")).await.unwrap();
        assert_eq!(stored.as_deref(), Some("held:1"), "key {key:?}");
        if i % 2 == 0 {
            store.complete(key, 1).await.unwrap();
        }
    }
    for (i, key) in keys.iter().enumerate() {
        let answer = store.claim(key, lease).await.unwrap();
        if i % 2 == 0 {
            assert_eq!(answer, Claim::Done, "key {key:?}");
        } else {
            assert!(
                matches!(answer, Claim::Held { .. }),
                "key {key:?}: {answer:?}"
            );
        }
    }
    let alive: bool = raw.exists(format!("{prefix}{{x}}")).await.unwrap();
    assert!(alive, "the store is still there");
}

/// Two prefixes on one Redis do not see each other's claims or fences.
#[tokio::test]
async fn prefixes_are_isolated() {
    let base = prefix("isolated");
    let a = store(&format!("{base}a:")).await;
    let b = store(&format!("{base}b:")).await;
    assert_eq!(a.prefix(), format!("{base}a:"));
    let lease = Duration::from_secs(30);
    let fa = claimed(&a, "order-1", lease).await;
    let fb = claimed(&b, "order-1", lease).await;
    assert_eq!((fa, fb), (1, 1));
    a.complete("order-1", fa).await.unwrap();
    assert_eq!(a.claim("order-1", lease).await.unwrap(), Claim::Done);
    assert!(matches!(
        b.claim("order-1", lease).await.unwrap(),
        Claim::Held { .. }
    ));
    b.release("order-1", fb).await.unwrap();
    assert_eq!(claimed(&b, "order-1", lease).await, 2);
    assert_eq!(a.claim("order-1", lease).await.unwrap(), Claim::Done);
}

/// A URL that does not parse, or where nothing listens, is a store error
/// that says so, without the URL's password.
#[tokio::test]
async fn bad_urls_are_store_errors() {
    match RedisClaims::connect("not a url").await {
        Err(ClaimError::Store(e)) => {
            let text = e.to_string();
            assert!(text.contains("invalid Redis URL `not a url`"), "{text}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    match RedisClaims::connect("http://127.0.0.1:6379").await {
        Err(ClaimError::Store(e)) => {
            assert!(e.to_string().contains("invalid Redis URL"), "{e}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    let port = jobrail_conformance::servers::free_port();
    let url = format!("redis://ada:s3cret@127.0.0.1:{port}");
    let started = std::time::Instant::now();
    match RedisClaims::connect(&url).await {
        Err(ClaimError::Store(e)) => {
            let text = e.to_string();
            assert!(
                text.contains(&format!(
                    "could not connect to Redis at `redis://ada:***@127.0.0.1:{port}`"
                )),
                "{text}"
            );
            assert!(!text.contains("s3cret"), "{text}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the refusal took {:?}",
        started.elapsed()
    );
}
