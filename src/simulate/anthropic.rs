//! Anthropic-shaped bodies: messages (JSON and SSE events) and errors.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};

use super::request::{answer, piece, Answer};

/// The default model when a request names none.
pub const MODEL: &str = "corral-sim-claude";

/// A `message` object.
pub fn message(a: &Answer) -> Bytes {
    let body = json!({
        "id": a.id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": answer(a.chunks)}],
        "model": a.model,
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.chunks},
    });
    serde_json::to_vec(&body)
        .expect("a Value always serializes")
        .into()
}

/// Anthropic's streaming sequence: `message_start`, `content_block_start`, `ping`, one
/// `content_block_delta` per chunk (`interval` apart, the first at once),
/// `content_block_stop`, `message_delta` and `message_stop`.
pub fn stream_events(a: &Answer, interval: Duration) -> Vec<(Duration, Bytes)> {
    let mut events = Vec::with_capacity(a.chunks as usize + 6);
    let mut push = |delay, name, data: Value| events.push((delay, event(name, &data)));
    let start = json!({
        "type": "message_start",
        "message": {
            "id": a.id, "type": "message", "role": "assistant", "content": [],
            "model": a.model, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": a.prompt_tokens, "output_tokens": 1},
        },
    });
    push(Duration::ZERO, "message_start", start);
    let block = json!({"type": "content_block_start", "index": 0,
        "content_block": {"type": "text", "text": ""}});
    push(Duration::ZERO, "content_block_start", block);
    push(Duration::ZERO, "ping", json!({"type": "ping"}));
    for i in 0..a.chunks {
        let delta = json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": piece(i)}});
        let delay = if i == 0 { Duration::ZERO } else { interval };
        push(delay, "content_block_delta", delta);
    }
    let stop = json!({"type": "content_block_stop", "index": 0});
    push(Duration::ZERO, "content_block_stop", stop);
    let delta = json!({"type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": null},
        "usage": {"output_tokens": a.chunks}});
    push(Duration::ZERO, "message_delta", delta);
    push(
        Duration::ZERO,
        "message_stop",
        json!({"type": "message_stop"}),
    );
    events
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error(kind: &str, message: &str) -> Bytes {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    serde_json::to_vec(&body)
        .expect("a Value always serializes")
        .into()
}

fn event(name: &str, data: &Value) -> Bytes {
    let mut out = format!("event: {name}\ndata: ").into_bytes();
    serde_json::to_writer(&mut out, data).expect("a Value always serializes");
    out.extend_from_slice(b"\n\n");
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Answer {
        Answer {
            id: "msg_1".into(),
            model: "claude-x".into(),
            created: 1,
            prompt_tokens: 4,
            chunks: 2,
        }
    }

    #[test]
    fn message_shape() {
        let v: Value = serde_json::from_slice(&message(&sample())).unwrap();
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert_eq!(v["content"][0], json!({"type": "text", "text": "This is "}));
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(v["usage"], json!({"input_tokens": 4, "output_tokens": 2}));
    }

    #[test]
    fn stream_follows_the_documented_event_order() {
        let events = stream_events(&sample(), Duration::from_millis(5));
        let mut names = Vec::new();
        for (_, bytes) in &events {
            let text = std::str::from_utf8(bytes).unwrap();
            let (head, data) = text.split_once('\n').unwrap();
            let name = head.strip_prefix("event: ").unwrap();
            let data = data
                .strip_prefix("data: ")
                .unwrap()
                .strip_suffix("\n\n")
                .unwrap();
            let json: Value = serde_json::from_str(data).unwrap();
            assert_eq!(json["type"], name, "event name matches data.type");
            names.push(name.to_owned());
        }
        let want = [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ];
        assert_eq!(names, want);
        let delays: Vec<u128> = events.iter().map(|(d, _)| d.as_millis()).collect();
        assert_eq!(delays, [0, 0, 0, 0, 5, 0, 0, 0]);
    }

    #[test]
    fn error_shape() {
        let v: Value = serde_json::from_slice(&error("overloaded_error", "Overloaded")).unwrap();
        let want = json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
        assert_eq!(v, want);
    }
}
