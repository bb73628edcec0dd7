//! Every Rust snippet the README and the guide (`guide/*.md`) show is
//! compiled by `tests/run`, and every link between their pages resolves:
//!
//! - a ```` ```rust ```` or ```` ```rust,no_run ```` block is one of the
//!   doc tests of `jobrail-native` (`native/src/lib.rs` includes each page
//!   as docs);
//! - a ```` ```rust,ignore ```` block, code the doc tests cannot build (a
//!   Worker's, for wasm32), must be an excerpt of a file `tests/run` builds,
//!   named on the line above it as `<!-- excerpt of PATH -->`: its lines,
//!   leading and trailing spaces aside, are that file's, in order, each run
//!   between `// ...` lines contiguous.
//!
//! Any other Rust block fails, as does an excerpt that no longer matches, a
//! page `native/src/lib.rs` does not include, and a relative link to a file
//! or heading that is not there.

use std::path::{Path, PathBuf};

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

/// The README and the guide's pages, as paths from the workspace root.
fn pages() -> Vec<String> {
    let mut pages: Vec<String> = std::fs::read_dir(root().join("guide"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("guide/{name}"))
        .collect();
    pages.sort();
    pages.insert(0, "README.md".to_string());
    pages
}

#[test]
fn every_rust_snippet_is_compiled() {
    let lib = std::fs::read_to_string(root().join("native/src/lib.rs")).unwrap();
    let (mut doctests, mut excerpts, mut problems) = (0, 0, Vec::new());
    for page in pages() {
        let included = format!("\"../../{page}\"");
        let unlisted = ["guide/README.md", "guide/SUMMARY.md"];
        if !unlisted.contains(&page.as_str()) && !lib.contains(&included) {
            problems.push(format!(
                "{page}: not among native/src/lib.rs's doc-test pages"
            ));
        }
        let text = std::fs::read_to_string(root().join(&page)).unwrap();
        check_snippets(&page, &text, &mut doctests, &mut excerpts, &mut problems);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        doctests > 0 && excerpts > 0,
        "{doctests} doc tests, {excerpts} excerpts"
    );
    println!(
        "README and guide: {doctests} Rust snippets run as doc tests, {excerpts} excerpts of built files"
    );
}

fn check_snippets(
    page: &str,
    text: &str,
    doctests: &mut usize,
    excerpts: &mut usize,
    problems: &mut Vec<String>,
) {
    let lines: Vec<&str> = text.lines().collect();
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
            "rust" | "rust,no_run" => *doctests += 1,
            "rust,ignore" => {
                let named = lines[..i]
                    .iter()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .and_then(|l| l.trim().strip_prefix("<!-- excerpt of "))
                    .and_then(|l| l.strip_suffix(" -->"));
                match named {
                    None => problems.push(format!(
                        "{page}:{line}: a `rust,ignore` block not marked `<!-- excerpt of PATH -->`: \
                         nothing compiles it"
                    )),
                    Some(path) if !BUILT.contains(&path) => problems.push(format!(
                        "{page}:{line}: {path} is not among the files tests/run builds ({BUILT:?})"
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
                            Ok(()) => *excerpts += 1,
                            Err(e) => problems.push(format!(
                                "{page}:{line}: not an excerpt of {path}: {e}"
                            )),
                        }
                    }
                }
            }
            other if other.starts_with("rust") => problems.push(format!(
                "{page}:{line}: a `{other}` block: make it a doc test or an excerpt"
            )),
            _ => {}
        }
        i = end + 1;
    }
}

/// GitHub's anchor for a heading: lowercase, punctuation other than `-` and
/// `_` dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a page's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            found.push(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

/// The targets of a page's inline links outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    found
}

/// The repository's address for its own files: links of the guide to files
/// outside it, and of the API docs to the guide, use it, so that they work on
/// the repository's site, in the rendered book and on docs.rs alike.
const REPO: &str = "https://github.com/jobrail/jobrail/blob/main/";

/// Checks one link target of a page in `dir` (a path from the root); `None`
/// when it is another site's.
fn check_link(page: &str, dir: &Path, target: &str) -> Option<Result<(), String>> {
    let (local, from_root) = match target.strip_prefix(REPO) {
        Some(path) => (path, true),
        None if target.contains("://") || target.starts_with("mailto:") => return None,
        None => (target, false),
    };
    let (file, fragment) = match local.split_once('#') {
        Some((file, fragment)) => (file, Some(fragment)),
        None => (local, None),
    };
    let path = if file.is_empty() {
        root().join(page)
    } else if from_root {
        root().join(file)
    } else {
        root().join(dir).join(file)
    };
    if !from_root && page.starts_with("guide/") && file.starts_with("../") {
        return Some(Err(format!(
            "{page}: a link to {target} leaves the guide: write it as {REPO}{}, \
             which the rendered book can follow",
            file.trim_start_matches("../")
        )));
    }
    if !path.exists() {
        return Some(Err(format!("{page}: a link to {target}: no such file")));
    }
    if let Some(fragment) = fragment {
        let target_text = std::fs::read_to_string(&path).unwrap_or_default();
        if !anchors(&target_text).iter().any(|a| a == fragment) {
            return Some(Err(format!("{page}: a link to {target}: no such heading")));
        }
    }
    Some(Ok(()))
}

#[test]
fn every_link_between_pages_resolves() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(root().join(&page)).unwrap();
        let dir = Path::new(&page).parent().unwrap().to_path_buf();
        for target in links(&text) {
            if let Some(result) = check_link(&page, &dir, &target) {
                checked += 1;
                if let Err(problem) = result {
                    problems.push(problem);
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(checked > 0, "no links checked");
    println!("README and guide: {checked} links between pages resolve");
}

#[test]
fn every_guide_page_is_a_chapter_of_the_book() {
    let summary = std::fs::read_to_string(root().join("guide/SUMMARY.md")).unwrap();
    let chapters = links(&summary);
    let missing: Vec<String> = pages()
        .into_iter()
        .filter(|page| page.starts_with("guide/") && page != "guide/SUMMARY.md")
        .filter(|page| !chapters.iter().any(|c| format!("guide/{c}") == *page))
        .collect();
    assert!(
        missing.is_empty(),
        "guide pages missing from guide/SUMMARY.md (the book would not show them): {missing:?}"
    );
}

/// The API docs' links to the guide and the repository's files (the crate
/// roots link their chapters): each names a file and heading that exist.
#[test]
fn the_api_docs_links_into_the_repository_resolve() {
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut stack: Vec<PathBuf> = [
        "shared/src",
        "native/src",
        "edge/src",
        "postgres/src",
        "redis/src",
    ]
    .iter()
    .map(|dir| root().join(dir))
    .collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let shown = path.strip_prefix(root()).unwrap().display().to_string();
            let mut rest = text.as_str();
            while let Some(at) = rest.find(REPO) {
                rest = &rest[at..];
                let end = rest
                    .find(|c: char| c == ')' || c == '>' || c.is_whitespace() || c == '"')
                    .unwrap_or(rest.len());
                let target = &rest[..end];
                rest = &rest[end..];
                if let Some(Err(problem)) = check_link(&shown, Path::new(""), target) {
                    problems.push(problem);
                }
                checked += 1;
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        checked > 0,
        "no links into the repository found in the API docs"
    );
    println!("API docs: {checked} links into the repository resolve");
}
