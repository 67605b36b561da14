//! `npuc generate / chat / perplexity / bench` on real models, against independent references:
//! tiny-qwen2 (HF transformers logits and greedy ids, tests/fixtures/llm/tiny-qwen2/) and Gemma 3 270M
//! Q4_K_M (llama.cpp's greedy ids and perplexity, tests/fixtures/llm/gemma3/).

use std::path::PathBuf;
use std::process::{Command, Stdio};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm")
}

fn cache() -> PathBuf {
    npuc_testsupport::cache_dir()
}

fn gemma() -> PathBuf {
    let p = cache().join("models/gemma3-270m/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/fetch-data.sh gemma3-270m` first",
        p.display()
    );
    p
}

fn npuc(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args(args)
        .output()
        .expect("npuc runs");
    let so = String::from_utf8_lossy(&out.stdout).to_string();
    let se = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "npuc {args:?} failed:\n{se}");
    (so, se)
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn csv(v: &[u64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn tiny_qwen2_greedy_matches_hf() {
    let dir = fixtures().join("tiny-qwen2");
    let refs = json(&std::fs::read_to_string(dir.join("refs.json")).unwrap());
    let seq = ids(&refs["seq"]);
    for (file, ty) in [
        ("tiny-qwen2-F32.gguf", "F32"),
        ("tiny-qwen2-Q8_0.gguf", "Q8_0"),
    ] {
        let model = dir.join(file);
        let (so, _) = npuc(&[
            "generate",
            model.to_str().unwrap(),
            "--prompt-tokens",
            &csv(&seq),
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--precision",
            "exact",
            "--json",
        ]);
        let j = json(&so);
        assert_eq!(
            ids(&j["tokens"]),
            ids(&refs["gguf"][ty]["greedy"]),
            "{file}"
        );
        assert_eq!(ids(&j["prompt_tokens"]), seq);
        assert!(j["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn tiny_qwen2_logits_out_matches_hf() {
    let dir = fixtures().join("tiny-qwen2");
    let refs = json(&std::fs::read_to_string(dir.join("refs.json")).unwrap());
    let seq = ids(&refs["seq"]);
    let tmp = std::env::temp_dir().join(format!("npuc-llm-logits-{}.npy", std::process::id()));
    npuc(&[
        "generate",
        dir.join("tiny-qwen2-F32.gguf").to_str().unwrap(),
        "--prompt-tokens",
        &csv(&seq),
        "--max-tokens",
        "0",
        "--precision",
        "exact",
        "--logits-out",
        tmp.to_str().unwrap(),
    ]);
    let got = npuc_cli::npy::read_npy(&tmp).unwrap();
    let want = npuc_cli::npy::read_npy(&dir.join("logits/F32.npy")).unwrap();
    let _ = std::fs::remove_file(&tmp);
    assert_eq!(got.shape(), &[512]);
    let g = got.to_f64_vec().unwrap();
    let w = want.to_f64_vec().unwrap();
    let max = g
        .iter()
        .zip(&w[23 * 512..])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(max < 1e-3, "max |diff| {max}");
}

/// The text prompts tokenize to llama.cpp's ids (BOS added), and the exact path's greedy
/// continuation of "The capital of France is" equals transformers' float32 greedy ids on the
/// same (dequantized) weights.
#[test]
fn gemma3_prompt_ids_match_llama_cpp_and_exact_greedy_matches_transformers() {
    let model = gemma();
    let refs =
        json(&std::fs::read_to_string(fixtures().join("gemma3/gemma3_270m_greedy.json")).unwrap());
    for p in refs["prompts"].as_array().unwrap() {
        let (so, _) = npuc(&[
            "generate",
            model.to_str().unwrap(),
            "--prompt",
            p["prompt"].as_str().unwrap(),
            "--max-tokens",
            "1",
            "--temperature",
            "0",
            "--json",
        ]);
        let j = json(&so);
        assert_eq!(
            ids(&j["prompt_tokens"]),
            ids(&p["prompt_ids_bos"]),
            "prompt {:?}",
            p["prompt"]
        );
    }
    let hf = json(&std::fs::read_to_string(fixtures().join("gemma3/meta.json")).unwrap());
    let (so, _) = npuc(&[
        "generate",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &csv(&ids(&hf["prompt_ids"])),
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--precision",
        "exact",
        "--json",
    ]);
    let j = json(&so);
    assert_eq!(ids(&j["tokens"]), ids(&hf["greedy_ids"]), "{so}");
}

/// Parity precision (llama.cpp's arithmetic op by op) vs llama.cpp's greedy ids.
#[test]
fn gemma3_parity_greedy_matches_llama_cpp() {
    let model = gemma();
    let refs =
        json(&std::fs::read_to_string(fixtures().join("gemma3/gemma3_270m_greedy.json")).unwrap());
    for p in refs["prompts"].as_array().unwrap() {
        let (so, _) = npuc(&[
            "generate",
            model.to_str().unwrap(),
            "--prompt",
            p["prompt"].as_str().unwrap(),
            "--max-tokens",
            "48",
            "--temperature",
            "0",
            "--precision",
            "parity",
            "--json",
        ]);
        let j = json(&so);
        assert_eq!(
            ids(&j["tokens"]),
            ids(&p["gen_ids"]),
            "prompt {:?}",
            p["prompt"]
        );
    }
}

/// `npuc perplexity MODEL --ctx 512` (the default, fast precision) on ppl_text.txt within 0.5 % of
/// `llama-perplexity -c 512` on the same file (`reference`: tests/fixtures/llm/<...>_ppl.json, made by
/// `scripts/llamacpp/make_ppl_refs.sh`): issue 15's quality bar for the fast path. The chunking
/// (the number of 512-token chunks each tokenizer makes of the text) must match llama.cpp's too.
fn assert_perplexity_within_half_a_percent(model: &std::path::Path, reference: &str) {
    let text = fixtures().join("gemma3/ppl_text.txt");
    let r = json(&std::fs::read_to_string(fixtures().join(reference)).unwrap());
    let (so, se) = npuc(&[
        "perplexity",
        model.to_str().unwrap(),
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "512",
        "--json",
    ]);
    let j = json(&so);
    assert_eq!(j["chunks"].as_u64(), r["chunks"].as_u64(), "{se}");
    let (got, want) = (j["ppl"].as_f64().unwrap(), r["ppl"].as_f64().unwrap());
    assert!(
        (got - want).abs() / want < 0.005,
        "{}: PPL {got} vs llama.cpp {want}",
        model.display()
    );
}

/// llama-perplexity: 13.5372 +/- 0.35626 over 43 chunks; ours measured 13.5387 on 2026-11-27.
/// Slow (43 x 512 tokens of prefill): `cargo test --release -p npuc-cli --test llm_cli -- --ignored`.
#[test]
#[ignore = "slow (~1-3 min in release); run with --ignored"]
fn gemma3_perplexity_within_half_a_percent_of_llama_cpp() {
    assert_perplexity_within_half_a_percent(&gemma(), "gemma3/gemma3_270m_ppl.json");
}

/// SmolLM2-135M-Instruct Q4_1 (arch llama): llama-perplexity 15.7472 +/- 0.40501 over 44 chunks.
#[test]
#[ignore = "slow (~1-2 min in release); run with --ignored"]
fn smollm2_perplexity_within_half_a_percent_of_llama_cpp() {
    assert_perplexity_within_half_a_percent(
        &npuc_testsupport::smollm2_gguf(),
        "smollm2/smollm2_135m_ppl.json",
    );
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch qwen2: Q5_0/Q8_0/Q6_K/Q4_K, q/k/v biases).
#[test]
#[ignore = "slow (~3-5 min in release); run with --ignored"]
fn qwen25_coder_perplexity_within_half_a_percent_of_llama_cpp() {
    assert_perplexity_within_half_a_percent(
        &npuc_testsupport::qwen25_coder_gguf(),
        "qwen2.5/qwen2.5_coder_0.5b_ppl.json",
    );
}

const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

#[test]
fn gemma3_chat_keeps_cache_between_turns() {
    let model = gemma();
    let mut child = Command::new(env!("CARGO_BIN_EXE_npuc"))
        .args([
            "chat",
            model.to_str().unwrap(),
            // The base model's GGUF has no chat template: Gemma 3's turn format.
            "--chat-template",
            GEMMA_TEMPLATE,
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\nAnd of Italy?\n/reset\nHi\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{se}");
    let so = String::from_utf8_lossy(&out.stdout);
    // 270M is a base model (not instruction-tuned): check the turns produced text, not content.
    assert!(so.trim().len() > 10, "{so}");
    // second turn reuses the first turn's cache: "[N cached + M new prompt tokens" with N > 0
    let stats: Vec<&str> = se.lines().filter(|l| l.contains(" cached + ")).collect();
    assert_eq!(stats.len(), 3, "{se}");
    let cached = |l: &str| {
        // the line may start with the "> " prompt
        l[l.find('[').expect("stats line") + 1..]
            .split(' ')
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    assert_eq!(cached(stats[0]), 0);
    assert!(cached(stats[1]) > 10, "{}", stats[1]);
    assert_eq!(cached(stats[2]), 0, "after /reset");
}

#[test]
fn gemma3_bench_reports_speeds_and_rss() {
    let model = gemma();
    let (so, _) = npuc(&[
        "bench",
        model.to_str().unwrap(),
        "--prompt-len",
        "32",
        "--gen",
        "8",
        "--runs",
        "1",
        "--json",
    ]);
    let j = json(&so);
    assert!(j["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["peak_rss_bytes"].as_u64().unwrap() > 100_000_000);
}

/// `npuc export` refuses what it cannot export, naming the file and what to do, and leaves no
/// output behind.
#[test]
fn export_bad_input_is_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_npuc"))
            .args(args)
            .output()
            .expect("npuc runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // Not a GGUF.
    let onnx = tmp.path().join("m.onnx");
    std::fs::write(&onnx, b"not a model").unwrap();
    let out = tmp.path().join("out.onnx");
    let (ok, err) = run(&[
        "export",
        onnx.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("m.onnx") && err.contains("GGUF"),
        "{err}"
    );
    // Output not named .onnx; unknown dtype.
    let g = gemma();
    let bad = tmp.path().join("out.bin");
    let (ok, err) = run(&["export", g.to_str().unwrap(), "-o", bad.to_str().unwrap()]);
    assert!(
        !ok && err.contains("out.bin") && err.contains(".onnx"),
        "{err}"
    );
    let (ok, err) = run(&[
        "export",
        g.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--dtype",
        "int3",
    ]);
    assert!(!ok && err.contains("int3") && err.contains("f16"), "{err}");
    assert!(!out.exists() && !bad.exists());
}
