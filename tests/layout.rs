//! The layout `src/lib.rs` documents is the layout of the code: every module it declares is
//! listed once, from the top of the request path down, and each imports only modules listed
//! below it (so no two modules import each other, directly or through others).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// The modules `lib.rs`'s `# Layout` list names, in its order.
fn listed() -> Vec<String> {
    let lib = std::fs::read_to_string(Path::new(SRC).join("lib.rs")).expect("read src/lib.rs");
    lib.lines()
        .skip_while(|l| !l.starts_with("//! # Layout"))
        .take_while(|l| l.starts_with("//!"))
        .filter_map(|l| l.strip_prefix("//! - [`"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_owned()))
        .collect()
}

/// The modules `lib.rs` declares (`pub mod NAME;`).
fn declared() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(Path::new(SRC).join("lib.rs")).expect("read src/lib.rs");
    lib.lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';').to_owned())
        .collect()
}

/// A module's source files: `src/NAME.rs` and everything under `src/NAME/`, test files left out.
fn files(module: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let file = Path::new(SRC).join(format!("{module}.rs"));
    if file.exists() {
        out.push(file);
    }
    let mut dirs = vec![Path::new(SRC).join(module)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "tests") {
                    dirs.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                out.push(path);
            }
        }
    }
    out
}

/// The crate's modules `module` names as `crate::NAME` in its code (comments and the test
/// module at the end of a file left out).
fn imports(module: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for file in files(module) {
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for line in code.lines() {
            let line = line.split("//").next().unwrap_or_default();
            for (at, _) in line.match_indices("crate::") {
                let name: String = line[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if name != module && modules.contains(&name) {
                    found.insert(name);
                }
            }
        }
    }
    found
}

#[test]
fn every_module_is_listed_once() {
    let listed = listed();
    let unique: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(unique.len(), listed.len(), "listed twice: {listed:?}");
    assert_eq!(
        unique,
        declared(),
        "lib.rs's layout list (left) vs its `pub mod`s (right)"
    );
}

#[test]
fn each_module_imports_only_modules_listed_below_it() {
    let listed = listed();
    let modules: BTreeSet<String> = listed.iter().cloned().collect();
    let mut upward = Vec::new();
    for (i, module) in listed.iter().enumerate() {
        for import in imports(module, &modules) {
            let at = listed.iter().position(|m| *m == import).expect("listed");
            if at < i {
                upward.push(format!("{module} imports {import}, listed above it"));
            }
        }
    }
    assert!(upward.is_empty(), "{upward:#?}");
}

#[test]
fn an_import_upward_is_found() {
    // The scan itself: `server` names `crate::router` and `crate::config`.
    let modules: BTreeSet<String> = listed().into_iter().collect();
    let found = imports("server", &modules);
    assert!(
        found.contains("router") && found.contains("config"),
        "{found:?}"
    );
}

/// Every `.rs` file under `src/`, test files included.
fn all_sources() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![PathBuf::from(SRC)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn no_source_file_is_over_700_lines() {
    let long: Vec<String> = all_sources()
        .into_iter()
        .filter_map(|path| {
            let lines = std::fs::read_to_string(&path)
                .expect("read")
                .lines()
                .count();
            (lines > 700).then(|| format!("{} ({lines})", path.display()))
        })
        .collect();
    assert!(long.is_empty(), "{long:#?}");
}

/// Functions of `text` (rustfmt's layout: a `fn` line, its body, and a `}` at the same
/// indentation) longer than `max` lines, test code left out.
fn long_functions(text: &str, max: usize) -> Vec<(String, usize)> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let words: Vec<&str> = body.split_whitespace().collect();
        let Some(at) = words.iter().position(|w| *w == "fn") else {
            continue;
        };
        let qualifiers = [
            "pub",
            "pub(crate)",
            "pub(super)",
            "const",
            "async",
            "unsafe",
        ];
        if !words[..at].iter().all(|w| qualifiers.contains(w)) || body.ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i..].iter().position(|l| *l == close) {
            if end + 1 > max {
                found.push((words[at + 1].to_owned(), end + 1));
            }
        }
    }
    found
}

#[test]
fn no_function_outside_tests_is_over_100_lines() {
    let mut long = Vec::new();
    for path in all_sources() {
        let test_file = path.file_name().is_some_and(|n| n == "tests.rs")
            || path.components().any(|c| c.as_os_str() == "tests");
        if test_file {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        for (name, lines) in long_functions(&text, 100) {
            long.push(format!("{}: {name} ({lines} lines)", path.display()));
        }
    }
    assert!(long.is_empty(), "{long:#?}");
}

#[test]
fn a_long_function_is_found() {
    let body = "    let x = 1;\n".repeat(101);
    let text = format!("impl A {{\n    pub fn long(&self) {{\n{body}    }}\n}}\n");
    assert_eq!(
        long_functions(&text, 100),
        [("long(&self)".to_owned(), 103)]
    );
}
