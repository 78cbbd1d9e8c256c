"""The official `openai` SDK with its default retries ON, against corral in front of an upstream
that always answers 503.

Driven by tests/retry.rs, which counts the attempts the upstream saw: the SDK must surface the
503 as `openai.InternalServerError` however many times it retried. Run alone:
`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 python test_openai_retries.py`.
"""

import os
import sys

import openai

import runner  # tests/python/runner.py, beside this script


def test_a_503_surfaces_as_internal_server_error():
    # The SDK's defaults: max_retries=2, with its own backoff between them.
    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], timeout=30)
    assert client.max_retries == 2, client.max_retries
    try:
        client.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": "Hi"}],
        )
    except openai.InternalServerError as e:
        assert e.status_code == 503, e
        # The upstream's answer, passed through, not one corral made.
        assert "x-corral-error" not in e.response.headers, e.response.headers
    else:
        raise AssertionError("a 503 did not raise openai.InternalServerError")


if __name__ == "__main__":
    sys.exit(runner.run(globals(), sys.argv[1:], f"openai {openai.__version__}"))
