//! OpenAI-shaped bodies: chat completions (JSON and SSE chunks), the model list, errors.

use std::time::Duration;

use bytes::Bytes;
use serde_json::json;

use super::request::{answer, piece, Answer};

/// The one model `GET /v1/models` lists; also the default when a request names none.
pub const MODEL: &str = "corral-sim-1";

/// A `chat.completion` object.
pub fn completion(a: &Answer) -> Bytes {
    let body = json!({
        "id": a.id,
        "object": "chat.completion",
        "created": a.created,
        "model": a.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": answer(a.chunks), "refusal": null},
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "usage": usage(a),
    });
    to_bytes(&body)
}

/// `chunks` `chat.completion.chunk` events `interval` apart (the first at once; it carries the
/// role, the last the finish reason), a usage chunk when asked for, then `data: [DONE]`.
pub fn stream_events(
    a: &Answer,
    interval: Duration,
    include_usage: bool,
) -> Vec<(Duration, Bytes)> {
    let mut events = Vec::with_capacity(a.chunks as usize + 2);
    for i in 0..a.chunks {
        let delta = if i == 0 {
            json!({"role": "assistant", "content": piece(i)})
        } else {
            json!({"content": piece(i)})
        };
        let finish = (i + 1 == a.chunks).then_some("stop");
        let chunk = json!({
            "id": a.id,
            "object": "chat.completion.chunk",
            "created": a.created,
            "model": a.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        let delay = if i == 0 { Duration::ZERO } else { interval };
        events.push((delay, data(&chunk)));
    }
    if include_usage {
        let chunk = json!({
            "id": a.id,
            "object": "chat.completion.chunk",
            "created": a.created,
            "model": a.model,
            "choices": [],
            "usage": usage(a),
        });
        events.push((Duration::ZERO, data(&chunk)));
    }
    events.push((Duration::ZERO, Bytes::from_static(b"data: [DONE]\n\n")));
    events
}

fn usage(a: &Answer) -> serde_json::Value {
    let completion = u64::from(a.chunks);
    json!({
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": a.prompt_tokens + completion,
    })
}

/// `GET /v1/models`.
pub fn models(created: u64) -> Bytes {
    to_bytes(&json!({
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": created, "owned_by": "corral"}],
    }))
}

/// `{"error": {"message", "type", "param": null, "code"}}`.
pub fn error(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    to_bytes(&json!({
        "error": {"message": message, "type": kind, "param": null, "code": code},
    }))
}

fn data(value: &serde_json::Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    serde_json::to_writer(&mut out, value).expect("a Value always serializes");
    out.extend_from_slice(b"\n\n");
    out.into()
}

fn to_bytes(value: &serde_json::Value) -> Bytes {
    serde_json::to_vec(value)
        .expect("a Value always serializes")
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn sample(chunks: u32) -> Answer {
        Answer {
            id: "chatcmpl-1".into(),
            model: "m".into(),
            created: 1,
            prompt_tokens: 5,
            chunks,
        }
    }

    #[test]
    fn completion_shape() {
        let v: Value = serde_json::from_slice(&completion(&sample(2))).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "m");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], "This is ");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 7);
    }

    #[test]
    fn stream_events_are_sse_chunks_then_done() {
        let events = stream_events(&sample(3), Duration::from_millis(20), true);
        let delays: Vec<u128> = events.iter().map(|(d, _)| d.as_millis()).collect();
        assert_eq!(delays, [0, 20, 20, 0, 0]);
        let texts: Vec<&str> = events
            .iter()
            .map(|(_, b)| std::str::from_utf8(b).unwrap())
            .collect();
        assert!(texts
            .iter()
            .all(|t| t.starts_with("data: ") && t.ends_with("\n\n")));
        assert_eq!(texts[4], "data: [DONE]\n\n");
        let first: Value = serde_json::from_str(&texts[0][6..]).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["finish_reason"], Value::Null);
        let last: Value = serde_json::from_str(&texts[2][6..]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let usage: Value = serde_json::from_str(&texts[3][6..]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 3);
    }

    #[test]
    fn error_shape() {
        let v: Value =
            serde_json::from_slice(&error("nope", "invalid_request_error", None)).unwrap();
        let want = json!({"error": {"message": "nope", "type": "invalid_request_error",
            "param": null, "code": null}});
        assert_eq!(v, want);
    }
}
