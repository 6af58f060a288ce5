//! `backstop prices [MODEL]`: what each model costs per token kind and where each price
//! came from (the built-in catalog and its date, or a `[[prices]]` entry of the
//! config), and the notes `check-config` and the start-up log give about prices: the
//! models a route may call that nothing prices, and the kinds a `[[prices]]` entry
//! leaves out (charged at the input price, never free).

use std::fmt::Write as _;

use crate::{
    billing::{price::Rates, Price, Prices, Source},
    config::{self, Config},
};

/// The models a route may ask of its targets, as `(route, model)`: a target's own
/// model, else the route's name when it is not a glob, else the ids a glob route lists.
pub fn route_models(config: &Config) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for route in &config.routes {
        let is_glob = route.model.contains(['*', '?']);
        for target in route.targets.iter().chain(&route.context_fallback) {
            let models: Vec<&str> = match (&target.model, is_glob) {
                (Some(model), _) => vec![model.as_str()],
                (None, false) => vec![route.model.as_str()],
                (None, true) => route.models.iter().map(String::as_str).collect(),
            };
            for model in models {
                let pair = (route.model.clone(), model.to_string());
                if !out.contains(&pair) {
                    out.push(pair);
                }
            }
        }
    }
    out
}

/// The `(route, model)` pairs whose model nothing prices.
pub fn unpriced(config: &Config) -> Vec<(String, String)> {
    let prices = config::prices(config);
    route_models(config)
        .into_iter()
        .filter(|(_, model)| prices.lookup(model).is_none())
        .collect()
}

/// What `check-config` says about prices, a line each.
pub fn notes(config: &Config) -> Vec<String> {
    let mut notes = Vec::new();
    for (i, entry) in config.prices.iter().enumerate() {
        let price = entry.price(i);
        for kind in &price.defaulted {
            notes.push(format!(
                "prices[{i}] ({}): no {}: charged at {}",
                entry.model,
                kind.key(),
                match kind {
                    crate::billing::price::Kind::CacheWrite1h
                        if entry.cache_write_per_mtok.is_some() =>
                        "cache_write_per_mtok",
                    _ => "input_per_mtok",
                }
            ));
        }
    }
    let unpriced_means = match config.billing.unpriced {
        config::Unpriced::Refuse => "refused (402 unpriced_model) under a USD cap",
        config::Unpriced::Free => "charged $0 (billing.unpriced = \"free\")",
    };
    for (route, model) in unpriced(config) {
        notes.push(format!(
            "route `{route}`: model `{model}` has no price: {unpriced_means}"
        ));
    }
    notes
}

/// The report `backstop prices` prints: one model in full, or (no model) every model
/// the routes may call, a line each, and the catalog's size and date.
pub fn show(config: &Config, model: Option<&str>) -> Result<String, String> {
    let prices = config::prices(config);
    let mut out = String::new();
    match model {
        Some(model) => {
            let price = prices.lookup(model).ok_or_else(|| {
                format!(
                    "`{model}` has no price (no [[prices]] entry matches it, and the catalog {})",
                    catalog_says(&prices)
                )
            })?;
            let _ = writeln!(out, "{model}: {}", origin(config, &prices, model, price));
            let _ = writeln!(out, "  USD per million tokens:");
            rates(&mut out, "  ", &price.base, price);
            for (above, tier) in &price.tiers {
                let _ = writeln!(out, "  above {above} prompt tokens (every input kind):");
                rates(&mut out, "  ", tier, price);
            }
            let _ = writeln!(
                out,
                "  web search: {}",
                match price.web_search_per_thousand {
                    0.0 => "not charged".to_string(),
                    fee => format!("{} USD per thousand", number(fee)),
                }
            );
            if let Some(max) = price.max_output_tokens {
                let _ = writeln!(out, "  max output tokens: {max}");
            }
        }
        None => {
            let _ = writeln!(out, "catalog: {}", catalog_says(&prices));
            for (route, model) in route_models(config) {
                let line = match prices.lookup(&model) {
                    Some(p) => format!(
                        "input {} output {} cache write {} cache read {}: {}",
                        number(p.base.input),
                        number(p.base.output),
                        number(p.base.cache_write),
                        number(p.base.cache_read),
                        origin(config, &prices, &model, p)
                    ),
                    None => "no price".to_string(),
                };
                let _ = writeln!(out, "route `{route}` model `{model}`: {line}");
            }
        }
    }
    Ok(out)
}

fn catalog_says(prices: &Prices) -> String {
    match prices.catalog() {
        Some(c) => format!("of {} models dated {} ({})", c.len(), c.date, c.source),
        None => "is off (billing.catalog = false)".to_string(),
    }
}

/// Where `price` (for `model`) came from.
fn origin(config: &Config, prices: &Prices, model: &str, price: &Price) -> String {
    match price.source {
        Source::Config(i) => format!(
            "config [[prices]] entry {i} (model = \"{}\")",
            config.prices.get(i).map_or("", |p| p.model.as_str())
        ),
        Source::Catalog => match prices.catalog().and_then(|c| Some((c, c.entry(model)?))) {
            Some((c, (id, provider, _))) => {
                format!(
                    "catalog of {} as `{id}` ({provider}), from {}",
                    c.date, c.source
                )
            }
            None => "catalog".to_string(),
        },
    }
}

fn rates(out: &mut String, indent: &str, r: &Rates, price: &Price) {
    use crate::billing::price::Kind;
    let said = |kind: Kind| {
        if price.defaulted.contains(&kind) {
            " (no price of its own)"
        } else {
            ""
        }
    };
    let rows = [
        ("input", r.input, ""),
        ("cache write (5 min)", r.cache_write, said(Kind::CacheWrite)),
        (
            "cache write (1 hour)",
            r.cache_write_1h,
            said(Kind::CacheWrite1h),
        ),
        ("cache read", r.cache_read, said(Kind::CacheRead)),
        ("output", r.output, ""),
    ];
    for (name, rate, note) in rows {
        let _ = writeln!(out, "{indent}  {name:<21}{}{note}", number(rate));
    }
}

/// A price as its sheet writes it: no float noise.
fn number(v: f64) -> String {
    let text = format!("{:.6}", v);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        Config::from_toml_with_env(
            &format!(
                "{extra}\n[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"claude-sonnet-4-5\"\ntargets = [{{ upstream = \"u\" }}, {{ upstream = \"u\", model = \"my-own-model\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]"
            ),
            |_| None,
        )
        .unwrap()
    }

    #[test]
    fn a_model_is_shown_kind_by_kind_with_its_source() {
        let c = config("");
        let text = show(&c, Some("claude-sonnet-4-5-20250929")).unwrap();
        assert!(text.contains("catalog of "), "{text}");
        assert!(
            text.contains("as `claude-sonnet-4-5-20250929` (anthropic)"),
            "{text}"
        );
        for line in [
            "input                3\n",
            "cache write (5 min)  3.75\n",
            "cache write (1 hour) 6\n",
            "cache read           0.3\n",
            "output               15\n",
            "web search: 10 USD per thousand",
        ] {
            assert!(text.contains(line), "{line:?} in {text}");
        }
        let mine =
            config("[[prices]]\nmodel = \"claude-*\"\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0");
        let text = show(&mine, Some("claude-sonnet-4-5")).unwrap();
        assert!(
            text.contains("config [[prices]] entry 0 (model = \"claude-*\")"),
            "{text}"
        );
        assert!(
            text.contains("cache read           1 (no price of its own)"),
            "{text}"
        );
        assert!(show(&c, Some("nothing-prices-this"))
            .unwrap_err()
            .contains("no price"));
    }

    #[test]
    fn notes_name_unpriced_route_models_and_kinds_left_out() {
        let c = config("[[prices]]\nmodel = \"gpt-4o\"\ninput_per_mtok = 2.5\noutput_per_mtok = 10.0\ncache_write_per_mtok = 3.0");
        let notes = notes(&c);
        assert_eq!(
            notes,
            vec![
                "prices[0] (gpt-4o): no cache_write_1h_per_mtok: charged at cache_write_per_mtok".to_string(),
                "prices[0] (gpt-4o): no cache_read_per_mtok: charged at input_per_mtok".to_string(),
                "route `claude-sonnet-4-5`: model `my-own-model` has no price: refused (402 unpriced_model) under a USD cap".to_string(),
            ]
        );
        let all = show(&c, None).unwrap();
        assert!(all.contains("route `claude-sonnet-4-5` model `claude-sonnet-4-5`: input 3 output 15 cache write 3.75 cache read 0.3: catalog"), "{all}");
        assert!(all.contains("model `my-own-model`: no price"), "{all}");
    }
}
