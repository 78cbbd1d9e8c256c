//! corral: a sidecar proxy that keeps LLM workloads from stampeding the APIs they depend on.
//!
//! # Layout
//! - [`simulate`]: `corral simulate`, a rate-limited fake OpenAI/Anthropic upstream for offline tests.

pub mod body;
pub mod classify;
pub mod cli;
pub mod client;
pub mod config;
pub mod error;
pub mod forward;
pub mod herd;
pub mod metrics;
pub mod provider;
pub mod router;
pub mod server;
pub mod shutdown;
pub mod simulate;
pub mod stack;
