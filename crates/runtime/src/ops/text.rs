//! TfIdfVectorizer (ImageDecoder is in `npuc-ops-ext`).

use crate::bail;
use crate::error::Result;
use crate::kernel::{Inputs, OpCtx, Registry};
use crate::value::Value;
use npuc_ir::{DType, Node, Tensor};
use std::collections::HashMap;

pub fn register(r: &mut Registry) {
    r.add("TfIdfVectorizer", 9, tfidf_vectorizer);
}

/// How n-gram counts become output values.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Weighting {
    Tf,
    Idf,
    TfIdf,
}

/// A trie over pool token ids. Node 0 is the root; `id` is the 1-based n-gram id of the
/// n-gram ending at this node (0: no n-gram ends here, keep looking for a longer one).
struct Trie {
    nodes: Vec<TrieNode>,
}

#[derive(Default)]
struct TrieNode {
    id: usize,
    children: HashMap<u32, usize>,
}

impl Trie {
    /// Child of `node` for token `tok`, created (with id 0) when missing.
    fn child_or_insert(&mut self, node: usize, tok: u32) -> usize {
        if let Some(&c) = self.nodes[node].children.get(&tok) {
            return c;
        }
        let c = self.nodes.len();
        self.nodes.push(TrieNode::default());
        self.nodes[node].children.insert(tok, c);
        c
    }
}

/// The n-gram model built from the node's attributes.
struct TfIdfModel {
    trie: Trie,
    /// Output column of each n-gram, by 0-based n-gram id.
    ngram_indexes: Vec<usize>,
    output_size: usize,
    min_gram: usize,
    max_gram: usize,
    max_skip: usize,
    weighting: Weighting,
    weights: Vec<f32>,
}

/// Inserts `ngrams` consecutive n-grams of `size` tokens from `pool[start..]` into the trie,
/// numbering them from `next_id`; returns the next free id. Mirrors the reference's
/// `populate_grams`, including that a repeated n-gram takes the later id.
fn populate_grams(
    trie: &mut Trie,
    pool: &[u32],
    mut idx: usize,
    ngrams: usize,
    size: usize,
    mut next_id: usize,
) -> usize {
    for _ in 0..ngrams {
        let mut n = 1;
        let mut node = 0;
        while idx < pool.len() {
            let child = trie.child_or_insert(node, pool[idx]);
            idx += 1;
            if n == size {
                trie.nodes[child].id = next_id;
                next_id += 1;
                break;
            }
            node = child;
            n += 1;
        }
    }
    next_id
}

impl TfIdfModel {
    /// Builds the model; `pool` holds the pool entries already mapped to token ids.
    fn new(node: &Node, pool: &[u32]) -> Result<TfIdfModel> {
        let weighting = match node.str_or("mode", "")? {
            "TF" => Weighting::Tf,
            "IDF" => Weighting::Idf,
            "TFIDF" => Weighting::TfIdf,
            other => bail!("mode must be TF, IDF or TFIDF, got '{other}'"),
        };
        let min_gram = node.int_req("min_gram_length")?;
        let max_gram = node.int_req("max_gram_length")?;
        let max_skip = node.int_req("max_skip_count")?;
        if min_gram < 1 || max_gram < min_gram || max_skip < 0 {
            bail!(
                "need 1 <= min_gram_length ({min_gram}) <= max_gram_length ({max_gram}) \
                 and max_skip_count ({max_skip}) >= 0"
            );
        }
        let counts = node.ints_req("ngram_counts")?;
        let indexes = node.ints_req("ngram_indexes")?;
        if indexes.is_empty() || indexes.iter().any(|&i| i < 0) {
            bail!("ngram_indexes must be non-empty and non-negative, got {indexes:?}");
        }
        let ngram_indexes: Vec<usize> = indexes.iter().map(|&i| i as usize).collect();
        let output_size = ngram_indexes.iter().max().map_or(0, |&m| m + 1);
        let weights = node.attr_floats("weights")?.unwrap_or(&[]).to_vec();
        if !weights.is_empty() && weights.len() < output_size {
            bail!(
                "weights has {} values, fewer than the output size {output_size}",
                weights.len()
            );
        }
        let total = pool.len();
        let mut trie = Trie {
            nodes: vec![TrieNode::default()],
        };
        let mut next_id = 1;
        for (i, &start) in counts.iter().enumerate() {
            let end = counts.get(i + 1).copied().unwrap_or(total as i64);
            if start < 0 || end < start || end as usize > total {
                bail!("ngram_counts {counts:?} do not index a pool of {total} items");
            }
            let (start, size) = (start as usize, i + 1);
            let ngrams = (end as usize - start) / size;
            if ngrams == 0 {
                continue;
            }
            if size as i64 >= min_gram && size as i64 <= max_gram {
                next_id = populate_grams(&mut trie, pool, start, ngrams, size, next_id);
            } else {
                next_id += ngrams;
            }
        }
        if trie.nodes.iter().any(|n| n.id > ngram_indexes.len()) {
            bail!(
                "the pool defines more n-grams than ngram_indexes has entries ({})",
                ngram_indexes.len()
            );
        }
        Ok(TfIdfModel {
            trie,
            ngram_indexes,
            output_size,
            min_gram: min_gram as usize,
            max_gram: max_gram as usize,
            max_skip: max_skip as usize,
            weighting,
            weights,
        })
    }

    /// Adds the n-gram counts of one row of tokens (`None`: not in the pool) to `freq`.
    fn count_row(&self, row: &[Option<u32>], freq: &mut [u32]) {
        let nodes = &self.trie.nodes;
        let len = row.len();
        let mut start_size = self.min_gram;
        for skip in 1..=self.max_skip + 1 {
            for start in 0..len {
                // Too close to the end for even the shortest wanted n-gram.
                if start + skip * (start_size - 1) >= len {
                    break;
                }
                let (mut item, mut node, mut size) = (start, 0usize, 1usize);
                while !nodes[node].children.is_empty() && size <= self.max_gram && item < len {
                    let Some(child) = row[item].and_then(|t| nodes[node].children.get(&t)) else {
                        break;
                    };
                    let id = nodes[*child].id;
                    if size >= start_size && id != 0 {
                        freq[self.ngram_indexes[id - 1]] += 1;
                    }
                    node = *child;
                    size += 1;
                    item += skip;
                }
            }
            // Unigrams do not depend on the skip distance: count them in the first pass only.
            if start_size == 1 {
                start_size = 2;
                if start_size > self.max_gram {
                    break;
                }
            }
        }
    }

    /// Converts one row of counts into output values.
    fn weigh(&self, freq: &[u32], out: &mut [f32]) {
        for (i, (o, &f)) in out.iter_mut().zip(freq).enumerate() {
            let w = self.weights.get(i).copied();
            *o = match self.weighting {
                Weighting::Tf => f as f32,
                Weighting::Idf => {
                    if f > 0 {
                        w.unwrap_or(1.0)
                    } else {
                        0.0
                    }
                }
                Weighting::TfIdf => w.map_or(f as f32, |w| w * f as f32),
            };
        }
    }
}

/// Maps pool entries and input elements to dense token ids (`None` for input values absent
/// from the pool), so that the trie works on `u32` keys whatever the element type.
fn tokenize<K: std::hash::Hash + Eq + Copy>(
    pool: &[K],
    input: &[K],
) -> (Vec<u32>, Vec<Option<u32>>) {
    let mut ids: HashMap<K, u32> = HashMap::with_capacity(pool.len());
    let pool_ids = pool
        .iter()
        .map(|k| {
            let next = ids.len() as u32;
            *ids.entry(*k).or_insert(next)
        })
        .collect();
    let input_ids = input.iter().map(|k| ids.get(k).copied()).collect();
    (pool_ids, input_ids)
}

/// TfIdfVectorizer (opset 9): counts pool n-grams (with up to `max_skip_count` skipped
/// tokens between items) in each row of a `[C]` or `[B, C]` int32/int64/string input and
/// outputs TF, IDF or TF-IDF values as float32 `[output_size]` or `[B, output_size]`.
fn tfidf_vectorizer(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let node = ctx.node;
    let (rows, cols, out_shape_rows) = match x.shape() {
        [] => (1, 1, None),
        [c] => (1, *c, None),
        [b, c] if *b > 0 => (*b, *c, Some(*b)),
        s => bail!("input must be [C] or [B, C] with B > 0, got {s:?}"),
    };
    let pool_ints = node.attr_ints("pool_int64s")?.unwrap_or(&[]);
    let pool_strs = node.attr_strings("pool_strings")?.unwrap_or(&[]);
    let (pool, tokens) = match x.dtype() {
        DType::String => {
            if pool_strs.is_empty() && !pool_ints.is_empty() {
                bail!("string input needs pool_strings, the node has pool_int64s");
            }
            let pool: Vec<&str> = pool_strs.iter().map(String::as_str).collect();
            let input: Vec<&str> = x.as_strings()?.iter().map(String::as_str).collect();
            tokenize(&pool, &input)
        }
        DType::I32 | DType::I64 => {
            if pool_ints.is_empty() && !pool_strs.is_empty() {
                bail!("integer input needs pool_int64s, the node has pool_strings");
            }
            tokenize(pool_ints, &x.to_i64_vec()?)
        }
        other => bail!("input must be int32, int64 or string, found {other}"),
    };
    let model = TfIdfModel::new(node, &pool)?;
    let out = model.output_size;
    let mut freq = vec![0u32; rows * out];
    let mut y = vec![0f32; rows * out];
    if cols > 0 {
        for ((row, f), o) in tokens
            .chunks_exact(cols)
            .zip(freq.chunks_exact_mut(out))
            .zip(y.chunks_exact_mut(out))
        {
            model.count_row(row, f);
            model.weigh(f, o);
        }
    }
    let shape = match out_shape_rows {
        Some(b) => vec![b, out],
        None => vec![out],
    };
    Ok(vec![Value::tensor(Tensor::from_vec(shape, y)?)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use npuc_ir::Attr;

    fn model(mode: &str, min: i64, max: i64, skip: i64, weights: Option<Vec<f32>>) -> TfIdfModel {
        // Unigrams [2, 3], bigrams [(5, 6), (6, 7)], ids 1..=4 mapped to columns 3, 2, 1, 0.
        let mut node = Node::new("TfIdfVectorizer", &["x"], &["y"])
            .with_attr("mode", Attr::String(mode.into()))
            .with_attr("min_gram_length", Attr::Int(min))
            .with_attr("max_gram_length", Attr::Int(max))
            .with_attr("max_skip_count", Attr::Int(skip))
            .with_attr("ngram_counts", Attr::Ints(vec![0, 2]))
            .with_attr("ngram_indexes", Attr::Ints(vec![3, 2, 1, 0]));
        if let Some(w) = weights {
            node = node.with_attr("weights", Attr::Floats(w));
        }
        let (pool, _) = tokenize(&[2i64, 3, 5, 6, 6, 7], &[]);
        TfIdfModel::new(&node, &pool).unwrap()
    }

    fn run(m: &TfIdfModel, row: &[i64]) -> Vec<f32> {
        let (_, toks) = tokenize(&[2i64, 3, 5, 6, 6, 7], row);
        let mut f = vec![0u32; m.output_size];
        let mut y = vec![0f32; m.output_size];
        m.count_row(&toks, &mut f);
        m.weigh(&f, &mut y);
        y
    }

    #[test]
    fn counts_unigrams_and_skip_bigrams() {
        let m = model("TF", 1, 2, 0, None);
        assert_eq!(run(&m, &[2, 5, 6, 7, 2, 9]), vec![1.0, 1.0, 0.0, 2.0]);
        // With one skipped token allowed, (5, _, 6) and (6, _, 7) are found.
        let m = model("TF", 2, 2, 1, None);
        assert_eq!(run(&m, &[5, 1, 6, 9, 7]), vec![1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn idf_and_tfidf_weights() {
        let w = vec![0.5, 1.5, 2.5, 3.5];
        let m = model("IDF", 1, 2, 0, Some(w.clone()));
        assert_eq!(run(&m, &[2, 2, 3]), vec![0.0, 0.0, 2.5, 3.5]);
        let m = model("TFIDF", 1, 2, 0, Some(w));
        assert_eq!(run(&m, &[2, 2, 3]), vec![0.0, 0.0, 2.5, 7.0]);
    }
}
