//! Tool-call ids across providers. Anthropic accepts only `^[a-zA-Z0-9_-]+$`; OpenAI
//! accepts any string of at most 40 characters. An id is kept where the target accepts
//! it; otherwise it is encoded, injectively and reversibly, so one conversation can go
//! to one provider and back on later turns and every call still meets its result.
//!
//! The encoding is `bkid_` and the id's bytes in lowercase hex. An id that is valid but
//! already starts with `bkid_` is encoded too, so the two kinds never collide.

const PREFIX: &str = "bkid_";

/// Longest tool-call id OpenAI accepts.
pub const OPENAI_MAX_ID: usize = 40;

fn anthropic_valid(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The id as Anthropic is to see it.
pub fn for_anthropic(id: &str) -> String {
    if anthropic_valid(id) && !id.starts_with(PREFIX) {
        return id.to_string();
    }
    let mut out = String::with_capacity(PREFIX.len() + 2 * id.len());
    out.push_str(PREFIX);
    for b in id.bytes() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The original id behind one Anthropic saw (an id that was never encoded is itself).
pub fn from_anthropic(id: &str) -> String {
    decode(id).unwrap_or_else(|| id.to_string())
}

fn decode(id: &str) -> Option<String> {
    let hex = id.strip_prefix(PREFIX)?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// The id as OpenAI is to see it: the original (decoded when it was encoded for
/// Anthropic), `None` when OpenAI would refuse it (longer than 40 characters).
pub fn for_openai(id: &str) -> Option<String> {
    let original = from_anthropic(id);
    (original.chars().count() <= OPENAI_MAX_ID && !original.is_empty()).then_some(original)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn valid_ids_are_kept_and_others_encoded() {
        assert_eq!(for_anthropic("call_abc-1"), "call_abc-1");
        assert_eq!(for_anthropic("toolu_01A"), "toolu_01A");
        let encoded = for_anthropic("functions.Bash:0");
        assert!(anthropic_valid(&encoded), "{encoded}");
        assert_eq!(from_anthropic(&encoded), "functions.Bash:0");
        assert_eq!(for_openai(&encoded).as_deref(), Some("functions.Bash:0"));
        assert_eq!(for_openai(&"x".repeat(41)), None);
    }

    proptest! {
        #[test]
        fn the_encoding_is_injective_reversible_and_valid(a in ".{1,24}", b in "(bkid_)?[a-z0-9_]{0,8}") {
            for id in [&a, &b] {
                if id.is_empty() { continue; }
                let seen = for_anthropic(id);
                prop_assert!(anthropic_valid(&seen));
                prop_assert_eq!(&from_anthropic(&seen), id);
            }
            if a != b && !a.is_empty() && !b.is_empty() {
                prop_assert_ne!(for_anthropic(&a), for_anthropic(&b));
            }
        }
    }
}
