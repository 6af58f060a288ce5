//! The one rule for identifiers a client sends in a header (`x-session-id`,
//! `Idempotency-Key`): read by the context and idempotency layers, which refuse a bad
//! one, and by the edge's request span, which leaves a bad one out.

use std::fmt;

/// Why a client identifier header was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidId {
    /// Longer than the configured limit.
    TooLong { len: usize, max: usize },
    /// A space, a control byte or a non-ASCII byte.
    NotVisibleAscii,
}

impl fmt::Display for InvalidId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidId::TooLong { len, max } => {
                write!(f, "{len} bytes, over the limit of {max}")
            }
            InvalidId::NotVisibleAscii => {
                f.write_str("only visible ASCII characters (0x21-0x7E) are allowed")
            }
        }
    }
}

/// A client identifier header: absent or blank is `None`; otherwise it must be at most
/// `max` bytes of visible ASCII (no spaces, no control or non-ASCII bytes).
pub fn identifier(
    headers: &http::HeaderMap,
    name: &str,
    max: usize,
) -> Result<Option<String>, InvalidId> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let bytes = value.as_bytes().trim_ascii();
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.len() > max {
        return Err(InvalidId::TooLong {
            len: bytes.len(),
            max,
        });
    }
    if !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(InvalidId::NotVisibleAscii);
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}
