//! The built-in price catalog (`catalog.json`, beside this file): the published prices
//! of the current models of OpenAI, Anthropic and Azure OpenAI, with the Bedrock and
//! Vertex AI ids of the same models, dated and versioned. It is generated from a
//! well-kept public price table by `scripts/refresh-prices`; `[[prices]]` entries in
//! the config come before it, entry by entry.
//!
//! A model is looked up by the id the upstream is asked for: as given, then without a
//! provider prefix (`azure/`), a Bedrock cross-region prefix (`us.`), or a date suffix
//! (`-20250929`, `-2024-08-06`, `@20250929`), so a new dated snapshot of a listed model
//! is priced as its undated alias.

use std::{collections::HashMap, sync::LazyLock};

use serde::Deserialize;

use super::price::{Price, RateSpec, Source, TierSpec};

/// The catalog's text, compiled in.
const TEXT: &str = include_str!("catalog.json");

/// The format version of `catalog.json` this binary reads.
pub const VERSION: u32 = 1;

/// The catalog, read once.
pub fn builtin() -> &'static Catalog {
    static CATALOG: LazyLock<Catalog> =
        LazyLock::new(|| Catalog::parse(TEXT).expect("the built-in catalog parses"));
    &CATALOG
}

/// Prices by model id, with the date and source they were taken from.
#[derive(Debug)]
pub struct Catalog {
    pub date: String,
    pub source: String,
    models: HashMap<String, (String, Price)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    date: String,
    source: String,
    models: HashMap<String, Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    provider: String,
    input: f64,
    #[serde(default)]
    output: Option<f64>,
    #[serde(default)]
    cache_write: Option<f64>,
    #[serde(default)]
    cache_write_1h: Option<f64>,
    #[serde(default)]
    cache_read: Option<f64>,
    #[serde(default)]
    web_search_per_thousand: Option<f64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    tiers: Vec<Tier>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tier {
    above_tokens: u64,
    #[serde(default)]
    input: Option<f64>,
    #[serde(default)]
    output: Option<f64>,
    #[serde(default)]
    cache_write: Option<f64>,
    #[serde(default)]
    cache_write_1h: Option<f64>,
    #[serde(default)]
    cache_read: Option<f64>,
}

impl Catalog {
    /// Reads a catalog file; an unknown version or a malformed entry is an error.
    pub fn parse(text: &str) -> Result<Catalog, String> {
        let file: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if file.version != VERSION {
            return Err(format!(
                "catalog version {} (this binary reads {VERSION})",
                file.version
            ));
        }
        let models = file
            .models
            .into_iter()
            .map(|(id, e)| {
                let tiers: Vec<TierSpec> = e
                    .tiers
                    .iter()
                    .map(|t| TierSpec {
                        above_tokens: t.above_tokens,
                        rates: RateSpec {
                            input: t.input,
                            output: t.output,
                            cache_write: t.cache_write,
                            cache_write_1h: t.cache_write_1h,
                            cache_read: t.cache_read,
                        },
                    })
                    .collect();
                let price = Price::new(
                    RateSpec {
                        input: Some(e.input),
                        output: Some(e.output.unwrap_or(0.0)),
                        cache_write: e.cache_write,
                        cache_write_1h: e.cache_write_1h,
                        cache_read: e.cache_read,
                    },
                    &tiers,
                    e.web_search_per_thousand,
                    e.max_output_tokens,
                    Source::Catalog,
                );
                (id, (e.provider, price))
            })
            .collect();
        Ok(Catalog {
            date: file.date,
            source: file.source,
            models,
        })
    }

    /// How many models it prices.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// `model`'s price (see the module docs for how ids are matched).
    pub fn lookup(&self, model: &str) -> Option<&Price> {
        self.entry(model).map(|(_, _, price)| price)
    }

    /// The catalog id that priced `model`, its provider and its price.
    pub fn entry(&self, model: &str) -> Option<(&str, &str, &Price)> {
        let listed = |id: &str| {
            self.models
                .get_key_value(id)
                .map(|(id, (provider, price))| (id.as_str(), provider.as_str(), price))
        };
        listed(model).or_else(|| candidates(model).into_iter().find_map(|id| listed(&id)))
    }
}

/// The other ids `model` may be listed under, in the order they are tried: without its
/// provider prefix, its Bedrock region, its date, its Bedrock version; then lowercase.
fn candidates(model: &str) -> Vec<String> {
    let bare = strip_provider(model);
    let regionless = strip_region(bare);
    let mut ids: Vec<String> = Vec::new();
    for id in [
        bare,
        regionless,
        strip_date(bare),
        strip_date(regionless),
        strip_date(strip_bedrock_version(regionless)),
    ] {
        if id != model && !id.is_empty() && !ids.iter().any(|seen| seen == id) {
            ids.push(id.to_string());
        }
    }
    let lower = model.to_ascii_lowercase();
    if lower != model {
        ids.push(lower);
    }
    ids
}

/// `azure/gpt-4o` → `gpt-4o`.
fn strip_provider(model: &str) -> &str {
    const PREFIXES: [&str; 7] = [
        "openai/",
        "anthropic/",
        "azure/",
        "bedrock/",
        "vertex_ai/",
        "vertex/",
        "gemini/",
    ];
    PREFIXES
        .iter()
        .find_map(|p| model.strip_prefix(p))
        .unwrap_or(model)
}

/// A Bedrock cross-region inference profile (`us.anthropic.claude-...`) → the model id.
fn strip_region(model: &str) -> &str {
    const REGIONS: [&str; 8] = [
        "us.", "eu.", "apac.", "global.", "us-gov.", "jp.", "au.", "ca.",
    ];
    REGIONS
        .iter()
        .find_map(|p| model.strip_prefix(p))
        .unwrap_or(model)
}

/// A Bedrock model id's version (`...-v1:0`, `...-v2`) taken off.
fn strip_bedrock_version(model: &str) -> &str {
    let Some(at) = model.rfind("-v") else {
        return model;
    };
    let tail = &model[at + 2..];
    let (major, minor) = tail.split_once(':').unwrap_or((tail, "0"));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if digits(major) && digits(minor) {
        &model[..at]
    } else {
        model
    }
}

/// A date suffix taken off: `-20250929`, `@20250929`, `-2024-08-06`.
fn strip_date(model: &str) -> &str {
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let n = model.len();
    if n > 9 {
        let (head, tail) = model.split_at(n - 9);
        if (tail.starts_with('-') || tail.starts_with('@')) && digits(&tail[1..]) {
            return head;
        }
    }
    if n > 11 {
        let (head, tail) = model.split_at(n - 11);
        let b = tail.as_bytes();
        if b[0] == b'-'
            && b[5] == b'-'
            && b[8] == b'-'
            && digits(&tail[1..5])
            && digits(&tail[6..8])
            && digits(&tail[9..])
        {
            return head;
        }
    }
    model
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_catalog_parses_and_is_dated() {
        let c = builtin();
        assert!(c.len() > 100, "{} models", c.len());
        assert_eq!(c.date.len(), 10, "a date: {}", c.date);
        assert!(c.source.contains("litellm"), "{}", c.source);
    }

    #[test]
    fn published_prices_are_what_the_sheets_say() {
        let c = builtin();
        let sonnet = c.lookup("claude-sonnet-4-5").unwrap();
        assert_eq!(
            (
                sonnet.base.input,
                sonnet.base.cache_write,
                sonnet.base.cache_write_1h,
                sonnet.base.cache_read,
                sonnet.base.output
            ),
            (3.0, 3.75, 6.0, 0.3, 15.0)
        );
        let gpt = c.lookup("gpt-4o").unwrap();
        assert_eq!(
            (gpt.base.input, gpt.base.cache_read, gpt.base.output),
            (2.5, 1.25, 10.0)
        );
        let mini = c.lookup("gpt-4o-mini").unwrap();
        assert_eq!((mini.base.input, mini.base.output), (0.15, 0.6));
    }

    #[test]
    fn ids_are_matched_with_dates_prefixes_and_regions() {
        let c = builtin();
        for id in [
            "claude-sonnet-4-5-20250929",
            "claude-sonnet-4-5-20991231",
            "anthropic/claude-sonnet-4-5",
            "anthropic.claude-sonnet-4-5-20250929-v1:0",
            "us.anthropic.claude-sonnet-4-5-20250929-v1:0",
            "claude-sonnet-4-5@20250929",
            "azure/gpt-4o",
            "gpt-4o-2099-01-01",
        ] {
            assert!(c.lookup(id).is_some(), "{id} is not priced");
        }
        assert!(c.lookup("my-own-finetune").is_none());
        assert_eq!(
            strip_date("claude-sonnet-4-5-20250929"),
            "claude-sonnet-4-5"
        );
        assert_eq!(strip_date("gpt-4o-2024-08-06"), "gpt-4o");
        assert_eq!(strip_date("x@20250929"), "x");
        assert_eq!(strip_date("gpt-4o"), "gpt-4o");
        assert_eq!(
            strip_bedrock_version("anthropic.claude-x-v1:0"),
            "anthropic.claude-x"
        );
        assert_eq!(strip_bedrock_version("model-very"), "model-very");
    }

    #[test]
    fn a_catalog_of_another_version_is_refused() {
        let err = Catalog::parse(r#"{"version": 9, "date": "d", "source": "s", "models": {}}"#)
            .unwrap_err();
        assert!(err.contains("version 9"), "{err}");
        let unknown = Catalog::parse(
            r#"{"version": 1, "date": "d", "source": "s", "models": {"m": {"provider": "p", "input": 1, "bogus": 2}}}"#,
        );
        assert!(unknown.is_err());
    }
}
