//! jobrail on Redis: claims that run an effect once ([`RedisClaims`]).
//!
//! [`RedisClaims`] is a [`ClaimStore`] on one Redis primary, through the
//! `redis` crate's [`ConnectionManager`] (one multiplexed connection that
//! reconnects on its own). See [`jobrail::run_once`] for how a handler uses
//! a claim. The `redis` crate is re-exported as [`redis`](mod@redis), so the
//! manager you pass to [`RedisClaims::from_manager`] is of the version this
//! crate was built with.
//!
//! # Data
//!
//! A claim of the business key `K` uses two Redis keys under a prefix
//! (`jobrail:claim:` unless [`RedisClaims::with_prefix`] says otherwise),
//! with `K` between braces:
//!
//! - `<prefix>{K}` (say `jobrail:claim:{order-42}`), the claim:
//!   `held:<fence>` with the lease as its expiry while a holder has it (the
//!   classic `SET NX PX` lock), then `done:<fence>`, kept for
//!   [`done_ttl`](RedisClaims::done_ttl) (7 days unless set), once the
//!   holder completed it. Released, or its lease ended, the key is gone.
//!   A schedule's fired ticks (`schedule:<name>:<tick>`) are such done
//!   marks: a tick older than `done_ttl` reads as never fired, which only
//!   matters to a missed-tick policy that looks back further than that, and
//!   to `jobrail schedules list`, which shows it as not fired.
//! - `<prefix>{K}:fence`, the fencing counter (`INCR` on every new claim).
//!   It is kept `done_ttl` beyond the end of the latest lease or done mark,
//!   so it outlives both.
//!
//! `K` sits in a hash tag (the braces), so both keys of a claim hash to
//! the same cluster slot; only a single primary is supported all the same.
//! Keys are passed to Redis as keys, never written into a script: any
//! UTF-8 text is a key of its own.
//!
//! Every operation is one Lua script, so it is atomic on the server:
//!
//! - claim: a done mark answers [`Claim::Done`]; a held key answers
//!   [`Claim::Held`] with its `PTTL`; otherwise the counter grows and the
//!   key is set to `held:<fence>` with the lease ([`Claim::Claimed`]).
//! - complete, release, extend: only if the key still holds
//!   `held:<fence>` (a key whose lease ended has expired, so a late holder
//!   finds it gone or taken by a newer fence); then the key becomes
//!   `done:<fence>`, is deleted, or gets the new lease. Otherwise
//!   [`ClaimError::Lost`], and nothing changes.
//!
//! Any error from Redis or the connection is [`ClaimError::Store`]: the
//! operation may or may not have run (a claim that ran but whose answer
//! was lost leaves the key held until its lease ends).
//!
//! # What Redis does not guarantee
//!
//! With one primary that persists every write and never evicts, a claim
//! behaves as the contract says. Redis does not promise that much on its
//! own:
//!
//! - Replication is asynchronous. A failover to a replica that had not
//!   received the latest writes can lose a claim (a second worker claims
//!   the key while the first still holds it: two holders) or a done mark
//!   (the effect runs again).
//! - Without persistence, or with `appendfsync everysec`, a restart loses
//!   the same writes (up to about a second of them with `everysec`).
//! - A `maxmemory-policy` other than `noeviction` or a `volatile-*` one can
//!   evict claims, done marks and fencing counters like any other key.
//! - Leases run on the Redis server's clock, not the worker's: a worker
//!   paused past its lease (a long GC pause, a suspended VM) still believes
//!   it holds the key.
//! - If the fencing counter is lost (evicted, or a restart without
//!   persistence) while the claim key is gone too, fences restart at 1: a
//!   holder of an older claim could pass for a newer one, and an effect's
//!   store that checks fences refuses the new, lower ones. While the claim
//!   key exists, it still answers as it should, and a holder's successful
//!   operation puts a lost counter back.
//! - The fence makes a stale holder's completion fail, but it does not stop
//!   the stale holder's *effect*: that is fenced only if the effect's own
//!   store checks the fence. Pass it along, for example as a conditional
//!   write (`UPDATE ... SET fence = $f WHERE fence < $f`).
//!
//! When the effect is a write to a database, prefer the Postgres store
//! (`jobrail_postgres::PgClaims`): its `complete_in` records the completion in the
//! same transaction as the effect, so the two cannot part. Redis claims suit
//! effects outside any database (a call to a remote service, an email),
//! with the remote side's idempotency key where it has one.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::ConnectionManager;
use ::redis::{Client, RedisError, Script};
use jobrail::{validate_claim, BoxFuture, Claim, ClaimError, ClaimState, ClaimStore};

pub use ::redis;

/// The prefix of every Redis key unless [`RedisClaims::with_prefix`] sets
/// another.
pub const DEFAULT_PREFIX: &str = "jobrail:claim:";

/// How long a done mark is kept unless [`RedisClaims::done_ttl`] sets
/// another time: 7 days.
pub const DEFAULT_DONE_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest done mark kept: 10 years (longer times are cut to this).
const MAX_DONE_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Keeps the fencing counter `KEYS[2]` at least at `fence` and alive for
/// at least `ttl` ms from now (a lost counter is put back).
const KEEP_COUNTER: &str = r"
local function keep_counter(key, fence, ttl)
  local current = tonumber(redis.call('GET', key) or '0') or 0
  if current < fence then
    redis.call('SET', key, string.format('%d', fence), 'PX', ttl)
  elseif redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
";

/// KEYS: claim, counter. ARGV: lease ms, counter ttl ms.
/// Returns {0, fence} claimed, {1, 0} done, {2, remaining ms} held.
const CLAIM: &str = r"
local value = redis.call('GET', KEYS[1])
if value then
  local state = string.sub(value, 1, 5)
  if state == 'done:' then
    return {1, 0}
  end
  if state == 'held:' then
    local left = redis.call('PTTL', KEYS[1])
    if left < 0 then left = 0 end
    return {2, left}
  end
  return redis.error_reply('ERR jobrail: the claim key holds a value that is not a claim')
end
local fence = redis.call('INCR', KEYS[2])
keep_counter(KEYS[2], fence, tonumber(ARGV[2]))
if not redis.call('SET', KEYS[1], 'held:' .. string.format('%d', fence), 'NX', 'PX', ARGV[1]) then
  return redis.error_reply('ERR jobrail: the claim key was set during the claim')
end
return {0, fence}
";

/// KEYS: claim, counter. ARGV: fence, done ttl ms, counter ttl ms.
const COMPLETE: &str = r"
if redis.call('GET', KEYS[1]) ~= 'held:' .. ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], 'done:' .. ARGV[1], 'PX', ARGV[2])
keep_counter(KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[3]))
return 1
";

/// KEYS: claim, counter. ARGV: fence, counter ttl ms.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) ~= 'held:' .. ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
keep_counter(KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
";

/// KEYS: claim, counter. ARGV: fence, lease ms, counter ttl ms.
const EXTEND: &str = r"
if redis.call('GET', KEYS[1]) ~= 'held:' .. ARGV[1] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
keep_counter(KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[3]))
return 1
";

/// KEYS: claim. Returns {0, 0} free, {1, 0} done, {2, remaining ms} held.
const STATE: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then
  return {0, 0}
end
local state = string.sub(value, 1, 5)
if state == 'done:' then
  return {1, 0}
end
if state == 'held:' then
  local left = redis.call('PTTL', KEYS[1])
  if left < 0 then left = 0 end
  return {2, left}
end
return redis.error_reply('ERR jobrail: the claim key holds a value that is not a claim')
";

struct Scripts {
    state: Script,
    claim: Script,
    complete: Script,
    release: Script,
    extend: Script,
}

impl Scripts {
    fn new() -> Self {
        let with_counter = |body: &str| Script::new(&format!("{KEEP_COUNTER}{body}"));
        Scripts {
            state: Script::new(STATE),
            claim: with_counter(CLAIM),
            complete: with_counter(COMPLETE),
            release: with_counter(RELEASE),
            extend: with_counter(EXTEND),
        }
    }
}

/// Claims on Redis: a [`ClaimStore`] shared by every worker that connects
/// to the same Redis (see the [module docs](self) for the data, the
/// guarantees and their limits).
///
/// Clones share one connection.
///
/// ```no_run
/// use std::time::Duration;
/// use jobrail::{run_once, JobError, Once};
/// use jobrail_redis::RedisClaims;
///
/// # async fn charge(_order: &str, _fence: u64) -> Result<(), JobError> { Ok(()) }
/// # async fn handler() -> Result<(), JobError> {
/// let claims = RedisClaims::connect("redis://127.0.0.1:6379")
///     .await
///     .map_err(JobError::new)?
///     .done_ttl(Duration::from_secs(3 * 24 * 3600));
/// let once = run_once(&claims, "order-42", Duration::from_secs(60), |fence| {
///     charge("order-42", fence)
/// })
/// .await?;
/// if let Once::AlreadyDone = once {
///     // A redelivery: the order was charged before.
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisClaims {
    connection: ConnectionManager,
    scripts: Arc<Scripts>,
    prefix: String,
    done_ttl: Duration,
}

impl fmt::Debug for RedisClaims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClaims")
            .field("prefix", &self.prefix)
            .field("done_ttl", &self.done_ttl)
            .finish_non_exhaustive()
    }
}

impl RedisClaims {
    /// Connects to the Redis at `url` (`redis://[user:password@]host:port[/db]`,
    /// `rediss://` for TLS where the `redis` crate is built with it) with a
    /// [`ConnectionManager`] of the `redis` crate's default settings.
    ///
    /// [`ClaimError::Store`] if the URL does not parse or no connection can
    /// be made; the message names the URL without its password.
    ///
    /// A lost connection is made again on the next call. While Redis is
    /// unreachable, a call waits for the manager's reconnection attempts
    /// (about 10 s with the crate's defaults) before it fails with
    /// [`ClaimError::Store`]; [`from_manager`](Self::from_manager) takes a
    /// manager with other bounds.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use jobrail::{run_once, JobError, Once};
    /// use jobrail_redis::RedisClaims;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let claims = RedisClaims::connect("redis://127.0.0.1:6379").await?;
    /// let once = run_once(&claims, "charge:order-42", Duration::from_secs(60), |_fence| async {
    ///     // The effect: runs once for this key, across workers and redeliveries.
    ///     Ok::<_, JobError>("receipt-1")
    /// })
    /// .await
    /// .map_err(JobError::into_inner)?;
    /// assert!(matches!(once, Once::Ran(_) | Once::AlreadyDone));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, ClaimError> {
        let shown = redact(url);
        let client =
            Client::open(url).map_err(|e| failure(format!("invalid Redis URL `{shown}`"), e))?;
        let connection = ConnectionManager::new(client)
            .await
            .map_err(|e| failure(format!("could not connect to Redis at `{shown}`"), e))?;
        Ok(Self::from_manager(connection))
    }

    /// Claims through a connection the caller made (its own timeouts,
    /// retries, TLS).
    pub fn from_manager(connection: ConnectionManager) -> Self {
        RedisClaims {
            connection,
            scripts: Arc::new(Scripts::new()),
            prefix: DEFAULT_PREFIX.to_owned(),
            done_ttl: DEFAULT_DONE_TTL,
        }
    }

    /// Puts every Redis key under `prefix` instead of [`DEFAULT_PREFIX`].
    /// Stores with different prefixes do not see each other's claims.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long a done mark is kept ([`DEFAULT_DONE_TTL`] unless set; cut
    /// to between 1 ms and 10 years). Once it is gone, the key can be
    /// claimed again, and the effect can run again: keep it longer than any
    /// redelivery of the same business key can come.
    pub fn done_ttl(mut self, ttl: Duration) -> Self {
        self.done_ttl = ttl.clamp(Duration::from_millis(1), MAX_DONE_TTL);
        self
    }

    /// The prefix of every Redis key of this store.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How long a done mark is kept.
    pub fn done_mark_ttl(&self) -> Duration {
        self.done_ttl
    }

    fn keys(&self, key: &str) -> (String, String) {
        redis_keys(&self.prefix, key)
    }

    fn done_ttl_ms(&self) -> u64 {
        millis(self.done_ttl)
    }

    /// How long the counter is kept after a lease of `lease` starts.
    fn counter_ttl_ms(&self, lease: Duration) -> u64 {
        millis(lease).saturating_add(self.done_ttl_ms())
    }

    async fn claim_key(&self, key: &str, lease: Duration) -> Result<Claim, ClaimError> {
        validate_claim(key, lease)?;
        let (claim, counter) = self.keys(key);
        let (state, value): (i64, i64) = self
            .scripts
            .claim
            .key(claim)
            .key(counter)
            .arg(millis(lease))
            .arg(self.counter_ttl_ms(lease))
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(|e| failure(format!("claim `{key}` on Redis"), e))?;
        match (state, u64::try_from(value)) {
            (0, Ok(fence)) if fence > 0 => Ok(Claim::Claimed { fence }),
            (1, _) => Ok(Claim::Done),
            (2, Ok(left)) => Ok(Claim::Held {
                remaining: Duration::from_millis(left),
            }),
            _ => Err(ClaimError::store(format!(
                "claim `{key}` on Redis: unexpected answer ({state}, {value})"
            ))),
        }
    }

    /// Reads the state of `key` (a done mark lasts `done_ttl`: after it, the
    /// key reads free again).
    async fn state_of(&self, key: &str) -> Result<ClaimState, ClaimError> {
        let (claim, _) = self.keys(key);
        let (state, value): (i64, i64) = self
            .scripts
            .state
            .key(claim)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(|e| failure(format!("read `{key}` on Redis"), e))?;
        match (state, u64::try_from(value)) {
            (0, _) => Ok(ClaimState::Free),
            (1, _) => Ok(ClaimState::Done),
            (2, Ok(left)) => Ok(ClaimState::Held {
                remaining: Duration::from_millis(left),
            }),
            _ => Err(ClaimError::store(format!(
                "read `{key}` on Redis: unexpected answer ({state}, {value})"
            ))),
        }
    }

    /// Runs one of the scripts that act on the live claim `fence` of `key`
    /// (its ARGV after the fence given as `args`).
    async fn held(
        &self,
        doing: &str,
        script: &Script,
        key: &str,
        fence: u64,
        args: &[u64],
    ) -> Result<(), ClaimError> {
        let (claim, counter) = self.keys(key);
        let mut invocation = script.key(claim);
        invocation.key(counter).arg(fence.to_string());
        for arg in args {
            invocation.arg(*arg);
        }
        let applied: i64 = invocation
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(|e| failure(format!("{doing} `{key}` (fence {fence}) on Redis"), e))?;
        if applied == 1 {
            Ok(())
        } else {
            Err(ClaimError::Lost {
                key: key.to_owned(),
                fence,
            })
        }
    }
}

impl ClaimStore for RedisClaims {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        Box::pin(self.claim_key(key, lease))
    }

    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            let done = self.done_ttl_ms();
            // The counter outlives the done mark by another done_ttl.
            let counter = done.saturating_mul(2);
            self.held(
                "complete",
                &self.scripts.complete,
                key,
                fence,
                &[done, counter],
            )
            .await
        })
    }

    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            let counter = self.done_ttl_ms();
            self.held("release", &self.scripts.release, key, fence, &[counter])
                .await
        })
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            validate_claim(key, lease)?;
            let counter = self.counter_ttl_ms(lease);
            self.held(
                "extend",
                &self.scripts.extend,
                key,
                fence,
                &[millis(lease), counter],
            )
            .await
        })
    }

    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        Box::pin(self.state_of(key))
    }
}

/// The claim key and the fencing counter's key of `key` under `prefix`:
/// `{prefix}{key}` in a hash tag, and the same with `:fence`. A claim key
/// always ends with `}` and a counter's with `:fence`, so no key of one
/// business key is ever a key of another.
fn redis_keys(prefix: &str, key: &str) -> (String, String) {
    let claim = format!("{prefix}{{{key}}}");
    let counter = format!("{claim}:fence");
    (claim, counter)
}

/// Whole milliseconds of `duration` (at least 1: Redis refuses an expiry
/// of 0).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// What the store was doing when Redis failed, with the `redis` crate's
/// error kept as the source.
#[derive(Debug)]
struct Failure {
    doing: String,
    source: RedisError,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.doing, self.source)
    }
}

impl StdError for Failure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.source)
    }
}

fn failure(doing: String, source: RedisError) -> ClaimError {
    ClaimError::store(Failure { doing, source })
}

/// `scheme://user:secret@host` -> `scheme://user:***@host`;
/// `scheme://secret@host` -> `scheme://***@host`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => format!("{scheme}://***@{host}{tail}"),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redact("redis://ada:s3cret@127.0.0.1:6379/2"),
            "redis://ada:***@127.0.0.1:6379/2"
        );
        assert_eq!(
            redact("redis://:s3cret@host:6379"),
            "redis://:***@host:6379"
        );
        assert_eq!(redact("rediss://tok3n@host"), "rediss://***@host");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn both_keys_of_a_claim_share_a_hash_tag() {
        assert_eq!(
            redis_keys(DEFAULT_PREFIX, "order-7"),
            (
                "jobrail:claim:{order-7}".to_owned(),
                "jobrail:claim:{order-7}:fence".to_owned()
            )
        );
        // The hash tag is the text between the first `{` and the next `}`:
        // the same for both keys, braces in the business key or not.
        let tag = |k: &str| {
            let open = k.find('{').unwrap();
            let close = open + k[open..].find('}').unwrap();
            k[open + 1..close].to_owned()
        };
        for key in ["order-7", "a}b", "{x}", "ü:{"] {
            let (claim, counter) = redis_keys("p:", key);
            assert_eq!(tag(&claim), tag(&counter), "key {key:?}");
        }
    }

    #[test]
    fn leases_are_whole_milliseconds_of_at_least_one() {
        assert_eq!(millis(Duration::from_micros(1500)), 1);
        assert_eq!(millis(Duration::from_micros(10)), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }
}
