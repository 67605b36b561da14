//! The sessions: one blocking thread per KV cache, fed from the bounded request queue.
//!
//! Each worker takes a job, runs npuc-generate's loop on its own model instance (the weights are
//! shared between instances, the caches are not) and sends the text as it becomes final. A job
//! whose client went away is skipped if still queued, and stops at its next token if running
//! ([`TokenObserver`] returning `false`); the session is then free for the next job.

use crate::api::GenRequest;
use crate::metrics::Metrics;
use crate::Vocab;
use npuc_generate::{generate_observed, CausalLm, StopReason, TokenObserver};
use std::cell::RefCell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// One generated token's log-probability and the most likely alternatives.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: TokenPiece,
    pub logprob: f32,
    pub top: Vec<(TokenPiece, f32)>,
}

/// A token's text (lossy UTF-8) and raw bytes.
#[derive(Clone, Debug)]
pub struct TokenPiece {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl TokenPiece {
    fn of(vocab: &dyn Vocab, id: u32) -> TokenPiece {
        let bytes = vocab.token_bytes(id);
        TokenPiece {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    }
}

/// How a finished generation ended.
#[derive(Clone, Debug)]
pub struct Finished {
    /// OpenAI's `finish_reason`: `stop` (end-of-generation token or stop string) or `length`.
    pub finish_reason: &'static str,
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Log-probabilities not yet sent with a text event (all of them when not streaming).
    pub logprobs: Vec<TokenLogprob>,
}

/// What a worker tells the request's handler.
#[derive(Debug)]
pub enum Event {
    /// Streaming only: newly final text and the log-probabilities of the tokens since the last one.
    Text(String, Vec<TokenLogprob>),
    Done(Finished),
    Error(String),
}

/// A request handed to a worker.
pub struct Job {
    pub req: GenRequest,
    pub events: UnboundedSender<Event>,
    /// Set when the client is gone (the handler's [`CancelOnDrop`] was dropped).
    pub cancel: Arc<AtomicBool>,
}

/// Held by a request's handler (or its response stream): dropping it cancels the job.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A worker's loop: until the queue is closed, take a job and run it on `lm`.
pub fn run(
    mut lm: Box<dyn CausalLm + Send>,
    vocab: Arc<dyn Vocab>,
    queue: Arc<Mutex<Receiver<Job>>>,
    metrics: Arc<Metrics>,
) {
    loop {
        let job = {
            let rx = queue.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        if job.cancel.load(Ordering::Relaxed) {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        metrics.active.fetch_add(1, Ordering::Relaxed);
        // A failure of one request must not take the server down: a panic is answered as an
        // error and the session's cache is reset by the next job anyway.
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            generate_job(&mut *lm, &*vocab, &job, &metrics)
        }));
        metrics.active.fetch_sub(1, Ordering::Relaxed);
        let event = match r {
            Ok(Ok(Some(done))) => Event::Done(done),
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => Event::Error(format!("generation failed: {e:#}")),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                Event::Error(format!("generation failed (internal error: {msg})"))
            }
        };
        // The client may be gone; nothing to do then.
        let _ = job.events.send(event);
    }
}

/// Sees each token: collects log-probabilities and stops when the client is gone.
struct Observer<'a> {
    vocab: &'a dyn Vocab,
    cancel: &'a AtomicBool,
    top: Option<usize>,
    pending: &'a RefCell<Vec<TokenLogprob>>,
}

impl TokenObserver for Observer<'_> {
    fn wants_logits(&self) -> bool {
        self.top.is_some()
    }

    fn on_token(&mut self, token: u32, logits: &[f32]) -> bool {
        if let Some(n) = self.top {
            // The end-of-generation token adds no text; OpenAI reports no entry for it.
            if !self.vocab.is_eog(token) {
                self.pending
                    .borrow_mut()
                    .push(logprobs_of(self.vocab, logits, token, n));
            }
        }
        !self.cancel.load(Ordering::Relaxed)
    }
}

/// Runs one job; `None` when it was cancelled (nothing to send).
fn generate_job(
    lm: &mut (dyn CausalLm + Send),
    vocab: &dyn Vocab,
    job: &Job,
    metrics: &Metrics,
) -> anyhow::Result<Option<Finished>> {
    let req = &job.req;
    let pending = RefCell::new(Vec::new());
    let mut observer = Observer {
        vocab,
        cancel: &job.cancel,
        top: req.logprobs,
        pending: &pending,
    };
    let mut on_text = |s: &str| {
        if req.stream {
            let lp = std::mem::take(&mut *pending.borrow_mut());
            if job.events.send(Event::Text(s.to_string(), lp)).is_err() {
                job.cancel.store(true, Ordering::Relaxed);
            }
        }
    };
    lm.reset();
    let out = generate_observed(
        lm,
        vocab,
        &req.prompt,
        &req.params,
        req.max_tokens,
        &req.stop,
        &mut on_text,
        Some(&mut observer as &mut dyn TokenObserver),
    )?;
    metrics
        .prompt_tokens
        .fetch_add(out.prompt_tokens as u64, Ordering::Relaxed);
    metrics
        .generated_tokens
        .fetch_add(out.tokens.len() as u64, Ordering::Relaxed);
    if out.decode_tokens_per_s > 0.0 {
        // Every sampled token but the last was fed back as a decode step.
        let steps = out.tokens.len().saturating_sub(1) as f64;
        metrics.decode_micros.fetch_add(
            (steps / out.decode_tokens_per_s * 1e6) as u64,
            Ordering::Relaxed,
        );
        metrics
            .last_decode_rate_bits
            .store(out.decode_tokens_per_s.to_bits(), Ordering::Relaxed);
    }
    let finish_reason = match out.stopped {
        StopReason::Eog | StopReason::StopString(_) => "stop",
        StopReason::MaxTokens => "length",
        StopReason::Cancelled => {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
    };
    Ok(Some(Finished {
        finish_reason,
        prompt_tokens: out.prompt_tokens,
        completion_tokens: out.tokens.len(),
        text: out.text,
        logprobs: pending.into_inner(),
    }))
}

/// `token`'s log-probability under the softmax of `logits` and the `n` most likely tokens
/// (ties: lower id first).
fn logprobs_of(vocab: &dyn Vocab, logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |id: usize| (logits[id] as f64 - lse) as f32;
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let n = n.min(ids.len());
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, by_logit);
    }
    ids.truncate(n);
    ids.sort_by(by_logit);
    TokenLogprob {
        token: TokenPiece::of(vocab, token),
        logprob: lp(token as usize),
        top: ids
            .into_iter()
            .map(|id| (TokenPiece::of(vocab, id as u32), lp(id)))
            .collect(),
    }
}
