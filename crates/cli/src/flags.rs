//! Which flags were given on the command line, so that a flag that would have no effect in
//! the mode chosen is rejected by name instead of being silently ignored.

use anyhow::{bail, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// One subcommand's parsed arguments with its definition (for flag names).
pub struct Given<'a> {
    pub cmd: &'a Command,
    pub matches: &'a ArgMatches,
}

impl Given<'_> {
    /// Whether the argument with clap id `id` was given on the command line.
    pub fn has(&self, id: &str) -> bool {
        self.cmd.get_arguments().any(|a| a.get_id() == id)
            && self.matches.value_source(id) == Some(ValueSource::CommandLine)
    }

    /// The `--long` names of the arguments among `ids` given on the command line.
    pub fn names(&self, ids: &[&str]) -> Vec<String> {
        ids.iter()
            .filter(|id| self.has(id))
            .map(|id| {
                let arg = self.cmd.get_arguments().find(|a| a.get_id() == *id);
                match arg.and_then(|a| a.get_long()) {
                    Some(l) => format!("--{l}"),
                    None => id.to_string(),
                }
            })
            .collect()
    }

    /// Fails naming every flag among `ids` that was given, with `why` it has no effect.
    pub fn reject(&self, ids: &[&str], why: &str) -> Result<()> {
        let given = self.names(ids);
        if !given.is_empty() {
            bail!("{}: {why}", given.join(", "));
        }
        Ok(())
    }
}
