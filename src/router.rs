//! Path prefix -> [`Upstream`] or [`Group`]. Each upstream owns one built stack; the longest
//! matching route wins; nothing else is ever reachable (corral connects only to hosts its config
//! names), and no path leaves its route: [`check_path`] refuses dot-segments and encoded
//! separators, which an upstream that normalises paths would resolve outside the configured
//! base path.

use std::sync::Arc;

use crate::config::{ByteSize, GroupConfig, UpstreamConfig};
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::forward::buffer::{self, BufferBudget};
use crate::group::Group;
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// All upstreams, longest route first, the groups, and the request-body budget they share.
pub struct Router {
    upstreams: Vec<Arc<Upstream>>,
    groups: Vec<Arc<Group>>,
    /// Every upstream and group that has a route, longest route first: the first match wins.
    routes: Vec<Route>,
    buffer: Arc<BufferBudget>,
}

/// Where a route leads.
#[derive(Clone)]
pub enum Route {
    Upstream(Arc<Upstream>),
    Group(Arc<Group>),
}

impl Route {
    pub fn name(&self) -> &str {
        match self {
            Self::Upstream(u) => &u.name,
            Self::Group(g) => &g.name,
        }
    }
    fn route(&self) -> &str {
        match self {
            Self::Upstream(u) => &u.route,
            Self::Group(g) => &g.route,
        }
    }
}

/// What a reload did to the upstreams.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Unchanged, kept with their state.
    pub kept: usize,
    /// New or changed, built afresh.
    pub built: usize,
    /// No longer configured (their in-flight requests finish).
    pub removed: usize,
}

impl Router {
    /// `max_buffered` unset: sized from the container's memory ([`buffer::default_cap`]).
    pub fn new(
        configs: &[UpstreamConfig],
        groups: &[GroupConfig],
        max_buffered: Option<ByteSize>,
        metrics: &Metrics,
        fleet: Option<&Arc<Fleet>>,
    ) -> Self {
        let cap = max_buffered.map_or_else(buffer::default_cap, |b| b.0);
        let buffer = BufferBudget::new(cap, metrics.request_buffer(cap.max(buffer::MIN_CAP)));
        let cap = buffer.cap();
        tracing::info!(
            max_buffered_bytes = cap,
            configured = max_buffered.is_some(),
            "request body buffer"
        );
        let mut upstreams: Vec<_> = configs
            .iter()
            .map(|c| Arc::new(Upstream::new(c, metrics, cap, fleet)))
            .collect();
        for (up, config) in upstreams.iter().zip(configs) {
            if config.body_limit.0 > cap {
                tracing::warn!(
                    upstream = %up.name,
                    body_limit = config.body_limit.0,
                    max_buffered_bytes = cap,
                    "body_limit exceeds the request buffer; larger bodies get a 413"
                );
            }
        }
        upstreams.sort_by_key(|u| std::cmp::Reverse(u.route.len()));
        let groups = Group::build_all(configs, groups, &upstreams, metrics, &[]);
        Self {
            routes: routes(&upstreams, &groups),
            upstreams,
            groups,
            buffer,
        }
    }

    /// The router for a reloaded config: upstreams whose config is unchanged are kept as they are
    /// (in-flight requests, learned limits, breaker state and queue carry on); new or changed
    /// ones are built afresh, a changed one keeping its breaker's state and its 429 pauses;
    /// groups are rebuilt, keeping by name what they learned; the body buffer is kept (its cap
    /// changes only on restart).
    pub fn reload(
        &self,
        configs: &[UpstreamConfig],
        groups: &[GroupConfig],
        metrics: &Metrics,
        fleet: Option<&Arc<Fleet>>,
    ) -> (Self, ReloadSummary) {
        let mut summary = ReloadSummary::default();
        let cap = self.buffer.cap();
        let mut upstreams: Vec<_> = configs
            .iter()
            .map(|c| match self.upstreams.iter().find(|u| u.config == *c) {
                Some(same) => {
                    summary.kept += 1;
                    Arc::clone(same)
                }
                None => {
                    summary.built += 1;
                    let built = Upstream::new(c, metrics, cap, fleet);
                    // A changed upstream keeps its breaker's state and its 429 pauses.
                    if let Some(was) = self.upstreams.iter().find(|u| u.name == c.name()) {
                        built.state.carry_from(&was.state);
                    }
                    Arc::new(built)
                }
            })
            .collect();
        summary.removed = self
            .upstreams
            .iter()
            .filter(|u| !upstreams.iter().any(|n| Arc::ptr_eq(n, u)))
            .count();
        upstreams.sort_by_key(|u| std::cmp::Reverse(u.route.len()));
        let groups = Group::build_all(configs, groups, &upstreams, metrics, &self.groups);
        let router = Self {
            routes: routes(&upstreams, &groups),
            upstreams,
            groups,
            buffer: Arc::clone(&self.buffer),
        };
        (router, summary)
    }

    /// The budget every request body is read under.
    pub fn buffer(&self) -> &BufferBudget {
        &self.buffer
    }

    /// The upstream or group whose route is the longest prefix of `path` on a segment boundary
    /// (an upstream reached only through a group has no route of its own).
    pub fn find(&self, path: &str) -> Option<Route> {
        self.routes
            .iter()
            .find(|r| matches_route(r.route(), path))
            .cloned()
    }

    pub fn groups(&self) -> &[Arc<Group>] {
        &self.groups
    }

    pub fn upstreams(&self) -> &[Arc<Upstream>] {
        &self.upstreams
    }
}

/// The routed upstreams and groups, longest route first (routes are unique: validated).
fn routes(upstreams: &[Arc<Upstream>], groups: &[Arc<Group>]) -> Vec<Route> {
    let upstreams = upstreams.iter().cloned().map(Route::Upstream);
    let groups = groups.iter().cloned().map(Route::Group);
    let mut routes: Vec<Route> = upstreams
        .chain(groups)
        .filter(|r| !r.route().is_empty())
        .collect();
    routes.sort_by_key(|r| std::cmp::Reverse(r.route().len()));
    routes
}

/// Refuse a path an upstream could resolve outside its route: a `.` or `..` segment, written
/// raw or percent-encoded (`%2e`, any case, mixed like `.%2e`, or before a `;` parameter), or an
/// encoded separator (`%2f`, `%5c`, a raw `\`, or any of them encoded twice as `%25..`).
pub fn check_path(path: &str) -> Result<(), ProxyError> {
    let bad = || Err(ProxyError::BadPath(path.chars().take(256).collect()));
    if path.contains('\\') {
        return bad();
    }
    // Nothing percent-encoded (the common case): only a raw dot segment, before any `;`
    // parameter, can leave the route, and no copy of the path is needed to find one.
    let leaves = if path.contains('%') {
        leaves_when_decoded(path)
    } else if !path.starts_with('.') && !path.contains("/.") {
        // A dot segment starts the path or follows a '/'.
        false
    } else {
        path.split('/')
            .map(|segment| segment.split(';').next().unwrap_or_default())
            .any(|segment| segment == "." || segment == "..")
    };
    if leaves {
        bad()
    } else {
        Ok(())
    }
}

/// Whether a path with percent-encoding could leave its route once an upstream decodes it.
fn leaves_when_decoded(path: &str) -> bool {
    // An encoded `;` starts a path parameter for upstreams that decode before they strip it
    // (`..%3bx` is `..`); a NUL byte is never part of a real path.
    let lower = path.to_ascii_lowercase().replace("%3b", ";");
    if ["%2f", "%5c", "%00", "%252e", "%252f", "%255c"]
        .iter()
        .any(|encoded| lower.contains(encoded))
    {
        return true;
    }
    lower.split('/').any(|segment| {
        let segment = segment.split(';').next().unwrap_or_default();
        let decoded = segment.replace("%2e", ".");
        decoded == "." || decoded == ".."
    })
}

fn matches_route(route: &str, path: &str) -> bool {
    route == "/"
        || path
            .strip_prefix(route)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::types::parse_base_url;

    fn router(routes: &[(&str, &str, &str)]) -> Router {
        let configs: Vec<_> = routes
            .iter()
            .map(|(n, r, u)| UpstreamConfig::new(n, r, parse_base_url(u).unwrap()))
            .collect();
        Router::new(&configs, &[], None, &Metrics::new(), None)
    }

    #[tokio::test]
    async fn longest_prefix_on_segment_boundaries() {
        let r = router(&[
            ("openai", "/v1", "https://api.openai.com/v1"),
            ("anthropic", "/anthropic", "https://api.anthropic.com"),
            ("vllm", "/v1/vllm", "http://127.0.0.1:8000/v1"),
        ]);
        assert_eq!(r.find("/v1/chat/completions").unwrap().name(), "openai");
        assert_eq!(r.find("/v1/vllm/models").unwrap().name(), "vllm");
        assert_eq!(
            r.find("/anthropic/v1/messages").unwrap().name(),
            "anthropic"
        );
        assert!(r.find("/v10/x").is_none());
        assert!(r.find("/anthropicx").is_none());
        assert!(r.find("/").is_none());
    }

    fn uri(s: &str) -> http::Uri {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn targets_replace_the_route_with_the_base_path() {
        let r = router(&[
            ("openai", "/v1", "https://api.openai.com/v1"),
            ("anthropic", "/anthropic", "https://api.anthropic.com/"),
        ]);
        let upstream = |path| match r.find(path) {
            Some(Route::Upstream(u)) => u,
            _ => panic!("no upstream for {path}"),
        };
        let openai = upstream("/v1/chat/completions");
        assert_eq!(
            openai.target(&uri("/v1/chat/completions?a=1")).unwrap(),
            "https://api.openai.com/v1/chat/completions?a=1"
        );
        let anthropic = upstream("/anthropic/v1/messages");
        assert_eq!(
            anthropic.target(&uri("/anthropic/v1/messages")).unwrap(),
            "https://api.anthropic.com/v1/messages"
        );
        assert_eq!(
            anthropic.target(&uri("/anthropic")).unwrap(),
            "https://api.anthropic.com/"
        );
    }

    /// A base path that is the route sends the client's path and query as they came, put
    /// together from parts; any other is written out: both give the same URI.
    #[tokio::test]
    async fn a_target_from_parts_is_the_target_written_out() {
        let r = router(&[
            ("openai", "/v1", "https://api.openai.com/v1/"),
            ("local", "/local", "http://127.0.0.1:8080/v1"),
            ("root", "/", "http://127.0.0.1:8081/base"),
        ]);
        for (route, path) in [
            ("/v1", "/v1/chat/completions?a=1&b=%20"),
            ("/v1", "/v1"),
            ("/v1", "/v1/"),
            ("/v1", "/v1/models"),
            ("/local", "/local/chat?x"),
            ("/", "/v1/chat"),
        ] {
            let Some(Route::Upstream(u)) = r.find(path.split('?').next().unwrap()) else {
                panic!("no upstream for {path}");
            };
            let uri = uri(path);
            let written = u.target_under(route, uri.path(), uri.query()).unwrap();
            let of = u.target_of(route, &uri).unwrap();
            assert_eq!(of, written, "{path}");
            assert_eq!(of.to_string(), written.to_string(), "{path}");
        }
    }

    #[test]
    fn dot_segments_and_encoded_separators_are_refused() {
        for bad in [
            "/v1/../x",
            "/v1/..",
            "/v1/./x",
            "/v1/.",
            "/v1/%2e%2e/x",
            "/v1/%2E%2E/x",
            "/v1/.%2e/x",
            "/v1/%2e./x",
            "/v1/%2e/x",
            "/v1/..;x=1/y",
            "/v1/a%2fb",
            "/v1/a%2Fb",
            "/v1/a%5cb",
            "/v1/a%5Cb",
            "/v1/a\\b",
            "/v1/%252e%252e/x",
            "/v1/a%252fb",
            "/v1/..%3bx/y",
            "/v1/%2e%2e%3Bx/y",
            "/v1/..%00/x",
        ] {
            let err = check_path(bad).expect_err(bad);
            assert_eq!(err.label(), "bad_path", "{bad}");
        }
        for good in [
            "/v1/chat/completions",
            "/v1/models/ft:gpt-4o:org::id",
            "/v1/files/file-abc.jsonl",
            "/v1/...",
            "/v1/.well-known/x",
            "/v1/a..b",
            "/v1/a%20b",
            "/",
        ] {
            assert!(check_path(good).is_ok(), "{good}");
        }
    }

    proptest::proptest! {
        /// A path without percent-encoding takes the short way, and it refuses exactly what
        /// the decoding check refuses.
        #[test]
        fn the_short_way_agrees_with_the_decoding_check(
            path in "(\\.|\\.\\.|[a-z.]{0,3})?(/(\\.|\\.\\.|[a-z.;=]{0,4})){0,5}/?"
        ) {
            let short = check_path(&path).is_err();
            proptest::prop_assert_eq!(short, leaves_when_decoded(&path), "{}", path);
        }
    }
}
