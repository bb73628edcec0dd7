//! Claims on business keys in Cloudflare D1: the edge's
//! [`jobrail::ClaimStore`] (`D1Claims`, wasm32).
//!
//! This file holds what does not need a Worker, so that it is unit-tested
//! natively: the table's SQL, the check of a table name, and how the rows a
//! claim reads back become a [`Claim`]. The store itself (the D1 calls) is
//! in `claims/d1.rs`; its documentation, with why D1 and the limits, is on
//! `D1Claims`.

use std::time::Duration;

use jobrail::{Claim, ClaimState};
use serde::Deserialize;

#[cfg(target_arch = "wasm32")]
mod d1;
#[cfg(target_arch = "wasm32")]
pub use d1::D1Claims;

/// The table a store uses unless told otherwise.
pub(crate) const DEFAULT_TABLE: &str = "jobrail_claims";

/// The longest table name accepted.
const MAX_TABLE_NAME: usize = 64;

/// Why `table` cannot name the claims table, if it cannot: it goes into the
/// SQL text, so it must be a plain identifier (ASCII letters, digits and
/// `_`, not starting with a digit, at most 64 characters).
pub(crate) fn check_table(table: &str) -> Result<(), String> {
    let plain = table
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !plain || table.len() > MAX_TABLE_NAME {
        return Err(format!(
            "claims table `{table}` must be 1 to {MAX_TABLE_NAME} ASCII letters, digits and `_`, not starting with a digit"
        ));
    }
    Ok(())
}

/// Now on the database's clock, in whole milliseconds since the Unix epoch.
///
/// SQLite fixes `'now'` for the whole of one statement (every use in it
/// agrees), and reads it anew for each statement of a batch. `julianday` is
/// in every SQLite; `unixepoch('subsec')` would need 3.42. The Julian day
/// is a double, so the product is rounded, not truncated, back to the
/// millisecond SQLite keeps.
pub(crate) const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

/// The statements of one table. Every time in them is the database's
/// ([`NOW_MS`]); parameters: `?1` the key, then the lease in milliseconds
/// (claim), or the fence and, for extend, the lease in milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sql {
    /// Creates the table if it is missing.
    pub(crate) schema: String,
    /// Inserts a held row at fence 1, or takes the key over from an ended
    /// lease with the next fence; returns the fence only when this call
    /// holds the key (`?2`: the lease).
    pub(crate) claim: String,
    /// Reads the key's state and how long its lease has left, never less
    /// than zero (in the claim's batch, after the upsert; alone, for
    /// `ClaimStore::state`: a read, no write).
    pub(crate) read: String,
    /// Marks the live claim `?2` done.
    pub(crate) complete: String,
    /// Ends the live claim `?2`'s lease now, without completing it.
    pub(crate) release: String,
    /// Moves the live claim `?2`'s lease end to `?3` from now.
    pub(crate) extend: String,
    /// First in a completion's batch: fails the statement, and so the
    /// batch, unless `?2` is the live claim of the key. It inserts a row
    /// with a NULL `state` only when the claim is not live, and `state` is
    /// NOT NULL; a live claim inserts nothing.
    pub(crate) guard: String,
    /// Second in a completion's batch: marks the claim `?2` done, with no
    /// look at the clock. The guard just found it live, and a batch is one
    /// transaction, so nothing else wrote the row in between; a second
    /// reading of the clock could only disagree with the guard's.
    pub(crate) settle: String,
}

/// The condition every operation on a held claim needs: `?2` is the key's
/// latest fence, the key is not done, and its lease runs past now.
fn live() -> String {
    format!("key = ?1 AND fence = ?2 AND state = 'held' AND lease_until_ms > {NOW_MS}")
}

impl Sql {
    /// The statements for `table` (a name [`check_table`] accepted).
    pub(crate) fn for_table(table: &str) -> Sql {
        let t = table;
        let now = NOW_MS;
        let live = live();
        Sql {
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    key TEXT PRIMARY KEY NOT NULL,
                    fence INTEGER NOT NULL,
                    state TEXT NOT NULL CHECK (state IN ('held', 'done')),
                    lease_until_ms INTEGER NOT NULL,
                    updated_at_ms INTEGER NOT NULL
                )"
            ),
            // `excluded.updated_at_ms` is this statement's now.
            claim: format!(
                "INSERT INTO {t} (key, fence, state, lease_until_ms, updated_at_ms)
                 VALUES (?1, 1, 'held', {now} + CAST(?2 AS INTEGER), {now})
                 ON CONFLICT (key) DO UPDATE
                   SET fence = fence + 1, lease_until_ms = excluded.lease_until_ms,
                       updated_at_ms = excluded.updated_at_ms
                   WHERE state = 'held' AND lease_until_ms <= excluded.updated_at_ms
                 RETURNING fence"
            ),
            read: format!(
                "SELECT state, MAX(0, lease_until_ms - {now}) AS remaining_ms
                 FROM {t} WHERE key = ?1"
            ),
            complete: format!(
                "UPDATE {t} SET state = 'done', lease_until_ms = 0, updated_at_ms = {now}
                 WHERE {live} RETURNING fence"
            ),
            release: format!(
                "UPDATE {t} SET lease_until_ms = 0, updated_at_ms = {now}
                 WHERE {live} RETURNING fence"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until_ms = {now} + CAST(?3 AS INTEGER), updated_at_ms = {now}
                 WHERE {live} RETURNING fence"
            ),
            guard: format!(
                "INSERT INTO {t} (key, fence, state, lease_until_ms, updated_at_ms)
                 SELECT ?1, ?2, NULL, 0, 0 WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE {live})"
            ),
            settle: format!(
                "UPDATE {t} SET state = 'done', lease_until_ms = 0, updated_at_ms = {now}
                 WHERE key = ?1 AND fence = ?2 AND state = 'held' RETURNING fence"
            ),
        }
    }
}

/// A lease in whole milliseconds, rounded up (a store never shortens it).
pub(crate) fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// The fence a `RETURNING fence` gave back (D1 hands numbers to JavaScript
/// as doubles).
#[derive(Debug, Deserialize)]
pub(crate) struct FenceRow {
    pub(crate) fence: f64,
}

/// The key's row as the claim's batch read it after the upsert.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct StateRow {
    pub(crate) state: String,
    /// Until the lease ends, on the database's clock when the read ran.
    pub(crate) remaining_ms: f64,
}

/// A fence read back from D1: a whole number from 1 up.
pub(crate) fn fence_of(value: f64) -> Result<u64, String> {
    if value.is_finite() && value >= 1.0 && value.fract() == 0.0 && value < 2f64.powi(53) {
        Ok(value as u64)
    } else {
        Err(format!("the claims table holds a fence of {value}"))
    }
}

/// What a claim found, from its batch's two results: the fence the upsert
/// returned (when this call took the key) and the key's row after it.
///
/// The read runs after the upsert, on a clock that has not gone back, so
/// a lease the upsert found live has at most `remaining_ms` left, and one
/// that ended in between is held with nothing left (a retry at once
/// takes it).
pub(crate) fn answer(claimed: Option<&FenceRow>, row: Option<&StateRow>) -> Result<Claim, String> {
    if let Some(claimed) = claimed {
        return Ok(Claim::Claimed {
            fence: fence_of(claimed.fence)?,
        });
    }
    let Some(row) = row else {
        return Err("the claim's row is missing after its upsert".into());
    };
    match row.state.as_str() {
        "done" => Ok(Claim::Done),
        "held" => {
            // `as` saturates, and a NaN becomes 0.
            let remaining = row.remaining_ms.max(0.0) as u64;
            Ok(Claim::Held {
                remaining: Duration::from_millis(remaining),
            })
        }
        other => Err(format!("the claims table holds an unknown state `{other}`")),
    }
}

/// The state of a key from its row, read on its own (`ClaimStore::state`):
/// no row, or a held row whose lease has ended, is free (the next claim
/// takes it); a held row with time left is held; a done row is done.
pub(crate) fn state_of(row: Option<&StateRow>) -> Result<ClaimState, String> {
    let Some(row) = row else {
        return Ok(ClaimState::Free);
    };
    match row.state.as_str() {
        "done" => Ok(ClaimState::Done),
        "held" => {
            // `as` saturates, and a NaN becomes 0.
            let remaining = row.remaining_ms.max(0.0) as u64;
            Ok(if remaining == 0 {
                ClaimState::Free
            } else {
                ClaimState::Held {
                    remaining: Duration::from_millis(remaining),
                }
            })
        }
        other => Err(format!("the claims table holds an unknown state `{other}`")),
    }
}

/// Whether `message` names `table` right after `prefix`, and ends the name
/// there (so `claims` is not found in a message about `claims_archive`).
fn names_after(message: &str, prefix: &str, table: &str) -> bool {
    let needle = format!("{prefix}{table}");
    message.match_indices(&needle).any(|(at, _)| {
        !message[at + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Whether a D1 error says the claims table `table` is missing (it was
/// dropped, or the isolate's note that it exists was about another
/// database).
pub(crate) fn is_missing_table(message: &str, table: &str) -> bool {
    names_after(message, "no such table: ", table)
        || names_after(message, "no such table: main.", table)
}

/// Whether a completion's batch failed on its guard, that is because the
/// claim was not live: SQLite's message for the NULL `state` the guard
/// inserts then.
pub(crate) fn is_guard_failure(message: &str, table: &str) -> bool {
    names_after(
        message,
        "NOT NULL constraint failed: ",
        &format!("{table}.state"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        for good in ["jobrail_claims", "_x", "Claims2", &"a".repeat(64)] {
            assert_eq!(check_table(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "2claims",
            "claims; DROP TABLE x",
            "claims-x",
            "cl\"aims",
            "ünï",
            &"a".repeat(65),
        ] {
            assert!(check_table(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(check_table(DEFAULT_TABLE), Ok(()));
    }

    /// The highest `?N` parameter in `sql` (0 without any).
    fn arity(sql: &str) -> u32 {
        sql.split('?')
            .skip(1)
            .filter_map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn the_sql_names_the_table_and_fences_every_write() {
        let sql = Sql::for_table("my_claims");
        let all = [
            &sql.schema,
            &sql.claim,
            &sql.read,
            &sql.complete,
            &sql.release,
            &sql.extend,
            &sql.guard,
            &sql.settle,
        ];
        for text in all {
            assert!(text.contains("my_claims"), "{text}");
            assert!(!text.contains("{t}") && !text.contains("{now}"), "{text}");
        }
        // A key is taken over only when held under an ended lease: never
        // when done, never while live.
        assert!(sql
            .claim
            .contains("WHERE state = 'held' AND lease_until_ms <= excluded.updated_at_ms"));
        assert!(sql.claim.contains("fence = fence + 1"));
        assert!(sql.claim.contains("RETURNING fence"));
        // Complete, release and extend only touch the live, latest claim;
        // the guard fails unless the claim is live.
        for text in [&sql.complete, &sql.release, &sql.extend, &sql.guard] {
            assert!(text.contains(&live()), "{text}");
        }
        for text in [&sql.complete, &sql.release, &sql.extend, &sql.settle] {
            assert!(text.contains("RETURNING fence"), "{text}");
        }
        assert!(sql.complete.contains("state = 'done'"));
        assert!(sql.settle.contains("state = 'done'"));
        assert!(sql
            .settle
            .contains("WHERE key = ?1 AND fence = ?2 AND state = 'held'"));
        assert!(sql.guard.contains("NULL, 0, 0 WHERE NOT EXISTS"));
    }

    #[test]
    fn every_time_is_the_databases() {
        let sql = Sql::for_table("jobrail_claims");
        // The parameters the store binds: the key, then the lease (claim)
        // or the fence (and the lease, for extend). None is a time.
        for (text, params) in [
            (&sql.schema, 0),
            (&sql.claim, 2),
            (&sql.read, 1),
            (&sql.complete, 2),
            (&sql.release, 2),
            (&sql.extend, 3),
            (&sql.guard, 2),
            (&sql.settle, 2),
        ] {
            assert_eq!(arity(text), params, "{text}");
        }
        // Every comparison with the lease end and every new lease end is
        // on the database's clock.
        assert!(live().ends_with(&format!("lease_until_ms > {NOW_MS}")));
        assert!(sql
            .claim
            .contains(&format!("{NOW_MS} + CAST(?2 AS INTEGER), {NOW_MS})")));
        assert!(sql
            .extend
            .contains(&format!("lease_until_ms = {NOW_MS} + CAST(?3 AS INTEGER)")));
        assert!(sql.read.contains(&format!(
            "MAX(0, lease_until_ms - {NOW_MS}) AS remaining_ms"
        )));
        for text in [&sql.complete, &sql.release, &sql.extend, &sql.settle] {
            assert!(
                text.contains(&format!("updated_at_ms = {NOW_MS}")),
                "{text}"
            );
        }
        // Rounded, not truncated: a Julian day in a double is a few
        // microseconds off the millisecond SQLite keeps.
        assert!(NOW_MS.starts_with("CAST(ROUND((julianday('now') - 2440587.5) * 86400000)"));
        assert!(!NOW_MS.contains('?'));
    }

    #[test]
    fn leases_round_up_to_whole_milliseconds() {
        assert_eq!(lease_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(lease_ms(Duration::from_micros(1500)), 2);
        assert_eq!(lease_ms(Duration::from_nanos(1)), 1);
        assert_eq!(lease_ms(jobrail::MAX_CLAIM_LEASE), 7 * 24 * 3600 * 1000);
    }

    #[test]
    fn fences_are_whole_numbers_from_one() {
        assert_eq!(fence_of(1.0), Ok(1));
        assert_eq!(fence_of(42.0), Ok(42));
        for bad in [0.0, -1.0, 1.5, f64::NAN, f64::INFINITY, 2f64.powi(60)] {
            assert!(fence_of(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rows_become_claims() {
        let held = |state: &str, remaining: f64| StateRow {
            state: state.into(),
            remaining_ms: remaining,
        };
        // The upsert returned a fence: this call holds the key, whatever the row says.
        assert_eq!(
            answer(Some(&FenceRow { fence: 3.0 }), Some(&held("held", 10.0))),
            Ok(Claim::Claimed { fence: 3 })
        );
        assert_eq!(answer(None, Some(&held("done", 0.0))), Ok(Claim::Done));
        assert_eq!(
            answer(None, Some(&held("held", 2500.0))),
            Ok(Claim::Held {
                remaining: Duration::from_millis(2500)
            })
        );
        // A lease that ended between the upsert and the read: held, with
        // nothing left (the SQL says 0; a negative or odd number would too).
        for nothing in [0.0, -5.0, f64::NAN] {
            assert_eq!(
                answer(None, Some(&held("held", nothing))),
                Ok(Claim::Held {
                    remaining: Duration::ZERO
                })
            );
        }
        assert!(answer(None, None).is_err());
        assert!(answer(None, Some(&held("lost", 0.0))).is_err());
        assert!(answer(Some(&FenceRow { fence: 0.0 }), None).is_err());
    }

    #[test]
    fn rows_read_alone_become_states() {
        let row = |state: &str, remaining_ms: f64| StateRow {
            state: state.into(),
            remaining_ms,
        };
        assert_eq!(state_of(None), Ok(ClaimState::Free));
        assert_eq!(state_of(Some(&row("done", 0.0))), Ok(ClaimState::Done));
        assert_eq!(
            state_of(Some(&row("held", 1500.0))),
            Ok(ClaimState::Held {
                remaining: Duration::from_millis(1500)
            })
        );
        assert_eq!(
            state_of(Some(&row("held", 0.0))),
            Ok(ClaimState::Free),
            "an ended lease: the next claim takes it"
        );
        assert!(state_of(Some(&row("gone", 0.0))).is_err());
        // The read is a plain SELECT: reading a state writes nothing.
        let sql = Sql::for_table("t");
        assert!(sql.read.trim_start().starts_with("SELECT"));
    }

    #[test]
    fn a_missing_table_is_recognised() {
        let t = "jobrail_claims";
        assert!(is_missing_table(
            "D1_ERROR: no such table: jobrail_claims: SQLITE_ERROR",
            t
        ));
        assert!(is_missing_table("no such table: main.jobrail_claims", t));
        assert!(is_missing_table("no such table: jobrail_claims", t));
        assert!(!is_missing_table("D1_ERROR: database is locked", t));
        // Another table (an effect's) is not the store's.
        assert!(!is_missing_table(
            "D1_ERROR: no such table: jobrail_claims_archive: SQLITE_ERROR",
            t
        ));
        assert!(!is_missing_table("no such table: orders", t));
    }

    #[test]
    fn a_failed_guard_is_recognised() {
        let t = "jobrail_claims";
        // What D1 said under `wrangler dev` when the guard found no live claim.
        let guard = "D1: D1Error { cause: JsValue(Error: NOT NULL constraint failed: \
                     jobrail_claims.state: SQLITE_CONSTRAINT (extended: \
                     SQLITE_CONSTRAINT_NOTNULL)) }";
        assert!(is_guard_failure(guard, t));
        // An effect's own failures are not a lost claim.
        for other in [
            "NOT NULL constraint failed: orders.state: SQLITE_CONSTRAINT",
            "NOT NULL constraint failed: my_jobrail_claims.state: SQLITE_CONSTRAINT",
            "NOT NULL constraint failed: jobrail_claims.state_x: SQLITE_CONSTRAINT",
            "UNIQUE constraint failed: jobrail_claims.key",
            "D1_ERROR: database is locked",
        ] {
            assert!(!is_guard_failure(other, t), "{other}");
        }
    }
}
