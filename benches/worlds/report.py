#!/usr/bin/env python3
"""Build results.md from results/*-n<N>.json."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", os.path.join(HERE, "..", "..", "bench-out", "worlds"))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 500
ORDER = ["nolimit", "openai-quantized", "openai-overload", "two-models", "anthropic", "azure", "gemini",
         "together", "vllm", "admission", "groq-daily", "openai-tokens", "openai-stream", "staggered",
         "tier-up", "sglang", "bedrock", "anthropic-accel", "azure-responses", "anthropic-529",
         "openai-incident", "lb-resets", "anthropic-504", "openai-overload-incident", "openai-quota",
         "anthropic-spend", "gemini-daily", "anthropic-stream-error"]
# corral modes, compared each with sdk-alone; "corral-retries" (the SDK's default retries through
# corral) and "fleet" (four corrals sharing Redis) get their own columns only when some result has them
CMODES = ["corral", "corral-retries", "fleet"]


def cell(s):
    return (f"{s['failed']} / {s['makespan']:.1f}s / x{s['vs_bound']} / {s['rate429']} / {s['other']}")


def main():
    rows, worse, details = [], [], []
    runs = []
    for w in ORDER:
        p = os.path.join(OUT, "results", f"{w}-n{N}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        if r.get("sdk-alone") and any(r.get(m) for m in CMODES):
            runs.append((w, r))
    modes = [m for m in CMODES if any(r.get(m) for _, r in runs)]
    for w, r in runs:
        a = r["sdk-alone"]
        b = r["bound"]
        bs = f"{b['total']:.1f}s" + ("".join(f", {k} {v:.1f}s" for k, v in b.items() if k != "total"))
        mk = "median_latency" if w == "staggered" else "median"  # staggered: from each task's arrival
        cs = [r.get(m) for m in modes]
        rows.append(f"| {w} | {bs} | {cell(a)} | " + " | ".join(cell(c) if c else "-" for c in cs) + " | "
                    + " / ".join(str(x[mk]) if x else "-" for x in [a] + cs) + " | "
                    + " / ".join(str(c["answers_with_nonstandard_headers"]) if c else "-" for c in cs) + " |")
        for m in modes:
            if r.get(m):
                compare(w, m, a, r[m], b, worse, details)
    label = " / ".join(["sdk"] + modes)
    out = [f"# corral vs SDK alone, N={N} simultaneous clients", "",
           "Cells: failed / makespan / makespan÷bound / rate 429s (upstream-counted) / other refusals (429 overload/admission, 5xx)",
           "Median task time counts from t=0, except `staggered` (from each task's arrival).",
           ] + (["`corral`: the SDK with max_retries=0 through corral; `corral-retries`: the SDK with its "
                 "default retries (2) through corral; `fleet`: the SDK with max_retries=0 through four "
                 "corrals sharing one Redis, clients spread over them in turn."] if len(modes) > 1 else []) + [
           "", f"| world | bound | sdk-alone | {' | '.join(modes)} | median task s ({label}) | "
           f"{'corral' if len(modes) == 1 else ' / '.join(modes)} answers w/ non-upstream headers |",
           "|---|---|---|" + "---|" * len(modes) + "---|---|"] + rows + [
           "", "## Worlds where corral is worse than the SDK alone", ""]
    out += worse or ["- none"]
    if details:
        out += ["", "## Per-model detail", ""] + details
    notes = os.path.join(HERE, "notes.md")
    if os.path.exists(notes):
        out += ["", open(notes).read()]
    open(os.path.join(OUT, "results.md"), "w").write("\n".join(out) + "\n")
    print("\n".join(out))


def compare(w, m, a, c, b, worse, details):
    """Flag mode m's run c where it is worse than the SDK alone (a); per-model detail."""
    tag = "" if m == "corral" else f" ({m})"
    why = []
    if c["failed"] > a["failed"]:
        why.append(f"more failures ({c['failed']} vs {a['failed']})")
    if c["makespan"] > 1.1 * a["makespan"]:
        lit = " [literal rule only: the SDK alone finished early by FAILING %d/%d tasks; corral's makespan is x%s of the bound]" % (
            a["failed"], N, c["vs_bound"]) if a["failed"] > max(c["failed"], 0.1 * N) else ""
        why.append(f"makespan {c['makespan']:.1f}s > 1.1 x SDK's {a['makespan']:.1f}s" + lit)
    if c["rate429"] > 0.02 * N:
        why.append(f"rate 429s {c['rate429']} > 2% of {N}")
    if why:
        ex = c.get("fail_examples") or []
        exs = "; ".join(f"t={e['t']}s status={e['status']} err={e['err']} "
                        f"hdrs={sorted((e.get('headers') or {}).items())[:12]}" for e in ex[:2])
        worse.append(f"- **{w}**{tag}: " + ", ".join(why) +
                     f". corral fail kinds {c['fail_kinds']}, failure times {c['fail_times']}; "
                     f"upstream saw {c['upstream_requests']} attempts ({c['upstream_by_cause']}); "
                     f"SDK alone: {a['fail_kinds']} / upstream {a['upstream_requests']} attempts. "
                     f"Non-standard headers on corral's failed answers: {c['nonstandard_header_names_on_failed']}."
                     + (f" When corral's rate 429s left the upstream (s): {c['rate429_times']}."
                        if c.get("rate429_times") else "")
                     + (f" Examples: {exs}" if exs else ""))
    pm = c.get("per_model") or {}
    if len(pm) > 1:
        details.append(f"- {w}{tag} per model (failed, makespan, last ok): sdk-alone "
                       f"{ {mm: (v['failed'], v['makespan'], v['last_ok']) for mm, v in a['per_model'].items()} }; "
                       f"{m} { {mm: (v['failed'], v['makespan'], v['last_ok']) for mm, v in pm.items()} }; bounds {b}")


if __name__ == "__main__":
    main()
