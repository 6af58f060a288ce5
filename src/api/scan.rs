//! A pre-scan of a request body that counts what parsing it would build, without
//! building it: every JSON value, the non-empty objects, and the lists the item limits
//! name (`messages`, `input`, and the content parts inside their items). It allocates
//! nothing, so a body that is over a limit is refused before it costs more than its own
//! bytes; a parsed body (a `serde_json::Value`) costs several times its size.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// What a body would cost parsed, counted by [`scan`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BodyShape {
    /// Every JSON value (objects, arrays and scalars), at any depth.
    pub values: u64,
    /// Objects with at least one key: each is a map node of its own once parsed.
    pub objects: u64,
    /// Items of the top-level `messages` list.
    pub messages: usize,
    /// Items of the top-level `input` list (the Responses API, embeddings).
    pub input: usize,
    /// Content parts: the lists at `messages[].content`, summed.
    pub message_parts: usize,
    /// Content parts: the lists at `input[].content`, summed.
    pub input_parts: usize,
}

/// Bytes one parsed value costs beyond its text: a `serde_json::Value` and an allocation.
const VALUE_BYTES: u64 = 48;
/// Bytes one non-empty parsed object costs: a B-tree leaf of 11 keys and values.
const OBJECT_BYTES: u64 = 640;

impl BodyShape {
    /// What the body of `len` bytes costs in memory once parsed, beyond its own bytes:
    /// its text copied into the tree, the tree, and one re-serialised copy for the
    /// upstream (a rewritten model, stream usage asked for). An estimate that errs high.
    pub fn parsed_bytes(&self, len: usize) -> u64 {
        (len as u64)
            .saturating_mul(2)
            .saturating_add(self.values.saturating_mul(VALUE_BYTES))
            .saturating_add(self.objects.saturating_mul(OBJECT_BYTES))
    }
}

/// Counts `bytes` as JSON. Errors are serde_json's own (syntax, depth over 128), as the
/// full parse would report them; a repeated key is left to the full parse.
pub fn scan(bytes: &[u8]) -> Result<BodyShape, serde_json::Error> {
    let mut shape = BodyShape::default();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Count {
        shape: &mut shape,
        at: At::Root,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(shape)
}

/// Where in the body a value sits, as far as the limits care.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    Root,
    /// The top-level `messages` or `input` list.
    List(Listed),
    /// One item of such a list.
    Item(Listed),
    /// The `content` list of such an item.
    Parts(Listed),
    Elsewhere,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Listed {
    Messages,
    Input,
}

struct Count<'a> {
    shape: &'a mut BodyShape,
    at: At,
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.shape.values += 1;
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.shape.values += 1;
        let child = match self.at {
            At::List(listed) => At::Item(listed),
            _ => At::Elsewhere,
        };
        let mut n = 0usize;
        while seq
            .next_element_seed(Count {
                shape: &mut *self.shape,
                at: child,
            })?
            .is_some()
        {
            n += 1;
        }
        match self.at {
            At::List(Listed::Messages) => self.shape.messages += n,
            At::List(Listed::Input) => self.shape.input += n,
            At::Parts(Listed::Messages) => self.shape.message_parts += n,
            At::Parts(Listed::Input) => self.shape.input_parts += n,
            _ => {}
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.shape.values += 1;
        let mut empty = true;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            empty = false;
            let child = match (self.at, key) {
                (At::Root, Key::Messages) => At::List(Listed::Messages),
                (At::Root, Key::Input) => At::List(Listed::Input),
                (At::Item(listed), Key::Content) => At::Parts(listed),
                _ => At::Elsewhere,
            };
            map.next_value_seed(Count {
                shape: &mut *self.shape,
                at: child,
            })?;
        }
        if !empty {
            self.shape.objects += 1;
        }
        Ok(())
    }
}

/// An object key, as far as the limits care.
#[derive(Clone, Copy)]
enum Key {
    Messages,
    Input,
    Content,
    Other,
}

struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Key, E> {
        Ok(match key {
            "messages" => Key::Messages,
            "input" => Key::Input,
            "content" => Key::Content,
            _ => Key::Other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_lists_the_limits_name_and_every_value() {
        let shape = scan(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "tools":[{"content":[1,2,3]}],"x":{"messages":[1,2]}}"#,
        )
        .unwrap();
        assert_eq!(shape.messages, 2);
        assert_eq!(shape.message_parts, 2);
        assert_eq!(shape.input, 0);
        assert_eq!(shape.input_parts, 0);
        // root, model, messages, 2 items (an object and its 2 values each), 2 parts (3
        // each), tools, its item, content, 3 numbers, x, its messages and 2 numbers.
        assert_eq!(
            shape.values,
            1 + 1 + 1 + 3 + 3 + 6 + 1 + 1 + 1 + 3 + 1 + 1 + 2
        );
        assert_eq!(shape.objects, 1 + 2 + 2 + 1 + 1);

        let shape =
            scan(br#"{"input":[{"type":"message","content":[{"type":"input_text"}]},"x"]}"#)
                .unwrap();
        assert_eq!((shape.input, shape.input_parts), (2, 1));
        let shape = scan(br#"{"input":"just text"}"#).unwrap();
        assert_eq!((shape.input, shape.values), (0, 2));
    }

    /// Every value of a parsed body, counted the way [`scan`] counts.
    fn count(value: &serde_json::Value) -> (u64, u64) {
        use serde_json::Value;
        match value {
            Value::Array(items) => items
                .iter()
                .map(count)
                .fold((1, 0), |a, b| (a.0 + b.0, a.1 + b.1)),
            Value::Object(map) => map
                .values()
                .map(count)
                .fold((1, u64::from(!map.is_empty())), |a, b| {
                    (a.0 + b.0, a.1 + b.1)
                }),
            _ => (1, 0),
        }
    }

    proptest::proptest! {
        /// The scan accepts what the parser accepts, and counts what it would build.
        #[test]
        fn scan_agrees_with_the_parser(bytes in proptest::collection::vec(
            proptest::sample::select(b"{}[],:\"ab01 tnul".to_vec()), 0..64)) {
            let parsed = serde_json::from_slice::<serde_json::Value>(&bytes);
            let scanned = scan(&bytes);
            proptest::prop_assert_eq!(parsed.is_ok(), scanned.is_ok());
            // Counted against a parse that keeps every key (a repeated one is refused).
            if let (Ok(value), Ok(shape)) = (crate::api::json::parse_strict(&bytes), scanned) {
                proptest::prop_assert_eq!(count(&value), (shape.values, shape.objects));
            }
        }
    }

    #[test]
    fn errors_are_the_parsers_own() {
        for bad in [&b"{"[..], b"{} trailing", b"[1,]"] {
            assert_eq!(
                scan(bad).unwrap_err().to_string(),
                serde_json::from_slice::<serde_json::Value>(bad)
                    .unwrap_err()
                    .to_string()
            );
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(scan(deep.as_bytes()).is_err());
    }
}
