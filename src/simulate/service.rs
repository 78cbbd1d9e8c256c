//! Routes one request: admin (`/_stats`, `/_reset`), `/v1/models`, and the two rate-limited
//! chat routes.
//!
//! A chat request is stamped on arrival, its body read, then taken through the gateway, the
//! overload dice, the day's quota and the buckets as of the arrival instant (`state`): a
//! refusal is a 429 at once (Anthropic's overload a 529), counted by reason; an admitted
//! request waits for a slot (`--queue-slots` only), then its service time (plus jitter and any
//! slow-first-byte delay) before its fault roll (or fail window) is applied.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;

use super::body::{self, SimBody};
use super::config::HeaderStyle;
use super::error::ConnectionReset;
use super::limits::{token_cost, Admission, Kind};
use super::request::{Answer, ChatRequest};
use super::state::{Arrival, Decision, Fault, Outcome, Shared};
use super::stats::Throttle;
use super::{anthropic, gemini, headers, openai};

/// OpenAI's documented overload message: a 429 that says nothing about the sender's rate.
pub const OVERLOAD_MESSAGE: &str = "The engine is currently overloaded, please try again later";

/// Largest request body read; more is a 413.
const MAX_BODY: usize = 8 * 1024 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    OpenAi,
    Anthropic,
}

pub async fn handle<B>(
    shared: &Shared,
    req: Request<B>,
) -> Result<Response<SimBody>, ConnectionReset>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let route = (req.method(), req.uri().path());
    tracing::debug!(method = %route.0, path = route.1, "request");
    let response = match route {
        (&Method::POST, "/v1/chat/completions") => return chat(shared, Api::OpenAi, req).await,
        (&Method::POST, "/v1/messages") => return chat(shared, Api::Anthropic, req).await,
        (&Method::GET, "/v1/models") => json(StatusCode::OK, openai::models(unix_now())),
        (&Method::GET, "/_stats") => {
            let stats = serde_json::to_vec(&shared.stats()).expect("stats serialize");
            json(StatusCode::OK, stats)
        }
        (&Method::POST, "/_reset") => {
            shared.reset();
            json(StatusCode::OK, &b"{\"reset\":true}"[..])
        }
        (_, "/v1/chat/completions" | "/v1/messages" | "/v1/models" | "/_stats" | "/_reset") => {
            let body = openai::error("method not allowed", "invalid_request_error", None);
            json(StatusCode::METHOD_NOT_ALLOWED, body)
        }
        (_, path) => {
            let message = format!("unknown path {path}");
            json(
                StatusCode::NOT_FOUND,
                openai::error(&message, "invalid_request_error", None),
            )
        }
    };
    Ok(response)
}

async fn chat<B>(
    shared: &Shared,
    api: Api,
    req: Request<B>,
) -> Result<Response<SimBody>, ConnectionReset>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let arrival = Instant::now();
    let in_flight = shared.stats.arrive(arrival);
    let bytes = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let status = if e.is::<http_body_util::LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            let message = format!("could not read the request body: {e}");
            return Ok(finish(
                shared,
                status,
                HeaderMap::new(),
                error(api, status, &message),
            ));
        }
    };
    let parsed = ChatRequest::parse(&bytes);
    let (cost, model) = match &parsed {
        Ok(r) => (token_cost(r.prompt_chars, r.max_tokens), r.model.as_deref()),
        Err(_) => (0, None),
    };
    let decision = shared.admit(Arrival {
        at: arrival,
        body: &bytes,
        model,
        cost,
    });
    let fate = match decision.outcome {
        Outcome::Admitted(fate) => fate,
        Outcome::Refused(reason) => return Ok(refuse(shared, api, &decision, reason, model)),
    };
    let headers = rate_headers(api, shared.config.header_style, &decision.admission);
    let request = match parsed {
        Ok(request) => request,
        Err(e) => {
            let status = StatusCode::BAD_REQUEST;
            return Ok(finish(
                shared,
                status,
                headers,
                error(api, status, &e.to_string()),
            ));
        }
    };
    // With `--queue-slots`, the service time starts once a slot is free.
    let slot = shared.slot(arrival).await;
    if !fate.delay.is_zero() {
        tokio::time::sleep(fate.delay).await;
    }
    let status = match fate.fault {
        None => StatusCode::OK,
        Some(Fault::Unavailable) => StatusCode::SERVICE_UNAVAILABLE,
        Some(Fault::Overloaded) => StatusCode::from_u16(529).expect("529 is a valid status"),
        Some(Fault::Reset) => {
            shared.stats.reset_connection();
            tracing::debug!("injected connection reset");
            return Err(ConnectionReset);
        }
    };
    if status != StatusCode::OK {
        return Ok(finish(shared, status, headers, fault_body(api, status)));
    }
    let answer = answer_for(shared, api, &request);
    let mut response = if request.stream {
        let interval = shared.config.stream_interval;
        let events = match api {
            Api::OpenAi => openai::stream_events(&answer, interval, request.include_usage),
            Api::Anthropic => anthropic::stream_events(&answer, interval),
        };
        // The stream holds its slot (and counts in flight) until its last event.
        let mut r = Response::new(body::stream(events, (in_flight, slot)));
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        let bytes = match api {
            Api::OpenAi => openai::completion(&answer),
            Api::Anthropic => anthropic::message(&answer),
        };
        json(StatusCode::OK, bytes)
    };
    response.headers_mut().extend(headers);
    shared.stats.status(StatusCode::OK.as_u16());
    Ok(response)
}

fn answer_for(shared: &Shared, api: Api, request: &ChatRequest) -> Answer {
    let n = shared.next_id();
    let (id, default_model) = match api {
        Api::OpenAi => (format!("chatcmpl-sim{n}"), openai::MODEL),
        Api::Anthropic => (format!("msg_sim{n}"), anthropic::MODEL),
    };
    Answer {
        id,
        model: request
            .model
            .clone()
            .unwrap_or_else(|| default_model.to_owned()),
        created: unix_now(),
        prompt_tokens: request.prompt_tokens(),
        chunks: shared.config.stream_chunks,
    }
}

fn rate_headers(api: Api, style: HeaderStyle, admission: &Admission) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(12);
    match (api, style) {
        (Api::OpenAi, HeaderStyle::OpenAi) => headers::openai(&mut h, admission),
        (Api::OpenAi, HeaderStyle::Azure) => headers::azure(&mut h, admission),
        (Api::OpenAi, HeaderStyle::None | HeaderStyle::Gemini) => {}
        (Api::Anthropic, _) => headers::anthropic(&mut h, admission, SystemTime::now()),
    }
    h
}

/// The answer to a refused arrival: a 429 counted by `reason`, except an overload on the
/// Anthropic route, which Anthropic signals with 529 `overloaded_error`.
fn refuse(
    shared: &Shared,
    api: Api,
    decision: &Decision,
    reason: Throttle,
    model: Option<&str>,
) -> Response<SimBody> {
    let style = shared.config.header_style;
    let admission = &decision.admission;
    let headers = match (reason, api) {
        // The gateway in front speaks for itself, whatever the API behind it sends.
        (Throttle::Admission, Api::OpenAi) => {
            let mut h = HeaderMap::with_capacity(8);
            headers::openai(&mut h, admission);
            h
        }
        _ => rate_headers(api, style, admission),
    };
    if (reason, api) == (Throttle::Overload, Api::Anthropic) {
        let status = StatusCode::from_u16(529).expect("529 is a valid status");
        let body = anthropic::error("overloaded_error", "Overloaded");
        return finish(shared, status, headers, body);
    }
    shared.stats.throttle(reason);
    let body = match reason {
        Throttle::Overload => openai::error(OVERLOAD_MESSAGE, "server_error", None),
        Throttle::Admission => {
            let message = "Too many requests are queued (corral simulate admission control). \
                           Please try again in 1s.";
            match api {
                Api::OpenAi => openai::error(message, "requests", Some("rate_limit_exceeded")),
                Api::Anthropic => anthropic::error("rate_limit_error", message),
            }
        }
        Throttle::Rate | Throttle::Quota if api == Api::OpenAi && style == HeaderStyle::Gemini => {
            gemini_refusal(decision, reason, model.unwrap_or(openai::MODEL))
        }
        Throttle::Rate | Throttle::Quota => {
            // OpenAI's messages name the wait ("Please try again in 20ms"); Anthropic's do
            // not (its `retry-after`, whole seconds, is all it names), nor do OpenAI-compatible
            // servers that send no rate-limit headers.
            let hint = api == Api::OpenAi && style != HeaderStyle::None;
            refusal(api, admission, reason == Throttle::Quota, hint)
        }
    };
    finish(shared, StatusCode::TOO_MANY_REQUESTS, headers, body)
}

/// The 429 body of an empty bucket or a spent `day`; without `hint` its message does not say
/// when to try again.
fn refusal(api: Api, admission: &Admission, day: bool, hint: bool) -> Bytes {
    let kind = admission.denied.map_or(Kind::Requests, |d| d.kind);
    let (what, limit) = match kind {
        Kind::Requests => ("requests", admission.requests.limit),
        Kind::Tokens => ("tokens", admission.tokens.map_or(0, |t| t.limit)),
    };
    let retry = admission.denied.map_or(Duration::ZERO, |d| d.retry_after);
    let mut message = if day {
        format!(
            "Rate limit reached for requests per day (RPD) (corral simulate): \
             Limit {limit}, Used {limit}, Requested 1."
        )
    } else {
        format!("Rate limit reached for {what} (corral simulate): limit {limit}.")
    };
    if hint {
        let retry = headers::go_duration(Duration::from_millis(headers::ceil_millis(retry)));
        message.push_str(&format!(" Please try again in {retry}."));
    }
    match api {
        Api::OpenAi => openai::error(&message, what, Some("rate_limit_exceeded")),
        Api::Anthropic => anthropic::error("rate_limit_error", &message),
    }
}

/// Gemini's `RESOURCE_EXHAUSTED` for an empty bucket or a spent day, its `retryDelay` the
/// true wait.
fn gemini_refusal(decision: &Decision, reason: Throttle, model: &str) -> Bytes {
    let admission = &decision.admission;
    let kind = admission.denied.map_or(Kind::Requests, |d| d.kind);
    let (quota, limit) = match (reason, kind) {
        (Throttle::Quota, _) => (gemini::Quota::RequestsPerDay, admission.requests.limit),
        (_, Kind::Requests) => (gemini::Quota::RequestsPerMinute, admission.requests.limit),
        (_, Kind::Tokens) => (
            gemini::Quota::InputTokensPerMinute,
            admission.tokens.map_or(0, |t| t.limit),
        ),
    };
    let delay = admission.denied.map_or(Duration::ZERO, |d| d.retry_after);
    gemini::resource_exhausted(quota, limit, model, delay, decision.array)
}

fn fault_body(api: Api, status: StatusCode) -> Bytes {
    match (api, status.as_u16()) {
        (Api::Anthropic, 529) => anthropic::error("overloaded_error", "Overloaded"),
        (Api::Anthropic, _) => anthropic::error("api_error", "Service unavailable (simulated)"),
        (Api::OpenAi, 529) => openai::error("Overloaded (simulated)", "server_error", None),
        (Api::OpenAi, _) => openai::error(
            "The server is temporarily unavailable (simulated)",
            "server_error",
            None,
        ),
    }
}

fn error(api: Api, status: StatusCode, message: &str) -> Bytes {
    match (api, status) {
        (Api::Anthropic, StatusCode::PAYLOAD_TOO_LARGE) => {
            anthropic::error("request_too_large", message)
        }
        (Api::Anthropic, _) => anthropic::error("invalid_request_error", message),
        (Api::OpenAi, _) => openai::error(message, "invalid_request_error", None),
    }
}

/// A buffered JSON answer from a chat route, counted in the stats.
fn finish(
    shared: &Shared,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
) -> Response<SimBody> {
    shared.stats.status(status.as_u16());
    let mut response = json(status, body);
    response.headers_mut().extend(headers);
    response
}

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<SimBody> {
    let mut response = Response::new(SimBody::full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
