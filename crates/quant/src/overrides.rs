//! Mixed-precision overrides: `{"default": "w8a8", "rules": [{"pattern": "/blocks.3/*",
//! "scheme": "w8a16"}, {"pattern": "*head*", "scheme": "float"}]}` (JSON, or TOML when the file
//! ends in `.toml`). Patterns are globs (`*`, `?`) matched against node names and tensor names;
//! the last matching rule wins.

use crate::Scheme;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One rule: nodes/tensors matching `pattern` use `scheme`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    /// Glob over node and tensor names.
    pub pattern: String,
    /// Any `--quantize` scheme name or `float`.
    pub scheme: String,
}

/// A parsed overrides file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Overrides {
    /// Scheme for everything no rule matches (the CLI's `--quantize` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Rules in order; later rules win.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

impl Overrides {
    /// Reads a JSON or (by extension) TOML overrides file and checks every scheme name.
    pub fn load(path: &Path) -> Result<Overrides> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading overrides file {}", path.display()))?;
        let o: Overrides = if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
        {
            toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?
        } else {
            serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?
        };
        o.validate()
            .with_context(|| format!("in {}", path.display()))?;
        Ok(o)
    }

    /// Checks that every scheme name parses.
    pub fn validate(&self) -> Result<()> {
        if let Some(d) = &self.default {
            Scheme::parse(d).context("\"default\"")?;
        }
        for r in &self.rules {
            Scheme::parse(&r.scheme).with_context(|| format!("rule '{}'", r.pattern))?;
            if r.pattern.is_empty() {
                bail!("a rule has an empty pattern");
            }
        }
        Ok(())
    }

    /// Pretty JSON in the format [`Self::load`] reads (what `npuc verify --apply` writes).
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The scheme of the last rule matching any of `names`, if any, with the rule index.
    pub fn lookup<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str> + Clone,
    ) -> Option<(usize, Scheme)> {
        self.rules.iter().enumerate().rev().find_map(|(i, r)| {
            names
                .clone()
                .into_iter()
                .any(|n| glob_match(&r.pattern, n))
                .then(|| Scheme::parse(&r.scheme).ok().map(|s| (i, s)))
                .flatten()
        })
    }
}

/// Glob matching with `*` (any run, including empty) and `?` (one character).
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            // Let the last star swallow one more character and retry.
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("/blocks.3/*", "/blocks.3/attn/MatMul"));
        assert!(!glob_match("/blocks.3/*", "/blocks.30"));
        assert!(glob_match("*head*", "model.head.weight"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "aXbYbc"));
        assert!(!glob_match("a*b*c", "aXbYb"));
    }
}
