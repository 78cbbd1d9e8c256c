//! The group driver: a request to a group through its members in turn ([`Group::forward`]),
//! each attempt hedged when the group says so, each member's answer judged for whether the
//! request moves on (a permanent 429, a stream whose first event is an `error`).

use std::net::SocketAddr;
use std::time::Duration;

use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{Fallback, Group};
use crate::body::{self, Body};
use crate::config::Priority;
use crate::error::ProxyError;
use crate::forward;
use crate::forward::buffer::{self, BodyBounds, BufferBudget};
use crate::upstream::{Attempt, SendResult, Tally};

/// What one group member made of a request.
struct MemberOutcome {
    result: SendResult,
    /// Why the request goes on to the next member, if it does.
    why: Option<Fallback>,
}

/// A group's request as every member gets it (each adds its URI, headers and model).
struct GroupRequest<'a> {
    parts: &'a http::request::Parts,
    body: &'a bytes::Bytes,
    /// Per member, its copy of the body with its `model` (see [`Group::member_body`]).
    copies: Vec<tokio::sync::OnceCell<(bytes::Bytes, buffer::Held)>>,
    budget: &'a BufferBudget,
    deadlines: forward::Deadlines,
    priority: Priority,
    peer: SocketAddr,
    start: Instant,
}

/// What [`Group::hedged`] decided: the attempt that decided, whose it is, and whether a hedge
/// went (at most one goes per request).
struct Hedged {
    decided: MemberOutcome,
    /// The member whose attempt decided.
    member: usize,
    hedge_sent: bool,
}

impl Hedged {
    fn unhedged(decided: MemberOutcome, member: usize) -> Self {
        Self {
            decided,
            member,
            hedge_sent: false,
        }
    }

    fn sent(decided: MemberOutcome, member: usize) -> Self {
        Self {
            decided,
            member,
            hedge_sent: true,
        }
    }
}

fn is_event_stream(response: &Response<Body>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Read a stream's first frame (given back in front of the rest), and whether it is an SSE
/// `error` event: a failure before any content, such as Anthropic's `overloaded_error`.
async fn first_event(response: Response<Body>) -> (Response<Body>, bool) {
    use http_body_util::BodyExt;
    let (parts, mut body) = response.into_parts();
    match body.frame().await {
        Some(Ok(frame)) => {
            let error = frame
                .data_ref()
                .is_some_and(|d| crate::classify::is_error_event(d));
            let body = body::Prepended::wrap(frame, body);
            (Response::from_parts(parts, body), error)
        }
        Some(Err(e)) => (Response::from_parts(parts, body::Prepended::fail(e)), true),
        None => (
            Response::from_parts(parts, body::full(bytes::Bytes::new())),
            false,
        ),
    }
}

impl Group {
    /// A request to this group: the body read once (under the first member's bounds, its room
    /// taken from `budget`), then each member in turn until one answers for good, each attempt
    /// hedged when the group says so. Also returns the member that answered (or refused last),
    /// for `x-corral-upstream`.
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        start: Instant,
        budget: &BufferBudget,
    ) -> (SendResult, Option<&str>) {
        self.arrived();
        let first = &self.members[0].upstream;
        let (parts, incoming) = req.into_parts();
        let asks = forward::Asks::of(&parts.headers);
        let deadlines = asks.deadlines(start, first.deadline);
        let default = self.priority.unwrap_or(first.config.priority);
        let priority = match asks.priority(default) {
            Ok(p) => p,
            Err(e) => return (Err(first.refuse(&parts.method, e)), Some(&first.name)),
        };
        let bounds = BodyBounds {
            limit: first.body_limit,
            idle: first.body_idle_timeout,
            deadline: deadlines.head,
        };
        let read = buffer::read_body(incoming, bounds, budget).await;
        let (body, held) = match read {
            Ok(read) => read,
            Err(e) => return (Err(first.refuse(&parts.method, e)), Some(&first.name)),
        };
        let req = GroupRequest {
            parts: &parts,
            body: &body,
            copies: self.members.iter().map(|_| Default::default()).collect(),
            budget,
            deadlines,
            priority,
            peer,
            start,
        };
        let mut tally = Tally::default();
        let last = self.members.len() - 1;
        let mut i = 0;
        let repeatable = self.repeatable(&parts);
        // At most one hedge per request, however many members it goes through; none for a
        // request that is not safe to send twice.
        let mut may_hedge = repeatable;
        while i <= last {
            let now = Instant::now();
            if self.passed_over(i, now) {
                self.fell_back(i, Fallback::Unavailable, now);
                i += 1;
                continue;
            }
            let (tried, who) = match self.hedge_delay(i).filter(|_| may_hedge) {
                Some(delay) => {
                    let hedged = self.hedged(i, delay, &req).await;
                    may_hedge = !hedged.hedge_sent;
                    (hedged.decided, hedged.member)
                }
                None => (self.try_member(i, &req).await, i),
            };
            let t = match &tried.result {
                Ok((_, t)) | Err((_, t)) => *t,
            };
            tally.attempts += t.attempts;
            tally.held = tally.held.max(t.held);
            // A request not safe to send twice moves on only from a member that certainly did
            // not act on it.
            let why = tried.why.filter(|_| repeatable || !t.reached);
            if let (Some(why), None, true) = (tried.why, why, who < last) {
                self.stayed(who, why);
            }
            match why {
                Some(why) if who < last => {
                    self.fell_back(who, why, Instant::now());
                    i = who + 1;
                }
                _ => {
                    drop(held);
                    self.answered(who);
                    let result = match tried.result {
                        Ok((response, _)) => Ok((response, tally)),
                        Err((e, _)) => Err((e, tally)),
                    };
                    return (result, Some(&self.members[who].upstream.name));
                }
            }
        }
        unreachable!("the last member is never passed over, and always answers")
    }

    /// An attempt on member `i`, and after `delay` without an answer for good, a hedge on the
    /// next usable member (the same one when `i` is the last) if the group's ratio and the
    /// member's retry budget allow: the first answer for good wins and the other attempt is
    /// dropped at once (cancelled). Returns what decided, whose it is, and whether a hedge went.
    async fn hedged(&self, i: usize, delay: Duration, req: &GroupRequest<'_>) -> Hedged {
        let mut first = std::pin::pin!(self.try_member(i, req));
        tokio::select! {
            tried = &mut first => return Hedged::unhedged(tried, i),
            () = tokio::time::sleep(delay) => {}
        }
        let j = self.hedge_target(i, Instant::now());
        if !self.take_hedge(j) {
            return Hedged::unhedged(first.await, i);
        }
        let mut second = std::pin::pin!(self.try_member(j, req));
        let (tried, who, first_pending) = tokio::select! {
            tried = &mut first => (tried, i, false),
            tried = &mut second => (tried, j, true),
        };
        if tried.why.is_none() {
            self.cancelled();
            if first_pending {
                self.hedge_won();
            }
            return Hedged::sent(tried, who);
        }
        // The first to answer failed; the other may still answer for good.
        let (other, other_who) = if first_pending {
            (first.await, i)
        } else {
            (second.await, j)
        };
        if other.why.is_none() {
            if other_who == j && i != j {
                self.hedge_won();
            }
            // The failed attempt's member is fallen back from all the same (a permanent 429
            // starts its cool-down), unless both attempts went to the one member.
            if let (Some(why), true) = (tried.why, who != other_who) {
                self.fell_back(who, why, Instant::now());
            }
            return Hedged::sent(other, other_who);
        }
        // Both failed: the request goes on after the later member, the earlier fallen back.
        let ((earlier, e_who), later) = if who < other_who {
            ((tried, who), (other, other_who))
        } else {
            ((other, other_who), (tried, who))
        };
        if e_who < later.1 {
            if let Some(why) = earlier.why {
                self.fell_back(e_who, why, Instant::now());
            }
        }
        Hedged::sent(later.0, later.1)
    }

    /// The request on member `i`: its URI, headers and (with `model`) body, through its stack;
    /// then whether the answer sends the request on to the next member, and why. A stream's
    /// first event is awaited on a member with a next one: an `error` event before any content
    /// (Anthropic's `overloaded_error`) is a failure, not an answer.
    async fn try_member(&self, i: usize, req: &GroupRequest<'_>) -> MemberOutcome {
        let member = &self.members[i];
        let upstream = &member.upstream;
        let path = req.parts.uri.path();
        let Some(uri) = upstream.target_of(&self.route, &req.parts.uri) else {
            let e = ProxyError::NoRoute(path.chars().take(256).collect());
            return MemberOutcome {
                result: Err((e, Tally::default())),
                why: None,
            };
        };
        let body = self.member_body(i, req.body, &req.copies[i], req.budget, req.deadlines.head);
        let body = match body.await {
            Ok(body) => body,
            Err(e) => {
                // No room for this member's copy: the next member may need none.
                return MemberOutcome {
                    result: Err(upstream.refuse(&req.parts.method, e)),
                    why: Some(Fallback::NoCapacity),
                };
            }
        };
        let now = Instant::now();
        let attempt = Attempt {
            method: req.parts.method.clone(),
            headers: req.parts.headers.clone(),
            withheld: &member.withheld,
            uri,
            body,
            deadlines: req.deadlines,
            wait_deadline: self.wait_deadline(i, now, req.deadlines.head),
            priority: req.priority,
        };
        let result = upstream.send(attempt, req.peer, req.start).await;
        let took = now.elapsed();
        let (response, tally) = match result {
            Ok(ok) => ok,
            Err((e, t)) => {
                let why = Fallback::of_error(&e);
                return MemberOutcome {
                    result: Err((e, t)),
                    why,
                };
            }
        };
        let status = response.status();
        let mut why = Fallback::of_status(status.as_u16());
        let response = if why.is_some() && status == StatusCode::TOO_MANY_REQUESTS {
            // A 429 that no wait cures sets the member aside for the group's cool-down.
            let retry = &upstream.config.retry;
            let (permanent, response) =
                crate::stack::retry::permanent_429(response, retry, req.deadlines.head).await;
            if permanent {
                why = Some(Fallback::Permanent429);
            }
            response
        } else if status == StatusCode::OK
            && i + 1 < self.members.len()
            && is_event_stream(&response)
        {
            let (response, error_first) = first_event(response).await;
            if error_first {
                why = Some(Fallback::Failed);
            }
            response
        } else {
            response
        };
        if why.is_none() {
            // This attempt's own time to an answer, for `hedge_after = "p95"`. (An attempt
            // cancelled because another won is not counted: its time is unknown.)
            self.record_head(i, took);
        }
        MemberOutcome {
            result: Ok((response, tally)),
            why,
        }
    }
}
