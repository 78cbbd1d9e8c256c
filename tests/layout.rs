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
    assert_eq!(unique, declared(), "lib.rs's layout list (left) vs its `pub mod`s (right)");
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
    assert!(found.contains("router") && found.contains("config"), "{found:?}");
}
