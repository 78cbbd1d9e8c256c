//! What the upstream counted: the token usage an answer reports, noticed while the answer goes
//! through to the client, so that the rate limiter can settle its estimate (`estimate`, a guess
//! made before the call) against the provider's own count.
//!
//! [`tap`] wraps a response body. Every frame goes on to the client as it arrives, untouched: the
//! tap never holds a frame back, so a stream still streams. On the side it keeps a bounded copy
//! of what it needs, and when the body ends (cleanly, with an error, or dropped by a client that
//! went away) it calls `on_done` once with what it saw.
//!
//! Where the count is (each API writes it after the content):
//! - OpenAI chat completions: `usage.prompt_tokens`, `completion_tokens`. Streamed, only with
//!   `stream_options.include_usage`: a last chunk with empty `choices` carries it, every earlier
//!   chunk has `"usage": null`.
//! - OpenAI embeddings: `usage.prompt_tokens` (and `total_tokens`, the same).
//! - OpenAI Responses: `usage.input_tokens`, `output_tokens`. Streamed: `response.completed`'s
//!   `response.usage`.
//! - Anthropic messages: `usage.input_tokens`, `output_tokens`, `cache_creation_input_tokens`,
//!   `cache_read_input_tokens`. Streamed: `message_start`'s `message.usage`, then each
//!   `message_delta`'s `usage` with the running totals.
//! - Gemini: `usageMetadata.promptTokenCount`, `toolUsePromptTokenCount`, `candidatesTokenCount`,
//!   `thoughtsTokenCount`. Streamed: every chunk's `usageMetadata`, the running totals.
//!
//! Input is everything the provider read: Anthropic's cache writes and reads are counted apart
//! from its `input_tokens`, so they are added; OpenAI's cached tokens are already inside
//! `prompt_tokens`, Gemini's inside `promptTokenCount`. Output is everything it wrote, Gemini's
//! thinking tokens included.
//!
//! How it reads, cheaply on the hot path (no lock, no allocation per frame once its buffer has
//! grown, no JSON parse of a frame without a count):
//! - A count is found by its member name: the last `"usage"` (or `"usageMetadata"`) member, read
//!   if its value is an object. Inside a JSON string every quote is escaped, so an unescaped
//!   `"usage"` followed by `:` is a member, never text; and each API writes its count after the
//!   content, so the last such member is the count. Only that object is parsed.
//! - JSON (`application/json`): the last [`TAIL`] bytes of the body are kept (a whole small body,
//!   the end of a large one: a batch of embeddings runs to megabytes with its count at the end),
//!   and read once at the end.
//! - Server-sent events (`text/event-stream`): each line is read as it completes, in place in the
//!   frame; only a line split across frames is copied (its last [`TAIL`] bytes, which hold the
//!   count of even a long `response.completed`). The counts of all lines are merged, each number
//!   replaced by its latest report (Anthropic's `message_delta` repeats the running output total,
//!   it does not add to it). Each line is read alone: an event whose JSON were split over several
//!   `data:` lines would go uncounted, but every provider sends one line per event.
//!
//! When the body ends early (an error, or dropped before its end), `on_done` gets `None`: a
//! count cut short would settle a charge whose end it never saw. `None` too when nothing was
//! reported (an OpenAI stream without `include_usage`, an error body). The callback runs on the task that polls or drops the
//! body, so it must be quick and must not panic.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use serde::Deserialize;

use crate::body::{Body, BoxError};

/// Bytes of a body (JSON), or of one line (events), kept to find the count in: the count and
/// what follows it fit with room to spare (after an OpenAI Responses `usage` come only `user`,
/// `metadata` of at most 16 short pairs, and the event's `sequence_number`). The buffer holds at
/// most twice this, trimmed back to it when full.
pub const TAIL: usize = 32 * 1024;

/// Tokens the upstream says it counted for one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens read: the prompt, cached parts included.
    pub input: u64,
    /// Tokens written: the completion, thinking included.
    pub output: u64,
}

impl Usage {
    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }
}

/// How an answer's body is framed, which decides how the tap reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON document.
    Json,
    /// Server-sent events, one JSON document per `data:` line.
    Sse,
}

impl Format {
    /// From the answer's `content-type`: `text/event-stream` is [`Format::Sse`];
    /// `application/json` and any `+json` type is [`Format::Json`]; anything else (or none) has no
    /// count to look for.
    pub fn of(headers: &HeaderMap) -> Option<Format> {
        let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
        let essence = value.split(';').next().unwrap_or_default().trim();
        let is = |name: &str| essence.eq_ignore_ascii_case(name);
        let json_suffix = essence
            .len()
            .checked_sub(5)
            .and_then(|at| essence.get(at..))
            .is_some_and(|tail| tail.eq_ignore_ascii_case("+json"));
        if is("text/event-stream") {
            Some(Format::Sse)
        } else if is("application/json") || json_suffix {
            Some(Format::Json)
        } else {
            None
        }
    }
}

/// Told the usage once the body is over: `None` when none was reported.
pub type OnDone = Box<dyn FnOnce(Option<Usage>) + Send>;

/// `body`, passed through frame for frame, with `on_done` called exactly once with the usage
/// the upstream reported in it: at its end, at an error, or when it is dropped unfinished.
pub fn tap(body: Body, format: Format, on_done: OnDone) -> Body {
    Tap {
        inner: body,
        tally: Tally {
            reader: match format {
                Format::Json => Reader::Json(Tail::default()),
                Format::Sse => Reader::Sse {
                    line: Tail::default(),
                    counted: Counted::default(),
                },
            },
            on_done: Some(on_done),
        },
    }
    .boxed_unsync()
}

/// The wrapper [`tap`] returns. `Body` is boxed and so `Unpin`, as is everything else here: no
/// pin projection is needed, and `Drop` can be implemented plainly.
struct Tap {
    inner: Body,
    tally: Tally,
}

impl HttpBody for Tap {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.tally.read(data);
                }
            }
            Poll::Ready(Some(Err(_))) => this.tally.finish(false),
            Poll::Ready(None) => this.tally.finish(true),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The reading state and the callback; dropping it finishes, so the callback runs even when the
/// client goes away mid-stream, or when hyper stops polling at `is_end_stream` and drops the body.
struct Tally {
    reader: Reader,
    on_done: Option<OnDone>,
}

impl Tally {
    fn read(&mut self, data: &[u8]) {
        if self.on_done.is_some() {
            self.reader.read(data);
        }
    }

    /// Call back with what was seen, the first time only: the count if the body reached its
    /// end (`complete`), else nothing (a count cut short would settle a charge it never saw
    /// the end of).
    fn finish(&mut self, complete: bool) {
        if let Some(on_done) = self.on_done.take() {
            on_done(if complete { self.reader.finish() } else { None });
        }
    }
}

/// Dropping the tap finishes it: the callback runs even when the client goes away mid-stream
/// (no count), or when hyper stops polling at `is_end_stream` and drops the body (counted).
impl Drop for Tap {
    fn drop(&mut self) {
        let ended = self.inner.is_end_stream();
        self.tally.finish(ended);
    }
}

enum Reader {
    /// The body's end so far.
    Json(Tail),
    /// The current line's start (when it is split across frames) and the counts seen so far.
    Sse { line: Tail, counted: Counted },
}

impl Reader {
    fn read(&mut self, data: &[u8]) {
        match self {
            Reader::Json(tail) => tail.push(data),
            Reader::Sse { line, counted } => read_lines(line, counted, data),
        }
    }

    /// The usage seen; the buffers are freed (the body may outlive its end a little).
    fn finish(&mut self) -> Option<Usage> {
        match self {
            Reader::Json(tail) => {
                let usage = count_in(&tail.buf).and_then(Counted::usage);
                *tail = Tail::default();
                usage
            }
            Reader::Sse { line, counted } => {
                // A last line the stream did not end with a newline.
                read_line(counted, &line.buf, line.cut);
                *line = Tail::default();
                counted.usage()
            }
        }
    }
}

/// Read every line that `data` completes, in place; keep the unfinished rest in `line`. Lines end
/// at `\n`, `\r\n` or `\r`, as in the event-stream format (a `\r\n` reads as a line and an empty
/// one, which says nothing).
fn read_lines(line: &mut Tail, counted: &mut Counted, mut data: &[u8]) {
    while let Some(end) = data.iter().position(|&b| b == b'\n' || b == b'\r') {
        if line.buf.is_empty() {
            read_line(counted, &data[..end], false);
        } else {
            line.push(&data[..end]);
            read_line(counted, &line.buf, line.cut);
            line.clear();
        }
        data = &data[end + 1..];
    }
    if !data.is_empty() {
        line.push(data);
    }
}

/// Merge the count on one event-stream line, if it is a `data:` line with one. A `cut` line has
/// lost its start, and with it the field name: only JSON carries a `"usage": {` member, so its
/// end is searched all the same.
fn read_line(counted: &mut Counted, line: &[u8], cut: bool) {
    if !cut && !line.starts_with(b"data:") {
        return;
    }
    if let Some(newer) = count_in(line) {
        counted.merge(newer);
    }
}

/// The last `len` bytes or so of a run of bytes: all of them while they fit in [`TAIL`], never
/// more than twice that.
#[derive(Default)]
struct Tail {
    buf: Vec<u8>,
    /// Bytes before `buf` were dropped.
    cut: bool,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        if bytes.len() > TAIL {
            self.buf.clear();
            self.buf.extend_from_slice(&bytes[bytes.len() - TAIL..]);
            self.cut = true;
            return;
        }
        if self.buf.len() + bytes.len() > 2 * TAIL {
            // Keep TAIL bytes in all: the newest of the old, then `bytes`.
            let drop = self.buf.len() + bytes.len() - TAIL;
            self.buf.drain(..drop);
            self.cut = true;
        }
        let needed = self.buf.len() + bytes.len();
        if needed > TAIL && needed > self.buf.capacity() {
            // Grow once to the most ever held, rather than doubling past it.
            self.buf.reserve_exact(2 * TAIL - self.buf.len());
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Empty for the next run, keeping the allocation.
    fn clear(&mut self) {
        self.buf.clear();
        self.cut = false;
    }
}

/// Counts as reported, each `None` until some report names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counted {
    input: Option<u64>,
    cache_write: Option<u64>,
    cache_read: Option<u64>,
    output: Option<u64>,
    total: Option<u64>,
}

impl Counted {
    /// Take every number `newer` reports in place of the older one.
    fn merge(&mut self, newer: Counted) {
        self.input = newer.input.or(self.input);
        self.cache_write = newer.cache_write.or(self.cache_write);
        self.cache_read = newer.cache_read.or(self.cache_read);
        self.output = newer.output.or(self.output);
        self.total = newer.total.or(self.total);
    }

    /// The usage these counts add up to; `None` if nothing was counted.
    fn usage(self) -> Option<Usage> {
        if self.input.is_none() && self.output.is_none() && self.total.is_none() {
            return None;
        }
        let output = self.output.unwrap_or(0);
        let input = self
            .input
            .or_else(|| self.total.map(|total| total.saturating_sub(output)))
            .unwrap_or(0)
            .saturating_add(self.cache_write.unwrap_or(0))
            .saturating_add(self.cache_read.unwrap_or(0));
        Some(Usage { input, output })
    }
}

/// A `usage` (or `usageMetadata`) object, in any API's words; other members are skipped unread.
#[derive(Deserialize)]
struct Reported {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    total_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    #[serde(rename = "promptTokenCount")]
    gemini_prompt: Option<u64>,
    #[serde(rename = "toolUsePromptTokenCount")]
    gemini_tool_prompt: Option<u64>,
    #[serde(rename = "candidatesTokenCount")]
    gemini_candidates: Option<u64>,
    #[serde(rename = "thoughtsTokenCount")]
    gemini_thoughts: Option<u64>,
    #[serde(rename = "totalTokenCount")]
    gemini_total: Option<u64>,
}

impl From<Reported> for Counted {
    fn from(r: Reported) -> Counted {
        let sum = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
        };
        Counted {
            input: r
                .prompt_tokens
                .or(r.input_tokens)
                .or(sum(r.gemini_prompt, r.gemini_tool_prompt)),
            cache_write: r.cache_creation_input_tokens,
            cache_read: r.cache_read_input_tokens,
            output: r
                .completion_tokens
                .or(r.output_tokens)
                .or(sum(r.gemini_candidates, r.gemini_thoughts)),
            total: r.total_tokens.or(r.gemini_total),
        }
    }
}

/// The counts of the last usage member in `json` (a whole document, a line, or the end of
/// either), if its value is an object of counts.
fn count_in(json: &[u8]) -> Option<Counted> {
    let object = last_usage_object(json)?;
    let reported = serde_json::Deserializer::from_slice(object)
        .into_iter::<Reported>()
        .next()?
        .ok()?;
    Some(reported.into())
}

/// Where the value of the last `"usage"` or `"usageMetadata"` member in `json` starts, if that
/// value is an object (`None` if it is `null`, as in every OpenAI chunk but the last).
fn last_usage_object(json: &[u8]) -> Option<&[u8]> {
    let mut end = json.len();
    while let Some(quote) = json[..end].iter().rposition(|&b| b == b'"') {
        end = quote;
        let after = &json[quote + 1..];
        let Some(after) = after
            .strip_prefix(b"usage\"")
            .or_else(|| after.strip_prefix(b"usageMetadata\""))
        else {
            continue;
        };
        if escaped(json, quote) {
            continue;
        }
        let Some(value) = skip_space(after).strip_prefix(b":").map(skip_space) else {
            continue;
        };
        return value.starts_with(b"{").then_some(value);
    }
    None
}

/// Whether the byte at `at` is escaped: preceded by an odd run of backslashes.
fn escaped(json: &[u8], at: usize) -> bool {
    json[..at].iter().rev().take_while(|&&b| b == b'\\').count() % 2 == 1
}

fn skip_space(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    &bytes[start..]
}

#[cfg(test)]
mod tests;
