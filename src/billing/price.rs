//! Prices with the dimensions providers bill: a rate per token kind, long-context tiers
//! (other rates once the prompt passes a size), and a fee per server-side web search.
//! A kind its source gives no price of its own is charged at the input price, never
//! free; a one-hour cache write never below a five-minute one. Pure arithmetic: the
//! catalog and the config only build these.

use super::{CacheTtl, Tokens};

/// One kind's rate as a source gives it: USD per million tokens, or nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RateSpec {
    pub input: Option<f64>,
    pub output: Option<f64>,
    pub cache_write: Option<f64>,
    pub cache_write_1h: Option<f64>,
    pub cache_read: Option<f64>,
}

/// The rates of one tier, every kind resolved: USD per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub input: f64,
    pub output: f64,
    pub cache_write: f64,
    pub cache_write_1h: f64,
    pub cache_read: f64,
}

/// A token kind a price can leave out, for saying which ones were (`backstop prices`,
/// `check-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    CacheWrite,
    CacheWrite1h,
    CacheRead,
}

impl Kind {
    pub fn key(self) -> &'static str {
        match self {
            Kind::CacheWrite => "cache_write_per_mtok",
            Kind::CacheWrite1h => "cache_write_1h_per_mtok",
            Kind::CacheRead => "cache_read_per_mtok",
        }
    }
}

impl Rates {
    /// The base rates from a source's: each kind it leaves out at the input price (a
    /// one-hour write at the five-minute write's when that one is given).
    fn base(spec: RateSpec) -> (Rates, Vec<Kind>) {
        let input = spec.input.unwrap_or(0.0);
        let mut defaulted = Vec::new();
        let mut or_input = |rate: Option<f64>, fallback: f64, kind: Kind| {
            rate.unwrap_or_else(|| {
                defaulted.push(kind);
                fallback
            })
        };
        let cache_write = or_input(spec.cache_write, input, Kind::CacheWrite);
        let cache_write_1h = or_input(
            spec.cache_write_1h,
            cache_write.max(input),
            Kind::CacheWrite1h,
        );
        let cache_read = or_input(spec.cache_read, input, Kind::CacheRead);
        let rates = Rates {
            input,
            output: spec.output.unwrap_or(0.0),
            cache_write,
            cache_write_1h,
            cache_read,
        };
        (rates, defaulted)
    }

    /// A tier's rates: the kinds it names changed, the rest as `base`.
    fn above(base: Rates, spec: RateSpec) -> Rates {
        Rates {
            input: spec.input.unwrap_or(base.input),
            output: spec.output.unwrap_or(base.output),
            cache_write: spec.cache_write.unwrap_or(base.cache_write),
            cache_write_1h: spec.cache_write_1h.unwrap_or(base.cache_write_1h),
            cache_read: spec.cache_read.unwrap_or(base.cache_read),
        }
    }

    /// The rate a prompt token is reserved at: the input price, or the cache write's
    /// when the request asks for caching (whichever is higher).
    fn prompt_worst(&self, cache: Option<CacheTtl>) -> f64 {
        match cache {
            None => self.input,
            Some(CacheTtl::FiveMinutes) => self.input.max(self.cache_write),
            Some(CacheTtl::OneHour) => self.input.max(self.cache_write_1h),
        }
    }
}

/// Where a price came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The built-in catalog (dated: [`Catalog::date`]).
    Catalog,
    /// `[[prices]]` entry `n` (0-based) of the config.
    Config(usize),
}

/// One model's price.
#[derive(Debug, Clone, PartialEq)]
pub struct Price {
    pub base: Rates,
    /// Other rates once the prompt (every input kind) passes `above_tokens`, ascending.
    pub tiers: Vec<(u64, Rates)>,
    /// USD per thousand server-side web searches (0: not charged).
    pub web_search_per_thousand: f64,
    /// The most the model may write in one answer, where the source says.
    pub max_output_tokens: Option<u64>,
    /// The kinds the source gave no price of their own (charged as [`Rates::base`] says).
    pub defaulted: Vec<Kind>,
    pub source: Source,
}

/// A tier as a source gives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierSpec {
    pub above_tokens: u64,
    pub rates: RateSpec,
}

impl Price {
    pub fn new(
        base: RateSpec,
        tiers: &[TierSpec],
        web_search_per_thousand: Option<f64>,
        max_output_tokens: Option<u64>,
        source: Source,
    ) -> Price {
        let (rates, defaulted) = Rates::base(base);
        let mut tiers: Vec<(u64, Rates)> = tiers
            .iter()
            .map(|t| (t.above_tokens, Rates::above(rates, t.rates)))
            .collect();
        tiers.sort_by_key(|(above, _)| *above);
        Price {
            base: rates,
            tiers,
            web_search_per_thousand: web_search_per_thousand.unwrap_or(0.0),
            max_output_tokens,
            defaulted,
            source,
        }
    }

    /// The rates for a call whose prompt is `prompt` tokens: the highest tier it passes.
    pub fn rates_for(&self, prompt: u64) -> &Rates {
        self.tiers
            .iter()
            .rev()
            .find(|(above, _)| prompt > *above)
            .map_or(&self.base, |(_, rates)| rates)
    }

    /// What `tokens` cost, in USD. Always finite and non-negative.
    pub fn cost(&self, tokens: &Tokens) -> f64 {
        let r = self.rates_for(tokens.prompt());
        let per_million = tokens.input as f64 * r.input
            + tokens.cache_write_5m as f64 * r.cache_write
            + tokens.cache_write_1h as f64 * r.cache_write_1h
            + tokens.cache_read as f64 * r.cache_read
            + tokens.output as f64 * r.output;
        sane(per_million / 1e6 + self.search_fee(tokens.web_searches))
    }

    /// The most a call may cost: `prompt` tokens at the dearest rate they may be billed
    /// at (a cache write when the request asks for caching), `output` tokens, and
    /// `searches` web searches.
    pub fn worst_case(
        &self,
        prompt: u64,
        output: u64,
        cache: Option<CacheTtl>,
        searches: u64,
    ) -> f64 {
        let r = self.rates_for(prompt);
        let per_million = prompt as f64 * r.prompt_worst(cache) + output as f64 * r.output;
        sane(per_million / 1e6 + self.search_fee(searches))
    }

    fn search_fee(&self, searches: u64) -> f64 {
        searches as f64 * self.web_search_per_thousand / 1e3
    }
}

/// USD amounts stay finite and non-negative (NaN is 0, infinity the largest float).
fn sane(usd: f64) -> f64 {
    if usd.is_nan() {
        0.0
    } else {
        usd.clamp(0.0, f64::MAX)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::billing) fn spec(input: f64, output: f64) -> RateSpec {
        RateSpec {
            input: Some(input),
            output: Some(output),
            ..RateSpec::default()
        }
    }

    /// Claude Sonnet 4.5 as Anthropic's price sheet has it (USD per million tokens):
    /// input 3, 5-minute cache write 3.75, 1-hour write 6, cache read 0.30, output 15;
    /// above 200k prompt tokens (1M context): 6 / 7.5 / 12 / 0.6 / 22.5; web search $10
    /// per thousand.
    fn sonnet() -> Price {
        Price::new(
            RateSpec {
                cache_write: Some(3.75),
                cache_write_1h: Some(6.0),
                cache_read: Some(0.3),
                ..spec(3.0, 15.0)
            },
            &[TierSpec {
                above_tokens: 200_000,
                rates: RateSpec {
                    cache_write: Some(7.5),
                    cache_write_1h: Some(12.0),
                    cache_read: Some(0.6),
                    ..spec(6.0, 22.5)
                },
            }],
            Some(10.0),
            Some(64_000),
            Source::Catalog,
        )
    }

    fn micro(usd: f64) -> i64 {
        (usd * 1e6).round() as i64
    }

    #[test]
    fn every_kind_is_priced_on_its_own_line() {
        // The turn: input 100, cache write 20,000, cache read 80,000, output 500.
        // 100 × 3 + 20,000 × 3.75 + 80,000 × 0.3 + 500 × 15 = 106,800 per million.
        let turn = Tokens {
            input: 100,
            cache_write_5m: 20_000,
            cache_read: 80_000,
            output: 500,
            ..Tokens::default()
        };
        assert_eq!(micro(sonnet().cost(&turn)), 106_800);
        // The same written for an hour: 20,000 × 6 instead of × 3.75.
        let hour = Tokens {
            cache_write_5m: 0,
            cache_write_1h: 20_000,
            ..turn
        };
        assert_eq!(micro(sonnet().cost(&hour)), 151_800);
        // Two web searches: $0.02 on top.
        let searched = Tokens {
            web_searches: 2,
            ..turn
        };
        assert_eq!(micro(sonnet().cost(&searched)), 126_800);
    }

    #[test]
    fn a_long_prompt_is_priced_at_its_tier_every_kind_included() {
        // 150k read from the cache + 60k plain input: the prompt is 210k, over 200k.
        let long = Tokens {
            input: 60_000,
            cache_read: 150_000,
            output: 1_000,
            ..Tokens::default()
        };
        // 60,000 × 6 + 150,000 × 0.6 + 1,000 × 22.5 = 472,500 per million.
        assert_eq!(micro(sonnet().cost(&long)), 472_500);
        let at_the_line = Tokens {
            input: 200_000,
            ..Tokens::default()
        };
        assert_eq!(micro(sonnet().cost(&at_the_line)), 600_000, "not above");
    }

    #[test]
    fn a_kind_without_a_price_is_charged_at_the_input_price() {
        let plain = Price::new(spec(2.5, 10.0), &[], None, None, Source::Config(0));
        assert_eq!(
            plain.defaulted,
            vec![Kind::CacheWrite, Kind::CacheWrite1h, Kind::CacheRead]
        );
        let cached = Tokens {
            input: 2_000,
            cache_read: 8_000,
            output: 100,
            ..Tokens::default()
        };
        // Never free: 10,000 × 2.5 + 100 × 10.
        assert_eq!(micro(plain.cost(&cached)), 26_000);
        // A one-hour write falls back to the five-minute write's price when only that is given.
        let five = Price::new(
            RateSpec {
                cache_write: Some(3.75),
                ..spec(3.0, 15.0)
            },
            &[],
            None,
            None,
            Source::Config(0),
        );
        assert_eq!(five.base.cache_write_1h, 3.75);
        assert_eq!(five.base.cache_read, 3.0);
    }

    #[test]
    fn the_worst_case_prices_a_cached_prompt_as_a_write() {
        let p = sonnet();
        // 115k prompt tokens and 4,096 out: as input 0.345 + 0.06144.
        assert_eq!(micro(p.worst_case(115_000, 4_096, None, 0)), 406_440);
        // Marked for caching: written at 3.75; for an hour at 6.
        assert_eq!(
            micro(p.worst_case(115_000, 4_096, Some(CacheTtl::FiveMinutes), 0)),
            492_690
        );
        assert_eq!(
            micro(p.worst_case(115_000, 4_096, Some(CacheTtl::OneHour), 0)),
            751_440
        );
        // Past the tier: its rates.
        assert_eq!(micro(p.worst_case(300_000, 0, None, 3)), 1_830_000);
    }
}
