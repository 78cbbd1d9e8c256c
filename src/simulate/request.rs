//! The few request fields the simulator reads, and the canned answer text.

use serde_json::Value;

/// Words of the canned answer; the `i`-th streamed event carries `PIECES[i % len]`.
const PIECES: [&str; 8] = [
    "This ",
    "is ",
    "a ",
    "simulated ",
    "answer ",
    "from ",
    "corral ",
    "simulate. ",
];

/// A chat (OpenAI) or messages (Anthropic) request, reduced to what shapes the answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub stream: bool,
    /// `max_tokens`, or OpenAI's `max_completion_tokens`.
    pub max_tokens: Option<u64>,
    /// Characters of text in `messages[].content` and `system`.
    pub prompt_chars: usize,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Why a body was refused with 400.
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    #[error("could not parse the JSON body of your request: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the request body must be a JSON object")]
    NotAnObject,
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, BadRequest> {
        let value: Value = serde_json::from_slice(body)?;
        let obj = value.as_object().ok_or(BadRequest::NotAnObject)?;
        let max_tokens = obj
            .get("max_tokens")
            .or_else(|| obj.get("max_completion_tokens"))
            .and_then(Value::as_u64);
        let mut prompt_chars = obj.get("system").map_or(0, text_chars);
        if let Some(messages) = obj.get("messages").and_then(Value::as_array) {
            for message in messages {
                prompt_chars += message.get("content").map_or(0, text_chars);
            }
        }
        Ok(Self {
            model: obj.get("model").and_then(Value::as_str).map(str::to_owned),
            stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
            max_tokens,
            prompt_chars,
            include_usage: obj
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }

    /// Tokens the answer's `usage` reports for the prompt.
    pub fn prompt_tokens(&self) -> u64 {
        (self.prompt_chars / 4) as u64
    }
}

/// Counts chars of a string, or of the `text` fields of an array of content parts.
fn text_chars(content: &Value) -> usize {
    match content {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|s| s.chars().count())
            .sum(),
        _ => 0,
    }
}

/// What an answer echoes and counts; built once per admitted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub id: String,
    pub model: String,
    /// Unix seconds.
    pub created: u64,
    pub prompt_tokens: u64,
    /// Pieces of text, streamed as one event each.
    pub chunks: u32,
}

/// The `i`-th piece of the canned answer.
pub fn piece(i: u32) -> &'static str {
    PIECES[i as usize % PIECES.len()]
}

/// The whole answer as `chunks` pieces would stream it.
pub fn answer(chunks: u32) -> String {
    (0..chunks).map(piece).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_openai_fields_and_counts_prompt_chars() {
        let body = br#"{"model":"gpt-x","stream":true,"max_completion_tokens":7,
            "stream_options":{"include_usage":true},
            "messages":[{"role":"user","content":"abcd"},
                        {"role":"user","content":[{"type":"text","text":"ef"},{"type":"image_url"}]}]}"#;
        let r = ChatRequest::parse(body).unwrap();
        assert_eq!(r.model.as_deref(), Some("gpt-x"));
        assert!(r.stream && r.include_usage);
        assert_eq!((r.max_tokens, r.prompt_chars), (Some(7), 6));
    }

    #[test]
    fn reads_anthropic_system_prompt() {
        let body = br#"{"model":"claude","max_tokens":3,"system":[{"type":"text","text":"sys!"}],
            "messages":[{"role":"user","content":"hi"}]}"#;
        let r = ChatRequest::parse(body).unwrap();
        assert_eq!(
            (r.max_tokens, r.prompt_chars, r.stream),
            (Some(3), 6, false)
        );
    }

    #[test]
    fn rejects_invalid_json_and_non_objects() {
        assert!(matches!(
            ChatRequest::parse(b"{nope"),
            Err(BadRequest::Json(_))
        ));
        assert!(matches!(
            ChatRequest::parse(b"[1]"),
            Err(BadRequest::NotAnObject)
        ));
        assert_eq!(ChatRequest::parse(b"{}").unwrap(), ChatRequest::default());
    }

    #[test]
    fn answer_is_the_streamed_pieces_joined() {
        assert_eq!(answer(3), "This is a ");
        assert_eq!(piece(8), piece(0));
    }
}
