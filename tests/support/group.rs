//! Two upstreams behind one group, for the tests of groups and fallback (`tests/groups.rs`) and
//! of which credentials reach which member (`tests/credentials.rs`).

use super::MockUpstream;

/// A chat request for `gpt-4o`, the model a group member may rewrite.
pub const BODY: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

/// OpenAI's answer for an account out of quota, a permanent 429 that moves a request on.
pub fn quota() -> serde_json::Value {
    serde_json::json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}})
}

/// A member's answer that is not a failure.
pub fn ok() -> serde_json::Value {
    serde_json::json!({"ok": true})
}

/// Two route-less upstreams `primary` and `backup` (each with `extra` TOML lines) behind the
/// group `chat` at `/v1`, with `group` TOML lines.
pub fn group_config(
    primary: &MockUpstream,
    primary_extra: &str,
    backup: &MockUpstream,
    backup_extra: &str,
    group: &str,
) -> String {
    format!(
        "drain_timeout = \"5s\"\n\
         [[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\n{primary_extra}\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\n{backup_extra}\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"backup\"]\n{group}\n",
        primary.url("/v1"),
        backup.url("/v1"),
    )
}
