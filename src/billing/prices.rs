//! Every price a gateway knows, looked up by model: the config's `[[prices]]` over the
//! built-in catalog.

use wildmatch::WildMatch;

use super::{
    catalog::{self, Catalog},
    price::Price,
    Tokens,
};

/// Every price a gateway knows: the config's `[[prices]]` first (exact names or globs,
/// the first match wins), then the built-in catalog (unless `billing.catalog = false`).
#[derive(Debug, Default)]
pub struct Prices {
    config: Vec<(WildMatch, Price)>,
    catalog: Option<&'static Catalog>,
}

impl Prices {
    /// From the config's entries, as `(model glob, price)` in match order, over the
    /// built-in catalog when `catalog` is set.
    pub fn new(config: impl IntoIterator<Item = (String, Price)>, catalog: bool) -> Self {
        Prices {
            config: config
                .into_iter()
                .map(|(glob, price)| (WildMatch::new(&glob), price))
                .collect(),
            catalog: catalog.then(catalog::builtin),
        }
    }

    /// `model`'s price, or `None` when nothing prices it.
    pub fn lookup(&self, model: &str) -> Option<&Price> {
        self.config
            .iter()
            .find(|(glob, _)| glob.matches(model))
            .map(|(_, price)| price)
            .or_else(|| self.catalog.and_then(|c| c.lookup(model)))
    }

    /// What `tokens` of `model` cost, or `None` when the model has no price.
    pub fn cost(&self, model: &str, tokens: &Tokens) -> Option<f64> {
        self.lookup(model).map(|p| p.cost(tokens))
    }

    /// The catalog in use, if any.
    pub fn catalog(&self) -> Option<&'static Catalog> {
        self.catalog
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::billing::price::{tests::spec, Source};

    #[test]
    fn config_entries_come_before_the_catalog_and_match_by_glob() {
        let prices = Prices::new(
            [(
                "claude-sonnet-4-5*".to_string(),
                Price::new(spec(1.0, 2.0), &[], None, None, Source::Config(0)),
            )],
            true,
        );
        let mine = prices.lookup("claude-sonnet-4-5-20250929").unwrap();
        assert_eq!(mine.source, Source::Config(0));
        assert_eq!(mine.base.input, 1.0);
        let listed = prices.lookup("gpt-4o").unwrap();
        assert_eq!(listed.source, Source::Catalog);
        assert_eq!((listed.base.input, listed.base.output), (2.5, 10.0));
        assert!(prices.lookup("no-such-model-anywhere").is_none());
        let without = Prices::new(Vec::new(), false);
        assert!(without.lookup("gpt-4o").is_none());
    }
}
