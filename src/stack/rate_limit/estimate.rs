//! Token estimates for the tokens-per-minute bucket: prompt characters / 4 plus the completion
//! budget (`max_tokens`, `max_completion_tokens`, `max_output_tokens`, or a default). A body
//! that is not JSON is still forwarded, charged by its length.

use serde_json::Value;

/// Estimated tokens a request will use.
pub fn estimate_tokens(body: &[u8], default_max_tokens: u32) -> u32 {
    let Ok(json) = serde_json::from_slice::<Value>(body) else {
        return (body.len() / 4) as u32 + default_max_tokens;
    };
    let mut chars = 0usize;
    for key in ["messages", "prompt", "input", "system", "instructions"] {
        if let Some(v) = json.get(key) {
            chars += text_chars(v);
        }
    }
    let completion = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| json.get(*k).and_then(Value::as_u64))
        .map_or(default_max_tokens, |n| {
            n.min(u64::from(u32::MAX / 2)) as u32
        });
    ((chars / 4) as u32).saturating_add(completion)
}

/// Characters of text in a prompt value (strings, arrays, message objects' content).
fn text_chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => items.iter().map(text_chars).sum(),
        Value::Object(map) => ["content", "text"]
            .iter()
            .filter_map(|k| map.get(*k))
            .map(text_chars)
            .sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_and_completion_shapes() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"12345678"},{"role":"user","content":[{"type":"text","text":"abcd"}]}],"max_tokens":100}"#;
        assert_eq!(estimate_tokens(chat, 16), 3 + 100);
        let legacy = br#"{"prompt":"0123456789abcdef","max_completion_tokens":10}"#;
        assert_eq!(estimate_tokens(legacy, 16), 4 + 10);
        let no_max = br#"{"messages":[{"role":"user","content":"abcd"}]}"#;
        assert_eq!(estimate_tokens(no_max, 16), 1 + 16);
        assert_eq!(estimate_tokens(b"not json at all!", 16), 4 + 16);
    }
}
