//! Groups: one route served by an ordered list of upstreams (`[[group]]`). A request goes to the
//! first member that is usable and moves to the next when the member
//!
//! - answers a permanent 429 (no wait cures it: `insufficient_quota`, a spend limit), after
//!   which the member is passed over for the group's `cooldown`;
//! - has its breaker open (the request is not sent there at all);
//! - has no capacity (concurrency slot, rate-limit tokens, breaker probe) within
//!   `fallback_wait` of the request's deadline: corral's own 429 or 503 comes back at once;
//! - has spent its retries: its stack gave up on a 429, a 529 or a 5xx, or on a connection
//!   failure or a timeout.
//!
//! Each member's own stack (its limits, retries, breaker) handles the request as it would on the
//! member's own route: a 429 a short wait cures is waited for there, never taken for a reason to
//! move on. A member is left only before its answer's head reaches the client, so no byte ever
//! comes from two members. The last member's answer, whatever it is, goes to the client. Every
//! answer carries `x-corral-upstream: <member>`.
//!
//! A member may set `model`: the JSON body's `"model"` is rewritten for that member only.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use prometheus::IntCounter;
use tokio::time::Instant;

use crate::config::{GroupConfig, UpstreamConfig};
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::router::Upstream;
use crate::stack::layer::lock;

/// The header naming the member that answered.
pub const UPSTREAM_HEADER: HeaderName = HeaderName::from_static("x-corral-upstream");

/// One member of a group.
pub struct Member {
    pub upstream: Arc<Upstream>,
    /// The `model` the JSON body gets for this member, if set.
    pub model: Option<String>,
    /// Passed over until then (it answered a permanent 429).
    aside: Mutex<Option<Instant>>,
    answers: IntCounter,
}

/// A group, ready to serve.
pub struct Group {
    pub name: String,
    pub route: String,
    pub members: Vec<Member>,
    fallback_wait: f64,
    cooldown: Duration,
    metrics: Metrics,
}

/// Why a request left a member for the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// A 429 no wait cures.
    Permanent429,
    /// Its breaker is open (or the member is in its cool-down after a permanent 429).
    Unavailable,
    /// No capacity within `fallback_wait` of the deadline.
    NoCapacity,
    /// Its stack gave up: retries spent on 429s, 529s, 5xx, connection failures or timeouts.
    Failed,
}

impl Fallback {
    pub fn label(self) -> &'static str {
        match self {
            Self::Permanent429 => "permanent_429",
            Self::Unavailable => "unavailable",
            Self::NoCapacity => "no_capacity",
            Self::Failed => "failed",
        }
    }

    /// Why corral's own refusal `e` makes a request leave its member, if it does.
    pub fn of_error(e: &ProxyError) -> Option<Self> {
        match e {
            ProxyError::QueueFull { .. }
            | ProxyError::QueueTimeout { .. }
            | ProxyError::RateLimited { .. } => Some(Self::NoCapacity),
            ProxyError::CircuitOpen { .. } => Some(Self::Unavailable),
            ProxyError::UpstreamConnect { .. }
            | ProxyError::UpstreamReset { .. }
            | ProxyError::TryTimeout { .. }
            | ProxyError::Internal(_) => Some(Self::Failed),
            // The request's own deadline is the whole group's: no member could do better.
            _ => None,
        }
    }

    /// Why an upstream answer with `status` (the member's stack has finished with it) makes a
    /// request leave its member: a throttle or a server error its retries did not cure.
    pub fn of_status(status: u16) -> Option<Self> {
        matches!(status, 429 | 500..=599).then_some(Self::Failed)
    }
}

impl Group {
    /// Every configured group over the built `upstreams` (configs validated: every member
    /// resolves, no cycles).
    pub fn build_all(
        configs: &[UpstreamConfig],
        groups: &[GroupConfig],
        upstreams: &[Arc<Upstream>],
        metrics: &Metrics,
    ) -> Vec<Arc<Self>> {
        groups
            .iter()
            .map(|g| {
                let members = crate::config::group_members(configs, groups, g)
                    .into_iter()
                    .filter_map(|(config, model)| {
                        let upstream = upstreams.iter().find(|u| u.name == config.name())?;
                        Some(Member {
                            upstream: Arc::clone(upstream),
                            model: model.map(str::to_owned),
                            aside: Mutex::new(None),
                            answers: metrics.group_answers(g.name(), config.name()),
                        })
                    })
                    .collect();
                Arc::new(Self {
                    name: g.name().to_owned(),
                    route: g.route().to_owned(),
                    members,
                    fallback_wait: g.fallback_wait,
                    cooldown: g.cooldown.0,
                    metrics: metrics.clone(),
                })
            })
            .collect()
    }

    /// Whether member `i` is passed over now without being tried: in its cool-down, or its
    /// breaker open. The last member is always tried.
    pub fn passed_over(&self, i: usize, now: Instant) -> bool {
        if i + 1 == self.members.len() {
            return false;
        }
        let member = &self.members[i];
        let cooling = lock(&member.aside).is_some_and(|until| until > now);
        let open = member
            .upstream
            .state
            .breaker
            .as_ref()
            .is_some_and(|b| b.phase().name() == "open");
        cooling || open
    }

    /// How long member `i` may wait for capacity: until `fallback_wait` of what is left before
    /// `deadline` for a member with a next one; until the deadline for the last.
    pub fn wait_deadline(&self, i: usize, now: Instant, deadline: Instant) -> Instant {
        if i + 1 == self.members.len() {
            return deadline;
        }
        now + deadline
            .saturating_duration_since(now)
            .mul_f64(self.fallback_wait)
    }

    /// A request leaves member `i` for the next, because of `why`.
    pub fn fell_back(&self, i: usize, why: Fallback, now: Instant) {
        let member = &self.members[i];
        if why == Fallback::Permanent429 {
            *lock(&member.aside) = Some(now + self.cooldown);
        }
        self.metrics
            .group_fallback(&self.name, &member.upstream.name, why.label());
        tracing::info!(
            group = %self.name,
            member = %member.upstream.name,
            reason = why.label(),
            "falling back to the next member"
        );
    }

    /// Member `i` answered.
    pub fn answered(&self, i: usize) {
        self.members[i].answers.inc();
    }

    /// `/status`: the group's members in order, each with its model and cool-down.
    pub fn status(&self) -> serde_json::Value {
        let now = Instant::now();
        let members: Vec<_> = self
            .members
            .iter()
            .map(|m| {
                let aside = lock(&m.aside)
                    .filter(|until| *until > now)
                    .map(|until| until.saturating_duration_since(now).as_millis() as u64);
                serde_json::json!({
                    "upstream": m.upstream.name,
                    "model": m.model,
                    "set_aside_ms": aside,
                    "breaker": m.upstream.state.breaker.as_ref().map(|b| b.phase().name()),
                })
            })
            .collect();
        serde_json::json!({"name": self.name, "route": self.route, "members": members})
    }
}

/// `body` with its JSON `"model"` set to `model`; unchanged when it is not a JSON object.
pub fn with_model(body: &Bytes, model: &str) -> Bytes {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut map)) => {
            map.insert("model".into(), serde_json::Value::String(model.to_owned()));
            Bytes::from(serde_json::to_vec(&map).expect("a JSON map serializes"))
        }
        _ => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_rewritten_in_json_objects_only() {
        let body = Bytes::from_static(br#"{"model":"gpt-4o","messages":[],"stream":true}"#);
        let out: serde_json::Value =
            serde_json::from_slice(&with_model(&body, "gpt-4o-mini")).unwrap();
        assert_eq!(out["model"], "gpt-4o-mini");
        assert_eq!(out["stream"], true);
        let not_json = Bytes::from_static(b"not json");
        assert_eq!(with_model(&not_json, "m"), not_json);
    }

    #[test]
    fn reasons_to_move_on() {
        assert_eq!(Fallback::of_status(429), Some(Fallback::Failed));
        assert_eq!(Fallback::of_status(503), Some(Fallback::Failed));
        assert_eq!(Fallback::of_status(200), None);
        assert_eq!(Fallback::of_status(400), None);
        assert_eq!(
            Fallback::of_error(&ProxyError::DeadlineExceeded),
            None,
            "the deadline is the group's"
        );
    }
}
