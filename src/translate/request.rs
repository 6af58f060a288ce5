//! Requests, chat completions ⇄ messages, and the judgement of each target.

use serde_json::{Map, Value};

use super::{Direction, Judge, Untranslatable};
use crate::api::ParsedRequest;

/// What a target's translation may use beyond the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    /// The route's `translate.drop`: top-level fields it allows to be lost.
    pub drop: &'a [String],
    /// The target's `max_tokens`, for an Anthropic target when the caller set none.
    pub max_tokens: Option<u64>,
}

/// A request translated for its target.
#[derive(Debug, Clone)]
pub struct Converted {
    pub json: Map<String, Value>,
    /// Fields lost because the route allowed it (for the response header).
    pub dropped: Vec<String>,
}

/// The caller's request for the target, or the paths it cannot carry.
pub fn convert(
    direction: Direction,
    caller: &ParsedRequest,
    options: Options<'_>,
) -> Result<Converted, Untranslatable> {
    let mut judge = Judge::new(options.drop);
    let json = match direction {
        Direction::ResponsesToMessages => {
            super::responses::request(&caller.json, &mut judge, options.max_tokens)
        }
        Direction::ChatToMessages | Direction::MessagesToChat => {
            judge.lose("", "");
            Map::new()
        }
    };
    if judge.losses.is_empty() {
        Ok(Converted {
            json,
            dropped: judge.dropped,
        })
    } else {
        Err(Untranslatable {
            paths: judge.losses,
        })
    }
}
