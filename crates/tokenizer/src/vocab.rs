//! The vocabulary as llama.cpp loads it from GGUF metadata: token texts, scores, token types, the
//! text → id map, the special-token cache and the end-of-generation set.

use crate::fxhash::FxHasher;
use std::hash::Hasher;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: not specified (rendered as nothing, like llama.cpp).
    Undefined,
    /// 1: an ordinary piece.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<bos>`, `<|im_start|>`, ...), only matched in text with `parse_special`.
    Control,
    /// 4: a user-defined token, always matched in text before splitting and rendered verbatim.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a byte-fallback token `<0xXX>`.
    Byte,
}

impl TokenType {
    /// Maps the GGUF integer; unknown values are `Undefined` (as llama.cpp does).
    pub fn from_gguf(v: i64) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Whether llama.cpp puts tokens of this type into its special-token cache (matched as whole
    /// tokens in the input text before the model's own splitting).
    pub(crate) fn is_special_cached(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }
}

/// Token texts as llama.cpp recognises them for the end-of-turn / end-of-generation sets
/// (llama-vocab.cpp matches these names because converters do not always record the ids).
pub(crate) const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts that end generation (llama.cpp's `special_eog_ids` name list).
pub(crate) const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Token table shared by all tokenizer models.
///
/// Texts live in one arena string and the text → id map is an open-addressing table of ids with
/// their hashes: building it for a 262k vocabulary costs no per-token allocation, and a lookup
/// touches one slot array and one arena slice (this is the hot path of SPM merging).
#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    arena: String,
    /// Token i is `arena[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<u32>,
    pub scores: Vec<f32>,
    pub types: Vec<TokenType>,
    /// `(hash << 32) | (id + 1)`, 0 = empty; linear probing, load factor <= 1/2.
    slots: Vec<u64>,
    mask: usize,
    /// Ids matched as whole tokens in the input text, longest text first (llama.cpp's
    /// `cache_special_tokens`; ties keep id order so the result is deterministic).
    pub special: Vec<u32>,
}

#[inline]
fn hash_str(s: &str) -> u32 {
    let mut h = FxHasher::default();
    h.write(s.as_bytes());
    // The high bits of an Fx hash are the well-mixed ones.
    (h.finish() >> 32) as u32
}

impl Vocab {
    /// Builds the table. Err when the texts exceed 4 GiB in total (u32 offsets).
    pub fn new<S: AsRef<str>>(
        tokens: &[S],
        scores: Vec<f32>,
        types: Vec<TokenType>,
    ) -> Result<Vocab, String> {
        let total: usize = tokens.iter().map(|t| t.as_ref().len()).sum();
        if total > u32::MAX as usize || tokens.len() >= u32::MAX as usize {
            return Err(format!(
                "vocabulary too large ({} tokens, {total} bytes)",
                tokens.len()
            ));
        }
        let mut arena = String::with_capacity(total);
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0u32);
        for t in tokens {
            arena.push_str(t.as_ref());
            offsets.push(arena.len() as u32);
        }
        let cap = (tokens.len() * 2).next_power_of_two().max(16);
        let mut v = Vocab {
            arena,
            offsets,
            scores,
            types,
            slots: vec![0; cap],
            mask: cap - 1,
            special: Vec::new(),
        };
        for id in 0..tokens.len() as u32 {
            v.insert(id);
        }
        Ok(v)
    }

    /// Maps the text of `id` to `id`; a later id with the same text replaces the earlier one,
    /// as in llama.cpp's `token_to_id`.
    fn insert(&mut self, id: u32) {
        let t = self.token(id);
        let h = hash_str(t);
        let mut i = h as usize & self.mask;
        loop {
            let e = self.slots[i];
            if e == 0 || ((e >> 32) as u32 == h && self.token((e as u32) - 1) == t) {
                self.slots[i] = ((h as u64) << 32) | (id as u64 + 1);
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The text of token `id` (in range).
    #[inline]
    pub fn token(&self, id: u32) -> &str {
        &self.arena[self.offsets[id as usize] as usize..self.offsets[id as usize + 1] as usize]
    }

    /// The text of token `id`, None when out of range.
    pub fn get(&self, id: u32) -> Option<&str> {
        ((id as usize) < self.len()).then(|| self.token(id))
    }

    /// The id of a token text (`llama_vocab::text_to_token`).
    #[inline]
    pub fn id(&self, text: &str) -> Option<u32> {
        let h = hash_str(text);
        let mut i = h as usize & self.mask;
        loop {
            let e = self.slots[i];
            if e == 0 {
                return None;
            }
            if (e >> 32) as u32 == h {
                let id = (e as u32) - 1;
                if self.token(id) == text {
                    return Some(id);
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Builds the special-token cache; call after all type fix-ups.
    pub fn build_special_cache(&mut self) {
        let mut ids: Vec<u32> = (0..self.len() as u32)
            .filter(|&i| self.types[i as usize].is_special_cached() && !self.token(i).is_empty())
            .collect();
        ids.sort_by(|&a, &b| {
            self.token(b)
                .len()
                .cmp(&self.token(a).len())
                .then(a.cmp(&b))
        });
        self.special = ids;
    }
}
