//! Why an answer ended, in each API: a closed table both ways. A value outside it is not
//! passed on raw (a strict client refuses an unknown `finish_reason`): the answer side
//! treats it as a malformed answer.

/// OpenAI's `finish_reason` for Anthropic's `stop_reason`.
pub fn to_finish_reason(stop_reason: &str) -> Option<&'static str> {
    Some(match stop_reason {
        "end_turn" | "stop_sequence" => "stop",
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "refusal" => "content_filter",
        _ => return None,
    })
}

/// Anthropic's `stop_reason` for OpenAI's `finish_reason`. (`stop` cannot say whether a
/// stop sequence matched: it is `end_turn`, with `stop_sequence: null`.)
pub fn to_stop_reason(finish_reason: &str) -> Option<&'static str> {
    Some(match finish_reason {
        "stop" => "end_turn",
        "length" => "max_tokens",
        "tool_calls" | "function_call" => "tool_use",
        "content_filter" => "refusal",
        _ => return None,
    })
}

/// The Responses API's ending for Anthropic's `stop_reason`: the response's `status`, and
/// the `incomplete_details.reason` when it is `incomplete`.
pub fn to_responses_status(stop_reason: &str) -> Option<(&'static str, Option<&'static str>)> {
    Some(match stop_reason {
        "end_turn" | "stop_sequence" | "tool_use" => ("completed", None),
        "max_tokens" | "model_context_window_exceeded" => ("incomplete", Some("max_output_tokens")),
        "refusal" => ("incomplete", Some("content_filter")),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_closed_and_round_trips_where_it_can() {
        for finish in ["stop", "length", "tool_calls", "content_filter"] {
            let stop = to_stop_reason(finish).unwrap();
            assert_eq!(to_finish_reason(stop), Some(finish));
        }
        for raw in ["pause_turn", "weird", ""] {
            assert_eq!(to_finish_reason(raw), None);
        }
        assert_eq!(to_stop_reason("end_turn"), None, "never a raw value across");
    }
}
