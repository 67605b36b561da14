//! Chat templates rendered by minijinja against Python jinja2 configured as HF transformers'
//! `apply_chat_template` (tests/fixtures/llm/chat/refs.json, made by make_refs.py there), and the
//! `tokenizer.json` backend against the HF ids of the tiny models.

use npuc_tokenizer::{ChatMessage, ModelKind, Tokenizer};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

fn load_json(p: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The tokenizer whose BOS/EOS texts the reference rendering used.
fn tokenizer_for(template: &str) -> Tokenizer {
    match template {
        "chatml" => {
            Tokenizer::from_gguf_path(fixtures().join("tiny-qwen2/tiny-qwen2-F32.gguf")).unwrap()
        }
        "llama3" => {
            Tokenizer::from_gguf_path(fixtures().join("tiny-llama3/tiny-llama3-F32.gguf")).unwrap()
        }
        _ => Tokenizer::from_gguf_path(fixtures().join("tiny-llama-spm/tiny-llama-spm-F32.gguf"))
            .unwrap(),
    }
}

#[test]
fn templates_match_jinja2() {
    let refs = load_json(fixtures().join("chat/refs.json"));
    let cases = refs.as_array().unwrap();
    assert_eq!(cases.len(), 24);
    let mut checked = 0;
    for c in cases {
        let name = c["template"].as_str().unwrap();
        let tmpl = std::fs::read_to_string(fixtures().join(format!("chat/{name}.jinja"))).unwrap();
        let msgs: Vec<ChatMessage> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let agp = c["add_generation_prompt"].as_bool().unwrap();
        let mut tok = tokenizer_for(name);
        let bos = tok
            .bos()
            .and_then(|b| tok.token_text(b))
            .unwrap_or("")
            .to_string();
        if name == "gemma3" {
            // Rendered with "<bos>"/"<eos>" in the reference; no tiny model has those texts.
            assert_eq!(c["bos_token"], "<bos>");
        } else if name != "chatml" {
            assert_eq!(c["bos_token"].as_str().unwrap(), bos, "{name}");
        }
        let got = tok.render_template(&tmpl, &msgs, agp);
        // apply_* drop the leading BOS text that encode(.., true) adds back.
        tok.set_chat_template(Some(tmpl.clone()));
        if let (Ok(raw), Ok(applied)) = (&got, tok.apply_chat_template(&msgs, agp)) {
            let stripped = if tok.add_bos() {
                raw.strip_prefix(bos.as_str()).unwrap_or(raw)
            } else {
                raw
            };
            assert_eq!(applied, stripped, "{name}/{agp}");
        }
        let conv = c["conversation"].as_str().unwrap();
        match (&c.get("ok"), got) {
            (Some(want), Ok(text)) if name != "gemma3" => {
                assert_eq!(&text, want.as_str().unwrap(), "{name}/{conv}/{agp}")
            }
            (Some(want), Ok(text)) => {
                // Same template with the reference's BOS text.
                assert_eq!(
                    text.replacen("<s>", "<bos>", 1),
                    want.as_str().unwrap(),
                    "{name}/{conv}/{agp}"
                );
            }
            (None, Err(e)) => {
                let want = c["error"].as_str().unwrap();
                assert!(e.to_string().contains(want), "{name}/{conv}: {e}");
            }
            (w, g) => panic!("{name}/{conv}/{agp}: reference {w:?}, got {g:?}"),
        }
        checked += 1;
    }
    assert_eq!(checked, 24);
}

#[test]
fn chatml_prompt_tokenizes_with_special_ids() {
    let mut tok = tokenizer_for("chatml");
    tok.set_chat_template(Some(
        std::fs::read_to_string(fixtures().join("chat/chatml.jinja")).unwrap(),
    ));
    let msgs = [ChatMessage::new("user", "Hello world")];
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    let ids = tok.encode(&text, true).unwrap();
    // <|im_start|> 510 ... <|im_end|> 511, three turns opened (system, user, assistant).
    assert_eq!(ids[0], 510);
    assert_eq!(ids.iter().filter(|&&i| i == 510).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 511).count(), 2);
    assert_eq!(tok.decode_with(&ids, true), text);
}

#[test]
fn template_syntax_errors_name_the_model() {
    let tok = tokenizer_for("chatml");
    let e = tok
        .apply_template(
            "{% for m in messages %}{{ m.content ",
            &[ChatMessage::new("user", "x")],
            false,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tiny-qwen2") && e.contains("chat template"),
        "{e}"
    );
}

#[test]
fn tokenizer_json_matches_hf_ids() {
    for (model, pre_bos) in [("tiny-llama3", true), ("tiny-qwen2", false)] {
        let path = fixtures().join(model).join("hf/tokenizer.json");
        let tok = Tokenizer::from_tokenizer_json(&path).unwrap();
        assert_eq!(tok.kind(), ModelKind::HfJson);
        assert_eq!(tok.add_bos(), pre_bos, "{model}");
        let gguf_tok =
            Tokenizer::from_gguf_path(fixtures().join(model).join(format!("{model}-F32.gguf")))
                .unwrap();
        assert_eq!(tok.vocab_size(), gguf_tok.vocab_size());
        assert_eq!(tok.eos(), gguf_tok.eos(), "{model}");
        let t = load_json(fixtures().join(model).join("tokenizer_tests.json"));
        for c in t["cases"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let want = ids(&c["hf_ids"]);
            assert_eq!(tok.encode(text, true).unwrap(), want, "{model}: {text:?}");
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids(&c["hf_ids_no_special"]),
                "{model}: {text:?}"
            );
            assert_eq!(tok.decode(&want), text, "{model}: decode");
            // Piece bytes agree with the GGUF tokenizer's.
            for &id in &want {
                assert_eq!(
                    tok.token_bytes(id),
                    gguf_tok.token_bytes(id),
                    "{model}: piece {id}"
                );
            }
            let mut dec = tok.stream_decoder();
            let mut s: String = want.iter().map(|&i| dec.push(i)).collect();
            s.push_str(&dec.flush());
            assert_eq!(s, text);
        }
        assert!(tok.is_eog(gguf_tok.eos().unwrap()));
    }
    let e = Tokenizer::from_tokenizer_json(fixtures().join("nonexistent/tokenizer.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nonexistent"), "{e}");
}

/// The GGUF byte-level BPE (hand-written, llama.cpp's algorithm) and HF's `tokenizers` library
/// (reading the model's tokenizer.json) are independent implementations; on ordinary text they
/// must give the same ids.
#[test]
fn gguf_bpe_agrees_with_hf_tokenizers_on_100kb_text() {
    let text = std::fs::read_to_string(fixtures().join("gemma3/ppl_text.txt")).unwrap();
    for model in ["tiny-llama3", "tiny-qwen2"] {
        let hf = Tokenizer::from_tokenizer_json(fixtures().join(model).join("hf/tokenizer.json"))
            .unwrap();
        let gg =
            Tokenizer::from_gguf_path(fixtures().join(model).join(format!("{model}-F32.gguf")))
                .unwrap();
        let a = gg.encode(&text, true).unwrap();
        let b = hf.encode(&text, true).unwrap();
        if a != b {
            let i = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x != y)
                .unwrap_or(a.len().min(b.len()));
            panic!(
                "{model}: first difference at token {i}: gguf {:?} vs hf {:?} (context {:?})",
                &a[i..(i + 8).min(a.len())],
                &b[i..(i + 8).min(b.len())],
                gg.decode(&a[i.saturating_sub(8)..(i + 8).min(a.len())])
            );
        }
        assert_eq!(gg.decode(&a), text, "{model}");
        // Line by line as well (different fragment boundaries).
        for line in text.lines().take(300) {
            assert_eq!(
                gg.encode(line, false).unwrap(),
                hf.encode(line, false).unwrap(),
                "{model}: {line:?}"
            );
        }
    }
}

#[test]
fn spm_round_trips_100kb_text() {
    let text = std::fs::read_to_string(fixtures().join("gemma3/ppl_text.txt")).unwrap();
    let tok = Tokenizer::from_gguf_path(fixtures().join("tiny-llama-spm/tiny-llama-spm-F32.gguf"))
        .unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(tok.decode(&ids), text);
    // With BOS, llama.cpp's detokenizer keeps the prefix space after it.
    let with = tok.encode(&text, true).unwrap();
    assert_eq!(&with[1..], &ids[..]);
    assert_eq!(tok.decode(&with), format!(" {text}"));
}

#[test]
fn gguf_bpe_agrees_with_hf_tokenizers_on_random_text() {
    let alphabet: Vec<char> = "ab xyZ09 123 4567 '\"sStTrRe've'LL'd .,;!?-_\n\r\n\t   \u{a0}\u{3000}éüßÆ—日本語😀🦀\u{0301}\u{0663}<>/|#$%^&*()"
        .chars()
        .collect();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for model in ["tiny-llama3", "tiny-qwen2"] {
        let hf = Tokenizer::from_tokenizer_json(fixtures().join(model).join("hf/tokenizer.json"))
            .unwrap();
        let gg =
            Tokenizer::from_gguf_path(fixtures().join(model).join(format!("{model}-F32.gguf")))
                .unwrap();
        for _ in 0..2000 {
            let len = (next() % 24) as usize;
            let s: String = (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect();
            assert_eq!(
                gg.encode(&s, false).unwrap(),
                hf.encode(&s, false).unwrap(),
                "{model}: {s:?}"
            );
        }
    }
}
