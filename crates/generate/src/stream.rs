//! Incremental detokenisation: token bytes in, UTF-8-complete text out, with stop-string detection.
//!
//! Byte-level vocabularies split multi-byte characters over several tokens, and a stop string can be
//! spread over several tokens too. [`TextStream`] therefore holds back
//! * bytes of an incomplete UTF-8 sequence at the end (invalid bytes become U+FFFD, like
//!   `String::from_utf8_lossy`), and
//! * the longest suffix of the decoded text that is a proper prefix of some stop string,
//!
//! and only hands out text that can no longer change. When a stop string appears, the text is cut right
//! before it; the stop string and anything after it are never emitted.

/// Streaming detokeniser with stop strings; see the module docs.
#[derive(Debug, Default)]
pub struct TextStream {
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    stops: Vec<String>,
    stopped: Option<usize>,
}

impl TextStream {
    /// A stream that stops at any of `stop_strings` (empty strings are ignored).
    pub fn new<S: AsRef<str>>(stop_strings: &[S]) -> TextStream {
        let stops = stop_strings
            .iter()
            .map(|s| s.as_ref().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        TextStream {
            stops,
            ..Default::default()
        }
    }

    /// Appends the raw bytes of one token and passes newly final text to `on_text` (not called when there
    /// is none). Returns the index (into the non-empty stop strings given to [`TextStream::new`], in
    /// order) of the stop string that ended the text, if one did; after that, pushes are ignored.
    pub fn push(&mut self, bytes: &[u8], on_text: &mut dyn FnMut(&str)) -> Option<usize> {
        if self.stopped.is_some() {
            return self.stopped;
        }
        self.pending.extend_from_slice(bytes);
        self.decode_pending(false);
        // A stop string cannot start before `emitted`: every suffix that could begin one was held back.
        let region = &self.text[self.emitted..];
        let mut hit: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(pos) = region.find(s.as_str()) {
                if hit.is_none_or(|(p, _)| pos < p) {
                    hit = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = hit {
            let end = self.emitted + pos;
            self.text.truncate(end);
            self.pending.clear();
            self.flush_to(end, on_text);
            self.stopped = Some(i);
            return self.stopped;
        }
        let hold = self.holdback();
        let end = self.text.len() - hold;
        self.flush_to(end, on_text);
        None
    }

    /// Ends the stream: held-back text and any incomplete UTF-8 tail (as U+FFFD) are emitted.
    pub fn finish(&mut self, on_text: &mut dyn FnMut(&str)) {
        if self.stopped.is_some() {
            return;
        }
        self.decode_pending(true);
        let end = self.text.len();
        self.flush_to(end, on_text);
    }

    /// All text decoded so far (including held-back text; cut at the stop string once one was found).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Consumes the stream and returns its text.
    pub fn into_text(self) -> String {
        self.text
    }

    /// Index of the stop string that ended the stream, if any.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// The stop strings in effect (empty ones removed).
    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    fn flush_to(&mut self, end: usize, on_text: &mut dyn FnMut(&str)) {
        if end > self.emitted {
            on_text(&self.text[self.emitted..end]);
            self.emitted = end;
        }
    }

    /// Moves complete UTF-8 from `pending` into `text`; with `finish`, an incomplete tail too (lossy).
    fn decode_pending(&mut self, finish: bool) {
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.text.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Cannot fail: from_utf8 just validated these `valid` bytes.
                    self.text.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or(""),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(n) => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            start += n;
                        }
                        None if finish => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            start = self.pending.len();
                            break;
                        }
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
    }

    /// Length of the longest suffix of the unemitted text that is a proper prefix of a stop string.
    fn holdback(&self) -> usize {
        let region = &self.text.as_bytes()[self.emitted..];
        let mut best = 0;
        for s in &self.stops {
            let s = s.as_bytes();
            let max = (s.len() - 1).min(region.len());
            for k in (best + 1..=max).rev() {
                if region.ends_with(&s[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}
