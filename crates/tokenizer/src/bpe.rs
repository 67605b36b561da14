//! Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`) as llama.cpp's `llm_tokenizer_bpe`
//! does it: split the text with the pre-tokenizer regexes chosen by `tokenizer.ggml.pre`, map each
//! word's bytes to the GPT-2 byte alphabet, then apply merges lowest rank first (ties: leftmost).
//!
//! Symbols are interned as ids (vocabulary ids plus extra ids for merge sides that are not
//! vocabulary pieces), and merges are keyed by id pairs, so the merge loop does no string work.

use crate::fxhash::FxHashMap;
use crate::vocab::Vocab;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GPT-2's reversible byte → printable character map (`bytes_to_unicode`).
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).expect("latin-1 code point")
        } else {
            let c = char::from_u32(256 + n).expect("code point below 512");
            n += 1;
            c
        };
    }
    map
}

/// Inverse of [`byte_to_char`].
pub(crate) fn char_to_byte() -> HashMap<char, u8> {
    byte_to_char()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// Pre-tokenizer families of llama.cpp (`LLAMA_VOCAB_PRE_TYPE_*`) that npuc supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreType {
    /// `default` (and an absent `tokenizer.ggml.pre`).
    Default,
    /// GPT-2's regex (`gpt-2`, `phi-2`, ...).
    Gpt2,
    /// Llama 3 (`llama-bpe`, `llama3`, ...): digits in groups of up to three, merges ignored for
    /// words that are whole vocabulary pieces, BOS added.
    Llama3,
    /// Qwen 2 (`qwen2`, ...): like Llama 3 with single digits.
    Qwen2,
    /// StarCoder family (`starcoder`, `refact`, `command-r`, `smollm`, ...): digits split first.
    StarCoder,
}

impl PreType {
    /// Maps a `tokenizer.ggml.pre` value; None for names npuc does not know.
    pub fn from_name(name: &str) -> Option<PreType> {
        Some(match name {
            "" | "default" => PreType::Default,
            "gpt-2" | "gpt2" | "phi-2" | "roberta-bpe" | "gigachat" | "jina-es" | "jina-de"
            | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" => PreType::Gpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" => PreType::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreType::Qwen2,
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" => PreType::StarCoder,
            _ => return None,
        })
    }

    /// llama.cpp's default for `add_bos` before `tokenizer.ggml.add_bos_token` overrides it.
    pub fn default_add_bos(self) -> bool {
        self == PreType::Llama3
    }

    /// Whether a word that is itself a vocabulary piece skips merging (llama.cpp `ignore_merges`).
    pub fn ignore_merges(self) -> bool {
        self == PreType::Llama3
    }

    /// The regexes llama.cpp applies in sequence (each splits the pieces left by the previous one).
    pub fn regexes(self) -> &'static [&'static str] {
        const GPT2: &str =
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
        match self {
            PreType::Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
            PreType::Gpt2 => &[GPT2],
            PreType::Llama3 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreType::Qwen2 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreType::StarCoder => &[r"\p{N}", GPT2],
        }
    }
}

struct Bigram {
    rank: u32,
    left: u32,
    right: u32,
    left_sym: u32,
    right_sym: u32,
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
    /// Max-heap order: lowest rank first, then the smaller left index.
    fn cmp(&self, o: &Self) -> Ordering {
        o.rank.cmp(&self.rank).then_with(|| o.left.cmp(&self.left))
    }
}

/// Sentinel for a character that is no symbol at all (neither a piece nor a merge side).
const NO_SYM: u32 = u32::MAX;

/// The byte-level BPE model.
#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    pub pre: PreType,
    regexes: Vec<fancy_regex::Regex>,
    n_vocab: u32,
    /// Texts of interned symbols that are not vocabulary pieces (id = n_vocab + index).
    extra: Vec<String>,
    /// (left, right) symbol ids → (rank, merged symbol id).
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// Symbol of each raw byte's mapped character.
    byte_sym: [u32; 256],
    byte_char: [char; 256],
}

impl Bpe {
    /// Builds the model; `merges` are GGUF's `"left right"` strings (rank = index; a repeated pair
    /// keeps its first rank, as llama.cpp's `emplace`). Err describes the first malformed merge.
    pub fn new(vocab: &Vocab, merges: &[&str], pre: PreType) -> Result<Bpe, String> {
        let regexes = pre
            .regexes()
            .iter()
            .map(|r| {
                fancy_regex::Regex::new(r).map_err(|e| format!("pre-tokenizer regex {r:?}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let n_vocab = vocab.len() as u32;
        let mut extra: Vec<String> = Vec::new();
        let mut extra_ids: FxHashMap<String, u32> = FxHashMap::default();
        let mut intern = |s: &str, extra: &mut Vec<String>| -> u32 {
            if let Some(id) = vocab.id(s) {
                return id;
            }
            if let Some(&id) = extra_ids.get(s) {
                return id;
            }
            let id = n_vocab + extra.len() as u32;
            extra.push(s.to_string());
            extra_ids.insert(s.to_string(), id);
            id
        };
        let mut map = FxHashMap::with_capacity_and_hasher(merges.len(), Default::default());
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after position 0.
            let pos = m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i)
                .ok_or_else(|| {
                    format!("merge #{rank} {m:?} has no space separating its two sides")
                })?;
            let (l, r) = (&m[..pos], &m[pos + 1..]);
            let ls = intern(l, &mut extra);
            let rs = intern(r, &mut extra);
            let joined = format!("{l}{r}");
            let js = intern(&joined, &mut extra);
            map.entry((ls, rs)).or_insert((rank as u32, js));
        }
        let byte_char = byte_to_char();
        let mut byte_sym = [NO_SYM; 256];
        for b in 0..256 {
            let s = byte_char[b].to_string();
            byte_sym[b] = vocab
                .id(&s)
                .or_else(|| extra_ids.get(&s).copied())
                .unwrap_or(NO_SYM);
        }
        Ok(Bpe {
            pre,
            regexes,
            n_vocab,
            extra,
            merges: map,
            byte_sym,
            byte_char,
        })
    }

    /// Splits `text` into words (byte ranges) with the pre-tokenizer regexes.
    pub fn pre_split(&self, text: &str) -> Result<Vec<(usize, usize)>, String> {
        let mut spans = vec![(0usize, text.len())];
        for re in &self.regexes {
            let mut out = Vec::with_capacity(spans.len() * 2);
            for &(s, e) in &spans {
                let sub = &text[s..e];
                let mut last = 0;
                for m in re.find_iter(sub) {
                    let m =
                        m.map_err(|err| format!("pre-tokenizer regex failed at byte {s}: {err}"))?;
                    if m.start() > last {
                        out.push((s + last, s + m.start()));
                    }
                    if m.end() > m.start() {
                        out.push((s + m.start(), s + m.end()));
                    }
                    last = m.end();
                }
                if last < sub.len() {
                    out.push((s + last, e));
                }
            }
            spans = out;
        }
        Ok(spans)
    }

    fn sym_text<'a>(&'a self, vocab: &'a Vocab, id: u32) -> &'a str {
        if id < self.n_vocab {
            vocab.token(id)
        } else {
            &self.extra[(id - self.n_vocab) as usize]
        }
    }

    /// Tokenizes one raw-text fragment, appending ids to `out`.
    pub fn tokenize(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let mut mapped = String::new();
        let mut syms: Vec<(u32, i32, i32, u32)> = Vec::new(); // (sym, prev, next, alive)
        let mut heap = BinaryHeap::new();
        for (s, e) in self.pre_split(text)? {
            let word = &text.as_bytes()[s..e];
            if self.pre.ignore_merges() {
                mapped.clear();
                mapped.extend(word.iter().map(|&b| self.byte_char[b as usize]));
                if let Some(id) = vocab.id(&mapped) {
                    out.push(id);
                    continue;
                }
            }
            syms.clear();
            heap.clear();
            for (i, &b) in word.iter().enumerate() {
                let next = if i + 1 == word.len() {
                    -1
                } else {
                    i as i32 + 1
                };
                syms.push((self.byte_sym[b as usize], i as i32 - 1, next, 1));
            }
            let add =
                |syms: &[(u32, i32, i32, u32)], heap: &mut BinaryHeap<Bigram>, l: i32, r: i32| {
                    if l < 0 || r < 0 {
                        return;
                    }
                    let (ls, rs) = (syms[l as usize].0, syms[r as usize].0);
                    if ls == NO_SYM || rs == NO_SYM {
                        return;
                    }
                    if let Some(&(rank, _)) = self.merges.get(&(ls, rs)) {
                        heap.push(Bigram {
                            rank,
                            left: l as u32,
                            right: r as u32,
                            left_sym: ls,
                            right_sym: rs,
                        });
                    }
                };
            for i in 1..syms.len() {
                add(&syms, &mut heap, i as i32 - 1, i as i32);
            }
            while let Some(b) = heap.pop() {
                let (l, r) = (b.left as usize, b.right as usize);
                if syms[l].3 == 0
                    || syms[r].3 == 0
                    || syms[l].0 != b.left_sym
                    || syms[r].0 != b.right_sym
                {
                    continue; // outdated
                }
                let merged = self.merges[&(b.left_sym, b.right_sym)].1;
                syms[l].0 = merged;
                syms[r].3 = 0;
                syms[l].2 = syms[r].2;
                let rn = syms[r].2;
                if rn >= 0 {
                    syms[rn as usize].1 = l as i32;
                }
                let (p, nx) = (syms[l].1, syms[l].2);
                add(&syms, &mut heap, p, l as i32);
                add(&syms, &mut heap, l as i32, nx);
            }
            let mut i = if syms.is_empty() { -1 } else { 0 };
            while i != -1 {
                let (sym, _, next, _) = syms[i as usize];
                if sym < self.n_vocab {
                    out.push(sym);
                } else {
                    // Not a vocabulary piece: llama.cpp emits the one-byte pieces of its text that exist.
                    let t: String = if sym == NO_SYM {
                        self.byte_char[word[i as usize] as usize].to_string()
                    } else {
                        self.sym_text(vocab, sym).to_string()
                    };
                    for &b in t.as_bytes() {
                        if let Some(id) = (b < 0x80)
                            .then(|| vocab.id(std::str::from_utf8(&[b]).unwrap_or("")))
                            .flatten()
                        {
                            out.push(id);
                        }
                    }
                }
                i = next;
            }
        }
        Ok(())
    }
}
