//! `npuc.LLM`: an LLM (`.gguf`, LLM `.npuc`, or a bundle directory from `npuc build`) loaded as
//! `npuc generate` loads it (`npuc_cli::llm_cmd::load`), generating text with the CLI's
//! prompt handling (`prompt_ids`), sampling options and generation loop (`npuc_generate`).
//!
//! `generate` returns the text; `stream` (or `generate(..., stream=True)`) returns an iterator
//! of text pieces produced by a generation running on its own thread; dropping the iterator
//! (or `close()`) stops that generation at the next token.

use crate::args::{parse_args, Kwargs};
use crate::{err, path_arg};
use npuc_cli::llm_cmd::{self, GenerateArgs, ModelArgs, Tok};
use npuc_generate::{GenOutput, TokenObserver};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};

/// The options of `npuc generate` that `generate`/`stream` take besides the sampling flags (by
/// flag name); the model options (threads, ctx, precision, chat_template, variants) belong to
/// `LLM(...)`.
const GENERATE_OPTIONS: &[&str] = &["max_tokens", "chat", "no_bos", "prompt_tokens"];

/// The loaded model and its tokenizer; one generation at a time.
struct Loaded {
    model: llm_cmd::Model,
    tok: npuc_tokenizer::Tokenizer,
}

/// An LLM loaded for generation.
#[pyclass(frozen, module = "npuc", name = "LLM")]
pub struct Llm {
    loaded: Arc<Mutex<Loaded>>,
    path: PathBuf,
    last: Arc<Mutex<Option<serde_json::Value>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A generation that panicked leaves the model usable (generate resets the cache first).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What `npuc generate --json` prints about a generation, with its warnings.
fn result_json(out: &GenOutput, prompt: &[u32]) -> serde_json::Value {
    let mut j = llm_cmd::json_out(out, prompt);
    j["warnings"] = serde_json::json!(out.warnings);
    j
}

/// Stops a generation when its stream was dropped or closed.
struct Cancel(Arc<AtomicBool>);

impl TokenObserver for Cancel {
    fn on_token(&mut self, _token: u32, _logits: &[f32]) -> bool {
        !self.0.load(Ordering::Relaxed)
    }
}

/// Parses the generate options (the prompt as `--prompt`, or `prompt_tokens=[...]`).
fn generate_args(
    path: &std::path::Path,
    prompt: Option<String>,
    options: Option<&Bound<'_, PyDict>>,
    fname: &'static str,
) -> PyResult<GenerateArgs> {
    let mut fixed = vec![];
    if let Some(p) = prompt {
        fixed.push(("prompt".to_string(), p));
    }
    let only: Vec<&str> = GENERATE_OPTIONS
        .iter()
        .chain(llm_cmd::SAMPLING_FLAGS)
        .copied()
        .collect();
    let kw = Kwargs::new(fname, options, &["prompt"]).only(&only);
    let (a, cmd, m) = parse_args::<GenerateArgs>(fname, &kw, &fixed, &[path.to_path_buf()])?;
    let given = npuc_cli::flags::Given {
        cmd: &cmd,
        matches: &m,
    };
    llm_cmd::check_generate_flags(&a, &given).map_err(err)?;
    Ok(a)
}

/// One generation on `loaded`: the CLI's prompt handling and generation loop.
fn run_generation(
    loaded: &mut Loaded,
    a: &GenerateArgs,
    on_text: &mut dyn FnMut(&str),
    cancel: Option<&mut Cancel>,
) -> anyhow::Result<serde_json::Value> {
    let Loaded { model, tok } = loaded;
    let prompt = llm_cmd::prompt_ids(a, tok)?;
    // From an empty cache, as `npuc generate` (npuc_generate::generate resets first too).
    npuc_generate::CausalLm::reset(model);
    let out = npuc_generate::generate_observed(
        model,
        &Tok(tok),
        &prompt,
        &a.sampling.params(),
        a.max_tokens,
        &a.sampling.stop,
        on_text,
        cancel.map(|c| c as &mut dyn TokenObserver),
    )?;
    Ok(result_json(&out, &prompt))
}

#[pymethods]
impl Llm {
    /// Loads `path` (`.gguf`, LLM `.npuc` or a bundle directory) as `npuc generate` does; the
    /// options are `npuc generate`'s model flags: `threads` (default: all cores), `ctx`,
    /// `precision` ("fast", "parity", "exact"; GGUF only), `chat_template`, `variants`.
    #[new]
    #[pyo3(signature = (path, **options))]
    fn new(
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Llm> {
        let path = path_arg(path)?;
        let kw = Kwargs::new("LLM", options, &["model"]);
        let (a, cmd, m) = parse_args::<ModelArgs>("LLM", &kw, &[], std::slice::from_ref(&path))?;
        let given = npuc_cli::flags::Given {
            cmd: &cmd,
            matches: &m,
        };
        llm_cmd::check_model_flags(&a, &given).map_err(err)?;
        let (model, tok) = py.detach(|| llm_cmd::load(&a)).map_err(err)?;
        Ok(Llm {
            loaded: Arc::new(Mutex::new(Loaded { model, tok })),
            path,
            last: Arc::new(Mutex::new(None)),
        })
    }

    /// Generates from `prompt` (or `prompt_tokens=[ids]`) with `npuc generate`'s options and
    /// defaults: `max_tokens=128`, `temperature=0.8` (0: greedy), `top_k=40`, `top_p=0.95`,
    /// `min_p=0.05`, `repeat_penalty=1.0`, `seed=0`, `stop=[...]`, `chat=False`, `no_bos=False`,
    /// ... Returns the text (`last_result` has the token ids and speeds); with `stream=True`,
    /// the iterator `stream()` returns.
    #[pyo3(signature = (prompt=None, *, stream=false, **options))]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: Option<String>,
        stream: bool,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        if stream {
            return Ok(self
                .stream(prompt, options)?
                .into_pyobject(py)?
                .into_any()
                .unbind());
        }
        let a = generate_args(&self.path, prompt, options, "generate")?;
        let loaded = self.loaded.clone();
        let j = py
            .detach(|| run_generation(&mut lock(&loaded), &a, &mut |_| {}, None))
            .map_err(err)?;
        let text = j["text"].as_str().unwrap_or_default().to_string();
        *lock(&self.last) = Some(j);
        Ok(text.into_pyobject(py)?.into_any().unbind())
    }

    /// Like `generate`, but returns an iterator over the text as it is generated (pieces that
    /// are final: stop strings held back until they cannot match).
    #[pyo3(signature = (prompt=None, **options))]
    fn stream(
        &self,
        prompt: Option<String>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<TokenStream> {
        let a = generate_args(&self.path, prompt, options, "stream")?;
        // Unbounded: the generation never waits for its reader, so it always ends (at
        // max_tokens, or at the next token once closed) and frees the model for the next call,
        // even when a stream is left half read.
        let (tx, rx) = channel::<Msg>();
        let cancel = Arc::new(AtomicBool::new(false));
        let loaded = self.loaded.clone();
        let last = self.last.clone();
        let flag = cancel.clone();
        std::thread::Builder::new()
            .name("npuc-generate".into())
            .spawn(move || {
                let mut c = Cancel(flag.clone());
                let text_tx = tx.clone();
                let r = run_generation(
                    &mut lock(&loaded),
                    &a,
                    &mut |s: &str| {
                        if text_tx.send(Msg::Text(s.to_string())).is_err() {
                            flag.store(true, Ordering::Relaxed);
                        }
                    },
                    Some(&mut c),
                );
                let end = match r {
                    Ok(j) => {
                        *lock(&last) = Some(j.clone());
                        Msg::Done(Ok(j))
                    }
                    Err(e) => Msg::Done(Err(format!("{e:#}"))),
                };
                let _ = tx.send(end);
            })
            .map_err(|e| {
                crate::NpucError::new_err(format!("starting the generation thread: {e}"))
            })?;
        Ok(TokenStream {
            rx: Mutex::new(Some(rx)),
            cancel,
            result: Mutex::new(None),
        })
    }

    /// What `npuc generate --json` prints about the last finished generation (`prompt_tokens`,
    /// `tokens`, `text`, `prefill_tokens_per_s`, `decode_tokens_per_s`, `stopped`), or None.
    #[getter]
    fn last_result<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let j = lock(&self.last).clone();
        j.map(|j| crate::json_to_py(py, &j)).transpose()
    }

    /// Tokenizes `text` as `generate` tokenizes a prompt (BOS added unless `no_bos`; the chat
    /// template with `chat=True`).
    #[pyo3(signature = (text, *, chat=false, no_bos=false))]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: String,
        chat: bool,
        no_bos: bool,
    ) -> PyResult<Vec<u32>> {
        let opts = PyDict::new(py);
        opts.set_item("chat", chat)?;
        opts.set_item("no_bos", no_bos)?;
        let a = generate_args(&self.path, Some(text), Some(&opts), "tokenize")?;
        let l = lock(&self.loaded);
        llm_cmd::prompt_ids(&a, &l.tok).map_err(err)
    }

    /// The model's vocabulary size.
    #[getter]
    fn vocab(&self) -> usize {
        lock(&self.loaded).model.vocab()
    }

    /// The context length in tokens.
    #[getter]
    fn ctx(&self) -> usize {
        npuc_generate::CausalLm::ctx(&lock(&self.loaded).model)
    }

    fn __repr__(&self) -> String {
        format!("npuc.LLM({:?})", self.path.display().to_string())
    }
}

enum Msg {
    Text(String),
    Done(Result<serde_json::Value, String>),
}

/// Text pieces of a running generation (`for piece in llm.stream(prompt): ...`). After the
/// last piece, `result` holds what `LLM.last_result` holds. Closing it (or dropping it) stops
/// the generation.
#[pyclass(frozen, module = "npuc")]
pub struct TokenStream {
    rx: Mutex<Option<Receiver<Msg>>>,
    cancel: Arc<AtomicBool>,
    result: Mutex<Option<serde_json::Value>>,
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let mut guard = lock(&self.rx);
        let Some(rx) = guard.take() else {
            return Ok(None);
        };
        let (rx, msg) = py.detach(move || {
            let m = rx.recv();
            (rx, m)
        });
        match msg {
            Ok(Msg::Text(s)) => {
                *guard = Some(rx);
                Ok(Some(s))
            }
            Ok(Msg::Done(Ok(j))) => {
                *lock(&self.result) = Some(j);
                Ok(None)
            }
            Ok(Msg::Done(Err(e))) => Err(crate::NpucError::new_err(e)),
            Err(_) => Err(crate::NpucError::new_err(
                "the generation thread ended without a result",
            )),
        }
    }

    /// Stops the generation (at its next token) and ends the iteration.
    fn close(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        *lock(&self.rx) = None;
    }

    /// What `npuc generate --json` prints about this generation, once it has finished.
    #[getter]
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let j = lock(&self.result).clone();
        j.map(|j| crate::json_to_py(py, &j)).transpose()
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}
