//! `corral simulate`: a rate-limited fake OpenAI- and Anthropic-compatible upstream (in progress).

mod config;
mod bucket;
mod limits;
mod headers;
mod stats;
mod body;
mod request;
mod openai;
mod anthropic;

pub use self::config::{ConfigError, LimitReport, RefillChange, SimConfig, SimulateArgs};
