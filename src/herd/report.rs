//! The herd benchmark's table (markdown) and chart (SVG, upstream arrivals per 100 ms, one panel
//! per strategy, the refill rate as a dashed line).

use std::fmt::Write;

use super::{RunResult, Spec};

/// A markdown table of every run, with the bound for comparison.
pub fn table(spec: &Spec, results: &[RunResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} tasks at once; bucket {} refilled at {}/s; service {} ms; bound (N - capacity) / refill = {:.2} s\n",
        spec.tasks,
        spec.capacity,
        spec.refill,
        spec.service.as_millis(),
        spec.bound().as_secs_f64()
    );
    out.push_str("| strategy | makespan s | vs bound | ok | failed | upstream 429s | client 429s | retries/task | p50 s | p99 s | var(arrivals/s) |\n");
    out.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2}x | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.1} |",
            r.strategy.label(),
            r.makespan.as_secs_f64(),
            r.makespan.as_secs_f64() / spec.bound().as_secs_f64().max(1e-9),
            r.ok,
            r.failed,
            r.upstream_429,
            r.client_429,
            r.retries_per_task(spec.tasks),
            r.percentile(0.5).as_secs_f64(),
            r.percentile(0.99).as_secs_f64(),
            r.arrival_variance(),
        );
    }
    out
}

/// One row per (scenario, strategy): client failures (and those that gave up waiting after
/// the world's patience), makespan against that world's bound,
/// upstream 429s the sender's rate caused (and as a share of the tasks) apart from the others
/// (overload, admission control, a spent day), median and p99 task latency, p99 wait in the
/// backend's own queue. A world of several models adds a row per model against its own bound.
pub fn scenario_table(results: &[RunResult]) -> String {
    let mut out = String::new();
    out.push_str("| scenario | strategy | tasks | failed | abandoned | makespan s | bound s | vs bound | rate 429s | rate 429s / tasks | other 429s | median task s | p99 task s | backend queue p99 s |\n");
    out.push_str("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for r in results {
        let scenario = r.scenario.map_or("classic", |s| s.label());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {:.1}% | {} | {:.2} | {:.2} | {:.2} |",
            scenario,
            r.strategy.label(),
            r.tasks,
            r.failed,
            r.abandoned,
            r.makespan.as_secs_f64(),
            r.bound.as_secs_f64(),
            ratio(r.makespan, r.bound),
            r.rate_429,
            100.0 * r.rate_429 as f64 / r.tasks.max(1) as f64,
            r.other_429,
            r.percentile(0.5).as_secs_f64(),
            r.percentile(0.99).as_secs_f64(),
            r.backend_queue_p99.as_secs_f64(),
        );
        for m in &r.per_model {
            let _ = writeln!(
                out,
                "| {scenario}: model {} | {} | {} | {} | | {:.2} | {:.2} | {} | | | | {:.2} | | |",
                m.model,
                r.strategy.label(),
                m.tasks,
                m.failed,
                m.makespan.as_secs_f64(),
                m.bound.as_secs_f64(),
                ratio(m.makespan, m.bound),
                m.median.as_secs_f64(),
            );
        }
    }
    out
}

/// `a / b` as "1.23x"; "-" when `b` is under a millisecond (e.g. every task fits in the burst),
/// where a ratio would only measure the machine.
fn ratio(a: std::time::Duration, b: std::time::Duration) -> String {
    if b < std::time::Duration::from_millis(1) {
        "-".to_owned()
    } else {
        format!("{:.2}x", a.as_secs_f64() / b.as_secs_f64())
    }
}

/// One row per fleet run: corrals, split, Redis or not, makespan against the bound, upstream
/// 429s, client failures, Redis round trips per client request.
pub fn fleet_table(results: &[RunResult]) -> String {
    let mut out = String::new();
    out.push_str("| corrals | clients | Redis | corral | makespan s | bound s | vs bound | upstream 429s | 429s / tasks | failed | Redis round trips / request |\n");
    out.push_str("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for r in results {
        let bound = r.bound.as_secs_f64();
        let redis = match (r.redis_calls, r.redis_killed) {
            (_, true) => "killed mid-run",
            (Some(_), false) => "shared",
            (None, false) => "none",
        };
        let trips = r.redis_calls.map_or("-".to_owned(), |n| {
            format!("{:.3}", n as f64 / r.tasks.max(1) as f64)
        });
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2}x | {} | {:.1}% | {} | {} |",
            r.replicas,
            if r.uneven {
                "uneven (half on one)"
            } else {
                "even"
            },
            redis,
            r.strategy.label(),
            r.makespan.as_secs_f64(),
            bound,
            r.makespan.as_secs_f64() / bound.max(1e-9),
            r.upstream_429,
            100.0 * r.upstream_429 as f64 / r.tasks.max(1) as f64,
            r.failed,
            trips,
        );
    }
    out
}

/// An SVG chart: one panel per strategy, arrivals per 100 ms over time on a log scale (a herd's
/// first wave is hundreds of times the refill; a linear scale would flatten everything else).
pub fn svg(spec: &Spec, results: &[RunResult]) -> String {
    const W: f64 = 900.0;
    const PANEL: f64 = 110.0;
    const LEFT: f64 = 60.0;
    const TOP: f64 = 30.0;
    let slots = results
        .iter()
        .map(|r| r.arrivals_per_100ms.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let peak = results
        .iter()
        .flat_map(|r| r.arrivals_per_100ms.iter())
        .copied()
        .max()
        .unwrap_or(1)
        .max(1);
    let peak = f64::from(peak);
    let height = TOP + PANEL * results.len() as f64 + 30.0;
    let x = |i: f64| LEFT + (W - LEFT - 10.0) * i / slots as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="18" font-size="14">Upstream arrivals per 100 ms, log scale ({} tasks, bucket {}, refill {}/s; dashed: refill)</text>"#,
        spec.tasks, spec.capacity, spec.refill
    );
    let refill_per_slot = spec.refill / 10.0;
    for (n, r) in results.iter().enumerate() {
        let top = TOP + PANEL * n as f64;
        let base = top + PANEL - 20.0;
        let y = |v: f64| base - (PANEL - 30.0) * ((1.0 + v).log10() / (1.0 + peak).log10());
        let _ = writeln!(
            s,
            r##"<text x="{LEFT}" y="{}" fill="#333">{}: makespan {:.1} s, {} upstream 429s</text>"##,
            top + 8.0,
            r.strategy.label(),
            r.makespan.as_secs_f64(),
            r.upstream_429
        );
        let mut tick = 1.0;
        while tick <= peak {
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#e5e5e5"/>"##,
                y(tick),
                W - 10.0
            );
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" fill="#666" text-anchor="end">{tick}</text>"##,
                LEFT - 6.0,
                y(tick) + 4.0
            );
            tick *= 10.0;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{base}" x2="{}" y2="{base}" stroke="#999"/>"##,
            W - 10.0
        );
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#c33" stroke-dasharray="4 3"/>"##,
            y(refill_per_slot),
            W - 10.0
        );
        let points: String = r
            .arrivals_per_100ms
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1} ", x(i as f64), y(f64::from(*v))))
            .collect();
        let _ = writeln!(
            s,
            r##"<polyline fill="none" stroke="#1f5fa8" stroke-width="1.2" points="{}"/>"##,
            points.trim_end()
        );
    }
    let seconds = slots as f64 / 10.0;
    let digits = usize::from(seconds < 20.0);
    for t in 0..=10 {
        let sec = seconds * f64::from(t) / 10.0;
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{}" fill="#666" text-anchor="middle">{:.*}s</text>"##,
            x(sec * 10.0),
            height - 8.0,
            digits,
            sec
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::herd::{ModelRun, Scenario, Strategy};
    use std::time::Duration;

    fn run(scenario: Scenario, per_model: Vec<ModelRun>) -> RunResult {
        RunResult {
            strategy: Strategy::OpenAiSdk,
            scenario: Some(scenario),
            tasks: 100,
            bound: Duration::from_secs(2),
            backend_queue_p99: Duration::ZERO,
            makespan: Duration::from_secs(3),
            ok: 90,
            failed: 10,
            abandoned: 2,
            upstream_429: 30,
            rate_429: 20,
            other_429: 10,
            client_429: 30,
            upstream_requests: 130,
            latencies: vec![Duration::from_secs(1); 100],
            per_model,
            arrivals_per_100ms: Vec::new(),
            replicas: 1,
            uneven: false,
            redis_calls: None,
            redis_killed: false,
        }
    }

    #[test]
    fn the_scenario_table_splits_429s_by_cause_and_adds_a_row_per_model() {
        let fast = ModelRun {
            model: "fast",
            tasks: 50,
            failed: 0,
            bound: Duration::ZERO,
            makespan: Duration::from_millis(500),
            median: Duration::from_millis(250),
        };
        let table = scenario_table(&[
            run(Scenario::Overload, Vec::new()),
            run(Scenario::Models, vec![fast]),
        ]);
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 5, "{table}");
        assert_eq!(
            rows[2],
            "| overload | openai SDK alone, no corral | 100 | 10 | 2 | 3.00 | 2.00 | 1.50x | 20 | 20.0% | 10 | 1.00 | 1.00 | 0.00 |"
        );
        assert_eq!(
            rows[4],
            "| models: model fast | openai SDK alone, no corral | 50 | 0 | | 0.50 | 0.00 | - | | | | 0.25 | | |"
        );
    }
}
