"""The official `openai` SDK against corral.

Reads OPENAI_BASE_URL (corral's /v1 route) and OPENAI_API_KEY from the environment, as a real
client would. Driven by tests/openai_sdk.rs, which runs a mock upstream and corral in-process;
also runs under pytest. Run alone: `OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 python
test_openai_sdk.py`.
"""

import os
import sys

import openai

import runner  # tests/python/runner.py, beside this script


def make_client() -> openai.OpenAI:
    base_url = os.environ["OPENAI_BASE_URL"]
    # max_retries=0: corral does the retrying; a retry here would hide a wrong status.
    return openai.OpenAI(base_url=base_url, max_retries=0, timeout=30)


def test_chat_completion():
    completion = make_client().chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "Say hello"}],
    )
    assert completion.object == "chat.completion", completion
    assert completion.model == "gpt-test", completion
    assert completion.choices[0].message.content == "Hello from the mock upstream.", completion
    assert completion.usage is not None and completion.usage.total_tokens > 0, completion


def test_streamed_chat_completion():
    stream = make_client().chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "Count"}],
        stream=True,
    )
    chunks = list(stream)
    assert len(chunks) > 1, f"expected several chunks, got {len(chunks)}"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three", text
    assert chunks[-1].choices[0].finish_reason == "stop", chunks[-1]


def test_upstream_400_is_bad_request_error():
    try:
        make_client().chat.completions.create(
            model="bad-model",
            messages=[{"role": "user", "content": "Hi"}],
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        assert e.code == "model_not_found", e.body
        assert "bad-model" in e.message, e.message
        # The upstream's own answer, not one made by corral.
        assert "x-corral-error" not in e.response.headers, e.response.headers
    else:
        raise AssertionError("a 400 from the upstream did not raise openai.BadRequestError")


if __name__ == "__main__":
    sys.exit(runner.run(globals(), sys.argv[1:], f"openai {openai.__version__}"))
