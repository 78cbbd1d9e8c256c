#!/usr/bin/env python3
"""Emulated LLM providers ("worlds") for judging a rate-limiting proxy.

Written from the providers' documented behaviour (the facts in the project brief's
PROVIDERS.md) by a helper that never read corral's source: worlds not built from the
mechanism they judge.
POST /v1/chat/completions  -> OpenAI chat.completion JSON (with usage) or a provider-style error
GET  /stats                -> counters for the current world run (429/5xx split rate vs other)
POST /stats/reset          -> zero counters AND reset all world state (buckets, windows, memory)
GET  /world?n=500          -> world description and its ideal makespan ("bound") for n tasks

Every answer carries x-harness-world and x-harness-req (unique id) so the driver can tell
answers produced by the upstream from answers a proxy produced itself.
"""
import argparse
import asyncio
import bisect
import copy
import datetime as dt
import json
import math
import os
import random
import socket
import struct
import time
import uuid

from aiohttp import web

WORLDS = ["openai-quantized", "openai-overload", "two-models", "anthropic", "azure", "gemini",
          "together", "vllm", "admission", "nolimit", "groq-daily",
          "openai-tokens", "openai-stream", "staggered", "tier-up", "sglang",
          "bedrock", "anthropic-accel", "azure-responses",
          "anthropic-529", "openai-incident", "lb-resets", "anthropic-504", "openai-quota",
          "anthropic-stream-error", "anthropic-spend", "gemini-daily", "openai-overload-incident"]

# default service time per world (seconds); overridable with --service
DEFAULT_SERVICE = {"vllm": 0.5, "openai-overload": 10.0, "openai-stream": 1.0, "sglang": 0.5,
                   "lb-resets": 0.5, "anthropic-stream-error": 1.0}

# openai-tokens: the key's per-minute limits (tokens bind long before requests)
TOK_TPM, TOK_RPM = 500_000, 5000
# openai-stream / staggered: reported per minute, enforced per second (quantized)
Q_RPM, Q_RPS = 1200, 20
# tier-up: (seconds after the first request, requests per second) -- limit raised at 10 s
TIER_SCHED = [(0.0, 10), (10.0, 40)]
# staggered: Poisson arrivals, mean rate per second
STAGGER_RATE = 50.0
# sglang: running slots and --max-queued-requests
SGL_RUNNING, SGL_QUEUE = 16, 48
# bedrock: token bucket per (account, model): burst, refill per second
BR_BURST, BR_RATE = 50, 20
# anthropic-accel: per-minute requests limit (reported, never binds for 500) and the acceleration
# rule (harness's choice; Anthropic documents the limits, not their formula): the requests admitted
# in the last ACCEL_WIN s may be at most max(ACCEL_FLOOR, ACCEL_GROWTH x the per-ACCEL_WIN rate over
# the ACCEL_PREV s before that)
ACCEL_RPM, ACCEL_FLOOR, ACCEL_GROWTH, ACCEL_WIN, ACCEL_PREV = 4000, 20, 2.0, 1.0, 5.0
# azure-responses: requests per 10 s sub-window (limit and remaining reported as -1)
AZR_SUB, AZR_WIN = 100, 10.0
# ---- incident / transport worlds (s46/h1). Every number below is the harness's guess; the
# behaviours they parameterise cite PROVIDERS.md in the handlers. Each can be overridden for a
# sensitivity run with an environment variable H1_<NAME> (read by upstream.py at start).


def _h1(name, default):
    return type(default)(os.environ.get("H1_" + name, default))


# anthropic-529: an API-wide overload incident from the run's first request for INC529_LEN s, during
# which INC529_SHARE of arrivals get 529 overloaded_error; healthy afterwards.
INC529_LEN, INC529_SHARE = _h1("INC529_LEN", 8.0), _h1("INC529_SHARE", 0.5)
# openai-incident: every request answered 500/502/503 for OUTAGE_LEN s from the first request.
OUTAGE_LEN = _h1("OUTAGE_LEN", 6.0)
# which 5xx the outage answers (comma list of 500, 502, 503; default all three, chosen at random)
OUTAGE_STATUSES = [int(x) for x in _h1("OUTAGE_STATUSES", "500,502,503").split(",")]
# lb-resets: a load balancer in front of the provider: LB_RESET of requests have their connection
# reset (RST) after U(0, service) without an answer; LB_CLOSE of answers carry `Connection: close`;
# idle keep-alive connections are dropped after LB_IDLE s.
LB_RESET, LB_CLOSE, LB_IDLE = _h1("LB_RESET", 0.10), _h1("LB_CLOSE", 0.20), _h1("LB_IDLE", 1.0)
# anthropic-504: T504_SHARE of requests wait T504_WAIT s and then get 504 timeout_error.
T504_SHARE, T504_WAIT = _h1("T504_SHARE", 0.10), _h1("T504_WAIT", 20.0)
# anthropic-stream-error: streamed answers; SERR_SHARE of streams get an SSE `error` event
# (overloaded_error) after SERR_AT of their chunks, on HTTP 200.
SERR_SHARE, SERR_AT = _h1("SERR_SHARE", 0.10), _h1("SERR_AT", 5)
# anthropic-spend: the spend limit is reached after SPEND_OK admitted requests; every later one 429s.
SPEND_OK = _h1("SPEND_OK", 100)
# gemini-daily: the project's requests-per-day quota has GD_LEFT requests left; then 429 per-day.
GD_LEFT = _h1("GD_LEFT", 200)
H1_WORLDS = ("anthropic-529", "openai-incident", "lb-resets", "anthropic-504", "openai-quota",
             "anthropic-stream-error", "anthropic-spend", "gemini-daily", "openai-overload-incident")
STREAM_CHUNKS = 20
FILLER = "the quick brown fox jumps over the lazy dog "


def task_request(world, i):
    """Request kwargs for task i (shared by drive.py and the bound). Worlds other than
    openai-tokens keep the original tiny request."""
    if world != "openai-tokens":
        return {"max_tokens": 16, "messages": [{"role": "user", "content": f"task {i}: say ok"}]}
    r = random.Random(1000 + i)
    ptoks, mx = r.randint(200, 2000), r.randint(100, 1000)
    text = f"task {i}: " + (FILLER * (ptoks * 4 // len(FILLER) + 1))[:ptoks * 4]
    return {"max_tokens": mx, "messages": [{"role": "user", "content": text}]}


def arrivals(world, n, seed=7):
    """Start offset (s) of each task: all at 0, except `staggered` (Poisson, STAGGER_RATE/s)."""
    if world != "staggered":
        return [0.0] * n
    r, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += r.expovariate(STAGGER_RATE)
    return out


def completion_tokens(prompt_t, max_t):
    """Tokens the model 'generates': 30-100 % of max_tokens, deterministic per request."""
    return max(1, int(max_t * (0.3 + 0.7 * ((prompt_t * 7919 + max_t) % 101) / 100)))


def go_duration(d: float) -> str:
    """Format seconds like Go's time.Duration.String() as OpenAI sends it: 12ms, 7.66s, 6m0s, 1h2m3.5s."""
    if d <= 0:
        return "0s"
    if d < 1:
        ms = d * 1000
        return f"{ms:.0f}ms" if ms >= 1 else f"{d*1e6:.0f}µs"

    def fmt_s(s):
        s = round(s, 3)
        t = f"{s:.3f}".rstrip("0").rstrip(".")
        return t + "s"
    if d < 60:
        return fmt_s(d)
    h, rem = divmod(d, 3600)
    m, s = divmod(rem, 60)
    if h >= 1:
        return f"{int(h)}h{int(m)}m{fmt_s(s)}"
    return f"{int(m)}m{fmt_s(s)}"


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Bucket:
    """Token bucket: capacity `cap`, refill `rate` per second."""

    def __init__(self, cap, rate):
        self.cap, self.rate = float(cap), float(rate)
        self.level, self.t = float(cap), time.monotonic()

    def _refill(self):
        now = time.monotonic()
        self.level = min(self.cap, self.level + (now - self.t) * self.rate)
        self.t = now

    def take(self, n=1.0) -> bool:
        self._refill()
        if self.level >= n:
            self.level -= n
            return True
        return False

    def force(self, n=1.0):  # charge without refusing (report-only buckets)
        self._refill()
        self.level = max(0.0, self.level - n)

    def wait(self, n=1.0) -> float:
        self._refill()
        return max(0.0, (n - self.level) / self.rate)

    def remaining(self) -> int:
        self._refill()
        return int(self.level)

    def to_full(self) -> float:
        self._refill()
        return (self.cap - self.level) / self.rate

    def give(self, n):  # refund (settling an over-charge)
        self._refill()
        self.level = min(self.cap, self.level + n)


class ScheduledBucket(Bucket):
    """Token bucket whose limit changes at set times: sched = [(t after origin, cap, rate)], the
    first at 0. A raise adds the new headroom to the level (remaining = new limit - used)."""

    def __init__(self, sched, origin, clock=time.monotonic):
        super().__init__(sched[0][1], sched[0][2])
        self.sched, self.origin, self.clock, self.idx = sched, origin, clock, 0
        self.t = origin

    def _fill(self, until):
        self.level = min(self.cap, self.level + max(0.0, until - self.t) * self.rate)
        self.t = max(self.t, until)

    def next_switch(self):
        if self.idx + 1 < len(self.sched):
            return self.origin + self.sched[self.idx + 1][0]
        return math.inf

    def advance(self, now):
        while self.next_switch() <= now:
            self._fill(self.next_switch())
            _, cap, rate = self.sched[self.idx + 1]
            self.level += cap - self.cap
            self.cap, self.rate, self.idx = float(cap), float(rate), self.idx + 1
        self._fill(now)

    def _refill(self):
        self.advance(self.clock())

    def wait(self, n=1.0) -> float:
        """Exact time until `n` is available, across limit changes."""
        now = self.clock()
        self.advance(now)
        b, t = copy.copy(self), now
        while b.level < n - 1e-9:
            t_need = t + (n - b.level) / b.rate
            t = min(t_need, b.next_switch())
            b.advance(t)
            if t == t_need:
                break
        return t - now


def ideal_finish(arrival_times, sched, service):
    """Ideal makespan through one bucket: each task admitted at the earliest instant the bucket
    allows, in arrival order, no wasted attempts."""
    vt = [0.0]
    b = ScheduledBucket(sched, 0.0, clock=lambda: vt[0])
    last = 0.0
    for a in sorted(arrival_times):
        vt[0] = max(a, last)
        vt[0] += b.wait(1.0)
        b.force(1.0)
        last = vt[0]
    return last + service


def accel_room(times, now):
    """anthropic-accel: how many more requests the acceleration rule admits at `now`, given the
    sorted admission times (older than ACCEL_WIN + ACCEL_PREV may be pruned)."""
    i_recent = bisect.bisect_right(times, now - ACCEL_WIN)   # times > now - WIN: the last second
    i_prev = bisect.bisect_right(times, now - ACCEL_WIN - ACCEL_PREV)
    recent, prev = len(times) - i_recent, i_recent - i_prev
    allow = max(ACCEL_FLOOR, ACCEL_GROWTH * prev * ACCEL_WIN / ACCEL_PREV)
    return int(math.floor(allow + 1e-9)) - recent


def accel_wait(times, now):
    """Time from `now` until the rule admits one more, if nothing else is admitted meanwhile: the
    count only changes when an admission leaves the last second or the 5 s before it."""
    if accel_room(times, now) >= 1:
        return 0.0
    for t in sorted({x + d for x in times for d in (ACCEL_WIN, ACCEL_WIN + ACCEL_PREV)}):
        if t > now and accel_room(times, t + 1e-9) >= 1:
            return t + 1e-9 - now
    return ACCEL_WIN


def accel_schedule(n):
    """The fastest schedule for n tasks ready at 0: each admitted at the earliest instant the rule
    allows (greedy, in order). Returns the admission times."""
    times, t = [], 0.0
    while len(times) < n:
        room = accel_room(times, t)
        if room >= 1:
            times.extend([t] * min(room, n - len(times)))
            continue
        t += accel_wait(times, t)
    return times


NEW_BOUNDS = ("openai-tokens", "openai-stream", "staggered", "tier-up", "sglang",
              "bedrock", "anthropic-accel", "azure-responses",
              "anthropic-529", "openai-incident", "lb-resets", "anthropic-504", "openai-quota",
              "anthropic-stream-error", "anthropic-spend", "gemini-daily", "openai-overload-incident")


def est_tokens(body):
    msgs = body.get("messages") or []
    chars = sum(len(str(m.get("content", ""))) for m in msgs if isinstance(m, dict))
    prompt = max(1, chars // 4) + 4 * len(msgs)
    mx = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    return prompt, int(mx)


class World:
    def __init__(self, name, service, seed):
        self.name, self.service, self.seed = name, service, seed
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self):
        self.rng = random.Random(self.seed)
        self.t0 = None  # first request after reset
        self.stats = {"requests": 0, "ok": 0, "rate": 0, "other": 0, "by_status": {},
                      "by_cause": {}, "per_second": {}, "arrivals_per_second": {}, "by_model": {}, "inflight_max": 0}
        self.inflight = 0
        n = self.name
        self.buckets = {}
        if n == "openai-quantized":
            # headers say 1200/min; enforcement is 20/s with capacity 20
            self.enf = lambda key: self._bk(("enf",) + key, 20, 20)
            self.minute = lambda key: self._bk(("min",) + key, 1200, 20)
            self.tok = lambda key: self._bk(("tok",) + key, 2_000_000, 2_000_000 / 60)
        elif n == "openai-overload":
            self.minute = lambda key: self._bk(("min",) + key, 10000, 10000 / 60)
            self.tok = lambda key: self._bk(("tok",) + key, 2_000_000, 2_000_000 / 60)
        elif n == "two-models":
            # per (key, model) buckets, headers honest per-second window
            self.model_rate = {"fast": 50, "slow": 10}
        elif n == "anthropic":
            self.enf = lambda key: self._bk(("enf",) + key, 25, 25)
            self.minute = lambda key: self._bk(("min",) + key, 1500, 25)
            self.itok = lambda key: self._bk(("itok",) + key, 400_000, 400_000 / 60)
            self.otok = lambda key: self._bk(("otok",) + key, 80_000, 80_000 / 60)
        elif n == "azure":
            self.rpm = 1200
            self.sub = self.rpm // 6  # per 10 s sub-window
            self.win_counts = {}
            self.tok = lambda key: self._bk(("tok",) + key, 1_000_000, 1_000_000 / 60)
        elif n in ("gemini", "together"):
            self.enf = lambda key: self._bk(("enf",) + key, 20, 20)
        elif n == "vllm":
            self.slots = asyncio.Semaphore(16)
        elif n == "admission":
            self.seen = {}
        elif n == "groq-daily":
            # requests counted per day (report only, huge), enforced 20/s; tokens per minute reported
            self.day = lambda key: self._bk(("day",) + key, 14400, 14400 / 86400)
            self.enf = lambda key: self._bk(("enf",) + key, 20, 20)
            self.tok = lambda key: self._bk(("tok",) + key, 600_000, 600_000 / 60)
        self.reset_new_worlds()

    def reset_new_worlds(self):
        n = self.name
        if n == "openai-tokens":
            # PROVIDERS.md: "OpenAI and Azure charge `max_tokens` at admission and settle later; the
            # final answer carries `usage` ... and `x-ratelimit-remaining-tokens` on the next answer
            # shows what was really charged." Honest per-minute buckets: capacity = the limit.
            self.minute = lambda key: self._bk(("min",) + key, TOK_RPM, TOK_RPM / 60)
            self.tok = lambda key: self._bk(("tok",) + key, TOK_TPM, TOK_TPM / 60)
        elif n in ("openai-stream", "staggered"):
            # PROVIDERS.md: "limits may be quantized, e.g. 60,000 requests/minute enforced as 1,000
            # requests/second": 1200/min reported, 20/s (capacity 20) enforced.
            self.enf = lambda key: self._bk(("enf",) + key, Q_RPS, Q_RPS)
            self.minute = lambda key: self._bk(("min",) + key, Q_RPM, Q_RPS)
            self.tok = lambda key: self._bk(("tok",) + key, 2_000_000, 2_000_000 / 60)
            self.stats["stream_aborted"] = 0
        elif n == "tier-up":
            # the same quantized key, its limit raised 10/s -> 40/s (600 -> 2400/min) 10 s in;
            # headers report whichever limit is in force
            self.enf = lambda key: self._sbk(("enf",) + key, [(t, r, r) for t, r in TIER_SCHED])
            self.minute = lambda key: self._sbk(("min",) + key, [(t, 60 * r, r) for t, r in TIER_SCHED])
            self.tok = lambda key: self._bk(("tok",) + key, 2_000_000, 2_000_000 / 60)
        elif n == "sglang":
            # PROVIDERS.md: "SGLang with `--max-queued-requests` answers 503 when its queue is full."
            self.slots = asyncio.Semaphore(SGL_RUNNING)
            self.in_server = 0
        elif n == "bedrock":
            # PROVIDERS.md l.76: "AWS Bedrock answers `ThrottlingException` (429) without saying
            # which quota." A token bucket per (account, model), BR_BURST deep, BR_RATE/s.
            self.enf = lambda key: self._bk(("enf",) + key, BR_BURST, BR_RATE)
        elif n == "anthropic-accel":
            # PROVIDERS.md l.20-21 / l.41: Anthropic adds "acceleration limits" on sharp ramps,
            # answered 429 `rate_limit_error`. Generous minute (ACCEL_RPM, never binds for 500),
            # admissions per (key, family) kept for the acceleration rule (accel_room).
            self.minute = lambda key: self._bk(("min",) + key, ACCEL_RPM, ACCEL_RPM / 60)
            self.itok = lambda key: self._bk(("itok",) + key, 400_000, 400_000 / 60)
            self.otok = lambda key: self._bk(("otok",) + key, 80_000, 80_000 / 60)
            self.admitted = {}
        elif n == "azure-responses":
            # PROVIDERS.md l.52-54: "-1 in limit/remaining means unknown (seen on the Responses
            # API, with no retry-after)"; "RPM is enforced over 1 s or 10 s sub-windows".
            self.win_counts = {}
        elif n == "lb-resets":
            self.stats["lb_reset"] = 0
            self.stats["lb_conn_close"] = 0
        elif n == "openai-overload-incident":
            self.minute = lambda key: self._bk(("min",) + key, 10000, 10000 / 60)
            self.tok = lambda key: self._bk(("tok",) + key, 2_000_000, 2_000_000 / 60)
        elif n in ("anthropic-spend", "gemini-daily"):
            self.admitted_n = 0
        elif n == "anthropic-stream-error":
            self.stats["stream_aborted"] = 0
            self.stats["sse_error_sent"] = 0

    def _bk(self, k, cap, rate):
        b = self.buckets.get(k)
        if b is None:
            b = self.buckets[k] = Bucket(cap, rate)
        return b

    def _sbk(self, k, sched):  # limit schedule counted from the run's first request
        b = self.buckets.get(k)
        if b is None:
            b = self.buckets[k] = ScheduledBucket(sched, self.t0)
        return b

    def bound(self, n):
        """Ideal makespan for n tasks all started at t=0 (perfect knowledge, no wasted attempts)."""
        s = self.service
        w = self.name
        if w in NEW_BOUNDS:
            return getattr(self, "bound_" + w.replace("-", "_"))(n)
        if w == "openai-quantized" or w == "gemini" or w == "together" or w == "groq-daily":
            return {"total": max(0, n - 20) / 20 + s}
        if w == "anthropic":
            return {"total": max(0, n - 25) / 25 + s}
        if w == "openai-overload" or w == "nolimit":
            return {"total": s}
        if w == "two-models":
            nf, ns = (n + 1) // 2, n // 2
            f = max(0, nf - 50) / 50 + s
            sl = max(0, ns - 10) / 10 + s
            return {"total": max(f, sl), "fast": f, "slow": sl}
        if w == "azure":
            windows = math.ceil(n / self.sub)
            return {"total": (windows - 1) * 10 + s}
        if w == "vllm":
            return {"total": math.ceil(n / 16) * s}
        if w == "admission":
            return {"total": 2 * 1 + s}
        return {"total": s}

    def bound_openai_tokens(self, n):
        """Token bucket: what the tasks really use (prompt + generated, after settling) beyond the
        minute's capacity, at TPM/60 per second. A lower bound: admission also needs max_tokens
        headroom. `if_unsettled`: the same if max_tokens were never refunded."""
        used = charged = 0
        for i in range(n):
            pt, mt = est_tokens(task_request(self.name, i))
            used += pt + completion_tokens(pt, mt)
            charged += pt + mt
        rate = TOK_TPM / 60
        return {"total": max(0, used - TOK_TPM) / rate + self.service,
                "if_unsettled": max(0, charged - TOK_TPM) / rate + self.service}

    def bound_openai_stream(self, n):
        return {"total": ideal_finish([0.0] * n, [(0.0, Q_RPS, Q_RPS)], self.service)}

    def bound_staggered(self, n):
        arr = arrivals(self.name, n)
        return {"total": ideal_finish(arr, [(0.0, Q_RPS, Q_RPS)], self.service),
                "last_arrival": arr[-1]}

    def bound_tier_up(self, n):
        return {"total": ideal_finish([0.0] * n, [(t, r, r) for t, r in TIER_SCHED], self.service)}

    def bound_sglang(self, n):
        return {"total": math.ceil(n / SGL_RUNNING) * self.service}

    def bound_bedrock(self, n):
        return {"total": ideal_finish([0.0] * n, [(0.0, BR_BURST, BR_RATE)], self.service)}

    def bound_anthropic_accel(self, n):
        return {"total": accel_schedule(n)[-1] + self.service} if n else {"total": self.service}

    def bound_azure_responses(self, n):
        return {"total": (math.ceil(n / AZR_SUB) - 1) * AZR_WIN + self.service}

    # Incident worlds. As for openai-overload (random refusals, bound = service), a refusal that is
    # a coin flip per arrival costs nothing to an ideal client that retries at once: bound = service.
    def bound_anthropic_529(self, n):
        return {"total": self.service, "incident_s": INC529_LEN, "share": INC529_SHARE}

    def bound_openai_incident(self, n):
        # nothing can succeed before the outage ends
        return {"total": OUTAGE_LEN + self.service}

    def bound_lb_resets(self, n):
        # lower bound (as openai-overload): ignores the time lost to resets, which are random
        return {"total": self.service}

    def bound_anthropic_504(self, n):
        # with T504_SHARE of 500 first attempts timing out, some task waits T504_WAIT before it can
        # even learn it must retry (no hedging): T504_WAIT + service
        return {"total": (T504_WAIT if n * T504_SHARE >= 1 else 0.0) + self.service}

    def bound_openai_quota(self, n):
        # permanent: the best answer is the 429 itself, at once
        return {"total": 0.0}

    def bound_openai_overload_incident(self, n):
        return {"total": OUTAGE_LEN + self.service}

    def bound_anthropic_spend(self, n):
        # the first SPEND_OK succeed after the service time; the rest are best refused at once
        return {"total": self.service if n else 0.0, "can_succeed": min(n, SPEND_OK)}

    def bound_gemini_daily(self, n):
        return {"total": self.service if n else 0.0, "can_succeed": min(n, GD_LEFT)}

    def bound_anthropic_stream_error(self, n):
        # a stream broken by an error event can be restarted at once: SERR_AT chunks + a full stream
        return {"total": self.service * (1 + SERR_AT / STREAM_CHUNKS)}

    # ------------------------------------------------------------------ helpers
    def count(self, status, cause=None, model=None):
        st = self.stats
        st["by_status"][str(status)] = st["by_status"].get(str(status), 0) + 1
        sec = str(int(time.monotonic() - self.t0))
        ps = st["per_second"].setdefault(sec, {})
        key = "200" if status == 200 else f"{status}:{cause}"
        ps[key] = ps.get(key, 0) + 1
        # a finer timeline, answers per 100 ms (every world since stop 49)
        k100 = f"{int((time.monotonic() - self.t0) * 10) / 10:.1f}"
        p100 = st.setdefault("per_100ms", {}).setdefault(k100, {})
        p100[key] = p100.get(key, 0) + 1
        if model:
            bm = st["by_model"].setdefault(model, {})
            bm[key] = bm.get(key, 0) + 1
        if status == 200:
            st["ok"] += 1
            st.setdefault("first_ok_t", round(time.monotonic() - self.t0, 3))
        elif cause == "rate" and len(st.setdefault("rate_times", [])) < 5000:
            st["rate_times"].append(round(time.monotonic() - self.t0, 3))  # when each rate 429 left
        if status != 200:
            st[cause] += 1
            ck = f"{status}:{cause}"
            st["by_cause"][ck] = st["by_cause"].get(ck, 0) + 1

    def base_headers(self):
        return {"x-harness-world": self.name, "x-harness-req": uuid.uuid4().hex[:16]}

    def completion(self, body, prompt_t, max_t):
        model = body.get("model", "gpt-test")
        ctoks = min(max_t, 8)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:24],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * ctoks},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_t, "completion_tokens": ctoks,
                      "total_tokens": prompt_t + ctoks},
            "system_fingerprint": "fp_harness",
        }

    # ------------------------------------------------------------------ handler
    async def handle(self, request: web.Request):
        now_m = time.monotonic()
        if self.t0 is None:
            self.t0 = now_m
        self.stats["requests"] += 1
        asec = str(int(now_m - self.t0))
        aps = self.stats["arrivals_per_second"]
        aps[asec] = aps.get(asec, 0) + 1
        if self.name in H1_WORLDS:  # arrivals per 100 ms for the incident worlds
            a100 = self.stats.setdefault("arrivals_per_100ms", {})
            k100 = f"{int((now_m - self.t0) * 10) / 10:.1f}"
            a100[k100] = a100.get(k100, 0) + 1
        try:
            body = await request.json()
        except Exception:
            body = {}
        auth = request.headers.get("authorization", "")
        rc = request.headers.get("x-stainless-retry-count", "absent")  # client retries seen here
        crc = self.stats.setdefault("client_retry_hdr", {})
        crc[rc] = crc.get(rc, 0) + 1
        model = body.get("model", "gpt-test")
        key = (auth,)
        prompt_t, max_t = est_tokens(body)
        h = self.base_headers()
        w = self.name
        self.inflight += 1
        self.stats["inflight_max"] = max(self.stats["inflight_max"], self.inflight)
        try:
            fn = getattr(self, "w_" + w.replace("-", "_"))
            return await fn(request, body, key, model, prompt_t, max_t, h)
        finally:
            self.inflight -= 1

    async def serve_ok(self, body, prompt_t, max_t, h, model=None, service=None):
        await asyncio.sleep(self.service if service is None else service)
        self.count(200, model=model)
        return web.json_response(self.completion(body, prompt_t, max_t), headers=h)

    def err(self, status, payload, h, cause, model=None):
        self.count(status, cause, model)
        if status != 200:  # the headers of the first and last refusal of each cause, for the report
            self.stats.setdefault(f"hdr_first_{cause}", dict(h))
            self.stats[f"hdr_last_{cause}"] = dict(h)
        return web.Response(status=status, text=json.dumps(payload), headers=h,
                            content_type="application/json")

    # --- OpenAI: headers report per-minute, enforcement per-second (quantized)
    def openai_headers(self, h, minute, tok):
        h["x-ratelimit-limit-requests"] = str(int(minute.cap))
        h["x-ratelimit-remaining-requests"] = str(minute.remaining())
        h["x-ratelimit-reset-requests"] = go_duration(minute.to_full())
        h["x-ratelimit-limit-tokens"] = str(int(tok.cap))
        h["x-ratelimit-remaining-tokens"] = str(tok.remaining())
        h["x-ratelimit-reset-tokens"] = go_duration(tok.to_full())

    async def w_openai_quantized(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        enf, minute, tok = self.enf(key), self.minute(key), self.tok(key)
        if not enf.take():
            wait = enf.wait()
            self.openai_headers(h, minute, tok)
            h["retry-after-ms"] = str(max(1, round(wait * 1000)))
            h["retry-after"] = str(max(1, math.ceil(wait)))
            return self.err(429, {"error": {
                "message": (f"Rate limit reached for {model} in organization org-harness on requests per min (RPM): "
                            f"Limit {int(minute.cap)}, Used {int(minute.cap) - minute.remaining()}, Requested 1. "
                            f"Please try again in {go_duration(wait)}. Visit https://platform.openai.com/account/rate-limits to learn more."),
                "type": "requests", "param": None, "code": "rate_limit_exceeded"}}, h, "rate")
        minute.force(1)
        tok.force(pt + mt)
        self.openai_headers(h, minute, tok)
        return await self.serve_ok(body, pt, mt, h)

    async def w_openai_overload(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        minute, tok = self.minute(key), self.tok(key)
        if self.rng.random() < 0.20:
            return self.overloaded_429(h, minute, tok)
        return await self.openai_ok(body, pt, mt, h, minute, tok)

    def overloaded_429(self, h, minute, tok):
        """OpenAI's overload 429: healthy headers, no hint, the engine's words."""
        self.openai_headers(h, minute, tok)
        return self.err(429, {"error": {
            "message": "The engine is currently overloaded, please try again later",
            "type": "server_error", "param": None, "code": None}}, h, "other")

    async def openai_ok(self, body, pt, mt, h, minute, tok):
        """An answer charged to the per-minute request and token counts, with their headers."""
        minute.force(1)
        tok.force(pt + mt)
        self.openai_headers(h, minute, tok)
        return await self.serve_ok(body, pt, mt, h)

    async def w_two_models(self, req, body, key, model, pt, mt, h):
        m = model if model in self.model_rate else "slow"
        r = self.model_rate[m]
        b = self._bk(("enf",) + key + (m,), r, r)
        ok = b.take()
        # honest headers over a 1 s window (like proxies/providers using other windows)
        h["x-ratelimit-limit-requests"] = str(r)
        h["x-ratelimit-remaining-requests"] = str(b.remaining())
        h["x-ratelimit-reset-requests"] = go_duration(b.to_full())
        if not ok:
            wait = b.wait()
            h["retry-after-ms"] = str(max(1, round(wait * 1000)))
            h["retry-after"] = str(max(1, math.ceil(wait)))
            return self.err(429, {"error": {
                "message": f"Rate limit reached for {m} in organization org-harness on requests per sec: Limit {r}, Used {r}, Requested 1. Please try again in {go_duration(wait)}.",
                "type": "requests", "param": None, "code": "rate_limit_exceeded"}}, h, "rate", model=m)
        return await self.serve_ok(body, pt, mt, h, model=m)

    # --- Anthropic (OpenAI-compatible endpoint, Anthropic headers and error shapes)
    def anthropic_headers(self, h, key, minute):
        now = time.time()
        h["anthropic-ratelimit-requests-limit"] = str(int(minute.cap))
        h["anthropic-ratelimit-requests-remaining"] = str(minute.remaining())
        h["anthropic-ratelimit-requests-reset"] = rfc3339(now + minute.to_full())
        for nm, b in (("input-tokens", self.itok(key)), ("output-tokens", self.otok(key))):
            h[f"anthropic-ratelimit-{nm}-limit"] = str(int(b.cap))
            h[f"anthropic-ratelimit-{nm}-remaining"] = str(b.remaining())
            h[f"anthropic-ratelimit-{nm}-reset"] = rfc3339(now + b.to_full())
        it, ot = self.itok(key), self.otok(key)
        h["anthropic-ratelimit-tokens-limit"] = str(int(it.cap + ot.cap))
        h["anthropic-ratelimit-tokens-remaining"] = str(it.remaining() + ot.remaining())
        h["anthropic-ratelimit-tokens-reset"] = rfc3339(now + max(it.to_full(), ot.to_full()))
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]

    async def w_anthropic(self, req, body, key, model, pt, mt, h):
        key = key + ("family",)
        enf, minute = self.enf(key), self.minute(key)
        if self.rng.random() < 0.05:
            h["request-id"] = "req_" + uuid.uuid4().hex[:20]
            return self.err(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                            h, "other")
        if not enf.take():
            wait = enf.wait()
            self.anthropic_headers(h, key, minute)
            h["retry-after"] = str(max(1, math.ceil(wait)))
            return self.err(429, {"type": "error", "error": {
                "type": "rate_limit_error",
                "message": ("This request would exceed the rate limit for your organization of "
                            f"{int(minute.cap)} requests per minute. For details, refer to: https://docs.anthropic.com/en/api/rate-limits.")}},
                h, "rate")
        return await self.anthropic_ok(body, key, pt, mt, h, minute)

    async def anthropic_ok(self, body, key, pt, mt, h, minute):
        """An answer charged to the minute's requests and the input and output token counts,
        with Anthropic's headers."""
        minute.force(1)
        self.itok(key).force(pt)
        self.otok(key).force(mt)
        self.anthropic_headers(h, key, minute)
        return await self.serve_ok(body, pt, mt, h)

    # --- Azure OpenAI: RPM enforced over 10 s sub-windows
    async def w_azure(self, req, body, key, model, pt, mt, h):
        el = time.monotonic() - self.t0
        win = int(el // 10)
        minute_win = int(el // 60)
        k = key + (model,)
        tok = self.tok(k)
        used = self.win_counts.get(k + (win,), 0)
        used_min = sum(v for kk, v in self.win_counts.items()
                       if kk[:-1] == k and kk[-1] // 6 == minute_win)
        if used >= self.sub:
            wait = (win + 1) * 10 - el
            h["x-ratelimit-remaining-requests"] = str(max(0, self.rpm - used_min))
            h["x-ratelimit-remaining-tokens"] = str(tok.remaining())
            h["x-ratelimit-reset-tokens"] = str(math.ceil(tok.to_full()))
            h["retry-after-ms"] = str(max(1, round(wait * 1000)))
            h["x-ms-retry-after-ms"] = h["retry-after-ms"]
            h["retry-after"] = str(max(1, math.ceil(wait)))
            h["apim-request-id"] = str(uuid.uuid4())
            return self.err(429, {"error": {
                "code": "429",
                "message": (f"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 "
                            f"have exceeded call rate limit of your current OpenAI S0 pricing tier. "
                            f"Please retry after {max(1, math.ceil(wait))} seconds. Please go here: https://aka.ms/oai/quotaincrease "
                            f"if you would like to further increase the default rate limit.")}}, h, "rate")
        self.win_counts[k + (win,)] = used + 1
        tok.force(pt + mt)  # TPM charged at admission: prompt + max_tokens
        h["x-ratelimit-remaining-requests"] = str(max(0, self.rpm - used_min - 1))
        h["x-ratelimit-remaining-tokens"] = str(tok.remaining())
        h["x-ratelimit-reset-tokens"] = str(math.ceil(tok.to_full()))
        h["apim-request-id"] = str(uuid.uuid4())
        return await self.serve_ok(body, pt, mt, h)

    # --- Gemini OpenAI-compatible endpoint: hints only in the body (JSON array)
    async def w_gemini(self, req, body, key, model, pt, mt, h):
        enf = self.enf(("project", model))  # per project and model, not per key
        if not enf.take():
            wait = enf.wait()
            delay = f"{max(0.001, wait):.3f}".rstrip("0").rstrip(".") + "s"
            payload = [{"error": {
                "code": 429,
                "message": "Resource has been exhausted (e.g. check quota).",
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                     "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                                     "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                                     "quotaDimensions": {"location": "global", "model": model},
                                     "quotaValue": "1200"}]},
                    {"@type": "type.googleapis.com/google.rpc.Help",
                     "links": [{"description": "Learn more about Gemini API quotas",
                                "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
                ]}}]
            return self.err(429, payload, h, "rate")
        return await self.serve_ok(body, pt, mt, h)

    # --- Together: 503 regardless of rate (5%), 429 only above rate
    async def w_together(self, req, body, key, model, pt, mt, h):
        enf = self.enf(key)
        if self.rng.random() < 0.05:
            return self.err(503, {"error": {"message": "The server is overloaded or not ready yet.",
                                            "type": "service_unavailable", "param": None, "code": None}}, h, "other")
        ok = enf.take()
        h["x-ratelimit-limit"] = str(int(enf.cap))
        h["x-ratelimit-remaining"] = str(enf.remaining())
        h["x-ratelimit-reset"] = str(max(1, math.ceil(enf.to_full())))
        if not ok:
            h["retry-after"] = str(max(1, math.ceil(enf.wait())))
            return self.err(429, {"error": {"message": "You have been rate limited. Please retry later.",
                                            "type": "rate_limit", "param": None, "code": "rate_limit_exceeded"}},
                            h, "rate")
        return await self.serve_ok(body, pt, mt, h)

    # --- vLLM: never 429, no headers, 16 slots + unbounded FIFO queue
    async def w_vllm(self, req, body, key, model, pt, mt, h):
        async with self.slots:
            return await self.serve_ok(body, pt, mt, h)

    # --- admission-control gateway: refuse each request's first 2 attempts
    async def w_admission(self, req, body, key, model, pt, mt, h):
        msgs = body.get("messages") or []
        ident = json.dumps(msgs, sort_keys=True)
        n = self.seen.get(ident, 0)
        self.seen[ident] = n + 1
        if n < 2:
            h["retry-after"] = "1"
            return self.err(429, {"error": {"message": "Server busy: admission queue full, retry later.",
                                            "type": "server_busy", "param": None, "code": "queue_full"}}, h, "other")
        return await self.serve_ok(body, pt, mt, h)

    # --- no limits at all: measures harness/server overhead
    async def w_nolimit(self, req, body, key, model, pt, mt, h):
        return await self.serve_ok(body, pt, mt, h)

    # --- Groq-like: -requests headers count per DAY, tokens per minute; enforced 20/s
    async def w_groq_daily(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        day, enf, tok = self.day(key), self.enf(key), self.tok(key)
        ok = enf.take()
        if ok:
            day.force(1)
            tok.force(pt + mt)
        self.openai_headers(h, day, tok)  # requests counted per day
        if not ok:
            wait = enf.wait()
            h["retry-after"] = str(max(1, math.ceil(wait)))
            return self.err(429, {"error": {
                "message": f"Rate limit reached for model `{model}` in organization `org_harness` service tier `on_demand` on requests per second (RPS): Limit 20, Used 20, Requested 1. Please try again in {go_duration(wait)}.",
                "type": "requests", "code": "rate_limit_exceeded"}}, h, "rate")
        return await self.serve_ok(body, pt, mt, h)

    # ------------------------------------------------------------------ added worlds
    def openai_429(self, h, model, minute, tok, wait, kind, used, limit, asked):
        """OpenAI's 429: per-minute headers, retry-after-ms and retry-after, rate_limit_exceeded."""
        self.openai_headers(h, minute, tok)
        h["retry-after-ms"] = str(max(1, round(wait * 1000)))
        h["retry-after"] = str(max(1, math.ceil(wait)))
        unit = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}[kind]
        return self.err(429, {"error": {
            "message": (f"Rate limit reached for {model} in organization org-harness on {unit}: "
                        f"Limit {limit}, Used {used}, Requested {asked}. Please try again in {go_duration(wait)}. "
                        "Visit https://platform.openai.com/account/rate-limits to learn more."),
            "type": kind, "param": None, "code": "rate_limit_exceeded"}}, h, "rate")

    def quantized_gate(self, h, key, model):
        """Admit one request through a quantized key (enf per second, minute reported) or 429."""
        enf, minute, tok = self.enf(key), self.minute(key), self.tok(key)
        if enf.take():
            return None
        used = int(minute.cap) - minute.remaining()
        return self.openai_429(h, model, minute, tok, enf.wait(), "requests", used, int(minute.cap), 1)

    # --- OpenAI key where tokens per minute bind: prompt + max_tokens charged at admission,
    #     the unused part of max_tokens refunded when the answer is complete
    async def w_openai_tokens(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        minute, tok = self.minute(key), self.tok(key)
        if not tok.take(pt + mt):
            used = int(tok.cap) - tok.remaining()
            return self.openai_429(h, model, minute, tok, tok.wait(pt + mt), "tokens", used, int(tok.cap), pt + mt)
        minute.force(1)
        self.openai_headers(h, minute, tok)
        await asyncio.sleep(self.service)
        ct = completion_tokens(pt, mt)
        tok.give(mt - ct)
        self.count(200)
        return web.json_response(self.completion_usage(body, pt, ct), headers=h)

    def completion_usage(self, body, pt, ct):
        c = self.completion(body, pt, ct)
        c["choices"][0]["message"]["content"] = "ok " * ct
        c["usage"] = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
        return c

    def quantized_admit(self, h, key, model, pt, mt):
        """The quantized key's gate; on admission its per-minute buckets charged and reported in h."""
        refused = self.quantized_gate(h, key, model)
        if refused is None:
            self.minute(key).force(1)
            self.tok(key).force(pt + mt)
            self.openai_headers(h, self.minute(key), self.tok(key))
        return refused

    # --- quantized OpenAI key, answers streamed as SSE chunks over the service time
    async def w_openai_stream(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        refused = self.quantized_admit(h, key, model, pt, mt)
        if refused is not None:
            return refused
        h["content-type"] = "text/event-stream; charset=utf-8"
        resp = web.StreamResponse(status=200, headers=h)
        try:
            await resp.prepare(req)
            await self.stream_chunks(resp, model, pt, min(mt, STREAM_CHUNKS))
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["stream_aborted"] += 1
            raise
        self.count(200)
        return resp

    async def stream_chunks(self, resp, model, pt, ct):
        cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())

        def chunk(choices, usage=None):
            return ("data: " + json.dumps({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": "fp_harness", "choices": choices, "usage": usage}) + "\n\n").encode()
        for k in range(STREAM_CHUNKS):
            await asyncio.sleep(self.service / STREAM_CHUNKS)
            delta = {"role": "assistant", "content": ""} if k == 0 else {"content": "ok "}
            fin = "stop" if k == STREAM_CHUNKS - 1 else None
            await resp.write(chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}]))
        # stream_options.include_usage: a last chunk with empty choices and the usage
        await resp.write(chunk([], {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}))
        await resp.write(b"data: [DONE]\n\n")

    # --- the quantized key, clients arriving as a Poisson stream (drive.py staggers them)
    async def w_staggered(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        refused = self.quantized_admit(h, key, model, pt, mt)
        if refused is not None:
            return refused
        return await self.serve_ok(body, pt, mt, h)

    # --- limit raised mid-run (same gate, scheduled buckets)
    async def w_tier_up(self, req, body, key, model, pt, mt, h):
        return await self.w_staggered(req, body, key, model, pt, mt, h)

    # --- AWS Bedrock (OpenAI-compatible chat completions): a token bucket per model.
    #     PROVIDERS.md l.76: "AWS Bedrock answers `ThrottlingException` (429) without saying which
    #     quota"; l.24: "Headers can be missing altogether". So: no retry-after, no x-ratelimit-*
    #     on any answer; the 429 is Bedrock's ThrottlingException shape.
    async def w_bedrock(self, req, body, key, model, pt, mt, h):
        enf = self.enf(key + (model,))
        h["x-amzn-requestid"] = str(uuid.uuid4())
        if not enf.take():
            h["x-amzn-errortype"] = "ThrottlingException"
            return self.err(429, {"message": "Too many requests, please wait before trying again."}, h, "rate")
        return await self.serve_ok(body, pt, mt, h)

    # --- Anthropic acceleration limit. PROVIDERS.md l.20-22: "Anthropic adds 'acceleration limits'
    #     on sharp ramps ... The 429 is the truth; the headers are a hint"; l.32-41: requests
    #     headers with RFC 3339 resets, retry-after on 429, 429 `rate_limit_error` (also
    #     acceleration limits). The minute (ACCEL_RPM) has plenty of room throughout; the rule
    #     (harness's choice): the requests admitted in the last 1 s may be at most
    #     max(20, 2 x the per-second rate over the 5 s before it). Above that: 429
    #     rate_limit_error, retry-after = the whole seconds until the rule admits one more (1 s),
    #     remaining still large.
    async def w_anthropic_accel(self, req, body, key, model, pt, mt, h):
        key = key + ("family",)
        minute = self.minute(key)
        now = time.monotonic()
        times = self.admitted.setdefault(key, [])
        del times[:bisect.bisect_right(times, now - ACCEL_WIN - ACCEL_PREV)]
        if accel_room(times, now) < 1:
            wait = accel_wait(times, now)
            self.anthropic_headers(h, key, minute)
            h["retry-after"] = str(max(1, math.ceil(wait)))
            return self.err(429, {"type": "error", "error": {
                "type": "rate_limit_error",
                "message": ("This request would exceed your organization's rate of growth in requests. "
                            "Please ramp up your traffic gradually. For details, refer to: "
                            "https://docs.anthropic.com/en/api/rate-limits.")}}, h, "rate")
        times.append(now)
        return await self.anthropic_ok(body, key, pt, mt, h, minute)

    # --- Azure OpenAI, Responses API header shape. PROVIDERS.md l.52: "`-1` in limit/remaining
    #     means unknown (seen on the Responses API, with no retry-after)"; l.54: "RPM is
    #     enforced over 1 s or 10 s sub-windows". AZR_SUB requests per AZR_WIN s window (counted
    #     from the run's first request); every answer says -1; the 429 carries no retry-after
    #     (-ms, x-ms-) and no "retry after N seconds" in its message.
    async def w_azure_responses(self, req, body, key, model, pt, mt, h):
        win = int((time.monotonic() - self.t0) // AZR_WIN)
        k = key + (model, win)
        used = self.win_counts.get(k, 0)
        for nm in ("requests", "tokens"):
            h[f"x-ratelimit-limit-{nm}"] = "-1"
            h[f"x-ratelimit-remaining-{nm}"] = "-1"
        h["apim-request-id"] = str(uuid.uuid4())
        if used >= AZR_SUB:
            return self.err(429, {"error": {
                "code": "429",
                "message": ("Requests to the Responses_Create Operation under Azure OpenAI API version "
                            "2025-04-01-preview have exceeded call rate limit of your current OpenAI S0 pricing "
                            "tier. Please go here: https://aka.ms/oai/quotaincrease if you would like to further "
                            "increase the default rate limit.")}}, h, "rate")
        self.win_counts[k] = used + 1
        return await self.serve_ok(body, pt, mt, h)

    # --- SGLang: SGL_RUNNING slots, SGL_QUEUE waiting; beyond that 503 at once, no headers
    async def w_sglang(self, req, body, key, model, pt, mt, h):
        if self.in_server >= SGL_RUNNING + SGL_QUEUE:
            return self.err(503, {"object": "error", "message": "The request queue is full.",
                                  "type": "ServiceUnavailable", "param": None, "code": 503}, h, "other")
        self.in_server += 1
        try:
            async with self.slots:
                return await self.serve_ok(body, pt, mt, h)
        finally:
            self.in_server -= 1


    # ------------------------------------------------------------------ incident / transport worlds
    def anth_err(self, status, etype, message, h, cause="other"):
        """Anthropic's error JSON shape (PROVIDERS.md l.30-42: 529 `overloaded_error`, 504
        `timeout_error`); `request-id` as on Anthropic's answers."""
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]
        return self.err(status, {"type": "error", "error": {"type": etype, "message": message}}, h, cause)

    # --- Anthropic API-wide overload incident.
    #     PROVIDERS.md l.41: "529 `overloaded_error` (API-wide overload, retryable)"; l.65-66:
    #     "Anthropic uses 529 `overloaded_error` for the same thing [as OpenAI's overload] ... Treat
    #     overload like a 503: back off with jitter under the failure budget; it is not a pacing
    #     signal." No rate limit binds; no retry-after on the 529 (PROVIDERS.md documents
    #     retry-after only "on 429", l.38). During the first INC529_LEN s after the first request,
    #     INC529_SHARE of arrivals get the 529 at once (share and length: harness's guess); the rest
    #     and everything afterwards succeed (OpenAI-compatible JSON, as the clients use the openai SDK).
    async def w_anthropic_529(self, req, body, key, model, pt, mt, h):
        if time.monotonic() - self.t0 < INC529_LEN and self.rng.random() < INC529_SHARE:
            return self.anth_err(529, "overloaded_error", "Overloaded", h)
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]
        return await self.serve_ok(body, pt, mt, h)

    # --- OpenAI outage episode: every request gets a 5xx for OUTAGE_LEN s, then healthy.
    #     PROVIDERS.md l.91: the SDKs "Retry 408, 409, 429, >= 500 and connection errors; default
    #     `max_retries = 2`"; l.65: "Together answers 503 ... Treat overload like a 503" (l.65-66). The status
    #     mix (500 server_error JSON, 502 from the edge as HTML, 503 overloaded JSON), the bodies and
    #     the outage length are the harness's guess (PROVIDERS.md does not document OpenAI 5xx shapes).
    async def w_openai_incident(self, req, body, key, model, pt, mt, h):
        if time.monotonic() - self.t0 < OUTAGE_LEN:
            await asyncio.sleep(0.02)
            st = self.rng.choice(OUTAGE_STATUSES)
            k = {500: 0, 502: 1, 503: 2}[st]
            if k == 0:
                return self.err(500, {"error": {
                    "message": "The server had an error while processing your request. Sorry about that!",
                    "type": "server_error", "param": None, "code": None}}, h, "other")
            if k == 1:
                self.count(502, "other")
                return web.Response(status=502, headers=h, content_type="text/html",
                                    text="<html><head><title>502 Bad Gateway</title></head><body>"
                                         "<center><h1>502 Bad Gateway</h1></center></body></html>")
            return self.err(503, {"error": {
                "message": "The engine is currently overloaded, please try again later",
                "type": "server_error", "param": None, "code": None}}, h, "other")
        return await self.serve_ok(body, pt, mt, h)

    # --- A load balancer in front of the provider that drops connections.
    #     PROVIDERS.md l.91: the SDKs "Retry ... connection errors; default `max_retries = 2`".
    #     PROVIDERS.md documents no load-balancer behaviour: the LB is the harness's guess (shares
    #     LB_RESET / LB_CLOSE, idle timeout LB_IDLE set on the server in main()). LB_RESET of
    #     requests: after U(0, service) the connection is reset (RST, SO_LINGER 0) with no answer.
    #     LB_CLOSE of successful answers carry `Connection: close`.
    async def w_lb_resets(self, req, body, key, model, pt, mt, h):
        r = self.rng.random()
        if r < LB_RESET:
            await asyncio.sleep(self.rng.uniform(0.0, self.service))
            self.stats["lb_reset"] += 1
            self.count("reset", "other")
            tr = req.transport
            if tr is not None:
                sock = tr.get_extra_info("socket")
                try:
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                tr.abort()
            raise asyncio.CancelledError()
        resp = await self.serve_ok(body, pt, mt, h)
        if r < LB_RESET + LB_CLOSE:
            self.stats["lb_conn_close"] += 1
            resp.force_close()
        return resp

    # --- Anthropic 504 after a long wait.
    #     PROVIDERS.md l.41: "504 `timeout_error`". T504_SHARE of requests are held T504_WAIT s and
    #     then answered 504 timeout_error (share, wait and message text: harness's guess); the rest
    #     succeed after the service time.
    async def w_anthropic_504(self, req, body, key, model, pt, mt, h):
        if self.rng.random() < T504_SHARE:
            await asyncio.sleep(T504_WAIT)
            return self.anth_err(504, "timeout_error", "Request timed out before a response was generated.", h)
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]
        return await self.serve_ok(body, pt, mt, h)

    # --- OpenAI key out of quota (billing): every request a permanent 429.
    #     PROVIDERS.md l.27-28: "Permanent 429: `code: "insufficient_quota"` (billing); retrying it
    #     only burns time"; l.127: "Retrying permanent 429s (openai-python #1671)" is a known peer
    #     failure. No retry-after (harness's guess; PROVIDERS.md gives retry-after for the transient
    #     429 only). Body message text: harness's guess.
    async def w_openai_quota(self, req, body, key, model, pt, mt, h):
        await asyncio.sleep(0.01)
        return self.err(429, {"error": {
            "message": ("You exceeded your current quota, please check your plan and billing details. "
                        "For more information on this error, read the docs: "
                        "https://platform.openai.com/docs/guides/error-codes/api-errors."),
            "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}, h, "other")

    # --- Anthropic error mid-stream after HTTP 200.
    #     PROVIDERS.md l.45: "Errors can arrive mid-stream as an SSE `error` event after HTTP 200";
    #     l.41: 529 `overloaded_error`. Streams as openai-stream (OpenAI chunk shape, as clients use
    #     the openai SDK); SERR_SHARE of streams send an `event: error` with Anthropic's overloaded
    #     body after SERR_AT chunks and end (share, position: harness's guess). No rate limit.
    async def w_anthropic_stream_error(self, req, body, key, model, pt, mt, h):
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]
        h["content-type"] = "text/event-stream; charset=utf-8"
        fail = self.rng.random() < SERR_SHARE
        resp = web.StreamResponse(status=200, headers=h)
        cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())

        def chunk(choices, usage=None):
            return ("data: " + json.dumps({
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": "fp_harness", "choices": choices, "usage": usage}) + "\n\n").encode()
        try:
            await resp.prepare(req)
            for k in range(STREAM_CHUNKS):
                await asyncio.sleep(self.service / STREAM_CHUNKS)
                if fail and k == SERR_AT:
                    await resp.write(("event: error\ndata: " + json.dumps({"type": "error", "error": {
                        "type": "overloaded_error", "message": "Overloaded"}}) + "\n\n").encode())
                    await resp.write_eof()
                    self.stats["sse_error_sent"] += 1
                    self.count("200-sse-error", "other")
                    return resp
                delta = {"role": "assistant", "content": ""} if k == 0 else {"content": "ok "}
                fin = "stop" if k == STREAM_CHUNKS - 1 else None
                await resp.write(chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}]))
            ct = min(mt, STREAM_CHUNKS)
            await resp.write(chunk([], {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["stream_aborted"] += 1
            raise
        self.count(200)
        return resp


    # --- Anthropic spend limit reached mid-run.
    #     PROVIDERS.md l.43-44: "Spend-limit 429: error code `enforced_spend_limit_reached` (in the
    #     error details), no `retry-after`: permanent until the account changes, never retry."
    #     l.41: 429 `rate_limit_error`. The first SPEND_OK requests are admitted; every later one
    #     gets the permanent 429 (count and the exact place of the code in the body: harness's guess).
    async def w_anthropic_spend(self, req, body, key, model, pt, mt, h):
        if self.admitted_n >= SPEND_OK:
            h["request-id"] = "req_" + uuid.uuid4().hex[:20]
            return self.err(429, {"type": "error", "error": {
                "type": "rate_limit_error",
                "message": ("Your organization has reached its monthly spend limit. "
                            "Increase the limit in the Console to continue."),
                "details": {"error_code": "enforced_spend_limit_reached"}}}, h, "other")
        self.admitted_n += 1
        h["request-id"] = "req_" + uuid.uuid4().hex[:20]
        return await self.serve_ok(body, pt, mt, h)

    # --- Gemini requests-per-day quota runs out mid-run.
    #     PROVIDERS.md l.68-70: "Gemini has requests-per-day quotas that reset at midnight Pacific. A
    #     429 whose wait is hours away is a quota, not a pace"; l.71-76: 429 `RESOURCE_EXHAUSTED`
    #     with no `retry-after` header, `error.details` with RetryInfo `retryDelay` and a
    #     QuotaFailure whose `quotaId` names the window (`...PerDay...`), "Some responses are a JSON
    #     array around the error object". The first GD_LEFT requests succeed (harness's guess); the
    #     rest get the per-day 429 with retryDelay = seconds to the next midnight Pacific (UTC-8,
    #     ignoring DST: harness's simplification).
    async def w_gemini_daily(self, req, body, key, model, pt, mt, h):
        if self.admitted_n >= GD_LEFT:
            now = time.time()
            pac = now - 8 * 3600
            delay = f"{86400 - (pac % 86400):.0f}s"
            payload = [{"error": {
                "code": 429,
                "message": ("You exceeded your current quota, please check your plan and billing details. "
                            f"Quota exceeded for metric: generativelanguage.googleapis.com/generate_requests_per_model_per_day, limit: {GD_LEFT}"),
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                     "violations": [{"quotaMetric": "generativelanguage.googleapis.com/generate_requests_per_model_per_day",
                                     "quotaId": "GenerateRequestsPerDayPerProjectPerModel",
                                     "quotaDimensions": {"location": "global", "model": model},
                                     "quotaValue": str(GD_LEFT)}]},
                    {"@type": "type.googleapis.com/google.rpc.Help",
                     "links": [{"description": "Learn more about Gemini API quotas",
                                "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
                ]}}]
            return self.err(429, payload, h, "other")
        self.admitted_n += 1
        return await self.serve_ok(body, pt, mt, h)


    # --- OpenAI overload episode answered with 429s.
    #     PROVIDERS.md l.63-65: "OpenAI documents `429 - The engine is currently overloaded, please
    #     try again later`: a 429 that says nothing about your rate, usually without `retry-after`
    #     and with healthy `x-ratelimit-remaining-*`." For OUTAGE_LEN s from the first request every
    #     request gets that 429 (no retry-after, generous per-minute headers as openai-overload);
    #     healthy afterwards (episode length: harness's guess, shared with openai-incident).
    async def w_openai_overload_incident(self, req, body, key, model, pt, mt, h):
        key = key + (model,)
        minute, tok = self.minute(key), self.tok(key)
        if time.monotonic() - self.t0 < OUTAGE_LEN:
            await asyncio.sleep(0.02)
            return self.overloaded_429(h, minute, tok)
        return await self.openai_ok(body, pt, mt, h, minute, tok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", required=True, choices=WORLDS)
    ap.add_argument("--port", type=int, default=18500)
    ap.add_argument("--service", type=float, default=None, help="service time per request, s (default 0.2)")
    ap.add_argument("--n", type=int, default=500, help="tasks, for printing the bound")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    service = a.service if a.service is not None else DEFAULT_SERVICE.get(a.world, 0.2)
    world = World(a.world, service, a.seed)

    async def stats(request):
        return web.json_response(world.stats)

    async def reset(request):
        world.reset()
        return web.json_response({"reset": True})

    async def info(request):
        n = int(request.query.get("n", a.n))
        return web.json_response({"world": world.name, "service": world.service, "n": n, "bound": world.bound(n)})

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", world.handle)
    app.router.add_get("/stats", stats)
    app.router.add_post("/stats/reset", reset)
    app.router.add_get("/world", info)
    print(f"world={a.world} service={service}s port={a.port} bound(n={a.n})={world.bound(a.n)}", flush=True)
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, backlog=4096, print=None,
                keepalive_timeout=LB_IDLE if a.world == "lb-resets" else 120)


if __name__ == "__main__":
    main()
