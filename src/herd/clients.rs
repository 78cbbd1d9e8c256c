//! The herd's clients: each task posts one request and retries it (or not) as its strategy
//! says: never (clients of corral), a hand-written backoff loop, or the openai SDK's policy
//! (`sdk`). A task that waits longer than its world's patience is abandoned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::sdk::{self, SdkPolicy};
use super::World;
use crate::stack::retry::backoff::Backoff;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How a client treats a failed attempt.
#[derive(Debug, Clone, Copy)]
pub(super) enum Retries {
    /// Never retries (clients of corral).
    Never,
    /// A hand-written loop: `backoff` between attempts, Retry-After ignored.
    HandWritten { backoff: Backoff, max_retries: u32 },
    /// openai-python's default policy, its own backoff divided by `scale`.
    Sdk { policy: SdkPolicy, scale: f64 },
}

/// What became of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TaskOutcome {
    /// It got a 200.
    pub ok: bool,
    /// From the start to its last answer (or to when it gave up).
    pub latency: Duration,
    /// It gave up waiting after the world's patience.
    pub abandoned: bool,
    /// The model it named, as an index into the world's models (0 when it has none).
    pub model: usize,
}

/// Fires the world's tasks at once at `targets` and returns what became of each, in task
/// order; a task still waiting after the world's patience is abandoned.
pub(super) async fn fire(
    world: &World,
    targets: &[String],
    uneven: bool,
    retries: Retries,
    client_429: &Arc<AtomicU64>,
    start: Instant,
) -> std::io::Result<Vec<TaskOutcome>> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let n = targets.len();
    let handles: Vec<_> = (0..world.tasks)
        .map(|i| {
            // Uneven: every other client goes to the first corral, the rest round the others.
            let target = if uneven {
                if i % 2 == 0 {
                    targets[0].clone()
                } else {
                    targets[1 + (i / 2) % (n - 1)].clone()
                }
            } else {
                targets[i % n].clone()
            };
            let index = model_of(i, n, world.models.len());
            let model = world.models.get(index).map_or("sim", |m| m.name);
            // Nine characters of content: every request costs the same tokens.
            let body = Bytes::from(format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"task {:04}"}}],"max_tokens":16}}"#,
                i % 10_000
            ));
            let (client, client_429) = (client.clone(), Arc::clone(client_429));
            let patience = world.patience;
            tokio::spawn(async move {
                let done = task(&client, &target, body, retries, &client_429);
                let finished = tokio::time::timeout(patience, done).await;
                TaskOutcome {
                    ok: finished == Ok(true),
                    latency: start.elapsed(),
                    abandoned: finished.is_err(),
                    model: index,
                }
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(world.tasks);
    for h in handles {
        outcomes.push(h.await.map_err(std::io::Error::other)?);
    }
    Ok(outcomes)
}

/// The model task `i` names among `models` (0 when there are none), with `corrals` behind
/// the clients: the models alternate by round of the corrals, not by task, so every corral
/// serves every model. By task, with two models and an even number of corrals each corral
/// served one model alone: the per-model figures took the fleet's corrals for models.
fn model_of(i: usize, corrals: usize, models: usize) -> usize {
    (i / corrals.max(1)) % models.max(1)
}

/// One client's request, retried as `retries` says; whether it got a 200.
async fn task(
    client: &HttpClient,
    target: &str,
    body: Bytes,
    retries: Retries,
    client_429: &AtomicU64,
) -> bool {
    let mut rng = SmallRng::from_os_rng();
    let mut previous = Duration::ZERO;
    let mut attempt = 0;
    loop {
        let count = matches!(retries, Retries::Sdk { .. }).then_some(attempt);
        let answer = post(client, target, body.clone(), count).await;
        let status = answer.as_ref().map(|(status, _)| *status);
        if status == Some(200) {
            return true;
        }
        if status == Some(429) {
            client_429.fetch_add(1, Ordering::Relaxed);
        }
        let sleep = match retries {
            Retries::Never => return false,
            Retries::HandWritten {
                backoff,
                max_retries,
            } => {
                if attempt >= max_retries {
                    return false;
                }
                backoff.sleep(attempt, previous, &mut rng)
            }
            Retries::Sdk { policy, scale } => {
                if attempt >= policy.max_retries {
                    return false;
                }
                let now = SystemTime::now();
                let headers = answer.as_ref().map(|(_, headers)| headers);
                if let Some((status, headers)) = &answer {
                    if !policy.should_retry(*status, headers, now) {
                        return false;
                    }
                }
                let hint = headers.and_then(|h| sdk::retry_after(h, now));
                match policy.wait(attempt, hint, rng.random()) {
                    sdk::Wait::Hinted(wait) => wait,
                    sdk::Wait::Backoff(wait) => wait.div_f64(scale),
                }
            }
        };
        tokio::time::sleep(sleep).await;
        previous = sleep;
        attempt += 1;
    }
}

/// POST (with `x-stainless-retry-count` when given, as the official SDKs send it) and drain
/// the answer: its status and headers, `None` when the connection failed.
async fn post(
    client: &HttpClient,
    url: &str,
    body: Bytes,
    retry_count: Option<u32>,
) -> Option<(u16, http::HeaderMap)> {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    if let Some(n) = retry_count {
        req = req.header("x-stainless-retry-count", n);
    }
    let req = req.body(Full::new(body)).ok()?;
    let response = client.request(req).await.ok()?;
    let (parts, body) = response.into_parts();
    let _ = body.collect().await;
    Some((parts.status.as_u16(), parts.headers))
}

#[cfg(test)]
mod tests {
    use super::model_of;

    #[test]
    fn every_corral_serves_every_model() {
        for corrals in 1..=4 {
            for corral in 0..corrals {
                let models: Vec<usize> = (0..48)
                    .filter(|i| i % corrals == corral)
                    .map(|i| model_of(i, corrals, 2))
                    .collect();
                assert_eq!(
                    models.iter().filter(|&&m| m == 0).count(),
                    24 / corrals,
                    "{corrals} corrals, corral {corral}: {models:?}"
                );
            }
        }
        assert_eq!(model_of(7, 4, 0), 0, "no models: the one");
    }
}
