//! Inference rules for windowed ops (convolutions, pools), resampling, recurrent networks,
//! attention, losses and signal processing.

use super::ctx::{NodeIn, R};
use super::util::*;
use super::Out;
use crate::dtype::DType;
use crate::graph::Dim;

fn one(o: Out) -> R<Vec<Out>> {
    Ok(vec![o])
}

/// Spatial attributes shared by Conv and the pools.
struct Window {
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    /// Begin pads then end pads (ONNX order).
    pads: Vec<i64>,
    auto_pad: String,
}

fn window(n: &NodeIn, kernel: Vec<usize>) -> R<Window> {
    let sp = kernel.len();
    let list = |name: &str, default: usize| -> R<Vec<usize>> {
        match n.ints_attr(name)? {
            Some(v) => {
                if v.len() != sp {
                    return Err(format!(
                        "'{name}' has {} entries for {sp} spatial dims",
                        v.len()
                    ));
                }
                let v = non_neg(v, name)?;
                if v.contains(&0) {
                    return Err(format!("'{name}' contains zero"));
                }
                Ok(v)
            }
            None => Ok(vec![default; sp]),
        }
    };
    let strides = list("strides", 1)?;
    let dilations = list("dilations", 1)?;
    let pads = match n.ints_attr("pads")? {
        Some(p) => {
            if p.len() != 2 * sp {
                return Err(format!(
                    "'pads' has {} entries for {sp} spatial dims",
                    p.len()
                ));
            }
            p.to_vec()
        }
        None => vec![0; 2 * sp],
    };
    let auto_pad = n.str_or("auto_pad", "NOTSET")?.to_string();
    Ok(Window {
        kernel,
        strides,
        dilations,
        pads,
        auto_pad,
    })
}

impl Window {
    /// Output length of spatial axis `i` for input length `d`.
    fn out(&self, i: usize, d: &Dim, ceil_mode: bool) -> R<Dim> {
        let Dim::Fixed(d) = *d else {
            return Ok(Dim::Unknown);
        };
        let (k, s, dil) = (self.kernel[i], self.strides[i], self.dilations[i]);
        let ek = k
            .checked_sub(1)
            .and_then(|k| k.checked_mul(dil))
            .and_then(|k| k.checked_add(1))
            .ok_or("kernel size overflows or is zero")?;
        let (d, ek, s) = (d as i128, ek as i128, s as i128);
        let o = match self.auto_pad.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => (d + s - 1) / s,
            "VALID" => {
                if d < ek {
                    return Err(format!("kernel extent {ek} exceeds input size {d}"));
                }
                (d - ek) / s + 1
            }
            "NOTSET" | "" => {
                let (pb, pe) = (
                    self.pads[i] as i128,
                    self.pads[i + self.kernel.len()] as i128,
                );
                let span = d + pb + pe - ek;
                if span < 0 {
                    return Err(format!(
                        "kernel extent {ek} exceeds padded input size {}",
                        d + pb + pe
                    ));
                }
                if ceil_mode {
                    let mut o = (span + s - 1) / s + 1;
                    // The last window must start inside the input or the begin padding.
                    if (o - 1) * s >= d + pb {
                        o -= 1;
                    }
                    o
                } else {
                    span / s + 1
                }
            }
            other => return Err(format!("unknown auto_pad '{other}'")),
        };
        usize::try_from(o)
            .map(Dim::Fixed)
            .map_err(|_| "output size is negative".into())
    }
}

/// Conv, ConvInteger, QLinearConv, DeformConv: `[N, M, spatial...]`.
pub fn conv(n: &NodeIn) -> R<Vec<Out>> {
    let (wi, dt) = match n.op() {
        "QLinearConv" => (3, n.dt(7)),
        "ConvInteger" => (1, Some(DType::I32)),
        _ => (1, n.dt(0)),
    };
    n.need(0)?;
    n.need(wi)?;
    let (xs, ws) = (n.shape(0), n.shape(wi));
    let rank = xs.map(|s| s.len()).or(ws.map(|s| s.len()));
    let Some(rank) = rank else {
        return one(Out::ty(tt(dt, None)));
    };
    if rank < 3 {
        return Err(format!("input rank {rank} is below 3"));
    }
    let sp = rank - 2;
    let kernel = match n.ints_attr("kernel_shape")? {
        Some(k) => Some(non_neg(k, "kernel_shape")?),
        None => ws.and_then(|w| all_fixed(w.get(2..)?)),
    };
    let m = ws.and_then(|w| w.first().cloned()).unwrap_or(Dim::Unknown);
    let batch = xs.and_then(|x| x.first().cloned()).unwrap_or(Dim::Unknown);
    if let (Some(x), Some(w)) = (xs, ws) {
        if x.len() != w.len() {
            return Err(format!(
                "input rank {} and weight rank {} differ",
                x.len(),
                w.len()
            ));
        }
        let g = usize::try_from(n.int_or("group", 1)?).map_err(|_| "negative group")?;
        if let (Dim::Fixed(c), Dim::Fixed(wc)) = (&x[1], &w[1]) {
            if g == 0 || c / g.max(1) != *wc || c % g.max(1) != 0 {
                return Err(format!(
                    "input channels {c} do not match weight channels {wc} x group {g}"
                ));
            }
        }
    }
    let mut dims = vec![batch, m];
    match (xs, kernel) {
        (Some(x), Some(k)) => {
            if k.len() != sp {
                return Err(format!("kernel has {} dims for {sp} spatial dims", k.len()));
            }
            let w = window(n, k)?;
            for i in 0..sp {
                dims.push(w.out(i, &x[2 + i], false)?);
            }
        }
        _ => dims.extend(std::iter::repeat_n(Dim::Unknown, sp)),
    }
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn conv_transpose(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let (xs, ws) = (n.shape(0), n.shape(1));
    let Some(rank) = xs.map(|s| s.len()).or(ws.map(|s| s.len())) else {
        return one(Out::ty(tt(dt, None)));
    };
    if rank < 3 {
        return Err(format!("input rank {rank} is below 3"));
    }
    let sp = rank - 2;
    let g = usize::try_from(n.int_or("group", 1)?).map_err(|_| "negative group")?;
    let m = ws
        .and_then(|w| w.get(1))
        .map_or(Dim::Unknown, |d| dim_mul(d, &Dim::Fixed(g)));
    let batch = xs.and_then(|x| x.first().cloned()).unwrap_or(Dim::Unknown);
    let mut dims = vec![batch, m];
    if let Some(os) = n.ints_attr("output_shape")? {
        let os = non_neg(os, "output_shape")?;
        if os.len() < sp {
            return Err(format!(
                "output_shape has {} entries for {sp} spatial dims",
                os.len()
            ));
        }
        dims.extend(fixed(&os[os.len() - sp..]));
        return one(Out::ty(tt(dt, Some(dims))));
    }
    let kernel = match n.ints_attr("kernel_shape")? {
        Some(k) => Some(non_neg(k, "kernel_shape")?),
        None => ws.and_then(|w| all_fixed(w.get(2..)?)),
    };
    let (Some(x), Some(k)) = (xs, kernel) else {
        dims.extend(std::iter::repeat_n(Dim::Unknown, sp));
        return one(Out::ty(tt(dt, Some(dims))));
    };
    if k.len() != sp {
        return Err(format!("kernel has {} dims for {sp} spatial dims", k.len()));
    }
    let w = window(n, k)?;
    let op = match n.ints_attr("output_padding")? {
        Some(p) if p.len() == sp => p.to_vec(),
        Some(p) => {
            return Err(format!(
                "output_padding has {} entries for {sp} dims",
                p.len()
            ))
        }
        None => vec![0; sp],
    };
    for i in 0..sp {
        let Dim::Fixed(d) = x[2 + i] else {
            dims.push(Dim::Unknown);
            continue;
        };
        let (d, s) = (d as i128, w.strides[i] as i128);
        let ek = (w.kernel[i] as i128 - 1) * w.dilations[i] as i128 + 1;
        let o = match w.auto_pad.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => d * s,
            _ => {
                let pads = if w.auto_pad == "VALID" {
                    0
                } else {
                    w.pads[i] as i128 + w.pads[i + sp] as i128
                };
                s * (d - 1) + op[i] as i128 + ek - pads
            }
        };
        dims.push(Dim::Fixed(
            usize::try_from(o).map_err(|_| "output size is negative")?,
        ));
    }
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn pool(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    let kernel = non_neg(
        n.ints_attr("kernel_shape")?
            .ok_or("required attribute 'kernel_shape' is missing")?,
        "kernel_shape",
    )?;
    let sp = kernel.len();
    let ceil_mode = n.int_or("ceil_mode", 0)? != 0;
    let dims = match n.shape(0) {
        Some(x) => {
            if x.len() != sp + 2 {
                return Err(format!(
                    "input rank {} does not fit a {sp}-D kernel",
                    x.len()
                ));
            }
            let w = window(n, kernel)?;
            let mut dims = x[..2].to_vec();
            for i in 0..sp {
                dims.push(w.out(i, &x[2 + i], ceil_mode)?);
            }
            Some(dims)
        }
        None => None,
    };
    Ok(vec![
        Out::ty(tt(dt, dims.clone())),
        Out::ty(tt(Some(DType::I64), dims)),
    ])
}

pub fn global_pool(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dims = match n.shape(0) {
        Some(x) if x.len() >= 2 => {
            let mut d = x[..2].to_vec();
            d.extend(std::iter::repeat_n(Dim::Fixed(1), x.len() - 2));
            Some(d)
        }
        Some(x) => return Err(format!("input rank {} is below 2", x.len())),
        None => None,
    };
    one(Out::ty(tt(n.dt(0), dims)))
}

pub fn max_unpool(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    if n.has(2) {
        return one(Out::ty(tt(dt, n.val(2).map(super::value::to_dims))));
    }
    let kernel = non_neg(
        n.ints_attr("kernel_shape")?
            .ok_or("required attribute 'kernel_shape' is missing")?,
        "kernel_shape",
    )?;
    let sp = kernel.len();
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    if x.len() != sp + 2 {
        return Err(format!(
            "input rank {} does not fit a {sp}-D kernel",
            x.len()
        ));
    }
    let w = window(n, kernel)?;
    let mut dims = x[..2].to_vec();
    for i in 0..sp {
        dims.push(match x[2 + i] {
            Dim::Fixed(d) => {
                let o = (d as i128 - 1) * w.strides[i] as i128 + w.kernel[i] as i128
                    - w.pads[i] as i128
                    - w.pads[i + sp] as i128;
                Dim::Fixed(usize::try_from(o).map_err(|_| "output size is negative")?)
            }
            _ => Dim::Unknown,
        });
    }
    one(Out::ty(tt(dt, Some(dims))))
}

/// MaxRoiPool and RoiAlign: `[num_rois, C, out_h, out_w]`.
pub fn roi(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let (h, w) = if n.op() == "MaxRoiPool" {
        let p = non_neg(
            n.ints_attr("pooled_shape")?
                .ok_or("required attribute 'pooled_shape' is missing")?,
            "pooled_shape",
        )?;
        if p.len() != 2 {
            return Err("pooled_shape must have 2 entries".into());
        }
        (p[0], p[1])
    } else {
        let h = usize::try_from(n.int_or("output_height", 1)?).map_err(|_| "negative height")?;
        let w = usize::try_from(n.int_or("output_width", 1)?).map_err(|_| "negative width")?;
        (h, w)
    };
    let rois = n
        .shape(1)
        .and_then(|s| s.first().cloned())
        .unwrap_or(Dim::Unknown);
    let c = n
        .shape(0)
        .and_then(|s| s.get(1).cloned())
        .unwrap_or(Dim::Unknown);
    one(Out::ty(tt(
        n.dt(0),
        Some(vec![rois, c, Dim::Fixed(h), Dim::Fixed(w)]),
    )))
}

pub fn resize(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    let r = x.len();
    let unknown = || one(Out::ty(tt(dt, Some(vec![Dim::Unknown; r]))));
    // Where scales and sizes live depends on the op and opset.
    let (scales, sizes): (Option<Vec<f64>>, Option<Vec<i64>>) = if n.op() == "Upsample" {
        if let Some(s) = n.floats_attr("scales")? {
            (Some(s.iter().map(|&v| v as f64).collect()), None)
        } else {
            (n.val(1).and_then(|v| v.as_floats()), None)
        }
    } else if n.opset < 11 {
        (n.val(1).and_then(|v| v.as_floats()), None)
    } else {
        let sc = if n.has(2) {
            match n.val(2) {
                Some(v) if !v.is_empty() => v.as_floats(),
                Some(_) => None,
                None if !n.has(3) => return unknown(),
                None => None,
            }
        } else {
            None
        };
        let sz = if sc.is_none() && n.has(3) {
            match n.ints(3) {
                Some(v) => Some(v),
                None => return unknown(),
            }
        } else {
            None
        };
        (sc, sz)
    };
    let axes_list = match n.ints_attr("axes")? {
        Some(a) => axes(a, r)?,
        None => (0..r).collect(),
    };
    let mut dims = x.to_vec();
    if let Some(sc) = scales {
        if sc.len() != axes_list.len() {
            return Err(format!("{} scales for {} axes", sc.len(), axes_list.len()));
        }
        for (j, &a) in axes_list.iter().enumerate() {
            if sc[j] <= 0.0 || !sc[j].is_finite() {
                return Err(format!("scale {} is not positive", sc[j]));
            }
            dims[a] = match x[a] {
                Dim::Fixed(d) => Dim::Fixed((d as f64 * sc[j]).floor() as usize),
                ref o if sc[j] == 1.0 => o.clone(),
                _ => Dim::Unknown,
            };
        }
    } else if let Some(sz) = sizes {
        if sz.len() != axes_list.len() {
            return Err(format!("{} sizes for {} axes", sz.len(), axes_list.len()));
        }
        let sz = non_neg(&sz, "sizes")?;
        let policy = n.str_or("keep_aspect_ratio_policy", "stretch")?;
        if policy == "stretch" {
            for (j, &a) in axes_list.iter().enumerate() {
                dims[a] = Dim::Fixed(sz[j]);
            }
        } else {
            let mut ratios = vec![];
            for (j, &a) in axes_list.iter().enumerate() {
                match x[a] {
                    Dim::Fixed(d) if d > 0 => ratios.push(sz[j] as f64 / d as f64),
                    _ => return unknown(),
                }
            }
            let scale = match policy {
                "not_larger" => ratios.iter().cloned().fold(f64::INFINITY, f64::min),
                "not_smaller" => ratios.iter().cloned().fold(0.0, f64::max),
                other => return Err(format!("unknown keep_aspect_ratio_policy '{other}'")),
            };
            for &a in &axes_list {
                if let Dim::Fixed(d) = x[a] {
                    dims[a] = Dim::Fixed((scale * d as f64 + 0.5).floor() as usize);
                }
            }
        }
    } else {
        return unknown();
    }
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn depth_space(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let b = usize::try_from(n.int_req("blocksize")?).map_err(|_| "negative blocksize")?;
    if b == 0 {
        return Err("blocksize is zero".into());
    }
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(n.dt(0), None)));
    };
    if x.len() != 4 {
        return Err(format!("input rank {} is not 4", x.len()));
    }
    let bb = Dim::Fixed(b);
    let dims = if n.op() == "DepthToSpace" {
        vec![
            x[0].clone(),
            dim_div_exact(&x[1], b * b, "channels")?,
            dim_mul(&x[2], &bb),
            dim_mul(&x[3], &bb),
        ]
    } else {
        vec![
            x[0].clone(),
            dim_mul(&x[1], &Dim::Fixed(b * b)),
            dim_div_exact(&x[2], b, "height")?,
            dim_div_exact(&x[3], b, "width")?,
        ]
    };
    one(Out::ty(tt(n.dt(0), Some(dims))))
}

pub fn grid_sample(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dims = match (n.shape(0), n.shape(1)) {
        (Some(x), Some(g)) if x.len() >= 3 && g.len() == x.len() => {
            let mut d = vec![unify_dim(&x[0], &g[0])?, x[1].clone()];
            d.extend_from_slice(&g[1..g.len() - 1]);
            Some(d)
        }
        (Some(x), _) if x.len() < 3 => return Err(format!("input rank {} is below 3", x.len())),
        (Some(x), Some(_)) | (Some(x), None) => {
            let mut d = x[..2].to_vec();
            d.extend(std::iter::repeat_n(Dim::Unknown, x.len() - 2));
            Some(d)
        }
        _ => None,
    };
    one(Out::ty(tt(n.dt(0), dims)))
}

pub fn affine_grid(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let size = n.val(1).map(super::value::to_dims);
    let len = size
        .as_ref()
        .map(|s| s.len())
        .or_else(|| n.shape(1).and_then(|s| s.first()).and_then(fx));
    let Some(len) = len else {
        return one(Out::ty(tt(dt, None)));
    };
    if len != 4 && len != 5 {
        return Err(format!("size has {len} entries; expected 4 or 5"));
    }
    let mut dims = match &size {
        Some(s) => {
            let mut d = vec![s[0].clone()];
            d.extend_from_slice(&s[2..]);
            d
        }
        None => vec![Dim::Unknown; len - 1],
    };
    dims.push(Dim::Fixed(len - 2));
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn col2im(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let dt = n.dt(0);
    let image = n.val(1).map(super::value::to_dims);
    let block = n.ints(2);
    let x = n.shape(0);
    let batch = x.and_then(|s| s.first().cloned()).unwrap_or(Dim::Unknown);
    let c = match (x.and_then(|s| s.get(1)), &block) {
        (Some(d), Some(b)) => {
            let p = non_neg(b, "block_shape")?
                .iter()
                .try_fold(1usize, |a, &v| a.checked_mul(v))
                .ok_or("block_shape overflows")?;
            dim_div_exact(d, p, "channels")?
        }
        _ => Dim::Unknown,
    };
    let Some(image) = image else {
        return one(Out::ty(tt(dt, None)));
    };
    let mut dims = vec![batch, c];
    dims.extend(image);
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn center_crop_pad(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    let ax = match n.ints_attr("axes")? {
        Some(a) => axes(a, x.len())?,
        None => (0..x.len()).collect(),
    };
    let Some(target) = n.val(1) else {
        let mut d = x.to_vec();
        for &a in &ax {
            d[a] = Dim::Unknown;
        }
        return one(Out::ty(tt(dt, Some(d))));
    };
    let t = super::value::to_dims(target);
    if t.len() != ax.len() {
        return Err(format!(
            "shape has {} entries for {} axes",
            t.len(),
            ax.len()
        ));
    }
    let mut d = x.to_vec();
    for (j, &a) in ax.iter().enumerate() {
        d[a] = t[j].clone();
    }
    one(Out::ty(tt(dt, Some(d))))
}

/// RNN (1 gate), GRU (3), LSTM and com.microsoft DynamicQuantizeLSTM (4).
pub fn rnn(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    let dirs = match n.str_or("direction", "forward")? {
        "forward" | "reverse" => 1,
        "bidirectional" => 2,
        other => return Err(format!("unknown direction '{other}'")),
    };
    let hidden = match n.int_attr("hidden_size")? {
        Some(h) => Dim::Fixed(usize::try_from(h).map_err(|_| "negative hidden_size")?),
        // R is [dirs, gates*hidden, hidden] (DynamicQuantizeLSTM: [dirs, hidden, 4*hidden]).
        None => n
            .shape(2)
            .and_then(|s| {
                s.get(if n.op() == "DynamicQuantizeLSTM" {
                    1
                } else {
                    2
                })
                .cloned()
            })
            .unwrap_or(Dim::Unknown),
    };
    if hidden == Dim::Fixed(0) {
        // What the kernel refuses too: inspect and compile report it instead of a shape.
        return Err("hidden size is 0 (from R's shape and the hidden_size attribute): a recurrent op needs at least one hidden unit".into());
    }
    let layout = n.int_or("layout", 0)?;
    let (seq, batch) = match n.shape(0) {
        Some(x) if x.len() == 3 => {
            if layout == 0 {
                (x[0].clone(), x[1].clone())
            } else {
                (x[1].clone(), x[0].clone())
            }
        }
        Some(x) => return Err(format!("input rank {} is not 3", x.len())),
        None => (Dim::Unknown, Dim::Unknown),
    };
    let d = Dim::Fixed(dirs);
    let (y, yh) = if layout == 0 {
        (
            vec![seq, d.clone(), batch.clone(), hidden.clone()],
            vec![d, batch, hidden],
        )
    } else {
        (
            vec![batch.clone(), seq, d.clone(), hidden.clone()],
            vec![batch, d, hidden],
        )
    };
    Ok(vec![
        Out::ty(tt(dt, Some(y))),
        Out::ty(tt(dt, Some(yh.clone()))),
        Out::ty(tt(dt, Some(yh))),
    ])
}

/// ONNX Attention (opset 23+): 4-D `[B, heads, seq, head]` or 3-D `[B, seq, heads*head]`.
pub fn attention(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let (q, k, v) = (n.shape(0), n.shape(1), n.shape(2));
    let (dq, dk, dv) = (n.dt(0), n.dt(1), n.dt(2));
    let (Some(q), Some(k), Some(v)) = (q, k, v) else {
        return Ok(vec![
            Out::ty(tt(dq, None)),
            Out::ty(tt(dk, Some(vec![Dim::Unknown; 4]))),
            Out::ty(tt(dv, Some(vec![Dim::Unknown; 4]))),
            Out::ty(tt(dq, Some(vec![Dim::Unknown; 4]))),
        ]);
    };
    if q.len() != k.len() || q.len() != v.len() || !(q.len() == 3 || q.len() == 4) {
        return Err(format!(
            "Q, K and V must all be 3-D or 4-D, found ranks {}, {}, {}",
            q.len(),
            k.len(),
            v.len()
        ));
    }
    // Bring everything to the 4-D view [B, heads, seq, head].
    let (q4, k4, v4) = if q.len() == 4 {
        (q.to_vec(), k.to_vec(), v.to_vec())
    } else {
        let qh = usize::try_from(n.int_req("q_num_heads")?).map_err(|_| "negative q_num_heads")?;
        let kh =
            usize::try_from(n.int_req("kv_num_heads")?).map_err(|_| "negative kv_num_heads")?;
        let split = |s: &[Dim], h: usize, what: &str| -> R<Vec<Dim>> {
            Ok(vec![
                s[0].clone(),
                Dim::Fixed(h),
                s[1].clone(),
                dim_div_exact(&s[2], h, what)?,
            ])
        };
        (
            split(q, qh, "Q hidden size")?,
            split(k, kh, "K hidden size")?,
            split(v, kh, "V hidden size")?,
        )
    };
    let past = |i: usize| -> Dim {
        if n.has(i) {
            n.shape(i)
                .and_then(|s| s.get(2).cloned())
                .unwrap_or(Dim::Unknown)
        } else {
            Dim::Fixed(0)
        }
    };
    let total_k = dim_sum(&past(4), &k4[2]);
    let total_v = dim_sum(&past(5), &v4[2]);
    let y = if q.len() == 4 {
        vec![q4[0].clone(), q4[1].clone(), q4[2].clone(), v4[3].clone()]
    } else {
        vec![q4[0].clone(), q4[2].clone(), dim_mul(&q4[1], &v4[3])]
    };
    let pk = vec![k4[0].clone(), k4[1].clone(), total_k.clone(), k4[3].clone()];
    let pv = vec![v4[0].clone(), v4[1].clone(), total_v, v4[3].clone()];
    let qk = vec![q4[0].clone(), q4[1].clone(), q4[2].clone(), total_k];
    Ok(vec![
        Out::ty(tt(dq, Some(y))),
        Out::ty(tt(dk, Some(pk))),
        Out::ty(tt(dv, Some(pv))),
        Out::ty(tt(dq, Some(qk))),
    ])
}

/// SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.
pub fn loss(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let reduction = n.str_or("reduction", "mean")?;
    let loss = match reduction {
        "none" => n.shape(1).map(|s| s.to_vec()),
        "mean" | "sum" => Some(vec![]),
        other => return Err(format!("unknown reduction '{other}'")),
    };
    Ok(vec![
        Out::ty(tt(dt, loss)),
        Out::ty(tt(dt, n.shape(0).map(|s| s.to_vec()))),
    ])
}

pub fn dft(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    let dt = n.dt(0);
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(dt, None)));
    };
    let r = x.len();
    if r < 2 {
        return Err(format!("input rank {r} is below 2"));
    }
    let a = if n.opset >= 20 {
        if n.has(2) {
            match n.int_scalar(2) {
                Some(a) => a,
                None => return one(Out::ty(tt(dt, Some(vec![Dim::Unknown; r])))),
            }
        } else {
            -2
        }
    } else {
        n.int_or("axis", 1)?
    };
    let ax = axis(a, r)?;
    if ax == r - 1 {
        return Err("axis may not be the last (complex) dimension".into());
    }
    let len = if n.has(1) {
        match n.int_scalar(1) {
            Some(l) => Dim::Fixed(usize::try_from(l).map_err(|_| "negative dft_length")?),
            None => Dim::Unknown,
        }
    } else {
        x[ax].clone()
    };
    let onesided = n.int_or("onesided", 0)? != 0;
    let mut dims = x.to_vec();
    if onesided && n.int_or("inverse", 0)? != 0 {
        // An inverse of a one-sided spectrum: the real output length and layout vary between
        // opsets and runtimes, so do not claim them.
        dims[ax] = Dim::Unknown;
        dims[r - 1] = Dim::Unknown;
        return one(Out::ty(tt(dt, Some(dims))));
    }
    dims[ax] = match (&len, onesided) {
        (Dim::Fixed(l), true) => Dim::Fixed(l / 2 + 1),
        (_, true) => Dim::Unknown,
        (l, false) => l.clone(),
    };
    dims[r - 1] = Dim::Fixed(2);
    one(Out::ty(tt(dt, Some(dims))))
}

pub fn stft(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let Some(x) = n.shape(0) else {
        return one(Out::ty(tt(dt, Some(vec![Dim::Unknown; 4]))));
    };
    if x.len() != 3 {
        return Err(format!("signal rank {} is not 3", x.len()));
    }
    let step = n.int_scalar(1);
    let flen = if n.has(3) {
        n.int_scalar(3)
    } else if n.has(2) {
        n.shape(2)
            .and_then(|s| s.first())
            .and_then(fx)
            .map(|v| v as i64)
    } else {
        None
    };
    let onesided = n.int_or("onesided", 1)? != 0;
    let (frames, bins) = match (step, flen, &x[1]) {
        (Some(s), Some(f), Dim::Fixed(len)) if s > 0 && f > 0 && (f as usize) <= *len => (
            Dim::Fixed((len - f as usize) / s as usize + 1),
            Dim::Fixed(if onesided {
                f as usize / 2 + 1
            } else {
                f as usize
            }),
        ),
        (_, Some(f), _) if f > 0 => (
            Dim::Unknown,
            Dim::Fixed(if onesided {
                f as usize / 2 + 1
            } else {
                f as usize
            }),
        ),
        _ => (Dim::Unknown, Dim::Unknown),
    };
    one(Out::ty(tt(
        dt,
        Some(vec![x[0].clone(), frames, bins, Dim::Fixed(2)]),
    )))
}

/// FlexAttention (ai.onnx.preview): Q `[B, Hq, L, E]`, V `[B, Hkv, S, Ev]` -> `[B, Hq, L, Ev]`.
pub fn flex_attention(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let dims = match (n.shape(0), n.shape(2)) {
        (Some(q), Some(v)) if q.len() == 4 && v.len() == 4 => Some(vec![
            unify_dim(&q[0], &v[0])?,
            q[1].clone(),
            q[2].clone(),
            v[3].clone(),
        ]),
        (Some(q), Some(v)) => {
            return Err(format!(
                "Q and V must be 4-D, found ranks {} and {}",
                q.len(),
                v.len()
            ))
        }
        _ => None,
    };
    one(Out::ty(tt(n.dt(2).or(n.dt(0)), dims)))
}

/// LinearAttention: 3-D `[B, T, heads*head]` inputs; output `[B, T, Hq*dv]` and the recurrent
/// state `[B, Hkv, dk, dv]`.
pub fn linear_attention(n: &NodeIn) -> R<Vec<Out>> {
    for i in 0..3 {
        n.need(i)?;
    }
    let dt = n.dt(0);
    let qh = usize::try_from(n.int_req("q_num_heads")?).map_err(|_| "negative q_num_heads")?;
    let kh = usize::try_from(n.int_req("kv_num_heads")?).map_err(|_| "negative kv_num_heads")?;
    if qh == 0 || kh == 0 || qh % kh != 0 {
        return Err(format!(
            "q_num_heads {qh} must be a positive multiple of kv_num_heads {kh}"
        ));
    }
    let (Some(q), Some(v)) = (n.shape(0), n.shape(2)) else {
        return Ok(vec![
            Out::ty(tt(dt, Some(vec![Dim::Unknown; 3]))),
            Out::ty(tt(dt, Some(vec![Dim::Unknown; 4]))),
        ]);
    };
    if q.len() != 3 || v.len() != 3 {
        return Err(format!(
            "query and value must be 3-D, found ranks {} and {}",
            q.len(),
            v.len()
        ));
    }
    let dk = dim_div_exact(&q[2], qh, "query hidden size")?;
    let dv = dim_div_exact(&v[2], kh, "value hidden size")?;
    Ok(vec![
        Out::ty(tt(
            dt,
            Some(vec![
                q[0].clone(),
                q[1].clone(),
                dim_mul(&Dim::Fixed(qh), &dv),
            ]),
        )),
        Out::ty(tt(dt, Some(vec![q[0].clone(), Dim::Fixed(kh), dk, dv]))),
    ])
}

/// CausalConvWithState: a depthwise causal conv1d over `[B, C, L]` left-padded with the past
/// state (or k-1 zeros); the new state is the last k-1 padded positions.
pub fn causal_conv_with_state(n: &NodeIn) -> R<Vec<Out>> {
    n.need(0)?;
    n.need(1)?;
    let dt = n.dt(0);
    let k = n.shape(1).and_then(|w| w.get(2)).and_then(fx);
    let (Some(x), Some(k)) = (n.shape(0), k) else {
        return Ok(vec![
            Out::ty(tt(dt, Some(vec![Dim::Unknown; 3]))),
            Out::ty(tt(dt, Some(vec![Dim::Unknown; 3]))),
        ]);
    };
    if x.len() != 3 {
        return Err(format!("input rank {} is not 3", x.len()));
    }
    if k == 0 {
        return Err("kernel size is zero".into());
    }
    let pad = if n.has(3) {
        n.shape(3)
            .and_then(|s| s.get(2).cloned())
            .unwrap_or(Dim::Unknown)
    } else {
        Dim::Fixed(k - 1)
    };
    let padded = dim_sum(&pad, &x[2]);
    let out_len = match &padded {
        Dim::Fixed(p) => Dim::Fixed(
            p.checked_sub(k - 1)
                .ok_or("input is shorter than the kernel")?,
        ),
        _ => Dim::Unknown,
    };
    let state = match &padded {
        Dim::Fixed(p) => Dim::Fixed((k - 1).min(*p)),
        _ => Dim::Unknown,
    };
    Ok(vec![
        Out::ty(tt(dt, Some(vec![x[0].clone(), x[1].clone(), out_len]))),
        Out::ty(tt(dt, Some(vec![x[0].clone(), x[1].clone(), state]))),
    ])
}
