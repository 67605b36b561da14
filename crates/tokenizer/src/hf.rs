//! Hugging Face `tokenizer.json` support through the `tokenizers` crate (BPE, Unigram, WordPiece
//! models with their normalizers, pre-tokenizers and post-processors).

use crate::special::SpecialIndex;
use crate::vocab::{self, TokenType, Vocab};
use crate::{Backend, Result, Tokenizer, TokenizerError};
use std::path::Path;

/// The wrapped HF tokenizer and how its pieces map to bytes.
#[derive(Clone)]
pub(crate) struct HfBackend {
    tk: tokenizers::Tokenizer,
    /// Pieces are in GPT-2's byte alphabet (ByteLevel decoder).
    byte_level: bool,
    /// WordPiece continuation prefix (`##`), stripped when rendering a piece.
    continuing_prefix: Option<String>,
}

impl HfBackend {
    pub fn encode(&self, text: &str, add_special: bool) -> std::result::Result<Vec<u32>, String> {
        self.tk
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// HF's decode (its decoder chain, e.g. ByteLevel or Metaspace + ByteFallback); None when the
    /// library rejects the ids.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Option<String> {
        self.tk.decode(ids, skip_special).ok()
    }

    /// Renders one normal piece to bytes.
    pub fn render_piece(&self, tok: &Tokenizer, text: &str, out: &mut Vec<u8>) {
        if self.byte_level {
            tok.unmap_bytelevel(text, out);
            return;
        }
        if let Some(b) = text
            .strip_prefix("<0x")
            .and_then(|s| s.strip_suffix('>'))
            .filter(|h| h.len() == 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            return;
        }
        let text = match &self.continuing_prefix {
            Some(p) => text.strip_prefix(p.as_str()).unwrap_or(text),
            None => text,
        };
        out.extend_from_slice(text.replace('▁', " ").as_bytes());
    }
}

fn token_content(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn load(path: &Path) -> Result<Tokenizer> {
    let ferr = |msg: String| TokenizerError::File {
        path: path.to_path_buf(),
        msg,
    };
    let raw = std::fs::read_to_string(path).map_err(|e| ferr(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&raw).map_err(|e| ferr(format!("invalid JSON: {e}")))?;
    let tk = tokenizers::Tokenizer::from_file(path).map_err(|e| {
        ferr(format!(
            "not a tokenizer.json the tokenizers library accepts: {e}"
        ))
    })?;
    let byte_level = json
        .get("decoder")
        .map(|d| d.to_string().contains("\"ByteLevel\""))
        .unwrap_or(false);
    let continuing_prefix = json
        .get("model")
        .filter(|m| m.get("type").and_then(|t| t.as_str()) == Some("WordPiece"))
        .and_then(|m| m.get("continuing_subword_prefix"))
        .and_then(|p| p.as_str())
        .map(str::to_string);

    let vocab_map = tk.get_vocab(true);
    let n = vocab_map
        .values()
        .map(|&i| i as usize + 1)
        .max()
        .unwrap_or(0);
    if n == 0 {
        return Err(ferr("empty vocabulary".into()));
    }
    let mut tokens = vec![String::new(); n];
    for (t, &i) in &vocab_map {
        tokens[i as usize] = t.clone();
    }
    let mut types: Vec<TokenType> = tokens
        .iter()
        .map(|t| {
            let is_byte = !byte_level && t.len() == 6 && t.starts_with("<0x") && t.ends_with('>');
            if is_byte {
                TokenType::Byte
            } else {
                TokenType::Normal
            }
        })
        .collect();
    if let Some(added) = json.get("added_tokens").and_then(|a| a.as_array()) {
        for a in added {
            let (Some(id), Some(special)) = (
                a.get("id").and_then(|v| v.as_u64()),
                a.get("special").and_then(|v| v.as_bool()),
            ) else {
                continue;
            };
            if (id as usize) < n {
                types[id as usize] = if special {
                    TokenType::Control
                } else {
                    TokenType::UserDefined
                };
            }
        }
    }
    let name = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());

    // tokenizer_config.json next to it: chat template and BOS/EOS names.
    let mut chat_template = None;
    let (mut bos_name, mut eos_name) = (None, None);
    let cfg_path = path.with_file_name("tokenizer_config.json");
    if let Ok(cfg_raw) = std::fs::read_to_string(&cfg_path) {
        let cfg: serde_json::Value =
            serde_json::from_str(&cfg_raw).map_err(|e| TokenizerError::File {
                path: cfg_path.clone(),
                msg: format!("invalid JSON: {e}"),
            })?;
        chat_template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: use "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        bos_name = cfg.get("bos_token").and_then(token_content);
        eos_name = cfg.get("eos_token").and_then(token_content);
    }
    let mut vocab = Vocab::new(&tokens, vec![0.0; n], types).map_err(ferr)?;
    let bos = bos_name.and_then(|b| vocab.id(&b));
    let eos = eos_name.and_then(|e| vocab.id(&e));
    let unk = ["<unk>", "[UNK]"].iter().find_map(|t| vocab.id(t));
    let eot = vocab::EOT_NAMES.iter().find_map(|t| vocab.id(t));
    let mut eog: Vec<u32> = vocab::EOG_NAMES
        .iter()
        .filter_map(|t| vocab.id(t))
        .collect();
    for &id in &eog {
        vocab.types[id as usize] = TokenType::Control;
    }
    eog.extend([eos, eot].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();
    vocab.build_special_cache();
    let special_index = SpecialIndex::new(&vocab);
    let backend = HfBackend {
        tk,
        byte_level,
        continuing_prefix,
    };
    // What the post-processor adds around a sequence tells whether BOS/EOS are added.
    let probe = backend.encode("a", true).map_err(ferr)?;
    let add_bos = bos.is_some() && probe.first() == bos.as_ref();
    let add_eos = eos.is_some() && probe.len() > 1 && probe.last() == eos.as_ref();
    Ok(Tokenizer {
        name,
        vocab,
        special_index,
        backend: Backend::Hf(Box::new(backend)),
        bos,
        eos,
        unk,
        eot,
        eog,
        add_bos,
        add_eos,
        add_space_prefix: false,
        chat_template,
        char_byte: crate::bpe::char_to_byte(),
    })
}
