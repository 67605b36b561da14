//! Splitting the input text at special tokens (llama.cpp's `tokenizer_st_partition`).
//!
//! llama.cpp walks its special-token cache longest text first and, for each token, splits every
//! remaining raw-text fragment at all of its occurrences, left to right. The order matters when
//! special texts overlap, so the same order is used here. To keep that cheap for vocabularies with
//! thousands of special tokens (Gemma: 6.4k), the text is scanned once to find which special texts
//! occur at all; only those are then applied.

use crate::vocab::Vocab;
use std::collections::{HashMap, HashSet};

/// A piece of the input: raw text (byte range into the input) or an already-decided token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

/// Index of the special texts by first byte, for the one-pass presence scan.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialIndex {
    /// For each first byte: the distinct lengths of special texts starting with it, longest first.
    lengths: Vec<Vec<usize>>,
    /// Text bytes → position in `Vocab::special`.
    by_text: HashMap<Vec<u8>, usize>,
}

impl SpecialIndex {
    pub fn new(vocab: &Vocab) -> SpecialIndex {
        let mut lengths = vec![Vec::new(); 256];
        let mut by_text = HashMap::new();
        for (pos, &id) in vocab.special.iter().enumerate() {
            let t = vocab.tokens[id as usize].as_bytes();
            // `special` is sorted longest first with ids ascending on ties; the first entry of a
            // text (duplicates are possible) is the one llama.cpp applies first.
            by_text.entry(t.to_vec()).or_insert(pos);
            let l: &mut Vec<usize> = &mut lengths[t[0] as usize];
            if !l.contains(&t.len()) {
                l.push(t.len());
            }
        }
        for l in &mut lengths {
            l.sort_unstable_by(|a, b| b.cmp(a));
        }
        SpecialIndex { lengths, by_text }
    }

    /// Positions (into `Vocab::special`) of the special texts that occur somewhere in `text`.
    fn present(&self, text: &[u8]) -> Vec<usize> {
        let mut found = HashSet::new();
        for i in 0..text.len() {
            let ls = &self.lengths[text[i] as usize];
            for &l in ls {
                if i + l <= text.len() {
                    if let Some(&p) = self.by_text.get(&text[i..i + l]) {
                        found.insert(p);
                    }
                }
            }
        }
        let mut v: Vec<usize> = found.into_iter().collect();
        v.sort_unstable();
        v
    }
}

/// Splits `text` into raw-text fragments and special tokens. With `parse_special == false` only
/// user-defined tokens are split out (control and unknown tokens stay text), as in llama.cpp.
pub(crate) fn partition(
    vocab: &Vocab,
    index: &SpecialIndex,
    text: &str,
    parse_special: bool,
) -> Vec<Fragment> {
    let bytes = text.as_bytes();
    let mut frags = vec![Fragment::Text {
        start: 0,
        end: bytes.len(),
    }];
    if bytes.is_empty() || vocab.special.is_empty() {
        return frags;
    }
    for pos in index.present(bytes) {
        let id = vocab.special[pos];
        let ty = vocab.types[id as usize];
        if !parse_special && ty != crate::vocab::TokenType::UserDefined {
            continue;
        }
        let needle = vocab.tokens[id as usize].as_str();
        let mut out = Vec::with_capacity(frags.len() + 4);
        for f in frags {
            let Fragment::Text { start, end } = f else {
                out.push(f);
                continue;
            };
            let mut s = start;
            while let Some(rel) = text[s..end].find(needle) {
                let m = s + rel;
                if m > s {
                    out.push(Fragment::Text { start: s, end: m });
                }
                out.push(Fragment::Token(id));
                s = m + needle.len();
            }
            if s < end {
                out.push(Fragment::Text { start: s, end });
            }
        }
        frags = out;
    }
    frags
}
