//! The OpenAI request bodies npuc accepts, checked into a [`GenRequest`], and the error shape.
//!
//! Bodies are parsed here (not by an extractor) so that every refusal, malformed JSON included,
//! is a 400 in OpenAI's error shape naming the field.

use crate::Vocab;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use npuc_generate::chat::ChatMessage;
use npuc_generate::SamplerParams;
use serde::Deserialize;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

impl Endpoint {
    /// The path, as `/metrics` labels it.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        }
    }
}

/// A request refused (or failed), answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn bad(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status {
            StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "server_busy",
            _ => "server_error",
        };
        serde_json::json!({"error": {
            "message": self.message, "type": kind, "param": self.param, "code": null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::json_response(self.status, &self.body())
    }
}

/// A checked request, ready for a worker.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    /// Prompt token ids (the chat rendered with the model's template, or the completion prompt).
    pub prompt: Vec<u32>,
    pub params: SamplerParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// `Some(n)`: report each generated token's log-probability and the `n` most likely ones.
    pub logprobs: Option<usize>,
    pub stream: bool,
    /// Streaming: a last chunk with the token counts (`stream_options.include_usage`).
    pub include_usage: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The fields both endpoints share (OpenAI's, plus llama-server's `top_k`, `min_p`,
/// `repeat_penalty`).
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<u64>,
    stop: Option<Stop>,
    seed: Option<i64>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct InMessage {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(flatten)]
    common: Common,
    messages: Option<Vec<InMessage>>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
    max_completion_tokens: Option<u64>,
    tools: Option<Vec<serde_json::Value>>,
    response_format: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(flatten)]
    common: Common,
    prompt: Option<Prompt>,
    logprobs: Option<u64>,
    echo: Option<bool>,
    best_of: Option<u64>,
    suffix: Option<String>,
}

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
const MAX_TOP_LOGPROBS: u64 = 20;

/// What a request is checked against.
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub ctx: usize,
    pub vocab_size: usize,
}

/// Parses and checks a request body of `endpoint`.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    vocab: &dyn Vocab,
    limits: &Limits,
) -> Result<GenRequest, ApiError> {
    let json_err = |e: serde_json::Error| {
        use serde_json::error::Category;
        let what = match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => "is not valid JSON",
            Category::Data => "does not have the fields and types it should",
        };
        ApiError::bad(
            None,
            format!("the request body {what} ({} request): {e}", endpoint.path()),
        )
    };
    match endpoint {
        Endpoint::Chat => {
            let b: ChatBody = serde_json::from_slice(body).map_err(json_err)?;
            if b.tools.as_ref().is_some_and(|t| !t.is_empty()) {
                return Err(ApiError::bad(
                    Some("tools"),
                    "'tools' (function calling) is not supported",
                ));
            }
            if let Some(f) = &b.response_format {
                if f.get("type").and_then(|t| t.as_str()) != Some("text") {
                    return Err(ApiError::bad(
                        Some("response_format"),
                        format!(
                            "response_format {f} is not supported (only {{\"type\": \"text\"}})"
                        ),
                    ));
                }
            }
            let Some(messages) = b.messages else {
                return Err(ApiError::bad(
                    Some("messages"),
                    "'messages' is required: an array of {role, content} objects",
                ));
            };
            if messages.is_empty() {
                return Err(ApiError::bad(Some("messages"), "'messages' is empty"));
            }
            let messages = messages
                .into_iter()
                .enumerate()
                .map(|(i, m)| Ok(ChatMessage::new(m.role, text_content(i, m.content)?)))
                .collect::<Result<Vec<_>, ApiError>>()?;
            if !vocab.has_chat_template() {
                return Err(ApiError::bad(
                    Some("messages"),
                    "the model has no chat template (start the server with --chat-template, or use /v1/completions)",
                ));
            }
            let rendered = vocab
                .render(&messages, true)
                .map_err(|e| ApiError::bad(Some("messages"), format!("chat template: {e:#}")))?;
            let prompt = vocab
                .encode(&rendered)
                .map_err(|e| ApiError::bad(Some("messages"), format!("tokenizing: {e:#}")))?;
            let logprobs = match (b.logprobs.unwrap_or(false), b.top_logprobs) {
                (true, n) => Some(top_count("top_logprobs", n.unwrap_or(0))?),
                (false, Some(n)) if n > 0 => {
                    return Err(ApiError::bad(
                        Some("top_logprobs"),
                        "'top_logprobs' needs 'logprobs': true",
                    ))
                }
                (false, _) => None,
            };
            let max = b.max_completion_tokens.or(b.common.max_tokens);
            finish(endpoint, b.common, prompt, max, logprobs, limits)
        }
        Endpoint::Completion => {
            let b: CompletionBody = serde_json::from_slice(body).map_err(json_err)?;
            if b.echo == Some(true) {
                return Err(ApiError::bad(Some("echo"), "'echo' is not supported"));
            }
            if b.best_of.is_some_and(|n| n != 1) {
                return Err(ApiError::bad(
                    Some("best_of"),
                    "only best_of = 1 is supported",
                ));
            }
            if b.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
                return Err(ApiError::bad(Some("suffix"), "'suffix' is not supported"));
            }
            let encode = |t: &str| {
                vocab
                    .encode_prompt(t)
                    .map_err(|e| ApiError::bad(Some("prompt"), format!("tokenizing: {e:#}")))
            };
            let one = "one prompt per request is supported (an array of several was given)";
            let prompt = match b.prompt {
                None => return Err(ApiError::bad(Some("prompt"), "'prompt' is required")),
                Some(Prompt::Text(t)) => encode(&t)?,
                Some(Prompt::Texts(t)) if t.len() == 1 => encode(&t[0])?,
                Some(Prompt::Tokens(t)) => t,
                Some(Prompt::TokenLists(mut t)) if t.len() == 1 => t.remove(0),
                Some(Prompt::Texts(_) | Prompt::TokenLists(_)) => {
                    return Err(ApiError::bad(Some("prompt"), one))
                }
            };
            if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
                return Err(ApiError::bad(
                    Some("prompt"),
                    format!(
                        "token id {bad} is outside the vocabulary of {} tokens",
                        limits.vocab_size
                    ),
                ));
            }
            let logprobs = b.logprobs.map(|n| top_count("logprobs", n)).transpose()?;
            // OpenAI's default for completions.
            let max = Some(b.common.max_tokens.unwrap_or(16));
            finish(endpoint, b.common, prompt, max, logprobs, limits)
        }
    }
}

fn top_count(param: &'static str, n: u64) -> Result<usize, ApiError> {
    if n > MAX_TOP_LOGPROBS {
        return Err(ApiError::bad(
            Some(param),
            format!("'{param}' is {n}, at most {MAX_TOP_LOGPROBS} are supported"),
        ));
    }
    Ok(n as usize)
}

/// A message's text: a string, or text parts (concatenated).
fn text_content(i: usize, c: Option<Content>) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t),
        Some(Content::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.kind.as_str(), p.text) {
                    ("text", Some(t)) => s.push_str(&t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            Some("messages"),
                            format!("messages[{i}]: content part of type '{kind}' is not supported (text only)"),
                        ))
                    }
                }
            }
            Ok(s)
        }
    }
}

/// The checks and sampler settings both endpoints share.
fn finish(
    endpoint: Endpoint,
    c: Common,
    prompt: Vec<u32>,
    max_tokens: Option<u64>,
    logprobs: Option<usize>,
    limits: &Limits,
) -> Result<GenRequest, ApiError> {
    if let Some(m) = &c.model {
        if m != limits.model_id {
            return Err(ApiError::bad(
                Some("model"),
                format!(
                    "unknown model '{m}': this server runs '{}'",
                    limits.model_id
                ),
            ));
        }
    }
    if c.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::bad(
            Some("logit_bias"),
            "'logit_bias' is not supported",
        ));
    }
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad(
                Some("n"),
                format!("n = {n}: only n = 1 is supported"),
            ));
        }
    }
    if prompt.is_empty() {
        return Err(ApiError::bad(
            None,
            "the prompt is empty (it tokenizes to no tokens)",
        ));
    }
    if prompt.len() > limits.ctx {
        return Err(ApiError::bad(
            None,
            format!(
                "the prompt has {} tokens, more than the context of {} tokens (start the server with a larger --ctx)",
                prompt.len(),
                limits.ctx
            ),
        ));
    }
    // What fits after the prompt (the last sampled token is never fed back).
    let fits = limits.ctx - prompt.len() + 1;
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ApiError::bad(
                Some("max_tokens"),
                "'max_tokens' must be at least 1",
            ))
        }
        Some(m) => (m.min(usize::MAX as u64) as usize).min(fits),
        None => fits,
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            Some("temperature"),
            format!("'temperature' is {temperature}, it must be between 0 and 2"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            Some("top_p"),
            format!("'top_p' is {top_p}, it must be in (0, 1]"),
        ));
    }
    let stop = match c.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    // No seed: a different draw per request, as OpenAI does.
    let seed = match c.seed {
        Some(s) => s as u64,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    // OpenAI semantics: only what the request names truncates the distribution (llama.cpp's
    // top_k 40 / min_p 0.05 defaults are off unless given).
    let params = SamplerParams {
        temperature,
        top_k: c.top_k.unwrap_or(0),
        top_p,
        min_p: c.min_p.unwrap_or(0.0),
        typical_p: 1.0,
        repeat_penalty: c.repeat_penalty.unwrap_or(1.0),
        repeat_last_n: 64,
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        min_keep: 0,
        seed,
    };
    params
        .validate()
        .map_err(|e| ApiError::bad(None, format!("{e:#}")))?;
    let stream = c.stream.unwrap_or(false);
    Ok(GenRequest {
        endpoint,
        prompt,
        params,
        max_tokens,
        stop,
        logprobs,
        stream,
        include_usage: stream
            && c.stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
    })
}
