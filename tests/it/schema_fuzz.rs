//! A fuzz harness for the static schema checks: random small schemas with `$ref`s to
//! random pointers, built from `allOf`/`anyOf`/`not`/`properties`/`items`/`$defs`.
//! Whatever the checks let through must compile and validate random instances in
//! bounded time (an in-place cycle they missed would overflow the stack or run away).
//!
//! 256 cases by default; `PROPTEST_CASES=10000 cargo test --test it schema_fuzz::` for more.

use std::{sync::mpsc, time::Duration};

use backstop::validation::shape::{self, ShapeLimits};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const POINTERS: &[&str] = &[
    "#",
    "#/$defs/a",
    "#/$defs/b",
    "#/$defs/a/allOf/0",
    "#/$defs/a/anyOf/1",
    "#/$defs/b/not",
    "#/$defs/b/properties/p",
    "#/$defs/a/items",
    "#/allOf/0",
    "#/anyOf/0",
    "#/not",
    "#/properties/p",
    "#/properties/q/allOf/0",
    "#/items",
    "#/nowhere",
];

const LIMITS: ShapeLimits = ShapeLimits {
    max_depth: 32,
    max_paths: 64,
    max_fanout: 1024,
};

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec!["string", "number", "object", "array", "null"])
            .prop_map(|t| json!({"type": t})),
        any::<bool>().prop_map(Value::Bool),
        prop::sample::select(POINTERS.to_vec()).prop_map(|p| json!({"$ref": p})),
    ]
}

/// One keyword with its value, `inner` being a subschema.
fn keyword(inner: BoxedStrategy<Value>) -> impl Strategy<Value = (String, Value)> {
    prop_oneof![
        prop::collection::vec(inner.clone(), 1..3).prop_map(|v| ("allOf".into(), Value::Array(v))),
        prop::collection::vec(inner.clone(), 1..3).prop_map(|v| ("anyOf".into(), Value::Array(v))),
        inner.clone().prop_map(|v| ("not".into(), v)),
        (inner.clone(), inner.clone())
            .prop_map(|(p, q)| ("properties".into(), json!({"p": p, "q": q}))),
        inner.clone().prop_map(|v| ("items".into(), v)),
        prop::sample::select(POINTERS.to_vec()).prop_map(|p| ("$ref".into(), json!(p))),
    ]
}

fn object(inner: BoxedStrategy<Value>) -> impl Strategy<Value = Value> {
    prop::collection::vec(keyword(inner), 1..4)
        .prop_map(|pairs| Value::Object(pairs.into_iter().collect::<Map<_, _>>()))
}

fn subschema() -> BoxedStrategy<Value> {
    leaf()
        .prop_recursive(2, 12, 3, |inner| object(inner.boxed()))
        .boxed()
}

fn schema() -> impl Strategy<Value = Value> {
    (object(subschema()), subschema(), subschema()).prop_map(|(mut root, a, b)| {
        root["$defs"] = json!({"a": a, "b": b});
        root
    })
}

fn instance() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        "[a-z]{0,4}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 24, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            (inner.clone(), inner).prop_map(|(p, q)| json!({"p": p, "q": q})),
        ]
    })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn what_passes_the_checks_validates_in_bounded_time(
        schema in schema(),
        instances in prop::collection::vec(instance(), 1..4),
    ) {
        if shape::check(&schema, &LIMITS).is_err() {
            return Ok(());
        }
        let Ok(validator) = jsonschema::validator_for(&schema) else {
            return Ok(());
        };
        let (done, wait) = mpsc::channel();
        // A missed cycle overflows this thread's stack, which aborts the test binary:
        // a loud failure, though not a shrunk one.
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                for instance in &instances {
                    let _ = validator.iter_errors(instance).take(20).count();
                    let _ = validator.is_valid(instance);
                }
                let _ = done.send(());
            })
            .unwrap();
        prop_assert!(
            wait.recv_timeout(Duration::from_secs(10)).is_ok(),
            "validation ran away for {}",
            schema
        );
    }
}

#[test]
fn the_generator_reaches_cycles_and_recursion() {
    // The harness only means something if it produces both kinds.
    use proptest::{strategy::ValueTree, test_runner::TestRunner};
    let mut runner = TestRunner::deterministic();
    let (mut refused, mut recursive_accepted) = (0, 0);
    for _ in 0..300 {
        let s = schema().new_tree(&mut runner).unwrap().current();
        match shape::check(&s, &LIMITS) {
            Err(e) if e.contains("reference cycle") => refused += 1,
            Ok(_) if s.to_string().contains("\"$ref\":\"#\"") => recursive_accepted += 1,
            _ => {}
        }
    }
    assert!(refused > 10, "{refused} cycles");
    assert!(
        recursive_accepted > 10,
        "{recursive_accepted} accepted recursive schemas"
    );
}
