//! `docs/configuration.md`'s "Configuration reference" stays in step with the config structs: every
//! key of every table is documented, no documented key is gone, and each literal default in the
//! tables is the default the structs really have.
//!
//! The real keys come from serializing a [`Config`] with one upstream (serde_json keeps `None`
//! fields as `null`, so optional keys are listed too); the documented ones from the
//! `| \`key\` | default | meaning |` rows under each `### ` heading of that section.

use std::collections::{BTreeMap, BTreeSet};

use corral::config::types::parse_base_url;
use corral::config::{Config, UpstreamConfig};
use serde_json::Value;

/// Tables whose keys are the user's (header names), documented as one key.
const FREE_FORM: &[&str] = &["upstream.headers", "upstream.limits.model_groups"];

/// `docs/configuration.md`'s reference section, and the table (`""` for the top level) each
/// `### ` heading documents.
fn reference_tables() -> BTreeMap<String, Vec<(String, String)>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let page = std::fs::read_to_string(path).expect("read docs/configuration.md");
    let start = page
        .find("\n## Configuration reference\n")
        .expect("docs/configuration.md has a `## Configuration reference` section");
    let section = &page[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    let mut tables = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in section[..end].lines() {
        if let Some(heading) = line.strip_prefix("### ") {
            current = table_of_heading(heading.trim());
            if let Some(t) = &current {
                assert!(
                    tables.insert(t.clone(), Vec::new()).is_none(),
                    "table `{t}` documented twice"
                );
            }
        } else if let (Some(table), Some(row)) = (&current, line.strip_prefix("| `")) {
            let (key, rest) = row.split_once('`').expect("| `key` | ...");
            let default = rest
                .trim_start_matches([' ', '|'])
                .split(" |")
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned();
            tables
                .get_mut(table)
                .expect("current table")
                .push((key.to_owned(), default));
        }
    }
    tables
}

/// `Top level` -> `""`, `` `[[upstream]]` `` -> `upstream`, `` `[upstream.limits]` `` ->
/// `upstream.limits`; other headings (Command line) document no table.
fn table_of_heading(heading: &str) -> Option<String> {
    if heading == "Top level" {
        return Some(String::new());
    }
    let inner = heading.strip_prefix('`')?.strip_suffix('`')?;
    let name = inner
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    assert!(
        inner.starts_with('[') && !name.is_empty(),
        "heading `{heading}`: write a table as `[name]` or `[[name]]`"
    );
    Some(name)
}

/// Every table of the structs with its keys and default values: serialized from the defaults,
/// with one upstream (an array of tables is described by its first element).
fn struct_tables() -> BTreeMap<String, BTreeMap<String, Value>> {
    let base_url = parse_base_url("https://api.openai.com/v1").expect("a valid base URL");
    let group = "name = \"chat\"\nroute = \"/chat\"\nmembers = [\"openai\"]\n";
    let config = Config {
        upstreams: vec![UpstreamConfig::new("openai", "/v1", base_url)],
        groups: vec![toml::from_str(group).expect("a group")],
        ..Config::default()
    };
    let value = serde_json::to_value(&config).expect("Config serializes");
    let mut tables = BTreeMap::new();
    walk("", &value, &mut tables);
    tables
}

fn walk(name: &str, value: &Value, tables: &mut BTreeMap<String, BTreeMap<String, Value>>) {
    let object = value.as_object().expect("a table");
    let mut keys = BTreeMap::new();
    for (key, v) in object {
        let path = if name.is_empty() {
            key.clone()
        } else {
            format!("{name}.{key}")
        };
        let nested = match v {
            Value::Object(_) if !FREE_FORM.contains(&path.as_str()) => Some(v),
            Value::Array(items) if items.first().is_some_and(Value::is_object) => items.first(),
            _ => None,
        };
        match nested {
            Some(table) => walk(&path, table, tables),
            None => {
                keys.insert(key.clone(), v.clone());
            }
        }
    }
    tables.insert(name.to_owned(), keys);
}

#[test]
fn every_config_key_is_documented_and_every_documented_key_exists() {
    let documented = reference_tables();
    let real = struct_tables();
    assert_eq!(
        documented.keys().collect::<BTreeSet<_>>(),
        real.keys().collect::<BTreeSet<_>>(),
        "docs/configuration.md `### ` tables (left) vs the config's tables (right)"
    );
    for (table, rows) in &documented {
        let shown = if table.is_empty() { "top level" } else { table };
        let mut keys = BTreeSet::new();
        for (key, _) in rows {
            // A row naming a table (`[[upstream]]`) points at that table's own heading.
            if let Some(sub) = key.strip_prefix('[') {
                let sub = sub.trim_start_matches('[').trim_end_matches(']');
                assert!(real.contains_key(sub), "{shown}: `{key}` is no table");
                continue;
            }
            assert!(
                keys.insert(key.clone()),
                "{shown}: `{key}` documented twice"
            );
        }
        let want: BTreeSet<String> = real[table].keys().cloned().collect();
        let missing: Vec<_> = want.difference(&keys).collect();
        let extra: Vec<_> = keys.difference(&want).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "docs/configuration.md table for {shown}: undocumented keys {missing:?}, documented keys that do not \
             exist {extra:?}"
        );
    }
}

/// `"30s"`, `1024`, `true`, `0.97`, `[]`, `{}`, `unset`, `"32MiB"` compared with the struct's
/// default; prose defaults (`required`, `rpm / 60`, ...) are left to the reader.
#[test]
fn literal_defaults_in_the_reference_are_the_real_defaults() {
    let real = struct_tables();
    let mut compared = 0;
    for (table, rows) in reference_tables() {
        for (key, default) in rows {
            let Some(actual) = real.get(&table).and_then(|t| t.get(&key)) else {
                continue;
            };
            let Some(literal) = default
                .strip_prefix('`')
                .and_then(|d| d.strip_suffix('`'))
                .filter(|d| !d.contains('`'))
            else {
                if default == "unset" {
                    assert!(
                        actual.is_null(),
                        "{table} {key}: docs/configuration.md says unset, is {actual}"
                    );
                    compared += 1;
                }
                continue;
            };
            let Ok(documented) = serde_json::from_str::<Value>(literal) else {
                continue;
            };
            let same = match (&documented, actual) {
                (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
                (Value::String(size), Value::Number(bytes)) => {
                    parse_size(size).is_some_and(|s| Some(s) == bytes.as_u64())
                }
                (a, b) => a == b,
            };
            assert!(
                same,
                "docs/configuration.md says `{table}{}{key}` defaults to {literal}; the structs say {actual}",
                if table.is_empty() { "" } else { "." }
            );
            compared += 1;
        }
    }
    assert!(compared >= 40, "compared only {compared} defaults");
}

/// `"32MiB"`, `"512KiB"`, `"1MB"` in bytes.
fn parse_size(s: &str) -> Option<u64> {
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let factor = match unit {
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return None,
    };
    Some(n.parse::<u64>().ok()? * factor)
}
