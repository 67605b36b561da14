//! Inference rules for the ONNX default domain (elementwise, shape manipulation, reductions,
//! quantization, sequences) and the few other-domain ops npuc meets. Convolution-like, pooling,
//! recurrent and attention ops live in `nn`.

use super::ctx::{NodeIn, R};
use super::util::*;
use super::value::{self, Known, Scalar, MAX_FOLD};
use super::{nn, tensor_type, Out, Outcome};
use crate::dtype::DType;
use crate::graph::{Attr, Dim, TypeInfo};

pub fn infer(n: &NodeIn) -> Outcome {
    let r = match n.node.domain.as_str() {
        "" => default_domain(n),
        "ai.onnx.preview.training" => training(n),
        "ai.onnx.ml" => ml(n),
        "ai.onnx.preview" => match n.op() {
            "FlexAttention" => Some(nn::flex_attention(n)),
            _ => None,
        },
        "com.microsoft" => match n.op() {
            "DynamicQuantizeLSTM" => Some(nn::rnn(n)),
            "RotaryEmbedding" => Some(same(n, 0)),
            "Attention" => Some(super::contrib::attention(n)),
            "MultiHeadAttention" => Some(super::contrib::multi_head_attention(n)),
            "GroupQueryAttention" => Some(super::contrib::group_query_attention(n)),
            "EmbedLayerNormalization" => Some(super::contrib::embed_layer_normalization(n)),
            _ => None,
        },
        _ => None,
    };
    // Ops defined outside ONNX (the `npuc` domain) carry their rule in their definition.
    let r = r.or_else(|| {
        crate::opdef::lookup(&n.node.domain, n.op())
            .map(|def| (def.infer)(n).map(|tys| tys.into_iter().map(Out::ty).collect()))
    });
    match r {
        None => Outcome::NotCovered,
        Some(Ok(v)) => Outcome::Done(v),
        Some(Err(e)) => Outcome::Failed(e),
    }
}

/// Output type equal to input `i`'s (any kind of type).
fn same(n: &NodeIn, i: usize) -> R<Vec<Out>> {
    n.need(i)?;
    Ok(vec![Out::ty(
        n.ty(i).cloned().unwrap_or_else(super::unknown),
    )])
}

/// Same shape as input `i`, given dtype.
fn same_shape(n: &NodeIn, i: usize, dtype: Option<DType>) -> Out {
    Out::ty(tt(dtype, n.shape(i).map(|s| s.to_vec())))
}

fn one(o: Out) -> R<Vec<Out>> {
    Ok(vec![o])
}

const UNARY_SAME: &[&str] = &[
    "Abs",
    "Neg",
    "Ceil",
    "Floor",
    "Round",
    "Sqrt",
    "Reciprocal",
    "Exp",
    "Log",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Sigmoid",
    "HardSigmoid",
    "Relu",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "Softplus",
    "Softsign",
    "ThresholdedRelu",
    "HardSwish",
    "Mish",
    "Gelu",
    "Erf",
    "Sign",
    "Tanh",
    "Shrink",
    "BitwiseNot",
    "Not",
    "Clip",
    "Swish",
    "LpNormalization",
    "MeanVarianceNormalization",
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "CumSum",
    "CumProd",
    "Trilu",
    "ReverseSequence",
    "LRN",
    "InstanceNormalization",
    "GroupNormalization",
    "RMSNormalization",
    "RotaryEmbedding",
    "ScatterElements",
    "ScatterND",
    "Scatter",
    "TensorScatter",
    "PRelu",
];

pub(crate) fn default_domain(n: &NodeIn) -> Option<R<Vec<Out>>> {
    let op = n.op();
    if UNARY_SAME.contains(&op) {
        return Some(unary_same(n));
    }
    Some(match op {
        "Identity" => same(n, 0),
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Mod" | "BitShift" | "BitwiseAnd" | "BitwiseOr"
        | "BitwiseXor" => binary(n),
        "Sum" | "Mean" | "Max" | "Min" => variadic(n),
        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor" => {
            logic(n)
        }
        "IsNaN" | "IsInf" | "RegexFullMatch" => {
            n.need(0).map(|_| vec![same_shape(n, 0, Some(DType::Bool))])
        }
        "StringConcat" => {
            bcast_all(&[n.shape(0), n.shape(1)]).map(|s| vec![Out::ty(tt(Some(DType::String), s))])
        }
        "StringSplit" => Ok(vec![
            Out::ty(tt(
                Some(DType::String),
                n.shape(0).map(|s| {
                    let mut v = s.to_vec();
                    v.push(Dim::Unknown);
                    v
                }),
            )),
            same_shape(n, 0, Some(DType::I64)),
        ]),
        "Where" => where_op(n),
        "Cast" => cast(n),
        "CastLike" => cast_like(n),
        "BitCast" => n
            .dtype_attr("to")
            .map(|d| vec![same_shape(n, 0, d.flatten())]),
        "Dropout" => Ok(vec![
            same_shape(n, 0, n.dt(0)),
            same_shape(n, 0, Some(DType::Bool)),
        ]),
        "Shape" => shape_op(n),
        "Size" => size_op(n),
        "Constant" => constant(n),
        "ConstantOfShape" => constant_of_shape(n),
        "EyeLike" => n
            .dtype_attr("dtype")
            .map(|d| vec![same_shape(n, 0, d.unwrap_or(n.dt(0)))]),
        "Range" => range(n),
        "Reshape" => reshape(n),
        "Flatten" => flatten(n),
        "Transpose" => transpose(n),
        "Squeeze" => squeeze(n),
        "Unsqueeze" => unsqueeze(n),
        "Concat" => concat(n),
        "Split" => split(n),
        "Slice" => slice(n),
        "Gather" => gather(n),
        "GatherElements" => n
            .need(1)
            .map(|_| vec![Out::ty(tt(n.dt(0), n.shape(1).map(|s| s.to_vec())))]),
        "GatherND" => gather_nd(n),
        "Expand" => expand(n),
        "Tile" => tile(n),
        "Pad" => pad(n),
        "OneHot" => one_hot(n),
        "TopK" => topk(n),
        "ArgMax" | "ArgMin" => arg_reduce(n),
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
        | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceSumSquare" => reduce(n),
        "LayerNormalization" => layer_norm(n),
        "BatchNormalization" => batch_norm(n),
        "MatMul" => matmul(n, n.dt(0)),
        "MatMulInteger" => matmul(n, Some(DType::I32)),
        "QLinearMatMul" => qlinear_matmul(n),
        "Gemm" => gemm(n),
        "Einsum" => einsum(n),
        "QuantizeLinear" => quantize(n),
        "DequantizeLinear" => dequantize(n),
        "DynamicQuantizeLinear" => Ok(vec![
            same_shape(n, 0, Some(DType::U8)),
            Out::ty(tt(Some(DType::F32), Some(vec![]))),
            Out::ty(tt(Some(DType::U8), Some(vec![]))),
        ]),
        "NonZero" => non_zero(n),
        "Compress" => compress(n),
        "Unique" => unique(n),
        "NonMaxSuppression" => one(Out::ty(tt(
            Some(DType::I64),
            Some(vec![Dim::Unknown, Dim::Fixed(3)]),
        ))),
        "Det" => n.need(0).map(|_| {
            let s = n
                .shape(0)
                .and_then(|s| (s.len() >= 2).then(|| s[..s.len() - 2].to_vec()));
            vec![Out::ty(tt(n.dt(0), s))]
        }),
        "Bernoulli" => n
            .dtype_attr("dtype")
            .map(|d| vec![same_shape(n, 0, d.unwrap_or(n.dt(0)))]),
        "RandomNormalLike" | "RandomUniformLike" => n
            .dtype_attr("dtype")
            .map(|d| vec![same_shape(n, 0, d.unwrap_or(n.dt(0)))]),
        "RandomNormal" | "RandomUniform" => random(n),
        "Multinomial" => multinomial(n),
        "HannWindow" | "HammingWindow" | "BlackmanWindow" => window(n),
        "MelWeightMatrix" => mel(n),
        "DFT" => nn::dft(n),
        "STFT" => nn::stft(n),
        "Conv" | "ConvInteger" | "QLinearConv" | "DeformConv" => nn::conv(n),
        "ConvTranspose" => nn::conv_transpose(n),
        "MaxPool" | "AveragePool" | "LpPool" => nn::pool(n),
        "GlobalAveragePool" | "GlobalMaxPool" | "GlobalLpPool" => nn::global_pool(n),
        "MaxUnpool" => nn::max_unpool(n),
        "MaxRoiPool" | "RoiAlign" => nn::roi(n),
        "Resize" | "Upsample" => nn::resize(n),
        "DepthToSpace" | "SpaceToDepth" => nn::depth_space(n),
        "GridSample" => nn::grid_sample(n),
        "AffineGrid" => nn::affine_grid(n),
        "Col2Im" => nn::col2im(n),
        "CenterCropPad" => nn::center_crop_pad(n),
        "RNN" => nn::rnn(n),
        "GRU" => nn::rnn(n),
        "LSTM" => nn::rnn(n),
        "Attention" => nn::attention(n),
        "LinearAttention" => nn::linear_attention(n),
        "CausalConvWithState" => nn::causal_conv_with_state(n),
        "TfIdfVectorizer" => tfidf(n),
        "StringNormalizer" => string_normalizer(n),
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" => nn::loss(n),
        "SequenceEmpty" => n.dtype_attr("dtype").map(|d| {
            vec![Out::ty(TypeInfo::Sequence(Some(Box::new(tt(
                d.unwrap_or(Some(DType::F32)),
                None,
            )))))]
        }),
        "SequenceConstruct" => sequence_construct(n),
        "SequenceInsert" => sequence_insert(n),
        "SequenceErase" => same(n, 0),
        "SequenceAt" => n.need(0).map(|_| {
            vec![Out::ty(match n.ty(0) {
                Some(TypeInfo::Sequence(Some(e))) => (**e).clone(),
                _ => super::unknown(),
            })]
        }),
        "SequenceLength" => one(Out::ty(tt(Some(DType::I64), Some(vec![])))),
        "SplitToSequence" => split_to_sequence(n),
        "ConcatFromSequence" => concat_from_sequence(n),
        "Optional" => optional(n),
        "OptionalHasElement" => one(Out::ty(tt(Some(DType::Bool), Some(vec![])))),
        "OptionalGetElement" => n.need(0).map(|_| {
            vec![Out::ty(match n.ty(0) {
                Some(TypeInfo::Optional(Some(e))) => (**e).clone(),
                Some(TypeInfo::Optional(None)) | None => super::unknown(),
                Some(other) => other.clone(),
            })]
        }),
        _ => return None,
    })
}

/// The ai.onnx.ml ops whose output shapes follow from attributes and input shapes.
fn ml(n: &NodeIn) -> Option<R<Vec<Out>>> {
    Some(match n.op() {
        "Binarizer" => same(n, 0),
        "LabelEncoder" => {
            let dt = if n.has_attr("values_strings") {
                Some(DType::String)
            } else if n.has_attr("values_int64s") {
                Some(DType::I64)
            } else if n.has_attr("values_floats") {
                Some(DType::F32)
            } else {
                match n.tensor_attr("values_tensor") {
                    Ok(t) => t.map(|t| t.dtype()),
                    Err(e) => return Some(Err(e)),
                }
            };
            n.need(0).map(|_| vec![same_shape(n, 0, dt)])
        }
        "ArrayFeatureExtractor" => {
            let add = n.shape(1).map(|s| match s {
                [one, k] if *one == Dim::Fixed(1) => k.clone(),
                [k] => k.clone(),
                s => dim_prod(s),
            });
            let dims = match (n.shape(0), add) {
                (Some([]), _) => return Some(Err("data must not be a scalar".into())),
                (Some([_]), Some(a)) => Some(vec![Dim::Fixed(1), a]),
                (Some(s), Some(a)) => {
                    let mut d = s[..s.len() - 1].to_vec();
                    d.push(a);
                    Some(d)
                }
                _ => None,
            };
            one(Out::ty(tt(n.dt(0), dims)))
        }
        "TreeEnsemble" => {
            let targets = match n.int_attr("n_targets") {
                Ok(t) => t.and_then(|t| usize::try_from(t).ok()),
                Err(e) => return Some(Err(e)),
            };
            let batch = n.shape(0).and_then(|s| s.first().cloned());
            one(Out::ty(tt(
                n.dt(0),
                Some(vec![
                    batch.unwrap_or(Dim::Unknown),
                    targets.map_or(Dim::Unknown, Dim::Fixed),
                ]),
            )))
        }
        _ => return None,
    })
}

fn tfidf(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let idx = n
        .ints_attr("ngram_indexes")?
        .ok_or("required attribute 'ngram_indexes' is missing")?;
    let c = idx
        .iter()
        .copied()
        .max()
        .and_then(|m| m.checked_add(1))
        .and_then(|m| usize::try_from(m).ok())
        .unwrap_or(0);
    let dims = match n.shape(0) {
        Some([_]) => Some(vec![Dim::Fixed(c)]),
        Some([b, _]) => Some(vec![b.clone(), Dim::Fixed(c)]),
        Some(s) => return Err(format!("input rank {} is not 1 or 2", s.len())),
        None => None,
    };
    one(Out::ty(tt(Some(DType::F32), dims)))
}

fn string_normalizer(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let stops = matches!(n.attr("stopwords"), Some(Attr::Strings(v)) if !v.is_empty());
    // Stopword removal makes the length data-dependent.
    let dims = n.shape(0).map(|s| {
        let mut d = s.to_vec();
        if stops {
            if let Some(last) = d.last_mut() {
                *last = Dim::Unknown;
            }
        }
        d
    });
    one(Out::ty(tt(Some(DType::String), dims)))
}

fn training(n: &NodeIn) -> Option<R<Vec<Out>>> {
    // Inputs: R, T, then groups of n tensors; outputs are groups of n tensors, each typed like
    // one input group (Adagrad/Momentum: X, G, H|V -> X, H|V; Adam: X, G, V, H -> X, V, H).
    let (in_groups, out_map): (usize, &[usize]) = match n.op() {
        "Adagrad" | "Momentum" => (3, &[0, 2]),
        "Adam" => (4, &[0, 2, 3]),
        _ => return None,
    };
    let total = n.n_in().saturating_sub(2);
    if !total.is_multiple_of(in_groups) {
        return Some(Err(format!(
            "expects 2 + {in_groups}*n inputs, found {}",
            n.n_in()
        )));
    }
    let k = total / in_groups;
    let mut outs = vec![];
    for &g in out_map {
        for j in 0..k {
            let i = 2 + g * k + j;
            outs.push(Out::ty(n.ty(i).cloned().unwrap_or_else(super::unknown)));
        }
    }
    Some(Ok(outs))
}

fn unary_same(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    if let (Some(v), Some(dt)) = (n.val(0), n.dt(0)) {
        let op = n.op();
        let data: Vec<Scalar> = v.data.iter().map(|s| value::unary(op, dt, s)).collect();
        if data.iter().any(|s| *s != Scalar::Unknown) {
            if let Some(k) = Known::new(dt, v.shape.clone(), data) {
                return one(Out::known(k));
            }
        }
    }
    one(same_shape(n, 0, n.dt(0)))
}

fn binary(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let op = n.op();
    let shape = bcast_all(&[n.shape(0), n.shape(1)])?;
    let dt = n.dt(0).or(if op == "Pow" { None } else { n.dt(1) });
    if let (Some(a), Some(b), Some(d)) = (n.val(0), n.val(1), dt) {
        let fmod = n.int_or("fmod", 0)? != 0;
        let f = |s: &[&Scalar]| value::arith(op, d, s[0], s[1], fmod);
        if let Some(k) = value::broadcast_map(&[a, b], d, f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(dt, shape)))
}

fn variadic(n: &NodeIn) -> R<Vec<Out>> {
    if n.n_in() == 0 {
        return Err("needs at least one input".into());
    }
    let shapes: Vec<Option<&[Dim]>> = (0..n.n_in()).map(|i| n.shape(i)).collect();
    let shape = bcast_all(&shapes)?;
    let dt = (0..n.n_in()).find_map(|i| n.dt(i));
    let op = match n.op() {
        "Sum" => "Add",
        "Max" => "Max",
        "Min" => "Min",
        _ => "",
    };
    if let Some(d) = dt {
        let vals: Option<Vec<&Known>> = (0..n.n_in()).map(|i| n.val(i)).collect();
        if let (Some(vals), false) = (vals, op.is_empty()) {
            let f = |s: &[&Scalar]| {
                s.iter()
                    .skip(1)
                    .fold(s[0].clone(), |acc, x| value::arith(op, d, &acc, x, false))
            };
            if let Some(k) = value::broadcast_map(&vals, d, f) {
                return one(Out::known(k));
            }
        }
    }
    one(Out::ty(tt(dt, shape)))
}

fn logic(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let op = n.op();
    let shape = bcast_all(&[n.shape(0), n.shape(1)])?;
    if let (Some(a), Some(b)) = (n.val(0), n.val(1)) {
        let f = |s: &[&Scalar]| match op {
            "And" | "Or" | "Xor" => match (s[0], s[1]) {
                (Scalar::Int(x), Scalar::Int(y)) => {
                    let (x, y) = (*x != 0, *y != 0);
                    Scalar::Int(match op {
                        "And" => x && y,
                        "Or" => x || y,
                        _ => x != y,
                    } as i64)
                }
                _ => Scalar::Unknown,
            },
            _ => value::compare(op, s[0], s[1]),
        };
        if let Some(k) = value::broadcast_map(&[a, b], DType::Bool, f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(Some(DType::Bool), shape)))
}

fn where_op(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let shape = bcast_all(&[n.shape(0), n.shape(1), n.shape(2)])?;
    let dt = n.dt(1).or(n.dt(2));
    if let (Some(c), Some(x), Some(y), Some(d)) = (n.val(0), n.val(1), n.val(2), dt) {
        let f = |s: &[&Scalar]| match s[0] {
            Scalar::Int(0) => s[2].clone(),
            Scalar::Int(_) => s[1].clone(),
            _ => Scalar::Unknown,
        };
        if let Some(k) = value::broadcast_map(&[c, x, y], d, f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(dt, shape)))
}

fn cast(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let to = n
        .dtype_attr("to")?
        .ok_or("required attribute 'to' is missing")?;
    if let (Some(v), Some(d)) = (n.val(0), to) {
        if let Some(k) = v.cast(d) {
            return one(Out::known(k));
        }
    }
    one(same_shape(n, 0, to))
}

fn cast_like(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let to = n.dt(1);
    if let (Some(v), Some(d)) = (n.val(0), to) {
        if let Some(k) = v.cast(d) {
            return one(Out::known(k));
        }
    }
    one(same_shape(n, 0, to))
}

/// Clamps a Shape start/end attribute into [0, rank].
fn clamp_index(i: i64, rank: usize) -> usize {
    let r = rank as i64;
    let v = if i < 0 { i.saturating_add(r) } else { i };
    v.clamp(0, r) as usize
}

fn shape_op(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(Some(DType::I64), Some(vec![Dim::Unknown]))));
    };
    let start = clamp_index(n.int_or("start", 0)?, s.len());
    let end = match n.int_attr("end")? {
        Some(e) => clamp_index(e, s.len()),
        None => s.len(),
    };
    let dims = if start < end { &s[start..end] } else { &[][..] };
    let k = Known::i64_vec(dims.iter().map(Scalar::from_dim).collect())
        .ok_or("shape is too long to track")?;
    one(Out::known(k))
}

fn size_op(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let total = n.shape(0).map(dim_prod);
    if let Some(Dim::Fixed(t)) = total {
        let t = i64::try_from(t).map_err(|_| "element count overflows int64")?;
        if let Some(k) = Known::ints(DType::I64, vec![], &[t]) {
            return one(Out::known(k));
        }
    }
    let mut o = Out::ty(tt(Some(DType::I64), Some(vec![])));
    if let Some(Dim::Symbolic(s)) = total {
        o.val = Known::new(DType::I64, vec![], vec![Scalar::Sym(s)]);
    }
    one(o)
}

fn constant(n: &NodeIn) -> R<Vec<Out>> {
    if let Some(t) = n.tensor_attr("value")?.or(n.tensor_attr("sparse_value")?) {
        return one(match Known::from_tensor(t) {
            Some(k) => Out::known(k),
            None => Out::ty(tensor_type(t)),
        });
    }
    let scalar = |d: DType| tt(Some(d), Some(vec![]));
    let vector = |d: DType, len: usize| tt(Some(d), Some(vec![Dim::Fixed(len)]));
    if let Some(f) = n.float_attr("value_float")? {
        let k = Known::new(DType::F32, vec![], vec![Scalar::Float(f as f64)]);
        return one(k.map_or(Out::ty(scalar(DType::F32)), Out::known));
    }
    if let Some(v) = n.floats_attr("value_floats")? {
        let k = Known::new(
            DType::F32,
            vec![v.len()],
            v.iter().map(|&f| Scalar::Float(f as f64)).collect(),
        );
        return one(k.map_or(Out::ty(vector(DType::F32, v.len())), Out::known));
    }
    if let Some(i) = n.int_attr("value_int")? {
        let k = Known::ints(DType::I64, vec![], &[i]);
        return one(k.map_or(Out::ty(scalar(DType::I64)), Out::known));
    }
    if let Some(v) = n.ints_attr("value_ints")? {
        let k = Known::ints(DType::I64, vec![v.len()], v);
        return one(k.map_or(Out::ty(vector(DType::I64, v.len())), Out::known));
    }
    if n.has_attr("value_string") {
        return one(Out::ty(scalar(DType::String)));
    }
    if let Some(Attr::Strings(v)) = n.attr("value_strings") {
        return one(Out::ty(vector(DType::String, v.len())));
    }
    Err("has no value attribute".into())
}

fn constant_of_shape(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let fill = n.tensor_attr("value")?;
    let dt = fill.map_or(DType::F32, |t| t.dtype());
    let Some(target) = n.val(0) else {
        let rank = rank_from_len(n.shape(0));
        return one(Out::ty(tt(Some(dt), rank.map(|r| vec![Dim::Unknown; r]))));
    };
    let dims = value::to_dims(target);
    if let Some(ints) = target.as_ints() {
        let sizes = non_neg(&ints, "the target shape")?;
        let elem = match fill.and_then(Known::from_tensor) {
            Some(k) => k.data.first().cloned().unwrap_or(Scalar::Unknown),
            None if fill.is_none() => Scalar::Float(0.0),
            None => Scalar::Unknown,
        };
        if let Some(total) = value::checked_numel(&sizes).filter(|&t| t <= MAX_FOLD) {
            if let Some(k) = Known::new(dt, sizes.clone(), vec![elem; total]) {
                return one(Out::known(k));
            }
        }
        return one(Out::ty(TypeInfo::tensor(dt, &sizes)));
    }
    one(Out::ty(tt(Some(dt), Some(dims))))
}

fn range(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let dt = n.dt(0).or(n.dt(1)).or(n.dt(2));
    let vals: Option<Vec<Scalar>> = (0..3).map(|i| n.val(i)?.single().cloned()).collect();
    let unknown = || one(Out::ty(tt(dt, Some(vec![Dim::Unknown]))));
    let (Some(vals), Some(d)) = (vals, dt) else {
        return unknown();
    };
    let count: usize = match (&vals[0], &vals[1], &vals[2]) {
        (Scalar::Int(s), Scalar::Int(l), Scalar::Int(dl)) => {
            if *dl == 0 {
                return Err("delta is zero".into());
            }
            let span = (*l as i128) - (*s as i128);
            let dl = *dl as i128;
            // ceil(span / dl) for either sign of dl.
            let q = span / dl + i128::from(span % dl != 0 && ((span < 0) == (dl < 0)));
            usize::try_from(q.max(0)).map_err(|_| "range is too long")?
        }
        (a, b, c) => {
            let (Some(s), Some(l), Some(dl)) = (a.as_f64(), b.as_f64(), c.as_f64()) else {
                return unknown();
            };
            if dl == 0.0 {
                return Err("delta is zero".into());
            }
            let q = ((l - s) / dl).ceil();
            if !q.is_finite() || q > 1e15 {
                return Err("range is too long".into());
            }
            q.max(0.0) as usize
        }
    };
    if count <= MAX_FOLD {
        let data: Vec<Scalar> = (0..count)
            .map(|i| match (&vals[0], &vals[2]) {
                (Scalar::Int(s), Scalar::Int(dl)) => (i as i64)
                    .checked_mul(*dl)
                    .and_then(|x| x.checked_add(*s))
                    .map_or(Scalar::Unknown, |v| value::wrap_int(d, v)),
                (s, dl) => match (s.as_f64(), dl.as_f64()) {
                    (Some(s), Some(dl)) => value::cast_scalar(&Scalar::Float(s + i as f64 * dl), d),
                    _ => Scalar::Unknown,
                },
            })
            .collect();
        if let Some(k) = Known::new(d, vec![count], data) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(TypeInfo::tensor(d, &[count])))
}

/// Resolves a Reshape target against the input shape.
pub(crate) fn reshape_dims(input: Option<&[Dim]>, target: &Known, allowzero: bool) -> R<Vec<Dim>> {
    let mut out: Vec<Dim> = Vec::with_capacity(target.len());
    let mut infer_at: Option<usize> = None;
    for (i, s) in target.data.iter().enumerate() {
        let d = match s {
            Scalar::Int(-1) => {
                if infer_at.replace(i).is_some() {
                    return Err("the target shape has more than one -1".into());
                }
                Dim::Unknown
            }
            Scalar::Int(0) if !allowzero => match input {
                Some(sh) => sh.get(i).cloned().ok_or_else(|| {
                    format!("target dim {i} copies an input dim that does not exist")
                })?,
                None => Dim::Unknown,
            },
            Scalar::Int(v) if *v < 0 => {
                return Err(format!("the target shape has invalid value {v}"));
            }
            other => other.to_dim(),
        };
        out.push(d);
    }
    if let (Some(at), Some(inp)) = (infer_at, input) {
        // Cancel symbolic dims appearing on both sides, then divide the fixed products.
        let mut rest_in: Vec<&Dim> = inp.iter().collect();
        let mut rest_out_fixed = 1usize;
        let mut ok = true;
        for (i, d) in out.iter().enumerate() {
            if i == at {
                continue;
            }
            match d {
                Dim::Fixed(x) => {
                    rest_out_fixed = rest_out_fixed.checked_mul(*x).ok_or("shape overflows")?
                }
                Dim::Symbolic(_) => match rest_in.iter().position(|e| *e == d) {
                    Some(p) => {
                        rest_in.remove(p);
                    }
                    None => ok = false,
                },
                Dim::Unknown => ok = false,
            }
        }
        let in_fixed = all_fixed(&rest_in.into_iter().cloned().collect::<Vec<_>>());
        if let (true, Some(f)) = (ok, in_fixed) {
            let total = value::checked_numel(&f).ok_or("shape overflows")?;
            if rest_out_fixed == 0 {
                if total != 0 {
                    return Err("cannot infer -1 next to a zero dimension".into());
                }
            } else if total % rest_out_fixed != 0 {
                return Err(format!(
                    "cannot reshape {total} elements into a shape with a multiple of {rest_out_fixed}"
                ));
            } else {
                out[at] = Dim::Fixed(total / rest_out_fixed);
            }
        }
    } else if let (None, Some(inp)) = (infer_at, input) {
        if let (Some(a), Some(b)) = (all_fixed(inp), all_fixed(&out)) {
            let (na, nb) = (value::checked_numel(&a), value::checked_numel(&b));
            if na != nb {
                return Err(format!(
                    "cannot reshape {} elements into shape {b:?}",
                    na.map_or("too many".to_string(), |x| x.to_string())
                ));
            }
        }
    }
    Ok(out)
}

fn reshape(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let allowzero = n.int_or("allowzero", 0)? != 0;
    let target = if n.opset < 5 {
        n.ints_attr("shape")?
            .and_then(|v| Known::ints(DType::I64, vec![v.len()], v))
    } else {
        n.need(1)?;
        n.val(1).cloned()
    };
    let Some(target) = target else {
        let rank = rank_from_len(n.shape(1));
        return one(Out::ty(tt(n.dt(0), rank.map(|r| vec![Dim::Unknown; r]))));
    };
    let dims = reshape_dims(n.shape(0), &target, allowzero)?;
    if let (Some(v), Some(f)) = (n.val(0), all_fixed(&dims)) {
        if let Some(k) = v.reshaped(f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn flatten(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), Some(vec![Dim::Unknown; 2]))));
    };
    let a = n.int_or("axis", 1)?;
    let r = s.len() as i64;
    let a = if a < 0 { a + r } else { a };
    if a < 0 || a > r {
        return Err(format!("axis {a} is out of range for rank {r}"));
    }
    let a = a as usize;
    let dims = vec![dim_prod(&s[..a]), dim_prod(&s[a..])];
    if let (Some(v), Some(f)) = (n.val(0), all_fixed(&dims)) {
        if let Some(k) = v.reshaped(f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn transpose(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let perm = n.ints_attr("perm")?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(
            n.dt(0),
            perm.map(|p| vec![Dim::Unknown; p.len()]),
        )));
    };
    let perm: Vec<usize> = match perm {
        Some(p) => {
            if p.len() != s.len() {
                return Err(format!("perm has {} entries for rank {}", p.len(), s.len()));
            }
            axes(p, s.len())?
        }
        None => (0..s.len()).rev().collect(),
    };
    let dims: Vec<Dim> = perm.iter().map(|&p| s[p].clone()).collect();
    if let Some(v) = n.val(0) {
        let st = value::strides(&v.shape);
        let out_shape: Vec<usize> = perm.iter().map(|&p| v.shape[p]).collect();
        let ost = value::strides(&out_shape);
        let data = (0..v.len())
            .map(|flat| {
                let mut src = 0;
                for (i, &p) in perm.iter().enumerate() {
                    src += (flat / ost[i]) % out_shape[i].max(1) * st[p];
                }
                v.data.get(src).cloned().unwrap_or(Scalar::Unknown)
            })
            .collect();
        if let Some(k) = Known::new(v.dtype, out_shape, data) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

/// Axes from the `axes` attribute (older opsets) or from input `i`. `Ok(None)` when given as
/// an input whose value is not known; `Ok(Some(None))` when not given at all.
fn axes_arg(n: &NodeIn, i: usize) -> R<Option<Option<Vec<i64>>>> {
    if let Some(a) = n.ints_attr("axes")? {
        return Ok(Some(Some(a.to_vec())));
    }
    if n.has(i) {
        return Ok(n.ints(i).map(Some));
    }
    Ok(Some(None))
}

fn squeeze(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(ax) = axes_arg(n, 1)? else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let keep: Vec<bool> = match ax {
        Some(a) => {
            let a = axes(&a, s.len())?;
            for &i in &a {
                if let Dim::Fixed(d) = s[i] {
                    if d != 1 {
                        return Err(format!("cannot squeeze axis {i} of size {d}"));
                    }
                }
            }
            (0..s.len()).map(|i| !a.contains(&i)).collect()
        }
        None => {
            if s.iter().any(|d| !matches!(d, Dim::Fixed(_))) {
                return one(Out::ty(tt(n.dt(0), None)));
            }
            s.iter().map(|d| *d != Dim::Fixed(1)).collect()
        }
    };
    let dims: Vec<Dim> = s
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(d, _)| d.clone())
        .collect();
    fold_reshape(n, dims)
}

/// Output of a pure re-view (Squeeze/Unsqueeze): folds the value when it is known.
fn fold_reshape(n: &NodeIn, dims: Vec<Dim>) -> R<Vec<Out>> {
    if let (Some(v), Some(f)) = (n.val(0), all_fixed(&dims)) {
        if let Some(k) = v.reshaped(f) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn unsqueeze(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(Some(ax)) = axes_arg(n, 1)? else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let r = s.len() + ax.len();
    let ax = axes(&ax, r)?;
    let mut it = s.iter();
    let dims: Vec<Dim> = (0..r)
        .map(|i| {
            if ax.contains(&i) {
                Dim::Fixed(1)
            } else {
                it.next().cloned().unwrap_or(Dim::Unknown)
            }
        })
        .collect();
    fold_reshape(n, dims)
}

/// Picks `idx` along `axis` of a known value.
fn take_axis(k: &Known, axis: usize, idx: &[usize]) -> Option<Known> {
    let outer: usize = k.shape[..axis].iter().product();
    let inner: usize = k.shape[axis + 1..].iter().product();
    let d = k.shape[axis];
    let total = outer.checked_mul(idx.len())?.checked_mul(inner)?;
    if total > MAX_FOLD {
        return None;
    }
    let mut data = Vec::with_capacity(total);
    for o in 0..outer {
        for &i in idx {
            if i >= d {
                return None;
            }
            let base = (o * d + i) * inner;
            data.extend_from_slice(k.data.get(base..base + inner)?);
        }
    }
    let mut shape = k.shape.clone();
    shape[axis] = idx.len();
    Known::new(k.dtype, shape, data)
}

fn concat(n: &NodeIn) -> R<Vec<Out>> {
    if n.n_in() == 0 {
        return Err("needs at least one input".into());
    }
    let a = n.int_req("axis")?;
    let dt = (0..n.n_in()).find_map(|i| n.dt(i));
    let shapes: Option<Vec<&[Dim]>> = (0..n.n_in()).map(|i| n.shape(i)).collect();
    let Some(shapes) = shapes else {
        let rank = (0..n.n_in()).find_map(|i| n.rank(i));
        return one(Out::ty(tt(dt, rank.map(|r| vec![Dim::Unknown; r]))));
    };
    let r = shapes[0].len();
    if shapes.iter().any(|s| s.len() != r) {
        return Err("inputs have different ranks".into());
    }
    let ax = axis(a, r)?;
    let mut dims = shapes[0].to_vec();
    for s in &shapes[1..] {
        for i in 0..r {
            dims[i] = if i == ax {
                dim_sum(&dims[i], &s[i])
            } else {
                unify_dim(&dims[i], &s[i]).map_err(|e| format!("dim {i}: {e}"))?
            };
        }
    }
    let vals: Option<Vec<&Known>> = (0..n.n_in()).map(|i| n.val(i)).collect();
    if let (Some(vals), Some(f), Some(d)) = (vals, all_fixed(&dims), dt) {
        let outer = value::checked_numel(&f[..ax]).filter(|&o| o <= MAX_FOLD);
        let mut data = Vec::new();
        let outer = outer.unwrap_or(0);
        for o in 0..outer {
            for v in &vals {
                let chunk: usize = v.shape[ax..].iter().product();
                if let Some(c) = v.data.get(o * chunk..(o + 1) * chunk) {
                    data.extend_from_slice(c);
                }
            }
        }
        if let Some(k) = Known::new(d, f, data) {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(dt, Some(dims))))
}

fn split(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let k = n.n_out();
    let sizes: Option<Vec<i64>> = if let Some(s) = n.ints_attr("split")? {
        Some(s.to_vec())
    } else if n.has(1) {
        match n.ints(1) {
            Some(v) => Some(v),
            None => {
                return Ok((0..k)
                    .map(|_| Out::ty(tt(n.dt(0), n.rank(0).map(|r| vec![Dim::Unknown; r]))))
                    .collect())
            }
        }
    } else {
        None
    };
    let Some(s) = n.shape(0) else {
        return Ok((0..k).map(|_| Out::ty(tt(n.dt(0), None))).collect());
    };
    let ax = axis(n.int_or("axis", 0)?, s.len())?;
    let parts: Vec<Dim> = match sizes {
        Some(v) => {
            if v.len() != k {
                return Err(format!("split has {} sizes for {k} outputs", v.len()));
            }
            let v = non_neg(&v, "split")?;
            if let Dim::Fixed(d) = s[ax] {
                if v.iter().sum::<usize>() != d {
                    return Err(format!("split sizes {v:?} do not sum to {d}"));
                }
            }
            v.into_iter().map(Dim::Fixed).collect()
        }
        None => {
            let num = match n.int_attr("num_outputs")? {
                Some(m) => usize::try_from(m).map_err(|_| "num_outputs is negative")?,
                None => k,
            };
            if num == 0 || num != k {
                return Err(format!("splits into {num} parts for {k} outputs"));
            }
            match s[ax] {
                Dim::Fixed(d) => {
                    if n.has_attr("num_outputs") {
                        // Chunks of ceil(d/num); the last one takes the rest.
                        let c = d.div_ceil(num);
                        (0..num)
                            .map(|i| Dim::Fixed(d.saturating_sub(c * i).min(c)))
                            .collect()
                    } else {
                        if d % num != 0 {
                            return Err(format!("dim {d} does not split evenly into {num}"));
                        }
                        vec![Dim::Fixed(d / num); num]
                    }
                }
                _ => vec![Dim::Unknown; num],
            }
        }
    };
    let mut outs = vec![];
    let mut offset = 0usize;
    for p in parts.iter().take(k) {
        let mut dims = s.to_vec();
        dims[ax] = p.clone();
        let mut o = Out::ty(tt(n.dt(0), Some(dims)));
        if let (Some(v), Dim::Fixed(len)) = (n.val(0), p) {
            let idx: Vec<usize> = (offset..offset + len).collect();
            if let Some(kv) = take_axis(v, ax, &idx) {
                o = Out::known(kv);
            }
            offset += len;
        }
        outs.push(o);
    }
    Ok(outs)
}

/// Per-axis slice parameters to the selected indices (ONNX clamping rules).
fn slice_indices(d: usize, start: i64, end: i64, step: i64) -> R<Vec<usize>> {
    if step == 0 {
        return Err("slice step is zero".into());
    }
    let d = d as i128;
    let (mut s, mut e) = (start as i128, end as i128);
    if s < 0 {
        s += d;
    }
    if e < 0 {
        e += d;
    }
    let mut out = vec![];
    if step > 0 {
        s = s.clamp(0, d);
        e = e.clamp(0, d);
        let mut i = s;
        while i < e {
            out.push(i as usize);
            i += step as i128;
        }
    } else {
        s = s.clamp(0, d - 1);
        e = e.clamp(-1, d - 1);
        let mut i = s;
        while i > e {
            out.push(i as usize);
            i += step as i128;
        }
    }
    Ok(out)
}

fn slice_count(d: usize, start: i64, end: i64, step: i64) -> R<usize> {
    if step == 0 {
        return Err("slice step is zero".into());
    }
    let dd = d as i128;
    let (mut s, mut e) = (start as i128, end as i128);
    if s < 0 {
        s += dd;
    }
    if e < 0 {
        e += dd;
    }
    let st = step as i128;
    let n = if st > 0 {
        let (s, e) = (s.clamp(0, dd), e.clamp(0, dd));
        if e > s {
            (e - s + st - 1) / st
        } else {
            0
        }
    } else {
        let (s, e) = (s.clamp(0, dd - 1), e.clamp(-1, dd - 1));
        if s > e {
            (s - e + (-st) - 1) / (-st)
        } else {
            0
        }
    };
    usize::try_from(n).map_err(|_| "slice is too long".to_string())
}

fn slice(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let (starts, ends, ax, steps) = if n.opset < 10 {
        let s = n.ints_attr("starts")?.map(|v| v.to_vec());
        let e = n.ints_attr("ends")?.map(|v| v.to_vec());
        (
            s,
            e,
            Some(n.ints_attr("axes")?.map(|v| v.to_vec())),
            Some(None),
        )
    } else {
        n.need(1)?;
        n.need(2)?;
        let ax = if n.has(3) {
            n.ints(3).map(Some)
        } else {
            Some(None)
        };
        let st = if n.has(4) {
            n.ints(4).map(Some)
        } else {
            Some(None)
        };
        (n.ints(1), n.ints(2), ax, st)
    };
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let (Some(starts), Some(ends), Some(ax), Some(steps)) = (starts, ends, ax, steps) else {
        // Which axes change is unknown, so every dim might.
        return one(Out::ty(tt(n.dt(0), Some(vec![Dim::Unknown; s.len()]))));
    };
    if starts.len() != ends.len() {
        return Err("starts and ends differ in length".into());
    }
    let ax = match ax {
        Some(a) => axes(&a, s.len())?,
        None => (0..starts.len()).collect(),
    };
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ax.len() != starts.len() || steps.len() != starts.len() {
        return Err("starts, ends, axes and steps differ in length".into());
    }
    let mut dims = s.to_vec();
    let mut picks: Vec<(usize, Vec<usize>)> = vec![];
    for (j, &a) in ax.iter().enumerate() {
        let (st, en, sp) = (starts[j], ends[j], steps[j]);
        if sp == 0 {
            return Err("slice step is zero".into());
        }
        dims[a] = match &s[a] {
            Dim::Fixed(d) => {
                let c = slice_count(*d, st, en, sp)?;
                if c <= MAX_FOLD {
                    picks.push((a, slice_indices(*d, st, en, sp)?));
                }
                Dim::Fixed(c)
            }
            // The whole axis, whatever its length.
            other if sp == 1 && st == 0 && en >= i64::MAX / 2 => other.clone(),
            _ => Dim::Unknown,
        };
    }
    if let (Some(v), true) = (n.val(0), picks.len() == ax.len()) {
        let mut cur = Some(v.clone());
        for (a, idx) in &picks {
            cur = cur.and_then(|c| take_axis(&c, *a, idx));
        }
        if let Some(k) = cur {
            return one(Out::known(k));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn gather(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let (Some(ds), Some(is)) = (n.shape(0), n.shape(1)) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let ax = axis(n.int_or("axis", 0)?, ds.len())?;
    let mut dims = ds[..ax].to_vec();
    dims.extend_from_slice(is);
    dims.extend_from_slice(&ds[ax + 1..]);
    if let (Some(v), Some(ix)) = (n.val(0), n.val(1)) {
        if let Some(ix) = ix.as_ints() {
            let d = v.shape[ax] as i64;
            let mut idx = Vec::with_capacity(ix.len());
            for i in ix {
                let j = if i < 0 { i + d } else { i };
                if j < 0 || j >= d {
                    return Err(format!("index {i} is out of range for axis of size {d}"));
                }
                idx.push(j as usize);
            }
            if let (Some(k), Some(f)) = (take_axis(v, ax, &idx), all_fixed(&dims)) {
                if let Some(k) = k.reshaped(f) {
                    return one(Out::known(k));
                }
            }
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn gather_nd(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let (Some(ds), Some(is)) = (n.shape(0), n.shape(1)) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let b = usize::try_from(n.int_or("batch_dims", 0)?).map_err(|_| "negative batch_dims")?;
    let Some(last) = is.last() else {
        return Err("indices must have rank at least 1".into());
    };
    let Dim::Fixed(last) = last else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    if b + last > ds.len() || b >= is.len() {
        return Err(format!(
            "indices of depth {last} with {b} batch dims exceed data rank {}",
            ds.len()
        ));
    }
    let mut dims = is[..is.len() - 1].to_vec();
    dims.extend_from_slice(&ds[b + last..]);
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn expand(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let Some(t) = n.val(1) else {
        let len = rank_from_len(n.shape(1));
        let rank = match (len, n.rank(0)) {
            (Some(l), Some(r)) => Some(l.max(r)),
            _ => None,
        };
        return one(Out::ty(tt(n.dt(0), rank.map(|r| vec![Dim::Unknown; r]))));
    };
    let target = value::to_dims(t);
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let dims = bcast(s, &target)?;
    if let (Some(v), Some(f)) = (n.val(0), all_fixed(&dims)) {
        let ones = Known::new(
            v.dtype,
            f.clone(),
            vec![
                Scalar::Int(0);
                value::checked_numel(&f)
                    .unwrap_or(usize::MAX)
                    .min(MAX_FOLD + 1)
            ],
        );
        if let Some(ones) = ones {
            if let Some(k) = value::broadcast_map(&[v, &ones], v.dtype, |s| s[0].clone()) {
                return one(Out::known(k));
            }
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn tile(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let Some(rep) = n.ints(1) else {
        return one(Out::ty(tt(n.dt(0), Some(vec![Dim::Unknown; s.len()]))));
    };
    if rep.len() != s.len() {
        return Err(format!(
            "repeats has {} entries for rank {}",
            rep.len(),
            s.len()
        ));
    }
    let rep = non_neg(&rep, "repeats")?;
    let dims = s
        .iter()
        .zip(&rep)
        .map(|(d, &r)| dim_mul(d, &Dim::Fixed(r)))
        .collect();
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn pad(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let pads = if let Some(p) = n.ints_attr("pads")? {
        Some(p.to_vec())
    } else {
        n.need(1)?;
        n.ints(1)
    };
    let ax = if n.has(3) {
        n.ints(3).map(|a| axes(&a, s.len())).transpose()?
    } else {
        Some((0..s.len()).collect())
    };
    let (Some(pads), Some(ax)) = (pads, ax) else {
        return one(Out::ty(tt(n.dt(0), Some(vec![Dim::Unknown; s.len()]))));
    };
    if pads.len() != 2 * ax.len() {
        return Err(format!(
            "pads has {} entries for {} axes",
            pads.len(),
            ax.len()
        ));
    }
    let mut dims = s.to_vec();
    for (j, &a) in ax.iter().enumerate() {
        let total = pads[j]
            .checked_add(pads[j + ax.len()])
            .ok_or("pads overflow")?;
        dims[a] = dim_add(&s[a], total);
        if let (Dim::Fixed(d), Dim::Unknown) = (&s[a], &dims[a]) {
            return Err(format!(
                "padding {total} makes axis {a} of size {d} negative"
            ));
        }
    }
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn one_hot(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let dt = n.dt(2);
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    let r = s.len() + 1;
    let ax = axis(n.int_or("axis", -1)?, r)?;
    let depth = match n.val(1).and_then(|k| k.single()).and_then(|x| x.as_f64()) {
        Some(d) if (1.0..1e15).contains(&d) => Dim::Fixed(d as usize),
        Some(d) => return Err(format!("depth {d} is not positive")),
        None => Dim::Unknown,
    };
    let mut dims = s.to_vec();
    dims.insert(ax, depth);
    one(Out::ty(tt(dt, Some(dims))))
}

fn topk(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let k = if n.opset < 10 {
        Some(n.int_req("k")?)
    } else {
        n.need(1)?;
        n.int_scalar(1)
    };
    let Some(s) = n.shape(0) else {
        return Ok(vec![
            Out::ty(tt(n.dt(0), None)),
            Out::ty(tt(Some(DType::I64), None)),
        ]);
    };
    let ax = axis(n.int_or("axis", -1)?, s.len())?;
    let mut dims = s.to_vec();
    dims[ax] = match k {
        Some(k) => {
            let k = usize::try_from(k).map_err(|_| format!("k {k} is negative"))?;
            if let Dim::Fixed(d) = s[ax] {
                if k > d {
                    return Err(format!("k {k} exceeds the axis size {d}"));
                }
            }
            Dim::Fixed(k)
        }
        None => Dim::Unknown,
    };
    Ok(vec![
        Out::ty(tt(n.dt(0), Some(dims.clone()))),
        Out::ty(tt(Some(DType::I64), Some(dims))),
    ])
}

fn arg_reduce(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(Some(DType::I64), None)));
    };
    let ax = axis(n.int_or("axis", 0)?, s.len())?;
    let keep = n.int_or("keepdims", 1)? != 0;
    let mut dims = s.to_vec();
    if keep {
        dims[ax] = Dim::Fixed(1);
    } else {
        dims.remove(ax);
    }
    one(Out::ty(tt(Some(DType::I64), Some(dims))))
}

fn reduce(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let keep = n.int_or("keepdims", 1)? != 0;
    let noop = n.int_or("noop_with_empty_axes", 0)? != 0;
    let dt = n.dt(0);
    let ax = axes_arg(n, 1)?;
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    let Some(ax) = ax else {
        return one(Out::ty(tt(dt, keep.then(|| vec![Dim::Unknown; s.len()]))));
    };
    let ax = match ax {
        Some(a) if !a.is_empty() => axes(&a, s.len())?,
        _ if noop => return same(n, 0),
        _ => (0..s.len()).collect(),
    };
    let mut dims = vec![];
    for (i, d) in s.iter().enumerate() {
        if ax.contains(&i) {
            if keep {
                dims.push(Dim::Fixed(1));
            }
        } else {
            dims.push(d.clone());
        }
    }
    // Fold reductions of whole integer vectors (e.g. the product of a shape).
    if let (Some(v), Some(f), true) = (n.val(0), all_fixed(&dims), ax.len() == s.len()) {
        if let (Some(ints), Some(d)) = (v.as_ints(), dt) {
            if d.is_int() {
                let r = match n.op() {
                    "ReduceSum" => ints.iter().try_fold(0i64, |a, &x| a.checked_add(x)),
                    "ReduceProd" => ints.iter().try_fold(1i64, |a, &x| a.checked_mul(x)),
                    "ReduceMax" => ints.iter().copied().max(),
                    "ReduceMin" => ints.iter().copied().min(),
                    _ => None,
                };
                if let Some(k) = r.and_then(|r| Known::ints(d, f, &[r])) {
                    return one(Out::known(k));
                }
            }
        }
    }
    one(Out::ty(tt(dt, Some(dims))))
}

fn layer_norm(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    let stash = n.dtype_attr("stash_type")?.unwrap_or(Some(DType::F32));
    // The statistics are computed in stash_type; runtimes disagree on whether they are cast
    // back, so only claim a dtype when both agree.
    let stat_dt = if stash == dt { dt } else { None };
    let Some(s) = n.shape(0) else {
        return Ok(vec![
            Out::ty(tt(dt, None)),
            Out::ty(tt(stat_dt, None)),
            Out::ty(tt(stat_dt, None)),
        ]);
    };
    let ax = axis(n.int_or("axis", -1)?, s.len())?;
    let mut st = s[..ax].to_vec();
    st.extend(std::iter::repeat_n(Dim::Fixed(1), s.len() - ax));
    Ok(vec![
        same_shape(n, 0, dt),
        Out::ty(tt(stat_dt, Some(st.clone()))),
        Out::ty(tt(stat_dt, Some(st))),
    ])
}

fn batch_norm(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let mut outs = vec![same_shape(n, 0, n.dt(0))];
    for i in 1..n.n_out() {
        // Running/saved mean and variance are shaped like the mean and var inputs.
        let src = if i % 2 == 1 { 3 } else { 4 };
        outs.push(Out::ty(n.ty(src).cloned().unwrap_or_else(super::unknown)));
    }
    Ok(outs)
}

/// numpy.matmul shape rule.
pub fn matmul_dims(a: &[Dim], b: &[Dim]) -> R<Vec<Dim>> {
    if a.is_empty() || b.is_empty() {
        return Err("matmul inputs must not be scalars".into());
    }
    let a2: Vec<Dim> = if a.len() == 1 {
        vec![Dim::Fixed(1), a[0].clone()]
    } else {
        a.to_vec()
    };
    let b2: Vec<Dim> = if b.len() == 1 {
        vec![b[0].clone(), Dim::Fixed(1)]
    } else {
        b.to_vec()
    };
    let (m, k1) = (&a2[a2.len() - 2], &a2[a2.len() - 1]);
    let (k2, nn) = (&b2[b2.len() - 2], &b2[b2.len() - 1]);
    if let (Dim::Fixed(x), Dim::Fixed(y)) = (k1, k2) {
        if x != y {
            return Err(format!("inner dimensions {x} and {y} do not match"));
        }
    }
    let mut dims = bcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
    if a.len() > 1 {
        dims.push(m.clone());
    }
    if b.len() > 1 {
        dims.push(nn.clone());
    }
    Ok(dims)
}

fn matmul(n: &NodeIn, dt: Option<DType>) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dims = match (n.shape(0), n.shape(1)) {
        (Some(a), Some(b)) => Some(matmul_dims(a, b)?),
        _ => None,
    };
    one(Out::ty(tt(dt, dims)))
}

fn qlinear_matmul(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(3)?;
    let dims = match (n.shape(0), n.shape(3)) {
        (Some(a), Some(b)) => Some(matmul_dims(a, b)?),
        _ => None,
    };
    one(Out::ty(tt(n.dt(7).or(n.dt(0)), dims)))
}

fn gemm(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let ta = n.int_or("transA", 0)? != 0;
    let tb = n.int_or("transB", 0)? != 0;
    let dims = match (n.shape(0), n.shape(1)) {
        (Some(a), Some(b)) => {
            if a.len() != 2 || b.len() != 2 {
                return Err(format!(
                    "A and B must be 2-D, found ranks {} and {}",
                    a.len(),
                    b.len()
                ));
            }
            let (m, k1) = if ta { (&a[1], &a[0]) } else { (&a[0], &a[1]) };
            let (k2, nn) = if tb { (&b[1], &b[0]) } else { (&b[0], &b[1]) };
            if let (Dim::Fixed(x), Dim::Fixed(y)) = (k1, k2) {
                if x != y {
                    return Err(format!("inner dimensions {x} and {y} do not match"));
                }
            }
            Some(vec![m.clone(), nn.clone()])
        }
        _ => None,
    };
    one(Out::ty(tt(n.dt(0), dims)))
}

fn einsum(n: &NodeIn) -> R<Vec<Out>> {
    let eq: String = n
        .str_or("equation", "")?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    if eq.is_empty() {
        return Err("required attribute 'equation' is missing".into());
    }
    let dt = n.dt(0);
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != n.n_in() {
        return Err(format!(
            "equation has {} operands for {} inputs",
            terms.len(),
            n.n_in()
        ));
    }
    let mut letters: Vec<(char, Dim)> = vec![];
    let mut counts: std::collections::BTreeMap<char, usize> = Default::default();
    let mut ell: Option<Vec<Dim>> = Some(vec![]);
    let mut any_ell = false;
    for (i, t) in terms.iter().enumerate() {
        let has_ell = t.contains("...");
        any_ell |= has_ell;
        let (pre, post) = match t.split_once("...") {
            Some((a, b)) => (a, b),
            None => (*t, ""),
        };
        let named: Vec<char> = pre.chars().chain(post.chars()).collect();
        if named.iter().any(|c| !c.is_ascii_alphabetic()) {
            return Err(format!("invalid term '{t}' in equation"));
        }
        for c in &named {
            *counts.entry(*c).or_insert(0) += 1;
        }
        let Some(s) = n.shape(i) else {
            ell = None;
            for c in &named {
                if !letters.iter().any(|(l, _)| l == c) {
                    letters.push((*c, Dim::Unknown));
                }
            }
            continue;
        };
        if s.len() < named.len() || (!has_ell && s.len() != named.len()) {
            return Err(format!(
                "term '{t}' does not fit input {i} of rank {}",
                s.len()
            ));
        }
        let n_ell = s.len() - named.len();
        let pre_n = pre.chars().count();
        let mut dims_of = |c: char, d: &Dim| -> R<()> {
            match letters.iter_mut().find(|(l, _)| *l == c) {
                Some((_, e)) => {
                    // Repeated letters must agree; size-1 broadcasting is allowed by numpy.
                    *e = match (&*e, d) {
                        (Dim::Fixed(1), o) | (o, Dim::Fixed(1)) => o.clone(),
                        _ => unify_dim(e, d).map_err(|m| format!("label '{c}': {m}"))?,
                    };
                }
                None => letters.push((c, d.clone())),
            }
            Ok(())
        };
        for (j, c) in pre.chars().enumerate() {
            dims_of(c, &s[j])?;
        }
        for (j, c) in post.chars().enumerate() {
            dims_of(c, &s[pre_n + n_ell + j])?;
        }
        if has_ell {
            if let Some(e) = &ell {
                ell = Some(bcast(e, &s[pre_n..pre_n + n_ell])?);
            }
        }
    }
    let out_spec: String = match rhs {
        Some(r) => r.to_string(),
        None => {
            let mut s = if any_ell {
                "...".to_string()
            } else {
                String::new()
            };
            s.extend(counts.iter().filter(|(_, &c)| c == 1).map(|(l, _)| *l));
            s
        }
    };
    let mut dims = vec![];
    let (pre, post) = match out_spec.split_once("...") {
        Some((a, b)) => (a.to_string(), Some(b.to_string())),
        None => (out_spec.clone(), None),
    };
    let lookup = |c: char| -> R<Dim> {
        letters
            .iter()
            .find(|(l, _)| *l == c)
            .map(|(_, d)| d.clone())
            .ok_or_else(|| format!("output label '{c}' does not appear in the inputs"))
    };
    for c in pre.chars() {
        dims.push(lookup(c)?);
    }
    if let Some(post) = post {
        match &ell {
            Some(e) => dims.extend(e.iter().cloned()),
            None => return one(Out::ty(tt(dt, None))),
        }
        for c in post.chars() {
            dims.push(lookup(c)?);
        }
    }
    one(Out::ty(tt(dt, Some(dims))))
}

fn quantize(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = if n.has(2) {
        n.dt(2)
    } else {
        match n.dtype_attr("output_dtype")? {
            Some(d) if n.int_or("output_dtype", 0)? != 0 => d,
            _ => Some(DType::U8),
        }
    };
    one(same_shape(n, 0, dt))
}

fn dequantize(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = match n.dtype_attr("output_dtype")? {
        Some(d) if n.int_or("output_dtype", 0)? != 0 => d,
        _ => n.dt(1),
    };
    one(same_shape(n, 0, dt))
}

fn non_zero(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let rank = n.rank(0).map(Dim::Fixed).unwrap_or(Dim::Unknown);
    let count = match n.val(0) {
        Some(v) if v.is_full() => Dim::Fixed(
            v.data
                .iter()
                .filter(|s| s.as_f64().is_some_and(|x| x != 0.0))
                .count(),
        ),
        _ => Dim::Unknown,
    };
    one(Out::ty(tt(Some(DType::I64), Some(vec![rank, count]))))
}

fn compress(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let trues = n.val(1).filter(|v| v.is_full()).map(|v| {
        v.data
            .iter()
            .filter(|s| s.as_f64().is_some_and(|x| x != 0.0))
            .count()
    });
    let Some(a) = n.int_attr("axis")? else {
        return one(Out::ty(tt(
            n.dt(0),
            Some(vec![trues.map_or(Dim::Unknown, Dim::Fixed)]),
        )));
    };
    let Some(s) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    let ax = axis(a, s.len())?;
    let mut dims = s.to_vec();
    dims[ax] = trues.map_or(Dim::Unknown, Dim::Fixed);
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

fn unique(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let u = Dim::Unknown;
    let i64v = |d: Dim| Out::ty(tt(Some(DType::I64), Some(vec![d])));
    let Some(a) = n.int_attr("axis")? else {
        let total = n.shape(0).map(dim_prod).unwrap_or(Dim::Unknown);
        return Ok(vec![
            Out::ty(tt(n.dt(0), Some(vec![u.clone()]))),
            i64v(u.clone()),
            i64v(total),
            i64v(u),
        ]);
    };
    let Some(s) = n.shape(0) else {
        return Ok(vec![
            Out::ty(tt(n.dt(0), None)),
            i64v(u.clone()),
            i64v(u.clone()),
            i64v(u),
        ]);
    };
    let ax = axis(a, s.len())?;
    let mut dims = s.to_vec();
    dims[ax] = Dim::Unknown;
    Ok(vec![
        Out::ty(tt(n.dt(0), Some(dims))),
        i64v(u.clone()),
        i64v(s[ax].clone()),
        i64v(u),
    ])
}

fn random(n: &NodeIn) -> R<Vec<Out>> {
    let shape = n
        .ints_attr("shape")?
        .ok_or("required attribute 'shape' is missing")?;
    let shape = non_neg(shape, "shape")?;
    let dt = n.dtype_attr("dtype")?.unwrap_or(Some(DType::F32));
    one(Out::ty(tt(dt, Some(fixed(&shape)))))
}

fn multinomial(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let samples =
        usize::try_from(n.int_or("sample_size", 1)?).map_err(|_| "negative sample_size")?;
    let dt = n.dtype_attr("dtype")?.unwrap_or(Some(DType::I32));
    let batch = n
        .shape(0)
        .and_then(|s| s.first().cloned())
        .unwrap_or(Dim::Unknown);
    one(Out::ty(tt(dt, Some(vec![batch, Dim::Fixed(samples)]))))
}

fn window(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dtype_attr("output_datatype")?.unwrap_or(Some(DType::F32));
    let size = match n.int_scalar(0) {
        Some(s) => Dim::Fixed(usize::try_from(s).map_err(|_| format!("size {s} is negative"))?),
        None => Dim::Unknown,
    };
    one(Out::ty(tt(dt, Some(vec![size]))))
}

fn mel(n: &NodeIn) -> R<Vec<Out>> {
    let dt = n.dtype_attr("output_datatype")?.unwrap_or(Some(DType::F32));
    let bins = n.int_scalar(0).and_then(|v| usize::try_from(v).ok());
    let dft = n.int_scalar(1).and_then(|v| usize::try_from(v).ok());
    one(Out::ty(tt(
        dt,
        Some(vec![
            dft.map_or(Dim::Unknown, |d| Dim::Fixed(d / 2 + 1)),
            bins.map_or(Dim::Unknown, Dim::Fixed),
        ]),
    )))
}

fn sequence_construct(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let mut t = n.ty(0).cloned().unwrap_or_else(super::unknown);
    for i in 1..n.n_in() {
        t = merge_type(&t, n.ty(i).unwrap_or(&super::unknown()));
    }
    one(Out::ty(TypeInfo::Sequence(Some(Box::new(t)))))
}

fn sequence_insert(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let elem = n.ty(1).cloned().unwrap_or_else(super::unknown);
    let t = match n.ty(0) {
        Some(TypeInfo::Sequence(Some(e))) => merge_type(e, &elem),
        _ => super::unknown(),
    };
    one(Out::ty(TypeInfo::Sequence(Some(Box::new(t)))))
}

fn split_to_sequence(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let seq = |t: TypeInfo| Ok(vec![Out::ty(TypeInfo::Sequence(Some(Box::new(t))))]);
    let Some(s) = n.shape(0) else {
        return seq(tt(n.dt(0), None));
    };
    let ax = axis(n.int_or("axis", 0)?, s.len())?;
    let mut dims = s.to_vec();
    if !n.has(1) {
        if n.int_or("keepdims", 1)? != 0 {
            dims[ax] = Dim::Fixed(1);
        } else {
            dims.remove(ax);
        }
        return seq(tt(n.dt(0), Some(dims)));
    }
    dims[ax] = match n.val(1) {
        Some(v) if v.shape.is_empty() => match (v.single().and_then(|x| x.as_i64()), &s[ax]) {
            (Some(c), Dim::Fixed(d)) if c > 0 && d % (c as usize) == 0 => Dim::Fixed(c as usize),
            _ => Dim::Unknown,
        },
        Some(v) => match v.as_ints() {
            Some(sz) if !sz.is_empty() && sz.iter().all(|&x| x == sz[0]) && sz[0] >= 0 => {
                Dim::Fixed(sz[0] as usize)
            }
            _ => Dim::Unknown,
        },
        None => Dim::Unknown,
    };
    seq(tt(n.dt(0), Some(dims)))
}

fn concat_from_sequence(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let new_axis = n.int_or("new_axis", 0)? != 0;
    let a = n.int_req("axis")?;
    let Some(TypeInfo::Sequence(Some(e))) = n.ty(0) else {
        return one(Out::ty(super::unknown()));
    };
    let TypeInfo::Tensor { dtype, shape } = &**e else {
        return one(Out::ty(super::unknown()));
    };
    let Some(s) = shape else {
        return one(Out::ty(tt(*dtype, None)));
    };
    let mut dims = s.clone();
    // The number of elements is not known statically, so the concatenated axis is not either.
    if new_axis {
        let ax = axis(a, s.len() + 1)?;
        dims.insert(ax, Dim::Unknown);
    } else {
        let ax = axis(a, s.len())?;
        dims[ax] = Dim::Unknown;
    }
    one(Out::ty(tt(*dtype, Some(dims))))
}

fn optional(n: &NodeIn) -> R<Vec<Out>> {
    if n.has(0) {
        return one(Out::ty(TypeInfo::Optional(Some(Box::new(
            n.ty(0).cloned().unwrap_or_else(super::unknown),
        )))));
    }
    match n.attr("type") {
        Some(Attr::Type(t)) => one(Out::ty(TypeInfo::Optional(Some(Box::new(t.clone()))))),
        _ => Err("needs an input or a 'type' attribute".into()),
    }
}
