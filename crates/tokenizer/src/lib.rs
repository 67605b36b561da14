//! LLM tokenizers for npuc.
//!
//! * From GGUF metadata (`tokenizer.ggml.*`), reproducing llama.cpp's tokenizers id for id:
//!   `llama` (SentencePiece-style: merge by score, byte fallback) and `gpt2`
//!   (byte-level BPE with the pre-tokenizer chosen by `tokenizer.ggml.pre`). Special tokens in the
//!   text are split out first, as llama.cpp's `tokenizer_st_partition` does.
//! * From a Hugging Face `tokenizer.json` (via the `tokenizers` crate).
//!
//! Decoding renders pieces like llama.cpp's `token_to_piece`; [`StreamDecoder`] turns a stream
//! of ids into complete UTF-8 text. [`Tokenizer::apply_chat_template`] renders the model's Jinja
//! chat template.
#![forbid(unsafe_code)]

mod bpe;
mod chat;
mod fxhash;
mod hf;
mod special;
mod spm;
mod vocab;

pub use bpe::PreType;
pub use chat::ChatMessage;
pub use vocab::TokenType;

use npuc_gguf::{GgufFile, MetaValue};
use special::{Fragment, SpecialIndex};
use std::path::{Path, PathBuf};
use thiserror::Error;
use vocab::Vocab;

/// Errors of this crate; each names the model (or file) it concerns.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// A `tokenizer.*` metadata key is missing or malformed.
    #[error("{model}: metadata key '{key}': {msg}")]
    Metadata {
        model: String,
        key: String,
        msg: String,
    },
    /// A tokenizer file could not be read or parsed.
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    /// The text could not be tokenized.
    #[error("{model}: cannot tokenize: {msg}")]
    Encode { model: String, msg: String },
    /// The model ships no chat template.
    #[error("model '{model}' has no chat template (no tokenizer.chat_template in its metadata); pass a template explicitly (--chat-template)")]
    NoChatTemplate { model: String },
    /// The chat template failed to parse or render.
    #[error("{model}: chat template: {msg}")]
    Template { model: String, msg: String },
    /// Reading the GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] npuc_gguf::GgufError),
    /// Metadata JSON (as an artifact stores it) that is not valid GGUF metadata.
    #[error(transparent)]
    MetaJson(#[from] npuc_gguf::MetaJsonError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// Which tokenization algorithm a [`Tokenizer`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// GGUF `llama`: SentencePiece-style merges by score, byte fallback.
    Spm,
    /// GGUF `gpt2`: byte-level BPE with the given pre-tokenizer.
    Bpe(PreType),
    /// A Hugging Face `tokenizer.json`.
    HfJson,
}

#[derive(Clone)]
enum Backend {
    Spm {
        byte_tokens: Box<[Option<u32>; 256]>,
    },
    Bpe(Box<bpe::Bpe>),
    Hf(Box<hf::HfBackend>),
}

/// A tokenizer: encode text to ids, decode ids to text, and render chat prompts. Cheap to
/// share across threads (`Send + Sync`, all methods take `&self`).
#[derive(Clone)]
pub struct Tokenizer {
    name: String,
    vocab: Vocab,
    special_index: SpecialIndex,
    backend: Backend,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    eot: Option<u32>,
    /// Sorted end-of-generation ids.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
    /// Inverse GPT-2 byte map (byte-level vocabularies).
    char_byte: std::collections::HashMap<char, u8>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn find<'a>(meta: &'a [(String, MetaValue)], key: &str) -> Option<&'a MetaValue> {
    meta.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF file from its `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
        Self::from_metadata_named(&gguf.name, &gguf.metadata)
    }

    /// Opens a GGUF file and builds its tokenizer.
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Tokenizer> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// Builds a tokenizer from GGUF metadata key/value pairs (what a `.npuc` artifact stores).
    /// The model is named by `general.name` in error messages.
    pub fn from_metadata(meta: &[(String, MetaValue)]) -> Result<Tokenizer> {
        let name = find(meta, "general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("model")
            .to_string();
        Self::from_metadata_named(&name, meta)
    }

    /// Builds a tokenizer from GGUF metadata in its JSON form ([`npuc_gguf::GgufMetaJson`], what
    /// an LLM artifact stores).
    pub fn from_metadata_json(json: &serde_json::Value) -> Result<Tokenizer> {
        Self::from_metadata(&npuc_gguf::GgufMetaJson::from_json(json)?.entries)
    }

    /// Like [`Tokenizer::from_metadata`] with an explicit model name for error messages.
    pub fn from_metadata_named(name: &str, meta: &[(String, MetaValue)]) -> Result<Tokenizer> {
        let err = |key: &str, msg: String| TokenizerError::Metadata {
            model: name.to_string(),
            key: key.to_string(),
            msg,
        };
        let model_key = "tokenizer.ggml.model";
        let model = find(meta, model_key)
            .ok_or_else(|| err(model_key, "missing (the file has no tokenizer)".into()))?
            .as_str()
            .ok_or_else(|| err(model_key, "not a string".into()))?;
        let tokens_key = "tokenizer.ggml.tokens";
        let tokens: Vec<&str> = find(meta, tokens_key)
            .ok_or_else(|| err(tokens_key, "missing".into()))?
            .as_str_array()
            .ok_or_else(|| err(tokens_key, "not an array of strings".into()))?;
        let n = tokens.len();
        if n == 0 {
            return Err(err(tokens_key, "empty vocabulary".into()));
        }
        let scores = match find(meta, "tokenizer.ggml.scores") {
            Some(v) => {
                let s = v.as_f32_array().ok_or_else(|| {
                    err("tokenizer.ggml.scores", "not an array of numbers".into())
                })?;
                if s.len() != n {
                    return Err(err(
                        "tokenizer.ggml.scores",
                        format!("{} scores for {n} tokens", s.len()),
                    ));
                }
                s
            }
            None => vec![0.0; n],
        };
        let types = match find(meta, "tokenizer.ggml.token_type") {
            Some(v) => {
                let t = v.as_i64_array().ok_or_else(|| {
                    err(
                        "tokenizer.ggml.token_type",
                        "not an array of integers".into(),
                    )
                })?;
                if t.len() != n {
                    return Err(err(
                        "tokenizer.ggml.token_type",
                        format!("{} types for {n} tokens", t.len()),
                    ));
                }
                t.into_iter().map(TokenType::from_gguf).collect()
            }
            None => vec![TokenType::Normal; n],
        };
        let mut vocab = Vocab::new(&tokens, scores, types).map_err(|m| err(tokens_key, m))?;

        let id_key = |key: &str| -> Result<Option<u32>> {
            match find(meta, key) {
                None => Ok(None),
                Some(v) => {
                    // llama.cpp writes -1 (as u32::MAX) for "none".
                    let id = v
                        .as_i64()
                        .ok_or_else(|| err(key, format!("not an integer: {v}")))?;
                    if id < 0 || id == u32::MAX as i64 {
                        Ok(None)
                    } else if (id as usize) < n {
                        Ok(Some(id as u32))
                    } else {
                        Err(err(
                            key,
                            format!("token id {id} is outside the vocabulary (size {n})"),
                        ))
                    }
                }
            }
        };
        let bool_key = |key: &str| -> Result<Option<bool>> {
            match find(meta, key) {
                None => Ok(None),
                Some(v) => v
                    .as_bool()
                    .map(Some)
                    .ok_or_else(|| err(key, format!("not a bool: {v}"))),
            }
        };
        let in_range = |id: u32| ((id as usize) < n).then_some(id);

        let (backend, mut bos, mut eos, mut unk, mut add_bos, mut add_space_prefix);
        match model {
            "llama" => {
                bos = in_range(1);
                eos = in_range(2);
                unk = in_range(0);
                add_bos = true;
                add_space_prefix = true;
                backend = Backend::Spm {
                    byte_tokens: Box::new(spm::byte_tokens(&vocab)),
                };
            }
            "gpt2" => {
                let pre_name = find(meta, "tokenizer.ggml.pre")
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                let pre = PreType::from_name(pre_name).ok_or_else(|| {
                    err(
                        "tokenizer.ggml.pre",
                        format!("pre-tokenizer '{pre_name}' is not supported (npuc knows default, gpt-2, llama-bpe/llama3, qwen2, starcoder/smollm families)"),
                    )
                })?;
                let merges_key = "tokenizer.ggml.merges";
                let merges = find(meta, merges_key)
                    .ok_or_else(|| err(merges_key, "missing (needed by a gpt2 tokenizer)".into()))?
                    .as_str_array()
                    .ok_or_else(|| err(merges_key, "not an array of strings".into()))?;
                let b = bpe::Bpe::new(&vocab, &merges, pre).map_err(|m| err(merges_key, m))?;
                bos = in_range(11);
                eos = in_range(11);
                unk = None;
                add_bos = pre.default_add_bos();
                add_space_prefix = false;
                backend = Backend::Bpe(Box::new(b));
            }
            other => {
                return Err(err(
                    model_key,
                    format!("tokenizer model '{other}' is not supported (npuc supports 'llama' (SentencePiece) and 'gpt2' (byte-level BPE) in GGUF; use a tokenizer.json for others)"),
                ))
            }
        }
        if let Some(id) = id_key("tokenizer.ggml.bos_token_id")? {
            bos = Some(id);
        }
        if let Some(id) = id_key("tokenizer.ggml.eos_token_id")? {
            eos = Some(id);
        }
        if let Some(id) = id_key("tokenizer.ggml.unknown_token_id")? {
            unk = Some(id);
        }
        let mut eot = id_key("tokenizer.ggml.eot_token_id")?;
        let eom = id_key("tokenizer.ggml.eom_token_id")?;
        if let Some(v) = bool_key("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }
        if let Some(v) = bool_key("tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        let add_eos = bool_key("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            add_bos = false;
        }

        // llama.cpp finds EOT / EOG tokens by name and forces those to CONTROL, so that they are
        // parsed as specials and not rendered as text. It scans a hash map, so when several EOT
        // names exist its pick is arbitrary; npuc takes the first in name order (turn markers
        // before `<|endoftext|>`).
        if eot.is_none() {
            eot = vocab::EOT_NAMES.iter().find_map(|t| vocab.id(t));
            if let Some(id) = eot {
                vocab.types[id as usize] = TokenType::Control;
            }
        }
        let mut eog: Vec<u32> = vocab::EOG_NAMES
            .iter()
            .filter_map(|t| vocab.id(t))
            .collect();
        for &id in &eog {
            vocab.types[id as usize] = TokenType::Control;
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        vocab.build_special_cache();
        let special_index = SpecialIndex::new(&vocab);
        let chat_template = find(meta, "tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        Ok(Tokenizer {
            name: name.to_string(),
            vocab,
            special_index,
            backend,
            bos,
            eos,
            unk,
            eot,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            chat_template,
            char_byte: bpe::char_to_byte(),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`. A `tokenizer_config.json` next to it supplies the
    /// chat template and the BOS/EOS token names when present.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Tokenizer> {
        hf::load(path.as_ref())
    }

    /// The model name used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tokenization algorithm.
    pub fn kind(&self) -> ModelKind {
        match &self.backend {
            Backend::Spm { .. } => ModelKind::Spm,
            Backend::Bpe(b) => ModelKind::Bpe(b.pre),
            Backend::Hf(_) => ModelKind::HfJson,
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The BOS token id, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token id, if the model has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The end-of-turn token id (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, ...), if any.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// The unknown token id, if any.
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// Whether `add_special` encoding prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `add_special` encoding appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generation should stop at `id` (llama.cpp's end-of-generation set: EOS, EOT, EOM
    /// and the tokens named `<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The vocabulary text of `id` as stored (e.g. `▁the`, `Ġthe`, `<0x0A>`), None if out of range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.get(id)
    }

    /// The type of `id`, None if out of range.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.vocab.types.get(id as usize).copied()
    }

    /// The id of a vocabulary text (exact match), if any.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// The chat template the model ships, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replaces (or removes) the chat template, e.g. with a `--chat-template` override.
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template;
    }

    /// Encodes `text`; `add_special` adds BOS/EOS as the model asks (`add_bos`/`add_eos`).
    /// Special-token texts in `text` (`<start_of_turn>`, `<|im_start|>`, ...) become their single
    /// ids (llama.cpp's `parse_special = true`, what it does for prompts).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Encodes `text` with explicit control of special-token parsing: with `parse_special ==
    /// false` control-token texts are tokenized as ordinary text (user-defined tokens are still
    /// matched, as in llama.cpp). For a `tokenizer.json` the HF library decides (it always matches
    /// its added tokens).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        let enc_err = |msg: String| TokenizerError::Encode {
            model: self.name.clone(),
            msg,
        };
        if let Backend::Hf(h) = &self.backend {
            return h.encode(text, add_special).map_err(enc_err);
        }
        let frags = special::partition(&self.vocab, &self.special_index, text, parse_special);
        // llama.cpp makes no fragment at all for empty text (so SPM adds no prefix space).
        let frags = if text.is_empty() { Vec::new() } else { frags };
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.backend {
            Backend::Spm { byte_tokens } => {
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Fragment::Text { start, end } => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('▁');
                            }
                            for ch in text[start..end].chars() {
                                buf.push(if ch == ' ' { '▁' } else { ch });
                            }
                            spm::tokenize(&self.vocab, byte_tokens, self.unk, &buf, &mut out).map_err(|b| {
                                enc_err(format!(
                                    "byte 0x{b:02X} has no token (<0x{b:02X}>) and the model has no unknown token"
                                ))
                            })?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Backend::Bpe(b) => {
                for f in frags {
                    match f {
                        Fragment::Text { start, end } => b
                            .tokenize(&self.vocab, &text[start..end], &mut out)
                            .map_err(enc_err)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Backend::Hf(_) => unreachable!("handled above"),
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// The bytes `id` renders to (llama.cpp's `token_to_piece` without special tokens): control
    /// and unknown tokens render as nothing, byte tokens as their byte, `▁` as a space, byte-level
    /// BPE pieces through the inverse GPT-2 byte map. Out-of-range ids render as nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut v = Vec::new();
        self.render(id, false, &mut v);
        v
    }

    /// Like [`Tokenizer::token_bytes`] but control/unknown tokens render their text
    /// (`<end_of_turn>`), like llama.cpp with `special = true`.
    pub fn token_bytes_special(&self, id: u32) -> Vec<u8> {
        let mut v = Vec::new();
        self.render(id, true, &mut v);
        v
    }

    fn render(&self, id: u32, special: bool, out: &mut Vec<u8>) {
        let Some(text) = self.vocab.get(id) else {
            return;
        };
        let ty = self.vocab.types[id as usize];
        match ty {
            TokenType::Control | TokenType::Unknown => {
                if special {
                    out.extend_from_slice(text.as_bytes());
                }
                return;
            }
            TokenType::UserDefined => {
                out.extend_from_slice(text.as_bytes());
                return;
            }
            _ => {}
        }
        match &self.backend {
            Backend::Spm { .. } => match ty {
                TokenType::Normal => {
                    for ch in text.chars() {
                        let c = if ch == '▁' { ' ' } else { ch };
                        let mut b = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                    }
                }
                TokenType::Byte => {
                    if let Some(b) = text
                        .strip_prefix("<0x")
                        .and_then(|s| s.strip_suffix('>'))
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        out.push(b);
                    }
                }
                _ => {}
            },
            Backend::Bpe(_) => {
                if ty == TokenType::Normal {
                    self.unmap_bytelevel(text, out);
                }
            }
            Backend::Hf(h) => h.render_piece(self, text, out),
        }
    }

    /// Maps a byte-level piece back to bytes; characters outside the map are kept as UTF-8.
    fn unmap_bytelevel(&self, text: &str, out: &mut Vec<u8>) {
        for ch in text.chars() {
            match self.char_byte.get(&ch) {
                Some(&b) => out.push(b),
                None => {
                    let mut b = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
            }
        }
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD). Control tokens (BOS, EOS, ...) render
    /// as nothing. As llama.cpp's `llama_detokenize`, with `add_space_prefix` one leading space of
    /// the first token is removed (so `decode(encode(s, false)) == s`); when the first id is BOS the
    /// space after it is kept, as llama.cpp does.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// [`Tokenizer::decode`], optionally rendering control tokens' text (`special`).
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        if let Backend::Hf(h) = &self.backend {
            if let Some(s) = h.decode(ids, !special) {
                return s;
            }
        }
        let mut out = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let start = out.len();
            self.render(id, special, &mut out);
            if i == 0 && self.add_space_prefix && out.len() > start && out[start] == b' ' {
                out.remove(start);
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Renders the model's chat template for `messages` (see [`Tokenizer::apply_template`]), ready
    /// for `encode(text, true)`. Err when the model has no template, naming the model.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self
            .chat_template
            .as_deref()
            .ok_or_else(|| TokenizerError::NoChatTemplate {
                model: self.name.clone(),
            })?;
        self.apply_template(t, messages, add_generation_prompt)
    }

    /// Renders a Jinja chat `template` for `encode(text, true)`: like llama.cpp's
    /// `common_chat_templates_apply`, a leading BOS text is removed when encoding adds BOS (and a
    /// trailing EOS text when it adds EOS), so the prompt gets exactly one BOS.
    pub fn apply_template(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut text = self.render_template(template, messages, add_generation_prompt)?;
        if self.add_bos {
            if let Some(b) = self
                .bos
                .and_then(|b| self.token_text(b))
                .filter(|b| !b.is_empty())
            {
                if text.starts_with(b) {
                    text.drain(..b.len());
                }
            }
        }
        if self.add_eos {
            if let Some(e) = self
                .eos
                .and_then(|e| self.token_text(e))
                .filter(|e| !e.is_empty())
            {
                if text.ends_with(e) {
                    text.truncate(text.len() - e.len());
                }
            }
        }
        Ok(text)
    }

    /// Renders a Jinja chat `template` exactly as HF transformers' `apply_chat_template(...,
    /// tokenize=False)` does (variables `messages`, `add_generation_prompt`, `bos_token`,
    /// `eos_token`; `raise_exception`; Python string methods; trim_blocks + lstrip_blocks).
    pub fn render_template(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let text = |id: Option<u32>| {
            id.and_then(|i| self.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        chat::render(
            template,
            messages,
            add_generation_prompt,
            &text(self.bos),
            &text(self.eos),
        )
        .map_err(|msg| TokenizerError::Template {
            model: self.name.clone(),
            msg,
        })
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }
}

/// Turns a stream of token ids into text, holding back the bytes of an incomplete UTF-8
/// character (a byte-fallback or byte-level piece can end mid-character) until it completes.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with nothing pending.
    pub fn new(tok: &'a Tokenizer) -> StreamDecoder<'a> {
        StreamDecoder {
            tok,
            pending: Vec::new(),
        }
    }

    /// Adds one id and returns the text that is now complete (possibly empty). Bytes that can
    /// never form valid UTF-8 are emitted as U+FFFD.
    pub fn push(&mut self, id: u32) -> String {
        self.tok.render(id, false, &mut self.pending);
        self.take_complete()
    }

    /// Returns whatever is pending (an incomplete character becomes U+FFFD) and clears it.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // from_utf8 just validated this prefix.
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        None => {
                            // Incomplete character at the end: keep it for the next piece.
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}
