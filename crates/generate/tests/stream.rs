//! Streaming detokenisation and stop strings on a real byte-level BPE vocabulary: the tokens of the
//! tiny-qwen2 GGUF (`tokenizer.ggml.tokens`, GPT-2 byte-to-unicode alphabet) and the token ids HF's
//! tokenizer produced for the test strings (`tokenizer_tests.json`).

mod common;

use common::{fixture, ByteVocab};
use npuc_generate::{TextStream, TokenText};

fn vocab() -> ByteVocab {
    ByteVocab::tiny_qwen2()
}

fn cases() -> Vec<(String, Vec<u32>)> {
    let j: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-qwen2/tokenizer_tests.json")).unwrap(),
    )
    .unwrap();
    j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["hf_ids_no_special"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            (c["text"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

/// Streams `ids` through a `TextStream`; returns the chunks per pushed token (empty string when
/// nothing was emitted), the chunk emitted by `finish`, and the stop index.
fn run(v: &ByteVocab, ids: &[u32], stops: &[&str]) -> (Vec<String>, String, Option<usize>, String) {
    let mut s = TextStream::new(stops);
    let mut per_token = Vec::new();
    let mut stop = None;
    for &id in ids {
        let mut got = String::new();
        stop = s.push(&v.token_bytes(id), &mut |t| got.push_str(t));
        per_token.push(got);
        if stop.is_some() {
            break;
        }
    }
    let mut tail = String::new();
    s.finish(&mut |t| tail.push_str(t));
    (per_token, tail, stop, s.into_text())
}

#[test]
fn every_test_string_streams_back_exactly() {
    let v = vocab();
    let cases = cases();
    assert_eq!(cases.len(), 8);
    for (text, ids) in &cases {
        let (chunks, tail, stop, full) = run(&v, ids, &[]);
        assert_eq!(stop, None);
        assert_eq!(
            tail, "",
            "no stop strings: nothing is held back except incomplete UTF-8"
        );
        assert_eq!(chunks.concat(), *text);
        assert_eq!(full, *text);
    }
}

#[test]
fn split_multibyte_characters_are_held_until_complete() {
    let v = vocab();
    let (text, ids) = cases()
        .into_iter()
        .find(|c| c.0.starts_with("café"))
        .unwrap();
    let (chunks, _, _, _) = run(&v, &ids, &[]);
    // tokens: c a f Ã © ... — 'é' is U+00E9 = C3 A9, split over two byte tokens
    assert_eq!(&chunks[..5], &["c", "a", "f", "", "é"]);
    // 日本語 = three 3-byte characters over single-byte tokens ("Ġ æ Ĺ ¥ æ ľ ¬ è ª ŀ"), 😀 = 4 bytes
    let i = ids
        .iter()
        .position(|&t| v.token_bytes(t) == [0xE6])
        .unwrap();
    assert_eq!(
        &chunks[i..i + 9],
        &["", "", "日", "", "", "本", "", "", "語"]
    );
    assert_eq!(&chunks[chunks.len() - 4..], &["", "", "", "😀"]);
    assert_eq!(chunks.concat(), text);
}

#[test]
fn stop_string_spanning_tokens_is_removed_and_held_back_text_never_leaks() {
    let v = vocab();
    let (_, ids) = cases()
        .into_iter()
        .find(|c| c.0.starts_with("The quick"))
        .unwrap();
    let (chunks, tail, stop, full) = run(&v, &ids, &[" fox j"]);
    assert_eq!(stop, Some(0));
    assert_eq!(full, "The quick brown");
    assert_eq!(chunks.concat(), "The quick brown");
    assert_eq!(tail, "");
    // " f" (token 'Ġf') could start the stop string, so it was held back: the chunk for that token is empty
    let f = ids.iter().position(|&t| v.token_bytes(t) == b" f").unwrap();
    assert_eq!(chunks[f], "");
    // the stream ended at the token completing the stop string ('j'), not later
    assert_eq!(v.token_bytes(ids[chunks.len() - 1]), b"j");
}

#[test]
fn earliest_stop_string_wins_and_partial_matches_are_released() {
    let v = vocab();
    let (text, ids) = cases()
        .into_iter()
        .find(|c| c.0.starts_with("The quick"))
        .unwrap();
    let (chunks, _, stop, full) = run(&v, &ids, &["lazy", "", "quick"]);
    assert_eq!(
        stop,
        Some(1),
        "index among the non-empty stop strings: \"quick\""
    );
    assert_eq!(full, "The ");
    assert_eq!(chunks.concat(), "The ");
    // "the lazy cat" never appears: text that looked like its start is released once it diverges,
    // and what is still held back at the end comes out in finish()
    let (chunks, tail, stop, full) = run(&v, &ids, &["the lazy cat", "dog!"]);
    assert_eq!(stop, None);
    assert_eq!(
        tail, "",
        "\"dog\" was held for \"dog!\" and released by \".\""
    );
    assert_eq!(chunks.concat() + &tail, text);
    assert_eq!(full, text);
    let lazy = ids.iter().position(|&t| v.token_bytes(t) == b" l").unwrap();
    assert_eq!(
        chunks[lazy], "",
        "\"the l\" may start \"the lazy cat\": held"
    );
}

#[test]
fn multibyte_stop_string() {
    let v = vocab();
    let (_, ids) = cases()
        .into_iter()
        .find(|c| c.0.starts_with("café"))
        .unwrap();
    let (chunks, _, stop, full) = run(&v, &ids, &["本語"]);
    assert_eq!(stop, Some(0));
    assert_eq!(full, "café naïve über — 日");
    assert_eq!(chunks.concat(), full);
}

#[test]
fn invalid_and_truncated_utf8_become_replacement_characters() {
    let v = vocab();
    let c3 = v.id(&[0xC3]);
    let a = v.id(b"A");
    let (chunks, tail, _, full) = run(&v, &[c3, a], &[]);
    assert_eq!(chunks, vec!["".to_string(), "\u{FFFD}A".to_string()]);
    assert_eq!(tail, "");
    assert_eq!(full, "\u{FFFD}A");
    let (chunks, tail, _, full) = run(&v, &[a, c3], &[]);
    assert_eq!(chunks, vec!["A".to_string(), String::new()]);
    assert_eq!(tail, "\u{FFFD}");
    assert_eq!(full, "A\u{FFFD}");
}

#[test]
fn control_tokens_produce_no_text_and_eos_ends_generation() {
    let v = vocab();
    // <|im_start|> = 510 and <|endoftext|> = 509 are control tokens in this vocabulary
    assert!(v.token_bytes(510).is_empty());
    assert!(v.is_eog(509));
    assert!(!v.is_eog(510));
    let hello = cases().into_iter().next().unwrap();
    let mut ids = vec![510];
    ids.extend(&hello.1);
    let (chunks, _, _, full) = run(&v, &ids, &[]);
    assert_eq!(chunks[0], "");
    assert_eq!(full, hello.0);
}
