//! Reading a config file and turning every failure into `file:line: key: reason`.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use super::Config;

/// The configuration corral runs on when given none: `/v1` to OpenAI on 127.0.0.1:8080.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// A configuration that cannot be used, located as precisely as corral can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: Option<usize>,
    pub key: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}: {}", self.file, line, self.key, self.reason),
            None => write!(f, "{}: {}: {}", self.file, self.key, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Read and validate the file at `path`; a relative `tls_ca_file` is taken from its directory.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: file.clone(),
        line: None,
        key: "(file)".into(),
        reason: format!("cannot read: {e}"),
    })?;
    load(&file, &text, path.parent())
}

/// Parse and validate `text`, naming it `file` in errors. There is no directory to resolve a
/// relative `tls_ca_file` against: it is taken from the working directory.
pub fn load_str(file: &str, text: &str) -> Result<Config, ConfigError> {
    load(file, text, None)
}

/// Parse and validate `text`, then read the CA files it names (relative to `dir`, if given).
fn load(file: &str, text: &str, dir: Option<&Path>) -> Result<Config, ConfigError> {
    let mut config: Config = toml::from_str(text).map_err(|e| {
        let span = e.span();
        let (line, key) = match &span {
            Some(span) => (Some(line_of(text, span.start)), key_at(text, span.clone())),
            None => (None, "(document)".into()),
        };
        let reason = redact_secrets(text, e.message().trim());
        ConfigError {
            file: file.into(),
            line,
            key,
            reason,
        }
    })?;
    super::validate::validate(&config).map_err(|v| ConfigError {
        file: file.into(),
        line: match v.span {
            Some(s) => Some(refine_line(text, s.start, &v.key)),
            None => top_level_line(text, &v.key),
        },
        key: v.key,
        reason: v.reason,
    })?;
    // Last, once the rest is known good: the only step that touches other files.
    for (i, up) in config.upstreams.iter_mut().enumerate() {
        if let Some(ca) = &mut up.tls_ca_file {
            let line = line_of(text, ca.span().start);
            ca.get_mut().read(dir).map_err(|reason| ConfigError {
                file: file.into(),
                line: Some(line),
                key: format!("upstream[{i}].tls_ca_file"),
                reason,
            })?;
        }
    }
    Ok(config)
}

/// `reason` with every secret-bearing value of `text` replaced by `*****`: each upstream's
/// `headers` and `keys`, and `[fleet] redis` (or `fleet` itself, written as a string). toml
/// quotes the value it refuses (`invalid type: string "sk-...", expected a sequence`) whatever
/// its key, and such a value is likely a credential. A `text` that is not even TOML quotes no
/// values: toml's syntax errors name what they expected.
fn redact_secrets(text: &str, reason: &str) -> String {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return reason.to_owned();
    };
    let mut secrets = Vec::new();
    let upstreams = match doc.get("upstream") {
        Some(toml::Value::Array(ups)) => ups.iter().collect(),
        Some(up) => vec![up],
        None => Vec::new(),
    };
    for up in upstreams.into_iter().filter_map(toml::Value::as_table) {
        for field in ["headers", "keys"] {
            leaves(up.get(field), &mut secrets);
        }
    }
    match doc.get("fleet") {
        Some(toml::Value::Table(fleet)) => leaves(fleet.get("redis"), &mut secrets),
        other => leaves(other, &mut secrets),
    }
    // The longest first, so a secret holding another is replaced whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut reason = reason.to_owned();
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        // serde quotes a string as Rust's `Debug` does (escapes included).
        reason = reason
            .replace(&format!("{secret:?}"), "\"*****\"")
            .replace(secret.as_str(), "*****");
    }
    reason
}

/// Every value under `value` as toml prints it (strings as they are).
fn leaves(value: Option<&toml::Value>, out: &mut Vec<String>) {
    match value {
        None => {}
        Some(toml::Value::String(s)) => out.push(s.clone()),
        Some(toml::Value::Array(items)) => items.iter().for_each(|v| leaves(Some(v), out)),
        Some(toml::Value::Table(table)) => table.values().for_each(|v| leaves(Some(v), out)),
        Some(other) => out.push(other.to_string()),
    }
}

/// 1-based line number of byte `offset`.
pub(super) fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The line where top-level `key` is written (before the first table), if it is.
fn top_level_line(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .take_while(|l| !l.trim_start().starts_with('['))
        .position(|l| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|r| r.trim_start().starts_with('='))
        })
        .map(|i| i + 1)
}

/// The line of `key`'s last segment within the upstream table that starts near `offset`, or the
/// line of `offset` itself when the key was not written (a default took its place).
fn refine_line(text: &str, offset: usize, key: &str) -> usize {
    let base = line_of(text, offset);
    let leaf = key.rsplit('.').next().unwrap_or(key);
    if !key.contains("].") || leaf.contains('[') {
        return base;
    }
    let lines = text.lines().enumerate().skip(base - 1);
    for (i, line) in lines.skip(1) {
        let line = line.trim_start();
        if line.starts_with("[[") {
            break;
        }
        if line
            .strip_prefix(leaf)
            .is_some_and(|r| r.trim_start().starts_with('='))
        {
            return i + 1;
        }
    }
    base
}

/// The dotted key an error span points into: the enclosing table header plus the key on that
/// line (toml's messages name the problem but not always the key).
fn key_at(text: &str, span: Range<usize>) -> String {
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let line = text[line_start..line_end].trim();
    let table = text[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|h| h.trim_matches(|c| c == '[' || c == ']').trim().to_owned());
    if line.starts_with('[') {
        return line
            .trim_matches(|c| c == '[' || c == ']')
            .trim()
            .to_owned();
    }
    // A line without a key continues a value (a multi-line array, whose items may be keys):
    // the key is the nearest one above it in its table, never a piece of the value.
    let key = key_of_line(line).or_else(|| {
        text[..line_start]
            .lines()
            .rev()
            .map(str::trim)
            .take_while(|l| !l.starts_with('['))
            .find_map(key_of_line)
    });
    match (table, key) {
        (Some(t), Some(key)) => format!("{t}.{key}"),
        (Some(t), None) => t,
        (None, Some(key)) => key.to_owned(),
        (None, None) => "(document)".into(),
    }
}

/// The key a `key = value` line assigns (bare, dotted or quoted), if the line is one.
fn key_of_line(line: &str) -> Option<&str> {
    let (key, rest) = match line.chars().next()? {
        quote @ ('"' | '\'') => {
            let end = line[1..].find(quote)? + 1;
            (&line[1..end], &line[end + 1..])
        }
        _ => {
            let end = line
                .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
                .unwrap_or(line.len());
            (&line[..end], &line[end..])
        }
    };
    (!key.is_empty() && rest.trim_start().starts_with('=')).then_some(key)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::AccessLog;

    const UPSTREAM: &str =
        "[[upstream]]\nname = \"openai\"\nroute = \"/v1\"\nbase_url = \"https://api.openai.com/v1\"\n";

    fn load(top: &str) -> Result<Config, String> {
        load_str("corral.toml", &format!("{top}{UPSTREAM}")).map_err(|e| e.to_string())
    }

    #[test]
    fn access_log_defaults_to_notable_past_30s() {
        let config = load("").unwrap();
        assert_eq!(config.access_log, AccessLog::Notable);
        assert_eq!(config.slow_request.0, Duration::from_secs(30));
        let config = load("access_log = \"all\"\nslow_request = \"2m\"\n").unwrap();
        assert_eq!(config.access_log, AccessLog::All);
        assert_eq!(config.slow_request.0, Duration::from_secs(120));
        assert_eq!(
            load("access_log = \"off\"\n").unwrap().access_log,
            AccessLog::Off
        );
    }

    #[test]
    fn an_unknown_access_log_is_refused_with_the_allowed_values() {
        let err = load("listen = \"127.0.0.1:0\"\naccess_log = \"some\"\n").unwrap_err();
        assert_eq!(
            err,
            "corral.toml:2: access_log: unknown variant `some`, expected one of `notable`, `all`, \
             `off`"
        );
    }

    #[test]
    fn slow_request_must_be_a_duration_above_zero() {
        let err = load("slow_request = \"0s\"\n").unwrap_err();
        assert_eq!(
            err,
            "corral.toml:1: slow_request: `slow_request` must be above zero; to log every \
             request, set `access_log = \"all\"`"
        );
        let err = load("\nslow_request = \"soon\"\n").unwrap_err();
        assert!(
            err.starts_with("corral.toml:2: slow_request: invalid duration `soon`"),
            "{err}"
        );
    }

    /// A pool key, an injected header value or a Redis URL written in the wrong shape (or
    /// breaking the syntax) is never quoted; the error still names the file, line and key.
    #[test]
    fn a_secret_written_in_the_wrong_shape_is_never_quoted() {
        let cases = [
            (
                format!("{UPSTREAM}keys = \"sk-live-SECRETVALUE\"\n[upstream.headers]\nAuthorization = \"Bearer {{key}}\"\n"),
                "corral.toml:5: upstream.keys: invalid type: string \"*****\"",
            ),
            (
                format!("{UPSTREAM}keys = \"sk-live-SECRET\\\"VALUE\"\n"),
                "corral.toml:5: upstream.keys: invalid type: string \"*****\"",
            ),
            (
                format!("fleet = \"redis://:SECRETVALUE@127.0.0.1:6379/0\"\n{UPSTREAM}"),
                "corral.toml:1: fleet: invalid type: string \"*****\"",
            ),
            (
                format!("{UPSTREAM}[upstream.headers]\nx-api-key = 123456789\n"),
                "corral.toml:6: upstream.headers.x-api-key: invalid type: integer `*****`",
            ),
            (
                format!("{UPSTREAM}headers = \"Bearer sk-live-SECRETVALUE\"\n"),
                "corral.toml:5: upstream.headers: invalid type: string \"*****\"",
            ),
            (
                format!("{UPSTREAM}keys = [\n  \"sk-a-SECRETVALUE\"\n  \"sk-b-SECRETVALUE\"\n]\n"),
                "corral.toml:7: upstream.keys: invalid array",
            ),
            (
                format!("{UPSTREAM}keys = [\n  \"sk-a-SECRETVALUE\",\n  123456789,\n]\n"),
                "corral.toml:7: upstream.keys: invalid type: integer `*****`",
            ),
            (
                format!("{UPSTREAM}[upstream.headers]\nAuthorization = Bearer sk-live-SECRETVALUE\n"),
                "corral.toml:6: upstream.headers.Authorization: invalid string",
            ),
        ];
        for (toml, want) in &cases {
            let err = load_str("corral.toml", toml).unwrap_err().to_string();
            assert!(
                !err.contains("SECRET") && !err.contains("123456789"),
                "{toml}\n=> {err}"
            );
            assert!(err.starts_with(want), "{toml}\n=> {err}");
        }
    }
}
