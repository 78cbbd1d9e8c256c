"""The official `anthropic` SDK against corral, in front of `corral simulate`.

Reads ANTHROPIC_BASE_URL (corral's /anthropic route) and ANTHROPIC_API_KEY from the environment,
as a real client would; CORRAL_OVERLOADED_BASE_URL is a second route, to an upstream that
answers some requests 529 (for `test_529_overloads_are_absorbed`). The SDK's own retries are off
(`max_retries=0`) unless CORRAL_SDK_MAX_RETRIES says otherwise: every call must succeed because
corral absorbs the 429s and 529s. With retries on, a 429 that reached the SDK would come back
with `x-stainless-retry-count`, which corral counts. Driven by tests/anthropic_sdk.rs; also runs
under pytest. Run alone:
`ANTHROPIC_BASE_URL=http://127.0.0.1:PORT/anthropic python test_anthropic_sdk.py [TEST ...]`.
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import anthropic

import runner  # tests/python/runner.py, beside this script

MODEL = "claude-test"
STORM = int(os.environ.get("CORRAL_STORM_CALLS", "40"))
OVERLOADED_CALLS = int(os.environ.get("CORRAL_OVERLOADED_CALLS", "10"))
MAX_RETRIES = int(os.environ.get("CORRAL_SDK_MAX_RETRIES", "0"))


def make_client(base_url=None) -> anthropic.Anthropic:
    # max_retries=0 (the default here): a 429 or 529 reaching the SDK fails the call instead of
    # being retried.
    return anthropic.Anthropic(
        base_url=base_url or os.environ["ANTHROPIC_BASE_URL"], max_retries=MAX_RETRIES, timeout=60
    )


def ask(client: anthropic.Anthropic, text: str) -> anthropic.types.Message:
    return client.messages.create(
        model=MODEL, max_tokens=32, messages=[{"role": "user", "content": text}]
    )


def test_message():
    message = ask(make_client(), "Say hello")
    assert message.type == "message", message
    assert message.role == "assistant", message
    assert message.model == MODEL, message
    assert message.stop_reason == "end_turn", message
    assert message.content[0].type == "text" and message.content[0].text, message
    assert message.usage.output_tokens > 0, message.usage


def test_streamed_message():
    whole = ask(make_client(), "Count").content[0].text
    with make_client().messages.stream(
        model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Count"}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1, f"expected several text deltas, got {pieces}"
    assert "".join(pieces) == whole, (pieces, whole)
    assert final.stop_reason == "end_turn", final


def test_raw_event_stream():
    events = list(
        make_client().messages.create(
            model=MODEL,
            max_tokens=32,
            messages=[{"role": "user", "content": "Count"}],
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert kinds.count("content_block_delta") > 1, kinds


def storm(calls: int, base_url=None) -> None:
    """`calls` concurrent calls at once; each must succeed."""
    client = make_client(base_url)
    with ThreadPoolExecutor(max_workers=calls) as pool:
        futures = [pool.submit(ask, client, f"task {i}") for i in range(calls)]
        failures = []
        for f in futures:
            try:
                assert f.result().stop_reason == "end_turn"
            except Exception as e:  # noqa: BLE001 - collect every failure
                failures.append(repr(e))
    assert not failures, f"{len(failures)} of {calls} calls failed: {failures[:3]}"


def test_429_storm_is_absorbed():
    storm(STORM)


def test_529_overloads_are_absorbed():
    storm(OVERLOADED_CALLS, os.environ["CORRAL_OVERLOADED_BASE_URL"])


if __name__ == "__main__":
    sys.exit(runner.run(globals(), sys.argv[1:], f"anthropic {anthropic.__version__}"))
