//! corral: a sidecar proxy that keeps LLM workloads from stampeding the APIs they depend on.
//!
//! # Layout
//! From the top of the request path down; each module imports only modules listed below it
//! (`tests/layout.rs` holds this list to the code).
//! - [`cli`]: the command line (clap) and logging; `main.rs` only runs it.
//! - [`herd`]: `corral bench herd`, the thundering-herd benchmark in several worlds.
//! - [`server`]: the app and its config reload; the request path, the admin endpoints, serving
//!   and draining, reload on SIGHUP, each in its own file.
//! - [`shutdown`]: the signal future.
//! - [`access_log`]: which requests get a log line, and why.
//! - [`accept`]: the accept loop of one listener: its connection cap, each connection's
//!   first-byte, idle and HTTP/2 keep-alive limits, its part of the drain.
//! - [`router`]: path prefix to upstream or group, each upstream owning one built stack.
//! - [`group`]: a route served by an ordered list of upstreams: fallback and hedging, and the
//!   driver that takes a request through the members.
//! - [`upstream`]: one upstream, ready to serve: its stack, its target, and `send`, one request
//!   through its stack.
//! - [`stack`]: the per-upstream tower stack: catch-panic, metrics, concurrency, retry, breaker,
//!   rate limit, per-try timeout; its module doc gives the order and why.
//! - [`fleet`]: corrals on one key sharing its limit through Redis (leased tokens, shared
//!   learning and pauses, fallback to a local share).
//! - [`client`]: the pooled upstream client (rustls: webpki roots plus any `tls_ca_file`).
//! - [`metrics`]: every Prometheus series, on an explicit registry.
//! - [`classify`]: one classifier of attempt outcomes (permanent 429s, SSE error events included).
//! - [`provider`]: what a provider's response headers say (retry hints, rate-limit reports).
//! - [`forward`]: what a request becomes before the stack (hop-by-hop headers, the body buffered
//!   under the global buffer cap, deadlines).
//! - [`error`]: `ProxyError`, corral's own refusals as OpenAI-style JSON.
//! - [`body`]: the response body types.
//! - [`bucket`]: the token bucket the rate limiter and the fleet both keep.
//! - [`sync`]: the poison-tolerant lock every room takes.
//! - [`config`]: the TOML config, checked in one pass into validated types.
//! - [`simulate`]: `corral simulate`, a rate-limited fake OpenAI/Anthropic upstream for offline tests.
//! - [`listener`]: a TCP listener whose backlog holds a herd's connects.

pub mod accept;
pub mod access_log;
pub mod body;
pub mod bucket;
pub mod classify;
pub mod cli;
pub mod client;
pub mod config;
pub mod error;
pub mod fleet;
pub mod forward;
pub mod group;
pub mod herd;
pub mod listener;
pub mod metrics;
pub mod provider;
pub mod router;
pub mod server;
pub mod shutdown;
pub mod simulate;
pub mod stack;
pub mod sync;
pub mod upstream;
