"""The official `openai` SDK in a 429 storm through corral, in front of `corral simulate`.

Reads OPENAI_BASE_URL (corral's /v1 route) and OPENAI_API_KEY from the environment. The SDK's
own retries are off (`max_retries=0`): every one of CORRAL_STORM_CALLS (40) concurrent calls,
plain and streamed, must succeed because corral absorbs the upstream's 429s. Driven by
tests/anthropic_sdk.rs; also runs under pytest.
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import openai

import runner  # tests/python/runner.py, beside this script

STORM = int(os.environ.get("CORRAL_STORM_CALLS", "40"))


def call(client: openai.OpenAI, i: int) -> str:
    messages = [{"role": "user", "content": f"task {i}"}]
    if i % 2:
        stream = client.chat.completions.create(
            model="gpt-test", messages=messages, max_tokens=16, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    completion = client.chat.completions.create(model="gpt-test", messages=messages, max_tokens=16)
    return completion.choices[0].message.content


def test_429_storm_is_absorbed():
    # max_retries=0: a 429 reaching the SDK fails the call instead of being retried.
    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], max_retries=0, timeout=60)
    with ThreadPoolExecutor(max_workers=STORM) as pool:
        futures = [pool.submit(call, client, i) for i in range(STORM)]
        failures = []
        for f in futures:
            try:
                assert f.result(), "an empty answer"
            except Exception as e:  # noqa: BLE001 - collect every failure
                failures.append(repr(e))
    assert not failures, f"{len(failures)} of {STORM} calls failed: {failures[:3]}"


if __name__ == "__main__":
    sys.exit(runner.run(globals(), sys.argv[1:], f"openai {openai.__version__}"))
