//! Token estimates for the tokens-per-minute bucket: prompt characters / 4 plus the completion
//! budget (`max_tokens`, `max_completion_tokens`, `max_output_tokens`, or a default). A body
//! that is not JSON is still forwarded, charged by its length.
//!
//! This runs on every attempt once a token bucket exists, so the body is read with serde visitors
//! that keep only counts instead of into a `serde_json::Value`: strings without escapes are
//! borrowed from the body, escaped ones are decoded into serde_json's one scratch buffer (so the
//! largest escaped string is the only allocation). Everything else goes through the same
//! `deserialize_any` as a `Value` would, so a body is JSON here exactly when `from_slice::<Value>`
//! takes it (same number ranges, UTF-8 checks and depth limit); a repeated key counts its last
//! value, as in a `Value`'s map.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Visitor};

/// Top-level members whose text is the prompt.
const PROMPT_KEYS: [&str; 5] = ["messages", "prompt", "input", "system", "instructions"];
/// Top-level members that may give the completion budget, in order of precedence (whatever
/// their order in the body).
const COMPLETION_KEYS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
/// Members of an object inside the prompt whose text counts (message content, content blocks).
const TEXT_KEYS: [&str; 2] = ["content", "text"];

/// Estimated tokens a request will use.
pub fn estimate_tokens(body: &[u8], default_max_tokens: u32) -> u32 {
    let e = estimate(body, default_max_tokens);
    e.prompt.saturating_add(e.completion)
}

/// A request's estimate in its two parts: the prompt (a guess from its characters, which the
/// upstream's `usage` can calibrate) and the completion budget (what providers charge at
/// admission).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Estimate {
    pub prompt: u32,
    pub completion: u32,
}

impl Estimate {
    /// The charge with the prompt's part scaled by `prompt_ratio` (tokens counted per token
    /// guessed, as the upstream's answers showed it).
    pub fn charge(self, prompt_ratio: f64) -> u32 {
        let prompt = (f64::from(self.prompt) * prompt_ratio)
            .ceil()
            .min(f64::from(u32::MAX));
        (prompt as u32).saturating_add(self.completion)
    }
}

/// Estimated tokens a request will use, by part.
pub fn estimate(body: &[u8], default_max_tokens: u32) -> Estimate {
    let Ok(counts) = read_body(body) else {
        return Estimate {
            prompt: u32::try_from(body.len() / 4).unwrap_or(u32::MAX),
            completion: default_max_tokens,
        };
    };
    let chars: usize = counts.prompt.iter().sum();
    let completion = counts
        .completion
        .iter()
        .find_map(|n| *n)
        .map_or(default_max_tokens, |n| {
            n.min(u64::from(u32::MAX / 2)) as u32
        });
    Estimate {
        prompt: u32::try_from(chars / 4).unwrap_or(u32::MAX),
        completion,
    }
}

/// What a body holds for the estimate, by position in `PROMPT_KEYS` and `COMPLETION_KEYS`.
#[derive(Default)]
struct Counts {
    prompt: [usize; PROMPT_KEYS.len()],
    /// The member's value if it is a non-negative integer (`Value::as_u64`).
    completion: [Option<u64>; COMPLETION_KEYS.len()],
}

/// The whole body as one JSON value, with nothing but whitespace after it.
fn read_body(body: &[u8]) -> serde_json::Result<Counts> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let counts = de.deserialize_any(Body)?;
    de.end()?;
    Ok(counts)
}

/// The top-level value: only an object has members to count (`Value::get` on anything else
/// finds none).
struct Body;

impl<'de> Visitor<'de> for Body {
    type Value = Counts;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counts, A::Error> {
        let mut counts = Counts::default();
        while let Some(key) = map.next_key_seed(KeyIn(&PROMPT_KEYS, &COMPLETION_KEYS))? {
            match key {
                Key::First(i) => counts.prompt[i] = map.next_value_seed(Chars::COUNT)?,
                Key::Second(i) => counts.completion[i] = map.next_value_seed(Uint)?,
                Key::Other => {
                    map.next_value_seed(Chars::SKIP)?;
                }
            }
        }
        Ok(counts)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Counts, A::Error> {
        Chars::SKIP.visit_seq(seq).map(|_| Counts::default())
    }

    fn visit_str<E: Error>(self, _: &str) -> Result<Counts, E> {
        Ok(Counts::default())
    }

    fn visit_bool<E: Error>(self, _: bool) -> Result<Counts, E> {
        Ok(Counts::default())
    }

    fn visit_i64<E: Error>(self, _: i64) -> Result<Counts, E> {
        Ok(Counts::default())
    }

    fn visit_u64<E: Error>(self, _: u64) -> Result<Counts, E> {
        Ok(Counts::default())
    }

    fn visit_f64<E: Error>(self, _: f64) -> Result<Counts, E> {
        Ok(Counts::default())
    }

    fn visit_unit<E: Error>(self) -> Result<Counts, E> {
        Ok(Counts::default())
    }
}

/// A member's key, looked up in two lists (decoded first, so `"m\u0061x_tokens"` matches too).
#[derive(Clone, Copy)]
struct KeyIn(&'static [&'static str], &'static [&'static str]);

enum Key {
    First(usize),
    Second(usize),
    Other,
}

impl<'de> DeserializeSeed<'de> for KeyIn {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Key, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIn {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: Error>(self, key: &str) -> Result<Key, E> {
        let at = |keys: &[&str]| keys.iter().position(|k| *k == key);
        Ok(at(self.0)
            .map(Key::First)
            .or_else(|| at(self.1).map(Key::Second))
            .unwrap_or(Key::Other))
    }
}

/// Characters of text in a prompt value (strings, arrays, objects' `content` and `text`), or,
/// not counting, a value only read past.
#[derive(Clone, Copy)]
struct Chars {
    count: bool,
}

impl Chars {
    const COUNT: Chars = Chars { count: true };
    const SKIP: Chars = Chars { count: false };
}

impl<'de> DeserializeSeed<'de> for Chars {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<usize, D::Error> {
        // Not `deserialize_ignored_any` when skipping: serde_json's skips neither check UTF-8
        // nor number ranges nor depth, and a body must be JSON here exactly when it is a `Value`.
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Chars {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E: Error>(self, s: &str) -> Result<usize, E> {
        Ok(if self.count { s.chars().count() } else { 0 })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut chars = 0;
        while let Some(n) = seq.next_element_seed(self)? {
            chars += n;
        }
        Ok(chars)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut text = [0; TEXT_KEYS.len()];
        while let Some(key) = map.next_key_seed(KeyIn(&TEXT_KEYS, &[]))? {
            match key {
                Key::First(i) if self.count => text[i] = map.next_value_seed(self)?,
                _ => {
                    map.next_value_seed(Chars::SKIP)?;
                }
            }
        }
        Ok(text.iter().sum())
    }

    fn visit_bool<E: Error>(self, _: bool) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_i64<E: Error>(self, _: i64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_u64<E: Error>(self, _: u64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_f64<E: Error>(self, _: f64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_unit<E: Error>(self) -> Result<usize, E> {
        Ok(0)
    }
}

/// A completion budget: the value if it is a non-negative integer, as `Value::as_u64` says
/// (not a float, a negative number or a string).
struct Uint;

impl<'de> DeserializeSeed<'de> for Uint {
    type Value = Option<u64>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<u64>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Uint {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_u64<E: Error>(self, n: u64) -> Result<Option<u64>, E> {
        Ok(Some(n))
    }

    fn visit_i64<E: Error>(self, n: i64) -> Result<Option<u64>, E> {
        Ok(u64::try_from(n).ok())
    }

    fn visit_f64<E: Error>(self, _: f64) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_str<E: Error>(self, _: &str) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_bool<E: Error>(self, _: bool) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_unit<E: Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<u64>, A::Error> {
        Chars::SKIP.visit_seq(seq).map(|_| None)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<u64>, A::Error> {
        Chars::SKIP.visit_map(map).map(|_| None)
    }
}

/// The estimate as it was before it read bodies with visitors, from a whole `serde_json::Value`
/// tree: the reference the tests check [`estimate_tokens`] against, and the baseline of
/// `benches/estimate.rs`. Not used by corral itself.
#[doc(hidden)]
pub mod reference {
    use serde_json::Value;

    /// The estimate as it was, from a whole `Value` tree: the reference the visitors must match.
    pub fn estimate_tokens_tree(body: &[u8], default_max_tokens: u32) -> u32 {
        let Ok(json) = serde_json::from_slice::<Value>(body) else {
            return (body.len() / 4) as u32 + default_max_tokens;
        };
        let mut chars = 0usize;
        for key in ["messages", "prompt", "input", "system", "instructions"] {
            if let Some(v) = json.get(key) {
                chars += text_chars(v);
            }
        }
        let completion = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .iter()
            .find_map(|k| json.get(*k).and_then(Value::as_u64))
            .map_or(default_max_tokens, |n| {
                n.min(u64::from(u32::MAX / 2)) as u32
            });
        ((chars / 4) as u32).saturating_add(completion)
    }

    fn text_chars(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(items) => items.iter().map(text_chars).sum(),
            Value::Object(map) => ["content", "text"]
                .iter()
                .filter_map(|k| map.get(*k))
                .map(text_chars)
                .sum(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reference::estimate_tokens_tree;
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    /// The estimate, checked against the reference.
    fn estimate(body: &[u8]) -> u32 {
        let got = estimate_tokens(body, 16);
        assert_eq!(
            got,
            estimate_tokens_tree(body, 16),
            "{}",
            String::from_utf8_lossy(body)
        );
        got
    }

    #[test]
    fn chat_and_completion_shapes() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"12345678"},{"role":"user","content":[{"type":"text","text":"abcd"}]}],"max_tokens":100}"#;
        assert_eq!(estimate_tokens(chat, 16), 3 + 100);
        let legacy = br#"{"prompt":"0123456789abcdef","max_completion_tokens":10}"#;
        assert_eq!(estimate_tokens(legacy, 16), 4 + 10);
        let no_max = br#"{"messages":[{"role":"user","content":"abcd"}]}"#;
        assert_eq!(estimate_tokens(no_max, 16), 1 + 16);
        assert_eq!(estimate_tokens(b"not json at all!", 16), 4 + 16);
    }

    #[test]
    fn escapes_count_decoded_chars() {
        // é, newline, quote, backslash, one emoji from a surrogate pair, tab, é, space: 8 chars.
        let escaped = br#"{"prompt":"\u00e9\n\"\\\ud83d\ude00\t\u00E9 ","max_tokens":0}"#;
        assert_eq!(estimate(escaped), 2);
        // Raw UTF-8 counts chars, not bytes: 10 chars in 18 bytes.
        assert_eq!(estimate(r#"{"prompt":"héllo 😀 日本"}"#.as_bytes()), 2 + 16);
        // A key is matched once decoded.
        assert_eq!(
            estimate(br#"{"m\u0065ssages":"abcd","max_tok\u0065ns":1}"#),
            1 + 1
        );
    }

    #[test]
    fn nested_content_counts_only_content_and_text() {
        let body = br#"{"messages":[
            {"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":"xxxxxxxxxxxx"}}]},
            {"role":"user","content":[
                {"type":"text","text":"abcd"},
                {"type":"image_url","image_url":{"url":"data:xxxxxxxxxxxxxxxx"}},
                {"type":"tool_result","tool_use_id":"xxxxxxxx","content":[{"type":"text","text":"efgh"},{"text":["ij",{"content":"kl"}],"content":7}]}
            ]},
            "mnop", 12, true, [["qrst"]]
        ]}"#;
        // abcd efgh ij kl mnop qrst: 20 chars.
        assert_eq!(estimate(body), 5 + 16);
    }

    #[test]
    fn anthropic_shapes() {
        let string_system = br#"{"model":"claude","max_tokens":1024,"system":"You are terse.!!",
            "messages":[{"role":"user","content":"abcdefgh"}]}"#;
        assert_eq!(estimate(string_system), 6 + 1024);
        let block_system = br#"{"model":"claude","max_tokens":1024,
            "system":[{"type":"text","text":"You are terse.!!","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":[{"type":"text","text":"abcdefgh"}]}]}"#;
        assert_eq!(estimate(block_system), 6 + 1024);
    }

    #[test]
    fn responses_api_shapes() {
        let string_input =
            br#"{"model":"gpt","instructions":"Be brief","input":"abcdefgh","max_output_tokens":50}"#;
        assert_eq!(estimate(string_input), 4 + 50);
        let items = br#"{"model":"gpt","input":[
            {"role":"user","content":[{"type":"input_text","text":"abcd"},{"type":"input_image","image_url":"https://x/y.png"}]},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"efgh","annotations":[]}]},
            {"type":"function_call_output","call_id":"c1","output":"not counted"},
            {"role":"user","content":"ijkl"}
        ],"max_output_tokens":50}"#;
        assert_eq!(estimate(items), 3 + 50);
    }

    #[test]
    fn completion_keys_by_precedence_not_position() {
        let cases: [(&[u8], u32); 9] = [
            (
                br#"{"max_output_tokens":5,"max_completion_tokens":6,"max_tokens":7}"#,
                7,
            ),
            (br#"{"max_output_tokens":5,"max_completion_tokens":6}"#, 6),
            (br#"{"max_tokens":"7","max_completion_tokens":6}"#, 6),
            (br#"{"max_tokens":7.0,"max_output_tokens":5}"#, 5),
            (br#"{"max_tokens":-7,"max_output_tokens":5}"#, 5),
            (br#"{"max_tokens":-0,"max_output_tokens":5}"#, 5),
            (br#"{"max_tokens":null}"#, 16),
            (br#"{"max_tokens":[7],"max_completion_tokens":{"n":6}}"#, 16),
            (br#"{"max_tokens":18446744073709551615}"#, u32::MAX / 2),
        ];
        for (body, want) in cases {
            assert_eq!(estimate(body), want, "{}", String::from_utf8_lossy(body));
        }
        // Past u64 it is a float to serde_json, so no budget.
        assert_eq!(estimate(br#"{"max_tokens":18446744073709551616}"#), 16);
        // The prompt estimate saturates rather than wrapping.
        let huge = format!(
            r#"{{"prompt":"{}","max_tokens":{}}}"#,
            "x".repeat(64),
            u64::MAX
        );
        assert_eq!(estimate(huge.as_bytes()), 16 + u32::MAX / 2);
    }

    #[test]
    fn a_top_level_other_than_an_object_has_no_members() {
        for body in [
            &br#"[{"messages":"abcdefgh","max_tokens":5}]"#[..],
            br#""messages: abcdefgh""#,
            b" 12 ",
            b"null",
            b"true",
            b"-1.5e3",
        ] {
            assert_eq!(estimate(body), 16, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn not_json_is_charged_by_length() {
        let deep = format!(
            r#"{{"tools":{}{}, "prompt":"abcd"}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let cases: [&[u8]; 9] = [
            br#"{"prompt":"abcd""#,
            br#"{"prompt":"abcd"} x"#,
            br#"{"prompt":"abcd",}"#,
            br#"{"prompt":"ab\qd"}"#,
            br#"{"prompt":"\ud800 lone surrogate"}"#,
            // Invalid even where the estimate does not look: UTF-8, number range and depth
            // are checked in skipped members as a `Value` would.
            b"{\"model\":\"\xff\xfe\",\"prompt\":\"abcd\"}",
            br#"{"temperature":1e400,"prompt":"abcd"}"#,
            deep.as_bytes(),
            b"",
        ];
        for body in cases {
            assert_eq!(
                estimate(body),
                (body.len() / 4) as u32 + 16,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_repeated_key_counts_its_last_value() {
        let top = br#"{"prompt":"abcdefghijklmnop","prompt":"abcd","max_tokens":5,"max_tokens":"x","max_output_tokens":9}"#;
        assert_eq!(estimate(top), 1 + 9);
        let nested = br#"{"messages":[{"content":"abcdefgh","content":"abcd","text":"efgh"}]}"#;
        assert_eq!(estimate(nested), 2 + 16);
    }

    /// Text with the characters JSON escapes, and one- to four-byte UTF-8.
    fn text() -> impl Strategy<Value = String> {
        let special =
            prop::sample::select(vec!['a', ' ', '"', '\\', '\n', '\u{1}', 'é', '€', '😀']);
        prop::collection::vec(prop_oneof![special, any::<char>()], 0..12)
            .prop_map(|chars| chars.into_iter().collect())
    }

    /// Keys the estimate looks for, near misses, and anything.
    fn key() -> impl Strategy<Value = String> {
        let known = prop::sample::select(vec![
            "messages",
            "prompt",
            "input",
            "system",
            "instructions",
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "content",
            "text",
            "role",
            "Content",
            "max_tokens ",
        ]);
        prop_oneof![4 => known.prop_map(String::from), 1 => text()]
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            1 => Just(Value::Null),
            1 => any::<bool>().prop_map(Value::from),
            1 => (0u64..5000).prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => any::<i64>().prop_map(Value::from),
            1 => any::<f64>().prop_map(Value::from),
            4 => text().prop_map(Value::from),
        ];
        leaf.prop_recursive(5, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key(), inner), 0..6)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    /// A request body: mostly an object, written member by member so keys can repeat.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        let object = (prop::collection::vec((key(), json()), 0..8), any::<bool>()).prop_map(
            |(members, pretty)| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(k, v)| {
                        let v = if pretty {
                            serde_json::to_string_pretty(v).unwrap()
                        } else {
                            v.to_string()
                        };
                        format!("{}:{v}", Value::from(k.as_str()))
                    })
                    .collect();
                format!("{{{}}}", members.join(if pretty { ",\n " } else { "," })).into_bytes()
            },
        );
        prop_oneof![9 => object, 1 => json().prop_map(|v| v.to_string().into_bytes())]
    }

    proptest! {
        #[test]
        fn matches_the_tree(body in body(), default in 0u32..100_000) {
            prop_assert_eq!(estimate_tokens(&body, default), estimate_tokens_tree(&body, default));
        }

        #[test]
        fn matches_the_tree_on_broken_bodies(
            body in body(),
            at in any::<prop::sample::Index>(),
            byte in prop::sample::select(b"\"\\{}[],:0e-u \xff\xc3\x80\x01".to_vec()),
            cut in any::<bool>(),
        ) {
            let mut body = body;
            let i = at.index(body.len() + 1);
            if cut {
                body.truncate(i);
            } else if i < body.len() {
                body[i] = byte;
            }
            prop_assert_eq!(estimate_tokens(&body, 16), estimate_tokens_tree(&body, 16));
        }
    }
}
