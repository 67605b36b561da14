//! `npuc serve`: loads the model once, makes one instance per concurrent session (the weights
//! shared, a KV cache each) and hands them to `npuc_serve::serve`.

use crate::llm_cmd::{load, Model, ModelArgs, Tok};
use anyhow::{bail, Result};
use clap::Args;
use npuc_generate::CausalLm;
use std::sync::Arc;

/// `npuc serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests generated at once, each in its own session (KV cache).
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free session; more are answered 503.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
}

impl npuc_serve::Vocab for Tok<'_> {
    /// As `npuc generate --prompt` encodes its prompt (BOS added when the model asks for it).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.0.encode(text, true)?)
    }
    fn has_chat_template(&self) -> bool {
        self.0.chat_template().is_some()
    }
}

/// `npuc serve`: listens until the process is stopped.
pub fn serve_cmd(a: &ServeArgs) -> Result<()> {
    if a.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let (model, tok) = load(&a.model)?;
    let mut sessions: Vec<Box<dyn CausalLm + Send>> = Vec::with_capacity(a.parallel);
    match model {
        Model::Engine(e) => {
            // Forks share the variant sessions and so the weights (the mapping and any
            // repacked copy); each has its own KV cache.
            for _ in 1..a.parallel {
                sessions.push(Box::new(Model::Engine(e.fork())));
            }
            sessions.push(Box::new(Model::Engine(e)));
        }
        bundle @ Model::Bundle(_) => {
            // A bundle's parts are artifacts whose weights are read from their mapping: opening
            // it again maps the same files (one copy in the page cache), with new caches.
            for _ in 1..a.parallel {
                sessions.push(Box::new(load(&a.model)?.0));
            }
            sessions.push(Box::new(bundle));
        }
    }
    let model_id = a
        .model
        .model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| a.model.model.display().to_string());
    let ctx = sessions[0].ctx();
    // The server runs until the process ends: the tokenizer lives as long.
    let tok: &'static npuc_tokenizer::Tokenizer = Box::leak(Box::new(tok));
    let opts = npuc_serve::ServeOptions {
        host: a.host.clone(),
        port: a.port,
        queue: a.queue,
        model_id: model_id.clone(),
    };
    npuc_serve::serve(&opts, sessions, Arc::new(Tok(tok)), |addr| {
        eprintln!(
            "npuc serve: listening on http://{addr} (model '{model_id}', ctx {ctx}, --parallel {}, --queue {})",
            a.parallel, a.queue
        );
    })
}
