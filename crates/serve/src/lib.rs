//! `npuc serve`: an OpenAI-compatible HTTP server over npuc-generate's generation loop.
//!
//! * `POST /v1/chat/completions`, `POST /v1/completions`: streaming (server-sent events, `data:
//!   {...}` chunks then `data: [DONE]`) or one JSON object; temperature, top_p, max_tokens, stop,
//!   seed, logprobs (+ top_logprobs), n = 1; usage counts; finish_reason `stop` / `length`.
//! * `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! Concurrency: `sessions` model instances (one KV cache each, the weights shared), each driven by
//! its own blocking thread ([`worker`]); requests wait in a bounded queue (503 when it is full).
//! The async runtime only parses, tokenizes and moves text. A client that disconnects cancels its
//! request: still queued, it is skipped; generating, it stops at the next token.
#![forbid(unsafe_code)]

pub mod api;
pub mod metrics;
pub mod worker;

use api::{ApiError, Endpoint, GenRequest, Limits};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use metrics::Metrics;
use npuc_generate::chat::ChatTemplate;
use npuc_generate::{CausalLm, TokenText};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use worker::{CancelOnDrop, Event, Finished, Job, TokenLogprob};

/// What the server needs from a tokenizer: token text, chat rendering, prompt encoding.
pub trait Vocab: TokenText + ChatTemplate + Send + Sync {
    /// Token ids of a plain completion prompt, encoded as `npuc generate --prompt` does.
    fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>>;
    /// Whether chat requests can be rendered.
    fn has_chat_template(&self) -> bool;
}

/// Where and how to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0: any free port (the bound address is passed to `on_listening`).
    pub port: u16,
    /// Requests that may wait for a free session; one more is answered 503.
    pub queue: usize,
    /// The model's name in `/v1/models` and in requests' `model`.
    pub model_id: String,
}

struct App {
    queue: SyncSender<Job>,
    metrics: Arc<Metrics>,
    vocab: Arc<dyn Vocab>,
    model_id: String,
    ctx: usize,
    vocab_size: usize,
    sessions: usize,
    queue_len: usize,
    created: u64,
    next_id: AtomicU64,
}

/// Serves until the process ends. `sessions` are the model instances (one per concurrent
/// request, all of the same model and context); `on_listening` gets the bound address once
/// requests are accepted.
pub fn serve(
    opts: &ServeOptions,
    sessions: Vec<Box<dyn CausalLm + Send>>,
    vocab: Arc<dyn Vocab>,
    on_listening: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let Some(first) = sessions.first() else {
        anyhow::bail!("serve: no sessions (--parallel must be at least 1)");
    };
    let (ctx, vocab_size) = (first.ctx(), first.vocab());
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = sync_channel::<Job>(opts.queue);
    let rx = Arc::new(Mutex::new(rx));
    let n = sessions.len();
    for (i, lm) in sessions.into_iter().enumerate() {
        let (vocab, rx, metrics) = (vocab.clone(), rx.clone(), metrics.clone());
        std::thread::Builder::new()
            .name(format!("npuc-serve-{i}"))
            .spawn(move || worker::run(lm, vocab, rx, metrics))?;
    }
    let app = Arc::new(App {
        queue: tx,
        metrics,
        vocab,
        model_id: opts.model_id.clone(),
        ctx,
        vocab_size,
        sessions: n,
        queue_len: opts.queue,
        created: unix_now(),
        next_id: AtomicU64::new(1),
    });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .fallback(not_found)
        .with_state(app);
    // Two threads are plenty for parsing and moving text; generation runs on the workers.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("npuc-serve-http")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", opts.host, opts.port))?;
        on_listening(listener.local_addr()?);
        axum::serve(listener, router).await?;
        Ok(())
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A JSON response with `status`.
pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn chat(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, Endpoint::Chat, body).await
}

async fn completion(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, Endpoint::Completion, body).await
}

async fn generate(app: Arc<App>, endpoint: Endpoint, body: Bytes) -> Response {
    let limits = Limits {
        model_id: &app.model_id,
        ctx: app.ctx,
        vocab_size: app.vocab_size,
    };
    let r = match api::parse(endpoint, &body, &*app.vocab, &limits) {
        Ok(req) => submit(&app, req).await,
        Err(e) => Err(e),
    };
    let r = r.unwrap_or_else(axum::response::IntoResponse::into_response);
    app.metrics.request(endpoint.path(), r.status().as_u16());
    r
}

/// Queues `req` and answers with its stream or, once generated, its JSON.
async fn submit(app: &Arc<App>, req: GenRequest) -> Result<Response, ApiError> {
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    let (stream, endpoint) = (req.stream, req.endpoint);
    let logprobs = req.logprobs.is_some();
    let include_usage = req.include_usage;
    let prompt_tokens = req.prompt.len();
    app.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = app.queue.try_send(Job {
        req,
        events,
        cancel,
    }) {
        app.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(match e {
            TrySendError::Full(_) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: format!(
                    "the server is busy: {} sessions are generating and {} requests are queued (--parallel, --queue); retry later",
                    app.sessions, app.queue_len
                ),
                param: None,
            },
            TrySendError::Disconnected(_) => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: "the generation workers have stopped".into(),
                param: None,
            },
        });
    }
    let ids = ResponseIds {
        id: format!(
            "{}-{}",
            match endpoint {
                Endpoint::Chat => "chatcmpl",
                Endpoint::Completion => "cmpl",
            },
            app.next_id.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_now(),
        model: app.model_id.clone(),
        endpoint,
        logprobs,
    };
    if stream {
        let state = StreamState {
            rx,
            _guard: guard,
            ids,
            include_usage,
            prompt_tokens,
            out: std::collections::VecDeque::new(),
            started: false,
            done: false,
            lp_offset: 0,
        };
        let body = futures_util::stream::unfold(state, |mut s| async move {
            let chunk = s.next().await?;
            Some((Ok::<_, std::convert::Infallible>(chunk), s))
        });
        let mut r = Response::new(Body::from_stream(body));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
        return Ok(r);
    }
    // Not streaming: the guard lives in this future, which the server drops if the client
    // disconnects.
    let _guard = guard;
    loop {
        match rx.recv().await {
            Some(Event::Text(..)) => {}
            Some(Event::Done(f)) => return Ok(json_response(StatusCode::OK, &ids.complete(&f))),
            Some(Event::Error(msg)) => {
                return Err(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: msg,
                    param: None,
                })
            }
            None => {
                return Err(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "the request was dropped by its worker".into(),
                    param: None,
                })
            }
        }
    }
}

/// What every response object of one request repeats.
struct ResponseIds {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    logprobs: bool,
}

impl ResponseIds {
    /// The non-streaming response.
    fn complete(&self, f: &Finished) -> Value {
        let lp = self.logprobs.then(|| self.logprobs_json(&f.logprobs, 0));
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": f.text},
                "logprobs": lp,
                "finish_reason": f.finish_reason,
            }),
            Endpoint::Completion => json!({
                "index": 0, "text": f.text, "logprobs": lp, "finish_reason": f.finish_reason,
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage(f.prompt_tokens, f.completion_tokens),
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// One streamed chunk: `delta` text (chat: with `role` on the first), log-probabilities
    /// of its tokens, and the finish reason on the last.
    fn chunk(
        &self,
        text: &str,
        role: bool,
        lp: &[TokenLogprob],
        offset: usize,
        finish: Option<&str>,
    ) -> Value {
        let lp = (self.logprobs && (!lp.is_empty() || finish.is_none()))
            .then(|| self.logprobs_json(lp, offset));
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if !text.is_empty() || role {
                    delta["content"] = json!(text);
                }
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [choice],
        })
    }

    /// Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: the legacy
    /// `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets from `offset`, in bytes).
    fn logprobs_json(&self, lp: &[TokenLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({
                "content": lp.iter().map(|t| json!({
                    "token": t.token.text, "logprob": t.logprob, "bytes": t.token.bytes,
                    "top_logprobs": t.top.iter().map(|(p, l)| json!({
                        "token": p.text, "logprob": l, "bytes": p.bytes,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
                "refusal": null,
            }),
            Endpoint::Completion => {
                let mut at = offset;
                let offsets: Vec<usize> = lp
                    .iter()
                    .map(|t| {
                        let o = at;
                        at += t.token.text.len();
                        o
                    })
                    .collect();
                json!({
                    "tokens": lp.iter().map(|t| &t.token.text).collect::<Vec<_>>(),
                    "token_logprobs": lp.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": lp.iter().map(|t| {
                        let mut m = serde_json::Map::new();
                        for (p, l) in &t.top {
                            m.entry(p.text.clone()).or_insert(json!(l));
                        }
                        Value::Object(m)
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// A streaming response's state: the worker's events turned into SSE lines.
struct StreamState {
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    /// Dropped with the response body when the client disconnects: cancels the job.
    _guard: CancelOnDrop,
    ids: ResponseIds,
    include_usage: bool,
    prompt_tokens: usize,
    out: std::collections::VecDeque<String>,
    /// Whether the first chunk (chat: the role) was sent.
    started: bool,
    done: bool,
    /// Bytes of the token texts whose log-probabilities were sent (completions' `text_offset`).
    lp_offset: usize,
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

impl StreamState {
    /// The `text_offset` of the first of `lp`; moves past them.
    fn advance(&mut self, lp: &[TokenLogprob]) -> usize {
        let at = self.lp_offset;
        self.lp_offset += lp.iter().map(|t| t.token.text.len()).sum::<usize>();
        at
    }

    /// The next SSE event, `None` at the end.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(s) = self.out.pop_front() {
                return Some(s);
            }
            if self.done {
                return None;
            }
            match self.rx.recv().await {
                Some(Event::Text(text, lp)) => {
                    let role = !self.started;
                    self.started = true;
                    let at = self.advance(&lp);
                    self.out
                        .push_back(sse(&self.ids.chunk(&text, role, &lp, at, None)));
                }
                Some(Event::Done(f)) => {
                    let role = !self.started;
                    self.started = true;
                    let at = self.advance(&f.logprobs);
                    self.out.push_back(sse(&self.ids.chunk(
                        "",
                        role,
                        &f.logprobs,
                        at,
                        Some(f.finish_reason),
                    )));
                    if self.include_usage {
                        let mut u = self.ids.chunk("", false, &[], 0, None);
                        u["choices"] = json!([]);
                        u["usage"] = usage(f.prompt_tokens, f.completion_tokens);
                        self.out.push_back(sse(&u));
                    }
                    self.out.push_back("data: [DONE]\n\n".into());
                    self.done = true;
                }
                Some(Event::Error(msg)) => {
                    let e = ApiError {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message: msg,
                        param: None,
                    };
                    self.out.push_back(sse(&e.body()));
                    self.done = true;
                }
                None => {
                    let e = ApiError {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message: format!(
                            "the request was dropped by its worker ({} prompt tokens)",
                            self.prompt_tokens
                        ),
                        param: None,
                    };
                    self.out.push_back(sse(&e.body()));
                    self.done = true;
                }
            }
        }
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    app.metrics.request("/v1/models", 200);
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": app.model_id, "object": "model", "created": app.created, "owned_by": "npuc",
            "meta": {"n_ctx": app.ctx, "n_vocab": app.vocab_size},
        }]}),
    )
}

async fn health(State(app): State<Arc<App>>) -> Response {
    app.metrics.request("/health", 200);
    let m = &app.metrics;
    json_response(
        StatusCode::OK,
        &json!({
            "status": "ok", "sessions": app.sessions,
            "active": m.active.load(Ordering::Relaxed),
            "queued": m.queue_depth.load(Ordering::Relaxed),
        }),
    )
}

async fn prometheus(State(app): State<Arc<App>>) -> Response {
    app.metrics.request("/metrics", 200);
    let mut r = Response::new(Body::from(app.metrics.render(app.sessions, app.queue_len)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

async fn not_found(State(app): State<Arc<App>>, uri: axum::http::Uri) -> Response {
    app.metrics.request("other", 404);
    let e = ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no route {}: the server has /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics",
            uri.path()
        ),
        param: None,
    };
    axum::response::IntoResponse::into_response(e)
}
