//! Keyword options → the CLI's flags, parsed by the CLI's own clap definitions.
//!
//! `name=value` becomes `--name=value` (underscores as dashes); `True` gives a switch, `False`
//! and `None` leave it out; a list or tuple repeats the flag; a dict gives `KEY=VALUE` per item,
//! a list value joined by `x` (`input_shape={"x": [1, 3, 224, 224]}` → `--input-shape
//! x=1x3x224x224`); an `os.PathLike` is its path.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::ffi::OsString;
use std::path::PathBuf;

/// The keyword options of one call.
pub struct Kwargs<'a, 'py> {
    /// The Python function's name, for messages.
    fname: &'a str,
    dict: Option<&'a Bound<'py, PyDict>>,
    /// Flags the function fills from its own parameters (not to be given as options).
    reserved: &'a [&'a str],
    /// When set: the only flags (by `--long` name, dashes as underscores) the function takes.
    only: Option<&'a [&'a str]>,
}

impl<'a, 'py> Kwargs<'a, 'py> {
    pub fn new(
        fname: &'a str,
        dict: Option<&'a Bound<'py, PyDict>>,
        reserved: &'a [&'a str],
    ) -> Self {
        Kwargs {
            fname,
            dict,
            reserved,
            only: None,
        }
    }
    /// Restricts the options to `only` (the other flags of the CLI command belong elsewhere).
    pub fn only(mut self, only: &'a [&'a str]) -> Self {
        self.only = Some(only);
        self
    }
}

/// A clap error as the CLI prints it, without `error: ` and the usage/help lines.
fn clap_message(e: &clap::Error) -> String {
    let s = e.render().to_string();
    let s = s.trim_start_matches("error: ");
    let s = s.split("\n\n").next().unwrap_or(s);
    s.trim().to_string()
}

/// One scalar option value as its flag text.
fn scalar(v: &Bound<'_, PyAny>, key: &str) -> PyResult<String> {
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "option '{key}': True/False is not a value here"
        )));
    }
    if let Ok(s) = v.extract::<String>() {
        return Ok(s);
    }
    if v.is_instance_of::<pyo3::types::PyInt>() || v.is_instance_of::<pyo3::types::PyFloat>() {
        return Ok(v.str()?.to_string());
    }
    if let Ok(p) = v.extract::<PathBuf>() {
        return Ok(p.display().to_string());
    }
    Err(PyTypeError::new_err(format!(
        "option '{key}': expected a str, number or path, got {}",
        v.get_type().name()?
    )))
}

fn is_seq(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()
}

/// The flag values an option gives (one per occurrence).
fn values(v: &Bound<'_, PyAny>, key: &str) -> PyResult<Vec<String>> {
    if let Ok(d) = v.cast::<PyDict>() {
        let mut out = vec![];
        for (k, val) in d.iter() {
            let k = scalar(&k, key)?;
            let val = if is_seq(&val) {
                val.try_iter()?
                    .map(|x| scalar(&x?, key))
                    .collect::<PyResult<Vec<_>>>()?
                    .join("x")
            } else {
                scalar(&val, key)?
            };
            out.push(format!("{k}={val}"));
        }
        return Ok(out);
    }
    if is_seq(v) {
        return v.try_iter()?.map(|x| scalar(&x?, key)).collect();
    }
    Ok(vec![scalar(v, key)?])
}

/// Parses `fixed` flags (`(long, value)`, from the function's own parameters), the keyword
/// options and `positionals` with the clap definition of `T`; returns the parsed arguments with
/// the command and matches (for `npuc_cli::flags::Given`).
pub fn parse_args<T: clap::Args + clap::FromArgMatches>(
    fname: &'static str,
    kw: &Kwargs<'_, '_>,
    fixed: &[(String, String)],
    positionals: &[PathBuf],
) -> PyResult<(T, clap::Command, clap::ArgMatches)> {
    let cmd = T::augment_args(
        clap::Command::new(fname)
            .disable_help_flag(true)
            .disable_version_flag(true),
    );
    let mut argv: Vec<OsString> = vec![fname.into()];
    for (long, v) in fixed {
        argv.push(format!("--{long}={v}").into());
    }
    if let Some(d) = kw.dict {
        for (k, v) in d.iter() {
            let key: String = k.extract()?;
            if kw.reserved.contains(&key.as_str()) {
                return Err(PyTypeError::new_err(format!(
                    "{}() got multiple values for argument '{key}'",
                    kw.fname
                )));
            }
            let long = key.replace('_', "-");
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(long.as_str()))
                .filter(|_| kw.only.is_none_or(|o| o.contains(&key.as_str())));
            let Some(arg) = arg else {
                let mut names: Vec<String> = cmd
                    .get_arguments()
                    .filter_map(|a| a.get_long())
                    .map(|l| l.replace('-', "_"))
                    .filter(|n| !kw.reserved.contains(&n.as_str()))
                    .filter(|n| kw.only.is_none_or(|o| o.contains(&n.as_str())))
                    .collect();
                names.sort();
                return Err(PyTypeError::new_err(format!(
                    "{}() got an unexpected keyword argument '{key}' (options: {})",
                    kw.fname,
                    names.join(", ")
                )));
            };
            if v.is_none() {
                continue;
            }
            if !arg.get_action().takes_values() {
                let on: bool = v.extract().map_err(|_| {
                    PyTypeError::new_err(format!("option '{key}' is a switch: True or False"))
                })?;
                if on {
                    argv.push(format!("--{long}").into());
                }
                continue;
            }
            for s in values(&v, &key)? {
                argv.push(format!("--{long}={s}").into());
            }
        }
    }
    if !positionals.is_empty() {
        argv.push("--".into());
        argv.extend(positionals.iter().map(|p| p.as_os_str().to_owned()));
    }
    let m = cmd
        .clone()
        .try_get_matches_from(argv)
        .map_err(|e| crate::NpucError::new_err(clap_message(&e)))?;
    let a = T::from_arg_matches(&m).map_err(|e| crate::NpucError::new_err(clap_message(&e)))?;
    Ok((a, cmd, m))
}
