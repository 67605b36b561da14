//! Chat templates: the Jinja templates shipped with models (GGUF `tokenizer.chat_template`, HF
//! `tokenizer_config.json` `chat_template`), rendered with minijinja configured like HF
//! transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, Python string
//! methods via minijinja-contrib's pycompat, `raise_exception`).

use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (whatever the template expects).
    pub role: String,
    /// The message text.
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

/// Messages as a list of `{role, content}` maps, the shape HF templates index into.
fn messages_value(messages: &[ChatMessage]) -> Value {
    let list: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut o = BTreeMap::new();
            o.insert("role".to_string(), Value::from(m.role.as_str()));
            o.insert("content".to_string(), Value::from(m.content.as_str()));
            Value::from(o)
        })
        .collect();
    Value::from(list)
}

/// Renders `template` for `messages`. `bos_token` / `eos_token` are the texts of the model's BOS /
/// EOS tokens (empty when it has none). Err carries minijinja's message (with the template line).
pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| format!("{e:#}"))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    let tmpl = env
        .template_from_str(template)
        .map_err(|e| format!("{e:#}"))?;
    tmpl.render(context! {
        messages => messages_value(messages),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| format!("{e:#}"))
}
