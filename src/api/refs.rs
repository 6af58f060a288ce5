//! What a Responses API create names that the provider holds for it: a previous
//! response, a conversation, stored items, a stored prompt, files and remote images.
//! Read once with the request (pure), so that the owners layer can check each named
//! object against the tenant that created it, and the meter can reserve the input the
//! provider adds to the body.
//!
//! Ids are compared as the provider reads them: surrounding whitespace is not part of an
//! id (OpenAI answered `"resp_x "` as `resp_x`), so it is trimmed here before any lookup.

use serde_json::{Map, Value};

use super::RequestError;

/// The stored objects one Responses create refers to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredRefs {
    /// `previous_response_id`, trimmed.
    pub previous_response: Option<String>,
    /// `conversation` (an id, or an object with an `id`), trimmed.
    pub conversation: Option<String>,
    /// Each input item that names an id (an `item_reference`, or an item passed back by
    /// id): its index in `input` and the trimmed id.
    pub items: Vec<(usize, String)>,
    /// Names server-held context whose size Backstop does not know: a conversation, an
    /// `item_reference`, a stored `prompt`, a file (`file_id`, `file_url`) or a remote
    /// image URL. The meter then reserves at least the tenant's `min_input_tokens`.
    pub unsized_context: bool,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An id as the provider reads it.
fn normalise(id: &str) -> String {
    id.trim().to_string()
}

/// Whether a content part names content Backstop cannot see in the body.
fn names_held_content(part: &Value) -> bool {
    let field = |k: &str| part.get(k).and_then(Value::as_str);
    match field("type") {
        Some("input_file") => field("file_id").is_some() || field("file_url").is_some(),
        Some("input_image") => {
            field("file_id").is_some()
                || field("image_url").is_some_and(|url| !url.starts_with("data:"))
        }
        _ => false,
    }
}

impl StoredRefs {
    /// The references of a Responses create, or why one of them is malformed (an id that
    /// is not a string is refused before anything is looked up or forwarded).
    pub fn read(json: &Map<String, Value>) -> Result<StoredRefs, RequestError> {
        let mut refs = StoredRefs::default();
        match json.get("previous_response_id") {
            None | Some(Value::Null) => {}
            Some(Value::String(id)) => refs.previous_response = Some(normalise(id)),
            Some(other) => {
                return Err(RequestError::InvalidParameter {
                    param: "previous_response_id",
                    detail: format!("must be a string, got {}", type_name(other)),
                })
            }
        }
        let conversation = match json.get("conversation") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id),
            Some(Value::Object(c)) => match c.get("id") {
                Some(Value::String(id)) => Some(id),
                other => {
                    return Err(RequestError::InvalidParameter {
                        param: "conversation",
                        detail: format!(
                            "conversation.id must be a string, got {}",
                            other.map_or("nothing", type_name)
                        ),
                    })
                }
            },
            Some(other) => {
                return Err(RequestError::InvalidParameter {
                    param: "conversation",
                    detail: format!(
                        "must be a string or an object with an `id`, got {}",
                        type_name(other)
                    ),
                })
            }
        };
        if let Some(id) = conversation {
            refs.conversation = Some(normalise(id));
            refs.unsized_context = true;
        }
        if json.get("prompt").is_some_and(|p| !p.is_null()) {
            refs.unsized_context = true;
        }
        if let Some(Value::Array(items)) = json.get("input") {
            for (i, item) in items.iter().enumerate() {
                let reference = item.get("type").and_then(Value::as_str) == Some("item_reference");
                match item.get("id") {
                    None | Some(Value::Null) if !reference => {}
                    Some(Value::String(id)) => refs.items.push((i, normalise(id))),
                    other => {
                        return Err(RequestError::InvalidParameter {
                            param: "input",
                            detail: format!(
                                "input[{i}].id must be a string, got {}",
                                other.map_or("nothing", type_name)
                            ),
                        })
                    }
                }
                if reference {
                    refs.unsized_context = true;
                }
                if let Some(Value::Array(parts)) = item.get("content") {
                    if parts.iter().any(names_held_content) {
                        refs.unsized_context = true;
                    }
                }
            }
        }
        Ok(refs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<StoredRefs, RequestError> {
        let Value::Object(map) = v else { panic!() };
        StoredRefs::read(&map)
    }

    #[test]
    fn ids_are_read_trimmed_and_non_strings_refused() {
        let refs = read(json!({
            "previous_response_id": "resp_1 ",
            "conversation": {"id": " conv_1"},
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "item_reference", "id": "msg_1"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ],
        }))
        .unwrap();
        assert_eq!(refs.previous_response.as_deref(), Some("resp_1"));
        assert_eq!(refs.conversation.as_deref(), Some("conv_1"));
        assert_eq!(
            refs.items,
            vec![(1, "msg_1".to_string()), (2, "rs_1".to_string())]
        );
        assert!(refs.unsized_context);

        for bad in [
            json!({"previous_response_id": ["resp_1"]}),
            json!({"previous_response_id": 7}),
            json!({"conversation": ["conv_1"]}),
            json!({"conversation": {"id": 1}}),
            json!({"input": [{"type": "item_reference", "id": ["msg_1"]}]}),
            json!({"input": [{"type": "item_reference"}]}),
        ] {
            assert!(
                matches!(
                    read(bad.clone()),
                    Err(RequestError::InvalidParameter { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn only_context_the_body_lacks_is_unsized() {
        let plain = read(json!({"previous_response_id": "resp_1", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}))
        .unwrap();
        assert!(!plain.unsized_context);
        for held in [
            json!({"prompt": {"id": "pmpt_1"}}),
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}),
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}),
        ] {
            assert!(read(held.clone()).unwrap().unsized_context, "{held}");
        }
    }
}
