//! The user guide keeps up with the config: every key that a shipped config file sets is
//! described in `docs/configuration.md`, under its full path as `check-config` names it
//! (`server.listen`, `upstreams[].api_key`, `tenants[].session.max_calls`). A key added to
//! `config/` without a line in the reference fails here, naming the key.
//!
//! Likewise every script in `scripts/` has its line in `scripts/README.md`.
//!
//! Only text is read: no gateway, no socket, nothing of the crate but its files.

use std::{collections::BTreeSet, path::Path};

/// Every key path in a parsed TOML tree but the sections' own (`server`,
/// `tenants[].session`): those are headings, their keys are what is set. The elements of
/// an array of tables share one path (`upstreams[].name`); a plain array is a leaf.
fn key_paths(value: &toml::Value, prefix: &str, paths: &mut BTreeSet<String>) {
    match value {
        toml::Value::Table(table) => {
            for (key, value) in table {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                if !value.is_table() {
                    paths.insert(path.clone());
                }
                key_paths(value, &path, paths);
            }
        }
        toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
            // `upstreams` was inserted by its parent; its elements' keys go under `upstreams[]`.
            let element = format!("{prefix}[]");
            for item in items {
                key_paths(item, &element, paths);
            }
        }
        _ => {}
    }
}

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

#[test]
fn every_key_of_the_shipped_configs_is_in_the_configuration_reference() {
    let reference = read("docs/configuration.md");
    let mut paths = BTreeSet::new();
    for file in [
        "config/backstop.example.toml",
        "config/backstop.toml",
        "config/backstop.replicas.toml",
    ] {
        let value: toml::Value =
            toml::from_str(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        key_paths(&value, "", &mut paths);
    }
    assert!(
        paths.contains("tenants[].guard.cool_down"),
        "the walk reaches nested tables inside arrays of tables: {paths:?}"
    );
    let missing: Vec<_> = paths
        .iter()
        .filter(|path| !reference.contains(&format!("`{path}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not describe these keys (write each as `path`): {missing:?}"
    );
}

#[test]
fn every_script_has_its_line_in_scripts_readme() {
    let index = read("scripts/README.md");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
    let missing: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != "README.md" && !index.contains(&format!("`{name}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "scripts/README.md has no line for: {missing:?}"
    );
}
