#!/usr/bin/env python3
"""Drive N simultaneous clients at one world: (a) SDK alone, (b) SDK (max_retries=0) through corral,
(c) "corral-retries": the SDK with its default retries (2, as users leave it) through corral,
(d) "fleet": the SDK (max_retries=0) through four corrals sharing one Redis, each client sent to one
of them in turn (as a Kubernetes Service spreads pods' clients), one quota behind them.

Usage: drive.py --world W [--n 500] [--modes sdk-alone,corral[,corral-retries,fleet]] [--out results/W.json]
Starts upstream.py for the world and (per corral run) fresh corrals (and for "fleet" a fresh
redis-server, `REDIS_SERVER` or on the PATH), stops them all by PID.
"""
import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import httpx2
import openai
from openai import AsyncOpenAI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import upstream as U  # noqa: E402  (shared task shapes, arrival times)

PY = sys.executable
# the added worlds bound their clients' deadlines so a run stays within ~2 minutes
DEADLINE_CAP = {w: 120.0 for w in U.NEW_BOUNDS}
STREAM_WORLDS = ("openai-stream", "anthropic-stream-error")
REPLICAS = 4
REDIS = os.environ.get("REDIS_SERVER", "redis-server")
CORRAL = os.environ.get("CORRAL_BIN", os.path.join(HERE, "..", "..", "target", "release", "corral"))
OUT = os.environ.get("OUT", os.path.join(HERE, "..", "..", "bench-out", "worlds"))

# headers the upstream itself may send (any world) + standard HTTP ones
KNOWN = {
    "content-type", "content-length", "date", "server", "connection", "keep-alive", "transfer-encoding",
    "x-harness-world", "x-harness-req", "retry-after", "retry-after-ms", "x-ms-retry-after-ms",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", "request-id", "apim-request-id",
    "x-amzn-requestid", "x-amzn-errortype",
}
for nm in ("requests", "tokens", "input-tokens", "output-tokens"):
    for f in ("limit", "remaining", "reset"):
        KNOWN.add(f"anthropic-ratelimit-{nm}-{f}")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, proc, timeout=15.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited early rc={proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not accepting after {timeout}s")


def http_json(url, method="GET"):
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def stop(proc):
    if proc and proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


async def call(client, kw, stream, rec):
    """One request; returns (raw response, ok). A stream counts only when read to its end with usage;
    rec["ttft"] gets the time from the call to its first chunk."""
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(**kw)
        comp = raw.parse()
        return raw, bool(comp.usage is not None and comp.choices)
    t0 = time.monotonic()
    raw = await client.chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **kw)
    chunks, usage, done = 0, None, False
    async for ch in raw.parse():
        if not chunks:
            rec["ttft"] = time.monotonic() - t0
        chunks += 1
        usage = ch.usage or usage
        done = done or any(c.finish_reason for c in ch.choices)
    return raw, bool(usage is not None and done and chunks >= U.STREAM_CHUNKS)


async def one_task(client, i, model, deadline, t_start, kw=None, stream=False, delay=0.0):
    rec = {"i": i, "model": model}
    kw = dict(kw or U.task_request("", i), model=model)
    if delay:
        await asyncio.sleep(max(0.0, delay - (time.monotonic() - t_start)))
    t_arr = time.monotonic() - t_start
    try:
        raw, rec["ok"] = await asyncio.wait_for(call(client, kw, stream, rec), timeout=deadline)
        rec["status"] = raw.status_code
        rec["headers"] = dict(raw.headers)
        rec["retries"] = raw.retries_taken
    except asyncio.TimeoutError:
        rec["ok"] = False
        rec["err"] = "deadline"
    except openai.APIStatusError as e:
        rec["ok"] = False
        rec["err"] = type(e).__name__
        rec["status"] = e.status_code
        rec["headers"] = dict(e.response.headers)
        try:
            rec["body"] = e.response.text[:400]
        except Exception:
            rec["body"] = None
    except (openai.APITimeoutError, openai.APIConnectionError) as e:
        rec["ok"] = False
        rec["err"] = type(e).__name__ + ":" + repr(getattr(e, "__cause__", None))[:150]
    except Exception as e:  # noqa
        rec["ok"] = False
        rec["err"] = "other:" + repr(e)[:200]
    rec["t"] = time.monotonic() - t_start
    rec["lat"] = rec["t"] - t_arr
    return rec


async def run_mode(base_urls, n, deadline, max_retries, models, world=""):
    """Task i asks for models[i % len(models)] through base_urls[(i // len(models)) % len(base_urls)]:
    every corral of a fleet gets each model's share."""
    limits = httpx2.Limits(max_connections=2000, max_keepalive_connections=2000)
    timeout = httpx2.Timeout(deadline, connect=deadline)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout) as hc:
        kw = {} if max_retries is None else {"max_retries": max_retries}
        clients = [AsyncOpenAI(base_url=b, api_key="sk-harness-key", http_client=hc, timeout=timeout, **kw)
                   for b in base_urls]
        t_start = time.monotonic()
        arr = U.arrivals(world, n)
        stream = world in STREAM_WORLDS
        nm = len(models)
        tasks = [asyncio.create_task(one_task(clients[(i // nm) % len(clients)], i, models[i % nm], deadline,
                                              t_start, U.task_request(world, i), stream, arr[i]))
                 for i in range(n)]
        recs = await asyncio.gather(*tasks)
        return recs


def spread(ts):
    """first / median / last of a list of times, and how many came after the first second"""
    ts = sorted(ts)
    if not ts:
        return None
    return {"first": ts[0], "p50": ts[len(ts) // 2], "last": ts[-1], "after_1s": sum(t >= 1.0 for t in ts)}


def summarize(recs, stats, bound, n):
    ok = [r for r in recs if r["ok"]]
    failed = [r for r in recs if not r["ok"]]
    makespan = max(r["t"] for r in recs) if recs else 0.0
    last_ok = max((r["t"] for r in ok), default=0.0)
    med = statistics.median([r["t"] for r in ok]) if ok else None
    unknown_all, unknown_failed = {}, {}
    marker_answers = 0
    no_upstream_id = 0
    for r in recs:
        hs = r.get("headers")
        if hs is None:
            continue
        unk = [k for k in hs if k.lower() not in KNOWN]
        if unk:
            marker_answers += 1
        if "x-harness-req" not in {k.lower() for k in hs}:
            no_upstream_id += 1
        for k in unk:
            unknown_all[k] = unknown_all.get(k, 0) + 1
            if not r["ok"]:
                unknown_failed[k] = unknown_failed.get(k, 0) + 1
    fail_kinds = {}
    for r in failed:
        k = f"{r.get('status', '-')}/{r.get('err')}"
        fail_kinds[k] = fail_kinds.get(k, 0) + 1
    ft = sorted(r["t"] for r in failed)
    examples = []
    seen = set()
    for r in failed:
        k = (r.get("status"), r.get("err"))
        if k in seen or len(examples) >= 4:
            continue
        seen.add(k)
        examples.append({"t": round(r["t"], 3), "status": r.get("status"), "err": r.get("err"),
                         "headers": r.get("headers"), "body": r.get("body")})
    per_model = {}
    for m in sorted({r["model"] for r in recs}):
        rm = [r for r in recs if r["model"] == m]
        okm = [r for r in rm if r["ok"]]
        per_model[m] = {"n": len(rm), "failed": len(rm) - len(okm),
                        "makespan": round(max(r["t"] for r in rm), 3),
                        "last_ok": round(max((r["t"] for r in okm), default=0), 3),
                        "median": round(statistics.median([r["t"] for r in okm]), 3) if okm else None}
    return {
        "n": n, "failed": len(failed), "makespan": round(makespan, 3), "last_ok": round(last_ok, 3),
        "bound": bound["total"], "vs_bound": round(makespan / bound["total"], 2) if bound["total"] else None,
        "median": round(med, 3) if med is not None else None,
        "median_latency": round(statistics.median([r["lat"] for r in ok]), 3) if ok else None,
        "stream_aborted": stats.get("stream_aborted"),
        "median_ttft": round(statistics.median([r["ttft"] for r in ok]), 3) if ok and "ttft" in ok[0] else None,
        "rate429_times": spread(stats.get("rate_times") or []),
        "upstream_first_ok_t": stats.get("first_ok_t"),
        "upstream_refusal_headers": {k: v for k, v in stats.items() if k.startswith("hdr_")},
        "rate429": stats.get("rate", 0), "other": stats.get("other", 0),
        "upstream_requests": stats.get("requests"), "upstream_ok": stats.get("ok"),
        "upstream_by_cause": stats.get("by_cause"), "upstream_inflight_max": stats.get("inflight_max"),
        "upstream_per_second": stats.get("per_second"), "upstream_arrivals_per_second": stats.get("arrivals_per_second"), "upstream_by_model": stats.get("by_model"),
        "upstream_per_100ms": stats.get("per_100ms"), "upstream_arrivals_per_100ms": stats.get("arrivals_per_100ms"),
        "client_fail_times_all": sorted(round(r["t"], 3) for r in failed) if len(failed) <= 1000 else None,
        "answers_with_nonstandard_headers": marker_answers, "answers_without_upstream_id": no_upstream_id,
        "nonstandard_header_names_all": unknown_all, "nonstandard_header_names_on_failed": unknown_failed,
        "fail_kinds": fail_kinds,
        "sdk_retries_taken_ok": {str(k): sum(1 for r in ok if r.get("retries") == k)
                                 for k in sorted({r.get("retries") for r in ok}, key=str)},
        "upstream_client_retry_hdr": stats.get("client_retry_hdr"),
        "fail_times": {"first": ft[0], "p50": ft[len(ft) // 2], "last": ft[-1]} if ft else None,
        "fail_examples": examples, "per_model": per_model,
        "bound_detail": bound,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", required=True)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--modes", default="sdk-alone,corral")
    ap.add_argument("--service", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--corral", default=CORRAL)
    a = ap.parse_args()
    if "fleet" in a.modes.split(",") and shutil.which(REDIS) is None:
        sys.exit(f"drive.py: mode fleet needs redis-server ({REDIS!r} is not on the PATH; set REDIS_SERVER)")
    out = a.out or os.path.join(OUT, "results", f"{a.world}-n{a.n}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    logdir = os.path.join(OUT, "logs")
    os.makedirs(logdir, exist_ok=True)

    uport = free_port()
    ucmd = [PY, os.path.join(HERE, "upstream.py"), "--world", a.world, "--port", str(uport), "--n", str(a.n)]
    if a.service is not None:
        ucmd += ["--service", str(a.service)]
    ulog = open(os.path.join(logdir, f"upstream-{a.world}.log"), "w")
    up = subprocess.Popen(ucmd, stdout=ulog, stderr=subprocess.STDOUT)
    results = {"world": a.world, "n": a.n}
    try:
        wait_port(uport, up)
        info = http_json(f"http://127.0.0.1:{uport}/world?n={a.n}")
        bound = info["bound"]
        deadline = min(max(10 * bound["total"], 60.0), DEADLINE_CAP.get(a.world, math.inf))
        last_arrival = max(U.arrivals(a.world, a.n))
        print(f"[{a.world}] service={info['service']} bound={bound} deadline={deadline}s", flush=True)
        results["bound"] = bound
        results["deadline"] = deadline
        models = ["fast", "slow"] if a.world == "two-models" else ["gpt-4o-mini"]
        for mode in a.modes.split(","):
            http_json(f"http://127.0.0.1:{uport}/stats/reset", "POST")
            procs = []
            try:
                if mode in ("corral", "corral-retries", "fleet"):
                    extra = []
                    if mode == "fleet":
                        rport = free_port()
                        rp = subprocess.Popen([REDIS, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                               "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
                        procs.append(rp)
                        wait_port(rport, rp)
                        extra = ["--redis", f"redis://127.0.0.1:{rport}"]
                    bases = []
                    for k in range(REPLICAS if mode == "fleet" else 1):
                        cport = free_port()
                        lname = mode if mode != "fleet" else f"fleet{k}"
                        clog = open(os.path.join(logdir, f"{lname}-{a.world}.log"), "w")
                        cp = subprocess.Popen([a.corral, "--upstream", f"http://127.0.0.1:{uport}/v1",
                                               "--listen", f"127.0.0.1:{cport}"] + extra,
                                              stdout=clog, stderr=subprocess.STDOUT)
                        procs.append(cp)
                        wait_port(cport, cp)
                        bases.append(f"http://127.0.0.1:{cport}/v1")
                    mr = None if mode == "corral-retries" else 0  # corral-retries: SDK default (2)
                else:
                    bases = [f"http://127.0.0.1:{uport}/v1"]
                    mr = None  # SDK default (2)
                t0 = time.monotonic()
                # hard wall-clock cap on the whole run: last arrival + deadline + 30 s
                recs = asyncio.run(asyncio.wait_for(run_mode(bases, a.n, deadline, mr, models, a.world),
                                                    last_arrival + deadline + 30))
                wall = time.monotonic() - t0
            finally:
                for p in reversed(procs):
                    stop(p)
            stats = http_json(f"http://127.0.0.1:{uport}/stats")
            s = summarize(recs, stats, bound, a.n)
            s["wall"] = round(wall, 2)
            results[mode] = s
            print(f"[{a.world}] {mode}: failed={s['failed']} makespan={s['makespan']}s bound={s['bound']:.2f}s "
                  f"x{s['vs_bound']} median={s['median']} median_lat={s['median_latency']} ttft={s['median_ttft']} rate429={s['rate429']} other={s['other']} "
                  f"rate429_times={s['rate429_times']} sdk_retries_ok={s['sdk_retries_taken_ok']} "
                  f"client_retry_hdr={s['upstream_client_retry_hdr']} "
                  f"upstream_req={s['upstream_requests']} nonstd_hdr_answers={s['answers_with_nonstandard_headers']} "
                  f"no_upstream_id={s['answers_without_upstream_id']} fail_kinds={s['fail_kinds']} "
                  f"nonstd_on_failed={s['nonstandard_header_names_on_failed']} per_model="
                  f"{ {m: (v['failed'], v['makespan']) for m, v in s['per_model'].items()} }", flush=True)
            # written after each mode: a run cut short keeps the modes it finished
            with open(out, "w") as f:
                json.dump(results, f, indent=1, default=str)
            time.sleep(0.5)
    finally:
        stop(up)
        ulog.close()
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
