//! Every error code Backstop answers with, and everything that follows from a code: its
//! HTTP status, its category, the `type` each API's error body carries, whether it is a
//! refusal and whether it comes with `Retry-After`. A code is added here once: a line in
//! `error_codes!` (its variant and wire string) and an arm in [`ErrorCode::spec`],
//! which is exhaustive, so a new code cannot be half-wired. `docs/errors.md` is checked against [`ErrorCode::ALL`].

use std::fmt;

/// What kind of failure a code reports (the error taxonomy of PRODUCT.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// The request itself is wrong, or not allowed: never retried, the same request gets
    /// the same answer.
    CallerFault,
    /// The upstream failed, or broke the protocol, on every target tried.
    Upstream,
    /// The upstream answered 200 with a body that is not what was asked for.
    Malformed,
    /// Backstop refused on purpose (limits, budgets, the session guard, an open breaker,
    /// money it cannot account for): says nothing about whether the work itself fails.
    Refusal,
    /// Backstop itself could not serve the request (busy, out of time, a bug).
    Server,
}

impl Category {
    pub const fn as_str(self) -> &'static str {
        match self {
            Category::CallerFault => "caller_fault",
            Category::Upstream => "upstream",
            Category::Malformed => "malformed",
            Category::Refusal => "refusal",
            Category::Server => "server",
        }
    }
}

/// Declares [`ErrorCode`] from one list, so that [`ErrorCode::ALL`] and the wire
/// strings cannot leave a variant out.
macro_rules! error_codes {
    ($($variant:ident = $wire:literal,)*) => {
        /// An error code: the OpenAI body's `code`, the log line's `error` field, the
        /// `backstop_refusals_total` reason and the dashboard's refusal key are its
        /// [`as_str`](ErrorCode::as_str).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($variant,)*
        }

        impl ErrorCode {
            /// Every code, in the order of `docs/errors.md`'s table.
            pub const ALL: [ErrorCode; [$($wire),*].len()] = [$(ErrorCode::$variant),*];

            /// The wire string.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }
        }
    };
}

error_codes! {
    InvalidApiKey = "invalid_api_key",
    InvalidJson = "invalid_json",
    InvalidHeader = "invalid_header",
    InvalidParameter = "invalid_parameter",
    MissingModel = "missing_model",
    PreviousResponseNotFound = "previous_response_not_found",
    ItemNotFound = "item_not_found",
    ConversationNotFound = "conversation_not_found",
    ModelNotFound = "model_not_found",
    ApiMismatch = "api_mismatch",
    UnsupportedConversion = "unsupported_conversion",
    RequestTooLarge = "request_too_large",
    TooManyItems = "too_many_items",
    BodyReadError = "body_read_error",
    RequestBodyTimeout = "request_body_timeout",
    UnknownEndpoint = "unknown_endpoint",
    MethodNotAllowed = "method_not_allowed",
    InvalidSchema = "invalid_schema",
    IdempotencyKeyReused = "idempotency_key_reused",
    DuplicateSideEffect = "duplicate_side_effect",
    NotFound = "not_found",
    InvalidAdminToken = "invalid_admin_token",
    AdminDisabled = "admin_disabled",
    ConfigInvalid = "config_invalid",
    ReloadUnavailable = "reload_unavailable",
    UpstreamUnavailable = "upstream_unavailable",
    UpstreamTimeout = "upstream_timeout",
    UpstreamAuthFailed = "upstream_auth_failed",
    UpstreamRedirect = "upstream_redirect",
    UpstreamResponseTooLarge = "upstream_response_too_large",
    UpstreamNotStreaming = "upstream_not_streaming",
    UpstreamMalformed = "upstream_malformed",
    OutputInvalid = "output_invalid",
    RateLimited = "rate_limited",
    TooManyConcurrent = "too_many_concurrent",
    BudgetExceeded = "budget_exceeded",
    UnpricedModel = "unpriced_model",
    SessionTripped = "session_tripped",
    LoopDetected = "loop_detected",
    CircuitOpen = "circuit_open",
    StoreUnavailable = "store_unavailable",
    StateUnavailable = "state_unavailable",
    Overloaded = "overloaded",
    RequestTimeout = "request_timeout",
    Internal = "internal_error",
}

/// What follows from a code, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub status: u16,
    pub category: Category,
    /// The OpenAI body's `type`.
    pub openai_type: &'static str,
    /// The Anthropic body's `error.type`: Anthropic's own name where one fits, else
    /// (`None`) the code itself.
    anthropic_type: Option<&'static str>,
    /// The answer carries `Retry-After`.
    pub retry_after: bool,
}

impl Spec {
    const fn new(status: u16, category: Category, openai_type: &'static str) -> Spec {
        Spec {
            status,
            category,
            openai_type,
            anthropic_type: None,
            retry_after: false,
        }
    }

    /// A fault of the request, typed `invalid_request_error` in both APIs.
    const fn invalid_request(status: u16) -> Spec {
        Spec::new(status, Category::CallerFault, "invalid_request_error")
            .anthropic("invalid_request_error")
    }

    const fn anthropic(self, anthropic_type: &'static str) -> Spec {
        Spec {
            anthropic_type: Some(anthropic_type),
            ..self
        }
    }

    const fn with_retry_after(self) -> Spec {
        Spec {
            retry_after: true,
            ..self
        }
    }
}

impl ErrorCode {
    /// The refusals, in [`ALL`](Self::ALL)'s order (the dashboard counts each).
    pub const REFUSALS: [ErrorCode; Self::refusal_count()] = {
        let mut out = [ErrorCode::Internal; Self::refusal_count()];
        let (mut i, mut n) = (0, 0);
        while i < Self::ALL.len() {
            if Self::ALL[i].is_refusal() {
                out[n] = Self::ALL[i];
                n += 1;
            }
            i += 1;
        }
        out
    };

    const fn refusal_count() -> usize {
        let (mut i, mut n) = (0, 0);
        while i < Self::ALL.len() {
            if Self::ALL[i].is_refusal() {
                n += 1;
            }
            i += 1;
        }
        n
    }

    /// Everything that follows from the code.
    pub const fn spec(self) -> Spec {
        use Category::*;
        use ErrorCode::*;
        match self {
            InvalidApiKey | InvalidAdminToken => {
                Spec::new(401, CallerFault, "authentication_error")
                    .anthropic("authentication_error")
            }
            InvalidJson
            | InvalidHeader
            | InvalidParameter
            | MissingModel
            | PreviousResponseNotFound
            | ItemNotFound
            | ConversationNotFound
            | ApiMismatch
            | UnsupportedConversion
            | TooManyItems
            | BodyReadError
            | InvalidSchema
            | ConfigInvalid => Spec::invalid_request(400),
            ModelNotFound | UnknownEndpoint | NotFound => {
                Spec::invalid_request(404).anthropic("not_found_error")
            }
            MethodNotAllowed => Spec::invalid_request(405),
            ReloadUnavailable => Spec::invalid_request(409),
            DuplicateSideEffect => {
                Spec::new(409, Refusal, "invalid_request_error").anthropic("invalid_request_error")
            }
            IdempotencyKeyReused => Spec::invalid_request(422),
            RequestTooLarge => Spec::invalid_request(413).anthropic("request_too_large"),
            RequestBodyTimeout => Spec::new(408, CallerFault, "timeout_error"),
            AdminDisabled => {
                Spec::new(403, CallerFault, "permission_error").anthropic("permission_error")
            }
            UpstreamUnavailable
            | UpstreamAuthFailed
            | UpstreamRedirect
            | UpstreamResponseTooLarge
            | UpstreamNotStreaming => Spec::new(502, Upstream, "upstream_error"),
            UpstreamTimeout => Spec::new(504, Upstream, "upstream_error"),
            UpstreamMalformed | OutputInvalid => Spec::new(502, Malformed, "upstream_error"),
            RateLimited => Spec::new(429, Refusal, "rate_limit_error").with_retry_after(),
            TooManyConcurrent => Spec::new(429, Refusal, "rate_limit_error"),
            BudgetExceeded | UnpricedModel => Spec::new(402, Refusal, "budget_error"),
            SessionTripped | LoopDetected => {
                Spec::new(429, Refusal, "session_error").with_retry_after()
            }
            CircuitOpen => Spec::new(503, Refusal, "upstream_error").with_retry_after(),
            StoreUnavailable => Spec::new(503, Refusal, "server_error").anthropic("api_error"),
            StateUnavailable => Spec::new(503, Refusal, "server_error")
                .anthropic("api_error")
                .with_retry_after(),
            Overloaded => Spec::new(503, Server, "server_error")
                .anthropic("overloaded_error")
                .with_retry_after(),
            RequestTimeout => Spec::new(504, Server, "timeout_error"),
            Internal => Spec::new(500, Server, "internal_error").anthropic("api_error"),
        }
    }

    pub const fn status(self) -> u16 {
        self.spec().status
    }

    pub const fn category(self) -> Category {
        self.spec().category
    }

    pub const fn openai_type(self) -> &'static str {
        self.spec().openai_type
    }

    pub const fn anthropic_type(self) -> &'static str {
        match self.spec().anthropic_type {
            Some(anthropic_type) => anthropic_type,
            None => self.as_str(),
        }
    }

    /// Backstop refused on purpose: counted in `backstop_refusals_total` and under its
    /// own reason on the dashboard, and not as a failure of the session's work.
    pub const fn is_refusal(self) -> bool {
        matches!(self.category(), Category::Refusal)
    }

    /// The answer carries `Retry-After`.
    pub const fn has_retry_after(self) -> bool {
        self.spec().retry_after
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_code_is_listed_once_with_a_wire_string_of_its_own() {
        let codes: HashSet<ErrorCode> = ErrorCode::ALL.into_iter().collect();
        assert_eq!(codes.len(), ErrorCode::ALL.len());
        let wire: HashSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(wire.len(), ErrorCode::ALL.len());
    }

    #[test]
    fn refusals_are_what_the_taxonomy_says() {
        let refusals: Vec<&str> = ErrorCode::REFUSALS.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            refusals,
            [
                "duplicate_side_effect",
                "rate_limited",
                "too_many_concurrent",
                "budget_exceeded",
                "unpriced_model",
                "session_tripped",
                "loop_detected",
                "circuit_open",
                "store_unavailable",
                "state_unavailable",
            ]
        );
        // A caller's mistake and a busy server are not refusals by policy.
        assert!(!ErrorCode::IdempotencyKeyReused.is_refusal());
        assert!(!ErrorCode::Overloaded.is_refusal());
    }

    #[test]
    fn a_trip_codes_wire_string_is_its_error_codes() {
        use crate::policy::guard::TripCode;
        for trip in [TripCode::SessionTripped, TripCode::LoopDetected] {
            assert_eq!(ErrorCode::from(trip).as_str(), trip.as_str());
        }
    }

    /// `docs/errors.md` has one table row per code, and the row says what the code does.
    #[test]
    fn the_error_reference_lists_every_code_as_it_is() {
        let doc = include_str!("../../docs/errors.md");
        let (_, table) = doc
            .split_once("\n## Error codes\n")
            .expect("an Error codes section");
        let table = table.split("\n#").next().unwrap_or_default();
        let rows: Vec<Vec<&str>> = table
            .lines()
            .filter(|line| line.starts_with("| `"))
            .map(|line| line.trim_matches('|').split(" | ").map(str::trim).collect())
            .collect();
        for code in ErrorCode::ALL {
            let name = format!("`{code}`");
            let found: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == name).collect();
            assert_eq!(found.len(), 1, "docs/errors.md: one row for {name}");
            let row = found[0];
            let yes = |b: bool| if b { "yes" } else { "no" };
            let expected = [
                name.clone(),
                code.status().to_string(),
                code.category().as_str().to_string(),
                format!("`{}`", code.openai_type()),
                format!("`{}`", code.anthropic_type()),
                yes(code.is_refusal()).to_string(),
                yes(code.has_retry_after()).to_string(),
            ];
            assert_eq!(
                row[..expected.len()],
                expected.each_ref().map(String::as_str),
                "docs/errors.md's row for {name}"
            );
        }
        assert_eq!(
            rows.len(),
            ErrorCode::ALL.len(),
            "docs/errors.md: a row for no code"
        );
    }
}
