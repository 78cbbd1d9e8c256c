//! corral: a sidecar proxy that keeps LLM workloads from stampeding the APIs they depend on.
//!
//! # Layout
//! - [`simulate`]: `corral simulate`, a rate-limited fake OpenAI/Anthropic upstream for offline tests.

pub mod simulate;
