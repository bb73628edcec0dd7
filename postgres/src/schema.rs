//! The one rule for the names of this crate's tables and of what is named
//! after them (indexes), shared by the claims and the outbox.
//!
//! A table name is one or two dot-separated parts, `table` or
//! `schema.table`, each an unquoted lowercase identifier
//! (`[a-z_][a-z0-9_]*`). Postgres keeps 63 bytes of an identifier and cuts
//! the rest off silently, so the table part leaves room for the longest
//! suffix an index takes from it ([`MAX_TABLE_BYTES`]); the schema part is
//! used as it is and may have up to 63 bytes. The name is written into SQL
//! quoted (`"schema"."table"`), so a reserved word (`order`) is a table
//! name like any other.

use std::fmt;

/// The longest identifier Postgres keeps, in bytes (`NAMEDATALEN - 1`).
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// The suffixes of the identifiers named after a table: the claims' index
/// on done rows and the outbox's index on unsent rows.
pub(crate) const DONE_INDEX: &str = "_done_at";
pub(crate) const UNSENT_INDEX: &str = "_unsent";

/// The longest of those suffixes.
const LONGEST_SUFFIX: usize = longest(&[DONE_INDEX, UNSENT_INDEX]);

/// The longest table part of a name (`table` in `schema.table`), in bytes:
/// [`MAX_IDENTIFIER_BYTES`] less the longest suffix of an index named after
/// the table (`_done_at`), so that every derived name fits whole.
pub const MAX_TABLE_BYTES: usize = MAX_IDENTIFIER_BYTES - LONGEST_SUFFIX;

const fn longest(suffixes: &[&str]) -> usize {
    let mut i = 0;
    let mut max = 0;
    while i < suffixes.len() {
        if suffixes[i].len() > max {
            max = suffixes[i].len();
        }
        i += 1;
    }
    max
}

/// A stable 63-bit key for a transaction-scoped install lock
/// (`pg_advisory_xact_lock`) of `name` under `kind` (FNV-1a), so that
/// processes installing the same tables at once take turns.
pub(crate) fn advisory_key(kind: &str, name: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in kind.bytes().chain(name.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash >> 1) as i64
}

/// A checked table name, optionally schema-qualified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    /// As the caller gave it.
    name: String,
    /// Where the table part starts in `name` (0 without a schema).
    table_at: usize,
}

/// Why a table name was refused: the name and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableNameError {
    name: String,
    why: String,
}

impl fmt::Display for TableNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is not a table name jobrail-postgres accepts: {} (a table name is \
             `table` or `schema.table`, each part [a-z_][a-z0-9_]*, the table at most \
             {MAX_TABLE_BYTES} bytes so that its indexes' names fit Postgres's \
             {MAX_IDENTIFIER_BYTES}-byte limit, the schema at most {MAX_IDENTIFIER_BYTES})",
            self.name.escape_debug(),
            self.why
        )
    }
}

impl TableName {
    /// Checks `name` against the rule in the [module docs](self).
    pub(crate) fn parse(name: &str) -> Result<TableName, TableNameError> {
        let refuse = |why: String| TableNameError {
            name: name.to_owned(),
            why,
        };
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 {
            return Err(refuse(
                "it has more than one `.` (only `schema.table` is qualified)".into(),
            ));
        }
        let last = parts.len() - 1;
        for (i, part) in parts.iter().enumerate() {
            let what = if i == last { "the table" } else { "the schema" };
            let limit = if i == last {
                MAX_TABLE_BYTES
            } else {
                MAX_IDENTIFIER_BYTES
            };
            let mut bytes = part.bytes();
            match bytes.next() {
                None => return Err(refuse(format!("{what} part is empty"))),
                Some(first) if first.is_ascii_lowercase() || first == b'_' => {}
                Some(_) => {
                    return Err(refuse(format!(
                        "{what} part does not start with a lowercase letter or `_`"
                    )))
                }
            }
            if !bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
                return Err(refuse(format!(
                    "{what} part holds a character other than a-z, 0-9 and `_`"
                )));
            }
            if part.len() > limit {
                return Err(refuse(format!(
                    "{what} part has {} bytes, more than {limit}",
                    part.len()
                )));
            }
        }
        Ok(TableName {
            name: name.to_owned(),
            table_at: name.len() - parts[last].len(),
        })
    }

    /// The name as given.
    pub(crate) fn as_str(&self) -> &str {
        &self.name
    }

    /// The schema part, if the name has one.
    fn schema(&self) -> Option<&str> {
        (self.table_at > 0).then(|| &self.name[..self.table_at - 1])
    }

    /// The table part.
    fn table(&self) -> &str {
        &self.name[self.table_at..]
    }

    /// The name quoted for SQL: `"schema"."table"` or `"table"`.
    pub(crate) fn quoted(&self) -> String {
        match self.schema() {
            Some(schema) => format!("\"{schema}\".\"{}\"", self.table()),
            None => format!("\"{}\"", self.table()),
        }
    }

    /// The quoted, unqualified name of an index named after the table
    /// (`"table_suffix"`; an index lives in its table's schema). `suffix`
    /// is one of this module's suffixes, so the name fits whole.
    pub(crate) fn index(&self, suffix: &str) -> String {
        debug_assert!(suffix.len() <= LONGEST_SUFFIX);
        format!("\"{}{suffix}\"", self.table())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_limits() {
        assert_eq!(MAX_TABLE_BYTES, 55);
        assert!(TableName::parse(&"a".repeat(55)).is_ok());
        let err = TableName::parse(&"a".repeat(56)).unwrap_err().to_string();
        assert!(
            err.contains("the table part has 56 bytes, more than 55"),
            "{err}"
        );
        assert!(err.contains("63-byte limit"), "{err}");
        assert!(TableName::parse(&format!("{}.t", "s".repeat(63))).is_ok());
        assert!(TableName::parse(&format!("{}.t", "s".repeat(64))).is_err());
    }

    #[test]
    fn refused_names() {
        for bad in [
            "",
            "Claims",
            "9t",
            "a-b",
            "a.b.c",
            ".t",
            "s.",
            "t; DROP TABLE x",
            "\"t\"",
            "outbóx",
            "out box",
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quoting_and_indexes() {
        let name = TableName::parse("jobs.order").unwrap();
        assert_eq!(name.as_str(), "jobs.order");
        assert_eq!(name.quoted(), "\"jobs\".\"order\"");
        assert_eq!(name.index(UNSENT_INDEX), "\"order_unsent\"");
        let bare = TableName::parse("t").unwrap();
        assert_eq!(bare.quoted(), "\"t\"");
        assert_eq!(bare.index(DONE_INDEX), "\"t_done_at\"");
    }

    fn part(max: usize) -> impl Strategy<Value = String> {
        proptest::string::string_regex(&format!("[a-z_][a-z0-9_]{{0,{}}}", max - 1)).unwrap()
    }

    proptest! {
        /// Every name the rule accepts gives derived identifiers that
        /// Postgres keeps whole, and quoting adds nothing but the quotes.
        #[test]
        fn accepted_names_fit(schema in proptest::option::of(part(MAX_IDENTIFIER_BYTES)),
                              table in part(MAX_TABLE_BYTES)) {
            let name = match &schema {
                Some(schema) => format!("{schema}.{table}"),
                None => table.clone(),
            };
            let parsed = TableName::parse(&name).unwrap();
            prop_assert_eq!(parsed.as_str(), name.as_str());
            for suffix in [DONE_INDEX, UNSENT_INDEX] {
                let index = parsed.index(suffix);
                prop_assert!(index.len() - 2 <= MAX_IDENTIFIER_BYTES, "{}", index);
                let stem = format!("\"{table}");
                prop_assert!(index.starts_with(&stem));
            }
            let unquoted: String = parsed.quoted().chars().filter(|c| *c != '"').collect();
            prop_assert_eq!(unquoted, name);
        }

        /// A table part longer than the limit is refused, whatever it holds.
        #[test]
        fn long_tables_are_refused(table in "[a-z_]{56,80}") {
            let err = TableName::parse(&table).unwrap_err().to_string();
            prop_assert!(err.contains("more than 55"), "{}", err);
        }

        /// Any name with a character outside the rule is refused, and the
        /// error names it as it was given.
        #[test]
        fn other_characters_are_refused(prefix in "[a-z_]{1,10}", c in any::<char>(),
                                        rest in "[a-z0-9_]{0,10}") {
            prop_assume!(!(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.'));
            let name = format!("{prefix}{c}{rest}");
            let err = TableName::parse(&name).unwrap_err();
            prop_assert!(err.to_string().contains(&name.escape_debug().to_string()));
        }
    }
}
