//! What a client asks of corral in its request's headers: its deadline (`x-corral-deadline-ms`,
//! or the official SDKs' timeouts) and its priority (`x-corral-priority`).

use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use super::names::{Name, Present};

/// Header a client may send to shorten (never lengthen) the request's deadline. (Header names
/// made once: a `&str` key is parsed and hashed at every lookup.)
pub const DEADLINE_HEADER: HeaderName = HeaderName::from_static("x-corral-deadline-ms");
/// The client's priority for its request: `interactive` or `batch`; corral's, never forwarded.
pub const PRIORITY_HEADER: HeaderName = HeaderName::from_static("x-corral-priority");
/// The official SDKs' timeout for each read, the response head's included, in seconds
/// (openai-python, anthropic-sdk-python); forwarded as sent.
const READ_TIMEOUT_HEADER: HeaderName = HeaderName::from_static("x-stainless-read-timeout");
/// The official SDKs' request timeout, in seconds (anthropic-sdk-python, the TypeScript SDKs).
const TIMEOUT_HEADER: HeaderName = HeaderName::from_static("x-stainless-timeout");

/// How long a client that sent `timeout` (seconds; `60.0`, `600`) waits for the response
/// head: its timeout less a twentieth (at most a second), so corral's answer reaches it before
/// its own clock runs out (that clock starts when it has sent the request, after corral's).
/// `None` for a value that is not a number of seconds of at least a millisecond (anthropic's
/// `NOT_GIVEN`, `1e-9`).
fn client_wait(timeout: &HeaderValue) -> Option<Duration> {
    let secs = timeout.to_str().ok()?.trim().parse::<f64>().ok()?;
    let timeout = Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|t| *t >= Duration::from_millis(1))?;
    Some(timeout - (timeout / 20).min(Duration::from_secs(1)))
}

/// A request's deadlines, both counted from its arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// For the request body and the response head: the configured `deadline`, shortened by
    /// the client's header or its SDK's timeout.
    pub head: Instant,
    /// For the whole exchange, streamed response body included: the client's header, if sent.
    /// (The configured deadline does not cut streams: a long generation is not a hang, and
    /// `stream_idle_timeout` catches the streams that are.)
    pub exchange: Option<Instant>,
}

/// What a client asks of corral in its request's headers (its deadline, its SDK's timeouts,
/// its priority), found with one look at their names: most requests send none of them, and a
/// lookup of each would hash its name for nothing.
pub struct Asks<'a> {
    deadline: Option<&'a HeaderValue>,
    priority: Option<&'a HeaderValue>,
    /// The official SDKs' `x-stainless-read-timeout` and `x-stainless-timeout` (seconds).
    timeouts: [Option<&'a HeaderValue>; 2],
}

impl<'a> Asks<'a> {
    pub fn of(headers: &'a HeaderMap) -> Self {
        let present = Present::of(headers);
        let get = |name: Name, header: HeaderName| {
            present.has(name).then(|| headers.get(header)).flatten()
        };
        Self {
            deadline: get(Name::Deadline, DEADLINE_HEADER),
            priority: get(Name::Priority, PRIORITY_HEADER),
            timeouts: [
                get(Name::ReadTimeout, READ_TIMEOUT_HEADER),
                get(Name::Timeout, TIMEOUT_HEADER),
            ],
        }
    }

    /// The deadlines for a request that arrived at `start`. The head's is the shortest of the
    /// configured `deadline`, the client's `x-corral-deadline-ms` and the wait the official
    /// SDKs say they will give the head (`x-stainless-read-timeout`, `x-stainless-timeout`,
    /// in seconds; [`client_wait`]): an answer after the client has gone is no answer, and a
    /// wait corral knows the client will not see out (a named pause longer than it) is
    /// refused at once with the upstream's word instead.
    pub fn deadlines(&self, start: Instant, configured: Duration) -> Deadlines {
        let asked = self
            .deadline
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_millis);
        let waits = self
            .timeouts
            .iter()
            .flatten()
            .filter_map(|v| client_wait(v));
        let head = asked
            .into_iter()
            .chain(waits)
            .fold(configured, Duration::min);
        Deadlines {
            head: start + head,
            // A deadline beyond what an `Instant` can hold is no deadline.
            exchange: asked.and_then(|a| start.checked_add(a)),
        }
    }

    /// The request's priority: its `x-corral-priority`, else `default`; a value that is
    /// neither `interactive` nor `batch` is refused.
    pub fn priority(
        &self,
        default: crate::config::Priority,
    ) -> Result<crate::config::Priority, crate::error::ProxyError> {
        match self.priority {
            None => Ok(default),
            Some(v) => crate::config::Priority::parse(v.as_bytes())
                .ok_or(crate::error::ProxyError::BadPriority),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::map;
    use super::*;

    #[test]
    fn the_clients_priority_is_read_when_sent_and_refused_when_unknown() {
        use crate::config::Priority;
        let asks = |pairs: &[(&str, &str)]| Asks::of(&map(pairs)).priority(Priority::Interactive);
        assert_eq!(asks(&[("x-other", "1")]).ok(), Some(Priority::Interactive));
        let batch = asks(&[(PRIORITY_HEADER.as_str(), "batch"), ("x-other", "1")]);
        assert_eq!(batch.ok(), Some(Priority::Batch));
        assert!(asks(&[(PRIORITY_HEADER.as_str(), "urgent")]).is_err());
    }

    #[test]
    fn client_deadline_only_shortens_the_head_and_alone_bounds_the_exchange() {
        let start = Instant::now();
        let ten = Duration::from_secs(10);
        let deadline = |start, ten, headers: &HeaderMap| Asks::of(headers).deadlines(start, ten);
        assert_eq!(
            deadline(start, ten, &map(&[("x-other", "1")])),
            Deadlines {
                head: start + ten,
                exchange: None
            }
        );
        let two = start + Duration::from_secs(2);
        assert_eq!(
            deadline(start, ten, &map(&[(DEADLINE_HEADER.as_str(), "2000")])),
            Deadlines {
                head: two,
                exchange: Some(two)
            }
        );
        let long = deadline(start, ten, &map(&[(DEADLINE_HEADER.as_str(), "99000")]));
        assert_eq!(long.head, start + ten);
        assert_eq!(long.exchange, Some(start + Duration::from_secs(99)));
        assert_eq!(
            deadline(start, ten, &map(&[(DEADLINE_HEADER.as_str(), "soon")])),
            Deadlines {
                head: start + ten,
                exchange: None
            }
        );
    }

    #[test]
    fn an_sdks_timeout_shortens_the_head_only() {
        let start = Instant::now();
        let ten = Duration::from_secs(10);
        let head = |pairs: &[(&str, &str)]| Asks::of(&map(pairs)).deadlines(start, ten);
        // openai-python: the read timeout alone; a twentieth off for the way back.
        let read = head(&[("x-stainless-read-timeout", "2.0")]);
        assert_eq!(read.head, start + Duration::from_millis(1900));
        assert_eq!(read.exchange, None);
        // anthropic: both, the shorter wins; a long one loses at most a second.
        let both = head(&[
            ("x-stainless-timeout", "600"),
            ("x-stainless-read-timeout", "4"),
        ]);
        assert_eq!(both.head, start + Duration::from_millis(3800));
        let long = head(&[("x-stainless-read-timeout", "9.5")]);
        assert_eq!(long.head, start + Duration::from_millis(9025));
        // Never longer than configured, nor than the client's own corral header.
        assert_eq!(head(&[("x-stainless-timeout", "600.0")]).head, start + ten);
        let corral = head(&[
            ("x-stainless-read-timeout", "5"),
            (DEADLINE_HEADER.as_str(), "1000"),
        ]);
        assert_eq!(corral.head, start + Duration::from_secs(1));
        // What is not a positive number of seconds is no timeout.
        for odd in ["NOT_GIVEN", "0", "1e-9", "-3", "inf", "NaN", ""] {
            let odd = head(&[("x-stainless-timeout", odd)]);
            assert_eq!(odd.head, start + ten);
        }
    }
}
