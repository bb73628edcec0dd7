//! The layers of the `jobrail` crate, kept by a test.
//!
//! The crate's modules live in one folder per layer under `src/`
//! ([`LAYERS`], lowest first). A module may import from its own layer and
//! the layers below it, never from a layer above, and the modules import
//! each other without a cycle. This test reads every `.rs` file under
//! `src/`, finds each path through the crate (`crate::...`, `super::...`,
//! `self::...`, groups such as `use crate::{a::X, b::{Y, Z}}` included),
//! maps it to the module that defines what it names (a root re-export such
//! as `crate::Registry` is followed through `lib.rs`'s `pub use` to its
//! module) and fails naming the file, the line, the import and the rule it
//! breaks.
//!
//! A module is a file or folder directly inside a layer folder
//! (`run/registry/decide.rs` belongs to `run::registry`); the files of one
//! module may import each other freely. Comments and string literals are
//! not read, so a doc link names what it likes. Unit tests inside a module
//! (a `mod` item under `#[cfg(test)]`, or `#[cfg(all(test, ...))]`) may use
//! anything in the crate: they are not part of the module's code, and the
//! integration tests see only the public API.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// The layers, lowest first, with what belongs in each: the one place the
/// order is declared.
const LAYERS: &[(&str, &str)] = &[
    (
        "model",
        "The vocabulary: injected time and cancellation, handler errors and \
         their markers, the wire envelope, the retry policy, terminal \
         failures and their records, a backend's answer, the circuit breaker \
         and the job declaration. It decides nothing about a delivery.",
    ),
    (
        "rules",
        "Pure decisions over the vocabulary: the settlement table, the \
         failure budget and the replay of failure records. No handler runs \
         here and nothing is counted.",
    ),
    (
        "observe",
        "What an operator sees: the counters, the events and their sinks, \
         and the metrics recorded through the `metrics` facade. It reads the \
         model and the rules and runs nothing.",
    ),
    (
        "run",
        "Running deliveries: the handler's context, the two retry tiers, the \
         registry and its pipeline, claims and unique dispatch, the broker \
         and delay limits on a registry, operator overrides, shared state \
         for handlers, and the test queue on virtual time.",
    ),
];

#[test]
fn the_crate_keeps_its_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_dir(&src, &src, &mut files);
    let report = check(&files);
    assert!(
        report.problems.is_empty(),
        "the layering of jobrail is broken:\n{}",
        report.problems.join("\n")
    );
    // The check read the crate: every layer has modules, and modules
    // import each other (so it cannot pass on nothing).
    for (layer, _) in LAYERS {
        assert!(
            report.modules.iter().any(|m| m.layer() == *layer),
            "no module found in layer `{layer}`"
        );
    }
    assert!(report.modules.len() >= 20, "{:?}", report.modules);
    assert!(report.edges.len() >= 40, "{:?}", report.edges);
    assert!(report
        .edges
        .contains(&(Module::of("run::registry"), Module::of("rules::settle"))));
}

#[test]
fn an_upward_import_is_reported() {
    let files = [
        file(
            "lib.rs",
            "mod model;\nmod run;\npub use run::registry::{Registry as Reg, Incoming};\n",
        ),
        file("model/mod.rs", "pub(crate) mod job;\n"),
        file(
            "model/job.rs",
            "use crate::model::policy::Backoff;\n\
             // crate::run::registry::Registry in a comment is not an import\n\
             const S: &str = \"crate::run::registry::Registry\";\n\
             use crate::{model::error::E, run::{pipeline::{A, B}}};\n\
             fn f() -> crate::Reg { todo!() }\n",
        ),
        file("model/policy.rs", "pub struct Backoff;\n"),
        file("model/error.rs", "pub struct E;\n"),
        file("run/mod.rs", "pub(crate) mod registry;\n"),
        file("run/registry.rs", "pub struct Registry;\n"),
        file("run/pipeline.rs", "use crate::run::registry::Registry;\n"),
    ];
    let report = check(&files);
    assert_eq!(report.problems.len(), 3, "{:#?}", report.problems);
    assert!(
        report.problems[1].starts_with("model/job.rs:4: `crate::run::pipeline::B`"),
        "{}",
        report.problems[1]
    );
    assert!(
        report.problems[0].starts_with("model/job.rs:4: `crate::run::pipeline::A`")
            && report.problems[0].contains("`model::job` (layer `model`)")
            && report.problems[0].contains("`run::pipeline` of the higher layer `run`"),
        "{}",
        report.problems[0]
    );
    assert!(
        report.problems[2].starts_with("model/job.rs:5: `crate::Reg`")
            && report.problems[2].contains("`run::registry` of the higher layer `run`"),
        "{}",
        report.problems[2]
    );
}

#[test]
fn a_cycle_is_reported() {
    let files = [
        file("lib.rs", "mod run;\n"),
        file("run/mod.rs", "pub(crate) mod a;\npub(crate) mod b;\n"),
        file("run/a.rs", "\n\nuse crate::run::b::X;\n"),
        file("run/b/mod.rs", "mod inner;\n"),
        file("run/b/inner.rs", "fn f() { super::super::a::g(); }\n"),
    ];
    let report = check(&files);
    assert_eq!(report.problems.len(), 1, "{:#?}", report.problems);
    assert!(
        report.problems[0].contains("run::a -> run::b -> run::a")
            && report.problems[0].contains("run/a.rs:3 `crate::run::b::X`")
            && report.problems[0].contains("run/b/inner.rs:1 `super::super::a::g`"),
        "{}",
        report.problems[0]
    );
}

#[test]
fn unit_tests_may_import_anything() {
    let files = [
        file(
            "lib.rs",
            "mod model;\nmod run;\npub use run::registry::Registry;\n",
        ),
        file(
            "model/job.rs",
            "pub struct Job;\n\
             #[cfg(test)]\n\
             mod tests {\n    use crate::Registry;\n    fn f() { let _ = '{'; }\n}\n\
             #[cfg(all(test, feature = \"x\"))]\n\
             #[allow(unused)]\n\
             mod more {\n    use crate::run::registry::Registry;\n}\n\
             fn g() -> &'static str { r#\"crate::run::registry\"# }\n",
        ),
        file("run/registry.rs", "pub struct Registry;\n"),
    ];
    let report = check(&files);
    assert!(report.problems.is_empty(), "{:#?}", report.problems);
    assert!(report.edges.is_empty(), "{:?}", report.edges);
}

#[test]
fn a_module_outside_the_layers_and_an_unknown_path_are_reported() {
    let files = [
        file("lib.rs", "mod model;\nmod misc;\n"),
        file("misc.rs", "pub struct M;\n"),
        file("model/job.rs", "use crate::Nowhere;\n"),
    ];
    let report = check(&files);
    assert_eq!(report.problems.len(), 2, "{:#?}", report.problems);
    assert!(
        report.problems[0].starts_with("misc.rs: "),
        "{}",
        report.problems[0]
    );
    assert!(
        report.problems[1].starts_with("model/job.rs:1: `crate::Nowhere`"),
        "{}",
        report.problems[1]
    );
}

fn file(path: &str, text: &str) -> (String, String) {
    (path.to_string(), text.to_string())
}

/// Every `.rs` file under `dir`, by its path relative to `root` (with `/`).
fn read_dir(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_dir(root, &path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).unwrap();
            let name = relative
                .components()
                .map(|c| c.as_os_str().to_str().unwrap())
                .collect::<Vec<_>>()
                .join("/");
            files.push((name, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

/// A module of the graph: a layer and a name (`run::registry`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Module(String, String);

impl Module {
    fn of(path: &str) -> Module {
        let (layer, name) = path.split_once("::").unwrap();
        Module(layer.to_string(), name.to_string())
    }

    fn layer(&self) -> &str {
        &self.0
    }

    fn rank(&self) -> usize {
        LAYERS.iter().position(|(l, _)| *l == self.0).unwrap()
    }
}

impl std::fmt::Display for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}::{}", self.0, self.1)
    }
}

/// What the check found.
struct Report {
    problems: Vec<String>,
    modules: BTreeSet<Module>,
    edges: BTreeSet<(Module, Module)>,
}

/// One place an import was found: file, line and the path as written.
#[derive(Debug, Clone)]
struct Site {
    file: String,
    line: usize,
    import: String,
}

/// Checks a crate's files (paths relative to `src/`, `lib.rs` the root).
fn check(files: &[(String, String)]) -> Report {
    let mut problems = Vec::new();
    let layer_names: BTreeSet<&str> = LAYERS.iter().map(|(l, _)| *l).collect();

    // Root re-exports: the name at the crate root -> its defining module.
    let mut reexports: BTreeMap<String, Module> = BTreeMap::new();
    if let Some((_, lib)) = files.iter().find(|(p, _)| p == "lib.rs") {
        let tokens = tokenize(lib);
        let mut i = 0;
        while i < tokens.len() {
            if tokens[i].text == "use" {
                let mut leaves = Vec::new();
                let end = parse_tree(&tokens, i + 1, Vec::new(), &mut leaves);
                for leaf in leaves {
                    let mut path = leaf.path.clone();
                    if path.first().is_some_and(|s| s == "crate") {
                        path.remove(0);
                    }
                    // An item (`run::registry::Registry`) or a whole module
                    // (`run::testing`).
                    if path.len() >= 2 && layer_names.contains(path[0].as_str()) {
                        let name = leaf.alias.unwrap_or_else(|| path.last().unwrap().clone());
                        reexports.insert(name, Module(path[0].clone(), path[1].clone()));
                    }
                }
                i = end;
            } else {
                i += 1;
            }
        }
    }

    let mut modules = BTreeSet::new();
    // Every import between two modules, with the sites it was found at.
    let mut imports: BTreeMap<(Module, Module), Vec<Site>> = BTreeMap::new();
    for (path, text) in files {
        if path == "lib.rs" {
            continue;
        }
        let segments = module_path(path);
        if !layer_names.contains(segments[0].as_str()) {
            problems.push(format!(
                "{path}: module `{}` is in no layer folder; every module lives in one of {:?}",
                segments[0], layer_names
            ));
            continue;
        }
        if segments.len() < 2 {
            continue; // A layer's `mod.rs`: its module declarations only.
        }
        let from = Module(segments[0].clone(), segments[1].clone());
        modules.insert(from.clone());
        let tokens = tokenize(text);
        for (leaf, line) in crate_paths(&tokens) {
            let import = leaf.join("::");
            let Some(absolute) = absolute(&segments, &leaf) else {
                problems.push(format!(
                    "{path}:{line}: `{import}` goes above the crate root"
                ));
                continue;
            };
            let to = match absolute.as_slice() {
                [] => continue,
                [layer, module, ..] if layer_names.contains(layer.as_str()) => {
                    Module(layer.clone(), module.clone())
                }
                [layer] if layer_names.contains(layer.as_str()) => continue,
                [name, ..] => match reexports.get(name) {
                    Some(module) => module.clone(),
                    None => {
                        problems.push(format!(
                            "{path}:{line}: `{import}` names `crate::{name}`, which is neither a \
                             layer nor a re-export of lib.rs: import from the defining module"
                        ));
                        continue;
                    }
                },
            };
            if to == from {
                continue;
            }
            if to.rank() > from.rank() {
                problems.push(format!(
                    "{path}:{line}: `{import}`: module `{from}` (layer `{}`) imports `{to}` of \
                     the higher layer `{}`; a module may import only from its own layer and the \
                     layers below it ({})",
                    from.layer(),
                    to.layer(),
                    LAYERS
                        .iter()
                        .map(|(l, _)| *l)
                        .collect::<Vec<_>>()
                        .join(" < ")
                ));
            }
            imports.entry((from.clone(), to)).or_default().push(Site {
                file: path.clone(),
                line,
                import,
            });
        }
    }

    let edges: BTreeSet<(Module, Module)> = imports.keys().cloned().collect();
    if let Some(cycle) = find_cycle(&modules, &edges) {
        let mut text = format!(
            "the modules import each other in a cycle: {}",
            cycle
                .iter()
                .chain(std::iter::once(&cycle[0]))
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
                .join(" -> ")
        );
        for (i, from) in cycle.iter().enumerate() {
            let to = &cycle[(i + 1) % cycle.len()];
            let site = &imports[&(from.clone(), to.clone())][0];
            let _ = write!(
                text,
                "\n  {from} -> {to}: {}:{} `{}`",
                site.file, site.line, site.import
            );
        }
        text.push_str("\n  (no cycle is allowed, inside a layer either)");
        problems.push(text);
    }

    Report {
        problems,
        modules,
        edges,
    }
}

/// The module path of a file: `run/registry/decide.rs` -> `run`, `registry`,
/// `decide`; `run/registry/mod.rs` -> `run`, `registry`.
fn module_path(path: &str) -> Vec<String> {
    let mut segments: Vec<String> = path
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if segments.last().is_some_and(|s| s == "mod") {
        segments.pop();
    }
    segments
}

/// A path found in a file, from the crate root: `crate::a::b` -> `a`, `b`;
/// `super::x` in module `run::registry::decide` -> `run`, `registry`, `x`.
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &path[1..];
        }
        Some("self") => rest = &path[1..],
        _ => {}
    }
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    base.extend(rest.iter().filter(|s| *s != "*").cloned());
    Some(base)
}

/// A cycle in the graph, if any, as the modules along it.
fn find_cycle(
    modules: &BTreeSet<Module>,
    edges: &BTreeSet<(Module, Module)>,
) -> Option<Vec<Module>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        node: &Module,
        edges: &BTreeSet<(Module, Module)>,
        marks: &mut BTreeMap<Module, Mark>,
        stack: &mut Vec<Module>,
    ) -> Option<Vec<Module>> {
        marks.insert(node.clone(), Mark::Open);
        stack.push(node.clone());
        for (_, next) in edges.iter().filter(|(from, _)| from == node) {
            match marks.get(next).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let start = stack.iter().position(|m| m == next).unwrap();
                    return Some(stack[start..].to_vec());
                }
                Mark::New => {
                    if let Some(cycle) = visit(next, edges, marks, stack) {
                        return Some(cycle);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        marks.insert(node.clone(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    let nodes: BTreeSet<&Module> = modules
        .iter()
        .chain(edges.iter().map(|(_, to)| to))
        .collect();
    for node in nodes {
        if marks.get(node).copied().unwrap_or(Mark::New) == Mark::New {
            if let Some(cycle) = visit(node, edges, &mut marks, &mut Vec::new()) {
                return Some(cycle);
            }
        }
    }
    None
}

/// A token of Rust source: an identifier, `::`, or one other character.
#[derive(Debug, Clone)]
struct Token {
    text: String,
    line: usize,
}

/// The tokens of `text` that matter for paths: comments, string and char
/// literals dropped, and every `mod` item under `#[cfg(test)]` (or
/// `#[cfg(all(test, ...))]`) left out.
fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' || ((c == 'b' || c == 'c') && at(i + 1) == '"') {
            // A string: skip to its unescaped closing quote.
            i += if c == '"' { 1 } else { 2 };
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
        } else if (c == 'r' && (at(i + 1) == '"' || at(i + 1) == '#'))
            || (c == 'b' && at(i + 1) == 'r' && (at(i + 2) == '"' || at(i + 2) == '#'))
        {
            // A raw string (or `r#ident`): count the hashes, then skip to the
            // quote followed by as many.
            let mut j = i + if c == 'r' { 1 } else { 2 };
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) != '"' {
                // A raw identifier: `r#name`.
                let start = j;
                while at(j).is_alphanumeric() || at(j) == '_' {
                    j += 1;
                }
                tokens.push(Token {
                    text: chars[start..j].iter().collect(),
                    line,
                });
                i = j;
                continue;
            }
            j += 1;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                    j += 1 + hashes;
                    break;
                }
                if chars[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            i = j;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime ('a).
            if at(i + 1) == '\\' {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            tokens.push(Token {
                text: chars[start..i].iter().collect(),
                line,
            });
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric()
                || at(i) == '_'
                || (at(i) == '.' && at(i + 1).is_ascii_digit())
            {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            tokens.push(Token {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    drop_test_modules(tokens)
}

/// `tokens` without the `mod` items under a `cfg` that needs `test`.
fn drop_test_modules(tokens: Vec<Token>) -> Vec<Token> {
    let mut kept = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i].text == "#" && is_test_cfg(&tokens, i) {
            // Skip this and any further attributes, then a `mod name { ... }`.
            let mut j = i;
            while j < tokens.len() && tokens[j].text == "#" {
                j = skip_group(&tokens, j + 1);
            }
            if tokens.get(j).is_some_and(|t| t.text == "mod")
                && tokens.get(j + 2).is_some_and(|t| t.text == "{")
            {
                i = skip_group(&tokens, j + 2);
                continue;
            }
        }
        kept.push(tokens[i].clone());
        i += 1;
    }
    kept
}

/// Whether the attribute at `i` (`#`) is `#[cfg(test)]` or
/// `#[cfg(all(test, ...))]`.
fn is_test_cfg(tokens: &[Token], i: usize) -> bool {
    let text = |k: usize| tokens.get(i + k).map(|t| t.text.as_str());
    text(1) == Some("[")
        && text(2) == Some("cfg")
        && text(3) == Some("(")
        && (text(4) == Some("test") || (text(4) == Some("all") && text(6) == Some("test")))
}

/// The index after the bracketed group opening at `open` (`[`, `(` or `{`).
fn skip_group(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0;
    let mut i = open;
    while i < tokens.len() {
        match tokens[i].text.as_str() {
            "[" | "(" | "{" => depth += 1,
            "]" | ")" | "}" => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// Every path through the crate in `tokens` (`crate::`, `$crate::`,
/// `super::`, `self::`), groups expanded, with its line.
fn crate_paths(tokens: &[Token]) -> Vec<(Vec<String>, usize)> {
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let starts = matches!(tokens[i].text.as_str(), "crate" | "super" | "self")
            && tokens.get(i + 1).is_some_and(|t| t.text == "::")
            && (i == 0 || tokens[i - 1].text != "::");
        if starts {
            let mut leaves = Vec::new();
            i = parse_tree(tokens, i, Vec::new(), &mut leaves);
            paths.extend(leaves.into_iter().map(|l| (l.path, l.line)));
        } else {
            i += 1;
        }
    }
    paths
}

/// One leaf of a use tree: its whole path, its `as` name, and its line.
struct Leaf {
    path: Vec<String>,
    alias: Option<String>,
    line: usize,
}

/// Parses the path or use tree at `i` under `prefix`; returns the index
/// after it.
fn parse_tree(
    tokens: &[Token],
    mut i: usize,
    mut prefix: Vec<String>,
    leaves: &mut Vec<Leaf>,
) -> usize {
    loop {
        let Some(token) = tokens.get(i) else {
            return i;
        };
        match token.text.as_str() {
            "{" => {
                i += 1;
                while tokens.get(i).is_some_and(|t| t.text != "}") {
                    i = parse_tree(tokens, i, prefix.clone(), leaves);
                    if tokens.get(i).is_some_and(|t| t.text == ",") {
                        i += 1;
                    }
                }
                return i + 1;
            }
            "*" => {
                prefix.push("*".into());
                leaves.push(Leaf {
                    path: prefix,
                    alias: None,
                    line: token.line,
                });
                return i + 1;
            }
            text if text.starts_with(|c: char| c.is_alphabetic() || c == '_') => {
                prefix.push(text.to_string());
                i += 1;
                if tokens.get(i).is_some_and(|t| t.text == "::") {
                    i += 1;
                    continue;
                }
                let mut alias = None;
                if tokens.get(i).is_some_and(|t| t.text == "as") {
                    alias = tokens.get(i + 1).map(|t| t.text.clone());
                    i += 2;
                }
                leaves.push(Leaf {
                    path: prefix,
                    alias,
                    line: token.line,
                });
                return i;
            }
            _ => return i,
        }
    }
}
