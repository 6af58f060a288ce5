//! Side effects committed once: which tool calls of a session are side effects, when one
//! is committed, and when an answer proposes one again. The rule alone: the calls and
//! results are read from the wire by `api::tool_calls`, the journal is kept by
//! `state::journal`.
//!
//! A call of a listed tool is *committed* when a later request of the session carries
//! its result; a result that says it failed is journaled as failed and not committed
//! (retrying a failed side effect is legitimate). An answer that proposes a committed
//! call again (same tool, same canonical arguments) is a duplicate, unless the agent
//! declared the repeat.

use sha2::{Digest, Sha256};

/// What happens to an answer that proposes a committed side effect again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRepeat {
    /// One corrective attempt telling the model the call was made; a second proposal is
    /// refused.
    Correct,
    /// 409 `duplicate_side_effect`.
    Refuse,
    /// Passed through, marked `x-backstop-side-effect: duplicate; tool=NAME`.
    Annotate,
}

impl OnRepeat {
    /// `correct`, `refuse` or `annotate`.
    pub fn parse(text: &str) -> Option<OnRepeat> {
        match text {
            "correct" => Some(OnRepeat::Correct),
            "refuse" => Some(OnRepeat::Refuse),
            "annotate" => Some(OnRepeat::Annotate),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OnRepeat::Correct => "correct",
            OnRepeat::Refuse => "refuse",
            OnRepeat::Annotate => "annotate",
        }
    }

    /// The stricter of two (a session may narrow its tenant's, never widen it).
    fn strictest(self, other: OnRepeat) -> OnRepeat {
        let rank = |r: OnRepeat| match r {
            OnRepeat::Annotate => 0,
            OnRepeat::Correct => 1,
            OnRepeat::Refuse => 2,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// What a journal entry keeps of a call's arguments and result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// The canonical arguments and the (truncated) result, with their hashes.
    Full,
    /// Their hashes alone.
    Hash,
}

/// A tenant's (or a session's narrowed) side-effect rule.
#[derive(Debug, Clone, PartialEq)]
pub struct SideEffectPolicy {
    /// Tool names or globs (`*` any run of characters, `?` one).
    pub tools: Vec<String>,
    /// A session's own list (`x-backstop-side-effects`): a tool is then a side effect
    /// only when both lists name it.
    pub only: Option<Vec<String>>,
    pub on_repeat: OnRepeat,
    pub record: Record,
    /// `restore = "note"`: a replanned conversation (none of the session's committed
    /// calls in it) is reminded of them.
    pub restore: bool,
    /// A journal the store cannot read or write refuses the request rather than let it
    /// go on unjournaled.
    pub fail_closed: bool,
    /// Entries kept per session, oldest dropped first.
    pub max_entries: usize,
}

/// The most of a result an entry keeps (its hash is of the whole).
pub const RESULT_BYTES: usize = 2_048;

/// Whether `name` matches the glob `pattern` (`*`, `?`; nothing else is special).
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic two-pointer match with one backtrack point per `*`.
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(c) if *c == '?' || *c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

impl SideEffectPolicy {
    /// Whether calls of `tool` are side effects.
    pub fn lists(&self, tool: &str) -> bool {
        let named = |patterns: &[String]| patterns.iter().any(|p| glob_matches(p, tool));
        named(&self.tools) && self.only.as_deref().is_none_or(named)
    }

    /// The rule narrowed by a session's own: a tool is a side effect only where both
    /// lists name it (so a session cannot add one), and a repeat is met by the stricter
    /// of the two `on_repeat`s.
    pub fn narrowed(&self, tools: Vec<String>, on_repeat: Option<OnRepeat>) -> SideEffectPolicy {
        SideEffectPolicy {
            only: Some(tools),
            on_repeat: on_repeat.map_or(self.on_repeat, |r| self.on_repeat.strictest(r)),
            ..self.clone()
        }
    }
}

/// Canonical JSON of a call's arguments (key order and whitespace do not matter); text
/// that is not JSON is kept trimmed.
pub fn canonical_args(text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text)
        .map_or_else(|_| text.trim().to_string(), |v| v.to_string())
}

/// Hex SHA-256 of `text`: what `record = "hash"` keeps, and what entries are matched by.
pub fn digest(text: &str) -> String {
    let hash = Sha256::digest(text.as_bytes());
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key a call is matched by: its tool and canonical arguments.
pub fn call_key(tool: &str, canonical: &str) -> String {
    digest(&format!("{tool}\u{0}{canonical}"))
}

/// Whether a tool result says the side effect failed: Anthropic's `is_error`, or a JSON
/// object with a top-level `error` or `errors` that holds something (not `null`,
/// `false`, `""`, `[]` or `{}`).
pub fn result_failed(is_error: bool, content: &str) -> bool {
    use serde_json::Value;
    // `"error": null`, `false`, `""`, `[]` or `{}` says there was none.
    let says_error = |v: &Value| match v {
        Value::Null | Value::Bool(false) => false,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    };
    is_error
        || serde_json::from_str::<Value>(content)
            .ok()
            .and_then(|v| {
                v.as_object().map(|o| {
                    o.get("error").is_some_and(says_error)
                        || o.get("errors").is_some_and(says_error)
                })
            })
            .unwrap_or(false)
}

/// `text` cut to at most `max` bytes, on a character boundary.
pub fn truncated(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(tools: &[&str]) -> SideEffectPolicy {
        SideEffectPolicy {
            tools: tools.iter().map(|t| t.to_string()).collect(),
            only: None,
            on_repeat: OnRepeat::Correct,
            record: Record::Full,
            restore: false,
            fail_closed: false,
            max_entries: 1_000,
        }
    }

    #[test]
    fn tools_are_listed_by_name_or_glob() {
        let p = policy(&["send_email", "transfer_*", "create_?icket"]);
        for listed in ["send_email", "transfer_funds", "transfer_", "create_ticket"] {
            assert!(p.lists(listed), "{listed}");
        }
        for unlisted in [
            "send_emails",
            "get_weather",
            "transfer",
            "create_tickets",
            "",
        ] {
            assert!(!p.lists(unlisted), "{unlisted}");
        }
        assert!(glob_matches("*", ""));
        assert!(glob_matches("a*b*c", "aXXbYYc"));
        assert!(!glob_matches("a*b*c", "aXXbYY"));
    }

    #[test]
    fn a_session_narrows_its_tenants_rule_and_never_widens_it() {
        let p = policy(&["send_email", "transfer_*"]);
        let narrowed = p.narrowed(vec!["send_email".into(), "delete_*".into()], None);
        assert!(narrowed.lists("send_email"));
        assert!(!narrowed.lists("transfer_funds"), "left out by the session");
        assert!(
            !narrowed.lists("delete_user"),
            "not the tenant's: not added"
        );
        let one = p.narrowed(vec!["transfer_funds".into()], None);
        assert!(one.lists("transfer_funds") && !one.lists("transfer_stock"));
        assert!(!p.narrowed(vec![], None).lists("send_email"));
        let all = p.narrowed(vec!["*".into()], Some(OnRepeat::Refuse));
        assert!(all.lists("send_email") && all.lists("transfer_x") && !all.lists("other"));
        assert_eq!(all.on_repeat, OnRepeat::Refuse);
        assert_eq!(
            p.narrowed(vec!["*".into()], Some(OnRepeat::Annotate))
                .on_repeat,
            OnRepeat::Correct,
            "annotate is looser than the tenant's correct"
        );
    }

    #[test]
    fn arguments_match_whatever_their_key_order_and_spacing() {
        let a = canonical_args(r#"{"to": "a@x.io", "subject": "hi"}"#);
        let b = canonical_args(r#"{"subject":"hi","to":"a@x.io"}"#);
        assert_eq!(a, b);
        assert_eq!(call_key("send_email", &a), call_key("send_email", &b));
        assert_ne!(call_key("send_email", &a), call_key("send_sms", &a));
        assert_ne!(
            call_key("send_email", &a),
            call_key(
                "send_email",
                &canonical_args(r#"{"to":"b@x.io","subject":"hi"}"#)
            )
        );
        assert_eq!(canonical_args("  not json "), "not json");
        assert_eq!(digest("abc").len(), 64);
    }

    #[test]
    fn a_result_fails_by_is_error_or_a_top_level_error_key() {
        assert!(result_failed(true, "sent"));
        assert!(result_failed(false, r#"{"error": "smtp down"}"#));
        assert!(result_failed(false, r#"{"errors": ["quota"]}"#));
        for none in [
            r#"{"ok": true, "error": null}"#,
            r#"{"data": 1, "errors": []}"#,
            r#"{"error": false}"#,
            r#"{"error": ""}"#,
        ] {
            assert!(!result_failed(false, none), "{none}");
        }
        assert!(!result_failed(
            false,
            r#"{"status": "sent", "detail": {"error": null}}"#
        ));
        assert!(!result_failed(false, "error: this is text, not an object"));
        assert!(!result_failed(false, r#"["error"]"#));
    }

    #[test]
    fn a_result_is_cut_on_a_character_boundary() {
        assert_eq!(truncated("héllo", 2), "h");
        assert_eq!(truncated("héllo", 3), "hé");
        assert_eq!(truncated("abc", 10), "abc");
    }
}
