//! [`ProxyError`]: everything corral itself can answer instead of the upstream.
//!
//! Each variant decides its HTTP status, whether a retry may cure it, and the label it carries in
//! metrics and in the `x-corral-error` header, in exhaustive `match`es, so a new variant forces all
//! three decisions. Responses corral makes use OpenAI's error shape; upstream answers never pass
//! through here.
//!
//! The client reads [`ProxyError::message`]: fixed text, naming at most what the config names
//! (an upstream, a limit). `Display` adds what only the operator should see (the error chain of
//! a failed connection, the path a client sent) and goes to the log.

use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};

use crate::body::{self, Body};

/// The header that marks a response as made by corral rather than the upstream.
pub const CORRAL_ERROR_HEADER: &str = "x-corral-error";

/// The methods corral proxies (any other gets a 405), as an `Allow` header lists them.
pub const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// An answer corral gives in place of the upstream's.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches path `{0}`")]
    NoRoute(String),
    #[error("the path has a dot-segment or an encoded slash or backslash: `{0}`")]
    BadPath(String),
    #[error("x-corral-priority must be `interactive` or `batch`")]
    BadPriority,
    #[error("method `{method}` is not allowed here; allowed: {allow}")]
    MethodNotAllowed { method: String, allow: &'static str },
    #[error("absolute-form request targets are refused: corral is not an open proxy; send origin-form paths such as /v1/chat/completions")]
    AbsoluteForm,
    #[error("CONNECT is refused: corral is not an open proxy")]
    Connect,
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("reading the request body failed: {0}")]
    BodyRead(String),
    #[error("the request body did not arrive in time ({0})")]
    BodyTimeout(crate::body::TimeoutKind),
    #[error("corral's buffer for request bodies is full ({cap} bytes); retry later")]
    BufferFull { cap: usize, retry_after: Duration },
    #[error("connecting to upstream `{upstream}` failed: {reason}")]
    UpstreamConnect { upstream: String, reason: String },
    #[error("upstream `{upstream}` failed before sending a response: {reason}")]
    UpstreamReset { upstream: String, reason: String },
    #[error("upstream `{upstream}` sent no response head within {timeout:?}")]
    TryTimeout { upstream: String, timeout: Duration },
    #[error("the request's deadline passed before the upstream answered")]
    DeadlineExceeded,
    #[error("the queue for upstream `{upstream}` is full; retry later")]
    QueueFull {
        upstream: String,
        retry_after: Duration,
    },
    #[error(
        "waited {waited:?} in the queue for upstream `{upstream}` without a slot; retry later"
    )]
    QueueTimeout {
        upstream: String,
        waited: Duration,
        retry_after: Duration,
    },
    #[error("client-side rate limit for upstream `{upstream}` has no capacity within the request's deadline")]
    RateLimited {
        upstream: String,
        retry_after: Duration,
    },
    #[error("circuit breaker for upstream `{upstream}` is open after repeated upstream failures")]
    CircuitOpen {
        upstream: String,
        retry_after: Duration,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProxyError {
    /// The status corral answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::NoRoute(_) => StatusCode::NOT_FOUND,
            Self::AbsoluteForm | Self::BadPath(_) | Self::BadPriority | Self::BodyRead(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::Connect | Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UpstreamConnect { .. } | Self::UpstreamReset { .. } => StatusCode::BAD_GATEWAY,
            Self::TryTimeout { .. } | Self::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Self::QueueFull { .. } | Self::QueueTimeout { .. } | Self::RateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::CircuitOpen { .. } | Self::BufferFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Whether another attempt at the upstream may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::UpstreamConnect { .. } | Self::UpstreamReset { .. } | Self::TryTimeout { .. } => {
                true
            }
            Self::NoRoute(_)
            | Self::BadPath(_)
            | Self::BadPriority
            | Self::MethodNotAllowed { .. }
            | Self::AbsoluteForm
            | Self::Connect
            | Self::BodyTooLarge { .. }
            | Self::BodyRead(_)
            | Self::BodyTimeout(_)
            | Self::BufferFull { .. }
            | Self::DeadlineExceeded
            | Self::QueueFull { .. }
            | Self::QueueTimeout { .. }
            | Self::RateLimited { .. }
            | Self::CircuitOpen { .. }
            | Self::Internal(_) => false,
        }
    }

    /// A short, bounded label for metrics, logs and the `x-corral-error` header.
    pub fn label(&self) -> &'static str {
        match self {
            Self::NoRoute(_) => "no_route",
            Self::BadPath(_) => "bad_path",
            Self::BadPriority => "bad_priority",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::AbsoluteForm => "absolute_form",
            Self::Connect => "connect_refused",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::BodyRead(_) => "body_read",
            Self::BodyTimeout(_) => "body_timeout",
            Self::BufferFull { .. } => "buffer_full",
            Self::UpstreamConnect { .. } => "upstream_connect",
            Self::UpstreamReset { .. } => "upstream_reset",
            Self::TryTimeout { .. } => "try_timeout",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::QueueFull { .. } => "queue_full",
            Self::QueueTimeout { .. } => "queue_timeout",
            Self::RateLimited { .. } => "rate_limited",
            Self::CircuitOpen { .. } => "circuit_open",
            Self::Internal(_) => "internal",
        }
    }

    /// OpenAI's `error.type` for this answer.
    fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "corral_error",
        }
    }

    /// When the client may try again, if corral can tell.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::QueueFull { retry_after, .. }
            | Self::QueueTimeout { retry_after, .. }
            | Self::RateLimited { retry_after, .. }
            | Self::CircuitOpen { retry_after, .. }
            | Self::BufferFull { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// What the client reads: fixed text per variant, naming only what the config names (an
    /// upstream, a limit, a timeout), never an error chain or a value the client sent.
    pub fn message(&self) -> String {
        match self {
            Self::NoRoute(_) => "no route matches the request path".into(),
            Self::BadPriority => "the x-corral-priority header must be `interactive` or `batch`".into(),
            Self::BadPath(_) => "the request path has a dot-segment (`.`, `..`, raw or percent-encoded) or an encoded slash or backslash; corral forwards only plain paths".into(),
            Self::MethodNotAllowed { allow, .. } => format!("only these methods are allowed here: {allow}"),
            Self::BodyRead(_) => "reading the request body failed".into(),
            Self::UpstreamConnect { upstream, .. } => {
                format!("connecting to upstream `{upstream}` failed")
            }
            Self::UpstreamReset { upstream, .. } => {
                format!("upstream `{upstream}` failed before sending a response")
            }
            Self::Internal(_) => "internal error in corral".into(),
            Self::AbsoluteForm
            | Self::Connect
            | Self::BodyTooLarge { .. }
            | Self::BodyTimeout(_)
            | Self::BufferFull { .. }
            | Self::TryTimeout { .. }
            | Self::DeadlineExceeded
            | Self::QueueFull { .. }
            | Self::QueueTimeout { .. }
            | Self::RateLimited { .. }
            | Self::CircuitOpen { .. } => self.to_string(),
        }
    }

    /// The response corral sends: OpenAI's error shape, `x-corral-error`, and `retry-after`
    /// (whole seconds, rounded up) when known.
    pub fn into_response(&self) -> Response<Body> {
        let json = serde_json::json!({
            "error": {
                "message": self.message(),
                "type": self.error_type(),
                "param": null,
                "code": self.label(),
            }
        });
        let mut response = Response::new(body::full(json.to_string()));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(CORRAL_ERROR_HEADER, HeaderValue::from_static(self.label()));
        match self {
            Self::MethodNotAllowed { allow, .. } => {
                headers.insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            Self::Connect => {
                headers.insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
            }
            _ => {}
        }
        if let Some(after) = self.retry_after() {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
            headers.insert(
                "retry-after-ms",
                HeaderValue::from(after.as_millis() as u64),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn error_response_has_openai_shape_and_marker_header() {
        let err = ProxyError::QueueFull {
            upstream: "openai".into(),
            retry_after: Duration::from_millis(1500),
        };
        let response = err.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[CORRAL_ERROR_HEADER], "queue_full");
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(response.headers()["retry-after-ms"], "1500");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error"]["code"], "queue_full");
        assert_eq!(json["error"]["type"], "rate_limit_error");
        assert!(json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("openai"));
    }

    #[test]
    fn only_transport_failures_are_retryable() {
        assert!(ProxyError::TryTimeout {
            upstream: "u".into(),
            timeout: Duration::ZERO
        }
        .is_retryable());
        assert!(!ProxyError::BodyTooLarge { limit: 1 }.is_retryable());
        assert!(!ProxyError::DeadlineExceeded.is_retryable());
    }

    #[tokio::test]
    async fn clients_read_fixed_messages_and_the_log_gets_the_detail() {
        let err = ProxyError::UpstreamConnect {
            upstream: "openai".into(),
            reason: "tcp connect error: Connection refused (os error 111)".into(),
        };
        assert!(err.to_string().contains("os error 111"), "the log keeps it");
        let body = err.into_response().into_body().collect().await.unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap();
        assert_eq!(
            json["error"]["message"],
            "connecting to upstream `openai` failed"
        );
        for err in [
            ProxyError::NoRoute("/secret-path".into()),
            ProxyError::BadPath("/v1/../secret-path".into()),
            ProxyError::MethodNotAllowed {
                method: "SECRET-METHOD".into(),
                allow: crate::error::ALLOWED_METHODS,
            },
            ProxyError::BodyRead("connection reset by peer".into()),
            ProxyError::Internal("lock poisoned".into()),
        ] {
            let message = err.message().to_lowercase();
            for leak in ["secret", "reset", "poisoned"] {
                assert!(!message.contains(leak), "{message}");
            }
        }
        let allow = ProxyError::MethodNotAllowed {
            method: "TRACE".into(),
            allow: ALLOWED_METHODS,
        }
        .into_response();
        assert_eq!(allow.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(allow.headers()[header::ALLOW], ALLOWED_METHODS);
    }
}
