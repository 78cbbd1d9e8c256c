//! Retry. Throttles and failures are different things and are bounded differently:
//!
//! - **Throttles wait.** A retryable 429 that says the sender's bucket is empty (rate, or
//!   unknown: `crate::classify::Reason`) is a pacing signal, not a failure. It goes straight back
//!   to the rate limiter below, which the 429 has paused for its hint and which then lets
//!   requests out at the learned rate. Throttle retries do not count against `max_retries`:
//!   each one takes a token from the rate limiter like a first attempt, so they cannot amplify
//!   load while the pacer paces. Those with no wait named by the upstream spend the retry
//!   budget past the first three of a request, in case it does not. They are bounded by the
//!   request's deadline (a wait beyond it, or a per-day quota, is given up at once) and by
//!   `max_throttle_retries`, the last guard.
//! - **Failures are budgeted.** 5xx, overloads (529, and 429s read as overload), connection
//!   failures and per-try timeouts are retried after `hint + U(0, min(floor_jitter, hint/10))`
//!   when the server's hint is at least the jittered backoff, else after the backoff, while
//!   `max_retries`, the retry budget and the deadline allow. A retry the budget cannot pay,
//!   for the first two of a request (the official SDKs' own), is not failed: it waits,
//!   sending nothing, until the upstream serves some request again or the budget can pay, for
//!   up to 16 s: a short outage the client alone would ride out by retrying loses no request,
//!   and still sees only the retries the budget pays for.
//! - **Backoff escalates while nobody is served.** The backoff's exponent counts a request's
//!   failures in a row during which the upstream served no request well. When others were
//!   served meanwhile (an engine refusing one arrival in five, a bad replica behind a balancer)
//!   the failure was that attempt's luck, not an outage: the next retry waits `U(0, base)`
//!   again, not twice as long as the last. An outage (nothing served) escalates as before,
//!   and what retries add is bounded by the budget and the breaker either way.
//!
//! Giving up passes the upstream's last answer through, with `x-should-retry: false` when corral
//! did retry, when the budget refused a retry, or when a throttle's wait is beyond the deadline
//! (so the client's own loop does not multiply the load again), and corral's `retry-after` (its limiter's wait, or the hint it read
//! from a reset header) if the answer carried none. An answer no retry cures that the SDKs
//! would retry (a permanent 429, a 501) goes back at once, marked the same ([`policy::futile`]):
//! against `insufficient_quota` the SDK behind corral spent 10-13 s on two more refusals.
//!
//! Classification (`policy`) is apart from the schedule (`backoff`, `crate::provider`'s hints,
//! the budget), as in Vector's `RetryLogic` vs `FibonacciRetryPolicy`. tower's `Retry` is not
//! used: its policy can't read a response body (needed to tell `insufficient_quota` from a
//! transient 429) or pass the last answer through on giving up; tower's `TpsBudget` is.

pub mod backoff;
mod body;
mod health;
pub mod room;

pub(crate) use self::body::replay;
pub mod policy;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderValue, Response};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

use self::backoff::Backoff;
use self::body::Buffered;
use self::health::{await_health, Probes, SDK_RETRIES};
use self::policy::{futile, judge_response, Verdict};
use self::room::{Room, Waited};
use crate::body::Body;
use crate::classify::{Outcome, Reason, Throttle};
use crate::config::RetryConfig;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};
use crate::sync::lock;

/// Retryable answers' bodies are buffered (to read their error code and to replay them on
/// giving up) up to this size; larger ones pass through unretried.
const MAX_BUFFERED_ERROR: usize = 64 * 1024;

/// The jitter on top of a hint is at most the hint divided by this: 20 ms on a 1 s hint.
/// The spread only keeps retries told the same hint from landing in one instant; pacing
/// them is the rate limiter's work, which every retry passes through again. A wider one is
/// paid in full by a client refused several times whatever its rate (three `retry-after: 1`
/// refusals cost 1.10x the hints at a tenth; the SDKs add no jitter at all).
const HINT_JITTER_SHARE: u32 = 50;

/// State shared by every request to one upstream.
pub struct RetryShared {
    config: RetryConfig,
    backoff: Backoff,
    budget: TpsBudget,
    rng: Mutex<SmallRng>,
    metrics: UpstreamMetrics,
    /// Final answers that were not failures (below 500), across every request: a request that
    /// failed while this moved was unlucky, not facing an outage (backoff does not escalate).
    served: AtomicU64,
    /// Retries waiting for health, and their probes.
    probes: Probes,
    /// Attempts in flight at the upstream (counted by the per-try timeout layer) and retries
    /// waiting for a place (`room`).
    room: Arc<Room>,
}

impl RetryShared {
    /// The RNG is seeded from the OS, once per upstream.
    pub fn new(config: &RetryConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        Self::with_rng(config, metrics, SmallRng::from_os_rng())
    }

    /// With a given RNG (tests seed it).
    pub fn with_rng(config: &RetryConfig, metrics: UpstreamMetrics, rng: SmallRng) -> Arc<Self> {
        Arc::new(Self {
            backoff: Backoff {
                base: config.base.0,
                cap: config.cap.0,
                jitter: config.jitter,
            },
            budget: TpsBudget::new(
                config.budget_ttl.0,
                config.budget_min_per_second,
                config.budget_ratio as f32,
            ),
            rng: Mutex::new(rng),
            config: config.clone(),
            metrics,
            served: AtomicU64::new(0),
            probes: Probes::new(),
            room: Arc::default(),
        })
    }

    /// The room the per-try timeout layer counts attempts on the wire in.
    pub fn room(&self) -> Arc<Room> {
        Arc::clone(&self.room)
    }

    /// Take one retry from the budget for a group's hedge: a hedge is an extra attempt, and
    /// an outage must not multiply load through hedges either.
    pub fn withdraw_for_hedge(&self) -> bool {
        self.budget.withdraw()
    }

    /// `hint` plus up to `floor_jitter` (at most a fiftieth of the hint), so requests told
    /// the same wait do not return at once: a little jitter next to a 30 s hint, and a 1 s
    /// hint is not stretched by half (an admission control refusing each request three times
    /// with `retry-after: 1` cost 1.5x the hints at `floor_jitter`).
    fn after_hint(&self, hint: Duration) -> Duration {
        let spread = self.config.floor_jitter.0.min(hint / HINT_JITTER_SHARE);
        if spread.is_zero() {
            return hint;
        }
        let share = lock(&self.rng).random_range(0.0..1.0);
        hint + spread.mul_f64(share)
    }

    fn sleep_for(&self, retry: u32, previous: Duration, hint: Option<Duration>) -> Duration {
        let mut rng = lock(&self.rng);
        let backoff = self.backoff.sleep(retry, previous, &mut *rng);
        drop(rng);
        match hint {
            Some(hint) if hint >= backoff => self.after_hint(hint),
            _ => backoff,
        }
    }
}

/// Retry as a tower layer.
pub type RetryLayer = SharedLayer<RetryShared>;

impl Middleware for RetryShared {
    fn call<'a, S: Next>(
        self: &'a Arc<Self>,
        next: &'a S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'a {
        run(next, req, self)
    }
}

/// The last retryable answer, kept to pass through when corral gives up.
enum Last {
    /// Head, body, and whether the body was cut (broke mid-way, or the deadline came first).
    Response(http::response::Parts, Bytes, bool),
    Error(ProxyError),
}

/// A retryable answer as the loop reads it.
struct Retryable {
    /// What to pass through on giving up.
    last: Last,
    /// The retry's metric label.
    reason: &'static str,
    /// The upstream's hint, if it gave one.
    hint: Option<Duration>,
    /// The 429's reading, for a throttle.
    throttle: Option<Throttle>,
    /// A 503 that names no wait: perhaps a full queue's refusal (`room`).
    full: bool,
}

/// What the loop waits for before the next attempt.
enum Wait {
    /// A throttle: the rate limiter below paces it.
    Throttle(Duration),
    /// A place freed at a full upstream (`room`): no budget spent.
    Room(Duration),
    /// A failure's backoff; `waited` of it already spent waiting for a place. `unpaid`: the
    /// budget could not pay for the retry, so it goes only once the upstream serves again
    /// ([`await_health`]).
    Failure {
        sleep: Duration,
        waited: Duration,
        unpaid: bool,
    },
}

/// How corral gives up: the arguments of [`give_up`] besides the last answer.
struct GiveUp {
    attempts: u32,
    why: &'static str,
    retry_after: Option<Duration>,
}

/// Throttle retries of one request with no wait named that go without the failure budget.
const UNBUDGETED_THROTTLES: u32 = 3;

/// One request's retries so far, by kind, and what its backoff remembers.
#[derive(Default)]
struct Tally {
    /// Failures retried (bounded by `max_retries` and the budget).
    retries: u32,
    /// Throttles retried (bounded by the deadline and `max_throttle_retries`).
    throttles: u32,
    /// Refusals for lack of room retried after a place freed (bounded like throttles).
    rooms: u32,
    /// The backoff's exponent: failures in a row while no other request was served.
    rung: u32,
    /// Failures retried that the budget could not pay (they waited for health).
    unpaid: u32,
    /// The last failure's or throttle's wait.
    previous: Duration,
}

impl Tally {
    fn attempts(&self) -> u32 {
        self.retries + self.throttles + self.rooms
    }

    /// What to wait for before retrying `answer`, or how to give up on it.
    async fn next_wait(
        &self,
        answer: &Retryable,
        req: &ProxyRequest,
        shared: &RetryShared,
    ) -> Result<Wait, GiveUp> {
        let (attempts, hint) = (self.attempts(), answer.hint);
        match &answer.throttle {
            Some(t) => {
                throttle_sleep(t, hint, self.throttles, attempts, req, shared).map(Wait::Throttle)
            }
            None if answer.full
                && self.rooms < shared.config.max_throttle_retries
                && shared.room.holds_others() =>
            {
                room_wait(self, req, shared).await
            }
            None => {
                failure_sleep(hint, self, attempts, shared).map(|(sleep, unpaid)| Wait::Failure {
                    sleep,
                    waited: Duration::ZERO,
                    unpaid,
                })
            }
        }
    }

    /// Count the retry `wait` led to (`waited` in all).
    fn count(&mut self, wait: &Wait, waited: Duration) {
        match *wait {
            Wait::Throttle(sleep) => {
                self.throttles += 1;
                self.previous = sleep;
            }
            Wait::Room(_) => self.rooms += 1,
            Wait::Failure { unpaid, .. } => {
                self.retries += 1;
                self.unpaid += u32::from(unpaid);
                self.rung += 1;
                self.previous = waited;
            }
        }
    }
}

/// Send the request, then judge the answer (`read_response`, `read_error`), then wait
/// (`Tally::next_wait`: a throttle's, a place's or a failure's) and send it again, until an
/// answer is final or a bound gives up.
async fn run<S: Next>(inner: &S, req: ProxyRequest, shared: &RetryShared) -> Answer {
    let metrics = &shared.metrics;
    shared.budget.deposit();
    let mut tally = Tally::default();
    // The count of requests served when the last answer was judged.
    let mut served = shared.served.load(Ordering::Relaxed);
    let mut previous_answer: Option<Last> = None;
    loop {
        let attempts = tally.attempts();
        let result = inner.send(req.clone()).await;
        let answer = match result {
            Ok(response) => match read_response(response, &req, shared).await {
                Ok(retryable) => retryable,
                Err(done) => {
                    if !done.status().is_server_error() {
                        shared.served.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(done);
                }
            },
            Err(e) => match read_error(e) {
                Ok(retryable) => retryable,
                // corral's own refusal (deadline, breaker, rate limit) after an earlier upstream
                // answer: the client gets that answer, not corral's, with corral's Retry-After
                // if the answer had none. A deadline that ends an attempt under way is counted
                // as one that ends the wait between attempts: the same `deadline`.
                Err(e) => {
                    let why = match e {
                        ProxyError::DeadlineExceeded => "deadline",
                        _ => e.label(),
                    };
                    return match previous_answer {
                        Some(last) => give_up(last, attempts, why, e.retry_after(), shared),
                        None => Err(e),
                    };
                }
            },
        };
        let now_served = shared.served.load(Ordering::Relaxed);
        if now_served != served {
            // Others were served since this request's last failure: this one was its own luck.
            tally.rung = 0;
            served = now_served;
        }
        let wait = match tally.next_wait(&answer, &req, shared).await {
            Ok(wait) => wait,
            Err(g) => return give_up(answer.last, g.attempts, g.why, g.retry_after, shared),
        };
        let Retryable {
            last,
            reason,
            hint,
            throttle,
            ..
        } = answer;
        let (sleep, waited) = match wait {
            Wait::Throttle(sleep) => (sleep, sleep),
            Wait::Room(waited) => (Duration::ZERO, waited),
            Wait::Failure { sleep, waited, .. } => {
                (sleep.saturating_sub(waited), sleep.max(waited))
            }
        };
        if Instant::now() + sleep >= req.ctx().deadline {
            // A throttle the deadline cannot wait for is marked even on its first answer: the
            // client's own loop would only meet the same limit.
            let marked = attempts + u32::from(throttle.is_some());
            return give_up(last, marked, "deadline", hint, shared);
        }
        metrics.retry(reason);
        metrics.backoff.observe(waited.as_secs_f64());
        if let Some(h) = hint {
            metrics.hints_honoured.inc();
            metrics.hint_seconds.inc_by(h.as_secs_f64());
        }
        tracing::debug!(
            upstream = metrics.name(),
            reason,
            retry = attempts + 1,
            sleep_ms = waited.as_millis() as u64,
            "retrying"
        );
        tokio::time::sleep(sleep).await;
        if matches!(wait, Wait::Failure { unpaid: true, .. })
            && !await_health(served, tally.rung, tally.unpaid == 0, &req, shared).await
        {
            return give_up(last, attempts + 1, "budget", None, shared);
        }
        previous_answer = Some(last);
        tally.count(&wait, waited);
    }
}

/// A 503 naming no wait while the upstream holds other attempts: wait for a place (`room`);
/// if it is not a full queue draining, the failure path decides, the wait counted as its
/// backoff.
async fn room_wait(
    tally: &Tally,
    req: &ProxyRequest,
    shared: &RetryShared,
) -> Result<Wait, GiveUp> {
    let attempts = tally.attempts();
    let backoff = shared.sleep_for(tally.rung, tally.previous, None);
    let patience = shared.room.patience(backoff, shared.config.base.0 * 2);
    let start = Instant::now();
    let waited = shared
        .room
        .wait(backoff, patience, req.ctx().deadline)
        .await;
    match waited {
        Waited::Freed => Ok(Wait::Room(start.elapsed())),
        // The failure path's bounds (`max_retries`, the budget) decide; the wait was its
        // backoff.
        Waited::Silent => failure_sleep(None, tally, attempts, shared).map(|(_, unpaid)| {
            let waited = start.elapsed();
            Wait::Failure {
                sleep: waited,
                waited,
                unpaid,
            }
        }),
        Waited::Deadline => Err(GiveUp {
            attempts,
            why: "deadline",
            retry_after: None,
        }),
    }
}

/// An upstream's answer: `Err` with what to hand the client when it is final (not retryable,
/// too large to judge, or judged done), else its body buffered and read for the retry.
async fn read_response(
    response: Response<Body>,
    req: &ProxyRequest,
    shared: &RetryShared,
) -> Result<Retryable, Response<Body>> {
    if !may_retry(&response) {
        return Err(response);
    }
    // Bounded by the deadline: a body that stalls is cut there, and the loop then gives up
    // with what arrived.
    let (parts, bytes, cut) = match buffer_error(response, req.ctx().deadline).await {
        Ok(buffered) => buffered,
        Err(whole) => return Err(whole),
    };
    if cut {
        tracing::debug!(
            upstream = shared.metrics.name(),
            status = parts.status.as_u16(),
            received = bytes.len(),
            "retryable answer's body cut (broken, or the deadline passed)"
        );
    }
    match judge_response(&parts, &bytes, &shared.config) {
        Verdict::Done => {
            let mut parts = parts;
            if shared.config.mark_given_up && futile(&parts) {
                parts
                    .headers
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            Err(body::replay(parts, bytes, cut))
        }
        Verdict::Retry(reason) => {
            // A 429 the rate limiter read carries its reading (hints from the body
            // included); anything else is read from its headers here.
            let read = parts.extensions.get::<Throttle>().copied();
            let hint = read.map_or_else(
                || crate::provider::retry_hint(&parts.headers, SystemTime::now()),
                |t| t.hint,
            );
            let outcome = Outcome::of_head(parts.status, &parts.extensions);
            let full = outcome == Outcome::ServerError(503) && hint.is_none();
            let throttle = match outcome {
                Outcome::Throttled(_) => Some(read.unwrap_or(Throttle {
                    reason: Reason::Unknown,
                    hint,
                    named: false,
                    own_wait: false,
                })),
                _ => None,
            };
            Ok(Retryable {
                last: Last::Response(parts, bytes, cut),
                reason,
                hint,
                throttle,
                full,
            })
        }
    }
}

/// An attempt's error: a retryable one (a per-try timeout, a connection failure) read for the
/// retry; any other (corral's own refusal) back as `Err`.
fn read_error(e: ProxyError) -> Result<Retryable, ProxyError> {
    if !e.is_retryable() {
        return Err(e);
    }
    let reason = if matches!(e, ProxyError::TryTimeout { .. }) {
        "timeout"
    } else {
        "connection"
    };
    Ok(Retryable {
        last: Last::Error(e),
        reason,
        hint: None,
        throttle: None,
        full: false,
    })
}

/// The wait before retrying a throttle, or how to give up on it.
fn throttle_sleep(
    throttle: &Throttle,
    hint: Option<Duration>,
    throttles: u32,
    attempts: u32,
    req: &ProxyRequest,
    shared: &RetryShared,
) -> Result<Duration, GiveUp> {
    let Throttle {
        reason, own_wait, ..
    } = *throttle;
    // A throttle is a pacing signal: the rate limiter below owns the wait (a 429 pauses
    // the partition for its hint, then the pacers let requests out at the learned rate),
    // so a retried 429 goes straight back to it. Each retry takes a token there like a
    // first attempt, so retrying throttles cannot add load; the deadline bounds them.
    if throttles >= shared.config.max_throttle_retries {
        return Err(GiveUp {
            attempts,
            why: "max_throttle_retries",
            retry_after: None,
        });
    }
    // A retry with no wait the upstream named relies on the pacer below alone. Past the first
    // few of one request it spends the failure budget too: when the pacer was wrong (a fleet
    // replica's cut that raised its own pace), nothing else bounded them, and each of 350
    // requests made its 50 at once, 20,000 into a bucket of 20 a second.
    if hint.is_none() && throttles >= UNBUDGETED_THROTTLES && !shared.budget.withdraw() {
        shared.metrics.budget_exhausted.inc();
        return Err(GiveUp {
            attempts: attempts + 1,
            why: "budget",
            retry_after: None,
        });
    }
    // The rate limiter enforces the hint; here only: can the deadline cover it? A
    // per-day quota cannot be waited for even without a hint.
    let beyond = hint.is_some_and(|h| Instant::now() + h >= req.ctx().deadline);
    if beyond || reason == Reason::LongWindow {
        return Err(GiveUp {
            attempts: attempts + 1,
            why: "deadline",
            retry_after: hint,
        });
    }
    Ok(match hint.filter(|_| own_wait) {
        // The wait is this request's own (the partition goes on): it waits it here,
        // spread a little as a hint is.
        Some(wait) => shared.after_hint(wait),
        None => Duration::ZERO,
    })
}

/// The wait before retrying a failure, and whether the budget could not pay for it; or how
/// to give up on it. A failure, an overload (529, or a 429 read as overload) among them: the
/// whole service is unwell, no bucket to wait for: back off (`rung`: the backoff's exponent)
/// within the failure budget.
fn failure_sleep(
    hint: Option<Duration>,
    tally: &Tally,
    attempts: u32,
    shared: &RetryShared,
) -> Result<(Duration, bool), GiveUp> {
    if tally.retries >= shared.config.max_retries {
        return Err(GiveUp {
            attempts,
            why: "max_retries",
            retry_after: None,
        });
    }
    let paid = shared.budget.withdraw();
    if !paid {
        shared.metrics.budget_exhausted.inc();
        // For as many as the official SDKs' own retries (two), a retry the budget cannot pay waits
        // for the upstream to serve again instead of failing: the client alone would have
        // retried after a second or two and been served once a short outage ended, and
        // waiting adds no load. Past them it gives up, marked even on a first answer: the
        // budget holds back the load an outage's retries would add, and the client's own
        // retries would add it all the same.
        if tally.unpaid >= SDK_RETRIES {
            return Err(GiveUp {
                attempts: attempts + 1,
                why: "budget",
                retry_after: None,
            });
        }
    }
    Ok((shared.sleep_for(tally.rung, tally.previous, hint), !paid))
}

/// Whether a 429 is permanent (no wait cures it: see [`policy::judge_response`]), judged from
/// its body, which is buffered for that (up to [`MAX_BUFFERED_ERROR`], within `deadline`) and
/// handed back replayed. Any other answer is not, and comes back untouched.
pub async fn permanent_429(
    response: Response<Body>,
    config: &RetryConfig,
    deadline: Instant,
) -> (bool, Response<Body>) {
    if response.status() != http::StatusCode::TOO_MANY_REQUESTS {
        return (false, response);
    }
    let (parts, bytes, cut) = match buffer_error(response, deadline).await {
        Ok(buffered) => buffered,
        Err(whole) => return (false, whole),
    };
    let permanent = crate::classify::is_permanent_answer(&parts, &bytes, config);
    (permanent, body::replay(parts, bytes, cut))
}

/// An error answer's body buffered to be judged (up to [`MAX_BUFFERED_ERROR`], cut at
/// `deadline`): its head, bytes and whether they were cut; or, too large to hold, the answer
/// whole again.
pub(crate) async fn buffer_error(
    response: Response<Body>,
    deadline: Instant,
) -> Result<(http::response::Parts, Bytes, bool), Response<Body>> {
    let (parts, body) = response.into_parts();
    match body::buffer(body, MAX_BUFFERED_ERROR, deadline).await {
        Buffered::Whole(bytes) => Ok((parts, bytes, false)),
        Buffered::Cut(bytes) => Ok((parts, bytes, true)),
        Buffered::TooLarge(whole) => Err(Response::from_parts(parts, whole)),
    }
}

/// Worth buffering the body to judge: a retryable status, or an upstream that says to retry.
fn may_retry(response: &Response<Body>) -> bool {
    let status = response.status().as_u16();
    matches!(status, 408 | 409 | 429 | 500..=599)
        || crate::classify::should_retry_header(response.headers()) == Some(true)
}

/// Pass the last answer through. `attempts > 0` (corral retried, the budget refused a retry, or
/// a throttle's wait is beyond the deadline): mark it so the SDKs don't retry again; add
/// `retry_after` if the answer has no Retry-After.
fn give_up(
    last: Last,
    attempts: u32,
    why: &'static str,
    retry_after: Option<Duration>,
    shared: &RetryShared,
) -> Result<Response<Body>, ProxyError> {
    shared.metrics.gave_up(why);
    match last {
        Last::Response(mut parts, bytes, cut) => {
            if attempts > 0 && shared.config.mark_given_up {
                parts
                    .headers
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            if let Some(after) = retry_after {
                if !parts.headers.contains_key(RETRY_AFTER) {
                    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
                    parts
                        .headers
                        .insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
                }
            }
            Ok(body::replay(parts, bytes, cut))
        }
        Last::Error(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
