//! Server counters and their Prometheus text exposition (`GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Everything `/metrics` reports; updated by the HTTP handlers and the workers.
#[derive(Default)]
pub struct Metrics {
    /// Responses by (endpoint, HTTP status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Wall time of the decode steps of finished generations, in microseconds.
    pub decode_micros: AtomicU64,
    /// Decode speed of the last finished generation, tokens/s as f64 bits.
    pub last_decode_rate_bits: AtomicU64,
    /// Generations stopped because their client went away (while queued or generating).
    pub cancelled: AtomicU64,
    /// Requests waiting for a free session.
    pub queue_depth: AtomicUsize,
    /// Sessions generating now.
    pub active: AtomicUsize,
}

impl Metrics {
    /// Counts one response of `endpoint` with `status`.
    pub fn request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// Prometheus text format 0.0.4; `parallel` and `queue` are the configured bounds.
    pub fn render(&self, parallel: usize, queue: usize) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<String>| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for l in lines {
                let _ = writeln!(o, "{name}{l}");
            }
        };
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        metric(
            "npuc_requests_total",
            "counter",
            "HTTP responses by endpoint and status code.",
            requests
                .iter()
                .map(|((e, s), n)| format!("{{endpoint=\"{e}\",status=\"{s}\"}} {n}"))
                .collect(),
        );
        drop(requests);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let scalars: [(&str, &str, &str, String); 9] = [
            (
                "npuc_prompt_tokens_total",
                "counter",
                "Prompt tokens evaluated.",
                load(&self.prompt_tokens).to_string(),
            ),
            (
                "npuc_generated_tokens_total",
                "counter",
                "Tokens generated.",
                load(&self.generated_tokens).to_string(),
            ),
            (
                "npuc_decode_seconds_total",
                "counter",
                "Wall time of decode steps (generated tokens / this = mean decode tokens/s).",
                format!("{:.6}", load(&self.decode_micros) as f64 / 1e6),
            ),
            (
                "npuc_decode_tokens_per_second",
                "gauge",
                "Decode speed of the last finished generation.",
                format!("{:.3}", f64::from_bits(load(&self.last_decode_rate_bits))),
            ),
            (
                "npuc_cancelled_total",
                "counter",
                "Generations stopped because the client disconnected.",
                load(&self.cancelled).to_string(),
            ),
            (
                "npuc_queue_depth",
                "gauge",
                "Requests waiting for a free session.",
                self.queue_depth.load(Ordering::Relaxed).to_string(),
            ),
            (
                "npuc_queue_capacity",
                "gauge",
                "Requests that may wait (--queue); more get 503.",
                queue.to_string(),
            ),
            (
                "npuc_active_sessions",
                "gauge",
                "Sessions generating now.",
                self.active.load(Ordering::Relaxed).to_string(),
            ),
            (
                "npuc_sessions",
                "gauge",
                "Concurrent sessions, each with its own KV cache (--parallel).",
                parallel.to_string(),
            ),
        ];
        for (name, kind, help, value) in scalars {
            metric(name, kind, help, vec![format!(" {value}")]);
        }
        o
    }
}
