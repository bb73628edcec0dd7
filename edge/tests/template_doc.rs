//! The crate docs' "Wiring a worker" example is the template's code: the
//! example in `src/lib.rs` and `templates/edge-worker/src/lib.rs` (what
//! `templates/new-edge-worker` copies, built for wasm32 by `tests/run`) must
//! have the same code lines, comments included; only the template's own
//! `//!` docs and blank lines are left out of the comparison.

use std::path::Path;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The code lines of `text`: trailing spaces, blank lines and `//!` lines
/// left out.
fn code_lines<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    lines
        .map(str::trim_end)
        .filter(|line| !line.is_empty() && !line.trim_start().starts_with("//!"))
        .collect()
}

/// The body of the first fenced example after the `# Wiring a worker`
/// heading of the crate docs.
fn doc_example(lib: &str) -> Vec<&str> {
    let mut docs = lib
        .lines()
        .take_while(|line| line.starts_with("//!"))
        .map(|line| line.strip_prefix("//!").unwrap())
        .map(|line| line.strip_prefix(' ').unwrap_or(line))
        .skip_while(|line| *line != "# Wiring a worker")
        .skip_while(|line| !line.starts_with("```"))
        .skip(1);
    let body: Vec<&str> = docs
        .by_ref()
        .take_while(|line| !line.starts_with("```"))
        .collect();
    assert!(
        !body.is_empty(),
        "no example under `# Wiring a worker` in the crate docs"
    );
    code_lines(body.into_iter())
}

#[test]
fn the_crate_docs_show_the_template_code() {
    let edge = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = read(&edge.join("src/lib.rs"));
    let template = read(&edge.join("../templates/edge-worker/src/lib.rs"));
    let docs = doc_example(&lib);
    let code = code_lines(template.lines());
    if let Some(i) = (0..docs.len().max(code.len())).find(|&i| docs.get(i) != code.get(i)) {
        panic!(
            "the `# Wiring a worker` example in edge/src/lib.rs and templates/edge-worker/src/lib.rs differ at code line {}:\n  docs:     {:?}\n  template: {:?}\nCopy the template's code (without its //! docs) into the example.",
            i + 1,
            docs.get(i),
            code.get(i)
        );
    }
}
