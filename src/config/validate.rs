//! Checks that span several keys, after every value has parsed on its own: the server and
//! fleet settings here, each upstream's in `upstream`, the groups' in `group`.

mod group;
mod upstream;

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use self::group::validate_groups;
use self::upstream::validate_upstreams;
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
