//! Checks that span several keys, after every value has parsed on its own.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use super::{Config, DEFAULT_GRACE_PERIOD};

/// A rejected configuration, before the file name and line are attached.
pub(super) struct Invalid {
    pub span: Option<Range<usize>>,
    pub key: String,
    pub reason: String,
}

/// Longest value of a connection timeout or drain setting: beyond it a typo, not a choice.
const MAX_SERVER_DURATION: Duration = Duration::from_secs(3600);

/// Routes that name corral's own admin endpoints when `admin_listen` does not move them.
const RESERVED_ROUTES: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/status"];

/// A rejected key of one upstream or group, before its index and span are attached: the key
/// below `upstream[i].` or `group[i].`, and why.
struct BadField {
    field: &'static str,
    reason: String,
}

impl BadField {
    fn new(field: &'static str, reason: String) -> Self {
        Self { field, reason }
    }
}

/// Every check that spans several keys, in order: server, fleet, the buffer cap, each
/// upstream, then the groups (whose routes share one namespace with the upstreams').
pub(super) fn validate(config: &Config) -> Result<(), Invalid> {
    validate_server(config)?;
    validate_fleet(&config.fleet)?;
    validate_buffer_cap(config)?;
    let mut routes: HashMap<&str, &str> = HashMap::new();
    validate_upstreams(config, &mut routes)?;
    validate_groups(config, &mut routes)?;
    Ok(())
}

/// `max_buffered_bytes`, when set, is at least the smallest buffer budget.
fn validate_buffer_cap(config: &Config) -> Result<(), Invalid> {
    let min_buffer = super::MIN_BUFFER_CAP;
    if let Some(cap) = config.max_buffered_bytes {
        if cap.0 < min_buffer {
            return Err(Invalid {
                span: None,
                key: "max_buffered_bytes".into(),
                reason: format!(
                    "`max_buffered_bytes` must be at least {min_buffer} bytes (1MiB), got {}",
                    cap.0
                ),
            });
        }
    }
    Ok(())
}

/// Each upstream: a plain, distinct name, a distinct route that is not an admin endpoint, then
/// its own settings. `routes` collects each route and the upstream that holds it.
fn validate_upstreams<'a>(
    config: &'a Config,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), Invalid> {
    let mut names: HashMap<&str, ()> = HashMap::new();
    for (i, up) in config.upstreams.iter().enumerate() {
        let at = |bad: BadField| Invalid {
            span: Some(up.name.span()),
            key: format!("upstream[{i}].{}", bad.field),
            reason: bad.reason,
        };
        plain_name(up.name()).map_err(|reason| at(BadField::new("name", reason)))?;
        if names.insert(up.name(), ()).is_some() {
            return Err(at(BadField::new(
                "name",
                format!("duplicate upstream name `{}`", up.name()),
            )));
        }
        validate_upstream_route(config, i, up, routes)?;
        validate_upstream(up, config.max_buffered_bytes).map_err(at)?;
    }
    Ok(())
}

/// An upstream's route: used by no other upstream, and not an admin endpoint's unless
/// `admin_listen` moves those. An empty route (a group member's) is checked with the groups.
fn validate_upstream_route<'a>(
    config: &Config,
    i: usize,
    up: &'a super::UpstreamConfig,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), Invalid> {
    let route_err = |reason: String| Invalid {
        span: Some(up.route.span()),
        key: format!("upstream[{i}].route"),
        reason,
    };
    if up.route().is_empty() {
        // A group member without a route of its own: checked with the groups below.
    } else if let Some(other) = routes.insert(up.route(), up.name()) {
        return Err(route_err(format!(
            "duplicate route `{}` (also used by upstream `{other}`)",
            up.route()
        )));
    }
    if config.admin_listen.is_none() && RESERVED_ROUTES.contains(&up.route()) {
        return Err(route_err(format!(
            "route `{}` is reserved for corral's admin endpoints; set `admin_listen` to move them",
            up.route()
        )));
    }
    Ok(())
}

/// One upstream's own settings, section by section: headers, keys, body, retry, breaker,
/// model groups, adaptive, limits.
fn validate_upstream(
    up: &super::UpstreamConfig,
    max_buffered_bytes: Option<super::ByteSize>,
) -> Result<(), BadField> {
    validate_headers(up)?;
    validate_keys(up)?;
    validate_body(up, max_buffered_bytes)?;
    validate_retry(&up.retry)?;
    validate_breaker(up)?;
    validate_model_groups(&up.limits)?;
    validate_adaptive(&up.adaptive)?;
    validate_limits(&up.limits)
}

/// Configured headers: valid names, then valid values.
fn validate_headers(up: &super::UpstreamConfig) -> Result<(), BadField> {
    for name in up.headers.keys() {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(BadField::new(
                "headers",
                format!("`{name}` is not a valid header name"),
            ));
        }
    }
    for (name, value) in &up.headers {
        if http::HeaderValue::from_str(&value.0).is_err() {
            return Err(BadField::new(
                "headers",
                format!("value of `{name}` is not a valid header value"),
            ));
        }
    }
    Ok(())
}

/// The request body: a `body_limit` that `max_buffered_bytes` could hold, idle timeouts above
/// zero.
fn validate_body(
    up: &super::UpstreamConfig,
    max_buffered_bytes: Option<super::ByteSize>,
) -> Result<(), BadField> {
    if let Some(cap) = max_buffered_bytes {
        if up.body_limit.0 > cap.0 {
            return Err(BadField::new(
                "body_limit",
                format!(
                    "`body_limit` ({} bytes) must not exceed `max_buffered_bytes` ({} bytes): \
                     such a body could never be held",
                    up.body_limit.0, cap.0
                ),
            ));
        }
    }
    if up.body_idle_timeout.0.is_zero() || up.stream_idle_timeout.0.is_zero() {
        return Err(BadField::new(
            "body_idle_timeout",
            "`body_idle_timeout` and `stream_idle_timeout` must be above zero".into(),
        ));
    }
    Ok(())
}

/// `[upstream.retry]`: a schedule whose cap is at least its base, a base above zero when it is
/// jittered, deadlines above zero, and a budget of 0..=10 retries per request kept 1 s to 60 s.
fn validate_retry(r: &super::RetryConfig) -> Result<(), BadField> {
    if r.cap < r.base {
        return Err(BadField::new(
            "retry.cap",
            format!("`cap` ({}) must be at least `base` ({})", r.cap, r.base),
        ));
    }
    if r.base.0.is_zero() && !matches!(r.jitter, super::Jitter::None) && r.max_retries > 0 {
        return Err(BadField::new(
            "retry.base",
            "`base` must be above zero".into(),
        ));
    }
    if r.deadline.0.is_zero() || r.per_try_timeout.0.is_zero() {
        return Err(BadField::new(
            "retry.deadline",
            "`deadline` and `per_try_timeout` must be above zero".into(),
        ));
    }
    if !(0.0..=10.0).contains(&r.budget_ratio) || !r.budget_ratio.is_finite() {
        return Err(BadField::new(
            "retry.budget_ratio",
            format!(
                "`budget_ratio` must be within 0..=10, got {}",
                r.budget_ratio
            ),
        ));
    }
    if r.budget_ttl.0 < std::time::Duration::from_secs(1)
        || r.budget_ttl.0 > std::time::Duration::from_secs(60)
    {
        return Err(BadField::new(
            "retry.budget_ttl",
            "`budget_ttl` must be between 1s and 60s".into(),
        ));
    }
    Ok(())
}

/// `[upstream.breaker]`: error rates within 0..=1 that close below where they open, a window
/// that holds its minimum samples, at least one probe, a cool-down that can grow, a release
/// ramp above zero, and no counting of throttles when the limits are split into partitions.
fn validate_breaker(up: &super::UpstreamConfig) -> Result<(), BadField> {
    let b = &up.breaker;
    let rate_ok = |x: f64| (0.0..=1.0).contains(&x);
    if !rate_ok(b.open_error_rate) || !rate_ok(b.close_error_rate) {
        return Err(BadField::new(
            "breaker.open_error_rate",
            "error rates must be within 0.0..=1.0".into(),
        ));
    }
    if b.close_error_rate > b.open_error_rate {
        return Err(BadField::new(
            "breaker.close_error_rate",
            format!(
                "`close_error_rate` ({}) must not exceed `open_error_rate` ({})",
                b.close_error_rate, b.open_error_rate
            ),
        ));
    }
    if b.window == 0 || b.min_samples == 0 || b.min_samples > b.window {
        return Err(BadField::new(
            "breaker.min_samples",
            format!(
                "need 0 < `min_samples` ({}) <= `window` ({})",
                b.min_samples, b.window
            ),
        ));
    }
    if b.half_open_probes == 0 {
        return Err(BadField::new(
            "breaker.half_open_probes",
            "`half_open_probes` must be at least 1".into(),
        ));
    }
    if b.max_cooldown < b.cooldown {
        return Err(BadField::new(
            "breaker.max_cooldown",
            "`max_cooldown` must be at least `cooldown`".into(),
        ));
    }
    if b.release_ramp.0.is_zero() {
        return Err(BadField::new(
            "breaker.release_ramp",
            "`release_ramp` must be above zero, or held requests would all leave at once \
             when the breaker closes"
                .into(),
        ));
    }
    let split = up
        .limits
        .partition
        .filter(|p| *p != super::Partition::Upstream);
    if let Some(partition) = split.filter(|_| b.enabled && b.count_throttles) {
        return Err(BadField::new(
            "breaker.count_throttles",
            format!(
                "`count_throttles = true` cannot be combined with `limits.partition = \"{}\"`: \
                 429s are per partition, and the upstream's one breaker would let one \
                 partition's throttling hold every partition's traffic; leave \
                 `count_throttles = false`, or set `partition = \"upstream\"`",
                partition.label()
            ),
        ));
    }
    Ok(())
}

/// `limits.model_groups`: every model and every limit group named.
fn validate_model_groups(limits: &super::LimitsConfig) -> Result<(), BadField> {
    for (model, group) in &limits.model_groups {
        if model.is_empty() || group.is_empty() {
            return Err(BadField::new(
                "limits.model_groups",
                format!(
                    "a model and its limit group must both be named (got {model:?} = {group:?})"
                ),
            ));
        }
    }
    Ok(())
}

/// `[upstream.adaptive]`: a rate margin within (0, 1], a latency tolerance of at least 1, and
/// starting points of at least 1 that respect the concurrency floor.
fn validate_adaptive(a: &super::AdaptiveConfig) -> Result<(), BadField> {
    if !(a.rate_margin > 0.0 && a.rate_margin <= 1.0) {
        return Err(BadField::new(
            "adaptive.rate_margin",
            format!("`rate_margin` must be within (0, 1], got {}", a.rate_margin),
        ));
    }
    if !(a.latency_tolerance >= 1.0 && a.latency_tolerance.is_finite()) {
        return Err(BadField::new(
            "adaptive.latency_tolerance",
            "`latency_tolerance` must be at least 1.0".into(),
        ));
    }
    if a.initial_burst == 0 || a.min_concurrency == 0 || a.initial_concurrency < a.min_concurrency {
        return Err(BadField::new("adaptive.initial_burst", "`initial_burst`, `min_concurrency` must be at least 1 and `initial_concurrency` >= `min_concurrency`".into()));
    }
    Ok(())
}

/// `[upstream.limits]`: a burst no larger than `rpm`, and a token burst only beside `tpm`.
fn validate_limits(limits: &super::LimitsConfig) -> Result<(), BadField> {
    if let (Some(burst), Some(rpm)) = (limits.burst, limits.rpm) {
        if burst > rpm {
            return Err(BadField::new(
                "limits.burst",
                format!("`burst` ({burst}) must not exceed `rpm` ({rpm})"),
            ));
        }
    }
    if limits.token_burst.is_some() && limits.tpm.is_none() {
        return Err(BadField::new(
            "limits.token_burst",
            "`token_burst` needs `tpm`".into(),
        ));
    }
    Ok(())
}

/// The top-level connection and drain settings: timeouts above zero, every one at most an hour;
/// `slow_request` above zero.
fn validate_server(config: &Config) -> Result<(), Invalid> {
    let durations = [
        ("first_byte_timeout", config.first_byte_timeout, false),
        ("idle_timeout", config.idle_timeout, false),
        ("write_timeout", config.write_timeout, false),
        (
            "http2_keep_alive_interval",
            config.http2_keep_alive_interval,
            false,
        ),
        ("drain_delay", config.drain_delay, true),
        ("drain_timeout", config.drain_timeout, true),
    ];
    for (key, value, zero_ok) in durations {
        let reason = if value.0.is_zero() && !zero_ok {
            format!("`{key}` must be above zero")
        } else if value.0 > MAX_SERVER_DURATION {
            format!("`{key}` must be at most 1h, got {value}")
        } else {
            continue;
        };
        return Err(Invalid {
            span: None,
            key: key.into(),
            reason,
        });
    }
    if config.slow_request.0.is_zero() {
        return Err(Invalid {
            span: None,
            key: "slow_request".into(),
            reason: "`slow_request` must be above zero; to log every request, set \
                     `access_log = \"all\"`"
                .into(),
        });
    }
    Ok(())
}

/// `[fleet]`: a lease timeout between 1ms and 10s, a heartbeat TTL of 1s to 1h, at least one
/// failure, a name of letters, digits, `.`, `_` and `-`.
fn validate_fleet(fleet: &super::FleetConfig) -> Result<(), Invalid> {
    let bad = |key: &str, reason: String| {
        Err(Invalid {
            span: None,
            key: format!("fleet.{key}"),
            reason,
        })
    };
    let lease = fleet.lease_timeout.0;
    if lease < Duration::from_millis(1) || lease > Duration::from_secs(10) {
        return bad(
            "lease_timeout",
            format!(
                "`lease_timeout` must be between 1ms and 10s, got {}",
                fleet.lease_timeout
            ),
        );
    }
    let ttl = fleet.heartbeat_ttl.0;
    if ttl < Duration::from_secs(1) || ttl > MAX_SERVER_DURATION {
        return bad(
            "heartbeat_ttl",
            format!(
                "`heartbeat_ttl` must be between 1s and 1h, got {}",
                fleet.heartbeat_ttl
            ),
        );
    }
    if fleet.max_failures == 0 {
        return bad("max_failures", "`max_failures` must be at least 1".into());
    }
    let name = &fleet.name.0;
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > 64 || !name.chars().all(allowed) {
        return bad(
            "name",
            format!("`name` must be 1 to 64 letters, digits, `.`, `_` or `-`, got `{name}`"),
        );
    }
    Ok(())
}

/// See [`Config::warnings`].
pub(super) fn warnings(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let listen = config.listen.0;
    let injecting: Vec<String> = config
        .upstreams
        .iter()
        .filter(|u| !u.headers.is_empty())
        .map(|u| format!("`{}`", u.name()))
        .collect();
    if !listen.ip().to_canonical().is_loopback() && !injecting.is_empty() {
        out.push(format!(
            "`listen` ({listen}, after --listen and CORRAL_LISTEN) is not a loopback address, and \
             corral adds configured headers (credentials) to requests for upstream {}: anyone \
             who can reach {listen} can spend them; listen on 127.0.0.1, or let the clients \
             send their own keys",
            injecting.join(", ")
        ));
    }
    let drain = config.drain_delay.0 + config.drain_timeout.0;
    if drain > DEFAULT_GRACE_PERIOD {
        out.push(format!(
            "`drain_delay` ({}) + `drain_timeout` ({}) exceed 30s, Kubernetes' default \
             grace period: a pod is killed before its drain ends unless its \
             terminationGracePeriodSeconds is longer",
            config.drain_delay, config.drain_timeout
        ));
    }
    out
}

/// A key pool: each key non-empty, distinct and a valid header value in its template, exactly
/// one `headers` entry holding `{key}` to put it in, and no `{key}` without keys.
fn validate_keys(up: &super::UpstreamConfig) -> Result<(), BadField> {
    use super::KEY_PLACEHOLDER as KEY;
    let templates: Vec<(&String, &super::Secret)> = up
        .headers
        .iter()
        .filter(|(_, v)| v.0.contains(KEY))
        .collect();
    if up.keys.is_empty() {
        return match templates.first() {
            Some((name, _)) => Err(BadField::new(
                "headers",
                format!("`{name}` holds `{KEY}` but the upstream has no `keys` to fill it with"),
            )),
            None => Ok(()),
        };
    }
    let [(_, template)] = templates.as_slice() else {
        return Err(BadField::new(
            "keys",
            format!(
                "`keys` needs exactly one `headers` entry whose value holds `{KEY}` (e.g. \
                 `Authorization = \"Bearer {KEY}\"` or `x-api-key = \"{KEY}\"`), found {}",
                templates.len()
            ),
        ));
    };
    if up.keys.len() > super::MAX_KEYS {
        return Err(BadField::new(
            "keys",
            format!("at most {} keys, got {}", super::MAX_KEYS, up.keys.len()),
        ));
    }
    for (i, key) in up.keys.iter().enumerate() {
        if key.0.trim().is_empty() {
            return Err(BadField::new(
                "keys",
                format!("key {} of {} is empty", i + 1, up.keys.len()),
            ));
        }
        if http::HeaderValue::from_str(&template.0.replace(KEY, &key.0)).is_err() {
            return Err(BadField::new(
                "keys",
                format!("key {} does not make a valid header value", i + 1),
            ));
        }
        if let Some(j) = up.keys[..i].iter().position(|k| k.0 == key.0) {
            return Err(BadField::new(
                "keys",
                format!("key {} repeats key {}", i + 1, j + 1),
            ));
        }
    }
    cooldown("key_cooldown", up.key_cooldown.0)
        .map_err(|reason| BadField::new("key_cooldown", reason))
}

/// Groups: names distinct from every upstream's and group's, routes distinct from every
/// upstream's, members that name an upstream or a group, no group reaching itself, no upstream
/// twice in a group, and every upstream without a route reached through some group.
fn validate_groups<'a>(
    config: &'a Config,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), Invalid> {
    let upstreams: HashMap<&str, usize> = config
        .upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name(), i))
        .collect();
    let mut groups: HashMap<&str, usize> = HashMap::new();
    for (i, g) in config.groups.iter().enumerate() {
        let at = |bad: BadField| Invalid {
            span: Some(g.name.span()),
            key: format!("group[{i}].{}", bad.field),
            reason: bad.reason,
        };
        validate_group_name(config, i, g, &upstreams, &mut groups, routes).map_err(at)?;
        validate_group_settings(g).map_err(at)?;
    }
    let mut reached = vec![false; config.upstreams.len()];
    for (i, g) in config.groups.iter().enumerate() {
        validate_group_members(config, i, g, &upstreams, &groups, &mut reached)?;
    }
    validate_reached(config, &reached)
}

/// A group's name and route: a plain name that no upstream or earlier group holds (recorded in
/// `groups` at index `i`), and a route of its own that is not an admin endpoint's unless
/// `admin_listen` moves those.
fn validate_group_name<'a>(
    config: &Config,
    i: usize,
    g: &'a super::GroupConfig,
    upstreams: &HashMap<&str, usize>,
    groups: &mut HashMap<&'a str, usize>,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), BadField> {
    plain_name(g.name()).map_err(|reason| BadField::new("name", reason))?;
    if upstreams.contains_key(g.name()) || groups.insert(g.name(), i).is_some() {
        return Err(BadField::new(
            "name",
            format!(
                "duplicate name `{}` (groups and upstreams share one namespace)",
                g.name()
            ),
        ));
    }
    if let Some(other) = routes.insert(g.route(), g.name()) {
        return Err(BadField::new(
            "route",
            format!("duplicate route `{}` (also used by `{other}`)", g.route()),
        ));
    }
    if config.admin_listen.is_none() && RESERVED_ROUTES.contains(&g.route()) {
        return Err(BadField::new(
            "route",
            format!("route `{}` is reserved for corral's admin endpoints; set `admin_listen` to move them", g.route()),
        ));
    }
    Ok(())
}

/// A group's own settings: at least one member, shares within (0, 1], a cool-down of 1 s to
/// 24 h, and repeatable paths that are path endings.
fn validate_group_settings(g: &super::GroupConfig) -> Result<(), BadField> {
    if g.members.is_empty() {
        return Err(BadField::new(
            "members",
            "a group needs at least one member".into(),
        ));
    }
    if !(g.fallback_wait > 0.0 && g.fallback_wait <= 1.0) {
        return Err(BadField::new(
            "fallback_wait",
            format!(
                "`fallback_wait` is a share of the deadline, within (0, 1]; got {}",
                g.fallback_wait
            ),
        ));
    }
    if !(g.hedge_max_ratio > 0.0 && g.hedge_max_ratio <= 1.0) {
        return Err(BadField::new(
            "hedge_max_ratio",
            format!(
                "`hedge_max_ratio` is a share of the group's requests, within (0, 1]; got {}",
                g.hedge_max_ratio
            ),
        ));
    }
    cooldown("cooldown", g.cooldown.0).map_err(|reason| BadField::new("cooldown", reason))?;
    if let Some(bad) = g
        .repeatable_paths
        .iter()
        .find(|p| p.is_empty() || p.contains(char::is_whitespace))
    {
        return Err(BadField::new(
            "repeatable_paths",
            format!(
                "`repeatable_paths` holds path endings such as \"/chat/completions\"; got {bad:?}"
            ),
        ));
    }
    Ok(())
}

/// Group `i`'s members: each names an upstream or a group, `model` only on an upstream, no
/// cycle through nested groups, and no upstream twice. Marks in `reached` every upstream the
/// group resolves to.
fn validate_group_members(
    config: &Config,
    i: usize,
    g: &super::GroupConfig,
    upstreams: &HashMap<&str, usize>,
    groups: &HashMap<&str, usize>,
    reached: &mut [bool],
) -> Result<(), Invalid> {
    let at = |reason: String| Invalid {
        span: Some(g.name.span()),
        key: format!("group[{i}].members"),
        reason,
    };
    for m in &g.members {
        let known = upstreams.contains_key(m.name()) || groups.contains_key(m.name());
        if !known {
            return Err(at(format!(
                "member `{}` names no upstream or group",
                m.name()
            )));
        }
        if m.model().is_some() && !upstreams.contains_key(m.name()) {
            return Err(at(format!(
                "`model` applies to an upstream member; `{}` is a group",
                m.name()
            )));
        }
    }
    // Depth-first through nested groups: a group met again on the current path is a cycle.
    let mut path = vec![g.name()];
    let mut flat = Vec::new();
    walk(config, groups, g, &mut path, &mut flat).map_err(&at)?;
    for (n, name) in flat.iter().enumerate() {
        if flat[..n].contains(name) {
            return Err(at(format!("upstream `{name}` is in the group twice")));
        }
        reached[upstreams[name]] = true;
    }
    Ok(())
}

/// Every upstream without a route of its own is `reached` through some group.
fn validate_reached(config: &Config, reached: &[bool]) -> Result<(), Invalid> {
    for (i, up) in config.upstreams.iter().enumerate() {
        if up.route().is_empty() && !reached[i] {
            return Err(Invalid {
                span: Some(up.name.span()),
                key: format!("upstream[{i}].route"),
                reason: format!(
                    "upstream `{}` has no `route` and is in no group: no request can reach it",
                    up.name()
                ),
            });
        }
    }
    Ok(())
}

/// The upstream names `group` resolves to, in order, or the cycle that prevents it.
fn walk<'a>(
    config: &'a Config,
    groups: &HashMap<&str, usize>,
    group: &'a super::GroupConfig,
    path: &mut Vec<&'a str>,
    flat: &mut Vec<&'a str>,
) -> Result<(), String> {
    for m in &group.members {
        match groups.get(m.name()) {
            Some(&j) => {
                let inner = &config.groups[j];
                if path.contains(&inner.name()) {
                    path.push(inner.name());
                    return Err(format!(
                        "group `{}` forms a cycle: {}",
                        path[0],
                        path.join(" -> ")
                    ));
                }
                path.push(inner.name());
                walk(config, groups, inner, path, flat)?;
                path.pop();
            }
            None => flat.push(m.name()),
        }
    }
    Ok(())
}

/// A name for metrics and logs: non-empty, without spaces.
fn plain_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.contains(|c: char| c.is_whitespace()) {
        return Err(format!(
            "name `{name}` must be non-empty and without spaces"
        ));
    }
    Ok(())
}

/// A cool-down (`key`): 1 s to 24 h.
fn cooldown(key: &str, value: Duration) -> Result<(), String> {
    if value < Duration::from_secs(1) || value > Duration::from_secs(86_400) {
        return Err(format!("`{key}` must be within 1s..=24h, got {value:?}"));
    }
    Ok(())
}
