//! Gemma 3 270M (262k-piece SentencePiece vocabulary in GGUF) against llama.cpp's and HF's ids
//! (tests/fixtures/llm/gemma3/, copied from /work/shared/reference/llm). The model comes from the
//! data cache (`scripts/fetch-data.sh gemma3-270m`); the tests fail, naming that command, without it.

use npuc_tokenizer::{ChatMessage, ModelKind, Tokenizer};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm/gemma3")
}

fn gemma() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let p = npuc_testsupport::gemma3_gguf();
        let t0 = Instant::now();
        let tok = Tokenizer::from_gguf_path(&p).expect("gemma tokenizer");
        eprintln!(
            "gemma3 tokenizer loaded in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        tok
    })
}

fn load_json(name: &str) -> Value {
    let p = fixtures().join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn prompts_match_llamacpp() {
    let tok = gemma();
    assert_eq!(tok.kind(), ModelKind::Spm);
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!((tok.bos(), tok.eos()), (Some(2), Some(1)));
    let refs = load_json("gemma3_270m_greedy.json");
    let prompts = refs["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 4);
    for p in prompts {
        let text = p["prompt"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&p["prompt_ids_bos"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&p["prompt_ids_nobos"]),
            "{text:?}"
        );
        assert_eq!(tok.decode(&ids(&p["prompt_ids_bos"])), text, "{text:?}");
        // Generated ids decode to llama.cpp's text, piece by piece and as a stream.
        let gen = ids(&p["gen_ids"]);
        let pieces: Vec<String> = p["gen_pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect();
        for (id, piece) in gen.iter().zip(&pieces) {
            assert_eq!(
                String::from_utf8(tok.token_bytes(*id)).unwrap(),
                *piece,
                "piece of {id}"
            );
        }
        let gen_text = p["gen_text"].as_str().unwrap();
        assert_eq!(tok.decode(&gen), gen_text);
        let mut dec = tok.stream_decoder();
        let mut s: String = gen.iter().map(|&i| dec.push(i)).collect();
        s.push_str(&dec.flush());
        assert_eq!(s, gen_text);
    }
    // The HF transformers reference (meta.json) agrees.
    let meta = load_json("meta.json");
    assert_eq!(
        tok.encode(meta["prompt"].as_str().unwrap(), true).unwrap(),
        ids(&meta["prompt_ids"])
    );
    assert_eq!(
        tok.decode(&ids(&meta["greedy_ids"])),
        meta["greedy_text"].as_str().unwrap()
    );
}

#[test]
fn special_tokens_and_eog() {
    let tok = gemma();
    let sot = tok.token_id("<start_of_turn>").unwrap();
    let eot = tok.token_id("<end_of_turn>").unwrap();
    assert_eq!((sot, eot), (105, 106));
    assert!(tok.is_eog(eot) && tok.is_eog(1) && !tok.is_eog(sot) && !tok.is_eog(2));
    let prompt = "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n";
    let got = tok.encode(prompt, true).unwrap();
    let mut want = vec![2, 105];
    want.extend(tok.encode("user", false).unwrap());
    want.push(107); // "\n" is a user-defined token, always matched whole
    want.extend(tok.encode("Why is the sky blue?", false).unwrap());
    want.extend([106, 107, 105]);
    want.extend(tok.encode("model", false).unwrap());
    want.push(107);
    assert_eq!(got, want);
    // parse_special = false: control-token text is ordinary text, user-defined "\n" still one id.
    let plain = tok.encode_with(prompt, false, false).unwrap();
    assert!(!plain.contains(&105) && !plain.contains(&106) && plain.contains(&107));
    assert_eq!(tok.decode(&plain), prompt);
    // The GGUF has no chat template: an explicit error naming the model; an override works.
    let msgs = [ChatMessage::new("user", "Hi")];
    let e = tok
        .apply_chat_template(&msgs, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat template"), "{e}");
    let tmpl = std::fs::read_to_string(fixtures().join("../chat/gemma3.jinja")).unwrap();
    let raw = tok.render_template(&tmpl, &msgs, true).unwrap();
    assert_eq!(
        raw,
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    // Ready for encode(.., true): exactly one BOS.
    let text = tok.apply_template(&tmpl, &msgs, true).unwrap();
    assert_eq!(text, &raw["<bos>".len()..]);
    let ids = tok.encode(&text, true).unwrap();
    assert_eq!(&ids[..3], &[2, 105, tok.encode("user", false).unwrap()[0]]);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
}

#[test]
fn long_text_is_fast_and_consistent() {
    let tok = gemma();
    let text = std::fs::read_to_string(fixtures().join("ppl_text.txt")).unwrap();
    assert_eq!(text.len(), 102_729);
    let t0 = Instant::now();
    let ids = tok.encode(&text, true).unwrap();
    let dt = t0.elapsed();
    eprintln!(
        "gemma3: {} bytes -> {} tokens in {:.1} ms ({:.1} MB/s)",
        text.len(),
        ids.len(),
        dt.as_secs_f64() * 1e3,
        text.len() as f64 / dt.as_secs_f64() / 1e6
    );
    // llama-perplexity -c 512 made 43 chunks of this text (gemma3_270m_ppl.json), so llama.cpp
    // produced between 43*512 and 44*512-1 tokens.
    let ppl = load_json("gemma3_270m_ppl.json");
    assert_eq!(ppl["chunks"].as_u64(), Some(43));
    assert!(
        (43 * 512..44 * 512).contains(&ids.len()),
        "{} tokens",
        ids.len()
    );
    assert_eq!(tok.decode(&ids), text);
    // Splitting the text at lines gives the same ids as one call for each line.
    let first_lines: String = text.lines().take(40).map(|l| format!("{l}\n")).collect();
    let whole = tok.encode(&first_lines, false).unwrap();
    assert_eq!(tok.decode(&whole), first_lines);
}

#[test]
fn metadata_json_round_trip() {
    let tok = gemma();
    let gguf = npuc_gguf::GgufFile::open(npuc_testsupport::gemma3_gguf()).unwrap();
    let json =
        npuc_gguf::GgufMetaJson::filtered(&gguf.metadata, &["tokenizer.", "general."]).to_json();
    let text = serde_json::to_string(&json).unwrap();
    eprintln!("gemma3 tokenizer metadata as JSON: {} bytes", text.len());
    let back = Tokenizer::from_metadata_json(&serde_json::from_str(&text).unwrap()).unwrap();
    assert_eq!(back.vocab_size(), tok.vocab_size());
    let refs = load_json("gemma3_270m_greedy.json");
    for p in refs["prompts"].as_array().unwrap() {
        let prompt = p["prompt"].as_str().unwrap();
        assert_eq!(
            back.encode(prompt, true).unwrap(),
            ids(&p["prompt_ids_bos"])
        );
    }
    let sample: String = std::fs::read_to_string(fixtures().join("ppl_text.txt"))
        .unwrap()
        .chars()
        .take(20_000)
        .collect();
    assert_eq!(
        back.encode(&sample, true).unwrap(),
        tok.encode(&sample, true).unwrap()
    );
}
