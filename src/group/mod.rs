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
//! A request is sent to a second member, by a hedge or after an error that may have reached the
//! first (a 5xx, a timeout, a connection lost after the request went out), only when it is safe
//! to repeat: its path ends with one of `repeatable_paths`, it carries `Idempotency-Key`, or it
//! is a GET or HEAD. Any other moves on only when no attempt on the member can have been acted
//! on (a refused connection, a 429, corral's own refusal: `RequestCtx::may_have_reached`), so no
//! second member creates a file upload or a batch again. (A member's own retry policy is the
//! retry layer's: it may still retry a 5xx on the same member.)
//!
//! A member may set `model`: the JSON body's top-level `"model"` value is replaced for that
//! member only, every other byte kept, in one copy per request that counts in the body budget.
//!
//! This module holds a group's state (members, cool-downs, hedging); `driver` takes a request
//! through the members ([`Group::forward`]).

mod driver;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use prometheus::IntCounter;
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

use crate::config::{GroupConfig, HedgeAfter, UpstreamConfig};
use crate::error::ProxyError;
use crate::forward;
use crate::forward::buffer::{BufferBudget, Held};
use crate::metrics::Metrics;
use crate::sync::{lock, SetAside};
use crate::upstream::Upstream;

/// The header naming the member that answered.
pub const UPSTREAM_HEADER: HeaderName = HeaderName::from_static("x-corral-upstream");
/// A client's promise that sending its request twice does its work once.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// One member of a group.
pub struct Member {
    pub upstream: Arc<Upstream>,
    /// The `model` the JSON body gets for this member, if set.
    pub model: Option<String>,
    /// The client's headers this member does not receive: when it injects a credential, every
    /// credential header and every header another member injects ([`forward::withheld`]).
    pub withheld: Vec<HeaderName>,
    /// Passed over until then (it answered a permanent 429).
    /// Shared with the same member of the group before a reload, as is `heads`.
    aside: Arc<SetAside>,
    answers: IntCounter,
    /// Its latest times to an answer (for `hedge_after = "p95"`), oldest first.
    heads: Arc<Mutex<VecDeque<Duration>>>,
}

/// Answer times kept per member for its p95.
const HEAD_SAMPLES: usize = 200;
/// Answer times a p95 needs before hedges go by it.
const MIN_HEAD_SAMPLES: usize = 20;

impl Member {
    /// The p95 of its latest times to an answer, once there are enough.
    fn p95(&self) -> Option<Duration> {
        let heads = lock(&self.heads);
        if heads.len() < MIN_HEAD_SAMPLES {
            return None;
        }
        let mut sorted: Vec<Duration> = heads.iter().copied().collect();
        let k = (sorted.len() * 95).div_ceil(100) - 1;
        Some(*sorted.select_nth_unstable(k).1)
    }
}

/// A group's hedging: when, and how many its recent requests allow.
struct Hedging {
    after: HedgeAfter,
    /// tower's windowed budget: each request deposits, each hedge withdraws, and both count
    /// for [`HEDGE_WINDOW`] only, so a quiet past lends an incident nothing. Withdrawals hold
    /// the lock, so requests racing for the last hedge cannot all take it.
    /// Shared with the same group before a reload when the cost is the same.
    budget: Arc<Mutex<TpsBudget>>,
    /// Requests a hedge costs: `hedge_max_ratio` as one in a whole number, rounded so hedges
    /// never exceed the ratio.
    cost: u32,
}

/// How long a request (and a hedge) counts for `hedge_max_ratio`.
pub const HEDGE_WINDOW: Duration = Duration::from_secs(10);

impl Hedging {
    fn new(after: HedgeAfter, max_ratio: f64) -> Self {
        // The ratio is validated within (0, 1]; the small tolerance keeps 1/0.1 at 10.
        let cost = ((1.0 / max_ratio) - 1e-9).ceil().max(1.0) as u32;
        // TpsBudget charges `1 / percent` deposits a withdrawal, rounded down: ask for
        // `1 / (cost + 0.5)` to be charged exactly `cost`.
        let percent = 1.0 / (cost as f32 + 0.5);
        Self {
            after,
            budget: Arc::new(Mutex::new(TpsBudget::new(HEDGE_WINDOW, 0, percent))),
            cost,
        }
    }
}

/// A group, ready to serve.
pub struct Group {
    pub name: String,
    pub route: String,
    pub members: Vec<Member>,
    fallback_wait: f64,
    cooldown: Duration,
    hedging: Option<Hedging>,
    /// The priority of a request without `x-corral-priority`, if the group sets one.
    pub priority: Option<crate::config::Priority>,
    /// Path endings of requests safe to send twice (`repeatable_paths`).
    repeatable_paths: Vec<String>,
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
    /// resolves, no cycles). A group of the same name in `previous` (the groups before a
    /// reload) hands on what it learned: its members' cool-downs and answer times, by
    /// upstream name, and its recent requests and hedges.
    pub fn build_all(
        configs: &[UpstreamConfig],
        groups: &[GroupConfig],
        upstreams: &[Arc<Upstream>],
        metrics: &Metrics,
        previous: &[Arc<Group>],
    ) -> Vec<Arc<Self>> {
        groups
            .iter()
            .map(|g| {
                let was = previous.iter().find(|p| p.name == g.name());
                let found: Vec<_> = crate::config::group_members(configs, groups, g)
                    .into_iter()
                    .filter_map(|(config, model)| {
                        let upstream = upstreams.iter().find(|u| u.name == config.name())?;
                        Some((upstream, config, model))
                    })
                    .collect();
                // What any member injects is kept from the others that inject a credential.
                let injected: Vec<HeaderName> = found
                    .iter()
                    .flat_map(|(u, _, _)| u.injects.iter().cloned())
                    .collect();
                // With a member that passes the client's credentials through, a credential the
                // client sends is that member's: one that injects its own never gets the
                // client's, whatever `header_mode` says of the header's name.
                let passes_through = found.iter().any(|(u, _, _)| !u.injects_credential);
                let members = found
                    .into_iter()
                    .map(|(upstream, config, model)| {
                        let same = was.and_then(|w| {
                            w.members.iter().find(|m| m.upstream.name == config.name())
                        });
                        let own: Vec<HeaderName> = upstream
                            .injects
                            .iter()
                            .filter(|h| !passes_through || !forward::CREDENTIAL_HEADERS.contains(h))
                            .cloned()
                            .collect();
                        Member {
                            withheld: forward::withheld(
                                &own,
                                upstream.injects_credential,
                                &injected,
                            ),
                            upstream: Arc::clone(upstream),
                            model: model.map(str::to_owned),
                            aside: same.map_or_else(Arc::default, |m| Arc::clone(&m.aside)),
                            answers: metrics.group_answers(g.name(), config.name()),
                            heads: same.map_or_else(
                                || Arc::new(Mutex::new(VecDeque::with_capacity(HEAD_SAMPLES))),
                                |m| Arc::clone(&m.heads),
                            ),
                        }
                    })
                    .collect();
                let hedging = g.hedge_after.map(|after| {
                    let mut hedging = Hedging::new(after, g.hedge_max_ratio);
                    let same = was.and_then(|w| w.hedging.as_ref());
                    if let Some(same) = same.filter(|h| h.cost == hedging.cost) {
                        hedging.budget = Arc::clone(&same.budget);
                    }
                    hedging
                });
                Arc::new(Self {
                    name: g.name().to_owned(),
                    route: g.route().to_owned(),
                    members,
                    fallback_wait: g.fallback_wait,
                    cooldown: g.cooldown.0,
                    hedging,
                    priority: g.priority,
                    repeatable_paths: g.repeatable_paths.clone(),
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
        let open = member
            .upstream
            .state
            .breaker
            .as_ref()
            .is_some_and(|b| b.is_open());
        member.aside.until(now).is_some() || open
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
            member.aside.set(now + self.cooldown, why.label());
        }
        self.metrics
            .group_fallback(&self.name, &member.upstream.name, why.label());
        let (group, member, reason) = (&self.name, &member.upstream.name, why.label());
        if why == Fallback::Unavailable {
            // Every request while a member cools down or its breaker is open: not a line each.
            tracing::debug!(%group, %member, reason, "passing over a member");
        } else {
            tracing::info!(%group, %member, reason, "falling back to the next member");
        }
    }

    /// Whether a request is safe to send twice (hedged, or sent on after an error that may have
    /// reached its member): a GET or HEAD, one with `Idempotency-Key`, or one whose path ends
    /// with one of `repeatable_paths`.
    ///
    /// No path under an Assistants thread (`/threads/`) counts: `/threads/{id}/messages` ends
    /// like Anthropic's `/messages` but adds a message to a thread each time it is sent.
    pub fn repeatable(&self, parts: &http::request::Parts) -> bool {
        let path = parts.uri.path();
        matches!(parts.method, http::Method::GET | http::Method::HEAD)
            || parts.headers.contains_key(IDEMPOTENCY_KEY)
            || (!path.contains("/threads/")
                && self
                    .repeatable_paths
                    .iter()
                    .any(|p| path.ends_with(p.as_str())))
    }

    /// A request not safe to repeat stays with member `i` although `why` would move it on: the
    /// member may have acted on it.
    pub fn stayed(&self, i: usize, why: Fallback) {
        let (group, member, reason) = (&self.name, &self.members[i].upstream.name, why.label());
        tracing::info!(
            %group,
            %member,
            reason,
            "not falling back: the member may have acted on a request not safe to repeat"
        );
    }

    /// The body member `i` gets: the request's own, or with a `model` the request's copy for
    /// that member (made on its first attempt, in `copy`), held in the body `budget` for as long
    /// as the request.
    pub async fn member_body(
        &self,
        i: usize,
        body: &Bytes,
        copy: &tokio::sync::OnceCell<(Bytes, Held)>,
        budget: &BufferBudget,
        deadline: Instant,
    ) -> Result<Bytes, ProxyError> {
        let Some(model) = &self.members[i].model else {
            return Ok(body.clone());
        };
        if let Some((copy, _)) = copy.get() {
            return Ok(copy.clone());
        }
        let Some(spans) = model_spans(body) else {
            // Nothing to rewrite (a multipart upload, a body that is no JSON object): no copy,
            // nothing more to hold.
            return Ok(body.clone());
        };
        let (copy, _) = copy
            .get_or_try_init(|| async {
                // Room before the copy: the body, and the new value escaped at worst.
                let held = budget
                    .hold(body.len() + 6 * model.len() + 16, deadline)
                    .await?;
                Ok::<_, ProxyError>((splice_model(body, &spans, model), held))
            })
            .await?;
        Ok(copy.clone())
    }

    /// Member `i` answered.
    pub fn answered(&self, i: usize) {
        self.members[i].answers.inc();
    }

    /// A request arrived (counted for `hedge_max_ratio` over [`HEDGE_WINDOW`]).
    pub fn arrived(&self) {
        if let Some(h) = &self.hedging {
            lock(&h.budget).deposit();
        }
    }

    /// Member `i` gave an answer (one that did not send the request on) after `took`.
    pub fn record_head(&self, i: usize, took: Duration) {
        if self
            .hedging
            .as_ref()
            .is_some_and(|h| h.after == HedgeAfter::P95)
        {
            let mut heads = lock(&self.members[i].heads);
            if heads.len() == HEAD_SAMPLES {
                heads.pop_front();
            }
            heads.push_back(took);
        }
    }

    /// When to hedge an attempt on member `i`, if the group hedges (with `"p95"`, once the
    /// member has answered often enough to have one).
    pub fn hedge_delay(&self, i: usize) -> Option<Duration> {
        match self.hedging.as_ref()?.after {
            HedgeAfter::Fixed(d) => Some(d),
            HedgeAfter::P95 => self.members[i].p95(),
        }
    }

    /// Where a hedge of an attempt on member `i` goes: the next member not passed over (the
    /// last never is), or the same one when `i` is the last.
    pub fn hedge_target(&self, i: usize, now: Instant) -> usize {
        (i + 1..self.members.len())
            .find(|&j| !self.passed_over(j, now))
            .unwrap_or(i)
    }

    /// Whether a hedge to member `j` may go: within `hedge_max_ratio` of the group's requests
    /// over the last [`HEDGE_WINDOW`], and with a retry taken from the member's budget.
    /// Counts it as sent.
    pub fn take_hedge(&self, j: usize) -> bool {
        let Some(h) = &self.hedging else {
            return false;
        };
        let budget = lock(&h.budget);
        if !budget.withdraw() {
            return false;
        }
        if !self.members[j].upstream.state.retry.withdraw_for_hedge() {
            // Not sent after all: the requests it was charged count again.
            for _ in 0..h.cost {
                budget.deposit();
            }
            return false;
        }
        drop(budget);
        self.metrics.group_hedge(&self.name, "sent");
        true
    }

    /// The hedge's answer won; the first attempt was cancelled.
    pub fn hedge_won(&self) {
        self.metrics.group_hedge(&self.name, "won");
    }

    /// An attempt that lost a race was cancelled (dropped mid-flight).
    pub fn cancelled(&self) {
        self.metrics.group_cancelled(&self.name);
    }

    /// `/status`: the group's members in order, each with its model and cool-down.
    pub fn status(&self) -> serde_json::Value {
        let now = Instant::now();
        let members: Vec<_> = self
            .members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "upstream": m.upstream.name,
                    "model": m.model,
                    "set_aside_ms": m.aside.left_ms(now),
                    "breaker": m.upstream.state.breaker.as_ref().map(|b| b.phase().name()),
                })
            })
            .collect();
        serde_json::json!({"name": self.name, "route": self.route, "members": members})
    }
}

/// The raw values of `body`'s top-level `"model"` keys, if `body` is a JSON object (the only
/// body [`with_model`] rewrites), read without building it.
fn model_spans(body: &[u8]) -> Option<Vec<&serde_json::value::RawValue>> {
    serde_json::from_slice::<TopLevel<'_>>(body)
        .ok()
        .map(|TopLevel(spans)| spans)
}

/// `body` with its top-level JSON `"model"` set to `model`, added first when absent; unchanged
/// when it is not a JSON object. Only the value's bytes change: every other byte (whitespace,
/// key order, numbers of any size) stays as the client wrote it, and the rest of the body is
/// scanned, never built into a tree.
pub fn with_model(body: &Bytes, model: &str) -> Bytes {
    match model_spans(body) {
        Some(spans) => splice_model(body, &spans, model),
        None => body.clone(),
    }
}

/// `body` with each of `spans` (its top-level `"model"` values) replaced by `model`, or with
/// `"model"` added first when there is none.
fn splice_model(body: &Bytes, spans: &[&serde_json::value::RawValue], model: &str) -> Bytes {
    let value = serde_json::to_string(model).expect("a string serializes");
    let mut out = Vec::with_capacity(body.len() + value.len() + 10);
    if spans.is_empty() {
        // A JSON object starts with `{` after any whitespace.
        let open = body.iter().position(|b| *b == b'{').expect("an object") + 1;
        let empty = body[open..]
            .iter()
            .all(|b| b.is_ascii_whitespace() || *b == b'}');
        out.extend_from_slice(&body[..open]);
        out.extend_from_slice(b"\"model\":");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(if empty { b"" } else { b"," });
        out.extend_from_slice(&body[open..]);
        return Bytes::from(out);
    }
    let mut from = 0;
    for span in spans {
        // The raw value borrows from `body`: its offset there is a pointer difference.
        let start = span.get().as_ptr() as usize - body.as_ptr() as usize;
        out.extend_from_slice(&body[from..start]);
        out.extend_from_slice(value.as_bytes());
        from = start + span.get().len();
    }
    out.extend_from_slice(&body[from..]);
    Bytes::from(out)
}

/// The raw values of a JSON object's top-level `"model"` keys (a duplicated key each time),
/// read without building the rest.
struct TopLevel<'a>(Vec<&'a serde_json::value::RawValue>);

impl<'de> serde::Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// A key, borrowed unless it has escapes.
        #[derive(serde::Deserialize)]
        struct Key<'a>(#[serde(borrow)] std::borrow::Cow<'a, str>);
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = TopLevel<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut spans = Vec::new();
                while let Some(Key(key)) = map.next_key()? {
                    if key == "model" {
                        spans.push(map.next_value()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(TopLevel(spans))
            }
        }
        d.deserialize_map(Visitor)
    }
}

#[cfg(test)]
mod tests;
