//! The generation loop: one prefill call for the prompt, then token-by-token decoding.
//!
//! Context policy: a prompt that does not fit the context (`prompt > ctx`) is an error, raised before
//! anything is evaluated. A `max_tokens` that would run past the context is **capped** to what fits
//! (the last sampled token is never fed back, so `ctx - prompt + 1` tokens can be generated) and the cap
//! is reported in [`GenOutput::warnings`] for the caller to print.
//!
//! The end-of-generation token is kept in [`GenOutput::tokens`] (like llama.cpp's reference outputs,
//! whose last id is the EOG token) but contributes no text. When a stop string ends generation, the
//! text is cut before it; the token that completed it is kept in `tokens`.

use crate::sample::{Sampler, SamplerParams};
use crate::stream::TextStream;
use crate::{CausalLm, TokenText};
use anyhow::{bail, Context, Result};
use std::time::Instant;

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    Eog,
    /// One of the stop strings appeared (the string itself is given).
    StopString(String),
    /// `max_tokens` tokens were generated (or the context is full).
    MaxTokens,
    /// The [`TokenObserver`] asked to stop (e.g. the client of a server went away).
    Cancelled,
}

impl StopReason {
    /// Short name for logs and JSON: `eog`, `stop_string`, `max_tokens`.
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Eog => "eog",
            StopReason::StopString(_) => "stop_string",
            StopReason::MaxTokens => "max_tokens",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// Result of one generation.
#[derive(Clone, Debug)]
pub struct GenOutput {
    /// Generated token ids (including a final EOG token when generation stopped on it).
    pub tokens: Vec<u32>,
    /// Generated text (stop string and everything after it removed).
    pub text: String,
    /// Number of prompt tokens fed in the prefill call.
    pub prompt_tokens: usize,
    /// Prompt tokens per second of the prefill call.
    pub prefill_tokens_per_s: f64,
    /// Decode throughput: single-token forward calls per second, timed over sampling + forward of each
    /// step (0 when no decode step ran).
    pub decode_tokens_per_s: f64,
    /// Why generation ended.
    pub stopped: StopReason,
    /// Non-fatal notes for the user (e.g. `max_tokens` capped to the context).
    pub warnings: Vec<String>,
}

/// A per-token hook of [`generate_observed`]: sees each sampled token (and, when it asks, the
/// logits it was drawn from) and can stop generation.
pub trait TokenObserver {
    /// Whether [`TokenObserver::on_token`] needs the logits row; when it does, the row is copied
    /// before the sampler transforms it in place.
    fn wants_logits(&self) -> bool {
        false
    }
    /// Called right after each token is sampled, before its text is streamed. `logits` is the
    /// model's raw row the token was drawn from (before penalties, temperature and truncation),
    /// empty unless [`TokenObserver::wants_logits`]. Returning `false` ends generation with
    /// [`StopReason::Cancelled`] (the token is kept in [`GenOutput::tokens`], its text is not
    /// streamed).
    fn on_token(&mut self, token: u32, logits: &[f32]) -> bool;
}

/// Generates from an empty cache: resets `lm`, feeds `prompt` in one forward call, then samples up to
/// `max_tokens` tokens. `on_text` receives the text as it becomes final (see [`TextStream`]).
#[allow(clippy::too_many_arguments)]
pub fn generate<L: CausalLm + ?Sized, T: TokenText + ?Sized>(
    lm: &mut L,
    text: &T,
    prompt: &[u32],
    params: &SamplerParams,
    max_tokens: usize,
    stop_strings: &[String],
    on_text: &mut dyn FnMut(&str),
) -> Result<GenOutput> {
    lm.reset();
    generate_continue(lm, text, prompt, params, max_tokens, stop_strings, on_text)
}

/// Like [`generate`], but keeps what is already in the cache: `tokens[..lm.position()]` must be the
/// tokens the cache holds (they are not fed again, only used for the repetition penalties), and
/// `tokens[lm.position()..]` (at least one token) are fed in one prefill call.
#[allow(clippy::too_many_arguments)]
pub fn generate_continue<L: CausalLm + ?Sized, T: TokenText + ?Sized>(
    lm: &mut L,
    text: &T,
    tokens: &[u32],
    params: &SamplerParams,
    max_tokens: usize,
    stop_strings: &[String],
    on_text: &mut dyn FnMut(&str),
) -> Result<GenOutput> {
    generate_observed(
        lm,
        text,
        tokens,
        params,
        max_tokens,
        stop_strings,
        on_text,
        None,
    )
}

/// [`generate_continue`] with a per-token [`TokenObserver`] (log-probabilities, cancellation).
#[allow(clippy::too_many_arguments)]
pub fn generate_observed<L: CausalLm + ?Sized, T: TokenText + ?Sized>(
    lm: &mut L,
    text: &T,
    tokens: &[u32],
    params: &SamplerParams,
    max_tokens: usize,
    stop_strings: &[String],
    on_text: &mut dyn FnMut(&str),
    mut observer: Option<&mut dyn TokenObserver>,
) -> Result<GenOutput> {
    let cached = lm.position();
    let ctx = lm.ctx();
    let vocab = lm.vocab();
    if tokens.len() <= cached {
        bail!(
            "generate: nothing to evaluate: {} tokens given but the cache already holds {cached} \
             (at least one new token is needed to get logits)",
            tokens.len()
        );
    }
    if tokens.len() > ctx {
        bail!(
            "generate: the prompt ({} tokens) does not fit the context of {ctx} tokens; use a larger --ctx or \
             a shorter prompt",
            tokens.len()
        );
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("generate: token id {bad} is outside the vocabulary of {vocab} tokens");
    }
    let mut warnings = Vec::new();
    let fits = ctx - tokens.len() + 1;
    let max_tokens = if max_tokens > fits {
        warnings.push(format!(
            "max_tokens {max_tokens} capped to {fits}: prompt {} + generated tokens must fit the context of {ctx}",
            tokens.len()
        ));
        fits
    } else {
        max_tokens
    };
    let mut sampler = Sampler::new(params.clone())?;
    let new = &tokens[cached..];

    let t0 = Instant::now();
    let mut logits = lm
        .forward(new, false)
        .with_context(|| format!("prefill of {} tokens", new.len()))?;
    let prefill_s = t0.elapsed().as_secs_f64();
    check_row(&logits, vocab)?;

    let mut history: Vec<u32> = tokens.to_vec();
    let mut out_tokens = Vec::new();
    let mut stream = TextStream::new(stop_strings);
    let mut stopped = StopReason::MaxTokens;
    let mut decode_steps = 0usize;
    let mut decode_s = 0.0f64;
    let mut step_start = Instant::now();
    let mut raw_logits = Vec::new();
    while out_tokens.len() < max_tokens {
        let wants_logits = observer.as_ref().is_some_and(|o| o.wants_logits());
        if wants_logits {
            raw_logits.clone_from(&logits);
        }
        let tok = sampler.sample(&mut logits, &history)?;
        out_tokens.push(tok);
        history.push(tok);
        if let Some(o) = observer.as_mut() {
            if !o.on_token(tok, if wants_logits { &raw_logits } else { &[] }) {
                stopped = StopReason::Cancelled;
                break;
            }
        }
        if text.is_eog(tok) {
            stopped = StopReason::Eog;
            break;
        }
        if let Some(i) = stream.push(&text.token_bytes(tok), on_text) {
            stopped = StopReason::StopString(stream.stop_strings()[i].clone());
            break;
        }
        if out_tokens.len() == max_tokens {
            break;
        }
        logits = lm
            .forward(&[tok], false)
            .with_context(|| format!("decode step {}", out_tokens.len()))?;
        check_row(&logits, vocab)?;
        decode_steps += 1;
        decode_s += step_start.elapsed().as_secs_f64();
        step_start = Instant::now();
    }
    stream.finish(on_text);
    Ok(GenOutput {
        tokens: out_tokens,
        text: stream.into_text(),
        prompt_tokens: new.len(),
        prefill_tokens_per_s: rate(new.len(), prefill_s),
        decode_tokens_per_s: rate(decode_steps, decode_s),
        stopped,
        warnings,
    })
}

fn rate(n: usize, secs: f64) -> f64 {
    if n == 0 || secs <= 0.0 {
        0.0
    } else {
        n as f64 / secs
    }
}

fn check_row(logits: &[f32], vocab: usize) -> Result<()> {
    if logits.len() != vocab {
        bail!(
            "model returned {} logits for one position, expected the vocabulary size {vocab}",
            logits.len()
        );
    }
    Ok(())
}
