//! The docs keep their shape: `README.md` is a front door of at most 300 lines, the five pages of
//! `docs/` exist and the README links each of them, and every relative link in `README.md`,
//! `deploy/README.md` and `docs/*.md` points at a file or directory that exists, its `#anchor`
//! (if any) at a heading of that page.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The most lines `README.md` may have.
const README_MAX_LINES: usize = 300;

/// The pages of `docs/`, each linked from the README.
const PAGES: &[&str] = &[
    "configuration.md",
    "operations.md",
    "benchmarks.md",
    "design.md",
    "testing.md",
];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// `README.md`, `deploy/README.md` and every `docs/*.md`.
fn markdown_files() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut files = vec![root.join("README.md"), root.join("deploy/README.md")];
    let docs = std::fs::read_dir(root.join("docs")).expect("read docs/");
    let mut pages: Vec<PathBuf> = docs
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

/// The lines of `text` outside fenced code blocks, which hold no links or headings.
fn outside_fences(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            lines.push(line);
        }
    }
    lines
}

/// The targets of the inline links (`[text](target)`, images too) in `text`, outside code.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in outside_fences(text) {
        // Inline code spans hold no links: keep what lies between them.
        let line: String = line.split('`').step_by(2).collect();
        let mut rest = line.as_str();
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            let target = rest[..end].split_whitespace().next().unwrap_or_default();
            targets.push(target.to_owned());
            rest = &rest[end..];
        }
    }
    targets
}

/// GitHub's anchor for a heading: lower case, letters, digits, `-` and `_` kept, spaces made
/// `-`, everything else dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings; a repeated one gets `-1`, `-2`, ... as on GitHub.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    for line in outside_fences(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let base = slug(heading.trim_start_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while !anchors.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
    }
    anchors
}

/// `path` shown from the crate's root.
fn shown(path: &Path) -> String {
    path.strip_prefix(ROOT)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn the_readme_is_a_front_door_of_at_most_300_lines() {
    let readme = read(&Path::new(ROOT).join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a page of \
         docs/ and link it"
    );
}

#[test]
fn the_five_docs_pages_exist_and_the_readme_links_each() {
    let readme = read(&Path::new(ROOT).join("README.md"));
    let linked: BTreeSet<String> = link_targets(&readme)
        .into_iter()
        .map(|t| t.split('#').next().unwrap_or_default().to_owned())
        .collect();
    for page in PAGES {
        let path = Path::new(ROOT).join("docs").join(page);
        assert!(path.is_file(), "docs/{page} is missing");
        assert!(
            linked.contains(&format!("docs/{page}")),
            "README.md does not link docs/{page}"
        );
    }
}

#[test]
fn every_relative_link_points_at_something_that_exists() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        let dir = file.parent().expect("a file's directory");
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            if !linked.exists() {
                broken.push(format!("{}: `{target}`: no such file", shown(&file)));
                continue;
            }
            if let Some(anchor) = anchor {
                let page = read(&linked);
                if !anchors(&page).contains(anchor) {
                    broken.push(format!(
                        "{}: `{target}`: no heading with that anchor in {}",
                        shown(&file),
                        shown(&linked)
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "broken links:\n  {}",
        broken.join("\n  ")
    );
    assert!(checked >= 20, "checked only {checked} links");
}
