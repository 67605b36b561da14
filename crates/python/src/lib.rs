//! The `npuc` Python package: `import npuc`.
//!
//! A thin layer over the same library functions the `npuc` binary calls (`npuc-cli`'s command
//! functions, which call `npuc-driver`): keyword options are turned into the CLI's flags and
//! parsed by the CLI's own clap definitions, so names, defaults, validation and error messages
//! are the CLI's (`npuc.compile(m, o, input_shape={"x": [1, 3, 224, 224]})` is
//! `npuc compile m -o o --input-shape x=1x3x224x224`). Nothing shells out.
//!
//! - [`compile`] / [`quantize`]: `npuc compile [--quantize]`;
//! - [`verify`]: `npuc verify`;
//! - [`session::Session`]: `npuc run`'s session (`npuc_driver::open`);
//! - [`llm::Llm`] (`npuc.LLM`): `npuc generate`, blocking or streaming.
//!
//! Errors are `npuc.NpucError` with the message the CLI prints after `error: `; a keyword the
//! command does not take is a `TypeError`. No `unsafe` here (the pyo3 macros' generated code
//! aside): numpy arrays are copied in and handed out without a copy.
#![deny(unsafe_code)]

/// Large buffers start on a cache line, as in the `npuc` binary
/// (`npuc_runtime::kernels::align_alloc`).
#[global_allocator]
static ALLOC: npuc_runtime::kernels::align_alloc::CacheAligned =
    npuc_runtime::kernels::align_alloc::CacheAligned;

mod args;
mod llm;
mod session;

use args::{parse_args, Kwargs};
use npuc_cli::compile_cmd::{CompileArgs, Compiled};
use npuc_cli::verify::VerifyArgs;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

pyo3::create_exception!(
    npuc,
    NpucError,
    PyException,
    "An npuc error: the message is what the `npuc` command prints after `error: `."
);

/// An `anyhow` error as the Python exception, with the CLI's message (causes joined by `: `).
pub(crate) fn err(e: anyhow::Error) -> PyErr {
    NpucError::new_err(format!("{e:#}"))
}

/// A path argument: `str` or `os.PathLike`.
pub(crate) fn path_arg(p: &Bound<'_, PyAny>) -> PyResult<PathBuf> {
    p.extract::<PathBuf>()
}

/// A JSON value as Python objects (through the `json` module: dicts, lists, floats, None).
pub(crate) fn json_to_py<'py>(
    py: Python<'py>,
    v: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    let s = serde_json::to_string(v).map_err(|e| err(e.into()))?;
    py.import("json")?.call_method1("loads", (s,))
}

/// Progress lines of a pipeline handed to a Python callable (`progress=print`), or dropped.
struct PyProgress {
    callback: Option<Py<PyAny>>,
    error: Option<PyErr>,
}

impl PyProgress {
    fn new(callback: Option<Py<PyAny>>) -> PyProgress {
        PyProgress {
            callback,
            error: None,
        }
    }
    fn send(&mut self, msg: &str) {
        if self.error.is_some() {
            return;
        }
        if let Some(cb) = &self.callback {
            let r = Python::attach(|py| cb.call1(py, (msg,)).map(|_| ()));
            if let Err(e) = r {
                self.error = Some(e);
            }
        }
    }
    /// The first exception the callback raised, if any.
    fn finish(self) -> PyResult<()> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl npuc_driver::Progress for PyProgress {
    fn done(&mut self, line: &str) {
        self.send(line)
    }
    fn note(&mut self, msg: &str) {
        self.send(msg)
    }
}

/// Takes `progress=` out of the keyword options: a callable receiving each step line.
fn take_progress(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Option<Py<PyAny>>> {
    let Some(kw) = kwargs else { return Ok(None) };
    let Some(p) = kw.get_item("progress")? else {
        return Ok(None);
    };
    kw.del_item("progress")?;
    if p.is_none() {
        return Ok(None);
    }
    if !p.is_callable() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "progress= takes a callable receiving each step line (e.g. print)",
        ));
    }
    Ok(Some(p.unbind()))
}

/// What `npuc.compile` returns: the summary as a dict, with the CLI's printed lines.
fn compiled_json(c: &Compiled, output: &std::path::Path, print_passes: bool) -> serde_json::Value {
    let lines = c.lines(output, print_passes);
    let mut j = match c {
        Compiled::Graphs(s) | Compiled::Gguf(s) => serde_json::json!({
            "graphs": s.graphs.iter().map(|g| serde_json::json!({
                "name": g.name, "nodes_before": g.nodes_before, "nodes_after": g.nodes_after,
                "arena_bytes": g.arena_bytes,
            })).collect::<Vec<_>>(),
            "weight_bytes_unique": s.weight_bytes_unique,
            "weight_bytes_referenced": s.weight_bytes_referenced,
            "file_bytes": s.file_bytes,
            "seconds": s.seconds,
        }),
        Compiled::Quantized { name, summary: s } => serde_json::json!({
            "graphs": [{"name": name}],
            "activations": s.activations,
            "params": s.params,
            "samples": s.samples,
            "scheme": s.scheme,
            "method": s.method,
            "file_bytes": s.file_bytes,
            "seconds": s.seconds,
        }),
    };
    j["output"] = serde_json::Value::String(output.display().to_string());
    j["summary"] = serde_json::Value::String(lines.last().cloned().unwrap_or_default());
    j["lines"] = serde_json::json!(lines);
    j
}

fn compile_impl<'py>(
    py: Python<'py>,
    fname: &'static str,
    model: &Bound<'py, PyAny>,
    output: &Bound<'py, PyAny>,
    scheme: Option<&str>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let progress = take_progress(kwargs)?;
    // One model (a path) or several (a list of paths).
    let models: Vec<PathBuf> = if model.is_instance_of::<pyo3::types::PyList>()
        || model.is_instance_of::<pyo3::types::PyTuple>()
    {
        model
            .try_iter()?
            .map(|m| path_arg(&m?))
            .collect::<PyResult<_>>()?
    } else {
        vec![path_arg(model)?]
    };
    let output = path_arg(output)?;
    let mut fixed: Vec<(String, String)> = vec![("output".into(), output.display().to_string())];
    if let Some(s) = scheme {
        fixed.push(("quantize".into(), s.to_string()));
    }
    let kw = Kwargs::new(fname, kwargs, &["output", "quantize"]);
    let (a, cmd, m) = parse_args::<CompileArgs>(fname, &kw, &fixed, &models)?;
    let given = npuc_cli::flags::Given {
        cmd: &cmd,
        matches: &m,
    };
    let mut p = PyProgress::new(progress);
    let r = py.detach(|| npuc_cli::compile_cmd::compile(&a, &given, &mut p));
    p.finish()?;
    let c = r.map_err(err)?;
    json_to_py(py, &compiled_json(&c, &a.output, a.print_passes))
}

/// `npuc compile MODEL [MODEL...] -o OUTPUT [options]`: ONNX models (or one `.gguf` LLM, or one
/// ONNX model with `quantize=SCHEME`) into one `.npuc` artifact. Options are the CLI's flags
/// (`input_shape={"x": [1, 3, 224, 224]}`, `dim={"batch": 1}`, `no_optimize=True`,
/// `variants="ar1,ar32"`, `quantize="w8a8", calib=DIR`, ...); `progress=print` shows the steps.
/// Returns the summary (a dict; `summary` is the line `npuc compile` ends with).
#[pyfunction]
#[pyo3(signature = (model, output, **options))]
fn compile<'py>(
    py: Python<'py>,
    model: &Bound<'py, PyAny>,
    output: &Bound<'py, PyAny>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    compile_impl(py, "compile", model, output, None, options)
}

/// `npuc compile MODEL --quantize SCHEME -o OUTPUT [options]`: calibrated quantization
/// (`calib=DIR`, `calib_method="percentile"`, `granularity=...`, `encodings=ENC.json`,
/// `emit_qdq=Q.onnx`, ...) into a quantized artifact. Returns the summary (a dict).
#[pyfunction]
#[pyo3(signature = (model, output, scheme, **options))]
fn quantize<'py>(
    py: Python<'py>,
    model: &Bound<'py, PyAny>,
    output: &Bound<'py, PyAny>,
    scheme: &str,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    compile_impl(py, "quantize", model, output, Some(scheme), options)
}

/// `npuc verify QUANTIZED --reference REFERENCE --inputs INPUTS [options]`: per-layer SQNR,
/// cosine and max abs error of a quantized model against its float reference. Returns the
/// report as `npuc verify --json` prints it (a dict) plus `text`, the table `npuc verify`
/// prints.
#[pyfunction]
#[pyo3(signature = (quantized, reference, inputs, **options))]
fn verify<'py>(
    py: Python<'py>,
    quantized: &Bound<'py, PyAny>,
    reference: &Bound<'py, PyAny>,
    inputs: &Bound<'py, PyAny>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let progress = take_progress(options)?;
    let fixed = vec![
        (
            "reference".to_string(),
            path_arg(reference)?.display().to_string(),
        ),
        (
            "inputs".to_string(),
            path_arg(inputs)?.display().to_string(),
        ),
    ];
    let kw = Kwargs::new("verify", options, &["reference", "inputs", "json"]);
    let (a, _, _) = parse_args::<VerifyArgs>("verify", &kw, &fixed, &[path_arg(quantized)?])?;
    let mut p = PyProgress::new(progress);
    let r = py.detach(|| npuc_cli::verify::verify(&a, &mut |m| p.send(m)));
    p.finish()?;
    let v = r.map_err(err)?;
    let mut j = v.json();
    j["text"] = serde_json::Value::String(npuc_driver::verify::report_text(&v.report));
    json_to_py(py, &j)
}

/// Memory budget for any one tensor or loop output whose size comes from a model, an option or
/// shape arithmetic (`npuc --max-memory`): bytes or a size such as `"8G"`; `None`: the memory
/// available (the default).
#[pyfunction]
#[pyo3(signature = (size))]
fn set_max_memory(size: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let bytes = match size {
        None => None,
        Some(s) if s.is_none() => None,
        Some(s) => Some(match s.extract::<u64>() {
            Ok(b) => b,
            Err(_) => npuc_runtime::limits::parse_bytes(&s.extract::<String>()?)
                .map_err(|e| NpucError::new_err(format!("max memory: {e}")))?,
        }),
    };
    npuc_runtime::limits::set_max_memory(bytes);
    Ok(())
}

/// Whether `.npuc` artifacts have their weight checksums verified when opened (the default;
/// `False` is `npuc --trust`).
#[pyfunction]
fn set_verify_weights(on: bool) {
    npuc_format::set_verify_weights_on_open(on);
}

#[pymodule]
fn npuc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    npuc_cli::register_ops();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NpucError", m.py().get_type::<NpucError>())?;
    m.add_function(wrap_pyfunction!(compile, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(set_max_memory, m)?)?;
    m.add_function(wrap_pyfunction!(set_verify_weights, m)?)?;
    m.add_class::<session::Session>()?;
    m.add_class::<session::TensorInfo>()?;
    m.add_class::<llm::Llm>()?;
    m.add_class::<llm::TokenStream>()?;
    Ok(())
}
