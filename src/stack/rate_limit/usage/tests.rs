use super::*;
use std::sync::{Arc, Mutex};

use futures_util::FutureExt;
use http_body_util::StreamBody;
use proptest::prelude::*;

// Where each body comes from is said above it: "documented" (the provider's API reference
// shows this shape), or "constructed" (put together from the documented fields; values made
// up).

/// Every call `on_done` got.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<Option<Usage>>>>);

impl Calls {
    fn on_done(&self) -> OnDone {
        let calls = self.0.clone();
        Box::new(move |usage| calls.lock().unwrap().push(usage))
    }

    fn all(&self) -> Vec<Option<Usage>> {
        self.0.lock().unwrap().clone()
    }
}

fn frames_body(frames: Vec<Frame<Bytes>>) -> Body {
    let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, BoxError>));
    crate::body::boxed(StreamBody::new(stream))
}

fn chunks<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Body {
    frames_body(
        parts
            .into_iter()
            .map(|p| Frame::data(Bytes::copy_from_slice(p)))
            .collect(),
    )
}

/// Tap `body`, read it to the end, and return the bytes the client got and what the callback
/// got (asserting it was called once).
async fn run(body: Body, format: Format) -> (Vec<u8>, Option<Usage>) {
    let calls = Calls::default();
    let mut tapped = tap(body, format, calls.on_done());
    let mut got = Vec::new();
    while let Some(frame) = tapped.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            got.extend_from_slice(&data);
        }
    }
    let all = calls.all();
    assert_eq!(all.len(), 1, "called once at the end, before the drop");
    drop(tapped);
    assert_eq!(calls.all().len(), 1, "and not again when dropped");
    (got, all[0])
}

/// Read `text` through a tap in one frame (the framing is tested apart).
fn usage_of(text: &str, format: Format) -> Option<Usage> {
    let body = crate::body::full(text.to_owned());
    run(body, format).now_or_never().expect("ready").1
}

fn usage(input: u64, output: u64) -> Option<Usage> {
    Some(Usage { input, output })
}

/// Documented (OpenAI API reference, chat completion object; values from its example).
const OPENAI_CHAT: &str = r#"{
  "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4.1-2025-04-14",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "Hello! How can I assist you today?",
        "refusal": null,
        "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {
      "cached_tokens": 0,
      "audio_tokens": 0
    },
    "completion_tokens_details": {
      "reasoning_tokens": 0,
      "audio_tokens": 0,
      "accepted_prediction_tokens": 0,
      "rejected_prediction_tokens": 0
    }
  },
  "service_tier": "default"
}"#;

#[test]
fn a_chat_completion_reports_prompt_and_completion_tokens() {
    assert_eq!(usage_of(OPENAI_CHAT, Format::Json), usage(19, 10));
}

#[test]
fn an_embeddings_answer_reports_its_prompt_only() {
    // Documented (OpenAI API reference, embeddings: the example's shape and counts).
    let body = r#"{"object":"list","data":[{"object":"embedding","embedding":[0.0023064255,-0.009327292,-0.0028842222],"index":0}],"model":"text-embedding-ada-002","usage":{"prompt_tokens":8,"total_tokens":8}}"#;
    assert_eq!(usage_of(body, Format::Json), usage(8, 0));
}

#[test]
fn a_large_embeddings_batch_is_counted_from_its_end() {
    // Constructed: 200 inputs of 1536 dimensions, about 4 MB, the count at the very end.
    let vector = vec!["-0.0028842222"; 1536].join(",");
    let items: Vec<String> = (0..200)
        .map(|i| format!(r#"{{"object":"embedding","index":{i},"embedding":[{vector}]}}"#))
        .collect();
    let body = format!(
        r#"{{"object":"list","data":[{}],"model":"text-embedding-3-small","usage":{{"prompt_tokens":51200,"total_tokens":51200}}}}"#,
        items.join(",")
    );
    assert!(body.len() > 100 * TAIL);
    let frames: Vec<&[u8]> = body.as_bytes().chunks(16 * 1024).collect();
    let (got, counted) = run(chunks(frames), Format::Json).now_or_never().unwrap();
    assert_eq!(counted, usage(51_200, 0));
    assert_eq!(got, body.as_bytes());
}

#[test]
fn an_anthropic_message_counts_cache_writes_and_reads_as_input() {
    // Documented (Anthropic Messages API reference: the response and its usage members);
    // counts constructed.
    let body = r#"{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":"claude-sonnet-4-20250514","content":[{"type":"text","text":"Hi! My name is Claude."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2095,"cache_creation_input_tokens":2048,"cache_read_input_tokens":1024,"output_tokens":503,"service_tier":"standard"}}"#;
    assert_eq!(usage_of(body, Format::Json), usage(2095 + 2048 + 1024, 503));
}

#[test]
fn a_responses_api_answer_reports_input_and_output_tokens() {
    // Documented (OpenAI API reference, the response object; usage from its example).
    let body = r#"{"id":"resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41","object":"response","created_at":1741476777,"status":"completed","error":null,"model":"gpt-4o-2024-08-06","output":[{"type":"message","id":"msg_67ccd3acc8d48190a77525dc6de64b4104becb25c45c1d41","status":"completed","role":"assistant","content":[{"type":"output_text","text":"The image depicts a scenic landscape.","annotations":[]}]}],"parallel_tool_calls":true,"tools":[],"top_p":1.0,"truncation":"disabled","usage":{"input_tokens":328,"input_tokens_details":{"cached_tokens":0},"output_tokens":52,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":380},"user":null,"metadata":{}}"#;
    assert_eq!(usage_of(body, Format::Json), usage(328, 52));
}

#[test]
fn a_gemini_answer_counts_thinking_as_output() {
    // Constructed from the documented usageMetadata members (Gemini API reference).
    let body = r#"{"candidates":[{"content":{"parts":[{"text":"Hi"}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":12,"cachedContentTokenCount":4,"candidatesTokenCount":3,"thoughtsTokenCount":40,"totalTokenCount":55},"modelVersion":"gemini-2.5-flash"}"#;
    assert_eq!(usage_of(body, Format::Json), usage(12, 43));
}

#[test]
fn usage_quoted_inside_the_content_is_not_the_count() {
    // Constructed: the model's answer quotes a usage object; only the real one counts.
    let quoted = r#"{"choices":[{"message":{"content":"Set \"usage\": {\"prompt_tokens\": 999} here"}}],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#;
    assert_eq!(usage_of(quoted, Format::Json), usage(5, 7));
    let only_quoted =
        r#"{"choices":[{"message":{"content":"\"usage\": {\"prompt_tokens\": 999}\\"}}]}"#;
    assert_eq!(usage_of(only_quoted, Format::Json), None);
}

#[test]
fn a_body_without_a_count_reports_none() {
    for body in [
        "",
        "not json",
        r#"{"error":{"message":"Rate limit reached","code":"rate_limit_exceeded"}}"#,
        r#"{"usage":null}"#,
        r#"{"usage":{"prompt_tokens":"many"}}"#,
        r#"{"usage":{}}"#,
        r#"{"usage":{"prompt_tokens":5"#,
    ] {
        assert_eq!(usage_of(body, Format::Json), None, "{body}");
    }
    let deep = format!(r#"{{"usage":{}"#, "[".repeat(100_000));
    assert_eq!(usage_of(&deep, Format::Json), None);
}

/// Constructed in the documented shape (OpenAI API reference, chat completion chunk, and
/// `stream_options.include_usage`: a last chunk with empty `choices` and the `usage`, every
/// other chunk with `"usage": null`).
const OPENAI_STREAM: &str = concat!(
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello \\\"usage\\\": {\\\"prompt_tokens\\\": 1}\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n",
    "\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21,\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n",
    "\n",
    "data: [DONE]\n",
    "\n",
);

#[test]
fn an_openai_stream_with_include_usage_is_counted_at_every_split() {
    let bytes = OPENAI_STREAM.as_bytes();
    for at in 0..=bytes.len() {
        let (got, counted) = run(chunks([&bytes[..at], &bytes[at..]]), Format::Sse)
            .now_or_never()
            .unwrap();
        assert_eq!(counted, usage(9, 12), "split at {at}");
        assert_eq!(got, bytes);
    }
}

#[test]
fn an_openai_stream_with_crlf_lines_or_no_final_newline_is_counted() {
    let crlf = OPENAI_STREAM.replace('\n', "\r\n");
    assert_eq!(usage_of(&crlf, Format::Sse), usage(9, 12));
    let cut = OPENAI_STREAM.split("\n\ndata: [DONE]").next().unwrap();
    assert!(cut.ends_with('}'));
    assert_eq!(usage_of(cut, Format::Sse), usage(9, 12));
}

#[test]
fn an_openai_stream_without_include_usage_reports_none() {
    let without: String = OPENAI_STREAM
        .split("\n\n")
        .filter(|event| !event.contains("\"usage\":{"))
        .map(|event| format!("{event}\n\n"))
        .collect();
    assert!(without.contains("[DONE]"));
    assert_eq!(usage_of(&without, Format::Sse), None);
}

/// Documented (Anthropic Messages streaming guide, its basic example, spaces included).
const ANTHROPIC_STREAM: &str = r#"event: message_start
data: {"type": "message_start", "message": {"id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message", "role": "assistant", "content": [], "model": "claude-3-5-sonnet-20241022", "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 25, "output_tokens": 1}}}

event: content_block_start
data: {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}

event: content_block_delta
data: {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}}

event: content_block_stop
data: {"type": "content_block_stop", "index": 0}

event: message_delta
data: {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence":null}, "usage": {"output_tokens": 15}}

event: message_stop
data: {"type": "message_stop"}

"#;

#[test]
fn an_anthropic_stream_takes_input_from_the_start_and_output_from_the_last_delta() {
    assert_eq!(usage_of(ANTHROPIC_STREAM, Format::Sse), usage(25, 15));
}

#[test]
fn anthropic_deltas_replace_the_output_so_far_and_cache_counts_are_input() {
    // Constructed: a server-tool turn with two message_delta events (each carries the
    // running total), and cache counts in message_start.
    let stream = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-20250514\",\"usage\":{\"input_tokens\":10,\"cache_creation_input_tokens\":200,\"cache_read_input_tokens\":3000,\"output_tokens\":1}}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},\"usage\":{\"output_tokens\":40}}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":90}}\n\n",
    );
    assert_eq!(usage_of(stream, Format::Sse), usage(3210, 90));
}

#[test]
fn a_responses_api_stream_is_counted_at_response_completed() {
    // Constructed in the documented event shapes (OpenAI API reference, Responses
    // streaming events): the created event has "usage": null, the completed one the count.
    let stream = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null,\"user\":null,\"metadata\":{}},\"sequence_number\":0}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\",\"sequence_number\":1}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\"}]}],\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":11,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":48},\"user\":null,\"metadata\":{}},\"sequence_number\":2}\n\n",
    );
    assert_eq!(usage_of(stream, Format::Sse), usage(37, 11));
}

#[test]
fn a_line_longer_than_the_tail_is_still_counted_from_its_end() {
    // Constructed: a response.completed whose output runs to 300 KB, in 1000-byte frames.
    let text = "word ".repeat(60_000);
    let stream = format!(
        "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"output\":[{{\"type\":\"message\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{text}\"}}]}}],\"usage\":{{\"input_tokens\":12,\"output_tokens\":60000,\"total_tokens\":60012}},\"user\":null,\"metadata\":{{}}}},\"sequence_number\":9}}\n\n"
    );
    let frames: Vec<&[u8]> = stream.as_bytes().chunks(1000).collect();
    let (got, counted) = run(chunks(frames), Format::Sse).now_or_never().unwrap();
    assert_eq!(counted, usage(12, 60_000));
    assert_eq!(got, stream.as_bytes());
}

#[test]
fn a_gemini_stream_keeps_the_last_cumulative_count() {
    // Constructed in the documented shape (Gemini streamGenerateContent with alt=sse).
    let stream = concat!(
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"The\"}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 8,\"candidatesTokenCount\": 1,\"totalTokenCount\": 9},\"modelVersion\": \"gemini-2.0-flash\"}\r\n\r\n",
        "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \" end.\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 8,\"candidatesTokenCount\": 30,\"totalTokenCount\": 38},\"modelVersion\": \"gemini-2.0-flash\"}\r\n\r\n",
    );
    assert_eq!(usage_of(stream, Format::Sse), usage(8, 30));
}

#[test]
fn frames_pass_through_byte_identical_and_in_the_same_framing() {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", "abc".parse().unwrap());
    let sent = vec![
        Frame::data(Bytes::from_static(b"data: {\"a\":")),
        Frame::data(Bytes::new()),
        Frame::data(Bytes::from_static(b"1}\n\n\xff\x00")),
        Frame::trailers(trailers.clone()),
    ];
    let calls = Calls::default();
    let mut tapped = tap(frames_body(sent), Format::Sse, calls.on_done());
    let mut got = Vec::new();
    while let Some(frame) = tapped.frame().now_or_never().unwrap() {
        got.push(frame.unwrap());
    }
    let data: Vec<&[u8]> = got
        .iter()
        .filter_map(|f| f.data_ref())
        .map(|d| &d[..])
        .collect();
    assert_eq!(
        data,
        [&b"data: {\"a\":"[..], &b""[..], &b"1}\n\n\xff\x00"[..]]
    );
    assert_eq!(got.last().unwrap().trailers_ref(), Some(&trailers));
    assert_eq!(calls.all(), [None]);
}

/// Gives its frames, then (`then_stall`) nothing ever, or an error.
struct Script {
    frames: Vec<Bytes>,
    then_stall: bool,
}

impl HttpBody for Script {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.frames.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(self.frames.remove(0)))));
        }
        if self.then_stall {
            Poll::Pending
        } else {
            Poll::Ready(Some(Err("upstream reset".into())))
        }
    }
}

#[test]
fn a_frame_goes_on_at_once_while_the_stream_is_still_open() {
    let first = ANTHROPIC_STREAM
        .split("event: message_delta")
        .next()
        .unwrap();
    let script = Script {
        frames: vec![Bytes::from(first.to_owned())],
        then_stall: true,
    };
    let calls = Calls::default();
    let mut tapped = tap(crate::body::boxed(script), Format::Sse, calls.on_done());
    let frame = tapped.frame().now_or_never().expect("not held back");
    assert_eq!(frame.unwrap().unwrap().into_data().unwrap(), first);
    assert!(
        tapped.frame().now_or_never().is_none(),
        "the upstream stalls"
    );
    assert!(
        calls.all().is_empty(),
        "no verdict while the stream is open"
    );
    drop(tapped);
    assert_eq!(
        calls.all(),
        [None],
        "a stream cut after message_start settles nothing: its end was never seen"
    );
}

#[test]
fn a_body_dropped_before_any_count_reports_none_once() {
    let script = Script {
        frames: vec![Bytes::from_static(
            b"data: {\"choices\":[],\"usage\":null}\n\n",
        )],
        then_stall: true,
    };
    let calls = Calls::default();
    let mut tapped = tap(crate::body::boxed(script), Format::Sse, calls.on_done());
    let _ = tapped.frame().now_or_never();
    drop(tapped);
    assert_eq!(calls.all(), [None]);
    let untouched = tap(
        crate::body::full(OPENAI_CHAT),
        Format::Json,
        calls.on_done(),
    );
    drop(untouched);
    assert_eq!(calls.all(), [None, None], "never polled: nothing seen");
}

#[test]
fn a_body_read_to_its_end_and_dropped_without_the_last_poll_is_counted() {
    // hyper stops polling a body whose `is_end_stream` is true, and drops it.
    let calls = Calls::default();
    let mut tapped = tap(
        crate::body::full(OPENAI_CHAT),
        Format::Json,
        calls.on_done(),
    );
    while !tapped.is_end_stream() {
        tapped.frame().now_or_never().unwrap().unwrap().unwrap();
    }
    assert!(calls.all().is_empty());
    drop(tapped);
    assert_eq!(calls.all(), [usage(19, 10)]);
}

#[test]
fn an_error_is_passed_on_and_reported_once() {
    let script = Script {
        frames: vec![Bytes::from_static(b"{\"usage\":{\"input_tokens\":3")],
        then_stall: false,
    };
    let calls = Calls::default();
    let mut tapped = tap(crate::body::boxed(script), Format::Json, calls.on_done());
    assert!(tapped.frame().now_or_never().unwrap().unwrap().is_ok());
    let err = tapped.frame().now_or_never().unwrap().unwrap().unwrap_err();
    assert_eq!(err.to_string(), "upstream reset");
    assert_eq!(calls.all(), [None], "an unfinished count is no count");
    let _ = tapped.frame().now_or_never();
    drop(tapped);
    assert_eq!(calls.all().len(), 1);
}

#[test]
fn the_size_hint_and_the_end_are_the_inner_bodys() {
    let tapped = tap(crate::body::full("12345"), Format::Json, Box::new(|_| {}));
    assert_eq!(tapped.size_hint().exact(), Some(5));
    let empty = tap(crate::body::full(""), Format::Json, Box::new(|_| {}));
    assert!(empty.is_end_stream());
}

#[test]
fn the_tail_never_holds_more_than_twice_its_bound() {
    let mut tail = Tail::default();
    let piece = vec![b'x'; 7000];
    for _ in 0..100 {
        tail.push(&piece);
        assert!(tail.buf.len() <= 2 * TAIL);
        assert!(tail.buf.capacity() <= 2 * TAIL);
    }
    assert!(tail.cut);
    tail.push(&vec![b'y'; 3 * TAIL]);
    assert_eq!(tail.buf.len(), TAIL);
    assert!(tail.buf.iter().all(|&b| b == b'y'));
    let mut small = Tail::default();
    small.push(b"abc");
    small.push(b"def");
    assert_eq!((&small.buf[..], small.cut), (&b"abcdef"[..], false));
}

#[test]
fn the_format_comes_from_the_content_type() {
    let table = [
        ("text/event-stream", Some(Format::Sse)),
        ("text/event-stream; charset=utf-8", Some(Format::Sse)),
        ("application/json", Some(Format::Json)),
        ("Application/JSON; charset=utf-8", Some(Format::Json)),
        ("application/problem+json", Some(Format::Json)),
        ("text/plain", None),
        ("json", None),
    ];
    for (value, want) in table {
        let headers = crate::provider::header_map(&[("content-type", value)]);
        assert_eq!(Format::of(&headers), want, "{value}");
    }
    assert_eq!(Format::of(&HeaderMap::new()), None);
}

proptest! {
    #[test]
    fn any_framing_of_a_stream_gives_the_same_count_and_bytes(
        cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..12),
        pick in 0usize..2,
    ) {
        let streams = [(OPENAI_STREAM, usage(9, 12)), (ANTHROPIC_STREAM, usage(25, 15))];
        let (text, want) = streams[pick];
        let bytes = text.as_bytes();
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        at.push(0);
        at.push(bytes.len());
        at.sort_unstable();
        let parts: Vec<&[u8]> = at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
        let (got, counted) = run(chunks(parts), Format::Sse).now_or_never().unwrap();
        prop_assert_eq!(counted, want);
        prop_assert_eq!(got, bytes);
    }

    #[test]
    fn no_bytes_make_the_tap_panic(
        frames in proptest::collection::vec(
            proptest::collection::vec(any::<u8>(), 0..200),
            0..8,
        ),
        sse in any::<bool>(),
    ) {
        let format = if sse { Format::Sse } else { Format::Json };
        let parts = frames.iter().map(Vec::as_slice);
        let (got, _) = run(chunks(parts), format).now_or_never().unwrap();
        prop_assert_eq!(got, frames.concat());
    }
}
