//! Splitting the input text at special tokens (llama.cpp's `tokenizer_st_partition`).
//!
//! llama.cpp walks its special-token cache longest text first and, for each token, splits every
//! remaining raw-text fragment at all of its occurrences, left to right. The order matters when
//! special texts overlap, so the same order is used here. To keep that cheap for vocabularies with
//! thousands of special tokens (Gemma: 6.4k), the text is scanned once to find which special texts
//! occur at all; only those are then applied.

use crate::fxhash::FxHashMap;
use crate::vocab::Vocab;
use aho_corasick::{AhoCorasick, MatchKind};

/// A piece of the input: raw text (byte range into the input) or an already-decided token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

/// Multi-pattern matcher over the distinct special texts, for the one-pass presence scan.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialIndex {
    /// Pattern i is the text of `Vocab::special[first[i]]`.
    matcher: Option<AhoCorasick>,
    /// For each distinct text, its first position in `Vocab::special` (the entry llama.cpp
    /// applies first: `special` is sorted longest first, ids ascending on ties).
    first: Vec<usize>,
}

impl SpecialIndex {
    pub fn new(vocab: &Vocab) -> SpecialIndex {
        let mut seen: FxHashMap<&str, ()> = FxHashMap::default();
        let mut patterns = Vec::new();
        let mut first = Vec::new();
        for (pos, &id) in vocab.special.iter().enumerate() {
            let t = vocab.token(id);
            if seen.insert(t, ()).is_none() {
                patterns.push(t);
                first.push(pos);
            }
        }
        // Building can only fail for absurd pattern sets; without a matcher every special
        // text is then tried directly (slower, same result).
        let matcher = if patterns.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .build(&patterns)
                .ok()
        };
        SpecialIndex { matcher, first }
    }

    /// Positions (into `Vocab::special`) of the special texts that occur somewhere in `text`,
    /// ascending (= the order llama.cpp applies them).
    fn present(&self, vocab: &Vocab, text: &str) -> Vec<usize> {
        let Some(m) = &self.matcher else {
            return (0..vocab.special.len())
                .filter(|&p| text.contains(vocab.token(vocab.special[p])))
                .collect();
        };
        let mut hit = vec![false; self.first.len()];
        for mat in m.find_overlapping_iter(text) {
            hit[mat.pattern().as_usize()] = true;
        }
        let mut v: Vec<usize> = hit
            .iter()
            .enumerate()
            .filter(|&(_, &h)| h)
            .map(|(i, _)| self.first[i])
            .collect();
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
    for pos in index.present(vocab, text) {
        let id = vocab.special[pos];
        let ty = vocab.types[id as usize];
        if !parse_special && ty != crate::vocab::TokenType::UserDefined {
            continue;
        }
        let needle = vocab.token(id);
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
