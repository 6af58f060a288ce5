//! Budget arithmetic: usage, limits, and reservations that make concurrent calls unable
//! to overshoot a cap. A call reserves its worst case before it is made and settles to
//! what the upstream reported after; a check counts what is settled *and* reserved.

/// What calls consumed (or may consume).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub calls: u64,
    pub tokens: u64,
    pub usd: f64,
}

impl Usage {
    /// Saturating: counts built from untrusted numbers (a client's `max_tokens`, an
    /// upstream's usage) stop at the maximum instead of wrapping round to small values
    /// that would pass a cap.
    pub fn add(&mut self, other: Usage) {
        self.calls = self.calls.saturating_add(other.calls);
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.usd = sane_usd(self.usd + sane_usd(other.usd));
    }

    /// `self + other`, saturating.
    pub fn plus(mut self, other: Usage) -> Usage {
        self.add(other);
        self
    }

    pub fn sub(&mut self, other: Usage) {
        self.calls = self.calls.saturating_sub(other.calls);
        self.tokens = self.tokens.saturating_sub(other.tokens);
        self.usd = sane_usd(self.usd - sane_usd(other.usd));
    }
}

/// The most tokens one call may reserve: 2^48, far above any model's context and
/// output, and small enough that the reservations of 65,536 concurrent calls still sum
/// without saturating (so releasing one gives back exactly what it took).
pub const MAX_CALL_TOKENS: u64 = 1 << 48;

/// One call's worst case: the prompt plus the most it may generate, saturating, and at
/// most [`MAX_CALL_TOKENS`].
pub fn worst_case(prompt_tokens: u64, max_output: u64, usd: f64) -> Usage {
    Usage {
        calls: 1,
        tokens: prompt_tokens
            .saturating_add(max_output)
            .min(MAX_CALL_TOKENS),
        usd: sane_usd(usd),
    }
}

/// USD amounts stay finite and non-negative: NaN counts as 0, infinity as the largest
/// float (still over every cap).
pub fn sane_usd(usd: f64) -> f64 {
    if usd.is_nan() {
        0.0
    } else {
        usd.clamp(0.0, f64::MAX)
    }
}

/// A dollar figure as the JSON views show it: rounded to micro-dollars, so a spend of
/// 0.1 + 0.2 reads 0.3 and not 0.30000000000000004. The arithmetic keeps full floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usd(pub f64);

impl Usd {
    pub fn rounded(self) -> f64 {
        (self.0 * 1e6).round() / 1e6
    }
}

impl serde::Serialize for Usd {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.rounded())
    }
}

/// Caps on a scope (a session, or a tenant's day); `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Caps {
    pub calls: Option<u64>,
    pub tokens: Option<u64>,
    pub usd: Option<f64>,
}

impl Caps {
    pub fn is_unlimited(&self) -> bool {
        self.calls.is_none() && self.tokens.is_none() && self.usd.is_none()
    }
}

/// A budget that refused, named as configured (`session.max_calls`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Exceeded {
    pub budget: &'static str,
    pub limit: f64,
    /// Settled plus reserved when the call was refused.
    pub used: f64,
    /// What this call would have added.
    pub requested: f64,
}

/// Names of a scope's three caps, for refusals.
#[derive(Debug, Clone, Copy)]
pub struct CapNames {
    pub calls: &'static str,
    pub tokens: &'static str,
    pub usd: &'static str,
}

pub const SESSION: CapNames = CapNames {
    calls: "session.max_calls",
    tokens: "session.max_tokens",
    usd: "session.max_usd",
};
pub const TENANT_DAY: CapNames = CapNames {
    calls: "tenant.calls_per_day",
    tokens: "tenant.tokens_per_day",
    usd: "tenant.usd_per_day",
};

/// One scope's account: what is settled, and what in-flight calls have reserved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Account {
    pub settled: Usage,
    pub reserved: Usage,
}

impl Account {
    pub fn committed(&self) -> Usage {
        let mut u = self.settled;
        u.add(self.reserved);
        u
    }

    /// Would `want` fit under `limits`? Checks every cap, calls first.
    pub fn check(&self, want: Usage, limits: &Caps, names: CapNames) -> Result<(), Exceeded> {
        let used = self.committed();
        let after = used.plus(want);
        if let Some(limit) = limits.calls {
            if after.calls > limit {
                return Err(Exceeded {
                    budget: names.calls,
                    limit: limit as f64,
                    used: used.calls as f64,
                    requested: want.calls as f64,
                });
            }
        }
        if let Some(limit) = limits.tokens {
            if after.tokens > limit {
                return Err(Exceeded {
                    budget: names.tokens,
                    limit: limit as f64,
                    used: used.tokens as f64,
                    requested: want.tokens as f64,
                });
            }
        }
        if let Some(limit) = limits.usd {
            // A tolerance keeps float rounding from refusing a call that fits exactly.
            if after.usd > limit + 1e-9 {
                return Err(Exceeded {
                    budget: names.usd,
                    limit,
                    used: used.usd,
                    requested: want.usd,
                });
            }
        }
        Ok(())
    }

    pub fn reserve(&mut self, want: Usage) {
        self.reserved.add(want);
    }

    /// Replaces a reservation by what the call actually used.
    pub fn settle(&mut self, reserved: Usage, actual: Usage) {
        self.reserved.sub(reserved);
        self.settled.add(actual);
    }

    /// What is left under `limits` (unlimited caps are `None`).
    pub fn remaining(&self, limits: &Caps) -> (Option<u64>, Option<u64>, Option<f64>) {
        let used = self.committed();
        (
            limits.calls.map(|l| l.saturating_sub(used.calls)),
            limits.tokens.map(|l| l.saturating_sub(used.tokens)),
            limits.usd.map(|l| (l - used.usd).max(0.0)),
        )
    }
}

/// Prompt tokens estimated from the request body: about four bytes a token, rounded up.
/// An over-estimate for JSON (keys and punctuation count too), which is the safe side
/// for a reservation.
pub fn estimate_prompt_tokens(body_len: usize) -> u64 {
    (body_len as u64).div_ceil(4).max(1)
}

/// A session as the settle of its last call left it in the shared state (one round
/// trip): what it has spent and holds reserved, and the version its guard's shared
/// state is at. The request that settled needs no other read to learn what the session
/// has left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SessionSeen {
    pub settled: Usage,
    pub reserved: Usage,
    pub guard_version: u64,
    /// The guard's shared state is quiet (active, no failures in a row): a success
    /// changes nothing in it.
    pub guard_quiet: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reservations_count_against_the_cap_until_settled() {
        let limits = Caps {
            calls: Some(2),
            tokens: None,
            usd: Some(1.0),
        };
        let mut a = Account::default();
        let call = Usage {
            calls: 1,
            tokens: 100,
            usd: 0.4,
        };
        a.check(call, &limits, SESSION).unwrap();
        a.reserve(call);
        a.check(call, &limits, SESSION).unwrap();
        a.reserve(call);
        let refused = a.check(call, &limits, SESSION).unwrap_err();
        assert_eq!(refused.budget, "session.max_calls");
        assert_eq!((refused.limit, refused.used), (2.0, 2.0));
        // The upstream reported less than reserved: the difference is released.
        a.settle(
            call,
            Usage {
                calls: 1,
                tokens: 10,
                usd: 0.1,
            },
        );
        assert_eq!(
            a.committed(),
            Usage {
                calls: 2,
                tokens: 110,
                usd: 0.5
            }
        );
        assert_eq!(a.remaining(&limits), (Some(0), None, Some(0.5)));
    }

    #[test]
    fn usd_caps_name_themselves() {
        let limits = Caps {
            calls: None,
            tokens: Some(1000),
            usd: Some(0.5),
        };
        let a = Account {
            settled: Usage {
                calls: 3,
                tokens: 10,
                usd: 0.45,
            },
            reserved: Usage::default(),
        };
        let e = a
            .check(
                Usage {
                    calls: 1,
                    tokens: 10,
                    usd: 0.1,
                },
                &limits,
                TENANT_DAY,
            )
            .unwrap_err();
        assert_eq!(e.budget, "tenant.usd_per_day");
        assert!(a
            .check(
                Usage {
                    calls: 1,
                    tokens: 10,
                    usd: 0.05
                },
                &limits,
                TENANT_DAY
            )
            .is_ok());
    }

    #[test]
    fn huge_requests_saturate_and_are_refused_by_a_token_cap() {
        let limits = Caps {
            calls: None,
            tokens: Some(1000),
            usd: None,
        };
        let mut a = Account::default();
        a.reserve(Usage {
            calls: 1,
            tokens: 10,
            usd: 0.0,
        });
        // max_tokens = 2^64 - 1 plus the prompt: wrapped, this was 9 and fitted.
        let want = worst_case(10, u64::MAX, f64::INFINITY);
        assert_eq!(want.tokens, MAX_CALL_TOKENS);
        let e = a.check(want, &limits, SESSION).unwrap_err();
        assert_eq!(e.budget, "session.max_tokens");
        // Without a token cap it may be reserved, and released exactly.
        a.reserve(want);
        assert!(a.committed().usd.is_finite());
        a.settle(want, Usage::default());
        assert_eq!(a.reserved.tokens, 10);
        assert_eq!(a.remaining(&limits).1, Some(990));
        // Sums saturate rather than wrap.
        let mut u = Usage {
            calls: u64::MAX,
            tokens: u64::MAX,
            usd: f64::MAX,
        };
        u.add(want);
        assert_eq!((u.calls, u.tokens), (u64::MAX, u64::MAX));
        assert_eq!(u.usd, f64::MAX);
    }

    proptest! {
        /// However calls interleave, settled + reserved never exceeds a cap, and once
        /// every reservation is settled nothing stays reserved.
        #[test]
        fn no_interleaving_overshoots(ops in proptest::collection::vec((0u64..3, 0u64..500, any::<bool>()), 1..200)) {
            let limits = Caps { calls: Some(20), tokens: Some(3000), usd: None };
            let mut a = Account::default();
            let mut open: Vec<Usage> = Vec::new();
            for (calls, tokens, settle_one) in ops {
                if settle_one && !open.is_empty() {
                    let r = open.remove(0);
                    a.settle(r, Usage { calls: r.calls, tokens: r.tokens / 2, usd: 0.0 });
                } else {
                    let want = Usage { calls, tokens, usd: 0.0 };
                    if a.check(want, &limits, SESSION).is_ok() {
                        a.reserve(want);
                        open.push(want);
                    }
                }
                let c = a.committed();
                prop_assert!(c.calls <= 20 && c.tokens <= 3000);
            }
            for r in open.drain(..) {
                a.settle(r, r);
            }
            prop_assert_eq!(a.reserved, Usage::default());
        }
    }
}
