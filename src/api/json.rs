//! Request bodies parsed strictly: the same bytes must mean the same thing to Backstop
//! and to the upstream. A JSON object with a repeated key (`{"model":"cheap",
//! "model":"dear"}`) is ambiguous (parsers keep the first or the last), so Backstop
//! could route and price one model while the upstream serves another; it is refused.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses `bytes` as JSON, refusing any object that repeats a key (at any depth).
/// serde_json's recursion limit (128) bounds the nesting.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = Strict.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Builds a [`Value`] like serde_json's own, but fails on a duplicate key.
#[derive(Clone, Copy)]
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(v) = seq.next_element_seed(Strict)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(Strict)?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "duplicate key `{key}`: a repeated key is ambiguous"
                )));
            }
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn duplicates_are_refused_at_any_depth() {
        for body in [
            r#"{"model":"a","model":"b"}"#,
            r#"{"model":"a","tools":[{"function":{"name":"x","name":"y"}}]}"#,
            r#"{"response_format":{"type":"json_object","type":"text"}}"#,
        ] {
            let err = parse_strict(body.as_bytes()).unwrap_err().to_string();
            assert!(err.contains("duplicate key"), "{body}: {err}");
        }
        let ok = parse_strict(br#"{"a":[{"a":1},{"a":2}],"b":{"a":null}}"#).unwrap();
        assert_eq!(ok["a"][1]["a"], 2);
        assert!(parse_strict(b"{} trailing").is_err());
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| Value::Number(n.into())),
            any::<u64>().prop_map(|n| Value::Number(n.into())),
            (-1e300f64..1e300).prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(".{0,6}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Without duplicates, strict parsing is serde_json's parsing.
        #[test]
        fn agrees_with_serde_json(value in json()) {
            let text = serde_json::to_vec(&value).unwrap();
            prop_assert_eq!(parse_strict(&text).unwrap(), serde_json::from_slice::<Value>(&text).unwrap());
        }

        /// Arbitrary bytes never panic, and are accepted only if serde_json accepts them.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            if parse_strict(&bytes).is_ok() {
                prop_assert!(serde_json::from_slice::<Value>(&bytes).is_ok());
            }
        }
    }
}
