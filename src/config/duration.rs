//! Durations as humantime text (`"250ms"`, `"30s"`), for `#[serde(with = ...)]` on a
//! `Duration` or an `Option<Duration>`. A value that does not parse is refused with
//! the kind expected and nothing of the value: humantime's own message quotes part of
//! it (`unknown time unit "kQv..."`), and that part may have come from `${ENV}`.

use humantime_serde::Serde;
use serde::{de::Error, Deserialize, Deserializer};

pub(super) const EXPECTED: &str = "expected a duration such as \"250ms\", \"30s\" or \"1h\"";

pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    Serde<T>: Deserialize<'de>,
{
    Serde::<T>::deserialize(d)
        .map(Serde::into_inner)
        .map_err(|_| D::Error::custom(EXPECTED))
}
