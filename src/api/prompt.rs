//! What a request's prompt may cost beyond its text, read once from the parsed body:
//! the images and documents it carries (sized from their headers, never from their
//! base64 bytes), whether it asks the provider to cache the prompt (and for how long),
//! and the web searches it lets the model make. The meter reserves the prompt from
//! this at the target provider's own token rules ([`PromptShape::input_tokens`]).

use serde_json::{Map, Value};

use super::Endpoint;
use crate::billing::{
    media::{self, Detail, MediaSize},
    CacheTtl,
};

/// One image or document a prompt carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Media {
    /// Sized from its header.
    Image {
        width: u32,
        height: u32,
        detail: Detail,
    },
    /// A remote URL or a file id: not sized here, reserved at the most an image costs.
    UnsizedImage { detail: Detail },
    /// A PDF of a known page count.
    Pdf { pages: u32 },
    /// A document Backstop cannot size (a URL, a file id, an unreadable file):
    /// reserved at [`media::UNSIZED_DOCUMENT_PAGES`] pages.
    UnsizedDocument,
}

/// The cost-relevant shape of a prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptShape {
    /// The bytes of inline (base64) media in the body: not text, so not estimated as
    /// text tokens.
    pub media_bytes: u64,
    pub media: Vec<Media>,
    /// The prompt asks to be cached (`cache_control` anywhere): the longest lifetime
    /// asked for.
    pub cache: Option<CacheTtl>,
    /// The most server-side web searches the request lets the model make.
    pub web_searches: u64,
}

/// Searches reserved for a web search tool that sets no `max_uses`.
pub const DEFAULT_WEB_SEARCHES: u64 = 10;

/// Whose token rules price a prompt's media.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaRules<'a> {
    /// Anthropic's, whose image tier depends on the model.
    Anthropic { model: &'a str },
    /// OpenAI's, which depend on the model.
    OpenAi { model: &'a str },
}

impl PromptShape {
    /// Reads the shape of `json`, a request body of `endpoint`; `body` is its text, for
    /// a quick look that skips the walk when nothing in it could matter.
    pub fn read(endpoint: Endpoint, body: &[u8], json: &Map<String, Value>) -> PromptShape {
        const HINTS: [&[u8]; 5] = [
            b"cache_control",
            b"base64",
            b"image",
            b"file",
            b"web_search",
        ];
        let mut shape = PromptShape::default();
        if endpoint == Endpoint::Embeddings
            || !HINTS
                .iter()
                .any(|hint| memchr::memmem::find(body, hint).is_some())
        {
            return shape;
        }
        for key in ["messages", "input", "system", "tools"] {
            if let Some(value) = json.get(key) {
                shape.walk(value, 0);
            }
        }
        if let Some(control) = json.get("cache_control") {
            shape.cache_marked(control);
        }
        if let Some(Value::Array(tools)) = json.get("tools") {
            for tool in tools {
                let searches = tool.get("type").and_then(Value::as_str).is_some_and(|t| {
                    t.starts_with("web_search") && endpoint != Endpoint::Responses
                });
                if searches {
                    let uses = tool.get("max_uses").and_then(Value::as_u64);
                    shape.web_searches = shape
                        .web_searches
                        .saturating_add(uses.unwrap_or(DEFAULT_WEB_SEARCHES));
                }
            }
        }
        shape
    }

    /// The input tokens to reserve for a body of `body_len` bytes with this shape: its
    /// text at about four bytes a token, plus each item of media at `rules`.
    pub fn input_tokens(&self, body_len: usize, rules: MediaRules<'_>) -> u64 {
        let text = (body_len as u64).saturating_sub(self.media_bytes);
        let media = self
            .media
            .iter()
            .map(|m| m.tokens(rules))
            .fold(0u64, u64::saturating_add);
        crate::policy::budget::estimate_prompt_tokens(text as usize).saturating_add(media)
    }

    fn cache_marked(&mut self, control: &Value) {
        if !control.is_object() {
            return;
        }
        let ttl = match control.get("ttl").and_then(Value::as_str) {
            Some("1h") => CacheTtl::OneHour,
            _ => CacheTtl::FiveMinutes,
        };
        self.cache = self.cache.max(Some(ttl));
    }

    /// Every object below `value`, depth-bounded (the parser bounds it too).
    fn walk(&mut self, value: &Value, depth: usize) {
        if depth > 64 {
            return;
        }
        match value {
            Value::Array(items) => {
                for item in items {
                    self.walk(item, depth + 1);
                }
            }
            Value::Object(object) => {
                if let Some(control) = object.get("cache_control") {
                    self.cache_marked(control);
                }
                // A media part is read whole by `part`; anything else may nest more
                // (tool results carrying images, Responses items' content).
                if self.part(object) {
                    return;
                }
                for (key, child) in object {
                    if key != "cache_control" {
                        self.walk(child, depth + 1);
                    }
                }
            }
            _ => {}
        }
    }

    /// One content part, if it is media, in any of the three APIs' shapes: whether it was.
    fn part(&mut self, part: &Map<String, Value>) -> bool {
        fn text(v: Option<&Value>) -> Option<&str> {
            v.and_then(Value::as_str)
        }
        let detail = |v: Option<&Value>| Detail::from_param(text(v));
        match text(part.get("type")) {
            // Anthropic: `source` says where the bytes are.
            Some(kind @ ("image" | "document")) => {
                let Some(source) = part.get("source").and_then(Value::as_object) else {
                    return false;
                };
                let image = kind == "image";
                match (text(source.get("type")), text(source.get("data"))) {
                    (Some("base64"), Some(data)) => self.inline(data, image, Detail::Auto),
                    // Plain text or nested content blocks: text, estimated as text.
                    (Some("text" | "content"), _) => return false,
                    _ => self.not_sized(image, Detail::Auto),
                }
            }
            // OpenAI chat: a data URL, or a remote one.
            Some("image_url") => {
                let (url, detail) = match part.get("image_url") {
                    Some(Value::String(url)) => (Some(url.as_str()), Detail::Auto),
                    Some(Value::Object(o)) => (text(o.get("url")), detail(o.get("detail"))),
                    _ => return false,
                };
                self.url(url, true, detail);
            }
            Some("file") => match part.get("file").and_then(Value::as_object) {
                Some(file) => self.url(text(file.get("file_data")), false, Detail::Auto),
                None => self.not_sized(false, Detail::Auto),
            },
            // The Responses API.
            Some("input_image") => self.url(
                text(part.get("image_url")),
                true,
                detail(part.get("detail")),
            ),
            Some("input_file") => self.url(text(part.get("file_data")), false, Detail::Auto),
            _ => return false,
        }
        true
    }

    /// A data URL read inline; anything else (a remote URL, none: a file id) unsized.
    fn url(&mut self, url: Option<&str>, image: bool, detail: Detail) {
        match url.and_then(media::data_url_payload) {
            Some((_, data)) => self.inline(data, image, detail),
            None => self.not_sized(image, detail),
        }
    }

    fn inline(&mut self, data: &str, image: bool, detail: Detail) {
        self.media_bytes = self.media_bytes.saturating_add(data.len() as u64);
        let item = match media::sniff(data) {
            MediaSize::Image { width, height } => Media::Image {
                width,
                height,
                detail,
            },
            MediaSize::Pdf { pages } => Media::Pdf { pages },
            // Unreadable data is still media: reserved as the most it may cost, which
            // is never less than the bytes would have said.
            MediaSize::Unknown if image => Media::UnsizedImage { detail },
            MediaSize::Unknown => {
                // A document of no known format: its bytes as text, as before.
                self.media_bytes = self.media_bytes.saturating_sub(data.len() as u64);
                return;
            }
        };
        self.media.push(item);
    }

    fn not_sized(&mut self, image: bool, detail: Detail) {
        self.media.push(match image {
            true => Media::UnsizedImage { detail },
            false => Media::UnsizedDocument,
        });
    }
}

impl Media {
    /// What this item costs at `rules`.
    pub fn tokens(&self, rules: MediaRules<'_>) -> u64 {
        let pages = |pages: u32| match rules {
            MediaRules::Anthropic { model } | MediaRules::OpenAi { model } => {
                media::pdf_tokens_for(model, pages)
            }
        };
        match (*self, rules) {
            (Media::Image { width, height, .. }, MediaRules::Anthropic { model }) => {
                media::anthropic_image_tokens_for(model, width, height)
            }
            (
                Media::Image {
                    width,
                    height,
                    detail,
                },
                MediaRules::OpenAi { model },
            ) => media::openai_image_tokens(model, width, height, detail),
            (Media::UnsizedImage { .. }, MediaRules::Anthropic { model }) => {
                media::anthropic_max_image_tokens_for(model)
            }
            (Media::UnsizedImage { detail }, MediaRules::OpenAi { model }) => {
                media::openai_max_image_tokens(model, detail)
            }
            (Media::Pdf { pages: n }, _) => pages(n),
            (Media::UnsizedDocument, _) => pages(media::UNSIZED_DOCUMENT_PAGES),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use serde_json::json;

    /// A PNG's signature and IHDR of `w`×`h`, then `filler` bytes of pixel data.
    fn png(w: u32, h: u32, filler: usize) -> String {
        let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        bytes.extend_from_slice(&w.to_be_bytes());
        bytes.extend_from_slice(&h.to_be_bytes());
        bytes.extend_from_slice(&[8, 6, 0, 0, 0, 0, 0, 0, 0]);
        bytes.resize(bytes.len() + filler, 0x5a);
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn shape(endpoint: Endpoint, body: Value) -> (PromptShape, usize) {
        let text = serde_json::to_vec(&body).unwrap();
        let Value::Object(map) = body else { panic!() };
        (PromptShape::read(endpoint, &text, &map), text.len())
    }

    #[test]
    fn an_image_is_reserved_by_its_size_not_its_bytes() {
        let data = png(1024, 1024, 3_000_000);
        assert!(data.len() > 4_000_000);
        let (s, len) = shape(
            Endpoint::Messages,
            json!({"model": "c", "max_tokens": 10, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                {"type": "text", "text": "what is this?"}]}]}),
        );
        assert_eq!(
            s.media,
            vec![Media::Image {
                width: 1024,
                height: 1024,
                detail: Detail::Auto
            }]
        );
        let tokens = s.input_tokens(
            len,
            MediaRules::Anthropic {
                model: "claude-sonnet-4-5",
            },
        );
        // 1,398 for the image, and the text around it at four bytes a token.
        assert!((1_398..1_398 + 60).contains(&tokens), "{tokens}");
        // The same image in OpenAI's shapes, at OpenAI's rule (765 at high detail on gpt-4o).
        let url = format!("data:image/png;base64,{}", png(1024, 1024, 10));
        let (chat, len) = shape(
            Endpoint::ChatCompletions,
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url, "detail": "high"}}]}]}),
        );
        assert!((765..765 + 40)
            .contains(&chat.input_tokens(len, MediaRules::OpenAi { model: "gpt-4o" })));
        let (responses, _) = shape(
            Endpoint::Responses,
            json!({"model": "gpt-4o", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url, "detail": "low"}]}]}),
        );
        assert_eq!(
            responses.media,
            vec![Media::Image {
                width: 1024,
                height: 1024,
                detail: Detail::Low
            }]
        );
    }

    #[test]
    fn remote_and_unreadable_media_reserve_the_most_they_may_cost() {
        let (s, _) = shape(
            Endpoint::Messages,
            json!({"model": "c", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                {"type": "document", "source": {"type": "file", "file_id": "file_1"}},
                {"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]}]}),
        );
        assert_eq!(
            s.media,
            vec![
                Media::UnsizedImage {
                    detail: Detail::Auto
                },
                Media::UnsizedDocument,
                Media::UnsizedImage {
                    detail: Detail::Auto
                }
            ]
        );
        assert_eq!(
            s.media[0].tokens(MediaRules::Anthropic {
                model: "claude-sonnet-4-5"
            }),
            media::ANTHROPIC_MAX_IMAGE_TOKENS
        );
        assert_eq!(
            s.media[1].tokens(MediaRules::Anthropic {
                model: "claude-sonnet-4-5"
            }),
            media::pdf_tokens(media::UNSIZED_DOCUMENT_PAGES)
        );
    }

    #[test]
    fn cache_marks_and_search_tools_are_found_anywhere() {
        let (s, _) = shape(
            Endpoint::Messages,
            json!({"model": "c", "system": [{"type": "text", "text": "long", "cache_control": {"type": "ephemeral"}}],
                   "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                             {"name": "f", "input_schema": {}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                   "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert_eq!(s.cache, Some(CacheTtl::OneHour));
        assert_eq!(s.web_searches, 3);
        let (plain, len) = shape(
            Endpoint::ChatCompletions,
            json!({"model": "m", "messages": [{"role": "user", "content": "an image of a file"}]}),
        );
        assert_eq!(plain, PromptShape::default());
        assert_eq!(
            plain.input_tokens(
                len,
                MediaRules::Anthropic {
                    model: "claude-sonnet-4-5"
                }
            ),
            crate::policy::budget::estimate_prompt_tokens(len)
        );
        let (top, _) = shape(
            Endpoint::Messages,
            json!({"model": "c", "cache_control": {"type": "ephemeral"}, "messages": []}),
        );
        assert_eq!(top.cache, Some(CacheTtl::FiveMinutes));
    }
}
