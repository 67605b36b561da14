//! IR -> ModelProto, and atomic file writing.

use crate::proto;
use crate::OnnxError;
use npuc_ir::{Attr, DType, Dim, Function, Graph, Model, Node, Tensor, TypeInfo, ValueInfo};
use prost::Message;
use std::path::Path;

#[derive(Clone, Debug, Default)]
pub struct ExportOptions {
    /// Write initializers of at least this many bytes to `<model>.data` next to the model
    /// (4096-aligned offsets, so the data can be mapped in place). `None`: everything inline.
    pub external_threshold: Option<usize>,
}

/// Converts an IR model to a ModelProto with all data inline.
pub fn to_model_proto(m: &Model) -> Result<proto::ModelProto, OnnxError> {
    let mut sink = None;
    model_proto(m, &mut sink)
}

/// Where initializers above the threshold go: streamed tensor by tensor into the data file's
/// temp file (created at the first one), so a model of many GB is never a second time in
/// memory as one buffer.
struct ExternalSink {
    location: String,
    path: std::path::PathBuf,
    threshold: usize,
    file: Option<npuc_format::AtomicFile>,
}

impl ExternalSink {
    /// Appends `bytes` at the next 4096-aligned offset; returns that offset.
    fn append(&mut self, bytes: &[u8]) -> Result<u64, OnnxError> {
        let io = |err| OnnxError::Io {
            path: self.path.clone(),
            err,
        };
        if self.file.is_none() {
            self.file = Some(npuc_format::AtomicFile::create(&self.path).map_err(io)?);
        }
        let f = self.file.as_mut().expect("created above");
        let offset = f.pad_to(4096).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        Ok(offset)
    }
}

fn model_proto(m: &Model, ext: &mut Option<ExternalSink>) -> Result<proto::ModelProto, OnnxError> {
    Ok(proto::ModelProto {
        ir_version: Some(m.ir_version),
        opset_import: m
            .opset_imports
            .iter()
            .map(|o| proto::OperatorSetIdProto {
                domain: Some(o.domain.clone()),
                version: Some(o.version),
            })
            .collect(),
        producer_name: Some(m.producer_name.clone()),
        producer_version: Some(m.producer_version.clone()),
        domain: Some(m.domain.clone()),
        model_version: Some(m.model_version),
        doc_string: Some(m.doc.clone()),
        graph: Some(graph_proto(&m.graph, ext)?),
        metadata_props: m
            .metadata
            .iter()
            .map(|(k, v)| proto::StringStringEntryProto {
                key: Some(k.clone()),
                value: Some(v.clone()),
            })
            .collect(),
        functions: m
            .functions
            .iter()
            .map(|f| function_proto(f, ext))
            .collect::<Result<_, _>>()?,
        ..Default::default()
    })
}

fn function_proto(
    f: &Function,
    ext: &mut Option<ExternalSink>,
) -> Result<proto::FunctionProto, OnnxError> {
    Ok(proto::FunctionProto {
        name: Some(f.name.clone()),
        domain: Some(f.domain.clone()),
        input: f.inputs.clone(),
        output: f.outputs.clone(),
        attribute: f.attributes.clone(),
        attribute_proto: f
            .attribute_defaults
            .iter()
            .map(|(n, a)| attr_proto(n, a, ext))
            .collect::<Result<_, _>>()?,
        node: f
            .nodes
            .iter()
            .map(|n| node_proto(n, ext))
            .collect::<Result<_, _>>()?,
        opset_import: f
            .opset_imports
            .iter()
            .map(|o| proto::OperatorSetIdProto {
                domain: Some(o.domain.clone()),
                version: Some(o.version),
            })
            .collect(),
        doc_string: Some(f.doc.clone()),
        ..Default::default()
    })
}

fn graph_proto(g: &Graph, ext: &mut Option<ExternalSink>) -> Result<proto::GraphProto, OnnxError> {
    Ok(proto::GraphProto {
        name: Some(g.name.clone()),
        node: g
            .nodes
            .iter()
            .map(|n| node_proto(n, ext))
            .collect::<Result<_, _>>()?,
        initializer: g
            .initializers
            .iter()
            .map(|i| tensor_proto_ext(&i.name, &i.tensor, ext))
            .collect::<Result<_, _>>()?,
        input: g.inputs.iter().map(value_info_proto).collect(),
        output: g.outputs.iter().map(value_info_proto).collect(),
        value_info: g.value_info.iter().map(value_info_proto).collect(),
        doc_string: Some(g.doc.clone()),
        ..Default::default()
    })
}

fn node_proto(n: &Node, ext: &mut Option<ExternalSink>) -> Result<proto::NodeProto, OnnxError> {
    Ok(proto::NodeProto {
        name: Some(n.name.clone()),
        op_type: Some(n.op_type.clone()),
        domain: Some(n.domain.clone()),
        input: n.inputs.clone(),
        output: n.outputs.clone(),
        attribute: n
            .attrs
            .iter()
            .map(|(name, a)| attr_proto(name, a, ext))
            .collect::<Result<_, _>>()?,
        doc_string: Some(n.doc.clone()),
        ..Default::default()
    })
}

fn attr_proto(
    name: &str,
    a: &Attr,
    ext: &mut Option<ExternalSink>,
) -> Result<proto::AttributeProto, OnnxError> {
    use proto::attribute_proto::AttributeType as T;
    let mut p = proto::AttributeProto {
        name: Some(name.to_string()),
        ..Default::default()
    };
    let ty = match a {
        Attr::Float(f) => {
            p.f = Some(*f);
            T::Float
        }
        Attr::Int(i) => {
            p.i = Some(*i);
            T::Int
        }
        Attr::String(s) => {
            p.s = Some(s.as_bytes().to_vec());
            T::String
        }
        Attr::Tensor(t) => {
            p.t = Some(tensor_proto("", t)?);
            T::Tensor
        }
        Attr::Graph(g) => {
            p.g = Some(graph_proto(g, ext)?);
            T::Graph
        }
        Attr::SparseTensor(t) => {
            // Written densely as a sparse tensor with all indices.
            p.sparse_tensor = Some(dense_as_sparse(t)?);
            T::SparseTensor
        }
        Attr::Type(t) => {
            p.tp = Some(type_proto(t));
            T::TypeProto
        }
        Attr::Floats(v) => {
            p.floats = v.clone();
            T::Floats
        }
        Attr::Ints(v) => {
            p.ints = v.clone();
            T::Ints
        }
        Attr::Strings(v) => {
            p.strings = v.iter().map(|s| s.as_bytes().to_vec()).collect();
            T::Strings
        }
        Attr::Tensors(v) => {
            p.tensors = v
                .iter()
                .map(|t| tensor_proto("", t))
                .collect::<Result<_, _>>()?;
            T::Tensors
        }
        Attr::Graphs(v) => {
            p.graphs = v
                .iter()
                .map(|g| graph_proto(g, ext))
                .collect::<Result<_, _>>()?;
            T::Graphs
        }
        Attr::SparseTensors(v) => {
            p.sparse_tensors = v.iter().map(dense_as_sparse).collect::<Result<_, _>>()?;
            T::SparseTensors
        }
        Attr::Types(v) => {
            p.type_protos = v.iter().map(type_proto).collect();
            T::TypeProtos
        }
        Attr::Ref(r) => {
            p.ref_attr_name = Some(r.clone());
            T::Undefined
        }
    };
    if ty != T::Undefined {
        p.r#type = Some(ty as i32);
    }
    Ok(p)
}

fn dense_as_sparse(t: &Tensor) -> Result<proto::SparseTensorProto, OnnxError> {
    let n = t.len();
    Ok(proto::SparseTensorProto {
        values: Some(tensor_proto("", &t.clone().reshaped(vec![n])?)?),
        indices: Some(tensor_proto(
            "",
            &Tensor::from_vec(vec![n], (0..n as i64).collect())?,
        )?),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
    })
}

fn value_info_proto(v: &ValueInfo) -> proto::ValueInfoProto {
    proto::ValueInfoProto {
        name: Some(v.name.clone()),
        r#type: v.ty.as_ref().map(type_proto),
        doc_string: if v.doc.is_empty() {
            None
        } else {
            Some(v.doc.clone())
        },
        ..Default::default()
    }
}

fn shape_proto(s: &Option<Vec<Dim>>) -> Option<proto::TensorShapeProto> {
    use proto::tensor_shape_proto::{dimension::Value as V, Dimension};
    s.as_ref().map(|dims| proto::TensorShapeProto {
        dim: dims
            .iter()
            .map(|d| Dimension {
                value: match d {
                    Dim::Fixed(n) => Some(V::DimValue(*n as i64)),
                    Dim::Symbolic(p) => Some(V::DimParam(p.clone())),
                    Dim::Unknown => None,
                },
                denotation: None,
            })
            .collect(),
    })
}

fn type_proto(t: &TypeInfo) -> proto::TypeProto {
    use proto::type_proto::{Map, Optional, Sequence, SparseTensor, Tensor as TT, Value as V};
    let code = |d: &Option<DType>| d.map(|d| d.onnx_code()).unwrap_or(0);
    let value = match t {
        TypeInfo::Tensor { dtype, shape } => V::TensorType(TT {
            elem_type: Some(code(dtype)),
            shape: shape_proto(shape),
        }),
        TypeInfo::SparseTensor { dtype, shape } => V::SparseTensorType(SparseTensor {
            elem_type: Some(code(dtype)),
            shape: shape_proto(shape),
        }),
        TypeInfo::Sequence(e) => V::SequenceType(Box::new(Sequence {
            elem_type: e.as_ref().map(|e| Box::new(type_proto(e))),
        })),
        TypeInfo::Optional(e) => V::OptionalType(Box::new(Optional {
            elem_type: e.as_ref().map(|e| Box::new(type_proto(e))),
        })),
        TypeInfo::Map { key, value } => V::MapType(Box::new(Map {
            key_type: Some(code(key)),
            value_type: value.as_ref().map(|e| Box::new(type_proto(e))),
        })),
    };
    proto::TypeProto {
        value: Some(value),
        denotation: None,
    }
}

/// Packs 4- and 2-bit codes, low bits first (the ONNX layout).
fn pack_bits(t: &Tensor) -> Result<Vec<u8>, OnnxError> {
    let bits = t.dtype().packed_bits();
    let codes = t.to_le_bytes()?;
    let per = 8 / bits;
    let mask = ((1u16 << bits) - 1) as u8;
    let mut out = vec![0u8; (codes.len() * bits).div_ceil(8)];
    for (i, c) in codes.iter().enumerate() {
        out[i / per] |= (c & mask) << ((i % per) * bits);
    }
    Ok(out)
}

/// A TensorProto with the data inline (raw_data; string_data for strings).
pub fn tensor_proto(name: &str, t: &Tensor) -> Result<proto::TensorProto, OnnxError> {
    tensor_proto_ext(name, t, &mut None)
}

fn tensor_proto_ext(
    name: &str,
    t: &Tensor,
    ext: &mut Option<ExternalSink>,
) -> Result<proto::TensorProto, OnnxError> {
    let mut p = proto::TensorProto {
        name: Some(name.to_string()),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: Some(t.dtype().onnx_code()),
        ..Default::default()
    };
    if t.dtype() == DType::String {
        p.string_data = t
            .as_strings()?
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        return Ok(p);
    }
    let bytes = if t.dtype().packed_bits() < 8 {
        std::borrow::Cow::Owned(pack_bits(t)?)
    } else {
        t.le_bytes()?
    };
    if let Some(sink) = ext
        .as_mut()
        .filter(|s| bytes.len() >= s.threshold && !name.is_empty())
    {
        let offset = sink.append(&bytes)?;
        p.data_location = Some(proto::tensor_proto::DataLocation::External as i32);
        let kv = |k: &str, v: String| proto::StringStringEntryProto {
            key: Some(k.into()),
            value: Some(v),
        };
        p.external_data = vec![
            kv("location", sink.location.clone()),
            kv("offset", offset.to_string()),
            kv("length", bytes.len().to_string()),
        ];
        return Ok(p);
    }
    p.raw_data = Some(bytes.into_owned().into());
    Ok(p)
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), OnnxError> {
    npuc_format::persist_atomic(path, bytes).map_err(|e| OnnxError::Io {
        path: path.to_path_buf(),
        err: e,
    })
}

/// Saves a model as ONNX. Large initializers go to `<file>.data` when the options ask for it.
pub fn save_model(m: &Model, path: &Path, opts: &ExportOptions) -> Result<(), OnnxError> {
    let location = format!(
        "{}.data",
        path.file_name()
            .and_then(|f| f.to_str())
            .unwrap_or("model.onnx")
    );
    let mut sink = opts.external_threshold.map(|threshold| ExternalSink {
        path: path.with_file_name(&location),
        location,
        threshold,
        file: None,
    });
    let mp = model_proto(m, &mut sink)?;
    // A protobuf message cannot exceed 2 GiB (onnxruntime and onnx refuse it): say what to do
    // instead of writing a file nothing can read.
    let len = mp.encoded_len();
    if len > PROTOBUF_LIMIT {
        return Err(OnnxError::Model {
            path: path.to_path_buf(),
            msg: format!(
                "the model is {len} bytes as one protobuf, over the 2 GiB protobuf limit; write its initializers as external data (ExportOptions::external_threshold)"
            ),
        });
    }
    // The data file first: the model is only renamed into place once everything it points at
    // is there.
    if let Some(f) = sink.and_then(|s| s.file) {
        let data_path = f.path().to_path_buf();
        f.commit().map_err(|err| OnnxError::Io {
            path: data_path,
            err,
        })?;
    }
    write_atomic(path, &mp.encode_to_vec())
}

/// The largest protobuf message (2 GiB - 1): what ONNX's own checker and onnxruntime accept.
pub const PROTOBUF_LIMIT: usize = i32::MAX as usize;

/// Saves one tensor as a TensorProto .pb file (the ONNX test-data format).
pub fn save_tensor_pb(name: &str, t: &Tensor, path: &Path) -> Result<(), OnnxError> {
    write_atomic(path, &tensor_proto(name, t)?.encode_to_vec())
}
