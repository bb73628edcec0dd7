//! Claims on business keys in Cloudflare D1: the edge's
//! [`jobrail::ClaimStore`] (`D1Claims`, wasm32).
//!
//! This file holds what does not need a Worker, so that it is unit-tested
//! natively: the table's SQL, the check of a table name, and how the rows a
//! claim reads back become a [`Claim`]. The store itself (the D1 calls) is
//! in `claims/d1.rs`; its documentation, with why D1 and the limits, is on
//! `D1Claims`.

use std::time::Duration;

use jobrail::Claim;
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

/// The statements of one table. Parameters: `?1` the key, `?2` the
/// Worker's clock (ms since the epoch), `?3` the fence or the new end of
/// the lease (ms since the epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sql {
    /// Creates the table if it is missing.
    pub(crate) schema: String,
    /// Inserts a held row at fence 1, or takes the key over from an ended
    /// lease with the next fence; returns the fence only when this call
    /// holds the key (`?3`: the lease's end).
    pub(crate) claim: String,
    /// Reads the key's row (in the claim's batch, after the upsert).
    pub(crate) read: String,
    /// Marks the live claim `?3` done.
    pub(crate) complete: String,
    /// Ends the live claim `?3`'s lease now, without completing it.
    pub(crate) release: String,
    /// Moves the live claim `?3`'s lease end to `?4`.
    pub(crate) extend: String,
}

/// The condition every operation on a held claim needs: `?3` is the key's
/// latest fence, the key is not done, and its lease runs past now.
const LIVE: &str = "key = ?1 AND fence = ?3 AND state = 'held' AND lease_until_ms > ?2";

impl Sql {
    /// The statements for `table` (a name [`check_table`] accepted).
    pub(crate) fn for_table(table: &str) -> Sql {
        let t = table;
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
            claim: format!(
                "INSERT INTO {t} (key, fence, state, lease_until_ms, updated_at_ms)
                 VALUES (?1, 1, 'held', ?3, ?2)
                 ON CONFLICT (key) DO UPDATE
                   SET fence = fence + 1, lease_until_ms = excluded.lease_until_ms,
                       updated_at_ms = excluded.updated_at_ms
                   WHERE state = 'held' AND lease_until_ms <= ?2
                 RETURNING fence"
            ),
            read: format!("SELECT state, lease_until_ms FROM {t} WHERE key = ?1"),
            complete: format!(
                "UPDATE {t} SET state = 'done', lease_until_ms = 0, updated_at_ms = ?2
                 WHERE {LIVE} RETURNING fence"
            ),
            release: format!(
                "UPDATE {t} SET lease_until_ms = 0, updated_at_ms = ?2
                 WHERE {LIVE} RETURNING fence"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until_ms = ?4, updated_at_ms = ?2
                 WHERE {LIVE} RETURNING fence"
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
    pub(crate) lease_until_ms: f64,
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
/// returned (when this call took the key) and the key's row after it, at
/// `now_ms` on the Worker's clock.
pub(crate) fn answer(
    claimed: Option<&FenceRow>,
    row: Option<&StateRow>,
    now_ms: u64,
) -> Result<Claim, String> {
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
            let end = row.lease_until_ms.max(0.0) as u64;
            Ok(Claim::Held {
                remaining: Duration::from_millis(end.saturating_sub(now_ms)),
            })
        }
        other => Err(format!("the claims table holds an unknown state `{other}`")),
    }
}

/// Whether a D1 error says the table is missing (it was dropped, or the
/// isolate's note that it exists was about another database).
pub(crate) fn is_missing_table(message: &str) -> bool {
    message.contains("no such table")
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

    #[test]
    fn the_sql_names_the_table_and_fences_every_write() {
        let sql = Sql::for_table("my_claims");
        for text in [
            &sql.schema,
            &sql.claim,
            &sql.read,
            &sql.complete,
            &sql.release,
            &sql.extend,
        ] {
            assert!(text.contains("my_claims"), "{text}");
            assert!(!text.contains("{t}") && !text.contains("{LIVE}"), "{text}");
        }
        // A key is taken over only when held under an ended lease: never
        // when done, never while live.
        assert!(sql
            .claim
            .contains("WHERE state = 'held' AND lease_until_ms <= ?2"));
        assert!(sql.claim.contains("fence = fence + 1"));
        assert!(sql.claim.contains("RETURNING fence"));
        // Complete, release and extend only touch the live, latest claim.
        for text in [&sql.complete, &sql.release, &sql.extend] {
            assert!(text.contains(LIVE), "{text}");
            assert!(text.contains("RETURNING fence"), "{text}");
        }
        assert!(sql.complete.contains("state = 'done'"));
        assert!(sql.extend.contains("lease_until_ms = ?4"));
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
        let now = 1_700_000_000_000;
        let held = |state: &str, until: u64| StateRow {
            state: state.into(),
            lease_until_ms: until as f64,
        };
        // The upsert returned a fence: this call holds the key, whatever the row says.
        assert_eq!(
            answer(
                Some(&FenceRow { fence: 3.0 }),
                Some(&held("held", now + 10)),
                now
            ),
            Ok(Claim::Claimed { fence: 3 })
        );
        assert_eq!(answer(None, Some(&held("done", 0)), now), Ok(Claim::Done));
        assert_eq!(
            answer(None, Some(&held("held", now + 2500)), now),
            Ok(Claim::Held {
                remaining: Duration::from_millis(2500)
            })
        );
        // A lease ending as the batch ran: held, with nothing left.
        assert_eq!(
            answer(None, Some(&held("held", now - 5)), now),
            Ok(Claim::Held {
                remaining: Duration::ZERO
            })
        );
        assert!(answer(None, None, now).is_err());
        assert!(answer(None, Some(&held("lost", now)), now).is_err());
        assert!(answer(Some(&FenceRow { fence: 0.0 }), None, now).is_err());
    }

    #[test]
    fn a_missing_table_is_recognised() {
        assert!(is_missing_table(
            "D1_ERROR: no such table: jobrail_claims: SQLITE_ERROR"
        ));
        assert!(!is_missing_table("D1_ERROR: database is locked"));
    }
}
