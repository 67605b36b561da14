//! Generation, chat cache reuse and perplexity on a real model: tiny-qwen2 (F32 GGUF) run by the f32
//! reference forward pass in `common/`, first checked against HF transformers' logits, then used to
//! check the generation loop against HF's greedy continuation (`refs.json`, full recompute per step).

mod common;

use common::{fixture, read_npy_f32, ByteVocab, TinyQwen2};
use npuc_generate::chat::{ChatMessage, ChatSession, ChatTemplate};
use npuc_generate::perplexity::nll;
use npuc_generate::{generate, perplexity, CausalLm, SamplerParams, StopReason};

fn refs() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("tiny-qwen2/refs.json")).unwrap())
        .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn greedy() -> SamplerParams {
    SamplerParams::greedy()
}

#[test]
fn reference_model_matches_hf_logits() {
    let r = refs();
    let seq = ids(&r["seq"]);
    let mut lm = TinyQwen2::load(256);
    let got = lm.forward(&seq, true).unwrap();
    let (shape, want) = read_npy_f32(&fixture("tiny-qwen2/logits/F32.npy"));
    assert_eq!(shape, vec![24, 512]);
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-3, "max |diff| vs HF = {max}");
    // last-only logits equal the last row; the KV-cached continuation equals the full recompute
    lm.reset();
    let last = lm.forward(&seq, false).unwrap();
    assert_eq!(last, got[23 * 512..].to_vec());
    lm.reset();
    lm.forward(&seq[..10], false).unwrap();
    let rest = lm.forward(&seq[10..], true).unwrap();
    let max = rest
        .iter()
        .zip(&got[10 * 512..])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-4, "{max}");
}

#[test]
fn greedy_generation_matches_hf_continuation() {
    let r = refs();
    let seq = ids(&r["seq"]);
    let want = ids(&r["gguf"]["F32"]["greedy"]);
    assert_eq!(want.len(), 16);
    let v = ByteVocab::tiny_qwen2();
    let mut lm = TinyQwen2::load(256);
    let mut streamed = String::new();
    let out = generate(&mut lm, &v, &seq, &greedy(), 16, &[], &mut |s| {
        streamed.push_str(s)
    })
    .unwrap();
    assert_eq!(out.tokens, want);
    assert_eq!(out.stopped, StopReason::MaxTokens);
    assert_eq!(out.prompt_tokens, 24);
    assert!(out.warnings.is_empty());
    let bytes: Vec<u8> = want
        .iter()
        .flat_map(|&t| v.pieces[t as usize].clone())
        .collect();
    assert_eq!(out.text, String::from_utf8_lossy(&bytes));
    assert_eq!(streamed, out.text);
    // the cache holds the prompt and all generated tokens but the last
    assert_eq!(lm.position(), 24 + 15);
    assert!(out.prefill_tokens_per_s > 0.0 && out.decode_tokens_per_s > 0.0);
    // a second call starts from scratch (generate resets the cache)
    let again = generate(&mut lm, &v, &seq, &greedy(), 16, &[], &mut |_| {}).unwrap();
    assert_eq!(again.tokens, want);
}

#[test]
fn context_limits_cap_or_fail_before_evaluating() {
    let r = refs();
    let seq = ids(&r["seq"]);
    let want = ids(&r["gguf"]["F32"]["greedy"]);
    let v = ByteVocab::tiny_qwen2();
    // ctx 32: 24 prompt tokens leave room for 32 - 24 + 1 = 9 generated tokens
    let mut lm = TinyQwen2::load(32);
    let out = generate(&mut lm, &v, &seq, &greedy(), 16, &[], &mut |_| {}).unwrap();
    assert_eq!(out.tokens, want[..9].to_vec());
    assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
    assert!(
        out.warnings[0].contains("capped to 9"),
        "{}",
        out.warnings[0]
    );
    assert_eq!(lm.position(), 32);
    // a prompt longer than the context is an error, raised before anything runs
    let mut lm = TinyQwen2::load(20);
    let e = generate(&mut lm, &v, &seq, &greedy(), 4, &[], &mut |_| {}).unwrap_err();
    assert!(
        format!("{e:#}").contains("does not fit the context of 20"),
        "{e:#}"
    );
    assert_eq!(lm.position(), 0);
    // empty prompt and out-of-vocabulary ids are errors too
    assert!(generate(&mut lm, &v, &[], &greedy(), 4, &[], &mut |_| {}).is_err());
    let e = generate(&mut lm, &v, &[5, 512], &greedy(), 4, &[], &mut |_| {}).unwrap_err();
    assert!(format!("{e:#}").contains("token id 512"), "{e:#}");
}

#[test]
fn eog_and_stop_strings_end_generation() {
    let r = refs();
    let seq = ids(&r["seq"]);
    let want = ids(&r["gguf"]["F32"]["greedy"]); // 84, 371, 477, 371, 477, ...
    let mut v = ByteVocab::tiny_qwen2();
    let mut lm = TinyQwen2::load(256);

    // stop string = the text of tokens 2..4 (spans token boundaries)
    let piece = |t: u32| String::from_utf8_lossy(&v.pieces[t as usize]).to_string();
    let stop = format!("{}{}", piece(want[2]), piece(want[3]));
    let mut streamed = String::new();
    let out = generate(
        &mut lm,
        &v,
        &seq,
        &greedy(),
        16,
        std::slice::from_ref(&stop),
        &mut |s| streamed.push_str(s),
    )
    .unwrap();
    assert_eq!(out.stopped, StopReason::StopString(stop.clone()));
    assert_eq!(out.tokens, want[..4].to_vec());
    assert_eq!(out.text, format!("{}{}", piece(want[0]), piece(want[1])));
    assert_eq!(streamed, out.text);

    // make token want[2] an end-of-generation token: it ends generation, is kept in `tokens`, adds no text
    v.eog.push(want[2]);
    let out = generate(&mut lm, &v, &seq, &greedy(), 16, &[], &mut |_| {}).unwrap();
    assert_eq!(out.stopped, StopReason::Eog);
    assert_eq!(out.tokens, want[..3].to_vec());
    assert_eq!(out.text, format!("{}{}", piece(want[0]), piece(want[1])));
}

#[test]
fn sampled_generation_is_reproducible_per_seed() {
    let seq = ids(&refs()["seq"]);
    let v = ByteVocab::tiny_qwen2();
    let mut lm = TinyQwen2::load(256);
    let p = |seed| SamplerParams {
        temperature: 1.5,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..Default::default()
    };
    let a = generate(&mut lm, &v, &seq, &p(1), 12, &[], &mut |_| {}).unwrap();
    let b = generate(&mut lm, &v, &seq, &p(1), 12, &[], &mut |_| {}).unwrap();
    let c = generate(&mut lm, &v, &seq, &p(2), 12, &[], &mut |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(
        a.tokens, c.tokens,
        "two seeds gave the same 12 tokens at temperature 1.5"
    );
}

/// ChatML (tiny-qwen2 has `<|im_start|>` / `<|im_end|>`), encoded byte by byte.
struct ChatMl<'a>(&'a ByteVocab);

impl ChatTemplate for ChatMl<'_> {
    fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> anyhow::Result<String> {
        let mut s = String::new();
        for m in messages {
            s += &format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
        }
        if add_generation_prompt {
            s += "<|im_start|>assistant\n";
        }
        Ok(s)
    }
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(self.0.encode_bytes(text))
    }
}

#[test]
fn chat_reuses_the_cache_and_matches_a_fresh_run() {
    let v = ByteVocab::tiny_qwen2();
    let t = ChatMl(&v);
    assert_eq!(v.encode_bytes("<|im_start|>a"), vec![510, v.id(b"a")]);
    let mut lm = TinyQwen2::load(256);
    let mut chat = ChatSession::new(Some("Be brief."));
    let r1 = chat
        .turn(&mut lm, &v, &t, "Hello", &greedy(), 6, &[], &mut |_| {})
        .unwrap();
    assert_eq!(r1.reused_tokens, 0);
    let r2 = chat
        .turn(&mut lm, &v, &t, "License?", &greedy(), 6, &[], &mut |_| {})
        .unwrap();
    // at least the whole first prompt is reused (the reply re-tokenizes byte by byte, so its
    // tokens may differ from the generated ones)
    let ids1 = t
        .encode(&t.render(&chat.messages()[..2], true).unwrap())
        .unwrap();
    assert!(
        r2.reused_tokens >= ids1.len(),
        "reused {} < {}",
        r2.reused_tokens,
        ids1.len()
    );
    assert_eq!(
        r2.reused_tokens + r2.fed_tokens,
        t.encode(&t.render(&chat.messages()[..4], true).unwrap())
            .unwrap()
            .len()
    );

    // the same conversation from an empty cache gives the same reply
    let prompt = t
        .encode(&t.render(&chat.messages()[..4], true).unwrap())
        .unwrap();
    let mut fresh = TinyQwen2::load(256);
    let f = generate(&mut fresh, &v, &prompt, &greedy(), 6, &[], &mut |_| {}).unwrap();
    assert_eq!(f.tokens, r2.gen.tokens);
    assert_eq!(chat.messages()[4].content, r2.gen.text);
    assert_eq!(chat.cached_tokens().len(), lm.position());

    // reset keeps the system message and empties the cache
    chat.reset(&mut lm);
    assert_eq!(chat.messages().len(), 1);
    assert_eq!(lm.position(), 0);
    let r3 = chat
        .turn(&mut lm, &v, &t, "Hello", &greedy(), 6, &[], &mut |_| {})
        .unwrap();
    assert_eq!(r3.gen.tokens, r1.gen.tokens);
}

/// Independent perplexity: whole chunk in one call, f64 softmax.
fn reference_ppl(tokens: &[u32], n_ctx: usize, bos: Option<u32>, chunks: usize) -> (f64, usize) {
    let mut lm = TinyQwen2::load(256);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for k in 0..chunks {
        let mut c = tokens[k * n_ctx..(k + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            c[0] = b;
        }
        lm.reset();
        let logits = lm.forward(&c, true).unwrap();
        for j in n_ctx / 2..n_ctx - 1 {
            let row = &logits[j * 512..(j + 1) * 512];
            let m = row
                .iter()
                .map(|&x| x as f64)
                .fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            sum -= row[c[j + 1] as usize] as f64 - m - z.ln();
            count += 1;
        }
    }
    ((sum / count as f64).exp(), count)
}

#[test]
fn perplexity_follows_llama_cpp_chunking() {
    // 3 full chunks of 64 and a remainder of 10 (ignored), pseudo-text over the whole vocabulary
    let tokens: Vec<u32> = (0..202u32)
        .map(|i| (37 * i * i + 11 * i + 5) % 509)
        .collect();
    let mut lm = TinyQwen2::load(256);
    let mut seen = Vec::new();
    let r = perplexity(&mut lm, &tokens, 64, Some(509), None, &mut |k, p| {
        seen.push((k, p))
    })
    .unwrap();
    assert_eq!(r.chunk_ppl.len(), 3);
    assert_eq!(r.count, 3 * (64 - 1 - 32));
    let (want, count) = reference_ppl(&tokens, 64, Some(509), 3);
    assert_eq!(count, r.count);
    assert!((r.ppl - want).abs() / want < 1e-5, "{} vs {want}", r.ppl);
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(seen[2].1, r.ppl);
    let (first, _) = reference_ppl(&tokens, 64, Some(509), 1);
    assert!((r.chunk_ppl[0] - first).abs() / first < 1e-5);
    assert!(r.stderr > 0.0 && r.stderr < r.ppl);
    assert!(r.final_line().starts_with("PPL = "));
    assert!(r.chunks_line().starts_with("[1]"));

    // without BOS replacement the first token of each chunk is the text's own, so results differ
    let nb = perplexity(&mut lm, &tokens, 64, None, None, &mut |_, _| {}).unwrap();
    let (want_nb, _) = reference_ppl(&tokens, 64, None, 3);
    assert!((nb.ppl - want_nb).abs() / want_nb < 1e-5);
    assert_ne!(nb.ppl, r.ppl);

    // --chunks limit, and the llama.cpp minimum of 2 * n_ctx tokens
    let one = perplexity(&mut lm, &tokens, 64, Some(509), Some(1), &mut |_, _| {}).unwrap();
    assert_eq!(one.chunk_ppl, vec![r.chunk_ppl[0]]);
    let e = perplexity(&mut lm, &tokens[..127], 64, Some(509), None, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("need at least 128 tokens"), "{e}");
    let e = perplexity(&mut lm, &tokens, 512, Some(509), None, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("exceeds the model context"), "{e}");

    // nll agrees with the f64 reference on a real row
    lm.reset();
    let row = lm.forward(&tokens[..5], false).unwrap();
    let m = row
        .iter()
        .map(|&x| x as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
    assert!((nll(&row, 7) - (-(row[7] as f64 - m - z.ln()))).abs() < 1e-5);
}

/// Records what `generate_observed` shows its observer and stops after `stop_after` tokens.
struct Recorder {
    tokens: Vec<u32>,
    rows: Vec<Vec<f32>>,
    stop_after: usize,
}

impl npuc_generate::TokenObserver for Recorder {
    fn wants_logits(&self) -> bool {
        true
    }
    fn on_token(&mut self, token: u32, logits: &[f32]) -> bool {
        self.tokens.push(token);
        self.rows.push(logits.to_vec());
        self.tokens.len() < self.stop_after
    }
}

#[test]
fn observer_sees_raw_logits_and_can_cancel() {
    let r = refs();
    let seq = ids(&r["seq"]);
    let v = ByteVocab::tiny_qwen2();
    let mut lm = TinyQwen2::load(256);
    let mut rec = Recorder {
        tokens: vec![],
        rows: vec![],
        stop_after: 5,
    };
    let mut streamed = String::new();
    // A repetition penalty changes what the sampler sees, not the rows the observer gets.
    let params = SamplerParams {
        repeat_penalty: 1.3,
        ..greedy()
    };
    let out = npuc_generate::generate_observed(
        &mut lm,
        &v,
        &seq,
        &params,
        16,
        &[],
        &mut |s| streamed.push_str(s),
        Some(&mut rec),
    )
    .unwrap();
    assert_eq!(out.stopped, StopReason::Cancelled);
    assert_eq!(out.tokens, rec.tokens);
    assert_eq!(out.tokens.len(), 5);
    // The first row is the prompt's last-position logits, unpenalized: the same as a plain forward.
    lm.reset();
    let first = lm.forward(&seq, false).unwrap();
    assert_eq!(rec.rows[0], first);
    // Each later row is the model's logits after feeding the previous tokens.
    lm.reset();
    let mut fed = seq.clone();
    fed.extend_from_slice(&out.tokens[..4]);
    let all = lm.forward(&fed, true).unwrap();
    let vocab = lm.vocab();
    for (k, row) in rec.rows.iter().enumerate() {
        let at = (seq.len() - 1 + k) * vocab;
        let max = row
            .iter()
            .zip(&all[at..at + vocab])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // Cached decode vs one full pass: f32 summation order only (see the 1e-4 above).
        assert!(max < 1e-4, "row {k}: max |diff| {max}");
    }
    // The cancelled token's text was not streamed.
    let bytes: Vec<u8> = out.tokens[..4]
        .iter()
        .flat_map(|&t| v.pieces[t as usize].clone())
        .collect();
    assert!(
        String::from_utf8_lossy(&bytes).starts_with(&streamed),
        "{streamed:?}"
    );
}
