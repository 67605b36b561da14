//! Parity precision on the two other real LLMs of issue 15 (GGUFs from the data cache; fails with
//! the fetch command when absent): greedy ids equal to llama.cpp's (AVX2 build of
//! `scripts/llamacpp/build.sh`, its defaults) for 48 tokens on the four reference prompts, the
//! references made by `scripts/llamacpp/make_greedy_refs.py`.

mod common;

#[test]
fn smollm2_parity_greedy_matches_llama_cpp() {
    common::assert_parity_greedy(
        "smollm2",
        &npuc_testsupport::smollm2_gguf(),
        "smollm2/smollm2_135m_greedy.json",
    );
}

#[test]
fn qwen25_coder_parity_greedy_matches_llama_cpp() {
    common::assert_parity_greedy(
        "qwen2.5-coder",
        &npuc_testsupport::qwen25_coder_gguf(),
        "qwen2.5/qwen2.5_coder_0.5b_greedy.json",
    );
}
