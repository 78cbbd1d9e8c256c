//! `[[group]]`: a route served by an ordered list of upstreams, and the members it resolves to.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::{
    default_key_cooldown, HedgeAfter, HumanDuration, Priority, RoutePrefix, Text, UpstreamConfig,
};

/// `[[group]]`: a route served by an ordered list of upstreams (`src/group/`). A request
/// goes to the first member and moves to the next when the member answers a permanent 429,
/// its breaker is open, it has no capacity within `fallback_wait` of the deadline, or its
/// retries are spent; never after bytes went to the client.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// A short name used in metrics and logs; distinct from every upstream's and group's.
    pub name: Spanned<Text>,
    /// Requests whose path starts with this prefix go to the group; each member gets the rest
    /// of the path after its own base URL.
    pub route: Spanned<RoutePrefix>,
    /// Upstream names (or other groups', whose members are taken in their place), in order.
    pub members: Vec<MemberConfig>,
    /// The share of a request's deadline a member other than the last may take to find
    /// capacity (a concurrency slot, rate-limit tokens) before the request moves on.
    #[serde(default = "default_fallback_wait")]
    pub fallback_wait: f64,
    /// A member that answered a permanent 429 is passed over for this long.
    #[serde(default = "default_key_cooldown")]
    pub cooldown: HumanDuration,
    /// With no answer by then, a second attempt goes to the next member (the same one in a
    /// group of one): a duration, or `"p95"` (the member's p95 time to an answer). Unset: none.
    #[serde(default)]
    pub hedge_after: Option<HedgeAfter>,
    /// Hedges never exceed this share of the group's requests.
    #[serde(default = "default_hedge_max_ratio")]
    pub hedge_max_ratio: f64,
    /// Requests safe to send twice: a path ending with one of these (or a request with
    /// `Idempotency-Key`, or a GET or HEAD) may be hedged, and may move to the next member
    /// after an error that may have reached the upstream. Any other moves on only when the
    /// member certainly did not act on it.
    #[serde(default = "default_repeatable_paths")]
    pub repeatable_paths: Vec<String>,
    /// The priority of a request that sends no `x-corral-priority` (unset: the first member's).
    #[serde(default)]
    pub priority: Option<Priority>,
}

fn default_hedge_max_ratio() -> f64 {
    0.1
}

fn default_repeatable_paths() -> Vec<String> {
    [
        "/chat/completions",
        "/completions",
        "/messages",
        "/responses",
        "/embeddings",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn default_fallback_wait() -> f64 {
    0.25
}

/// A group member: an upstream's (or a group's) name, or a table that also rewrites the JSON
/// body's `model` for that member.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum MemberConfig {
    Name(String),
    Table {
        upstream: String,
        #[serde(default)]
        model: Option<String>,
    },
}

impl MemberConfig {
    pub fn name(&self) -> &str {
        match self {
            Self::Name(n) | Self::Table { upstream: n, .. } => n,
        }
    }
    pub fn model(&self) -> Option<&str> {
        match self {
            Self::Name(_) => None,
            Self::Table { model, .. } => model.as_deref(),
        }
    }
}

/// The upstreams `group` resolves to (nested groups in their members' place), in order, each
/// with the `model` its member sets. The config is validated: no cycles.
pub fn group_members<'a>(
    upstreams: &'a [UpstreamConfig],
    groups: &'a [GroupConfig],
    group: &'a GroupConfig,
) -> Vec<(&'a UpstreamConfig, Option<&'a str>)> {
    let mut out = Vec::new();
    for m in &group.members {
        if let Some(inner) = groups.iter().find(|g| g.name() == m.name()) {
            out.extend(group_members(upstreams, groups, inner));
        } else if let Some(up) = upstreams.iter().find(|u| u.name() == m.name()) {
            out.push((up, m.model()));
        }
    }
    out
}

impl GroupConfig {
    pub fn name(&self) -> &str {
        &self.name.get_ref().0
    }
    pub fn route(&self) -> &str {
        &self.route.get_ref().0
    }
}
