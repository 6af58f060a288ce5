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

/// The modules `src/` holds, as docs/architecture.md names them: every top-level module
/// (`src/state/`, `src/app.rs`) and every module one level down (`state/live/`,
/// `layers/meter.rs`; a folder's `mod.rs` is the folder).
fn modules() -> Vec<(String, bool)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let entries = |dir: &Path| {
        let mut names: Vec<(String, bool)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    p.is_dir(),
                )
            })
            .filter(|(name, _)| name != "mod.rs")
            .collect();
        names.sort();
        names
    };
    let mut out = Vec::new();
    for (top, is_dir) in entries(&src) {
        out.push((format!("src/{top}{}", if is_dir { "/" } else { "" }), true));
        if is_dir {
            for (name, sub_dir) in entries(&src.join(&top)) {
                out.push((
                    format!("{top}/{name}{}", if sub_dir { "/" } else { "" }),
                    false,
                ));
            }
        }
    }
    out
}

/// A backticked token of the page that names a file or folder of the repository:
/// relative to the root, to `src/` or to `docs/` (a glob's folder must exist).
fn named_paths(page: &str) -> Vec<&str> {
    page.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| !t.contains(char::is_whitespace) && !t.starts_with(['/', '.']))
        .filter(|t| !t.contains("::") && !t.contains('{') && !t.contains('='))
        .filter(|t| {
            t.contains('/')
                || [".rs", ".lua", ".md", ".toml", ".sql", ".json"]
                    .iter()
                    .any(|ext| t.ends_with(ext))
        })
        .collect()
}

#[test]
fn the_architecture_page_names_every_module_and_only_paths_that_exist() {
    let page = read("docs/architecture.md");
    let missing: Vec<String> = modules()
        .into_iter()
        .filter(|(name, _)| !page.contains(name.as_str()))
        .map(|(name, _)| name)
        .collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md does not name these modules of src/: {missing:?}"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exists = |path: &str| {
        let path = path.trim_end_matches('/');
        // A glob (`state/redis/*.lua`): its folder.
        let path = path.split('*').next().unwrap().trim_end_matches('/');
        ["", "src", "docs"]
            .iter()
            .any(|base| root.join(base).join(path).exists())
    };
    let gone: Vec<&str> = named_paths(&page)
        .into_iter()
        .filter(|p| !exists(p))
        .collect();
    assert!(
        gone.is_empty(),
        "docs/architecture.md names paths that do not exist: {gone:?}"
    );
}
