//! The typed config builder for tests: a config is a TOML tree, changed by key path, never
//! by searching and replacing its text (a replacement whose target text moved does
//! nothing, silently; a path whose table is missing is created, and one naming an
//! upstream, route or tenant that does not exist panics).
//!
//! ```ignore
//! TestConfig::parse(BASE)
//!     .set("retry.max_attempts", 1)
//!     .set("upstreams.primary.attempt_timeout", "1s")
//!     .set("routes.two.hedge_after", "100ms")
//!     .merge(r#"[[tenants]]
//!               name = "capped"
//!               api_keys = ["bk-capped"]"#)
//! ```
#![allow(dead_code)]

use backstop::config::Config;
use toml::{Table, Value};

/// A config under construction; [`TestConfig::text`] renders it, [`TestConfig::config`]
/// parses and validates it as the gateway would.
#[derive(Clone, Debug)]
pub struct TestConfig {
    root: Table,
}

/// The key that names an element of an array of tables (`[[upstreams]]` by `name`,
/// `[[routes]]` by `model`).
const NAMING_KEYS: [&str; 2] = ["name", "model"];

impl TestConfig {
    /// Starts from config text (which must parse).
    pub fn parse(text: &str) -> TestConfig {
        let root = toml::from_str(text).unwrap_or_else(|e| panic!("test config text: {e}"));
        TestConfig { root }
    }

    /// Sets the value at `path`: dotted keys, where a key after an array of tables picks
    /// the element with that `name` (or `model`): `upstreams.primary.attempt_timeout`.
    /// Missing tables are created; a missing array element panics.
    pub fn set(mut self, path: &str, value: impl Into<Value>) -> TestConfig {
        let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
        table_at(&mut self.root, parent).insert(key.to_string(), value.into());
        self
    }

    /// The string at `path` (which must exist).
    pub fn str_at(&self, path: &str) -> String {
        let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
        let mut root = self.root.clone();
        match table_at(&mut root, parent).get(key) {
            Some(Value::String(s)) => s.clone(),
            other => panic!("`{path}` is {other:?}, not a string"),
        }
    }

    /// Removes the key at `path`, or the named element of a top-level array of tables
    /// (`tenants.team-b`); it must exist.
    pub fn remove(mut self, path: &str) -> TestConfig {
        let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
        if let Some(Value::Array(items)) = self.root.get_mut(parent) {
            let before = items.len();
            items.retain(|item| !is_named(item, key));
            assert!(
                items.len() < before,
                "no `{path}` in the test config to remove"
            );
            return self;
        }
        table_at(&mut self.root, parent)
            .remove(key)
            .unwrap_or_else(|| panic!("no `{path}` in the test config to remove"));
        self
    }

    /// Merges TOML text into the tree: tables key by key, arrays of tables appended
    /// (`[[tenants]]` adds a tenant), other values replaced.
    pub fn merge(mut self, text: &str) -> TestConfig {
        let other: Table =
            toml::from_str(text).unwrap_or_else(|e| panic!("merged config text: {e}\n{text}"));
        merge(&mut self.root, other);
        self
    }

    /// The config as TOML text (for a config file, or a reload).
    pub fn text(&self) -> String {
        let mut out = String::new();
        render_table(&mut out, "", &self.root);
        out
    }

    /// Parsed and validated, with no environment.
    pub fn config(&self) -> Config {
        Config::from_toml_with_env(&self.text(), |_| None)
            .unwrap_or_else(|e| panic!("test config is invalid: {e}\n{}", self.text()))
    }
}

/// The table at dotted `path`, created where missing.
fn table_at<'a>(root: &'a mut Table, path: &str) -> &'a mut Table {
    let mut table = root;
    let mut keys = path.split('.').filter(|k| !k.is_empty()).peekable();
    while let Some(key) = keys.next() {
        let entry = table
            .entry(key.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        table = match entry {
            Value::Table(t) => t,
            Value::Array(items) => {
                let name = keys
                    .next()
                    .unwrap_or_else(|| panic!("`{path}`: which of the `{key}`?"));
                items
                    .iter_mut()
                    .find(|t| is_named(t, name))
                    .and_then(Value::as_table_mut)
                    .unwrap_or_else(|| panic!("`{path}`: no `{key}` named `{name}`"))
            }
            other => panic!("`{path}`: `{key}` is {other:?}, not a table"),
        };
    }
    table
}

fn is_named(item: &Value, name: &str) -> bool {
    NAMING_KEYS
        .iter()
        .any(|k| item.get(*k).and_then(Value::as_str) == Some(name))
}

/// A TOML value written as TOML (`[{ upstream = "dead" }]`), for [`TestConfig::set`].
pub fn toml_value(text: &str) -> Value {
    let mut table: Table =
        toml::from_str(&format!("v = {text}")).unwrap_or_else(|e| panic!("`{text}`: {e}"));
    table.remove("v").unwrap()
}

fn merge(into: &mut Table, from: Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(Value::Table(a)), Value::Table(b)) => merge(a, b),
            (Some(Value::Array(a)), Value::Array(b)) if is_tables(a) && is_tables(&b) => {
                a.extend(b)
            }
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

fn is_tables(items: &[Value]) -> bool {
    !items.is_empty() && items.iter().all(Value::is_table)
}

/// TOML text for `table` under the header path `at`: its plain keys, then its tables and
/// arrays of tables as sections.
fn render_table(out: &mut String, at: &str, table: &Table) {
    let section = |key: &str| {
        if at.is_empty() {
            key.to_string()
        } else {
            format!("{at}.{key}")
        }
    };
    for (key, value) in table {
        let nested = matches!(value, Value::Table(_))
            || matches!(value, Value::Array(items) if is_tables(items));
        if !nested {
            out.push_str(&format!("{} = {}\n", render_key(key), inline(value)));
        }
    }
    for (key, value) in table {
        match value {
            Value::Table(t) => {
                out.push_str(&format!("\n[{}]\n", section(&render_key(key))));
                render_table(out, &section(&render_key(key)), t);
            }
            Value::Array(items) if is_tables(items) => {
                for item in items.iter().filter_map(Value::as_table) {
                    out.push_str(&format!("\n[[{}]]\n", section(&render_key(key))));
                    render_table(out, &section(&render_key(key)), item);
                }
            }
            _ => {}
        }
    }
}

fn render_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_string()
    } else {
        quoted(key)
    }
}

/// A TOML basic string (JSON's escapes are a subset of TOML's).
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn inline(value: &Value) -> String {
    match value {
        Value::String(s) => quoted(s),
        Value::Integer(i) => i.to_string(),
        Value::Float(f) => format!("{f:?}"),
        Value::Boolean(b) => b.to_string(),
        Value::Datetime(d) => d.to_string(),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(inline).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Table(t) => {
            let pairs: Vec<String> = t
                .iter()
                .map(|(k, v)| format!("{} = {}", render_key(k), inline(v)))
                .collect();
            format!("{{ {} }}", pairs.join(", "))
        }
    }
}
