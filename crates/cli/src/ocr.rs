//! PaddleOCR-style text-line recognition: image preprocessing and CTC decoding around a
//! recogniser model (PP-OCRv5/v6 `rec`). The character dictionary comes from the model's
//! metadata (`character`), as PaddleOCR exports it.

use npuc_ir::{Model, Tensor};

/// Converts an RGB8 image to the recogniser input: height `h`, width scaled to keep the aspect
/// ratio (capped at `max_w`), BGR channel order, `(x/255 - 0.5)/0.5`, zero-padded to `max_w`.
/// Layout `[1, 3, h, max_w]`.
pub fn rec_input(rgb: &[u8], width: usize, height: usize, h: usize, max_w: usize) -> Tensor {
    let w = ((h as f64 * width as f64 / height as f64).ceil() as usize).clamp(1, max_w);
    let mut x = vec![0f32; 3 * h * max_w];
    let sx = width as f32 / w as f32;
    let sy = height as f32 / h as f32;
    for oy in 0..h {
        // Half-pixel centres, as PIL/OpenCV bilinear resizing does.
        let fy = ((oy as f32 + 0.5) * sy - 0.5).max(0.0);
        let y0 = (fy as usize).min(height - 1);
        let y1 = (y0 + 1).min(height - 1);
        let wy = fy - y0 as f32;
        for ox in 0..w {
            let fx = ((ox as f32 + 0.5) * sx - 0.5).max(0.0);
            let x0 = (fx as usize).min(width - 1);
            let x1 = (x0 + 1).min(width - 1);
            let wx = fx - x0 as f32;
            for c in 0..3 {
                let p = |yy: usize, xx: usize| rgb[(yy * width + xx) * 3 + c] as f32;
                let v = p(y0, x0) * (1.0 - wx) * (1.0 - wy)
                    + p(y0, x1) * wx * (1.0 - wy)
                    + p(y1, x0) * (1.0 - wx) * wy
                    + p(y1, x1) * wx * wy;
                // BGR: channel 0 of the tensor is blue.
                let plane = 2 - c;
                x[(plane * h + oy) * max_w + ox] = (v / 255.0 - 0.5) / 0.5;
            }
        }
    }
    Tensor::from_vec(vec![1, 3, h, max_w], x).expect("shape matches data")
}

/// The dictionary of a PaddleOCR recogniser: metadata `character` lines plus a trailing space.
pub fn dictionary(m: &Model) -> Option<Vec<String>> {
    let c = m.metadata("character")?;
    let mut chars: Vec<String> = c.split('\n').map(|s| s.to_string()).collect();
    chars.push(" ".into());
    Some(chars)
}

/// Greedy CTC decoding of `[1, T, C]` probabilities: argmax per step, merge repeats, drop the
/// blank (index 0). Returns the text and the mean confidence of the kept characters.
pub fn ctc_decode(probs: &Tensor, chars: &[String]) -> Result<(String, f32), String> {
    let s = probs.shape();
    if s.len() != 3 || s[0] != 1 {
        return Err(format!("expected recogniser output [1, T, C], got {s:?}"));
    }
    let (t, c) = (s[1], s[2]);
    let p = probs.as_slice::<f32>().map_err(|e| e.to_string())?;
    let mut out = String::new();
    let mut conf = vec![];
    let mut prev = usize::MAX;
    for step in 0..t {
        let row = &p[step * c..(step + 1) * c];
        let (best, &score) = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .ok_or("empty class dimension")?;
        if best != prev && best != 0 {
            out.push_str(chars.get(best - 1).map(|s| s.as_str()).unwrap_or("?"));
            conf.push(score);
        }
        prev = best;
    }
    let mean = if conf.is_empty() {
        0.0
    } else {
        conf.iter().sum::<f32>() / conf.len() as f32
    };
    Ok((out, mean))
}
