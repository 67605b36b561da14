//! `npuc serve` end to end: the server is started on a free port of 127.0.0.1 with SmolLM2-135M
//! and driven by the official `openai` Python client (`serve_openai.py`, run by the test venv's
//! interpreter). Greedy outputs are compared with `npuc generate --temperature 0` for the same
//! prompts; the load test sends 64 streaming requests from 8 concurrent clients and compares
//! every response with its reference.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// The servers of these tests run one at a time: on a small machine, concurrent servers would
/// only slow each other (and the load test's latencies would mean nothing).
static SERIAL: Mutex<()> = Mutex::new(());

/// Context of the server and of the references (small, so a too-long prompt is cheap to make).
const CTX: &str = "512";

const COMPLETION_PROMPTS: &[(&str, usize)] = &[
    ("The capital of France is", 24),
    ("Once upon a time, in a small village,", 32),
    ("def fibonacci(n):", 40),
    ("The three primary colors are", 20),
    ("Water boils at", 16),
    ("A list of fruits: apple, banana,", 28),
    ("The quick brown fox", 24),
    ("In 1969, the first humans", 36),
];

const CHAT_PROMPTS: &[(&str, usize)] = &[
    ("What is the capital of France?", 32),
    ("Write a haiku about the sea.", 40),
    ("Name three programming languages.", 28),
    ("How many legs does a spider have?", 24),
    ("Say hello in Spanish.", 16),
    ("What is 2 + 2?", 20),
    ("Give me a word that rhymes with cat.", 24),
    ("What color is the sky on a clear day?", 36),
];

fn npuc() -> Command {
    Command::new(env!("CARGO_BIN_EXE_npuc"))
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve_openai.py")
}

/// `npuc generate --temperature 0 --json` for one prompt.
fn reference(model: &Path, prompt: &str, max_tokens: usize, chat: bool) -> serde_json::Value {
    let mut cmd = npuc();
    cmd.arg("generate")
        .arg(model)
        .args([
            "--ctx",
            CTX,
            "--temperature",
            "0",
            "--json",
            "--prompt",
            prompt,
        ])
        .args(["--max-tokens", &max_tokens.to_string()]);
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd.output().expect("npuc generate runs");
    assert!(
        out.status.success(),
        "npuc generate {prompt:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("generate --json");
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "text": j["text"],
        "tokens": j["tokens"].as_array().expect("tokens").len(),
        "prompt_tokens": j["prompt_tokens"].as_array().expect("prompt_tokens").len(),
        "stopped": j["stopped"],
    })
}

/// The references of every prompt, made once, in a file for the client script.
fn refs_file(model: &Path, model_id: &str) -> PathBuf {
    static REFS: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    REFS.get_or_init(|| {
        let t0 = std::time::Instant::now();
        let completion: Vec<_> = COMPLETION_PROMPTS
            .iter()
            .map(|(p, n)| reference(model, p, *n, false))
            .collect();
        let chat: Vec<_> = CHAT_PROMPTS
            .iter()
            .map(|(p, n)| reference(model, p, *n, true))
            .collect();
        eprintln!(
            "references from npuc generate: {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("refs.json");
        let j = serde_json::json!({
            "model": model_id, "ctx": CTX.parse::<usize>().expect("ctx"),
            "completion": completion, "chat": chat,
        });
        std::fs::write(&path, j.to_string()).expect("write refs");
        (dir, path)
    })
    .1
    .clone()
}

/// A running `npuc serve`; killed when dropped.
struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = npuc()
            .arg("serve")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0", "--ctx", CTX])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("npuc serve starts");
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut seen = String::new();
        let base = loop {
            let mut line = String::new();
            let n = stderr
                .read_line(&mut line)
                .expect("read npuc serve's stderr");
            if n == 0 {
                let _ = child.kill();
                panic!("npuc serve exited before listening:\n{seen}");
            }
            seen.push_str(&line);
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().expect("address").to_string();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            while stderr.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        Server { child, base }
    }

    /// Runs the client script in `mode`; returns its summary line.
    fn client(&self, mode: &str, refs: &Path) -> String {
        let out = npuc_testsupport::python()
            .arg(script())
            .args([mode, &self.base])
            .arg(refs)
            .output()
            .expect("the test venv's python runs");
        let so = String::from_utf8_lossy(&out.stdout).to_string();
        let se = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success(),
            "serve_openai.py {mode} failed (is `openai` in the test venv? scripts/setup.sh installs \
             scripts/requirements-test.txt):\n{so}\n{se}"
        );
        // The server survived everything the client sent.
        assert!(
            self.alive(),
            "npuc serve exited during serve_openai.py {mode}"
        );
        so.trim().to_string()
    }

    fn alive(&self) -> bool {
        let pid = self.child.id();
        Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.split_whitespace().nth(2) == Some("Z"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn model() -> PathBuf {
    npuc_testsupport::smollm2_gguf()
}

fn model_id(model: &Path) -> String {
    model
        .file_stem()
        .expect("model file name")
        .to_string_lossy()
        .into_owned()
}

/// Starts `npuc serve` with `flags` (one server at a time), runs the client script in `mode`
/// against it and returns the script's summary line.
fn serve_and_run(mode: &str, flags: &[&str]) -> String {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = model();
    let refs = refs_file(&model, &model_id(&model));
    let server = Server::start(&model, flags);
    let summary = server.client(mode, &refs);
    // Visible with --nocapture: the load test's latency percentiles and throughput.
    eprintln!("serve_openai.py {mode}: {summary}");
    summary
}

#[test]
fn openai_client_chat_and_completions_match_generate() {
    serve_and_run("api", &["--parallel", "2"]);
}

#[test]
fn load_64_streaming_requests_from_8_clients() {
    let summary = serve_and_run("load", &["--parallel", "4", "--queue", "64"]);
    let j: serde_json::Value = serde_json::from_str(&summary).expect("summary JSON");
    assert_eq!(j["errors"], 0);
    assert_eq!(j["requests"], 64);
}

#[test]
fn full_queue_is_503_and_disconnect_cancels() {
    serve_and_run("busy", &["--parallel", "1", "--queue", "1"]);
}

#[test]
fn serve_flags_are_checked() {
    let out = npuc()
        .args(["serve", "/nonexistent.gguf", "--parallel", "0"])
        .output()
        .expect("npuc runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--parallel must be at least 1"), "{err}");
}
