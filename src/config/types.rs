//! Value types that validate themselves while they deserialize, so a bad value is reported by
//! `toml` with its exact location, and that print back in the form a user writes them.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use http::uri::Uri;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize, Serializer};

/// Expand `${VAR}` from the environment; a missing variable is an error naming it.
pub fn expand_env(raw: &str) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        // Never quote `raw`: what surrounds a stray `${` may be a literal credential.
        let end = after
            .find('}')
            .ok_or("unterminated `${`: a variable is written `${NAME}`")?;
        let name = &after[..end];
        if name.is_empty() {
            return Err("empty variable name `${}`: write `${NAME}`".into());
        }
        let value =
            std::env::var(name).map_err(|_| format!("environment variable `{name}` is not set"))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Deserialize a string, expand it, and parse it with `parse`.
fn parse_str<'de, D, T>(d: D, parse: impl FnOnce(&str) -> Result<T, String>) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    let raw = String::deserialize(d)?;
    let expanded = expand_env(&raw).map_err(de::Error::custom)?;
    parse(&expanded).map_err(|reason| {
        // A refused value is quoted as written, never as expanded: a variable may hold a
        // credential (`base_url = "${OPENAI_API_KEY}"`).
        let reason = if expanded != raw && !expanded.is_empty() {
            reason.replace(&expanded, &raw)
        } else {
            reason
        };
        de::Error::custom(reason)
    })
}

macro_rules! string_value {
    ($ty:ident, $parse:expr) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                parse_str(d, $parse)
            }
        }
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    };
}

/// A plain string with `${VAR}` expanded.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Text(pub String);
string_value!(Text, |s: &str| Ok(Text(s.to_owned())));
impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A credential-bearing value: expanded like [`Text`], printed as `*****`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);
string_value!(Secret, |s: &str| Ok(Secret(s.to_owned())));
impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}
impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(*****)")
    }
}

/// A Redis URL (`redis://[user:password@]host:port/db`, `unix:///path?pass=...`; no TLS): its
/// password is never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);
string_value!(RedisUrl, parse_redis_url);

/// A Redis URL, checked (not connected to).
pub fn parse_redis_url(s: &str) -> Result<RedisUrl, String> {
    if s.starts_with("rediss://") {
        return Err(
            "TLS Redis URLs (rediss://) are not supported by this build: use redis:// \
                    (on a private network or through a TLS sidecar)"
                .into(),
        );
    }
    match redis::Client::open(s) {
        Ok(_) => Ok(RedisUrl(s.to_owned())),
        // Never the URL itself: an invalid one may not mask its password.
        Err(_) => Err(
            "invalid Redis URL: write redis://[user:password@]host:port/db \
             (or unix:///path/to/redis.sock)"
                .into(),
        ),
    }
}
impl fmt::Display for RedisUrl {
    /// The URL with its user info's password (everything up to the last `@`: a password may
    /// hold `/`, `?` or `#`) and any `pass`/`password` query value replaced by `*****`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.0;
        let Some(scheme_end) = s.find("://").map(|i| i + 3) else {
            return f.write_str("*****");
        };
        let rest = &s[scheme_end..];
        let (userinfo, after) = match rest.rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at..]),
            None => (None, rest),
        };
        f.write_str(&s[..scheme_end])?;
        if let Some(userinfo) = userinfo {
            match userinfo.split_once(':') {
                Some((user, _)) => write!(f, "{user}:*****")?,
                None => f.write_str("*****")?,
            }
        }
        let (path, query) = after.split_once('?').unwrap_or((after, ""));
        f.write_str(path)?;
        if query.is_empty() {
            return Ok(());
        }
        let masked: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if matches!(k, "pass" | "password") => format!("{k}=*****"),
                _ => pair.to_owned(),
            })
            .collect();
        write!(f, "?{}", masked.join("&"))
    }
}
impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisUrl({self})")
    }
}

/// A duration written as a human string: "500ms", "30s", "1m 30s"; at most [`MAX_DURATION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);
string_value!(HumanDuration, parse_duration);

/// The longest duration any key takes: far beyond any sane timeout, and short enough that no
/// instant plus a few of them can overflow (`500000000000y` parses, then panics when added).
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

pub fn parse_duration(s: &str) -> Result<HumanDuration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration `{s}` ({e}); write e.g. \"500ms\" or \"30s\""))?;
    if d > MAX_DURATION {
        return Err(format!(
            "duration `{s}` is too long: at most 365 days (\"365d\")"
        ));
    }
    Ok(HumanDuration(d))
}
impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}
/// When a group sends a hedge: after a fixed time, or after the member's p95 time to an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeAfter {
    Fixed(Duration),
    P95,
}
string_value!(HedgeAfter, |s: &str| {
    if s.trim() == "p95" {
        return Ok(HedgeAfter::P95);
    }
    let d = parse_duration(s).map_err(|e| format!("{e}, or \"p95\""))?.0;
    if d.is_zero() {
        return Err("`hedge_after` must be above zero (leave it out for no hedging)".into());
    }
    Ok(HedgeAfter::Fixed(d))
});
impl fmt::Display for HedgeAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(d) => write!(f, "{}", humantime::format_duration(*d)),
            Self::P95 => f.write_str("p95"),
        }
    }
}

impl HumanDuration {
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }
    pub const fn from_secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }
}

/// A listen address such as `127.0.0.1:8080`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub SocketAddr);
string_value!(ListenAddr, |s: &str| s.parse().map(ListenAddr).map_err(
    |_| format!("invalid listen address `{s}`; write host:port, e.g. \"127.0.0.1:8080\"")
));
impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An upstream base URL: http or https, a host, an optional path, nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl(pub Uri);
string_value!(BaseUrl, parse_base_url);
impl fmt::Display for BaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
impl BaseUrl {
    /// The path without a trailing slash ("" for the root).
    pub fn path(&self) -> &str {
        self.0.path().trim_end_matches('/')
    }
}

pub fn parse_base_url(raw_url: &str) -> Result<BaseUrl, String> {
    // User info and a query string may hold credentials: errors quote the URL without them.
    let shown = redact_url(raw_url);
    let s = shown.as_str();
    let uri: Uri = raw_url
        .parse()
        .map_err(|e| format!("invalid URL `{s}`: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => return Err(format!("URL `{s}` has scheme `{other}`; use http or https")),
        None => return Err(format!("URL `{s}` needs a scheme, e.g. https://{s}")),
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("URL `{s}` has no host"));
    };
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(format!("URL `{s}` must name a host, without user info"));
    }
    if uri.query().is_some() {
        return Err(format!("URL `{s}` must not have a query string"));
    }
    Ok(BaseUrl(uri))
}

/// `url` with its user info and query string, if any, replaced by `*****`.
fn redact_url(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((before, _)) => (before, "?*****"),
        None => (url, ""),
    };
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let authority_end = url[after_scheme..]
        .find('/')
        .map_or(url.len(), |i| after_scheme + i);
    match url[after_scheme..authority_end].rfind('@') {
        Some(at) => format!(
            "{}*****{}{query}",
            &url[..after_scheme],
            &url[after_scheme + at..]
        ),
        None => format!("{url}{query}"),
    }
}

/// A route: a path prefix beginning with `/`, without a trailing slash (except `/` itself).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RoutePrefix(pub String);
string_value!(RoutePrefix, |s: &str| {
    if !s.starts_with('/') {
        return Err(format!("route `{s}` must start with `/`"));
    }
    if s.contains(['?', '#', ' ']) {
        return Err(format!("route `{s}` must be a plain path prefix"));
    }
    let trimmed = s.trim_end_matches('/');
    Ok(RoutePrefix(if trimmed.is_empty() {
        "/".into()
    } else {
        trimmed.into()
    }))
});
impl fmt::Display for RoutePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A size in bytes: an integer, or a string such as "32MiB", "512KiB", "1MB".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub usize);
impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n as usize)),
            Raw::Str(s) => parse_byte_size(&s).map(ByteSize).map_err(de::Error::custom),
        }
    }
}
impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0 as u64)
    }
}

pub fn parse_byte_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("invalid size `{s}`; write e.g. 33554432 or \"32MiB\""))?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "invalid size unit `{other}` in `{s}`; use B, KiB, MiB, GiB, KB, MB or GB"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size `{s}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_variables_and_names_missing_ones() {
        std::env::set_var("CORRAL_TEST_EXPAND", "sk-123");
        assert_eq!(
            expand_env("Bearer ${CORRAL_TEST_EXPAND}").unwrap(),
            "Bearer sk-123"
        );
        assert_eq!(expand_env("plain").unwrap(), "plain");
        let err = expand_env("${CORRAL_TEST_SURELY_UNSET}").unwrap_err();
        assert!(err.contains("`CORRAL_TEST_SURELY_UNSET`"), "{err}");
        assert!(expand_env("${OPEN").is_err());
    }

    #[test]
    fn base_urls() {
        assert_eq!(
            parse_base_url("https://api.openai.com/v1").unwrap().path(),
            "/v1"
        );
        assert_eq!(parse_base_url("http://127.0.0.1:8000").unwrap().path(), "");
        for bad in [
            "ftp://x",
            "api.openai.com",
            "https://",
            "http://h/?q=1",
            "http://u@h/",
        ] {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redis_urls_never_show_their_password() {
        let show = |s: &str| RedisUrl(s.into()).to_string();
        assert_eq!(
            show("redis://user:hunter2@redis:6379/0"),
            "redis://user:*****@redis:6379/0"
        );
        assert_eq!(show("redis://:hunter2@redis/0"), "redis://:*****@redis/0");
        assert_eq!(show("redis://token@redis"), "redis://*****@redis");
        assert_eq!(show("redis://redis:6379"), "redis://redis:6379");
        // A password with `/`, `?`, `#` or `@` in it.
        assert_eq!(
            show("redis://u:a/b?c#d@e@redis:6379/0"),
            "redis://u:*****@redis:6379/0"
        );
        assert_eq!(
            show("unix:///run/redis.sock?db=1&pass=hunter2"),
            "unix:///run/redis.sock?db=1&pass=*****"
        );
        for bad in [
            "http://x:hunter2@redis",
            "redis://u:hunter2@[bad",
            "hunter2",
            "rediss://u:hunter2@redis",
        ] {
            let err = parse_redis_url(bad).unwrap_err();
            assert!(!err.contains("hunter2"), "{err}");
        }
        assert!(parse_redis_url("redis://127.0.0.1:6379/0").is_ok());
    }

    #[test]
    fn durations_are_bounded() {
        assert_eq!(parse_duration("365d").unwrap().0, MAX_DURATION);
        assert_eq!(parse_duration("1m 30s").unwrap().0, Duration::from_secs(90));
        let err = parse_duration("500000000000y").unwrap_err();
        assert_eq!(
            err,
            "duration `500000000000y` is too long: at most 365 days (\"365d\")"
        );
        assert!(parse_duration("366d").is_err());
    }

    #[test]
    fn url_errors_hide_user_info_and_query() {
        let err = parse_base_url("https://user:sk-secret@api.openai.com/v1").unwrap_err();
        assert_eq!(
            err,
            "URL `https://*****@api.openai.com/v1` must name a host, without user info"
        );
        let err = parse_base_url("https://generativelanguage.googleapis.com/v1?key=AIza-secret")
            .unwrap_err();
        assert_eq!(
            err,
            "URL `https://generativelanguage.googleapis.com/v1?*****` must not have a query string"
        );
        assert_eq!(redact_url("sk-no-scheme@x"), "*****@x");
        assert_eq!(redact_url("http://h/p@q"), "http://h/p@q");
    }

    #[test]
    fn expansion_errors_never_quote_the_value() {
        let err = expand_env("Bearer sk-literal-secret ${").unwrap_err();
        assert!(!err.contains("sk-literal"), "{err}");
        let err = expand_env("sk-literal-secret ${}").unwrap_err();
        assert!(!err.contains("sk-literal"), "{err}");
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("32MiB").unwrap(), 32 << 20);
        assert_eq!(parse_byte_size("1000").unwrap(), 1000);
        assert_eq!(parse_byte_size("2 KB").unwrap(), 2000);
        assert!(parse_byte_size("12XB").is_err());
        assert!(parse_byte_size("MiB").is_err());
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret("sk-live".into());
        assert_eq!(format!("{s} {s:?}"), "***** Secret(*****)");
    }
}
