//! The claim store on a D1 database (wasm32).

use std::cell::RefCell;
use std::fmt;
use std::time::Duration;

use jobrail::{validate_claim, BoxFuture, Claim, ClaimError, ClaimState, ClaimStore};
use serde::de::DeserializeOwned;
use wasm_bindgen::JsValue;
use worker::{D1Database, D1PreparedStatement, D1Result, Env};

use super::{
    answer, check_table, is_guard_failure, is_missing_table, lease_ms, state_of, FenceRow, Sql,
    StateRow,
};
use crate::{EdgeError, EdgeErrorKind};

thread_local! {
    /// The tables this isolate has created (or found) already.
    static INSTALLED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Claims on business keys, kept in a Cloudflare D1 database: the edge's
/// [`ClaimStore`], used through [`jobrail::run_once`] and the rest of the
/// claim API exactly as natively.
///
/// ```ignore
/// use std::time::Duration;
/// use jobrail::{run_once, JobError};
/// use jobrail_edge::D1Claims;
///
/// async fn charge(env: &worker::Env, order: &str) -> Result<(), JobError> {
///     let claims = D1Claims::from_env(env, "CLAIMS_DB").map_err(JobError::new)?;
///     run_once(&claims, order, Duration::from_secs(60), |_fence| async {
///         // The effect: charge the card (with the order as the
///         // provider's idempotency key, too).
///         Ok::<_, JobError>(())
///     })
///     .await?;
///     Ok(())
/// }
/// ```
///
/// with a `[[d1_databases]]` entry whose `binding` is `CLAIMS_DB` in
/// wrangler.toml. The table (`jobrail_claims` unless
/// [`with_table`](D1Claims::with_table) names another) is created on the
/// first operation in each isolate ([`install`](D1Claims::install)).
///
/// # Why D1
///
/// - A worker that keeps failure records binds D1 already; claims need no
///   other kind of binding.
/// - D1 runs every write of a database on its one primary SQLite database,
///   one statement (or batch) at a time. A claim is a single conditional
///   upsert (`INSERT ... ON CONFLICT (key) DO UPDATE ... WHERE state =
///   'held' AND lease_until_ms <= now RETURNING fence`), so it is atomic,
///   and two invocations racing on one key are put in order: the first
///   takes the key, the second finds it held. Completion, release and
///   extension are each one `UPDATE ... WHERE key = ? AND fence = ? AND
///   state = 'held' AND lease_until_ms > now`; the row it returns, or its
///   absence, says whether the claim was still live
///   ([`ClaimError::Lost`] otherwise).
/// - The statements have the shape of the Postgres store's (the same
///   upsert, the same fenced updates), so the rules read the same on both,
///   and both run the leases on the database's clock (below).
/// - A Durable Object would be strongly consistent too (one object per
///   key), but every user's worker would have to export a Durable Object
///   class and declare a migration for it. D1 asks for neither.
///
/// # Completion with a database effect
///
/// An effect that is itself a write to the same D1 database can commit
/// with its completion, in one batch: [`complete_with`](D1Claims::complete_with),
/// the counterpart of the Postgres store's `complete_in`. Then the effect
/// happens exactly once: a claim that was lost commits nothing of it.
///
/// # Limits
///
/// - Leases run on the database's clock, not the Worker's: every statement
///   takes "now" from SQLite on the D1 primary (`julianday('now')`, in
///   milliseconds), which compares it with the lease end and computes the
///   new end and a held claim's remaining time itself. Workers in
///   different locations, whose clocks may disagree, thus measure every
///   lease against one clock. A lease starts when the statement runs on
///   the primary, so a holder learns of its claim up to a round trip
///   later, and its completion must reach the primary before the end:
///   leave a lease a margin over the effect it covers (seconds, not
///   milliseconds). The fences keep a holder whose lease ran out from
///   completing over a newer one either way. SQLite reads the clock once
///   per statement: in a claim's batch the read after the upsert sees a
///   later "now", so a held claim's remaining time is at most what was
///   left when the upsert ran, and never below zero. (Should D1 move the
///   database to another machine, leases go on on that machine's clock.)
/// - Every operation is a write to the primary database (D1's read
///   replicas are not used, not even for the read after a claim, which
///   runs in the claim's batch), so each costs a round trip to wherever
///   the database lives.
/// - Rows are kept: a done row is what makes a redelivery answer
///   [`Claim::Done`]. Delete done rows (`updated_at_ms` says when they
///   changed) only once no delivery of their key can still arrive.
///
/// Like every JavaScript-facing value, a `D1Claims` is not `Send`: build
/// one per invocation from the `Env` (it is cheap).
pub struct D1Claims {
    db: D1Database,
    table: String,
    sql: Sql,
}

impl fmt::Debug for D1Claims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("D1Claims")
            .field("table", &self.table)
            .finish()
    }
}

fn num(value: u64) -> JsValue {
    JsValue::from_f64(value as f64)
}

fn text(value: &str) -> JsValue {
    JsValue::from_str(value)
}

/// A D1 failure as a store error, with what was being done.
fn store_error(what: &str, e: impl fmt::Display) -> ClaimError {
    ClaimError::store(format!("D1 claims: {what}: {e}"))
}

impl D1Claims {
    /// The store on `db`, in the table `jobrail_claims`.
    pub fn new(db: D1Database) -> Self {
        D1Claims {
            db,
            table: super::DEFAULT_TABLE.to_string(),
            sql: Sql::for_table(super::DEFAULT_TABLE),
        }
    }

    /// The store on the D1 binding named `binding` in `env` (a
    /// `[[d1_databases]]` entry of wrangler.toml).
    pub fn from_env(env: &Env, binding: &str) -> Result<Self, EdgeError> {
        env.d1(binding).map(Self::new).map_err(|e| {
            EdgeError::new(
                EdgeErrorKind::Config,
                format!("D1 binding `{binding}` (add a [[d1_databases]] entry): {e}"),
            )
        })
    }

    /// The same store in the table `table` instead: ASCII letters, digits
    /// and `_`, not starting with a digit, at most 64 characters (the name
    /// goes into the SQL text).
    pub fn with_table(self, table: &str) -> Result<Self, EdgeError> {
        check_table(table).map_err(|e| EdgeError::new(EdgeErrorKind::Config, e))?;
        Ok(D1Claims {
            table: table.to_string(),
            sql: Sql::for_table(table),
            ..self
        })
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The database the claims are kept in: prepare the statements of a
    /// [`complete_with`](D1Claims::complete_with) on it.
    pub fn database(&self) -> &D1Database {
        &self.db
    }

    /// Creates the table if it is missing (idempotent). Every operation
    /// calls it on the isolate's first use of the table, so calling it is
    /// only needed to find a problem early.
    pub async fn install(&self) -> Result<(), ClaimError> {
        let result = self.statement(&self.sql.schema, &[])?.run().await;
        checked(result, "creating the claims table")?;
        INSTALLED.with(|t| {
            let mut installed = t.borrow_mut();
            if !installed.contains(&self.table) {
                installed.push(self.table.clone());
            }
        });
        Ok(())
    }

    async fn ensure_installed(&self) -> Result<(), ClaimError> {
        if INSTALLED.with(|t| t.borrow().contains(&self.table)) {
            return Ok(());
        }
        self.install().await
    }

    fn statement(&self, sql: &str, args: &[JsValue]) -> Result<D1PreparedStatement, ClaimError> {
        self.db
            .prepare(sql)
            .bind(args)
            .map_err(|e| store_error("binding a statement", e))
    }

    /// Runs `op` once the table exists; if D1 says it does not (another
    /// database behind the same table name in this isolate, or a dropped
    /// table), creates it and runs `op` again.
    async fn with_table_ready<T, F, Fut>(&self, op: F) -> Result<T, ClaimError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClaimError>>,
    {
        self.ensure_installed().await?;
        match op().await {
            Err(ClaimError::Store(e)) if is_missing_table(&e.to_string(), &self.table) => {
                self.install().await?;
                op().await
            }
            other => other,
        }
    }

    /// Completes the claim `fence` of `key` and runs `effects`, statements
    /// on the store's [database](D1Claims::database), in one D1 batch:
    /// both commit, or neither does. The counterpart of the Postgres
    /// store's `complete_in`, for effects that are writes to D1.
    ///
    /// The batch (one transaction on the D1 primary) opens with a guard
    /// that fails it unless `fence` is the key's live claim, on the
    /// database's clock; the completion follows, then `effects` in order.
    /// Their results come back in that order (a `RETURNING` clause's rows
    /// included).
    ///
    /// - [`ClaimError::Lost`]: the lease had ended, a newer claim took the
    ///   key, or it is done. The batch rolled back: nothing of `effects`
    ///   was written, and the newer holder's effect happens instead.
    /// - [`ClaimError::Store`]: a statement failed (one of `effects`, say)
    ///   and the batch rolled back, so the claim is still held: release it
    ///   or let the lease end. Or D1's answer was lost, when the batch may
    ///   have committed; a retry's claim then finds the key done.
    ///
    /// A handler claims the key itself (`run_once` would complete the
    /// claim on its own), and writes its effect with the completion:
    ///
    /// ```ignore
    /// use std::time::Duration;
    /// use jobrail::{ClaimStore, JobError};
    /// use jobrail_edge::D1Claims;
    ///
    /// async fn refund(claims: &D1Claims, order: &str, cents: u64) -> Result<(), JobError> {
    ///     let key = format!("refund:{order}");
    ///     let claim = claims.claim(&key, Duration::from_secs(60)).await.map_err(JobError::new)?;
    ///     // Done already: skip. Held by another invocation: retry when its lease ends.
    ///     let Some(fence) = claim.proceed(&key)? else {
    ///         return Ok(());
    ///     };
    ///     let insert = claims
    ///         .database()
    ///         .prepare("INSERT INTO refunds (order_id, cents) VALUES (?1, ?2)")
    ///         .bind(&[order.into(), (cents as f64).into()])
    ///         .map_err(|e| JobError::new(e.to_string()))?;
    ///     // The refund row and the completion, at once; a lost claim writes
    ///     // neither, and the delivery retries.
    ///     claims
    ///         .complete_with(&key, fence, vec![insert])
    ///         .await
    ///         .map_err(JobError::new)?;
    ///     Ok(())
    /// }
    /// ```
    pub async fn complete_with(
        &self,
        key: &str,
        fence: u64,
        effects: Vec<D1PreparedStatement>,
    ) -> Result<Vec<D1Result>, ClaimError> {
        const WHAT: &str = "completing a claim with its effects";
        let effects = &effects;
        self.with_table_ready(move || async move {
            let args = [text(key), num(fence)];
            let mut batch = Vec::with_capacity(effects.len() + 2);
            batch.push(self.statement(&self.sql.guard, &args)?);
            batch.push(self.statement(&self.sql.settle, &args)?);
            batch.extend(effects.iter().cloned());
            let mut results = match self.db.batch(batch).await {
                Ok(results) => results,
                Err(e) => {
                    let message = e.to_string();
                    return Err(if is_guard_failure(&message, &self.table) {
                        ClaimError::Lost {
                            key: key.to_owned(),
                            fence,
                        }
                    } else {
                        store_error(WHAT, message)
                    });
                }
            };
            if results.len() != effects.len() + 2 {
                return Err(store_error(
                    WHAT,
                    format!(
                        "{} results for a batch of {}",
                        results.len(),
                        effects.len() + 2
                    ),
                ));
            }
            let effects = results.split_off(2);
            let settled: Vec<FenceRow> = rows(&results[1], WHAT)?;
            if settled.is_empty() {
                // Cannot happen: the guard found the claim live in this
                // transaction, and nothing ran in between.
                return Err(store_error(
                    WHAT,
                    "the completion matched no row after the guard passed",
                ));
            }
            Ok(effects)
        })
        .await
    }

    async fn claim_now(&self, key: &str, lease: Duration) -> Result<Claim, ClaimError> {
        validate_claim(key, lease)?;
        self.with_table_ready(move || async move {
            let upsert = self.statement(&self.sql.claim, &[text(key), num(lease_ms(lease))])?;
            let read = self.statement(&self.sql.read, &[text(key)])?;
            // One batch is one transaction: the row read is the one the
            // upsert left, whatever other invocations do; the read's clock
            // is the upsert's or later.
            let results = self
                .db
                .batch(vec![upsert, read])
                .await
                .map_err(|e| store_error("claiming", e))?;
            let [upserted, read] = results.as_slice() else {
                return Err(store_error(
                    "claiming",
                    format!("{} results for a batch of 2", results.len()),
                ));
            };
            let claimed: Vec<FenceRow> = rows(upserted, "claiming")?;
            let row: Vec<StateRow> = rows(read, "reading a claim")?;
            answer(claimed.first(), row.first()).map_err(|e| store_error("claiming", e))
        })
        .await
    }

    /// The key's state, by one `SELECT` on the database's clock (no write;
    /// the table is created first if this isolate has not seen it).
    async fn state_now(&self, key: &str) -> Result<ClaimState, ClaimError> {
        validate_claim(key, Duration::from_millis(1))?;
        self.with_table_ready(move || async move {
            let what = "reading a claim's state";
            let result = self.statement(&self.sql.read, &[text(key)])?.all().await;
            let row: Vec<StateRow> = rows(&checked(result, what)?, what)?;
            state_of(row.first()).map_err(|e| store_error(what, e))
        })
        .await
    }

    /// Runs the fenced `UPDATE` `sql` on the live claim `fence` of `key`:
    /// `Lost` when it changed nothing.
    async fn on_live(
        &self,
        sql: &str,
        what: &str,
        key: &str,
        fence: u64,
        lease: Option<Duration>,
    ) -> Result<(), ClaimError> {
        self.with_table_ready(move || async move {
            let mut args = vec![text(key), num(fence)];
            if let Some(lease) = lease {
                args.push(num(lease_ms(lease)));
            }
            let result = self.statement(sql, &args)?.all().await;
            let changed: Vec<FenceRow> = rows(&checked(result, what)?, what)?;
            if changed.is_empty() {
                Err(ClaimError::Lost {
                    key: key.to_owned(),
                    fence,
                })
            } else {
                Ok(())
            }
        })
        .await
    }
}

/// A statement's result, or its error as a store error.
fn checked(result: worker::Result<D1Result>, what: &str) -> Result<D1Result, ClaimError> {
    let result = result.map_err(|e| store_error(what, e))?;
    match result.error() {
        Some(e) => Err(store_error(what, e)),
        None => Ok(result),
    }
}

fn rows<T: DeserializeOwned>(result: &D1Result, what: &str) -> Result<Vec<T>, ClaimError> {
    if let Some(e) = result.error() {
        return Err(store_error(what, e));
    }
    result.results::<T>().map_err(|e| store_error(what, e))
}

impl ClaimStore for D1Claims {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        Box::pin(self.claim_now(key, lease))
    }

    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.on_live(&self.sql.complete, "completing a claim", key, fence, None))
    }

    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(self.on_live(&self.sql.release, "releasing a claim", key, fence, None))
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            validate_claim(key, lease)?;
            self.on_live(
                &self.sql.extend,
                "extending a claim",
                key,
                fence,
                Some(lease),
            )
            .await
        })
    }

    /// One `SELECT`: free (no row, or a lease that has ended), held with
    /// the lease's time left on the database's clock, or done.
    fn state<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<ClaimState, ClaimError>> {
        Box::pin(self.state_now(key))
    }
}
