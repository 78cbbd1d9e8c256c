#!/usr/bin/env bash
# Worlds written elsewhere: corral against what a user gets without it, in upstreams built from
# the providers' documented behaviour by a helper that never read corral's source
# (benches/worlds/upstream.py: OpenAI's quantized limits and overload 429s, two models on one
# key, Anthropic's headers and 529s, Azure's 10 s sub-windows, Gemini's body hints, a
# Together-like 503 share, a vLLM queue, a gateway's admission queue, Groq's per-day
# requests report, no limit at all; and openai-tokens: a tokens-per-minute limit that binds
# before requests, prompt + max_tokens charged at admission and settled from usage;
# openai-stream: SSE answers with include_usage, done only when read to the end; staggered:
# Poisson arrivals at 50/s into a 20/s key; tier-up: a key's limit raised from 10/s to 40/s
# 10 s in; sglang: a server that answers 503 when its queue is full, no rate-limit headers;
# bedrock: a token bucket per model (burst 50, 20/s) answering 429 ThrottlingException with no
# retry-after and no rate-limit headers at all; anthropic-accel: Anthropic's headers with a
# minute that never binds, but an acceleration limit (the last second's requests at most
# max(20, 2 x the per-second rate of the 5 s before)), 429 rate_limit_error + retry-after 1;
# azure-responses: Azure's 10 s sub-windows (100 requests) with limit/remaining reported as -1
# and 429s without retry-after); and provider incidents: anthropic-529 (half of arrivals 529
# overloaded_error for 8 s), openai-incident (every request 500/502/503 for 6 s), lb-resets (a
# load balancer resetting and closing connections), anthropic-504 (504 timeout_error after
# 20 s), openai-overload-incident (overload 429s for 6 s), and permanent refusals: openai-quota
# (insufficient_quota), anthropic-spend (enforced_spend_limit_reached after 100), gemini-daily
# (the per-day quota after 200), anthropic-stream-error (an SSE error event mid-stream). Their
# guessed numbers can be changed with H1_<NAME> (upstream.py).
#
#   benches/worlds.sh                    # every world, N=500 clients fired at once
#   WORLDS="admission groq-daily" N=100 benches/worlds.sh
#
# Per world (benches/worlds/drive.py), two runs against a fresh upstream: the official openai
# SDK with its default retries straight at it ("sdk-alone"), and the same SDK with
# max_retries=0 through a fresh, unconfigured corral (`corral --upstream URL`). A third mode,
# "corral-retries" (the SDK's default max_retries=2 through a fresh corral: stacked retries),
# runs when asked (drive.py --modes sdk-alone,corral,corral-retries), and so does "fleet":
# the SDK (max_retries=0) through four corrals sharing one redis-server (started and stopped
# by drive.py; `REDIS_SERVER` or on the PATH), the clients spread over them in turn:
#   MODES=sdk-alone,corral,fleet benches/worlds.sh
# Each client's deadline is max(10 x the world's bound, 60 s), at most 120 s in the eight
# added worlds. The upstream counts its refusals by cause: "rate" (the bucket the sender emptied) and "other"
# (overload, admission, 5xx). Report: bench-out/worlds/results.md (per-run JSON and logs
# beside it).
#
# Needs python3 with venv; installs openai and aiohttp from PyPI into $VENV
# (bench-out/worlds/venv). Builds corral (cargo build --release) unless CORRAL_BIN is set.
# Everything listens on 127.0.0.1; each upstream and corral is stopped by its PID. About 40
# minutes for every world at N=500. The openai SDK itself takes about 1.5 s of the two cores
# for 500 clients (the `nolimit` world's makespan against its 0.2 s service time).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export OUT=${OUT:-$root/bench-out/worlds}
VENV=${VENV:-$OUT/venv}
N=${N:-500}
MODES=${MODES:-sdk-alone,corral}
WORLDS=${WORLDS:-"nolimit openai-quantized openai-overload two-models anthropic azure gemini together vllm admission groq-daily
    openai-tokens openai-stream staggered tier-up sglang bedrock anthropic-accel azure-responses
    anthropic-529 openai-incident lb-resets anthropic-504 openai-overload-incident openai-quota
    anthropic-spend gemini-daily anthropic-stream-error"}
mkdir -p "$OUT"
if [[ -z ${CORRAL_BIN:-} ]]; then
    (cd "$root" && cargo build --release --locked)
    export CORRAL_BIN=$root/target/release/corral
fi
if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet openai aiohttp
fi
# 450 s a mode (a world's run is its clients' deadline, at most 120 s, and 30 s more)
limit=$((450 * $(tr ',' '\n' <<< "$MODES" | wc -l)))
for w in $WORLDS; do
    timeout "$limit" "$VENV/bin/python" "$root/benches/worlds/drive.py" --world "$w" --n "$N" --modes "$MODES"
done
"$VENV/bin/python" "$root/benches/worlds/report.py" "$N" > /dev/null
echo "wrote $OUT/results.md"
