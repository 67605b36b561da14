//! The vocabulary as llama.cpp loads it from GGUF metadata: token texts, scores, token types, the
//! text → id map, the special-token cache and the end-of-generation set.

use crate::fxhash::FxHashMap;

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
#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<TokenType>,
    /// Text → id; when a text occurs twice the later id wins, as in llama.cpp's `token_to_id`.
    pub token_to_id: FxHashMap<String, u32>,
    /// Ids matched as whole tokens in the input text, longest text first (llama.cpp's
    /// `cache_special_tokens`; ties keep id order so the result is deterministic).
    pub special: Vec<u32>,
}

impl Vocab {
    pub fn new(tokens: Vec<String>, scores: Vec<f32>, types: Vec<TokenType>) -> Vocab {
        let mut token_to_id = FxHashMap::with_capacity_and_hasher(tokens.len(), Default::default());
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }
        Vocab {
            tokens,
            scores,
            types,
            token_to_id,
            special: Vec::new(),
        }
    }

    /// The id of a token text (`llama_vocab::text_to_token`).
    #[inline]
    pub fn id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Builds the special-token cache; call after all type fix-ups.
    pub fn build_special_cache(&mut self) {
        let mut ids: Vec<u32> = (0..self.tokens.len() as u32)
            .filter(|&i| {
                self.types[i as usize].is_special_cached() && !self.tokens[i as usize].is_empty()
            })
            .collect();
        ids.sort_by(|&a, &b| {
            self.tokens[b as usize]
                .len()
                .cmp(&self.tokens[a as usize].len())
                .then(a.cmp(&b))
        });
        self.special = ids;
    }
}
