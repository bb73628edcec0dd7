//! Every Rust snippet the README shows is compiled by `tests/run`:
//!
//! - a ```` ```rust ```` or ```` ```rust,no_run ```` block is one of the
//!   README's doc tests (`native/src/lib.rs` includes the README as docs);
//! - a ```` ```rust,ignore ```` block, code the doc tests cannot build (a
//!   Worker's, for wasm32), must be an excerpt of a file `tests/run` builds,
//!   named on the line above it as `<!-- excerpt of PATH -->`: its lines,
//!   leading and trailing spaces aside, are that file's, in order, each run
//!   between `// ...` lines contiguous.
//!
//! Any other Rust block fails, as does an excerpt that no longer matches.

use std::path::Path;

/// The files `tests/run` builds that the README may quote: the template
/// worker (for wasm32, and its native test), the report worker (wasm32).
const BUILT: &[&str] = &[
    "templates/edge-worker/src/lib.rs",
    "templates/edge-worker/src/routes.rs",
    "templates/edge-worker/tests/jobs.rs",
    "examples/report-worker/src/lib.rs",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
}

/// `lines` trimmed, blank ones left out.
fn trimmed<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    lines
        .into_iter()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

/// Whether `runs` appear in `file`, in order, each run contiguous.
fn is_excerpt(runs: &[Vec<&str>], file: &[&str]) -> Result<(), String> {
    let mut at = 0;
    for run in runs {
        let found = (at..=file.len().saturating_sub(run.len()))
            .find(|&i| file[i..].starts_with(run))
            .ok_or_else(|| {
                format!(
                    "the lines from {:?} on are not in it (after line {at})",
                    run[0]
                )
            })?;
        at = found + run.len();
    }
    Ok(())
}

#[test]
fn every_rust_snippet_is_compiled() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    let (mut doctests, mut excerpts, mut problems) = (0, 0, Vec::new());
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let end = (i + 1..lines.len())
            .find(|&j| lines[j].starts_with("```"))
            .expect("every fence is closed");
        let body = &lines[i + 1..end];
        let line = i + 1;
        match info.trim() {
            "rust" | "rust,no_run" => doctests += 1,
            "rust,ignore" => {
                let named = lines[..i]
                    .iter()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .and_then(|l| l.trim().strip_prefix("<!-- excerpt of "))
                    .and_then(|l| l.strip_suffix(" -->"));
                match named {
                    None => problems.push(format!(
                        "README.md:{line}: a `rust,ignore` block not marked `<!-- excerpt of PATH -->`: \
                         nothing compiles it"
                    )),
                    Some(path) if !BUILT.contains(&path) => problems.push(format!(
                        "README.md:{line}: {path} is not among the files tests/run builds ({BUILT:?})"
                    )),
                    Some(path) => {
                        let text = std::fs::read_to_string(root().join(path)).unwrap();
                        let file = trimmed(text.lines());
                        let runs: Vec<Vec<&str>> = body
                            .split(|l| l.trim() == "// ...")
                            .map(|run| trimmed(run.iter().copied()))
                            .filter(|run| !run.is_empty())
                            .collect();
                        match is_excerpt(&runs, &file) {
                            Ok(()) => excerpts += 1,
                            Err(e) => problems.push(format!(
                                "README.md:{line}: not an excerpt of {path}: {e}"
                            )),
                        }
                    }
                }
            }
            other if other.starts_with("rust") => problems.push(format!(
                "README.md:{line}: a `{other}` block: make it a doc test or an excerpt"
            )),
            _ => {}
        }
        i = end + 1;
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        doctests > 0 && excerpts > 0,
        "{doctests} doc tests, {excerpts} excerpts"
    );
    println!(
        "README: {doctests} Rust snippets run as doc tests, {excerpts} excerpts of built files"
    );
}
