//! The typed usage record: every kind of token a provider bills for one call, as the
//! target reported it, carried unchanged from the answer to the books, the ledger and
//! the report. The two APIs count differently (OpenAI's `prompt_tokens` includes its
//! cached part; Anthropic's `input_tokens` excludes its cache writes and reads); the
//! record holds each kind once, on its own line, so each is priced once.

use serde::{Deserialize, Serialize};

/// How long a prompt-cache write is kept (Anthropic prices the two differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CacheTtl {
    FiveMinutes,
    OneHour,
}

/// The tokens of one call, by the kind they are billed as.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tokens {
    /// Input billed at the input price: OpenAI's prompt less its cached part,
    /// Anthropic's `input_tokens`.
    pub input: u64,
    /// Prompt-cache writes kept five minutes (Anthropic).
    pub cache_write_5m: u64,
    /// Prompt-cache writes kept an hour (Anthropic).
    pub cache_write_1h: u64,
    /// Prompt-cache reads: Anthropic's, and OpenAI's cached input.
    pub cache_read: u64,
    /// Output, reasoning included.
    pub output: u64,
    /// The part of `output` that was reasoning (billed as output; kept for the books).
    pub reasoning: u64,
    /// Server-side web searches the call made (a fee per search).
    pub web_searches: u64,
}

impl Tokens {
    /// Plain input and output only (a reservation charged whole, an old record).
    pub fn plain(input: u64, output: u64) -> Tokens {
        Tokens {
            input,
            output,
            ..Tokens::default()
        }
    }

    /// Every cache write, whatever its lifetime.
    pub fn cache_write(&self) -> u64 {
        self.cache_write_5m.saturating_add(self.cache_write_1h)
    }

    /// Every prompt token the provider processed: plain input, cache writes and reads.
    /// Long-context price tiers are chosen by it.
    pub fn prompt(&self) -> u64 {
        self.input
            .saturating_add(self.cache_write())
            .saturating_add(self.cache_read)
    }

    /// Every token the provider processed, as token caps count them.
    pub fn total(&self) -> u64 {
        self.prompt().saturating_add(self.output)
    }

    /// Field by field, saturating.
    pub fn plus(self, other: Tokens) -> Tokens {
        Tokens {
            input: self.input.saturating_add(other.input),
            cache_write_5m: self.cache_write_5m.saturating_add(other.cache_write_5m),
            cache_write_1h: self.cache_write_1h.saturating_add(other.cache_write_1h),
            cache_read: self.cache_read.saturating_add(other.cache_read),
            output: self.output.saturating_add(other.output),
            reasoning: self.reasoning.saturating_add(other.reasoning),
            web_searches: self.web_searches.saturating_add(other.web_searches),
        }
    }

    /// Whether any kind beyond plain input and output is set (old readers know only
    /// those two).
    pub fn has_extra_kinds(&self) -> bool {
        self.cache_write() > 0 || self.cache_read > 0 || self.reasoning > 0 || self.web_searches > 0
    }

    /// Each kind with its label in `backstop_tokens_total{kind}`, reasoning apart
    /// (it is inside `output`).
    pub fn by_kind(&self) -> [(&'static str, u64); 6] {
        [
            ("input", self.input),
            ("cache_write_5m", self.cache_write_5m),
            ("cache_write_1h", self.cache_write_1h),
            ("cache_read", self.cache_read),
            ("output", self.output),
            ("reasoning", self.reasoning),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_counts_every_input_kind_and_the_total_adds_output() {
        let t = Tokens {
            input: 100,
            cache_write_5m: 20_000,
            cache_write_1h: 5,
            cache_read: 80_000,
            output: 500,
            reasoning: 200,
            web_searches: 2,
        };
        assert_eq!(t.prompt(), 100_105);
        assert_eq!(t.total(), 100_605, "reasoning is inside output");
        assert!(t.has_extra_kinds());
        assert!(!Tokens::plain(1, 2).has_extra_kinds());
        let max = Tokens::plain(u64::MAX, u64::MAX);
        assert_eq!(max.total(), u64::MAX);
        assert_eq!(max.plus(t).input, u64::MAX);
    }
}
