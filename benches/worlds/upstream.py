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
import datetime as dt
import json
import math
import random
import time
import uuid

from aiohttp import web

WORLDS = ["openai-quantized", "openai-overload", "two-models", "anthropic", "azure", "gemini",
          "together", "vllm", "admission", "nolimit", "groq-daily"]

# default service time per world (seconds); overridable with --service
DEFAULT_SERVICE = {"vllm": 0.5, "openai-overload": 10.0}


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

    def _bk(self, k, cap, rate):
        b = self.buckets.get(k)
        if b is None:
            b = self.buckets[k] = Bucket(cap, rate)
        return b

    def bound(self, n):
        """Ideal makespan for n tasks all started at t=0 (perfect knowledge, no wasted attempts)."""
        s = self.service
        w = self.name
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

    # ------------------------------------------------------------------ helpers
    def count(self, status, cause=None, model=None):
        st = self.stats
        st["by_status"][str(status)] = st["by_status"].get(str(status), 0) + 1
        sec = str(int(time.monotonic() - self.t0))
        ps = st["per_second"].setdefault(sec, {})
        key = "200" if status == 200 else f"{status}:{cause}"
        ps[key] = ps.get(key, 0) + 1
        if model:
            bm = st["by_model"].setdefault(model, {})
            bm[key] = bm.get(key, 0) + 1
        if status == 200:
            st["ok"] += 1
        else:
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
        try:
            body = await request.json()
        except Exception:
            body = {}
        auth = request.headers.get("authorization", "")
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
            self.openai_headers(h, minute, tok)
            return self.err(429, {"error": {
                "message": "The engine is currently overloaded, please try again later",
                "type": "server_error", "param": None, "code": None}}, h, "other")
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
                keepalive_timeout=120)


if __name__ == "__main__":
    main()
