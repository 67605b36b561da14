//! Sampler checks against hand-computed candidate sets and distributions (llama.cpp semantics).

use npuc_generate::sample::{greedy, Candidate, Sampler, SamplerParams};
use proptest::prelude::*;

/// Every stage off, temperature 1: the plain softmax.
fn plain() -> SamplerParams {
    SamplerParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        typical_p: 1.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        min_keep: 0,
        seed: 0,
    }
}

fn dist(params: SamplerParams, logits: &[f32], history: &[u32]) -> Vec<Candidate> {
    let mut s = Sampler::new(params).unwrap();
    s.distribution(&mut logits.to_vec(), history).unwrap()
}

fn ids(c: &[Candidate]) -> Vec<u32> {
    c.iter().map(|c| c.id).collect()
}

fn assert_probs(c: &[Candidate], want: &[(u32, f64)]) {
    assert_eq!(
        ids(c),
        want.iter().map(|w| w.0).collect::<Vec<_>>(),
        "candidate ids"
    );
    for (c, &(_, p)) in c.iter().zip(want) {
        assert!(
            (c.p as f64 - p).abs() < 1e-6,
            "token {}: p {} want {p}",
            c.id,
            c.p
        );
    }
}

/// ln of a probability vector: softmax of these logits gives the probabilities back.
fn ln(p: &[f64]) -> Vec<f32> {
    p.iter().map(|&x| x.ln() as f32).collect()
}

#[test]
fn greedy_picks_lowest_id_on_ties_and_skips_nan() {
    assert_eq!(greedy(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
    assert_eq!(greedy(&[f32::NAN, -1.0, -1.0]).unwrap(), 1);
    assert_eq!(greedy(&[f32::NEG_INFINITY, f32::NEG_INFINITY]).unwrap(), 0);
    assert!(greedy(&[f32::NAN]).is_err());
    // temperature <= 0 goes through greedy regardless of the other stages
    let mut s = Sampler::new(SamplerParams {
        temperature: 0.0,
        top_k: 1,
        seed: 7,
        ..Default::default()
    })
    .unwrap();
    for _ in 0..5 {
        assert_eq!(s.sample(&mut [0.5, 2.0, 2.0, -1.0], &[]).unwrap(), 1);
    }
    let mut s = Sampler::new(SamplerParams {
        temperature: -1.0,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.sample(&mut [0.5, 2.0, 2.5, -1.0], &[]).unwrap(), 2);
}

#[test]
fn penalties_follow_llama_cpp_formulas() {
    let params = SamplerParams {
        repeat_penalty: 2.0,
        frequency_penalty: 0.1,
        presence_penalty: 0.5,
        repeat_last_n: 3,
        temperature: 0.0,
        ..plain()
    };
    // window = last 3 of history = [1, 1, 3]: token 1 twice, token 3 once; token 0 is outside the window.
    let mut logits = vec![2.0f32, -1.0, 0.5, 3.0];
    let mut s = Sampler::new(params.clone()).unwrap();
    let tok = s.sample(&mut logits, &[0, 1, 1, 3]).unwrap();
    // token 1: -1 * 2 (non-positive logit: multiplied), minus count 2 * 0.1 and presence 0.5
    let want = [2.0, -2.0 - 2.0 * 0.1 - 0.5, 0.5, 3.0 / 2.0 - 0.1 - 0.5];
    for (g, w) in logits.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{logits:?} vs {want:?}");
    }
    assert_eq!(
        tok, 0,
        "token 0 (2.0) now beats the penalised token 3 (0.9)"
    );

    // repeat_last_n = -1: the whole history, so token 0 is penalised too (positive logit: divided).
    let mut logits = vec![2.0f32, -1.0, 0.5, 3.0];
    let mut s = Sampler::new(SamplerParams {
        repeat_last_n: -1,
        ..params.clone()
    })
    .unwrap();
    s.sample(&mut logits, &[0, 1, 1, 3]).unwrap();
    assert!((logits[0] - (1.0 - 0.1 - 0.5)).abs() < 1e-6);

    // repeat_last_n = 0 disables all penalties; ids beyond the vocabulary are ignored.
    let mut logits = vec![2.0f32, -1.0, 0.5, 3.0];
    let mut s = Sampler::new(SamplerParams {
        repeat_last_n: 0,
        ..params
    })
    .unwrap();
    s.sample(&mut logits, &[0, 1, 1, 3, 99]).unwrap();
    assert_eq!(logits, vec![2.0, -1.0, 0.5, 3.0]);
}

#[test]
fn top_k_keeps_k_best_and_renormalises() {
    let logits = [1.0f32, 4.0, 2.0, 3.0, 4.0];
    let c = dist(
        SamplerParams {
            top_k: 3,
            ..plain()
        },
        &logits,
        &[],
    );
    // ties (ids 1 and 4 at 4.0) broken by id; then id 3 (3.0)
    let z = 2.0 * 4f64.exp() + 3f64.exp();
    assert_probs(
        &c,
        &[
            (1, 4f64.exp() / z),
            (4, 4f64.exp() / z),
            (3, 3f64.exp() / z),
        ],
    );
    // k larger than the vocabulary keeps everything
    assert_eq!(
        dist(
            SamplerParams {
                top_k: 100,
                ..plain()
            },
            &logits,
            &[]
        )
        .len(),
        5
    );
}

#[test]
fn top_p_keeps_smallest_prefix_reaching_p() {
    let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
    let c = dist(
        SamplerParams {
            top_p: 0.75,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 0.5 / 0.8), (1, 0.3 / 0.8)]);
    let c = dist(
        SamplerParams {
            top_p: 0.81,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)]);
    let c = dist(
        SamplerParams {
            top_p: 0.4,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 1.0)]);
    // min_keep forces more candidates
    let c = dist(
        SamplerParams {
            top_p: 0.4,
            min_keep: 3,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_eq!(ids(&c), vec![0, 1, 2]);
}

#[test]
fn min_p_keeps_tokens_above_fraction_of_max() {
    let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
    // threshold 0.2 * 0.5 = 0.1: tokens 0, 1, 2 survive
    let c = dist(
        SamplerParams {
            min_p: 0.2,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)]);
    // threshold 0.7 * 0.5 = 0.35: only token 0
    let c = dist(
        SamplerParams {
            min_p: 0.7,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 1.0)]);
}

#[test]
fn typical_orders_by_distance_to_entropy() {
    let p = [0.5, 0.3, 0.15, 0.05];
    // H = 1.1421; |-ln p - H| = 0.449, 0.062, 0.755, 1.854 → order 1, 0, 2, 3; cumulative 0.3, 0.8 > 0.5
    let c = dist(
        SamplerParams {
            typical_p: 0.5,
            ..plain()
        },
        &ln(&p),
        &[],
    );
    assert_probs(&c, &[(0, 0.5 / 0.8), (1, 0.3 / 0.8)]);
    // 0.25: token 1 alone already exceeds it
    let c = dist(
        SamplerParams {
            typical_p: 0.25,
            ..plain()
        },
        &ln(&p),
        &[],
    );
    assert_probs(&c, &[(1, 1.0)]);
}

#[test]
fn temperature_scales_after_truncation() {
    // p ∝ exp(l / 2): [1, 2] for logits [0, ln 4]
    let c = dist(
        SamplerParams {
            temperature: 2.0,
            ..plain()
        },
        &[0.0, 4f32.ln()],
        &[],
    );
    assert_probs(&c, &[(1, 2.0 / 3.0), (0, 1.0 / 3.0)]);
    // min_p is applied before temperature: with T = 4 the flattened tail would pass 0.2, but it was
    // already cut at T = 1 (p = [0.5, 0.3, 0.15, 0.05], threshold 0.1 keeps 3 tokens).
    let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
    let c = dist(
        SamplerParams {
            min_p: 0.2,
            temperature: 4.0,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_eq!(ids(&c), vec![0, 1, 2]);
    let w: Vec<f64> = [0.5f64, 0.3, 0.15].iter().map(|p| p.powf(0.25)).collect();
    let z: f64 = w.iter().sum();
    assert_probs(&c, &[(0, w[0] / z), (1, w[1] / z), (2, w[2] / z)]);
}

#[test]
fn chain_order_top_k_then_top_p() {
    // top_k 2 first: {0: 0.5, 1: 0.3} renormalised to 0.625 / 0.375; top_p 0.6 then keeps only token 0.
    // (top_p over the full distribution would need tokens 0 and 1 to reach 0.6.)
    let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
    let c = dist(
        SamplerParams {
            top_k: 2,
            top_p: 0.6,
            ..plain()
        },
        &logits,
        &[],
    );
    assert_probs(&c, &[(0, 1.0)]);
}

#[test]
fn draws_follow_the_distribution_and_are_reproducible() {
    let p = [0.5, 0.3, 0.15, 0.05];
    let logits = ln(&p);
    let mut s = Sampler::new(SamplerParams {
        seed: 42,
        ..plain()
    })
    .unwrap();
    let n = 40_000;
    let mut counts = [0usize; 4];
    let mut seq = Vec::new();
    for _ in 0..n {
        let t = s.sample(&mut logits.clone(), &[]).unwrap();
        counts[t as usize] += 1;
        if seq.len() < 64 {
            seq.push(t);
        }
    }
    for (i, &c) in counts.iter().enumerate() {
        let f = c as f64 / n as f64;
        assert!(
            (f - p[i]).abs() < 0.01,
            "token {i}: frequency {f} vs p {}",
            p[i]
        );
    }
    // same seed → same sequence; reset() restarts it
    let mut a = Sampler::new(SamplerParams {
        seed: 42,
        ..plain()
    })
    .unwrap();
    let again: Vec<u32> = (0..64)
        .map(|_| a.sample(&mut logits.clone(), &[]).unwrap())
        .collect();
    assert_eq!(seq, again);
    a.reset();
    let third: Vec<u32> = (0..64)
        .map(|_| a.sample(&mut logits.clone(), &[]).unwrap())
        .collect();
    assert_eq!(seq, third);
    // another seed → another sequence
    let mut b = Sampler::new(SamplerParams {
        seed: 43,
        ..plain()
    })
    .unwrap();
    let other: Vec<u32> = (0..64)
        .map(|_| b.sample(&mut logits.clone(), &[]).unwrap())
        .collect();
    assert_ne!(seq, other);
}

#[test]
fn invalid_parameters_are_rejected() {
    assert!(Sampler::new(SamplerParams {
        temperature: f32::NAN,
        ..plain()
    })
    .is_err());
    assert!(Sampler::new(SamplerParams {
        repeat_penalty: 0.0,
        ..plain()
    })
    .is_err());
    assert!(Sampler::new(SamplerParams {
        repeat_last_n: -2,
        ..plain()
    })
    .is_err());
    let mut s = Sampler::new(plain()).unwrap();
    assert!(s.sample(&mut [], &[]).is_err());
    assert!(s.sample(&mut [f32::NEG_INFINITY; 3], &[]).is_err());
}

/// Naive llama.cpp chain for comparison: full sort, then each stage on the sorted list.
fn reference(params: &SamplerParams, logits: &[f32]) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        c.truncate(params.top_k as usize);
    }
    if params.top_p < 1.0 {
        let max = c[0].1;
        let e: Vec<f32> = c.iter().map(|x| (x.1 - max).exp()).collect();
        let z: f64 = e.iter().map(|&v| v as f64).sum();
        let mut cum = 0.0f64;
        let mut last = c.len();
        for (i, &v) in e.iter().enumerate() {
            cum += ((v as f64 / z) as f32) as f64;
            if cum >= params.top_p as f64 {
                last = i + 1;
                break;
            }
        }
        c.truncate(last);
    }
    if params.min_p > 0.0 {
        let thr = c[0].1 + params.min_p.ln();
        let keep = 1 + c[1..].iter().take_while(|x| x.1 >= thr).count();
        c.truncate(keep);
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The partial-selection paths (top-k select, incremental top-p) give exactly the candidate set of a
    /// full sort, on vocabularies larger than the incremental window.
    #[test]
    fn fast_paths_match_full_sort(
        seed in any::<u64>(),
        n in 1usize..5000,
        top_k in prop_oneof![Just(0i32), 1i32..400],
        top_p in prop_oneof![Just(1.0f32), 0.05f32..0.999],
        min_p in prop_oneof![Just(0.0f32), 0.001f32..0.5],
        spread in 0.1f32..20.0,
    ) {
        // deterministic pseudo-random logits (xorshift), including duplicated values
        let mut x = seed | 1;
        let logits: Vec<f32> = (0..n).map(|_| {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            ((x % 2001) as f32 / 1000.0 - 1.0) * spread
        }).collect();
        let params = SamplerParams { top_k, top_p, min_p, ..plain() };
        let got = dist(params.clone(), &logits, &[]);
        let want = reference(&params, &logits);
        prop_assert_eq!(ids(&got), want.iter().map(|w| w.0).collect::<Vec<_>>());
    }
}
