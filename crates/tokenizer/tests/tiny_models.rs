//! Token ids of the synthetic tiny models (tests/fixtures/llm/*) against the references: the HF
//! tokenizer / SentencePiece ids in `tokenizer_tests.json` and llama.cpp's ids in
//! `llamacpp_check.json`.

use npuc_tokenizer::{ModelKind, PreType, Tokenizer};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

fn load_json(p: PathBuf) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn tokenizer(model: &str) -> Tokenizer {
    Tokenizer::from_gguf_path(fixtures().join(model).join(format!("{model}-F32.gguf")))
        .expect("load tokenizer")
}

/// (text, reference ids with special tokens, reference ids without) per case.
fn cases(model: &str) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let t = load_json(fixtures().join(model).join("tokenizer_tests.json"));
    t["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let text = c["text"].as_str().unwrap().to_string();
            // SentencePiece's ids are authoritative for the SPM model (llama.cpp reproduces them).
            let (with, without) = match c.get("sentencepiece_ids") {
                Some(sp) => {
                    let with = ids(sp);
                    let without = with[1..].to_vec();
                    (with, without)
                }
                None => (ids(&c["hf_ids"]), ids(&c["hf_ids_no_special"])),
            };
            (text, with, without)
        })
        .collect()
}

fn check_model(model: &str) {
    let tok = tokenizer(model);
    let cases = cases(model);
    assert_eq!(cases.len(), 8);
    for (text, with, without) in &cases {
        assert_eq!(
            &tok.encode(text, true).unwrap(),
            with,
            "{model}: {text:?} with special tokens"
        );
        assert_eq!(
            &tok.encode(text, false).unwrap(),
            without,
            "{model}: {text:?} without special tokens"
        );
        assert_eq!(
            &tok.encode_with(text, false, false).unwrap(),
            without,
            "{model}: {text:?} parse_special=false"
        );
        // Lossless: decoding gives the text back.
        assert_eq!(
            &tok.decode(without),
            text,
            "{model}: round trip of {text:?}"
        );
    }
    // llama.cpp's own tokenization of the same strings.
    let lc = load_json(fixtures().join(model).join("llamacpp_check.json"));
    let lc_cases = lc["tokenizer"].as_array().unwrap();
    assert_eq!(lc_cases.len(), 8);
    for c in lc_cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&c["llamacpp_ids"]),
            "{model}: llama.cpp ids of {text:?}"
        );
    }
}

#[test]
fn tiny_llama_spm_matches_sentencepiece_and_llamacpp() {
    let tok = tokenizer("tiny-llama-spm");
    assert_eq!(tok.kind(), ModelKind::Spm);
    assert_eq!(
        (tok.bos(), tok.eos(), tok.unk()),
        (Some(1), Some(2), Some(0))
    );
    assert!(tok.add_bos() && !tok.add_eos());
    check_model("tiny-llama-spm");
}

#[test]
fn tiny_llama3_matches_hf_and_llamacpp() {
    let tok = tokenizer("tiny-llama3");
    assert_eq!(tok.kind(), ModelKind::Bpe(PreType::Llama3));
    assert_eq!((tok.bos(), tok.eos()), (Some(510), Some(511)));
    assert!(tok.add_bos());
    check_model("tiny-llama3");
}

#[test]
fn tiny_qwen2_matches_hf_and_llamacpp() {
    let tok = tokenizer("tiny-qwen2");
    assert_eq!(tok.kind(), ModelKind::Bpe(PreType::Qwen2));
    assert!(!tok.add_bos());
    check_model("tiny-qwen2");
}

#[test]
fn spm_decode_keeps_space_after_bos_like_llamacpp() {
    // llama_detokenize only removes the SPM prefix space when the first id is not BOS.
    let tok = tokenizer("tiny-llama-spm");
    let with = tok.encode("Hello world", true).unwrap();
    assert_eq!(with[0], 1);
    assert_eq!(tok.decode(&with), " Hello world");
    assert_eq!(tok.decode(&with[1..]), "Hello world");
    assert_eq!(tok.decode_with(&with, true), "<s> Hello world");
}

#[test]
fn eog_and_special_tokens() {
    let qwen = tokenizer("tiny-qwen2");
    // <|endoftext|> 509 (eos), <|im_start|> 510, <|im_end|> 511.
    assert!(qwen.is_eog(509) && qwen.is_eog(511) && !qwen.is_eog(510));
    assert_eq!(qwen.eot(), Some(511));
    let prompt = "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n";
    let got = qwen.encode(prompt, true).unwrap();
    let mut want = vec![510];
    want.extend(qwen.encode("user\nHello world", false).unwrap());
    want.push(511);
    want.extend(qwen.encode("\n", false).unwrap());
    want.push(510);
    want.extend(qwen.encode("assistant\n", false).unwrap());
    assert_eq!(got, want);
    // Without parse_special the markers are ordinary text.
    let plain = qwen.encode_with(prompt, false, false).unwrap();
    assert!(!plain.contains(&510) && !plain.contains(&511));
    assert_eq!(qwen.decode(&plain), prompt);
    // Control tokens render as nothing unless asked for.
    assert_eq!(qwen.decode(&got), "user\nHello world\nassistant\n");
    assert_eq!(qwen.decode_with(&got, true), prompt);

    let llama3 = tokenizer("tiny-llama3");
    assert!(llama3.is_eog(511) && !llama3.is_eog(510));
    let spm = tokenizer("tiny-llama-spm");
    assert!(spm.is_eog(2) && !spm.is_eog(1));
    // SPM: a special token in the text is its id, and the text after it gets the space prefix.
    let got = spm.encode("<s>Hi</s>", false).unwrap();
    let mut want = vec![1];
    want.extend(spm.encode("Hi", false).unwrap());
    want.push(2);
    assert_eq!(got, want);
}

/// Deterministic xorshift for the fuzz round trip.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_text_round_trips() {
    let alphabet: Vec<char> =
        "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,;:'!?-\n\t  éüß—日本語😀🦀\u{0301}<>/|s"
            .chars()
            .collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for model in ["tiny-llama-spm", "tiny-llama3", "tiny-qwen2"] {
        let tok = tokenizer(model);
        for _ in 0..300 {
            let len = (rng.next() % 40) as usize;
            let s: String = (0..len)
                .map(|_| alphabet[(rng.next() % alphabet.len() as u64) as usize])
                .collect();
            let ids = tok.encode_with(&s, false, false).unwrap();
            assert_eq!(
                tok.decode(&ids),
                s,
                "{model}: round trip of {s:?} ({ids:?})"
            );
            // Streaming gives the same text, piece by piece.
            let mut dec = tok.stream_decoder();
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&dec.push(id));
            }
            streamed.push_str(&dec.flush());
            // The SPM prefix space of the first piece is removed by decode only.
            let expect = if tok.kind() == ModelKind::Spm && !ids.is_empty() {
                format!(" {s}")
            } else {
                s.clone()
            };
            assert_eq!(streamed, expect, "{model}: streamed {s:?}");
        }
    }
}

#[test]
fn empty_and_edge_inputs() {
    for model in ["tiny-llama-spm", "tiny-llama3", "tiny-qwen2"] {
        let tok = tokenizer(model);
        assert_eq!(tok.encode("", false).unwrap(), Vec::<u32>::new(), "{model}");
        let with = tok.encode("", true).unwrap();
        assert_eq!(
            with,
            tok.bos()
                .filter(|_| tok.add_bos())
                .into_iter()
                .collect::<Vec<_>>(),
            "{model}"
        );
        assert_eq!(tok.decode(&[]), "");
        // Out-of-range ids render as nothing instead of panicking.
        assert_eq!(tok.token_bytes(u32::MAX), Vec::<u8>::new());
        assert_eq!(tok.decode(&[u32::MAX, 7_000_000]), "");
        assert_eq!(tok.vocab_size(), 512);
    }
}

#[test]
fn streaming_holds_back_partial_utf8() {
    // SPM byte fallback splits 😀 into four byte tokens; the character appears with the last one.
    let tok = tokenizer("tiny-llama-spm");
    let ids = tok.encode("😀", false).unwrap();
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&i| tok.token_bytes(i)).collect();
    assert!(ids.len() >= 4, "{ids:?} {bytes:?}");
    let mut dec = tok.stream_decoder();
    let outs: Vec<String> = ids.iter().map(|&i| dec.push(i)).collect();
    assert!(
        outs[..outs.len() - 1]
            .iter()
            .all(|s| s.is_empty() || s == " "),
        "{outs:?}"
    );
    assert!(outs.last().unwrap().ends_with('😀'));
    // An orphan continuation byte is not valid UTF-8 at all: U+FFFD, then normal text.
    let b80 = tok.token_id("<0x80>").unwrap();
    let a = tok.encode("a", false).unwrap();
    let mut dec = tok.stream_decoder();
    assert_eq!(dec.push(b80), "\u{FFFD}");
    let rest: String = a.iter().map(|&i| dec.push(i)).collect();
    assert_eq!(rest, " a");
    // An incomplete character left at the end is flushed as U+FFFD.
    let f0 = tok.token_id("<0xF0>").unwrap();
    let mut dec = tok.stream_decoder();
    assert_eq!(dec.push(f0), "");
    assert_eq!(dec.flush(), "\u{FFFD}");
}

#[test]
fn bad_metadata_is_a_clear_error() {
    use npuc_gguf::MetaValue;
    let gguf =
        npuc_gguf::GgufFile::open(fixtures().join("tiny-qwen2/tiny-qwen2-F32.gguf")).unwrap();
    let mut meta = gguf.metadata.clone();
    // Drop the merges: the error names the key.
    meta.retain(|(k, _)| k != "tokenizer.ggml.merges");
    let e = Tokenizer::from_metadata(&meta).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");
    // A BOS id outside the vocabulary.
    let mut meta = gguf.metadata.clone();
    for (k, v) in &mut meta {
        if k == "tokenizer.ggml.bos_token_id" {
            *v = MetaValue::U32(100_000);
        }
    }
    let e = Tokenizer::from_metadata(&meta).unwrap_err().to_string();
    assert!(e.contains("bos_token_id") && e.contains("100000"), "{e}");
    // An unknown pre-tokenizer.
    let mut meta = gguf.metadata.clone();
    for (k, v) in &mut meta {
        if k == "tokenizer.ggml.pre" {
            *v = MetaValue::String("made-up".into());
        }
    }
    let e = Tokenizer::from_metadata(&meta).unwrap_err().to_string();
    assert!(e.contains("made-up"), "{e}");
    // Scores of the wrong length.
    let spm = npuc_gguf::GgufFile::open(fixtures().join("tiny-llama-spm/tiny-llama-spm-F32.gguf"))
        .unwrap();
    let mut meta = spm.metadata.clone();
    for (k, v) in &mut meta {
        if k == "tokenizer.ggml.scores" {
            *v = MetaValue::Array(npuc_gguf::ValueType::F32, vec![MetaValue::F32(0.0); 3]);
        }
    }
    let e = Tokenizer::from_metadata(&meta).unwrap_err().to_string();
    assert!(e.contains("3 scores for 512 tokens"), "{e}");
    // No chat template in these files: the error names the model.
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let e = tok
        .apply_chat_template(&[npuc_tokenizer::ChatMessage::new("user", "hi")], true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tiny-qwen2") && e.contains("chat template"),
        "{e}"
    );
}

#[test]
fn metadata_json_round_trip() {
    for model in ["tiny-llama-spm", "tiny-llama3", "tiny-qwen2"] {
        let gguf =
            npuc_gguf::GgufFile::open(fixtures().join(model).join(format!("{model}-F32.gguf")))
                .unwrap();
        let kept = npuc_gguf::GgufMetaJson::filtered(&gguf.metadata, &["tokenizer.", "general."]);
        assert!(kept.get("tokenizer.ggml.tokens").is_some());
        let text = serde_json::to_string(&kept.to_json()).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        // Every value comes back with its GGUF type and bits.
        assert_eq!(
            npuc_gguf::GgufMetaJson::from_json(&back).unwrap(),
            kept,
            "{model}"
        );
        let a = tokenizer(model);
        let b = Tokenizer::from_metadata_json(&back).unwrap();
        for (text, with, _) in cases(model) {
            assert_eq!(b.encode(&text, true).unwrap(), with, "{model}: {text:?}");
            assert_eq!(a.encode(&text, true).unwrap(), with);
        }
        assert_eq!(
            (a.bos(), a.eos(), a.add_bos(), a.eog_ids()),
            (b.bos(), b.eos(), b.add_bos(), b.eog_ids())
        );
    }
    let e = Tokenizer::from_metadata_json(&serde_json::json!([1, 2]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not [key, {type, value}]"), "{e}");
    let e = Tokenizer::from_metadata_json(&serde_json::json!([[
        "tokenizer.ggml.token_type",
        {"type": "array", "value": {"type": "i32", "value": [1, "x", 2]}}
    ]]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("metadata 'tokenizer.ggml.token_type'"), "{e}");
}

/// SentencePiece itself (tests/fixtures/llm/tokenizer/make_spm_refs.py) on 300 lines and the
/// first 20k characters of the 100 KB licence text.
#[test]
fn spm_matches_sentencepiece_on_licence_text() {
    let refs = load_json(fixtures().join("tokenizer/spm_refs.json"));
    let tok = tokenizer("tiny-llama-spm");
    let lines = refs["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 300);
    let mut mismatched = Vec::new();
    for l in lines {
        let text = l["text"].as_str().unwrap();
        if tok.encode(text, false).unwrap() != ids(&l["ids"]) {
            mismatched.push(text.to_string());
        }
    }
    assert!(
        mismatched.is_empty(),
        "{} of 300 lines differ, e.g. {:?}",
        mismatched.len(),
        &mismatched[..mismatched.len().min(3)]
    );
    let text = std::fs::read_to_string(fixtures().join("gemma3/ppl_text.txt")).unwrap();
    let n = refs["head"]["text_chars"].as_u64().unwrap() as usize;
    let head: String = text.chars().take(n).collect();
    assert_eq!(tok.encode(&head, false).unwrap(), ids(&refs["head"]["ids"]));
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Tokenizer>();
    let tok = std::sync::Arc::new(tokenizer("tiny-llama3"));
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let tok = tok.clone();
            std::thread::spawn(move || tok.encode(&format!("thread {i} says hello"), true).unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let ids = h.join().unwrap();
        assert_eq!(tok.decode(&ids), format!("thread {i} says hello"));
    }
}

#[test]
fn long_degenerate_inputs() {
    // One huge "word" and long runs of spaces / multi-byte characters: no quadratic blow-up, no
    // panic, lossless.
    let inputs = [
        "a".repeat(200_000),
        " ".repeat(50_000),
        "😀".repeat(20_000),
        "\n\n x".repeat(20_000),
        "1234567890".repeat(10_000),
    ];
    for model in ["tiny-llama-spm", "tiny-llama3", "tiny-qwen2"] {
        let tok = tokenizer(model);
        for s in &inputs {
            let ids = tok.encode_with(s, false, false).unwrap();
            assert!(!ids.is_empty());
            assert!(
                tok.decode(&ids) == *s,
                "{model}: round trip of a {}-byte input",
                s.len()
            );
        }
    }
}
