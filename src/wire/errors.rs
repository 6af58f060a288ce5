//! What an error says, before a format shapes it ([`super::error_body`]).

/// What an error says, independent of the format it will be written in.
pub struct ErrorParts<'a> {
    /// OpenAI `type`: a broad category (`invalid_request_error`, `upstream_error`, ...).
    pub category: &'a str,
    /// The exact thing that happened (`model_not_found`, `upstream_timeout`, ...).
    pub code: &'a str,
    /// Anthropic `type`: Anthropic's own name where one exists, else `code`.
    pub anthropic_type: &'a str,
    pub message: &'a str,
    pub param: Option<&'a str>,
}
