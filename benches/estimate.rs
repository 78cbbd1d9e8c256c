//! Throughput of the token estimate (`corral::stack::rate_limit::estimate::estimate_tokens`),
//! which runs on every attempt once a tokens-per-minute bucket exists, against the tree-based
//! version it replaced (a whole `serde_json::Value` per body, kept in `estimate::reference`).
//!
//! Run: `cargo bench --bench estimate` (release build; about 7 s once built). It builds
//! chat-completions bodies whose prompts total 10 KB, 100 KB and 1 MB of text in 8 KB messages
//! (mostly ASCII words, some two- to four-byte characters, newlines and quotes that JSON escapes
//! as `\n` and `\"`), runs each function on each body for about a second, and prints body MB/s
//! (10^6 bytes of the whole body) and ns per call. Time only: allocations are not counted here
//! (a counting allocator needs `unsafe`, which the crate forbids).
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it only checks that both functions
//! agree on the bodies, so CI does not spend the seconds.

use std::hint::black_box;
use std::time::{Duration, Instant};

use corral::stack::rate_limit::estimate::estimate_tokens;
use corral::stack::rate_limit::estimate::reference::estimate_tokens_tree;
use serde_json::json;

/// About `bytes` of prose from a fixed seed: words, a non-ASCII one in ~12, a newline in ~10,
/// a quoted word in ~25.
fn prose(bytes: usize, seed: &mut u64) -> String {
    const WORDS: [&str; 12] = [
        "the", "request", "limit", "tokens", "model", "answer", "proxy", "upstream", "retry",
        "bucket", "minute", "budget",
    ];
    const WIDE: [&str; 5] = ["café", "naïve", "日本語", "—", "😀"];
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let r = (*seed >> 33) as usize;
        match r % 100 {
            0..=7 => out.push_str(WIDE[r / 100 % WIDE.len()]),
            8..=11 => {
                out.push('"');
                out.push_str(WORDS[r / 100 % WORDS.len()]);
                out.push('"');
            }
            _ => out.push_str(WORDS[r / 100 % WORDS.len()]),
        }
        out.push(if r.is_multiple_of(10) { '\n' } else { ' ' });
    }
    out
}

/// A chat-completions body whose messages hold about `prompt_bytes` of text, 8 KB a message.
fn chat_body(prompt_bytes: usize) -> Vec<u8> {
    let mut seed = 42;
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant."})];
    let mut left = prompt_bytes;
    while left > 0 {
        let n = left.min(8 * 1024);
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(json!({"role": role, "content": prose(n, &mut seed)}));
        left -= n;
    }
    serde_json::to_vec(&json!({
        "model": "gpt-4o-mini",
        "messages": messages,
        "temperature": 0.2,
        "max_tokens": 512,
        "stream": true,
    }))
    .unwrap()
}

/// An estimate function: body and default completion budget to tokens.
type Estimate = fn(&[u8], u32) -> u32;

/// Runs `f` on `body` for about `budget`, returning the mean time per call.
fn time_per_call(f: Estimate, body: &[u8], budget: Duration) -> Duration {
    // Calibrate: double the count until a batch takes a twentieth of the budget.
    let mut n = 1u32;
    let batch = loop {
        let start = Instant::now();
        for _ in 0..n {
            black_box(f(black_box(body), 256));
        }
        let took = start.elapsed();
        if took >= budget / 20 {
            break took / n;
        }
        n *= 2;
    };
    let iters = (budget.as_nanos() / batch.as_nanos().max(1)).max(1) as u32;
    let start = Instant::now();
    for _ in 0..iters {
        black_box(f(black_box(body), 256));
    }
    start.elapsed() / iters
}

fn main() {
    let sizes = [("10 KB", 10_000), ("100 KB", 100_000), ("1 MB", 1_000_000)];
    let bodies: Vec<_> = sizes.iter().map(|&(_, n)| chat_body(n)).collect();
    for body in &bodies {
        assert_eq!(
            estimate_tokens(body, 256),
            estimate_tokens_tree(body, 256),
            "the estimate and the baseline disagree"
        );
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "estimate: {} bodies agree with the baseline; `cargo bench --bench estimate` measures",
            bodies.len()
        );
        return;
    }

    println!("| prompt | body bytes | function | MB/s | ns/call |");
    println!("| --- | ---: | --- | ---: | ---: |");
    let functions: [(&str, Estimate); 2] = [
        ("estimate_tokens (visitors)", estimate_tokens),
        ("baseline: Value tree", estimate_tokens_tree),
    ];
    for ((label, _), body) in sizes.iter().zip(&bodies) {
        for (name, f) in functions {
            let per_call = time_per_call(f, body, Duration::from_secs(1));
            let mb_s = body.len() as f64 / per_call.as_secs_f64() / 1e6;
            println!(
                "| {label} | {} | {name} | {mb_s:.0} | {} |",
                body.len(),
                per_call.as_nanos()
            );
        }
    }
}
