//! Multi-turn chat that reuses the KV cache between turns.
//!
//! Each turn re-renders the whole conversation with the model's chat template and tokenizes it. The
//! session remembers which tokens the cache holds; only the part after the longest common prefix with
//! the new rendering is fed (the cache is truncated to that prefix first). The rendered assistant reply
//! usually differs from the generated tokens only at the end (e.g. an `<end_of_turn>` the model emitted
//! as EOG, which was never fed), so a turn costs little more than its new user message.

use crate::generate::{generate_continue, GenOutput};
use crate::sample::SamplerParams;
use crate::{CausalLm, TokenText};
use anyhow::{bail, Result};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders and tokenizes a conversation (implemented over the tokenizer's `apply_chat_template`).
pub trait ChatTemplate {
    /// The conversation as prompt text; `add_generation_prompt` appends the assistant turn header.
    fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String>;
    /// Token ids of rendered text (special tokens in the text, e.g. `<bos>`, parsed as such; no extra BOS
    /// when the template already writes one).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
}

/// A chat conversation bound to no particular model; pass the model to each [`ChatSession::turn`].
#[derive(Clone, Debug, Default)]
pub struct ChatSession {
    messages: Vec<ChatMessage>,
    /// Tokens the model's cache holds, in order (kept equal in length to `lm.position()`).
    cached: Vec<u32>,
}

/// Result of one chat turn.
#[derive(Clone, Debug)]
pub struct TurnOutput {
    /// The generation result (reply text and tokens, speeds).
    pub gen: GenOutput,
    /// How many tokens of the rendered conversation were already in the cache and not fed again.
    pub reused_tokens: usize,
    /// How many tokens were fed in this turn's prefill.
    pub fed_tokens: usize,
}

impl ChatSession {
    /// An empty conversation, optionally with a system message.
    pub fn new(system: Option<&str>) -> ChatSession {
        let mut s = ChatSession::default();
        if let Some(sys) = system {
            s.messages.push(ChatMessage::new("system", sys));
        }
        s
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[ChatMessage] {
        &self.messages
    }

    /// The tokens this session believes are in the model's cache.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Forgets the conversation (keeping a system message) and empties the model's cache.
    pub fn reset<L: CausalLm + ?Sized>(&mut self, lm: &mut L) {
        self.messages.retain(|m| m.role == "system");
        self.cached.clear();
        lm.reset();
    }

    /// Adds a user message, generates the assistant reply (streamed through `on_text`) and appends it to
    /// the conversation. On error the user message is removed again and the cache state stays consistent.
    #[allow(clippy::too_many_arguments)]
    pub fn turn<L: CausalLm + ?Sized, T: TokenText + ?Sized, C: ChatTemplate + ?Sized>(
        &mut self,
        lm: &mut L,
        text: &T,
        template: &C,
        user: &str,
        params: &SamplerParams,
        max_tokens: usize,
        stop_strings: &[String],
        on_text: &mut dyn FnMut(&str),
    ) -> Result<TurnOutput> {
        self.messages.push(ChatMessage::new("user", user));
        let r = self.turn_inner(
            lm,
            text,
            template,
            params,
            max_tokens,
            stop_strings,
            on_text,
        );
        match r {
            Ok(out) => {
                self.messages
                    .push(ChatMessage::new("assistant", out.gen.text.clone()));
                Ok(out)
            }
            Err(e) => {
                self.messages.pop();
                // The cache may hold part of a failed prefill; realign what we track with it.
                let pos = lm.position().min(self.cached.len());
                self.cached.truncate(pos);
                lm.truncate(pos);
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn turn_inner<L: CausalLm + ?Sized, T: TokenText + ?Sized, C: ChatTemplate + ?Sized>(
        &mut self,
        lm: &mut L,
        text: &T,
        template: &C,
        params: &SamplerParams,
        max_tokens: usize,
        stop_strings: &[String],
        on_text: &mut dyn FnMut(&str),
    ) -> Result<TurnOutput> {
        let rendered = template.render(&self.messages, true)?;
        let ids = template.encode(&rendered)?;
        if ids.is_empty() {
            bail!("chat: the rendered conversation tokenizes to nothing");
        }
        if ids.len() >= lm.ctx() {
            bail!(
                "chat: the conversation ({} tokens) no longer fits the context of {} tokens; /reset to start over",
                ids.len(),
                lm.ctx()
            );
        }
        // What the cache really holds can only be a prefix of what we recorded.
        self.cached.truncate(lm.position());
        let mut common = self
            .cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count();
        // At least one token must be fed to get logits for the first reply token.
        if common == ids.len() {
            common -= 1;
        }
        lm.truncate(common);
        self.cached.truncate(common);
        if lm.position() != common {
            bail!(
                "chat: the model cache is at position {} after truncating to {common}",
                lm.position()
            );
        }
        let gen = generate_continue(lm, text, &ids, params, max_tokens, stop_strings, on_text)?;
        // The cache now holds the prompt and every generated token except the last one sampled.
        self.cached = ids.clone();
        self.cached.extend_from_slice(&gen.tokens);
        self.cached.truncate(lm.position());
        Ok(TurnOutput {
            fed_tokens: ids.len() - common,
            reused_tokens: common,
            gen,
        })
    }
}
