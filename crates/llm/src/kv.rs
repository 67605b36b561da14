//! What [`crate::Engine`] (one graph per variant) and [`crate::Bundle`] (parts in sequence)
//! share: the argument checks and chunk loop of `forward`, the inputs every call takes
//! (`positions`, `attn_mask`, `token_count`, `logits_from`), and the host-owned KV caches.
//!
//! A graph's caches are found by name: every input `past_key.{l}` / `past_value.{l}`
//! (`[KVH, C, D]`, multi-head graphs) or `past_key.{l}.h{g}` / `past_value.{l}.h{g}`
//! (`[1, C, D]`, single-head graphs, one per KV head) has the output `new_…` of the same
//! suffix (`[heads, N, D]`), which the host writes into the cache at the call's positions.

use crate::{bail, LlmError, Result};
use npuc_ir::{f16, DType, Dim, Tensor, TypeInfo, ValueInfo};
use npuc_runtime::Value;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// One cache tensor of a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KvSlot {
    /// The input (`past_key.3`, `past_value.3.h1`).
    pub past: String,
    /// The output with this call's rows (`new_key.3`, `new_value.3.h1`).
    pub new: String,
    /// Layer.
    pub layer: usize,
    /// KV heads the tensor holds (its first dimension).
    pub heads: usize,
}

/// The KV cache inputs of a graph, in input order; each layer of `layers` must have key and
/// value caches, and no other layer may.
pub(crate) fn kv_slots(inputs: &[ValueInfo], layers: &Range<usize>) -> Result<Vec<KvSlot>> {
    let mut slots = vec![];
    for i in inputs {
        let Some(rest) = i
            .name
            .strip_prefix("past_key.")
            .or_else(|| i.name.strip_prefix("past_value."))
        else {
            continue;
        };
        let layer = rest.split('.').next().and_then(|l| l.parse::<usize>().ok());
        let head_ok = match rest.split_once('.') {
            None => true,
            Some((_, h)) => h
                .strip_prefix('h')
                .is_some_and(|g| g.parse::<usize>().is_ok()),
        };
        let (Some(layer), true) = (layer, head_ok) else {
            bail!(
                "KV input '{}' is not past_key.<layer>[.h<head>] / past_value.<layer>[.h<head>]",
                i.name
            );
        };
        if !layers.contains(&layer) {
            bail!(
                "KV input '{}' is outside the graph's layers {}..{}",
                i.name,
                layers.start,
                layers.end
            );
        }
        let heads = match i.dims() {
            Some([Dim::Fixed(h), _, _]) => *h,
            _ => bail!(
                "KV input '{}' is not a static [heads, ctx, head_dim] tensor",
                i.name
            ),
        };
        slots.push(KvSlot {
            new: format!("new_{}", &i.name["past_".len()..]),
            past: i.name.clone(),
            layer,
            heads,
        });
    }
    for l in layers.clone() {
        for kind in ["past_key.", "past_value."] {
            if !slots
                .iter()
                .any(|s| s.layer == l && s.past.starts_with(kind))
            {
                bail!("the graph has no {kind}{l} KV cache input");
            }
        }
    }
    Ok(slots)
}

/// The caches of one graph (all variants of a model or part share one layout).
pub(crate) struct KvCaches {
    pub slots: Vec<KvSlot>,
    /// One per slot, `[heads, ctx, head_dim]`.
    caches: Vec<Arc<Tensor>>,
    pub kv: DType,
    pub head_dim: usize,
    ctx: usize,
    /// Times a cache had to be copied because a reference outlived a run (should stay 0).
    pub copies: usize,
}

impl KvCaches {
    /// Zeroed caches of `ctx` slots.
    pub fn new(slots: Vec<KvSlot>, kv: DType, head_dim: usize, ctx: usize) -> KvCaches {
        let caches = slots
            .iter()
            .map(|s| Arc::new(Tensor::zeros(kv, vec![s.heads, ctx, head_dim])))
            .collect();
        KvCaches {
            slots,
            caches,
            kv,
            head_dim,
            ctx,
            copies: 0,
        }
    }

    /// Bytes the caches take at a context of `ctx` (`None` on overflow).
    pub fn bytes_at(slots: &[KvSlot], kv: DType, head_dim: usize, ctx: usize) -> Option<u128> {
        slots.iter().try_fold(0u128, |acc, s| {
            [s.heads, ctx, head_dim, kv.size()]
                .iter()
                .try_fold(1u128, |a, &b| a.checked_mul(b as u128))
                .and_then(|b| acc.checked_add(b))
        })
    }

    /// Zeroed caches of `ctx` slots.
    pub fn reset_to(&mut self, ctx: usize) {
        *self = KvCaches::new(std::mem::take(&mut self.slots), self.kv, self.head_dim, ctx);
    }

    /// Moves the caches into `new` (larger) slots, keeping their contents.
    pub fn grow(&mut self, new: usize) -> Result<()> {
        let (old, d) = (self.ctx, self.head_dim);
        for (slot, cache) in self.slots.iter().zip(&mut self.caches) {
            let mut grown = Tensor::zeros(self.kv, vec![slot.heads, new, d]);
            match self.kv {
                DType::F16 => copy_slots::<f16>(cache, &mut grown, old, new, d)?,
                _ => copy_slots::<f32>(cache, &mut grown, old, new, d)?,
            }
            *cache = Arc::new(grown);
        }
        self.ctx = new;
        Ok(())
    }

    /// Adds the caches to `feeds` (shared with the run, never copied).
    pub fn feed(&self, feeds: &mut Vec<(String, Value)>) {
        for (s, c) in self.slots.iter().zip(&self.caches) {
            feeds.push((s.past.clone(), Value::Tensor(c.clone())));
        }
    }

    /// Writes rows `0..count` of each `new_…` output of `outs` (a call of `n` rows) into its
    /// cache at slots `pos..`; the outputs are taken out of `outs`.
    pub fn store(
        &mut self,
        outs: &mut HashMap<String, Arc<Tensor>>,
        n: usize,
        count: usize,
        pos: usize,
    ) -> Result<()> {
        let (d, ctx, kv) = (self.head_dim, self.ctx, self.kv);
        for (s, cache) in self.slots.iter().zip(&mut self.caches) {
            let Some(new) = outs.remove(&s.new) else {
                bail!("the graph did not produce the KV output '{}'", s.new);
            };
            if new.shape() != [s.heads, n, d] || new.dtype() != kv {
                bail!(
                    "KV output '{}' is {:?} {}, expected [{}, {n}, {d}] {kv}",
                    s.new,
                    new.shape(),
                    new.dtype(),
                    s.heads
                );
            }
            let cache = match Arc::get_mut(cache) {
                Some(c) => c,
                None => {
                    self.copies += 1;
                    Arc::make_mut(cache)
                }
            };
            match kv {
                DType::F16 => write_kv::<f16>(cache, &new, count, pos, ctx)?,
                _ => write_kv::<f32>(cache, &new, count, pos, ctx)?,
            }
        }
        Ok(())
    }
}

/// The tensor outputs of a run by name.
pub(crate) fn outputs_by_name(outs: Vec<(String, Value)>) -> Result<HashMap<String, Arc<Tensor>>> {
    outs.into_iter()
        .map(|(name, v)| match v {
            Value::Tensor(t) => Ok((name, t)),
            _ => Err(LlmError::msg(format!("output '{name}' is not a tensor"))),
        })
        .collect()
}

/// The inputs every call of one chunk takes, whatever the graph: `positions`, `attn_mask`,
/// and (where the graph has them) `token_count`, `logits_from`.
pub(crate) struct StepInputs {
    positions: Value,
    mask: Value,
    token_count: Value,
    logits_from: Value,
}

impl StepInputs {
    /// `count` real tokens padded to `n` rows at position `pos` of a `ctx`-slot cache, logits
    /// wanted from row `from`. Padding rows take the slots after the real ones; nothing reads
    /// them (their mask row shows only their own slot, real rows never see them) and the host
    /// does not keep them.
    pub fn new(pos: usize, n: usize, count: usize, ctx: usize, from: usize) -> Result<StepInputs> {
        if pos + n > ctx {
            bail!("internal: {n} rows at position {pos} overflow the context of {ctx}");
        }
        let positions: Vec<i64> = (0..n).map(|i| (pos + i) as i64).collect();
        let mut mask = vec![f32::NEG_INFINITY; n * ctx];
        for i in 0..n {
            let row = &mut mask[i * ctx..(i + 1) * ctx];
            if i < count {
                row[..=pos + i].fill(0.0);
            } else {
                row[pos + i] = 0.0;
            }
        }
        Ok(StepInputs {
            positions: Value::tensor(Tensor::from_vec(vec![n], positions)?),
            mask: Value::tensor(Tensor::from_vec(vec![n, ctx], mask)?),
            token_count: Value::tensor(Tensor::from_vec(vec![1], vec![count as i64])?),
            logits_from: Value::tensor(Tensor::from_vec(vec![1], vec![from as i64])?),
        })
    }

    /// The feeds of a graph with `inputs`: `first` (`input_ids` or `hidden_in`) and the shared
    /// inputs it declares.
    pub fn feeds(&self, inputs: &[ValueInfo], first: (&str, Value)) -> Vec<(String, Value)> {
        let has = |name: &str| inputs.iter().any(|i| i.name == name);
        let mut feeds = vec![
            (first.0.to_string(), first.1),
            ("positions".to_string(), self.positions.clone()),
            ("attn_mask".to_string(), self.mask.clone()),
        ];
        // Graphs built since the fast path follows llama.cpp's batching take the count of
        // real (unpadded) tokens; graphs whose output head computes only the wanted rows take
        // the first one.
        if has("token_count") {
            feeds.push(("token_count".into(), self.token_count.clone()));
        }
        if has("logits_from") {
            feeds.push(("logits_from".into(), self.logits_from.clone()));
        }
        feeds
    }
}

fn fixed_dim(inputs: &[ValueInfo], name: &str, axis: usize) -> Result<usize> {
    match inputs
        .iter()
        .find(|i| i.name == name)
        .and_then(|i| i.dims())
        .and_then(|d| d.get(axis))
    {
        Some(Dim::Fixed(n)) => Ok(*n),
        _ => bail!("the graph has no static '{name}' input"),
    }
}

/// The feeds of one call of a graph with `inputs` (an LLM or part graph): `first` (token ids
/// or hidden state, `N` rows of which `count` are real) at position `pos`, every row's logits
/// wanted; the caller adds the KV caches.
pub fn call_feeds(
    inputs: &[ValueInfo],
    first: Value,
    pos: usize,
    count: usize,
    ctx: usize,
) -> Result<Vec<(String, Value)>> {
    let n = fixed_dim(inputs, "positions", 0)?;
    let name = if inputs.iter().any(|i| i.name == "input_ids") {
        "input_ids"
    } else {
        crate::build::split::HIDDEN_IN
    };
    Ok(StepInputs::new(pos, n, count, ctx, 0)?.feeds(inputs, (name, first)))
}

/// [`call_feeds`] at position 0 with zeroed KV caches: one self-contained call.
pub fn first_call_feeds(
    inputs: &[ValueInfo],
    first: Value,
    count: usize,
) -> Result<Vec<(String, Value)>> {
    let ctx = fixed_dim(inputs, "attn_mask", 1)?;
    let mut feeds = call_feeds(inputs, first, 0, count, ctx)?;
    for i in inputs.iter().filter(|i| i.name.starts_with("past_")) {
        let (dtype, dims) = match &i.ty {
            Some(TypeInfo::Tensor {
                dtype: Some(t),
                shape: Some(d),
            }) => (
                *t,
                d.iter()
                    .map(|x| match x {
                        Dim::Fixed(n) => Some(*n),
                        _ => None,
                    })
                    .collect::<Option<Vec<usize>>>(),
            ),
            _ => (DType::F32, None),
        };
        let Some(dims) = dims else {
            bail!("KV input '{}' is not a static typed tensor", i.name);
        };
        feeds.push((i.name.clone(), Value::tensor(Tensor::zeros(dtype, dims))));
    }
    Ok(feeds)
}

/// `input_ids` of `toks` padded with 0 to `n` rows.
pub(crate) fn input_ids(toks: &[u32], n: usize) -> Result<Value> {
    let mut ids: Vec<i64> = toks.iter().map(|&t| t as i64).collect();
    ids.resize(n, 0);
    Ok(Value::tensor(Tensor::from_vec(vec![n], ids)?))
}

/// Rows `from..count` of `logits [N, vocab]`.
pub(crate) fn logit_rows(
    logits: &Tensor,
    from: usize,
    count: usize,
    vocab: usize,
) -> Result<Vec<f32>> {
    let rows = logits.as_slice::<f32>()?;
    if rows.len() < count * vocab {
        bail!(
            "logits hold {} values, expected at least {count} x {vocab}",
            rows.len()
        );
    }
    Ok(rows[from * vocab..count * vocab].to_vec())
}

/// A model that runs a sequence in chunks (the engine and the bundle).
pub(crate) trait Chunked {
    /// The sequence limit.
    fn ctx(&self) -> usize;
    fn vocab(&self) -> usize;
    fn position(&self) -> usize;
    /// What to do when a sequence does not fit (e.g. "compile with a larger --ctx").
    fn ctx_advice(&self) -> &'static str;
    /// The graph (an opaque choice) and its tokens per call for the next chunk of `remaining`.
    fn pick(&self, remaining: usize, all_logits: bool) -> Result<(usize, usize)>;
    /// Runs `choice` on `toks` (padded to its N), updates the caches and the position, and
    /// returns the logits of rows `from..toks.len()`.
    fn run_chunk(&mut self, choice: usize, toks: &[u32], from: usize) -> Result<Vec<f32>>;
}

/// `forward` of a [`Chunked`] model: appends `tokens` and returns the last token's logits
/// `[vocab]`, or every token's (`[tokens.len() * vocab]`) when `all_logits`.
pub(crate) fn forward<M: Chunked>(m: &mut M, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        bail!("forward needs at least one token");
    }
    let (ctx, vocab, pos) = (m.ctx(), m.vocab(), m.position());
    if pos + tokens.len() > ctx {
        bail!(
            "prompt of {} tokens + {pos} generated exceeds the context of {ctx}; {}",
            tokens.len(),
            m.ctx_advice()
        );
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} is outside the vocabulary of {vocab}");
    }
    let mut out = Vec::with_capacity(if all_logits {
        tokens.len() * vocab
    } else {
        vocab
    });
    let mut rest = tokens;
    while !rest.is_empty() {
        let (choice, n) = m.pick(rest.len(), all_logits)?;
        let count = n.min(rest.len());
        // Only the last chunk's last row is wanted unless every row is.
        let from = if all_logits {
            0
        } else if count == rest.len() {
            count - 1
        } else {
            count
        };
        out.extend_from_slice(&m.run_chunk(choice, &rest[..count], from)?);
        rest = &rest[count..];
    }
    Ok(out)
}

/// Refuses caches larger than the memory budget (`--max-memory`, else the memory the system has
/// available), before allocating them.
pub(crate) fn check_fits(need: Option<u128>, what: &str, advice: &str) -> Result<()> {
    let (budget, source) = npuc_runtime::limits::memory_budget();
    match need {
        None => bail!("{what} is too large to address; {advice}"),
        Some(n) if n > budget as u128 => bail!(
            "{what} needs {:.2} GB, but the memory budget is {:.2} GB ({source}); {advice}",
            n as f64 / 1e9,
            budget as f64 / 1e9
        ),
        _ => Ok(()),
    }
}

/// Writes rows `0..count` of `new [H, N, D]` into `cache [H, C, D]` at slots `pos..`.
fn write_kv<T: npuc_ir::Elem + Copy>(
    cache: &mut Tensor,
    new: &Tensor,
    count: usize,
    pos: usize,
    ctx: usize,
) -> Result<()> {
    let (kvh, n, d) = (new.shape()[0], new.shape()[1], new.shape()[2]);
    let src = new.as_slice::<T>()?;
    let dst = cache.as_mut_slice::<T>()?;
    for g in 0..kvh {
        let s = &src[g * n * d..(g * n + count) * d];
        dst[(g * ctx + pos) * d..(g * ctx + pos + count) * d].copy_from_slice(s);
    }
    Ok(())
}

/// Copies the `old` slots of `src [H, old, D]` into `dst [H, new, D]`.
fn copy_slots<T: npuc_ir::Elem + Copy>(
    src: &Tensor,
    dst: &mut Tensor,
    old: usize,
    new: usize,
    d: usize,
) -> Result<()> {
    let kvh = src.shape()[0];
    let s = src.as_slice::<T>()?;
    let t = dst.as_mut_slice::<T>()?;
    for g in 0..kvh {
        t[g * new * d..(g * new + old) * d].copy_from_slice(&s[g * old * d..(g + 1) * old * d]);
    }
    Ok(())
}
