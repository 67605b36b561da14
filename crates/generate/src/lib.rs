//! Sampling, generation, perplexity and chat sessions for npuc's LLM runtime.
//!
//! The crate is independent of the engine and the tokenizer: it drives any model implementing
//! [`CausalLm`] and detokenises through any [`TokenText`]. `npuc_llm::Engine` and
//! `npuc_tokenizer::Tokenizer` implement these traits.
//!
//! * [`sample`]: [`Sampler`] with llama.cpp's sampler semantics and default chain order.
//! * [`generate`](mod@generate): prefill + decode loop with UTF-8-safe streaming and stop strings.
//! * [`perplexity`](mod@perplexity): llama.cpp's `llama-perplexity` method.
//! * [`chat`]: multi-turn chat that reuses the KV cache between turns.
#![forbid(unsafe_code)]

pub mod chat;
pub mod generate;
pub mod perplexity;
pub mod sample;
pub mod stream;

pub use chat::{ChatMessage, ChatSession, ChatTemplate};
pub use generate::{
    generate, generate_continue, generate_observed, GenOutput, StopReason, TokenObserver,
};
pub use perplexity::{perplexity, PerplexityResult};
pub use sample::{Sampler, SamplerParams};
pub use stream::TextStream;

/// A causal language model with a KV cache: the interface generation and perplexity need.
pub trait CausalLm {
    /// Appends `tokens` at the current position and returns the logits of the last token (`[vocab]`),
    /// or of every token (`[tokens.len() * vocab]`, row-major) when `all_logits`; advances the position.
    /// Must fail (not panic) when `position() + tokens.len() > ctx()`.
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> anyhow::Result<Vec<f32>>;
    /// Number of tokens currently in the cache.
    fn position(&self) -> usize;
    /// Context length (maximum number of cached tokens).
    fn ctx(&self) -> usize;
    /// Vocabulary size (length of one logits row).
    fn vocab(&self) -> usize;
    /// Empties the cache (position 0).
    fn reset(&mut self);
    /// Drops cache entries at positions `>= pos` (no-op when `pos >= position()`).
    fn truncate(&mut self, pos: usize);
}

impl<T: CausalLm + ?Sized> CausalLm for &mut T {
    fn forward(&mut self, tokens: &[u32], all_logits: bool) -> anyhow::Result<Vec<f32>> {
        (**self).forward(tokens, all_logits)
    }
    fn position(&self) -> usize {
        (**self).position()
    }
    fn ctx(&self) -> usize {
        (**self).ctx()
    }
    fn vocab(&self) -> usize {
        (**self).vocab()
    }
    fn reset(&mut self) {
        (**self).reset()
    }
    fn truncate(&mut self, pos: usize) {
        (**self).truncate(pos)
    }
}

/// What generation needs from a tokenizer: the raw bytes of a token and end-of-generation detection.
pub trait TokenText {
    /// Raw bytes of token `id` as it appears in decoded text (byte-level BPE pieces mapped back to bytes,
    /// SentencePiece `▁` as a space, byte-fallback tokens as their byte); empty for control tokens and
    /// unknown ids.
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// Whether `id` ends generation (EOS, EOT, `<end_of_turn>`, ...).
    fn is_eog(&self, id: u32) -> bool;
}

impl<T: TokenText + ?Sized> TokenText for &T {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        (**self).token_bytes(id)
    }
    fn is_eog(&self, id: u32) -> bool {
        (**self).is_eog(id)
    }
}
