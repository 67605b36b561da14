//! SentencePiece-style tokenization as llama.cpp's `llm_tokenizer_spm` does it: start from UTF-8
//! characters, repeatedly merge the adjacent pair whose concatenation is the vocabulary piece with
//! the highest score (ties: leftmost), then map leftover pieces that are not in the vocabulary to
//! byte tokens `<0xXX>`.
//!
//! The priority queue makes this O(n log n) in the text length; pairs are looked up as slices of
//! the (escaped) text, so there is no allocation per candidate pair.

use crate::vocab::Vocab;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: i32,
    next: i32,
}

struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the smaller left index (llama.cpp's comparator).
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// Byte → token id for the byte fallback: `<0xXX>` if present, else the one-character piece.
pub(crate) fn byte_tokens(vocab: &Vocab) -> [Option<u32>; 256] {
    let mut t = [None; 256];
    for (b, slot) in t.iter_mut().enumerate() {
        let hex = format!("<0x{b:02X}>");
        *slot = vocab.id(&hex).or_else(|| {
            if b < 0x80 {
                vocab.id(&(b as u8 as char).to_string())
            } else {
                None
            }
        });
    }
    t
}

/// Tokenizes one raw-text fragment that is already whitespace-escaped (`' '` → `'▁'`), appending
/// the ids to `out`. Bytes without a token fall back to `unk`; Err names the byte when there is
/// neither.
pub(crate) fn tokenize(
    vocab: &Vocab,
    bytes_tok: &[Option<u32>; 256],
    unk: Option<u32>,
    text: &str,
    out: &mut Vec<u32>,
) -> Result<(), u8> {
    if text.is_empty() {
        return Ok(());
    }
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (off, ch)) in text.char_indices().enumerate() {
        syms.push(Sym {
            start: off as u32,
            len: ch.len_utf8() as u32,
            prev: i as i32 - 1,
            next: i as i32 + 1,
        });
    }
    let n = syms.len();
    syms[n - 1].next = -1;

    let mut heap = BinaryHeap::with_capacity(n);
    let try_add = |syms: &[Sym], heap: &mut BinaryHeap<Bigram>, l: i32, r: i32| {
        if l < 0 || r < 0 {
            return;
        }
        let (ls, rs) = (syms[l as usize], syms[r as usize]);
        let piece = &text[ls.start as usize..(rs.start + rs.len) as usize];
        if let Some(id) = vocab.id(piece) {
            heap.push(Bigram {
                score: vocab.scores[id as usize],
                left: l as u32,
                right: r as u32,
                size: piece.len() as u32,
            });
        }
    };
    for i in 1..n {
        try_add(&syms, &mut heap, i as i32 - 1, i as i32);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left as usize, b.right as usize);
        // Stale: one side was merged away or grew since this pair was queued.
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        let rn = syms[r].next;
        if rn >= 0 {
            syms[rn as usize].prev = l as i32;
        }
        let (p, nx) = (syms[l].prev, syms[l].next);
        try_add(&syms, &mut heap, p, l as i32);
        try_add(&syms, &mut heap, l as i32, nx);
    }

    let mut i = 0i32;
    while i != -1 {
        let s = syms[i as usize];
        let piece = &text[s.start as usize..(s.start + s.len) as usize];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                // A merged symbol is always a vocabulary piece, so only single characters get here.
                for &b in piece.as_bytes() {
                    match bytes_tok[b as usize].or(unk) {
                        Some(id) => out.push(id),
                        None => return Err(b),
                    }
                }
            }
        }
        i = s.next;
    }
    Ok(())
}
