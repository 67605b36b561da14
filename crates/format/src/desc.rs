//! The META section's schema (serde) and conversion to and from the IR.

use crate::{Artifact, ArtifactWriter, FormatError};
use npuc_ir::{
    Attr, DType, Dim, Graph, Initializer, Model, Node, OpsetImport, TypeInfo, ValueInfo,
};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub format_major: u16,
    pub format_minor: u16,
    pub producer: String,
    pub producer_version: String,
    pub target: crate::Target,
    /// The compile options used (as given on the command line).
    pub options: serde_json::Value,
    pub sources: Vec<SourceDesc>,
    pub graphs: Vec<GraphDesc>,
    /// Unique weight blobs; graphs refer to them by index.
    pub weights: Vec<WeightDesc>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SourceDesc {
    pub name: String,
    pub xxh3_128: String,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WeightDesc {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Offset within the WEIGHTS section (64-byte aligned).
    pub offset: u64,
    pub len: u64,
    pub xxh3: u64,
    /// String tensors live in META.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strings: Option<Vec<String>>,
}

/// Per-graph facts recorded by the compiler.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GraphInfo {
    #[serde(default)]
    pub nodes_before: usize,
    #[serde(default)]
    pub nodes_after: usize,
    #[serde(default)]
    pub arena_bytes: u64,
    #[serde(default)]
    pub source: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GraphDesc {
    pub name: String,
    #[serde(default)]
    pub opsets: Vec<(String, i64)>,
    pub body: BodyDesc,
    #[serde(default)]
    pub metadata: Vec<(String, String)>,
    #[serde(default)]
    pub functions_inlined: bool,
    #[serde(default)]
    pub info: GraphInfo,
    /// Inputs/outputs that carry an LLM's KV cache (name -> role), for later LLM graphs.
    #[serde(default)]
    pub kv_cache: Vec<(String, String)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BodyDesc {
    pub name: String,
    pub inputs: Vec<IoDesc>,
    pub outputs: Vec<IoDesc>,
    pub initializers: Vec<(String, usize)>,
    pub nodes: Vec<NodeDesc>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IoDesc {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ty: Option<TypeDesc>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TypeDesc {
    Tensor {
        dtype: Option<String>,
        shape: Option<Vec<DimDesc>>,
    },
    SparseTensor {
        dtype: Option<String>,
        shape: Option<Vec<DimDesc>>,
    },
    Sequence {
        elem: Option<Box<TypeDesc>>,
    },
    Optional {
        elem: Option<Box<TypeDesc>>,
    },
    Map {
        key: Option<String>,
        value: Option<Box<TypeDesc>>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DimDesc {
    Fixed(usize),
    /// A symbol name, or "?" for unknown.
    Sym(String),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeDesc {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub op: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attrs: Vec<(String, AttrDesc)>,
}

/// A float that survives JSON: finite values as numbers, others as "nan"/"inf"/"-inf".
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum F32Desc {
    Num(f32),
    Special(String),
}

impl From<f32> for F32Desc {
    fn from(f: f32) -> F32Desc {
        if f.is_finite() {
            F32Desc::Num(f)
        } else if f.is_nan() {
            F32Desc::Special("nan".into())
        } else if f > 0.0 {
            F32Desc::Special("inf".into())
        } else {
            F32Desc::Special("-inf".into())
        }
    }
}

impl F32Desc {
    fn get(&self) -> f32 {
        match self {
            F32Desc::Num(f) => *f,
            F32Desc::Special(s) => match s.as_str() {
                "inf" => f32::INFINITY,
                "-inf" => f32::NEG_INFINITY,
                _ => f32::NAN,
            },
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttrDesc {
    Float(F32Desc),
    Int(i64),
    String(String),
    /// Index into `Meta::weights`.
    Tensor(usize),
    SparseTensor(usize),
    Graph(Box<BodyDesc>),
    Type(TypeDesc),
    Floats(Vec<F32Desc>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
    Tensors(Vec<usize>),
    SparseTensors(Vec<usize>),
    Graphs(Vec<BodyDesc>),
    Types(Vec<TypeDesc>),
}

fn type_desc(t: &TypeInfo) -> TypeDesc {
    let dims = |s: &Option<Vec<Dim>>| {
        s.as_ref().map(|d| {
            d.iter()
                .map(|d| match d {
                    Dim::Fixed(n) => DimDesc::Fixed(*n),
                    Dim::Symbolic(s) => DimDesc::Sym(s.clone()),
                    Dim::Unknown => DimDesc::Sym("?".into()),
                })
                .collect()
        })
    };
    let dt = |d: &Option<DType>| d.map(|d| d.name().to_string());
    match t {
        TypeInfo::Tensor { dtype, shape } => TypeDesc::Tensor {
            dtype: dt(dtype),
            shape: dims(shape),
        },
        TypeInfo::SparseTensor { dtype, shape } => TypeDesc::SparseTensor {
            dtype: dt(dtype),
            shape: dims(shape),
        },
        TypeInfo::Sequence(e) => TypeDesc::Sequence {
            elem: e.as_ref().map(|e| Box::new(type_desc(e))),
        },
        TypeInfo::Optional(e) => TypeDesc::Optional {
            elem: e.as_ref().map(|e| Box::new(type_desc(e))),
        },
        TypeInfo::Map { key, value } => TypeDesc::Map {
            key: dt(key),
            value: value.as_ref().map(|e| Box::new(type_desc(e))),
        },
    }
}

fn type_info(t: &TypeDesc) -> TypeInfo {
    let dims = |s: &Option<Vec<DimDesc>>| {
        s.as_ref().map(|d| {
            d.iter()
                .map(|d| match d {
                    DimDesc::Fixed(n) => Dim::Fixed(*n),
                    DimDesc::Sym(s) if s == "?" => Dim::Unknown,
                    DimDesc::Sym(s) => Dim::Symbolic(s.clone()),
                })
                .collect()
        })
    };
    let dt = |d: &Option<String>| d.as_deref().and_then(DType::from_name);
    match t {
        TypeDesc::Tensor { dtype, shape } => TypeInfo::Tensor {
            dtype: dt(dtype),
            shape: dims(shape),
        },
        TypeDesc::SparseTensor { dtype, shape } => TypeInfo::SparseTensor {
            dtype: dt(dtype),
            shape: dims(shape),
        },
        TypeDesc::Sequence { elem } => {
            TypeInfo::Sequence(elem.as_ref().map(|e| Box::new(type_info(e))))
        }
        TypeDesc::Optional { elem } => {
            TypeInfo::Optional(elem.as_ref().map(|e| Box::new(type_info(e))))
        }
        TypeDesc::Map { key, value } => TypeInfo::Map {
            key: dt(key),
            value: value.as_ref().map(|e| Box::new(type_info(e))),
        },
    }
}

fn io(v: &ValueInfo) -> IoDesc {
    IoDesc {
        name: v.name.clone(),
        ty: v.ty.as_ref().map(type_desc),
    }
}

fn body_desc(w: &mut ArtifactWriter, g: &Graph) -> Result<BodyDesc, FormatError> {
    let mut initializers = vec![];
    for i in &g.initializers {
        initializers.push((i.name.clone(), w.intern(&i.tensor)?));
    }
    let mut nodes = vec![];
    for n in &g.nodes {
        let mut attrs = vec![];
        for (k, a) in &n.attrs {
            attrs.push((k.clone(), attr_desc(w, a)?));
        }
        nodes.push(NodeDesc {
            name: n.name.clone(),
            op: n.op_type.clone(),
            domain: n.domain.clone(),
            inputs: n.inputs.clone(),
            outputs: n.outputs.clone(),
            attrs,
        });
    }
    Ok(BodyDesc {
        name: g.name.clone(),
        inputs: g.inputs.iter().map(io).collect(),
        outputs: g.outputs.iter().map(io).collect(),
        initializers,
        nodes,
    })
}

fn attr_desc(w: &mut ArtifactWriter, a: &Attr) -> Result<AttrDesc, FormatError> {
    Ok(match a {
        Attr::Float(f) => AttrDesc::Float((*f).into()),
        Attr::Int(i) => AttrDesc::Int(*i),
        Attr::String(s) => AttrDesc::String(s.clone()),
        Attr::Tensor(t) => AttrDesc::Tensor(w.intern(t)?),
        Attr::SparseTensor(t) => AttrDesc::SparseTensor(w.intern(t)?),
        Attr::Graph(g) => AttrDesc::Graph(Box::new(body_desc(w, g)?)),
        Attr::Type(t) => AttrDesc::Type(type_desc(t)),
        Attr::Floats(v) => AttrDesc::Floats(v.iter().map(|&f| f.into()).collect()),
        Attr::Ints(v) => AttrDesc::Ints(v.clone()),
        Attr::Strings(v) => AttrDesc::Strings(v.clone()),
        Attr::Tensors(v) => {
            AttrDesc::Tensors(v.iter().map(|t| w.intern(t)).collect::<Result<_, _>>()?)
        }
        Attr::SparseTensors(v) => {
            AttrDesc::SparseTensors(v.iter().map(|t| w.intern(t)).collect::<Result<_, _>>()?)
        }
        Attr::Graphs(v) => AttrDesc::Graphs(
            v.iter()
                .map(|g| body_desc(w, g))
                .collect::<Result<_, _>>()?,
        ),
        Attr::Types(v) => AttrDesc::Types(v.iter().map(type_desc).collect()),
        Attr::Ref(r) => {
            return Err(FormatError::Invalid(format!(
                "attribute reference '{r}' outside a function body; inline functions before writing"
            )))
        }
    })
}

pub(crate) fn graph_desc(
    w: &mut ArtifactWriter,
    name: &str,
    m: &Model,
    info: GraphInfo,
) -> Result<GraphDesc, FormatError> {
    if !m.functions.is_empty() {
        return Err(FormatError::Invalid(
            "model-local functions must be inlined before writing an artifact".into(),
        ));
    }
    Ok(GraphDesc {
        name: name.into(),
        opsets: m
            .opset_imports
            .iter()
            .map(|o| (o.domain.clone(), o.version))
            .collect(),
        body: body_desc(w, &m.graph)?,
        metadata: m.metadata.clone(),
        functions_inlined: true,
        info,
        kv_cache: vec![],
    })
}

fn body_graph(a: &Artifact, b: &BodyDesc) -> Result<Graph, FormatError> {
    let mut nodes = Vec::with_capacity(b.nodes.len());
    for n in &b.nodes {
        let mut attrs = vec![];
        for (k, d) in &n.attrs {
            attrs.push((k.clone(), attr(a, d)?));
        }
        nodes.push(Node {
            name: n.name.clone(),
            op_type: n.op.clone(),
            domain: n.domain.clone(),
            inputs: n.inputs.clone(),
            outputs: n.outputs.clone(),
            attrs,
            doc: String::new(),
        });
    }
    let vi = |d: &IoDesc| ValueInfo::new(d.name.clone(), d.ty.as_ref().map(type_info));
    Ok(Graph {
        name: b.name.clone(),
        nodes,
        inputs: b.inputs.iter().map(vi).collect(),
        outputs: b.outputs.iter().map(vi).collect(),
        initializers: b
            .initializers
            .iter()
            .map(|(n, i)| {
                Ok(Initializer {
                    name: n.clone(),
                    tensor: a.weight(*i)?,
                })
            })
            .collect::<Result<_, FormatError>>()?,
        value_info: vec![],
        doc: String::new(),
    })
}

fn attr(a: &Artifact, d: &AttrDesc) -> Result<Attr, FormatError> {
    Ok(match d {
        AttrDesc::Float(f) => Attr::Float(f.get()),
        AttrDesc::Int(i) => Attr::Int(*i),
        AttrDesc::String(s) => Attr::String(s.clone()),
        AttrDesc::Tensor(i) => Attr::Tensor(a.weight(*i)?),
        AttrDesc::SparseTensor(i) => Attr::SparseTensor(a.weight(*i)?),
        AttrDesc::Graph(b) => Attr::Graph(Box::new(body_graph(a, b)?)),
        AttrDesc::Type(t) => Attr::Type(type_info(t)),
        AttrDesc::Floats(v) => Attr::Floats(v.iter().map(|f| f.get()).collect()),
        AttrDesc::Ints(v) => Attr::Ints(v.clone()),
        AttrDesc::Strings(v) => Attr::Strings(v.clone()),
        AttrDesc::Tensors(v) => {
            Attr::Tensors(v.iter().map(|i| a.weight(*i)).collect::<Result<_, _>>()?)
        }
        AttrDesc::SparseTensors(v) => {
            Attr::SparseTensors(v.iter().map(|i| a.weight(*i)).collect::<Result<_, _>>()?)
        }
        AttrDesc::Graphs(v) => Attr::Graphs(
            v.iter()
                .map(|b| body_graph(a, b))
                .collect::<Result<_, _>>()?,
        ),
        AttrDesc::Types(v) => Attr::Types(v.iter().map(type_info).collect()),
    })
}

pub(crate) fn model_from_desc(a: &Artifact, g: &GraphDesc) -> Result<Model, FormatError> {
    Ok(Model {
        ir_version: 10,
        opset_imports: g
            .opsets
            .iter()
            .map(|(d, v)| OpsetImport {
                domain: d.clone(),
                version: *v,
            })
            .collect(),
        producer_name: a.meta.producer.clone(),
        producer_version: a.meta.producer_version.clone(),
        graph: body_graph(a, &g.body)?,
        metadata: g.metadata.clone(),
        ..Default::default()
    })
}
