//! The checks of each upstream: its name and route, then its own settings section by section.

use std::collections::HashMap;

use super::{cooldown, plain_name, BadField, Invalid, RESERVED_ROUTES};
use crate::config::{
    AdaptiveConfig, ByteSize, Config, Jitter, LimitsConfig, PartitionScope, RetryConfig, Secret,
    UpstreamConfig, MAX_KEYS,
};

/// Each upstream: a plain, distinct name, a distinct route that is not an admin endpoint, then
/// its own settings. `routes` collects each route and the upstream that holds it.
pub(super) fn validate_upstreams<'a>(
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
    up: &'a UpstreamConfig,
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
    up: &UpstreamConfig,
    max_buffered_bytes: Option<ByteSize>,
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
fn validate_headers(up: &UpstreamConfig) -> Result<(), BadField> {
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
    up: &UpstreamConfig,
    max_buffered_bytes: Option<ByteSize>,
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
fn validate_retry(r: &RetryConfig) -> Result<(), BadField> {
    if r.cap < r.base {
        return Err(BadField::new(
            "retry.cap",
            format!("`cap` ({}) must be at least `base` ({})", r.cap, r.base),
        ));
    }
    if r.base.0.is_zero() && !matches!(r.jitter, Jitter::None) && r.max_retries > 0 {
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
fn validate_breaker(up: &UpstreamConfig) -> Result<(), BadField> {
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
        .filter(|p| *p != PartitionScope::Upstream);
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
fn validate_model_groups(limits: &LimitsConfig) -> Result<(), BadField> {
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
fn validate_adaptive(a: &AdaptiveConfig) -> Result<(), BadField> {
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
fn validate_limits(limits: &LimitsConfig) -> Result<(), BadField> {
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

/// A key pool: each key non-empty, distinct and a valid header value in its template, exactly
/// one `headers` entry holding `{key}` to put it in, and no `{key}` without keys.
fn validate_keys(up: &UpstreamConfig) -> Result<(), BadField> {
    use crate::config::KEY_PLACEHOLDER as KEY;
    let templates: Vec<(&String, &Secret)> = up
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
    if up.keys.len() > MAX_KEYS {
        return Err(BadField::new(
            "keys",
            format!("at most {} keys, got {}", MAX_KEYS, up.keys.len()),
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
