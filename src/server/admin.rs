//! The admin answers: `/healthz`, `/readyz`, `/metrics` and `/status`.

use std::sync::atomic::Ordering;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};

use super::App;
use crate::body::{self, Body};
use crate::error::ProxyError;

/// The paths [`App::admin`] answers.
const ADMIN_PATHS: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/status"];

impl App {
    /// `/healthz`, `/readyz`, `/metrics`, `/status` for GET and HEAD (405 for other methods);
    /// `None` for any other path.
    pub(super) fn admin<B>(&self, req: &Request<B>) -> Option<Response<Body>> {
        let path = req.uri().path();
        if !ADMIN_PATHS.contains(&path) {
            return None;
        }
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return Some(
                ProxyError::MethodNotAllowed {
                    method: req.method().as_str().chars().take(32).collect(),
                    allow: "GET, HEAD",
                }
                .into_response(),
            );
        }
        let (status, content_type, text) = match path {
            "/readyz" if self.is_ready() => (StatusCode::OK, "text/plain", "ready\n".to_owned()),
            "/readyz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "not ready\n".to_owned(),
            ),
            "/metrics" => (
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            "/status" => (StatusCode::OK, "application/json", self.status_json()),
            _ => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        };
        let mut response = Response::new(body::full(text));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        Some(response)
    }

    fn status_json(&self) -> String {
        let upstreams: Vec<_> = self
            .router
            .load()
            .upstreams()
            .iter()
            .map(|u| {
                let mut v = u.state.status();
                v["name"] = serde_json::json!(u.name);
                v["route"] = serde_json::json!(u.route);
                v["in_flight"] = serde_json::json!(u.metrics.in_flight.get());
                v
            })
            .collect();
        let json = serde_json::json!({
            "ready": self.is_ready(),
            "connections": {
                "open": self.open_connections.load(Ordering::Relaxed),
                "max": self.limits.max_connections,
            },
            "config_generation": self.metrics.config_generation.get(),
            "warnings": self.config.load().warnings(),
            "fleet": self.fleet.as_ref().map(|f| f.status()),
            "upstreams": upstreams,
            "groups": self.router.load().groups().iter().map(|g| g.status()).collect::<Vec<_>>(),
        });
        serde_json::to_string_pretty(&json).expect("JSON values serialize")
    }

    /// Requests in flight to every upstream.
    pub(super) fn in_flight(&self) -> i64 {
        let router = self.router.load();
        router
            .upstreams()
            .iter()
            .map(|u| u.metrics.in_flight.get())
            .sum()
    }
}
