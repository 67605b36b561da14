//! `npuc.Session`: a model or artifact opened as `npuc run` opens it, run on numpy arrays.
//!
//! Inputs are copied once into npuc tensors (a numpy buffer cannot be lent to the runtime
//! without `unsafe`: its lifetime is Python's); outputs are handed to numpy without a copy
//! (`PyArray::from_vec` takes the tensor's `Vec`), except for the rare output the session
//! still shares (an initializer passed through), which is copied.

use crate::{err, path_arg};
use npuc_ir::{DType, Dim, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::Value;
use numpy::{Element, PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// numpy's name of an npuc dtype.
fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I16 => "int16",
        DType::U16 => "uint16",
        DType::I32 => "int32",
        DType::U32 => "uint32",
        DType::I64 => "int64",
        DType::U64 => "uint64",
        DType::Bool => "bool",
        DType::String => "str",
        other => other.name(),
    }
}

/// A graph input or output: name, numpy dtype name and shape (`int` per fixed dimension, the
/// symbol's name for a symbolic one, `None` when unknown; `shape` is `None` when the rank is).
#[pyclass(frozen, module = "npuc", get_all)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Option<String>,
    pub shape: Option<Vec<Py<PyAny>>>,
}

#[pymethods]
impl TensorInfo {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let shape = match &self.shape {
            None => "None".to_string(),
            Some(s) => {
                let parts: Vec<String> = s
                    .iter()
                    .map(|d| d.bind(py).repr().map(|r| r.to_string()))
                    .collect::<PyResult<_>>()?;
                format!("[{}]", parts.join(", "))
            }
        };
        Ok(format!(
            "TensorInfo(name={:?}, dtype={}, shape={shape})",
            self.name,
            self.dtype
                .as_deref()
                .map(|d| format!("{d:?}"))
                .unwrap_or_else(|| "None".into())
        ))
    }
}

fn info(py: Python<'_>, v: &ValueInfo) -> PyResult<TensorInfo> {
    let (dtype, shape) = match &v.ty {
        Some(TypeInfo::Tensor { dtype, shape }) => (*dtype, shape.as_ref()),
        _ => (None, None),
    };
    let shape = shape
        .map(|dims| {
            dims.iter()
                .map(|d| -> PyResult<Py<PyAny>> {
                    Ok(match d {
                        Dim::Fixed(n) => n.into_pyobject(py)?.into_any().unbind(),
                        Dim::Symbolic(s) => s.into_pyobject(py)?.into_any().unbind(),
                        Dim::Unknown => py.None(),
                    })
                })
                .collect::<PyResult<Vec<_>>>()
        })
        .transpose()?;
    Ok(TensorInfo {
        name: v.name.clone(),
        dtype: dtype.map(|d| numpy_name(d).to_string()),
        shape,
    })
}

/// A model (ONNX) or artifact (`.npuc`) opened for execution, as `npuc run` opens it.
#[pyclass(frozen, module = "npuc")]
pub struct Session {
    session: npuc_runtime::Session,
    path: PathBuf,
}

/// A numpy array's values as an npuc tensor of element type `T` (one copy; any strides).
fn copy_in<T: Element + npuc_ir::tensor::Elem>(a: &Bound<'_, PyArrayDyn<T>>) -> PyResult<Tensor> {
    let ro = a
        .try_readonly()
        .map_err(|e| PyTypeError::new_err(e.to_string()))?;
    let shape = ro.shape().to_vec();
    let v: Vec<T> = match ro.as_slice() {
        Ok(s) if ro.is_c_contiguous() => s.to_vec(),
        _ => ro.as_array().iter().copied().collect(),
    };
    Tensor::from_vec(shape, v).map_err(|e| err(e.into()))
}

/// A Python value (numpy array, or anything `numpy.asarray` takes) as an input tensor.
fn to_value(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    let py = obj.py();
    let a = py.import("numpy")?.call_method1("asarray", (obj,))?;
    macro_rules! try_types {
        ($($t:ty),*) => {
            $(if let Ok(x) = a.cast::<PyArrayDyn<$t>>() {
                return Ok(Value::tensor(copy_in(x)?));
            })*
        };
    }
    try_types!(
        f32,
        f64,
        half::f16,
        i64,
        i32,
        i16,
        i8,
        u8,
        u16,
        u32,
        u64,
        bool
    );
    let dt = a.getattr("dtype")?.str()?.to_string();
    Err(PyTypeError::new_err(format!(
        "input '{name}': numpy dtype {dt} is not supported (npuc takes float16/32/64, int8-64, uint8-64 and bool arrays)"
    )))
}

/// A numpy array owning `v` (no copy), shaped `shape`.
fn array<'py, T: Element>(
    py: Python<'py>,
    v: Vec<T>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, v)
        .reshape(shape.to_vec())?
        .into_any())
}

/// An output tensor as a numpy array: the tensor's buffer itself when the session no longer
/// holds it (the usual case), else a copy. bfloat16 and the 8/4-bit float formats become
/// float32 (numpy has no such dtypes); 4/2-bit integers their 8-bit storage type.
fn tensor_to_py<'py>(py: Python<'py>, t: Arc<Tensor>) -> PyResult<Bound<'py, PyAny>> {
    let t = Arc::try_unwrap(t).unwrap_or_else(|shared| (*shared).clone());
    let shape = t.shape().to_vec();
    let e = |e: npuc_ir::IrError| err(e.into());
    match t.dtype() {
        DType::F32 => array(py, t.into_vec::<f32>().map_err(e)?, &shape),
        DType::F64 => array(py, t.into_vec::<f64>().map_err(e)?, &shape),
        DType::F16 => array(py, t.into_vec::<half::f16>().map_err(e)?, &shape),
        DType::I8 | DType::I4 | DType::I2 => array(py, t.into_vec::<i8>().map_err(e)?, &shape),
        DType::U8 | DType::U4 | DType::U2 => array(py, t.into_vec::<u8>().map_err(e)?, &shape),
        DType::I16 => array(py, t.into_vec::<i16>().map_err(e)?, &shape),
        DType::U16 => array(py, t.into_vec::<u16>().map_err(e)?, &shape),
        DType::I32 => array(py, t.into_vec::<i32>().map_err(e)?, &shape),
        DType::U32 => array(py, t.into_vec::<u32>().map_err(e)?, &shape),
        DType::I64 => array(py, t.into_vec::<i64>().map_err(e)?, &shape),
        DType::U64 => array(py, t.into_vec::<u64>().map_err(e)?, &shape),
        DType::Bool => array(py, t.into_vec::<bool>().map_err(e)?, &shape),
        DType::String => {
            let objs: Vec<Py<PyAny>> = t
                .as_strings()
                .map_err(e)?
                .iter()
                .map(|s| pyo3::types::PyString::new(py, s).into_any().unbind())
                .collect();
            array(py, objs, &shape)
        }
        _ => {
            let v: Vec<f32> = t
                .to_f64_vec()
                .map_err(e)?
                .into_iter()
                .map(|x| x as f32)
                .collect();
            array(py, v, &shape)
        }
    }
}

/// An output value: a numpy array, a list (sequence) or `None`/the value (optional).
fn value_to_py<'py>(py: Python<'py>, v: Value) -> PyResult<Bound<'py, PyAny>> {
    match v {
        Value::Tensor(t) => tensor_to_py(py, t),
        Value::Sequence(items) => {
            let l = PyList::empty(py);
            for it in items {
                l.append(value_to_py(py, it)?)?;
            }
            Ok(l.into_any())
        }
        Value::Optional(None) => Ok(py.None().into_bound(py)),
        Value::Optional(Some(b)) => value_to_py(py, *b),
    }
}

#[pymethods]
impl Session {
    /// Opens `path` (ONNX model or `.npuc` artifact) as `npuc run` does: `graph` picks an
    /// artifact's graph (default: its first), `threads` the session's threads, `simulate` runs a
    /// quantized model as QuantSim; `input_shape`/`dim` bind input shapes of an ONNX model
    /// (`{"x": [1, 3, 224, 224]}`, `{"batch": 1}`); `optimize=False` runs a float ONNX model's
    /// graph as imported (`npuc run --no-optimize`).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, *, graph=None, threads=1, simulate=false, input_shape=None, dim=None, optimize=true))]
    fn new(
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        graph: Option<String>,
        threads: usize,
        simulate: bool,
        input_shape: Option<HashMap<String, Vec<usize>>>,
        dim: Option<HashMap<String, usize>>,
        optimize: bool,
    ) -> PyResult<Session> {
        let path = path_arg(path)?;
        if threads == 0 {
            return Err(crate::NpucError::new_err("threads must be at least 1"));
        }
        let opts = npuc_driver::OpenOptions {
            graph,
            input_shapes: input_shape.unwrap_or_default(),
            dims: dim.unwrap_or_default(),
            simulate,
            threads,
            optimize,
        };
        let opened = py
            .detach(|| {
                let o = npuc_driver::open(&path, &opts)?;
                npuc_cli::check_simulate(&path, simulate, &o)?;
                anyhow::Ok(o)
            })
            .map_err(err)?;
        Ok(Session {
            session: opened.session,
            path,
        })
    }

    /// The graph inputs (name, dtype, shape).
    #[getter]
    fn inputs(&self, py: Python<'_>) -> PyResult<Vec<TensorInfo>> {
        self.session.inputs().iter().map(|v| info(py, v)).collect()
    }

    /// The graph outputs (name, dtype, shape as declared).
    #[getter]
    fn outputs(&self, py: Python<'_>) -> PyResult<Vec<TensorInfo>> {
        self.session.outputs().iter().map(|v| info(py, v)).collect()
    }

    /// The file this session runs.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Runs the model on `{input name: array}` and returns `{output name: array}` in the graph's
    /// output order. The GIL is released while the model runs.
    fn run<'py>(
        &self,
        py: Python<'py>,
        feeds: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut inputs = Vec::with_capacity(feeds.len());
        for (k, v) in feeds.iter() {
            let name: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("run() takes a dict of {input name: array}"))?;
            let val = to_value(&name, &v)?;
            inputs.push((name, val));
        }
        let outs = py
            .detach(|| self.session.run(inputs))
            .map_err(|e| err(e.into()))?;
        let d = PyDict::new(py);
        for (name, v) in outs {
            d.set_item(name, value_to_py(py, v)?)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("npuc.Session({:?})", self.path.display().to_string())
    }
}
