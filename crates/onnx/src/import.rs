//! ModelProto -> IR.

use crate::proto;
use crate::OnnxError;
use bytes::Bytes;
use npuc_ir::{
    Attr, Backing, DType, Dim, Function, Graph, Initializer, Model, Node, OpsetImport, Tensor,
    TypeInfo, ValueInfo,
};
use prost::Message;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct BytesBacking(Bytes);
impl Backing for BytesBacking {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

pub(crate) struct MmapBacking(pub(crate) memmap2::Mmap);
impl Backing for MmapBacking {
    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn releasable(&self) -> bool {
        true
    }

    /// `madvise(MADV_DONTNEED)` over the whole pages inside the window (a partial page at
    /// either end may hold a neighbour's bytes still in use, and costs at most 4 KiB each).
    fn release(&self, offset: usize, len: usize) {
        #[cfg(unix)]
        {
            const PAGE: usize = 4096;
            let end = offset.saturating_add(len).min(self.0.len()) / PAGE * PAGE;
            let start = offset.div_ceil(PAGE) * PAGE;
            if start < end {
                // SAFETY: `Mmap::map` maps the file shared and read-only; for a shared file
                // mapping MADV_DONTNEED only unmaps the pages, and the next read maps them
                // again from the file (man 2 madvise), whose bytes npuc does not change while
                // it is mapped (see the mapping's SAFETY note). So every slice borrowed from
                // the mapping reads the same values before and after. The range lies inside
                // the mapping (clamped to its length above) and is page-aligned (the mapping
                // starts on a page).
                let _ = unsafe {
                    self.0.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )
                };
            }
        }
    }
}

/// Resolves external data files relative to the model's directory, mapping each file once.
struct ExternalFiles {
    base: Option<PathBuf>,
    model_path: PathBuf,
    files: HashMap<PathBuf, Arc<MmapBacking>>,
}

impl ExternalFiles {
    fn get(&mut self, tensor: &str, location: &str) -> Result<Arc<MmapBacking>, OnnxError> {
        let terr = |msg: String| OnnxError::Tensor {
            path: self.model_path.clone(),
            tensor: tensor.to_string(),
            msg,
        };
        let base = self.base.clone().ok_or_else(|| {
            terr("external data cannot be resolved for a model loaded from memory".into())
        })?;
        let rel = Path::new(location);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(terr(format!(
                "external data location '{location}' must be a relative path inside the model's directory"
            )));
        }
        let full = base.join(rel);
        if let Some(m) = self.files.get(&full) {
            return Ok(m.clone());
        }
        let file = std::fs::File::open(&full).map_err(|e| {
            terr(format!(
                "external data file '{}' cannot be opened ({e}); keep it next to the model",
                full.display()
            ))
        })?;
        // SAFETY: the mapping is read-only; npuc never writes model files while reading them.
        // Concurrent truncation by another process is the caller's responsibility (as for any mmap).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| OnnxError::Io {
            path: full.clone(),
            err: e,
        })?;
        let m = Arc::new(MmapBacking(mmap));
        self.files.insert(full, m.clone());
        Ok(m)
    }
}

/// Reads an ONNX model file. The file is memory-mapped; initializer data is borrowed from the
/// mapping (or from mapped external data files) where alignment allows.
pub fn load_model(path: &Path) -> Result<Model, OnnxError> {
    if path.is_dir() {
        return Err(OnnxError::Model {
            path: path.to_path_buf(),
            msg: "is a directory, not a model file (give the .onnx file; `npuc build` bundles are run by `npuc generate`)".into(),
        });
    }
    let file = std::fs::File::open(path).map_err(|e| OnnxError::Io {
        path: path.to_path_buf(),
        err: e,
    })?;
    let len = file
        .metadata()
        .map_err(|e| OnnxError::Io {
            path: path.to_path_buf(),
            err: e,
        })?
        .len();
    let bytes = if len == 0 {
        Bytes::new()
    } else {
        // SAFETY: read-only mapping of a model file that npuc does not modify while it is mapped.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| OnnxError::Io {
            path: path.to_path_buf(),
            err: e,
        })?;
        Bytes::from_owner(mmap)
    };
    let base = path
        .parent()
        .map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        })
        .map(Path::to_path_buf);
    decode_model(bytes, path, base)
}

/// Reads an ONNX model held in memory (external data cannot be resolved).
pub fn load_model_bytes(bytes: Vec<u8>, name: &Path) -> Result<Model, OnnxError> {
    decode_model(Bytes::from(bytes), name, None)
}

fn decode_model(bytes: Bytes, path: &Path, base: Option<PathBuf>) -> Result<Model, OnnxError> {
    if bytes.is_empty() {
        return Err(OnnxError::Decode {
            path: path.to_path_buf(),
            detail: "the file is empty".into(),
        });
    }
    let mp = proto::ModelProto::decode(bytes).map_err(|e| OnnxError::Decode {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    let graph = mp.graph.as_ref().ok_or_else(|| OnnxError::Model {
        path: path.to_path_buf(),
        msg: "the model has no graph (is this an ONNX model file?)".into(),
    })?;
    let mut cx = Cx {
        ext: ExternalFiles {
            base,
            model_path: path.to_path_buf(),
            files: HashMap::new(),
        },
        depth: 0,
    };
    let g = cx.graph(graph)?;
    let mut opset_imports: Vec<OpsetImport> = mp
        .opset_import
        .iter()
        .map(|o| OpsetImport {
            domain: o.domain().to_string(),
            version: o.version(),
        })
        .collect();
    if opset_imports.is_empty() {
        // IR version 3 models may omit it; opset 1 is what the spec implies then.
        opset_imports.push(OpsetImport {
            domain: String::new(),
            version: 1,
        });
    }
    let functions = mp
        .functions
        .iter()
        .map(|f| cx.function(f))
        .collect::<Result<Vec<_>, _>>()?;
    let mut model = Model {
        ir_version: mp.ir_version(),
        opset_imports,
        producer_name: mp.producer_name().to_string(),
        producer_version: mp.producer_version().to_string(),
        domain: mp.domain().to_string(),
        model_version: mp.model_version(),
        doc: mp.doc_string().to_string(),
        graph: g,
        metadata: mp
            .metadata_props
            .iter()
            .map(|p| (p.key().to_string(), p.value().to_string()))
            .collect(),
        functions,
    };
    // onnxruntime contrib ops become exact equivalents npuc runs (see `contrib`).
    crate::contrib::decompose(&mut model).map_err(|msg| OnnxError::Model {
        path: path.to_path_buf(),
        msg,
    })?;
    Ok(model)
}

struct Cx {
    ext: ExternalFiles,
    depth: usize,
}

const MAX_GRAPH_DEPTH: usize = 64;

impl Cx {
    fn merr(&self, msg: String) -> OnnxError {
        OnnxError::Model {
            path: self.ext.model_path.clone(),
            msg,
        }
    }

    fn graph(&mut self, g: &proto::GraphProto) -> Result<Graph, OnnxError> {
        self.depth += 1;
        if self.depth > MAX_GRAPH_DEPTH {
            return Err(self.merr(format!(
                "subgraphs nest deeper than {MAX_GRAPH_DEPTH} levels"
            )));
        }
        let mut initializers = Vec::with_capacity(g.initializer.len());
        for t in &g.initializer {
            let tensor = self.tensor(t)?;
            initializers.push(Initializer {
                name: t.name().to_string(),
                tensor,
            });
        }
        for s in &g.sparse_initializer {
            let (name, tensor) = self.sparse(s)?;
            initializers.push(Initializer { name, tensor });
        }
        let nodes = g
            .node
            .iter()
            .map(|n| self.node(n))
            .collect::<Result<Vec<_>, _>>()?;
        self.depth -= 1;
        Ok(Graph {
            name: g.name().to_string(),
            nodes,
            inputs: g.input.iter().map(value_info).collect(),
            outputs: g.output.iter().map(value_info).collect(),
            initializers,
            value_info: g.value_info.iter().map(value_info).collect(),
            doc: g.doc_string().to_string(),
        })
    }

    fn function(&mut self, f: &proto::FunctionProto) -> Result<Function, OnnxError> {
        let nodes = f
            .node
            .iter()
            .map(|n| self.node(n))
            .collect::<Result<Vec<_>, _>>()?;
        let attribute_defaults = f
            .attribute_proto
            .iter()
            .map(|a| Ok((a.name().to_string(), self.attr(a, "function")?)))
            .collect::<Result<Vec<_>, OnnxError>>()?;
        Ok(Function {
            name: f.name().to_string(),
            domain: f.domain().to_string(),
            inputs: f.input.clone(),
            outputs: f.output.clone(),
            attributes: f.attribute.clone(),
            attribute_defaults,
            nodes,
            opset_imports: f
                .opset_import
                .iter()
                .map(|o| OpsetImport {
                    domain: o.domain().to_string(),
                    version: o.version(),
                })
                .collect(),
            doc: f.doc_string().to_string(),
        })
    }

    fn node(&mut self, n: &proto::NodeProto) -> Result<Node, OnnxError> {
        let mut attrs = Vec::with_capacity(n.attribute.len());
        for a in &n.attribute {
            attrs.push((a.name().to_string(), self.attr(a, n.name())?));
        }
        Ok(Node {
            name: n.name().to_string(),
            op_type: n.op_type().to_string(),
            domain: npuc_ir::normalize_domain(n.domain()).to_string(),
            inputs: n.input.clone(),
            outputs: n.output.clone(),
            attrs,
            doc: n.doc_string().to_string(),
        })
    }

    fn attr(&mut self, a: &proto::AttributeProto, node: &str) -> Result<Attr, OnnxError> {
        use proto::attribute_proto::AttributeType as T;
        if let Some(r) = &a.ref_attr_name {
            return Ok(Attr::Ref(r.clone()));
        }
        let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let ty = T::try_from(a.r#type.unwrap_or(0)).unwrap_or(T::Undefined);
        let ty = if ty == T::Undefined {
            // Old models leave `type` unset: infer it from whichever field is filled.
            if a.f.is_some() {
                T::Float
            } else if a.i.is_some() {
                T::Int
            } else if a.s.is_some() {
                T::String
            } else if a.t.is_some() {
                T::Tensor
            } else if a.g.is_some() {
                T::Graph
            } else if !a.floats.is_empty() {
                T::Floats
            } else if !a.ints.is_empty() {
                T::Ints
            } else if !a.strings.is_empty() {
                T::Strings
            } else {
                T::Ints
            }
        } else {
            ty
        };
        Ok(match ty {
            T::Float => Attr::Float(a.f()),
            T::Int => Attr::Int(a.i()),
            T::String => Attr::String(s(a.s())),
            T::Tensor => Attr::Tensor(match &a.t {
                Some(t) => self.tensor(t)?,
                None => {
                    return Err(self.merr(format!(
                        "node '{node}': attribute '{}' has no tensor",
                        a.name()
                    )))
                }
            }),
            T::Graph => Attr::Graph(Box::new(match &a.g {
                Some(g) => self.graph(g)?,
                None => {
                    return Err(self.merr(format!(
                        "node '{node}': attribute '{}' has no graph",
                        a.name()
                    )))
                }
            })),
            T::SparseTensor => Attr::SparseTensor(match &a.sparse_tensor {
                Some(t) => self.sparse(t)?.1,
                None => {
                    return Err(self.merr(format!(
                        "node '{node}': attribute '{}' has no sparse tensor",
                        a.name()
                    )))
                }
            }),
            T::TypeProto => Attr::Type(a.tp.as_ref().and_then(type_info).ok_or_else(|| {
                self.merr(format!(
                    "node '{node}': attribute '{}' has no type",
                    a.name()
                ))
            })?),
            T::Floats => Attr::Floats(a.floats.clone()),
            T::Ints => Attr::Ints(a.ints.clone()),
            T::Strings => Attr::Strings(a.strings.iter().map(|b| s(b)).collect()),
            T::Tensors => Attr::Tensors(
                a.tensors
                    .iter()
                    .map(|t| self.tensor(t))
                    .collect::<Result<_, _>>()?,
            ),
            T::Graphs => Attr::Graphs(
                a.graphs
                    .iter()
                    .map(|g| self.graph(g))
                    .collect::<Result<_, _>>()?,
            ),
            T::SparseTensors => Attr::SparseTensors(
                a.sparse_tensors
                    .iter()
                    .map(|t| self.sparse(t).map(|x| x.1))
                    .collect::<Result<_, _>>()?,
            ),
            T::TypeProtos => Attr::Types(a.type_protos.iter().filter_map(type_info).collect()),
            T::Undefined => unreachable!("resolved above"),
        })
    }

    fn sparse(&mut self, s: &proto::SparseTensorProto) -> Result<(String, Tensor), OnnxError> {
        let vals = s
            .values
            .as_ref()
            .ok_or_else(|| self.merr("sparse tensor without values".into()))?;
        let name = vals.name().to_string();
        let values = self.tensor(vals)?;
        let indices = match &s.indices {
            Some(i) => self.tensor(i)?.to_i64_vec()?,
            None => vec![],
        };
        let dims: Vec<usize> = s.dims.iter().map(|&d| d.max(0) as usize).collect();
        sparse_to_dense(&dims, &values, &indices)
            .map(|t| (name.clone(), t))
            .map_err(|msg| OnnxError::Tensor {
                path: self.ext.model_path.clone(),
                tensor: name,
                msg,
            })
    }

    fn tensor(&mut self, t: &proto::TensorProto) -> Result<Tensor, OnnxError> {
        let path = self.ext.model_path.clone();
        tensor_from_proto_with(t, Some(&mut self.ext), &path)
    }
}

fn sparse_to_dense(dims: &[usize], values: &Tensor, indices: &[i64]) -> Result<Tensor, String> {
    let n = npuc_ir::checked_numel(dims).ok_or_else(|| {
        format!("dense shape {dims:?} overflows (more elements than addressable)")
    })?;
    let nnz = values.len();
    let rank = dims.len();
    // Indices are either [nnz] linear offsets or [nnz, rank] coordinates.
    let linear: Vec<usize> = if indices.len() == nnz {
        indices.iter().map(|&i| i as usize).collect()
    } else if indices.len() == nnz * rank {
        indices
            .chunks(rank.max(1))
            .map(|c| {
                c.iter()
                    .zip(dims)
                    .fold(0usize, |acc, (&i, &d)| acc * d + i as usize)
            })
            .collect()
    } else {
        return Err(format!(
            "sparse tensor has {nnz} values but {} indices",
            indices.len()
        ));
    };
    if linear.iter().any(|&i| i >= n) {
        return Err("sparse tensor index out of range".into());
    }
    let vals = values.to_f64_vec().map_err(|e| e.to_string())?;
    macro_rules! dense {
        ($t:ty, $conv:expr) => {{
            let mut out = vec![<$t>::default(); n];
            for (&i, &v) in linear.iter().zip(&vals) {
                out[i] = $conv(v);
            }
            Tensor::from_vec(dims.to_vec(), out).map_err(|e| e.to_string())
        }};
    }
    match values.dtype() {
        DType::F32 => dense!(f32, |v| v as f32),
        DType::F64 => dense!(f64, |v| v),
        DType::I64 => dense!(i64, |v| v as i64),
        DType::I32 => dense!(i32, |v| v as i32),
        other => Err(format!("sparse tensors of {other} are not supported")),
    }
}

fn value_info(v: &proto::ValueInfoProto) -> ValueInfo {
    ValueInfo {
        name: v.name().to_string(),
        ty: v.r#type.as_ref().and_then(type_info),
        doc: v.doc_string().to_string(),
    }
}

fn dims(s: &Option<proto::TensorShapeProto>) -> Option<Vec<Dim>> {
    use proto::tensor_shape_proto::dimension::Value as V;
    s.as_ref().map(|s| {
        s.dim
            .iter()
            .map(|d| match &d.value {
                Some(V::DimValue(v)) if *v >= 0 => Dim::Fixed(*v as usize),
                Some(V::DimParam(p)) if !p.is_empty() => Dim::Symbolic(p.clone()),
                _ => Dim::Unknown,
            })
            .collect()
    })
}

pub(crate) fn type_info(t: &proto::TypeProto) -> Option<TypeInfo> {
    use proto::type_proto::Value as V;
    Some(match t.value.as_ref()? {
        V::TensorType(tt) => TypeInfo::Tensor {
            dtype: DType::from_onnx_code(tt.elem_type()),
            shape: dims(&tt.shape),
        },
        V::SparseTensorType(tt) => TypeInfo::SparseTensor {
            dtype: DType::from_onnx_code(tt.elem_type()),
            shape: dims(&tt.shape),
        },
        V::SequenceType(s) => {
            TypeInfo::Sequence(s.elem_type.as_deref().and_then(type_info).map(Box::new))
        }
        V::OptionalType(s) => {
            TypeInfo::Optional(s.elem_type.as_deref().and_then(type_info).map(Box::new))
        }
        V::MapType(m) => TypeInfo::Map {
            key: DType::from_onnx_code(m.key_type()),
            value: m.value_type.as_deref().and_then(type_info).map(Box::new),
        },
        V::OpaqueType(_) => return None,
    })
}

fn dtype_name(code: i32) -> String {
    proto::tensor_proto::DataType::try_from(code)
        .map(|d| d.as_str_name().to_string())
        .unwrap_or_else(|_| format!("code {code}"))
}

/// Converts a TensorProto with no external data (a .pb test file, a Constant's value).
pub fn tensor_from_proto(t: &proto::TensorProto, source: &Path) -> Result<Tensor, OnnxError> {
    tensor_from_proto_with(t, None, source)
}

fn tensor_from_proto_with(
    t: &proto::TensorProto,
    ext: Option<&mut ExternalFiles>,
    source: &Path,
) -> Result<Tensor, OnnxError> {
    let name = t.name().to_string();
    let terr = |msg: String| OnnxError::Tensor {
        path: source.to_path_buf(),
        tensor: name.clone(),
        msg,
    };
    let code = t.data_type();
    let dtype = DType::from_onnx_code(code).ok_or_else(|| {
        terr(format!(
            "element type {} is not supported by npuc",
            dtype_name(code)
        ))
    })?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        if d < 0 {
            return Err(terr(format!("negative dimension {d} in {:?}", t.dims)));
        }
        shape.push(d as usize);
    }
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| terr(format!("shape {:?} overflows", t.dims)))?;
    let external = t.data_location == Some(proto::tensor_proto::DataLocation::External as i32);
    // Sub-byte types (4- and 2-bit) are packed low bits first.
    let bits = dtype.packed_bits();
    let packed4 = bits < 8;
    let need_bytes = if packed4 {
        (n * bits).div_ceil(8)
    } else {
        n * dtype.size()
    };

    let unpack4 = |bytes: &[u8]| -> Vec<u8> {
        let per = 8 / bits.max(1);
        let mask = ((1u16 << bits) - 1) as u8;
        (0..n)
            .map(|i| (bytes[i / per] >> ((i % per) * bits)) & mask)
            .collect()
    };

    if external {
        let ext = ext.ok_or_else(|| terr("external data is not allowed here".into()))?;
        let mut location = None;
        let mut offset = 0usize;
        let mut length = None;
        for kv in &t.external_data {
            let parse = |v: &str| {
                v.parse::<usize>().map_err(|_| {
                    terr(format!(
                        "external data field '{}' = '{v}' is not a number",
                        kv.key()
                    ))
                })
            };
            match kv.key() {
                "location" => location = Some(kv.value().to_string()),
                "offset" => offset = parse(kv.value())?,
                "length" => length = Some(parse(kv.value())?),
                _ => {}
            }
        }
        let location = location.ok_or_else(|| terr("external data has no 'location'".into()))?;
        let file = ext.get(&name, &location)?;
        let flen = file.bytes().len();
        let len = length.unwrap_or(flen.saturating_sub(offset));
        if offset.checked_add(len).is_none_or(|e| e > flen) {
            return Err(terr(format!(
                "external data offset {offset} + length {len} lies past the end of '{location}' ({flen} bytes); the data file is truncated or does not belong to this model"
            )));
        }
        if len != need_bytes {
            return Err(terr(format!(
                "external data length {len} does not match {dtype} {shape:?} ({need_bytes} bytes)"
            )));
        }
        if packed4 {
            let v = unpack4(&file.bytes()[offset..offset + len]);
            return Ok(Tensor::from_4bit(dtype, shape, v)?);
        }
        return Tensor::from_le_bytes(dtype, shape, file, offset, len)
            .map_err(|e| terr(e.to_string()));
    }

    if let Some(raw) = &t.raw_data {
        if dtype == DType::String {
            return Err(terr("string tensors cannot use raw_data".into()));
        }
        if raw.len() != need_bytes {
            return Err(terr(format!(
                "raw_data holds {} bytes but {dtype} {shape:?} needs {need_bytes}",
                raw.len()
            )));
        }
        if packed4 {
            return Ok(Tensor::from_4bit(dtype, shape, unpack4(raw))?);
        }
        let len = raw.len();
        let backing: Arc<dyn Backing> = Arc::new(BytesBacking(raw.clone()));
        return Tensor::from_le_bytes(dtype, shape, backing, 0, len)
            .map_err(|e| terr(e.to_string()));
    }

    let count_err = |found: usize| {
        terr(format!(
            "holds {found} values but shape {shape:?} needs {n}"
        ))
    };
    macro_rules! from_field {
        ($field:expr, $t:ty, $conv:expr) => {{
            let f = &$field;
            if f.len() != n {
                return Err(count_err(f.len()));
            }
            let v: Vec<$t> = f.iter().map($conv).collect();
            Tensor::from_vec(shape, v)?
        }};
    }
    Ok(match dtype {
        DType::F32 => from_field!(t.float_data, f32, |&x| x),
        DType::F64 => from_field!(t.double_data, f64, |&x| x),
        DType::I64 => from_field!(t.int64_data, i64, |&x| x),
        DType::I32 => from_field!(t.int32_data, i32, |&x| x),
        DType::I16 => from_field!(t.int32_data, i16, |&x| x as i16),
        DType::I8 => from_field!(t.int32_data, i8, |&x| x as i8),
        DType::U16 => from_field!(t.int32_data, u16, |&x| x as u16),
        DType::U8 => from_field!(t.int32_data, u8, |&x| x as u8),
        DType::Bool => from_field!(t.int32_data, bool, |&x| x != 0),
        DType::F16 => from_field!(t.int32_data, npuc_ir::f16, |&x| npuc_ir::f16::from_bits(
            x as u16
        )),
        DType::BF16 => from_field!(t.int32_data, npuc_ir::bf16, |&x| npuc_ir::bf16::from_bits(
            x as u16
        )),
        DType::U32 => from_field!(t.uint64_data, u32, |&x| x as u32),
        DType::U64 => from_field!(t.uint64_data, u64, |&x| x),
        DType::String => {
            if t.string_data.len() != n {
                return Err(count_err(t.string_data.len()));
            }
            Tensor::from_strings(
                shape,
                t.string_data
                    .iter()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .collect(),
            )?
        }
        d if d.is_small_float() && bits == 8 => {
            if t.int32_data.len() != n {
                return Err(count_err(t.int32_data.len()));
            }
            Tensor::from_codes(d, shape, t.int32_data.iter().map(|&x| x as u8).collect())?
        }
        _ => {
            // int32_data holds the packed bytes, one per entry.
            if t.int32_data.len() != need_bytes {
                return Err(count_err(t.int32_data.len() * 2));
            }
            let bytes: Vec<u8> = t.int32_data.iter().map(|&x| x as u8).collect();
            Tensor::from_4bit(dtype, shape, unpack4(&bytes))?
        }
    })
}

/// A value read from a test-data .pb file: a TensorProto, SequenceProto or OptionalProto.
#[derive(Debug, Clone)]
pub enum PbValue {
    Tensor(Tensor),
    Sequence(Vec<PbValue>),
    Optional(Option<Box<PbValue>>),
}

/// Reads a .pb file holding a TensorProto (or, with `kind` hints from the model's declared
/// type, a SequenceProto/OptionalProto).
pub fn load_value_pb(path: &Path, declared: Option<&TypeInfo>) -> Result<PbValue, OnnxError> {
    let bytes = std::fs::read(path).map_err(|e| OnnxError::Io {
        path: path.to_path_buf(),
        err: e,
    })?;
    let dec = |e: prost::DecodeError| OnnxError::Decode {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    match declared {
        Some(TypeInfo::Sequence(_)) => {
            let s = proto::SequenceProto::decode(bytes.as_slice()).map_err(dec)?;
            seq_value(&s, path)
        }
        Some(TypeInfo::Optional(_)) => {
            let o = proto::OptionalProto::decode(bytes.as_slice()).map_err(dec)?;
            opt_value(&o, path)
        }
        _ => {
            let t = proto::TensorProto::decode(bytes.as_slice()).map_err(dec)?;
            Ok(PbValue::Tensor(tensor_from_proto(&t, path)?))
        }
    }
}

fn seq_value(s: &proto::SequenceProto, path: &Path) -> Result<PbValue, OnnxError> {
    let mut v = vec![];
    for t in &s.tensor_values {
        v.push(PbValue::Tensor(tensor_from_proto(t, path)?));
    }
    for q in &s.sequence_values {
        v.push(seq_value(q, path)?);
    }
    for o in &s.optional_values {
        v.push(opt_value(o, path)?);
    }
    Ok(PbValue::Sequence(v))
}

fn opt_value(o: &proto::OptionalProto, path: &Path) -> Result<PbValue, OnnxError> {
    if let Some(t) = &o.tensor_value {
        return Ok(PbValue::Optional(Some(Box::new(PbValue::Tensor(
            tensor_from_proto(t, path)?,
        )))));
    }
    if let Some(s) = &o.sequence_value {
        return Ok(PbValue::Optional(Some(Box::new(seq_value(s, path)?))));
    }
    if let Some(s) = &o.optional_value {
        return Ok(PbValue::Optional(Some(Box::new(opt_value(s, path)?))));
    }
    Ok(PbValue::Optional(None))
}
