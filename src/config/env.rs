//! `${VAR}` interpolation over every string in the parsed TOML tree, so secrets never
//! have to be written into the file. Done on the tree (not the text) so a value cannot
//! break the TOML syntax, and so a missing variable can be reported with its key path.

use super::ConfigError;

pub(super) fn interpolate(
    value: &mut toml::Value,
    path: &str,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    match value {
        toml::Value::String(s) if s.contains("${") => *s = expand(s, path, lookup)?,
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &format!("{path}[{i}]"), lookup)?;
            }
        }
        toml::Value::Table(table) => {
            for (key, item) in table.iter_mut() {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                interpolate(item, &child, lookup)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn expand(
    input: &str,
    path: &str,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| ConfigError::invalid(path, "unterminated ${...} reference"))?;
        let var = &after[..end];
        if var.is_empty() {
            return Err(ConfigError::invalid(path, "empty ${} reference"));
        }
        let value = lookup(var).ok_or_else(|| ConfigError::MissingEnv {
            key: path.to_string(),
            var: var.to_string(),
        })?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
