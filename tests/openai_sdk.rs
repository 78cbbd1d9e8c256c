//! The official `openai` Python SDK through corral: a chat completion, a streamed one, and an
//! upstream 400 that must surface as `openai.BadRequestError`.
//!
//! The mock upstream and corral run in-process; `tests/python/test_openai_sdk.py` runs under
//! `$CORRAL_PYTHON` (a venv with `openai`; `.ci/run` makes one). Without it the test fails, unless
//! `CORRAL_SKIP_PYTHON=1`.

mod support;

use std::time::Duration;

use http::Response;
use support::*;

use corral::body::{self, Body};

/// Answers `/v1/chat/completions` in OpenAI's shape: JSON, SSE when `stream` is true, and a 400
/// with an OpenAI error body for model `bad-model`. Any other request, or a missing client key,
/// gets a status the SDK would report as the wrong error.
async fn openai_mock() -> MockUpstream {
    MockUpstream::start(|seen| async move {
        if seen.uri.path() != "/v1/chat/completions" {
            return json(404, error_body("no such path", "not_found"));
        }
        if seen.headers.get("authorization").map(|v| v.as_bytes()) != Some(b"Bearer sk-test") {
            return json(
                401,
                error_body("missing the client's key", "invalid_api_key"),
            );
        }
        let request: serde_json::Value = serde_json::from_slice(&seen.body).unwrap_or_default();
        let model = request["model"].as_str().unwrap_or_default().to_owned();
        if model == "bad-model" {
            return json(
                400,
                error_body(
                    "The model `bad-model` does not exist or you do not have access to it.",
                    "model_not_found",
                ),
            );
        }
        if request["stream"] == true {
            return sse(&model);
        }
        json(
            200,
            serde_json::json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion",
                "created": 1_700_000_000,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello from the mock upstream."},
                    "finish_reason": "stop",
                    "logprobs": null
                }],
                "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
            }),
        )
    })
    .await
}

fn error_body(message: &str, code: &str) -> serde_json::Value {
    serde_json::json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": "model",
        "code": code,
    }})
}

/// A streamed completion: a role chunk, three content chunks, a finish chunk, `[DONE]`.
fn sse(model: &str) -> Response<Body> {
    let chunk = |delta: serde_json::Value, finish: Option<&str>| {
        let json = serde_json::json!({
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]
        });
        format!("data: {json}\n\n")
    };
    let mut text = chunk(
        serde_json::json!({"role": "assistant", "content": ""}),
        None,
    );
    for word in ["one", " two", " three"] {
        text += &chunk(serde_json::json!({"content": word}), None);
    }
    text += &chunk(serde_json::json!({}), Some("stop"));
    text += "data: [DONE]\n\n";
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(body::full(text))
        .unwrap()
}

#[tokio::test]
async fn openai_python_sdk_through_corral() {
    let Some(python) = support::python::python("the openai SDK") else {
        return;
    };
    let upstream = openai_mock().await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    sdk_script(&python, &corral).await;
    assert_eq!(upstream.calls(), 3, "one upstream call per SDK request");
}

/// The same SDK calls through a group whose first member is out of quota for good:
/// each call falls back to the OpenAI-shaped member, the SDK sees its answers (the 400 included:
/// an answer for good is not a reason to move on), and the primary is asked once, then passed
/// over for its cool-down.
#[tokio::test]
async fn openai_python_sdk_through_a_group() {
    let Some(python) = support::python::python("the openai SDK") else {
        return;
    };
    let primary = MockUpstream::start(|_| async {
        json(
            429,
            serde_json::json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}}),
        )
    })
    .await;
    let backup = openai_mock().await;
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"backup\"]\n",
        primary.url("/v1"),
        backup.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    sdk_script(&python, &corral).await;
    assert_eq!(backup.calls(), 3, "every call answered by the backup");
    assert_eq!(
        primary.calls(),
        1,
        "the primary passed over after its permanent 429"
    );
}

/// `tests/python/test_openai_sdk.py` against `corral`'s `/v1`: all three of its tests pass.
async fn sdk_script(python: &str, corral: &Corral) {
    let env = [
        ("OPENAI_BASE_URL", corral.url("/v1")),
        ("OPENAI_API_KEY", "sk-test".to_owned()),
    ];
    let limit = Duration::from_secs(120);
    support::python::run_sdk_script(python, "test_openai_sdk.py", &[], &env, 3, limit).await;
}
