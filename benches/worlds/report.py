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
         "tier-up", "sglang"]


def cell(s):
    return (f"{s['failed']} / {s['makespan']:.1f}s / x{s['vs_bound']} / {s['rate429']} / {s['other']}")


def main():
    rows, worse, details = [], [], []
    for w in ORDER:
        p = os.path.join(OUT, "results", f"{w}-n{N}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        a, c = r.get("sdk-alone"), r.get("corral")
        if not a or not c:
            continue
        b = r["bound"]
        bs = f"{b['total']:.1f}s" + ("".join(f", {k} {v:.1f}s" for k, v in b.items() if k != "total"))
        mk = "median_latency" if w == "staggered" else "median"  # staggered: from each task's arrival
        rows.append(f"| {w} | {bs} | {cell(a)} | {cell(c)} | {a[mk]} / {c[mk]} | "
                    f"{c['answers_with_nonstandard_headers']} |")
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
            worse.append(f"- **{w}**: " + ", ".join(why) +
                         f". corral fail kinds {c['fail_kinds']}, failure times {c['fail_times']}; "
                         f"upstream saw {c['upstream_requests']} attempts ({c['upstream_by_cause']}); "
                         f"SDK alone: {a['fail_kinds']} / upstream {a['upstream_requests']} attempts. "
                         f"Non-standard headers on corral's failed answers: {c['nonstandard_header_names_on_failed']}."
                         + (f" When corral's rate 429s left the upstream (s): {c['rate429_times']}."
                            if c.get("rate429_times") else "")
                         + (f" Examples: {exs}" if exs else ""))
        pm = c.get("per_model") or {}
        if len(pm) > 1:
            details.append(f"- {w} per model (failed, makespan, last ok): sdk-alone "
                           f"{ {m: (v['failed'], v['makespan'], v['last_ok']) for m, v in a['per_model'].items()} }; "
                           f"corral { {m: (v['failed'], v['makespan'], v['last_ok']) for m, v in pm.items()} }; bounds {b}")
    out = [f"# corral vs SDK alone, N={N} simultaneous clients", "",
           "Cells: failed / makespan / makespan÷bound / rate 429s (upstream-counted) / other refusals (429 overload/admission, 5xx)",
           "Median task time counts from t=0, except `staggered` (from each task's arrival).",
           "", "| world | bound | sdk-alone | corral | median task s (sdk / corral) | corral answers w/ non-upstream headers |",
           "|---|---|---|---|---|---|"] + rows + ["", "## Worlds where corral is worse than the SDK alone", ""]
    out += worse or ["- none"]
    if details:
        out += ["", "## Per-model detail", ""] + details
    notes = os.path.join(HERE, "notes.md")
    if os.path.exists(notes):
        out += ["", open(notes).read()]
    open(os.path.join(OUT, "results.md"), "w").write("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
