//! What did the model answer? Reading it: `{"subtask": "...", "done": bool}`, however it is
//! wrapped.
//!
//! Chat models wrap JSON in reasoning (`<think>…</think>`), code fences or prose, even when
//! asked for JSON only; so the answer is unwrapped step by step, and the first balanced
//! `{…}` object that holds a usable subtask wins.

/// A usable answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub subtask: String,
    pub done: bool,
}

/// Why an answer could not be used (also what the corrective retry tells the model).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("the answer holds no JSON object")]
    NoObject,
    #[error("the JSON object has no \"subtask\" string")]
    NoSubtask,
    #[error("\"subtask\" is empty")]
    Empty,
    #[error("\"subtask\" is {got} bytes long; at most {max} fit the policy's prompt")]
    TooLong { max: usize, got: usize },
}

/// Most `{` positions tried as the start of an object (bounds the work on a long answer).
const MAX_CANDIDATES: usize = 32;

/// Extracts the answer from a model's message `content`. `max_bytes` is the most the
/// policy's prompt input holds.
pub fn parse(content: &str, max_bytes: usize) -> Result<Answer, ParseError> {
    let text = strip_fences(strip_think(content));
    let mut last = ParseError::NoObject;
    let candidates = text
        .char_indices()
        .filter(|&(_, c)| c == '{')
        .take(MAX_CANDIDATES);
    for (start, _) in candidates {
        let Some(len) = balanced_object(&text[start..]) else {
            continue;
        };
        let Ok(serde_json::Value::Object(map)) =
            serde_json::from_str::<serde_json::Value>(&text[start..start + len])
        else {
            continue;
        };
        match answer(&map, max_bytes) {
            Ok(a) => return Ok(a),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn answer(
    map: &serde_json::Map<String, serde_json::Value>,
    max_bytes: usize,
) -> Result<Answer, ParseError> {
    let Some(serde_json::Value::String(raw)) = map.get("subtask") else {
        return Err(ParseError::NoSubtask);
    };
    // One line, single spaces: the policy was trained on short instructions.
    let subtask = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    if subtask.is_empty() {
        return Err(ParseError::Empty);
    }
    if subtask.len() > max_bytes {
        return Err(ParseError::TooLong {
            max: max_bytes,
            got: subtask.len(),
        });
    }
    let done = match map.get("done") {
        Some(serde_json::Value::Bool(b)) => *b,
        Some(serde_json::Value::String(s)) => s.eq_ignore_ascii_case("true"),
        _ => false,
    };
    Ok(Answer { subtask, done })
}

/// Drops reasoning blocks: every `<think>…</think>`, an unclosed `<think>` to the end, and
/// everything before a stray `</think>` (templates that open the block in the prompt).
fn strip_think(s: &str) -> std::borrow::Cow<'_, str> {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    if !s.contains(OPEN) && !s.contains(CLOSE) {
        return s.into();
    }
    let mut rest = s;
    if let (Some(c), o) = (rest.find(CLOSE), rest.find(OPEN))
        && o.is_none_or(|o| c < o)
    {
        rest = &rest[c + CLOSE.len()..];
    }
    let mut out = String::with_capacity(rest.len());
    while let Some(o) = rest.find(OPEN) {
        out.push_str(&rest[..o]);
        match rest[o..].find(CLOSE) {
            Some(c) => rest = &rest[o + c + CLOSE.len()..],
            None => return out.into(),
        }
    }
    out.push_str(rest);
    out.into()
}

/// The inside of the first code fence (```json … ```), or the text itself.
fn strip_fences(s: std::borrow::Cow<'_, str>) -> std::borrow::Cow<'_, str> {
    let Some(open) = s.find("```") else {
        return s;
    };
    let after = &s[open + 3..];
    // Skip the info string (`json`) up to the end of the fence line.
    let body_start = after.find('\n').map_or(0, |n| n + 1);
    let body = &after[body_start..];
    let inner = match body.find("```") {
        Some(end) => &body[..end],
        None => body,
    };
    // A fence with no object inside (prose quoting code) does not hide the answer.
    if inner.contains('{') {
        inner.to_string().into()
    } else {
        s
    }
}

/// The byte length of the balanced `{…}` object `s` starts with, skipping braces inside JSON
/// strings (with their escapes).
fn balanced_object(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, b) in s.bytes().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => depth += 1,
            b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> Answer {
        parse(s, 64).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn plain_json() {
        let a = ok(r#"{"subtask": "pick up the red cup", "done": false}"#);
        assert_eq!(a.subtask, "pick up the red cup");
        assert!(!a.done);
        assert!(ok(r#"{"subtask":"stop","done":true}"#).done);
        assert!(!ok(r#"{"subtask":"go"}"#).done, "done defaults to false");
    }

    #[test]
    fn fenced_json_and_prose_around_it() {
        let a = ok(
            "Sure! Here is the plan:\n```json\n{\"subtask\": \"open the drawer\", \"done\": false}\n```\nGood luck.",
        );
        assert_eq!(a.subtask, "open the drawer");
        let a = ok("The next step: {\"subtask\": \"wipe\", \"done\": false} as asked.");
        assert_eq!(a.subtask, "wipe");
    }

    #[test]
    fn think_blocks_are_dropped() {
        let a = ok(
            "<think>The cup {maybe \"subtask\": \"wrong\"} is left.</think>\n{\"subtask\": \"grasp the cup\"}",
        );
        assert_eq!(a.subtask, "grasp the cup");
        // A template that opened the block in the prompt: only the close tag is generated.
        let a = ok("I see a cup {x}.</think>{\"subtask\": \"lift\"}");
        assert_eq!(a.subtask, "lift");
        // Unclosed reasoning hides nothing after it worth reading.
        assert_eq!(
            parse("{\"subtask\": \"a\"}<think>{\"subtask\": \"b\"}", 64).map(|a| a.subtask),
            Ok("a".to_string())
        );
    }

    #[test]
    fn braces_inside_strings_do_not_end_the_object() {
        let a = ok(r#"note {"subtask": "place the {blue} block \"here}\"", "done": false} end"#);
        assert_eq!(a.subtask, "place the {blue} block \"here}\"");
    }

    #[test]
    fn the_first_usable_object_wins() {
        let a = ok(r#"{"thought": "x"} then {"subtask": "push the button"}"#);
        assert_eq!(a.subtask, "push the button");
    }

    #[test]
    fn whitespace_is_folded_to_one_line() {
        assert_eq!(
            ok("{\"subtask\": \"  pick\\n up \\t it \"}").subtask,
            "pick up it"
        );
    }

    #[test]
    fn failures_say_why() {
        assert_eq!(
            parse("I cannot help with that.", 64),
            Err(ParseError::NoObject)
        );
        assert_eq!(parse("{\"subtask\": ", 64), Err(ParseError::NoObject));
        assert_eq!(parse("{\"task\": \"x\"}", 64), Err(ParseError::NoSubtask));
        assert_eq!(parse("{\"subtask\": 3}", 64), Err(ParseError::NoSubtask));
        assert_eq!(parse("{\"subtask\": \"  \"}", 64), Err(ParseError::Empty));
        assert_eq!(
            parse("{\"subtask\": \"abcdefghij\"}", 4),
            Err(ParseError::TooLong { max: 4, got: 10 })
        );
        assert_eq!(parse("}}}{", 64), Err(ParseError::NoObject));
    }

    #[test]
    fn arbitrary_text_never_panics() {
        for s in [
            "", "{", "}", "```", "```json", "<think>", "</think>", "\"{\"", "{\"\\", "é{ü}",
        ] {
            let _ = parse(s, 8);
        }
    }
}
