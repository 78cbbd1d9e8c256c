//! Path prefix -> [`Upstream`]. Each upstream owns one built stack; the longest matching route
//! wins; nothing else is ever reachable (corral connects only to hosts its config names).

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::Uri;

use crate::config::{HeaderMode, Secret, UpstreamConfig};
use crate::metrics::{Metrics, UpstreamMetrics};
use crate::stack::{self, Stack, StackState};

/// One configured upstream, ready to serve.
pub struct Upstream {
    pub name: String,
    pub route: String,
    /// `scheme://authority/base-path` without a trailing slash.
    target_prefix: String,
    pub inject: Vec<(HeaderName, Secret)>,
    pub header_mode: HeaderMode,
    pub body_limit: usize,
    pub deadline: Duration,
    pub metrics: UpstreamMetrics,
    pub stack: Stack,
    /// Shared state of the stack's layers, for `/status`.
    pub state: StackState,
}

impl Upstream {
    pub fn new(config: &UpstreamConfig, metrics: &Metrics) -> Self {
        let base = &config.base_url.0;
        let target_prefix = format!(
            "{}://{}{}",
            base.scheme_str().unwrap_or("https"),
            base.authority().map(|a| a.as_str()).unwrap_or_default(),
            config.base_url.path()
        );
        let metrics = metrics.upstream(config.name());
        let (stack, state) = stack::build(config, &metrics);
        Self {
            name: config.name().to_owned(),
            route: config.route().to_owned(),
            target_prefix,
            inject: config
                .headers
                .iter()
                .filter_map(|(k, v)| Some((HeaderName::from_bytes(k.as_bytes()).ok()?, v.clone())))
                .collect(),
            header_mode: config.header_mode,
            body_limit: config.body_limit.0,
            deadline: config.retry.deadline.0,
            metrics,
            stack,
            state,
        }
    }

    /// The upstream URI for a client path (already known to match this route) and query.
    pub fn target(&self, path: &str, query: Option<&str>) -> Option<Uri> {
        let rest = if self.route == "/" {
            path
        } else {
            &path[self.route.len()..]
        };
        let mut uri = String::with_capacity(self.target_prefix.len() + rest.len() + 64);
        uri.push_str(&self.target_prefix);
        if !rest.is_empty() && !rest.starts_with('/') {
            uri.push('/');
        }
        uri.push_str(rest);
        if let Some(q) = query {
            uri.push('?');
            uri.push_str(q);
        }
        uri.parse().ok()
    }
}

/// All upstreams, longest route first.
pub struct Router {
    upstreams: Vec<Arc<Upstream>>,
}

impl Router {
    pub fn new(configs: &[UpstreamConfig], metrics: &Metrics) -> Self {
        let mut upstreams: Vec<_> = configs
            .iter()
            .map(|c| Arc::new(Upstream::new(c, metrics)))
            .collect();
        upstreams.sort_by_key(|u| std::cmp::Reverse(u.route.len()));
        Self { upstreams }
    }

    /// The upstream whose route is the longest prefix of `path` on a segment boundary.
    pub fn find(&self, path: &str) -> Option<&Arc<Upstream>> {
        self.upstreams
            .iter()
            .find(|u| matches_route(&u.route, path))
    }

    pub fn upstreams(&self) -> &[Arc<Upstream>] {
        &self.upstreams
    }
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
        Router::new(&configs, &Metrics::new())
    }

    #[tokio::test]
    async fn longest_prefix_on_segment_boundaries() {
        let r = router(&[
            ("openai", "/v1", "https://api.openai.com/v1"),
            ("anthropic", "/anthropic", "https://api.anthropic.com"),
            ("vllm", "/v1/vllm", "http://127.0.0.1:8000/v1"),
        ]);
        assert_eq!(r.find("/v1/chat/completions").unwrap().name, "openai");
        assert_eq!(r.find("/v1/vllm/models").unwrap().name, "vllm");
        assert_eq!(r.find("/anthropic/v1/messages").unwrap().name, "anthropic");
        assert!(r.find("/v10/x").is_none());
        assert!(r.find("/anthropicx").is_none());
        assert!(r.find("/").is_none());
    }

    #[tokio::test]
    async fn targets_replace_the_route_with_the_base_path() {
        let r = router(&[
            ("openai", "/v1", "https://api.openai.com/v1"),
            ("anthropic", "/anthropic", "https://api.anthropic.com/"),
        ]);
        let openai = r.find("/v1/chat/completions").unwrap();
        assert_eq!(
            openai.target("/v1/chat/completions", Some("a=1")).unwrap(),
            "https://api.openai.com/v1/chat/completions?a=1"
        );
        let anthropic = r.find("/anthropic/v1/messages").unwrap();
        assert_eq!(
            anthropic.target("/anthropic/v1/messages", None).unwrap(),
            "https://api.anthropic.com/v1/messages"
        );
        assert_eq!(
            anthropic.target("/anthropic", None).unwrap(),
            "https://api.anthropic.com/"
        );
    }
}
