//! The records of the `postgres_history` bench (one JSON line each in
//! `target/bench-results/postgres_history.jsonl`) and their Markdown
//! rendering, shared by the bench (stdout) and `tables` (tables.md).

use serde::{Deserialize, Serialize};

/// The `kind` of the settings line.
pub const SETTINGS_KIND: &str = "history-settings";
/// The `kind` of a chunk's line.
pub const CHUNK_KIND: &str = "history-chunk";

/// The server the run used and its vacuum settings (`pg_settings`:
/// seconds, milliseconds, tuples, fractions; `SHOW` for the text ones).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// [`SETTINGS_KIND`].
    pub kind: String,
    /// `private` (a server the bench started, its defaults) or `given`
    /// (`BENCH_PG_URL`).
    pub server: String,
    /// `SHOW server_version`.
    pub server_version: String,
    /// `SHOW autovacuum`.
    pub autovacuum: String,
    /// `SHOW fsync`.
    pub fsync: String,
    /// `SHOW autovacuum_naptime`.
    pub naptime: String,
    /// `autovacuum_max_workers`.
    pub max_workers: f64,
    /// `autovacuum_vacuum_scale_factor`.
    pub vacuum_scale_factor: f64,
    /// `autovacuum_vacuum_threshold`.
    pub vacuum_threshold: f64,
    /// `autovacuum_vacuum_insert_scale_factor`.
    pub insert_scale_factor: f64,
    /// `autovacuum_vacuum_insert_threshold`.
    pub insert_threshold: f64,
    /// `autovacuum_analyze_scale_factor`.
    pub analyze_scale_factor: f64,
    /// `autovacuum_analyze_threshold`.
    pub analyze_threshold: f64,
    /// `autovacuum_vacuum_cost_delay`, ms.
    pub cost_delay_ms: f64,
    /// `autovacuum_vacuum_cost_limit` (`vacuum_cost_limit` when -1).
    pub cost_limit: f64,
    /// A `BENCH_QUICK=1` run.
    pub quick: bool,
    /// Jobs in the whole run.
    pub jobs: u64,
    /// Chunks they run in.
    pub chunks: u64,
}

impl Settings {
    /// One line of prose.
    pub fn line(&self) -> String {
        format!(
            "{} server, PostgreSQL {}: autovacuum = {}, fsync = {}, autovacuum_naptime = {}, \
             autovacuum_max_workers = {}, vacuum: {} + {} x reltuples dead tuples, insert: {} + {} x \
             reltuples, analyze: {} + {} x reltuples, cost delay {} ms, limit {}; {} jobs in {} chunks{}",
            self.server,
            self.server_version,
            self.autovacuum,
            self.fsync,
            self.naptime,
            self.max_workers,
            self.vacuum_threshold,
            self.vacuum_scale_factor,
            self.insert_threshold,
            self.insert_scale_factor,
            self.analyze_threshold,
            self.analyze_scale_factor,
            self.cost_delay_ms,
            self.cost_limit,
            self.jobs,
            self.chunks,
            if self.quick { " (BENCH_QUICK)" } else { "" },
        )
    }
}

/// `pg_stat_user_tables` and the sizes of the jobs table, read afresh.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TableState {
    /// `n_live_tup`.
    pub n_live_tup: i64,
    /// `n_dead_tup`.
    pub n_dead_tup: i64,
    /// `autovacuum_count`.
    pub autovacuum_count: i64,
    /// `last_autovacuum`, as text.
    pub last_autovacuum: Option<String>,
    /// `autoanalyze_count`.
    #[serde(default)]
    pub autoanalyze_count: i64,
    /// `vacuum_count` (manual vacuums).
    pub vacuum_count: i64,
    /// `last_vacuum`, as text.
    pub last_vacuum: Option<String>,
    /// `pg_relation_size` of `jobs`.
    pub table_bytes: i64,
    /// Of `jobs_fetch`.
    pub fetch_index_bytes: i64,
    /// Of `jobs_pkey`.
    pub pkey_bytes: i64,
    /// `pg_total_relation_size` of `jobs`.
    pub total_bytes: i64,
}

/// One chunk's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Chunk {
    /// [`CHUNK_KIND`].
    pub kind: String,
    /// As in [`Settings::server`].
    pub server: String,
    /// A `BENCH_QUICK=1` run.
    pub quick: bool,
    /// 1 to the number of chunks.
    pub chunk: u64,
    /// Jobs in this chunk.
    pub jobs: u64,
    /// Jobs done in all chunks so far, this one included.
    pub done: u64,
    /// Seconds to dispatch the chunk.
    pub dispatch_secs: f64,
    /// Jobs dispatched per second.
    pub dispatch_per_sec: f64,
    /// Seconds to consume it.
    pub consume_secs: f64,
    /// Jobs consumed per second.
    pub jobs_per_sec: f64,
    /// The highest `n_dead_tup` the sampler saw during the chunk.
    pub peak_dead_tup: i64,
    /// Autovacuums of `jobs` that finished during the chunk (including its
    /// statistics wait).
    #[serde(default)]
    pub autovacuums_in_chunk: i64,
    /// The table after the chunk.
    #[serde(flatten)]
    pub state: TableState,
}

/// A size in KiB, or MiB from 10 MiB on.
pub fn kib(bytes: i64) -> String {
    if bytes >= 10 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{} KiB", bytes / 1024)
    }
}

/// The table's header (two lines).
pub fn header() -> &'static str {
    "| chunk | jobs done | dispatch jobs/s | consume jobs/s | n_live_tup | n_dead_tup | peak dead | autovacuums (in chunk, total) | last autovacuum | manual vacuums | jobs | jobs_fetch | jobs_pkey | total |\n\
     |---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
}

/// A chunk's row.
pub fn row(c: &Chunk) -> String {
    let s = &c.state;
    let time = |t: Option<&str>| {
        t.map(|t| t.get(11..19).unwrap_or(t).to_string())
            .unwrap_or_else(|| "-".into())
    };
    format!(
        "| {}{} | {} | {:.0} | {:.0} | {} | {} | {} | {}, {} | {} | {} | {} | {} | {} | {} |",
        c.chunk,
        if c.quick { " (quick)" } else { "" },
        c.done,
        c.dispatch_per_sec,
        c.jobs_per_sec,
        s.n_live_tup,
        s.n_dead_tup,
        c.peak_dead_tup,
        c.autovacuums_in_chunk,
        s.autovacuum_count,
        time(s.last_autovacuum.as_deref()),
        s.vacuum_count,
        kib(s.table_bytes),
        kib(s.fetch_index_bytes),
        kib(s.pkey_bytes),
        kib(s.total_bytes),
    )
}
