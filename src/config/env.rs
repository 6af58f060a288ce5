//! `${VAR}` interpolation over every string in the parsed TOML tree, so secrets never
//! have to be written into the file. Done on the tree (not the text) so a value cannot
//! break the TOML syntax, and so a missing variable can be reported with its key path.
//!
//! What came from the environment is remembered ([`FromEnv`]) so that no error can echo
//! it: a secret put by mistake into a duration or a URL must not reach a log line or an
//! answer of `POST /admin/reload`.

use super::ConfigError;

/// The values `${VAR}` references were replaced with, by variable.
#[derive(Default)]
pub(super) struct FromEnv(Vec<(String, String)>);

impl FromEnv {
    /// `text` with every value that came from the environment replaced by its `${VAR}`
    /// reference. Longest first, so a value that contains another is replaced whole;
    /// also in its escaped (`{:?}`) form, as messages quote values that way.
    pub(super) fn scrub(&self, text: &str) -> String {
        let mut values: Vec<(&str, String)> = Vec::new();
        for (var, value) in &self.0 {
            let escaped = format!("{value:?}");
            let escaped = &escaped[1..escaped.len() - 1];
            if escaped != value {
                values.push((var, escaped.to_string()));
            }
            values.push((var, value.clone()));
        }
        values.sort_by_key(|(_, value)| std::cmp::Reverse(value.len()));
        let mut out = text.to_string();
        for (var, value) in values {
            if !value.is_empty() && out.contains(&value) {
                out = out.replace(&value, &format!("${{{var}}}"));
            }
        }
        out
    }
}

pub(super) fn interpolate(
    value: &mut toml::Value,
    path: &str,
    lookup: &impl Fn(&str) -> Option<String>,
    from_env: &mut FromEnv,
) -> Result<(), ConfigError> {
    match value {
        toml::Value::String(s) if s.contains("${") => *s = expand(s, path, lookup, from_env)?,
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &format!("{path}[{i}]"), lookup, from_env)?;
            }
        }
        toml::Value::Table(table) => {
            for (key, item) in table.iter_mut() {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                interpolate(item, &child, lookup, from_env)?;
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
    from_env: &mut FromEnv,
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
        from_env.0.push((var.to_string(), value));
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::FromEnv;

    #[test]
    fn values_from_the_environment_are_replaced_by_their_reference() {
        let from_env = FromEnv(vec![
            ("KEY".into(), "sk-abc".into()),
            ("LONG".into(), "sk-abc-def".into()),
            ("QUOTED".into(), "a\"b".into()),
        ]);
        assert_eq!(
            from_env.scrub("got \"sk-abc-def\" and sk-abc and \"a\\\"b\""),
            "got \"${LONG}\" and ${KEY} and \"${QUOTED}\""
        );
    }
}
