//! String ops (StringConcat, StringNormalizer, StringSplit; RegexFullMatch is in
//! `npuc-ops-ext`), window
//! generators (Hann, Hamming, Blackman), MelWeightMatrix, and the `ai.onnx.ml` ops in
//! [`ml`].

mod ml;

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::ops::elementwise::{cast_tensor, Bcast};
use crate::value::Value;
use npuc_ir::{DType, Tensor};

/// StringConcat: elementwise `X + Y` of string tensors with numpy broadcasting.
fn string_concat(_ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let (a, b) = (ins.tensor(0)?, ins.tensor(1)?);
    let plan = Bcast::new(&[a.shape(), b.shape()])?;
    let (xa, xb) = (a.as_strings()?, b.as_strings()?);
    let mut out = Vec::with_capacity(plan.len());
    plan.for_each_row(|offs, _, n, st| {
        for i in 0..n {
            let (x, y) = (&xa[offs[0] + i * st[0]], &xb[offs[1] + i * st[1]]);
            let mut s = String::with_capacity(x.len() + y.len());
            s.push_str(x);
            s.push_str(y);
            out.push(s);
        }
    });
    Ok(vec![Value::tensor(Tensor::from_strings(
        plan.out_shape,
        out,
    )?)])
}

/// Python's `str.split(None, maxsplit)`: runs of whitespace separate fields, leading and
/// trailing whitespace is dropped, and after `maxsplit` splits the rest (left-trimmed) is
/// one field.
fn split_whitespace(s: &str, maxsplit: Option<usize>) -> Vec<String> {
    let mut out = vec![];
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        if maxsplit.is_some_and(|m| out.len() == m) {
            out.push(rest.to_string());
            break;
        }
        match rest.find(char::is_whitespace) {
            Some(i) => {
                out.push(rest[..i].to_string());
                rest = rest[i..].trim_start();
            }
            None => {
                out.push(rest.to_string());
                break;
            }
        }
    }
    out
}

/// StringSplit: splits each string at `delimiter` (whitespace runs when empty or absent),
/// at most `maxsplit` times. Output 0 pads the pieces with "" to `X.shape + [max pieces]`;
/// output 1 holds each string's piece count.
fn string_split(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let delim = ctx.node.str_or("delimiter", "")?;
    let maxsplit = match ctx.node.attr_int("maxsplit")? {
        Some(m) if m >= 0 => Some(m as usize),
        _ => None,
    };
    let parts: Vec<Vec<String>> = x
        .as_strings()?
        .iter()
        .map(|s| {
            if delim.is_empty() {
                split_whitespace(s, maxsplit)
            } else {
                let n = maxsplit.map_or(usize::MAX, |m| m.saturating_add(1));
                s.splitn(n, delim).map(str::to_string).collect()
            }
        })
        .collect();
    let width = parts.iter().map(Vec::len).max().unwrap_or(0);
    let counts: Vec<i64> = parts.iter().map(|p| p.len() as i64).collect();
    let mut flat = Vec::with_capacity(parts.len() * width);
    for p in parts {
        let k = p.len();
        flat.extend(p);
        flat.extend(std::iter::repeat_n(String::new(), width - k));
    }
    let mut shape = x.shape().to_vec();
    shape.push(width);
    Ok(vec![
        Value::tensor(Tensor::from_strings(shape, flat)?),
        Value::tensor(Tensor::from_vec(x.shape().to_vec(), counts)?),
    ])
}

/// Removes combining accents from common Latin letters (the NFKD-then-drop-combining-marks
/// step of the reference), for the precomposed Latin-1 Supplement and Latin Extended-A
/// letters; other characters are kept as they are.
fn strip_accents(s: &str) -> String {
    if s.is_ascii() {
        return s.to_string();
    }
    s.chars()
        .map(|c| match c {
            'À'..='Å' => 'A',
            'Ç' => 'C',
            'È'..='Ë' => 'E',
            'Ì'..='Ï' => 'I',
            'Ñ' => 'N',
            'Ò'..='Ö' => 'O',
            'Ù'..='Ü' => 'U',
            'Ý' => 'Y',
            'à'..='å' => 'a',
            'ç' => 'c',
            'è'..='ë' => 'e',
            'ì'..='ï' => 'i',
            'ñ' => 'n',
            'ò'..='ö' => 'o',
            'ù'..='ü' => 'u',
            'ý' | 'ÿ' => 'y',
            _ => c,
        })
        .collect()
}

/// StringNormalizer: strips accents, removes stop words (case-sensitively before the case
/// change, or after it when insensitive) and changes case (LOWER/UPPER/NONE). Inputs are
/// `[C]` or `[1, C]`; for those, empty results are dropped (leaving `[""]` if none remain).
fn string_normalizer(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let action = ctx.node.str_or("case_change_action", "NONE")?;
    let sensitive = ctx.node.int_or("is_case_sensitive", 0)? != 0;
    let raw_stops: Vec<String> = ctx
        .node
        .attr_strings("stopwords")?
        .map(|s| s.to_vec())
        .unwrap_or_default();
    let change = |s: &str| -> Result<String> {
        Ok(match action {
            "LOWER" => s.to_lowercase(),
            "UPPER" => s.to_uppercase(),
            "NONE" => s.to_string(),
            other => bail!("unknown case_change_action '{other}'"),
        })
    };
    let stops: std::collections::HashSet<String> =
        raw_stops.iter().map(|w| change(w)).collect::<Result<_>>()?;
    let raw: std::collections::HashSet<&str> = raw_stops.iter().map(|s| s.as_str()).collect();
    let remove = |text: &str, set: &dyn Fn(&str) -> bool| -> String {
        text.split(' ')
            .filter(|w| !set(w))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let shape = x.shape().to_vec();
    if !(shape.len() == 1 || shape.len() == 2) {
        bail!("StringNormalizer input must be 1-D or 2-D, got shape {shape:?}");
    }
    let mut out: Vec<String> = Vec::with_capacity(x.len());
    for s in x.as_strings()? {
        let mut v = strip_accents(s);
        if sensitive && !raw.is_empty() {
            v = remove(&v, &|w| raw.contains(w));
        }
        v = change(&v)?;
        if !sensitive && !stops.is_empty() {
            v = remove(&v, &|w| stops.contains(w));
        }
        out.push(v);
    }
    let filter = shape.len() == 1 || shape[0] == 1;
    let (shape, out) = if filter {
        let mut kept: Vec<String> = out.into_iter().filter(|s| !s.is_empty()).collect();
        if kept.is_empty() {
            kept.push(String::new());
        }
        let n = kept.len();
        (
            if shape.len() == 1 {
                vec![n]
            } else {
                vec![1, n]
            },
            kept,
        )
    } else {
        (shape, out)
    };
    Ok(vec![Value::tensor(Tensor::from_strings(shape, out)?)])
}

/// Reads a scalar (or one-element) integer input.
fn scalar_i64(ins: &Inputs, i: usize, what: &str) -> Result<i64> {
    let t = ins.tensor(i)?;
    match t.to_i64_vec()?.as_slice() {
        [v] => Ok(*v),
        _ => bail!("{what} must be a scalar, got shape {:?}", t.shape()),
    }
}

/// Reads a scalar numeric input as f64.
fn scalar_f64(ins: &Inputs, i: usize, what: &str) -> Result<f64> {
    let t = ins.tensor(i)?;
    match t.to_f64_vec()?.as_slice() {
        [v] => Ok(*v),
        _ => bail!("{what} must be a scalar, got shape {:?}", t.shape()),
    }
}

/// The `output_datatype` attribute (default float).
fn output_dtype(ctx: &OpCtx) -> Result<DType> {
    let code = ctx.node.int_or("output_datatype", 1)?;
    match i32::try_from(code).ok().and_then(DType::from_onnx_code) {
        Some(d) if d != DType::String => Ok(d),
        _ => bail!("output_datatype={code} is not supported"),
    }
}

/// Shared body of the window generators: `w(n, N)` for `n` in `0..size`, where `N` is the
/// size when `periodic` (the default) and size − 1 otherwise.
fn window(ctx: &OpCtx, ins: Inputs, w: fn(f64, f64) -> f64) -> Result<Vec<Value>> {
    let size = scalar_i64(&ins, 0, "size")?;
    if size < 0 {
        bail!("window size {size} is negative");
    }
    let periodic = ctx.node.int_or("periodic", 1)? != 0;
    let n = size as usize;
    let denom = if periodic {
        size as f64
    } else {
        size as f64 - 1.0
    };
    let vals: Vec<f64> = (0..n).map(|i| w(i as f64, denom)).collect();
    let t = Tensor::from_vec(vec![n], vals)?;
    Ok(vec![Value::tensor(cast_tensor(&t, output_dtype(ctx)?)?)])
}

use std::f64::consts::PI;

/// HannWindow: sin²(πn/N).
fn hann_window(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    window(ctx, ins, |n, d| (PI * n / d).sin().powi(2))
}

/// HammingWindow: α − β·cos(2πn/N) with α = 25/46, β = 1 − α.
fn hamming_window(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    window(ctx, ins, |n, d| {
        let a = 25.0 / 46.0;
        a - (1.0 - a) * (2.0 * PI * n / d).cos()
    })
}

/// BlackmanWindow: 0.42 − 0.5·cos(2πn/N) + 0.08·cos(4πn/N).
fn blackman_window(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    window(ctx, ins, |n, d| {
        0.42 - 0.5 * (2.0 * PI * n / d).cos() + 0.08 * (4.0 * PI * n / d).cos()
    })
}

/// MelWeightMatrix: a `[dft_length/2 + 1, num_mel_bins]` matrix of triangular filters evenly
/// spaced on the mel scale between the lower and upper edge frequencies.
fn mel_weight_matrix(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let mel_bins = scalar_i64(&ins, 0, "num_mel_bins")?;
    let dft_length = scalar_i64(&ins, 1, "dft_length")?;
    let sample_rate = scalar_i64(&ins, 2, "sample_rate")?;
    let lower = scalar_f64(&ins, 3, "lower_edge_hertz")?;
    let upper = scalar_f64(&ins, 4, "upper_edge_hertz")?;
    if mel_bins <= 0 || dft_length <= 0 || sample_rate <= 0 {
        bail!("num_mel_bins, dft_length and sample_rate must be positive");
    }
    let (bins, spec) = (mel_bins as usize, dft_length as usize / 2 + 1);
    let mel = |hz: f64| 2595.0 * (1.0 + hz / 700.0).log10();
    let (lo_mel, hi_mel) = (mel(lower), mel(upper));
    let step = (hi_mel - lo_mel) / (bins + 2) as f64;
    // Filter edges as spectrogram bin indices (floor division as in the reference).
    let edges: Vec<i64> = (0..bins + 2)
        .map(|i| {
            let hz = 700.0 * (10f64.powf((i as f64 * step + lo_mel) / 2595.0) - 1.0);
            (((dft_length + 1) as f64 * hz) / sample_rate as f64).floor() as i64
        })
        .collect();
    let mut out = vec![0f64; spec * bins];
    let mut set = |j: i64, i: usize, v: f64| -> Result<()> {
        if j < 0 || j as usize >= spec {
            bail!("mel filter edge {j} lies outside the {spec} spectrogram bins");
        }
        out[j as usize * bins + i] = v;
        Ok(())
    };
    for i in 0..bins {
        let (l, c, h) = (edges[i], edges[i + 1], edges[i + 2]);
        if c == l {
            set(c, i, 1.0)?;
        } else {
            for j in l..=c {
                set(j, i, (j - l) as f64 / (c - l) as f64)?;
            }
        }
        if h > c {
            for j in c..h {
                set(j, i, (h - j) as f64 / (h - c) as f64)?;
            }
        }
    }
    let t = Tensor::from_vec(vec![spec, bins], out)?;
    Ok(vec![Value::tensor(cast_tensor(&t, output_dtype(ctx)?)?)])
}

pub fn register(r: &mut Registry) {
    r.add("StringConcat", 20, string_concat);
    r.add("StringSplit", 20, string_split);
    r.add("StringNormalizer", 10, string_normalizer);
    r.add("HannWindow", 17, hann_window);
    r.add("HammingWindow", 17, hamming_window);
    r.add("BlackmanWindow", 17, blackman_window);
    r.add("MelWeightMatrix", 17, mel_weight_matrix);
    ml::register(r);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitespace_split_matches_python() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(split_whitespace("  a b  c  ", None), s(&["a", "b", "c"]));
        assert_eq!(split_whitespace("  a b  c  ", Some(1)), s(&["a", "b  c  "]));
        assert!(split_whitespace("   ", None).is_empty());
    }
}
