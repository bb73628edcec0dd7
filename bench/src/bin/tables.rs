//! Gathers `target/bench-results/*.jsonl` (one JSON line per comparison,
//! scale point or growing-history chunk, written by the benches) into
//! `target/bench-results/tables.md`: one Markdown table per bench, in the
//! order of `BENCHMARKS.md`, then any other bench alphabetically. Prints
//! the path. `bench/run` runs it after the benches.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use jobrail_bench::history::{self, Chunk, Settings, CHUNK_KIND, SETTINGS_KIND};
use jobrail_bench::latency::{Latency, LATENCY_KIND};
use jobrail_bench::{results_dir, Allocations, Comparison, Spread, ALLOCATIONS_KIND};
use serde_json::Value;

/// The benches in the order `BENCHMARKS.md` shows them.
const ORDER: [&str; 9] = [
    "pure",
    "memory",
    "rabbitmq",
    "nats",
    "sqs",
    "postgres",
    "postgres_history",
    "scale",
    "latency",
];

fn strings(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or("").to_string()
}

fn numbers(v: &Value, key: &str) -> Vec<f64> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn spread(v: &Value, key: &str) -> Option<Spread> {
    let s = v.get(key)?;
    Some(Spread {
        median: s.get("median")?.as_f64()?,
        min: s.get("min")?.as_f64()?,
        max: s.get("max")?.as_f64()?,
    })
}

/// A comparison read back from its JSON line.
fn comparison(v: &Value) -> Option<Comparison> {
    let mut c = Comparison::new(
        &strings(v, "bench"),
        &strings(v, "work"),
        &strings(v, "baseline"),
        v.get("count")?.as_u64()?,
    );
    c.baseline_secs = numbers(v, "baseline_secs");
    c.facade_secs = numbers(v, "facade_secs");
    c.target = v.get("target").and_then(Value::as_f64);
    (!c.baseline_secs.is_empty() && c.baseline_secs.len() == c.facade_secs.len()).then_some(c)
}

/// A timing's row (a measured time against an absolute target, no baseline).
fn timing_row(v: &Value) -> Option<String> {
    let secs = spread(v, "seconds")?;
    Some(format!(
        "| {} | {} | {} | {:.3} ({:.3} to {:.3}) | {} | under {} s |",
        v.get("work")?.as_str()?,
        v.get("backend")?.as_str()?,
        v.get("records")?.as_u64()?,
        secs.median,
        secs.min,
        secs.max,
        v.get("rounds")?.as_u64()?,
        v.get("target_seconds")?.as_f64()?
    ))
}

/// A scale point's row.
fn scale_row(v: &Value) -> Option<String> {
    let rate = spread(v, "msgs_per_sec")?;
    let cost = spread(v, "us_per_msg")?;
    let startup = spread(v, "startup_ms")?;
    let rounds = v.get("secs")?.as_array()?.len();
    let quick = if v.get("quick").and_then(Value::as_bool) == Some(true) {
        " (quick)"
    } else {
        ""
    };
    Some(format!(
        "| {}{quick} | {} | {} | {:.0} ({:.0} to {:.0}) | {:.2} ({:.2} to {:.2}) | {:.1} | {rounds} |",
        strings(v, "backend"),
        v.get("backlog")?.as_u64()?,
        v.get("concurrency")?.as_u64()?,
        rate.median,
        rate.min,
        rate.max,
        cost.median,
        cost.min,
        cost.max,
        startup.median,
    ))
}

/// The growing-history bench's lines: its settings as a sentence, then its
/// chunks as the table the bench prints.
fn history_tables(out: &mut String, name: &str, lines: &[&Value]) {
    let mut rows = vec![];
    for v in lines {
        if v.get("kind").and_then(Value::as_str) == Some(SETTINGS_KIND) {
            match serde_json::from_value::<Settings>((*v).clone()) {
                Ok(s) => {
                    let _ = writeln!(out, "{}\n", s.line());
                }
                Err(e) => eprintln!("tables: {name}: a settings line it cannot read: {e}"),
            }
        } else {
            match serde_json::from_value::<Chunk>((*v).clone()) {
                Ok(c) => rows.push(history::row(&c)),
                Err(e) => eprintln!("tables: {name}: a chunk line it cannot read: {e}"),
            }
        }
    }
    if !rows.is_empty() {
        let _ = writeln!(out, "{}", history::header());
        for row in rows {
            let _ = writeln!(out, "{row}");
        }
    }
}

fn main() {
    let dir = results_dir();
    let mut benches: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let entries = std::fs::read_dir(&dir).expect("read the results directory");
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let bench = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let text = std::fs::read_to_string(&path).expect("read a results file");
        let lines = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .filter_map(|l| match serde_json::from_str(l) {
                Ok(v) => Some(v),
                Err(e) => {
                    eprintln!("tables: {}: skipping a line: {e}", path.display());
                    None
                }
            })
            .collect();
        benches.insert(bench, lines);
    }
    let mut names: Vec<String> = ORDER
        .iter()
        .map(|s| s.to_string())
        .filter(|n| benches.contains_key(n))
        .collect();
    names.extend(
        benches
            .keys()
            .filter(|k| !ORDER.contains(&k.as_str()))
            .cloned(),
    );

    let mut out =
        String::from("<!-- Generated by bench/run from target/bench-results/*.jsonl -->\n");
    for name in names {
        let values = &benches[&name];
        let _ = writeln!(out, "\n## {name}\n");
        let kind = |v: &&Value| {
            v.get("kind")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let (history, values): (Vec<&Value>, Vec<&Value>) = values
            .iter()
            .partition(|v| [SETTINGS_KIND, CHUNK_KIND].contains(&kind(v).as_str()));
        let (scale, other): (Vec<&Value>, Vec<&Value>) =
            values.into_iter().partition(|v| kind(v) == "scale-point");
        if !history.is_empty() {
            history_tables(&mut out, &name, &history);
        }
        let (latency, other): (Vec<&Value>, Vec<&Value>) =
            other.into_iter().partition(|v| kind(v) == LATENCY_KIND);
        if !latency.is_empty() {
            let _ = writeln!(out, "{}", Latency::header());
            for v in latency {
                match serde_json::from_value::<Latency>((*v).clone()) {
                    Ok(l) => {
                        let _ = writeln!(out, "{}", l.rows());
                    }
                    Err(e) => eprintln!("tables: {name}: a latency line it cannot read: {e}"),
                }
            }
        }
        let (timing, other): (Vec<&Value>, Vec<&Value>) =
            other.into_iter().partition(|v| kind(v) == "timing");
        if !timing.is_empty() {
            out.push_str(
                "| work | backend | records | seconds median (min to max) | rounds | target |\n",
            );
            out.push_str("|---|---|---|---|---|---|\n");
            for v in timing {
                match timing_row(v) {
                    Some(row) => {
                        let _ = writeln!(out, "{row}");
                    }
                    None => eprintln!("tables: {name}: a timing line without its fields"),
                }
            }
        }
        let (allocations, other): (Vec<&Value>, Vec<&Value>) =
            other.into_iter().partition(|v| kind(v) == ALLOCATIONS_KIND);
        if !other.is_empty() {
            out.push_str("| work | baseline | baseline median | facade median | ratio median (range) | target |\n");
            out.push_str("|---|---|---|---|---|---|\n");
            for v in other {
                match comparison(v) {
                    Some(c) => {
                        let _ = writeln!(out, "{}", c.row());
                    }
                    None => eprintln!("tables: {name}: a line that is not a comparison"),
                }
            }
        }
        if !allocations.is_empty() {
            let _ = writeln!(out, "\n{}", Allocations::header());
            for v in allocations {
                match serde_json::from_value::<Allocations>((*v).clone()) {
                    Ok(a) => {
                        let _ = writeln!(out, "{}", a.row());
                    }
                    Err(e) => eprintln!("tables: {name}: an allocations line it cannot read: {e}"),
                }
            }
        }
        if !scale.is_empty() {
            if !out.ends_with("\n\n") {
                out.push('\n');
            }
            out.push_str("| backend | backlog | concurrency | messages/s median (min to max) | us/msg median (min to max) | start-up ms | rounds |\n");
            out.push_str("|---|---|---|---|---|---|---|\n");
            for v in scale {
                if let Some(row) = scale_row(v) {
                    let _ = writeln!(out, "{row}");
                }
            }
        }
    }
    let path = dir.join("tables.md");
    std::fs::write(&path, out).expect("write tables.md");
    println!("{}", path.display());
}
