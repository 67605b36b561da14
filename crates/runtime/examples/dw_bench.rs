//! Times the NHWC depthwise row kernel (the dispatched level, and its scalar twin for
//! reference) on PP-OCR depthwise shapes, one thread, whole images, buffers cache-line aligned:
//! `cargo run --release -p npuc-runtime --example dw_bench`.
use npuc_runtime::kernels::conv_nhwc::{dw_row, dw_row_scalar, DwGeom};
use std::time::Instant;

/// `len` values of `v` starting on a 64-byte boundary (as the CLI's allocator gives them).
fn aligned(v: &mut [f32], len: usize) -> &mut [f32] {
    let skip = (64 - v.as_ptr() as usize % 64) / 4 % 16;
    &mut v[skip..skip + len]
}

fn main() {
    // (name, h = w, channels, kernel, stride)
    let shapes = [
        ("v6det_c5", 80, 32, 3, 1),
        ("v6det_c78", 80, 64, 5, 1),
        ("v6det_c74", 40, 64, 5, 1),
        ("v6det_c16", 40, 48, 3, 1),
        ("v6det_c13", 80, 32, 3, 2),
    ];
    for (name, hw, c, k, s) in shapes {
        let pad = k / 2;
        let ow = (hw + 2 * pad - k) / s + 1;
        let g = DwGeom {
            h: hw,
            wd: hw,
            c,
            kh: k,
            kw: k,
            stride: [s, s],
            dilation: [1, 1],
            pad: [pad, pad],
            ow,
        };
        let mut xs: Vec<f32> = (0..hw * hw * c + 16)
            .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
            .collect();
        let x = aligned(&mut xs, hw * hw * c);
        let w: Vec<f32> = (0..k * k * c)
            .map(|i| ((i % 13) as f32 - 6.0) / 10.0)
            .collect();
        let b: Vec<f32> = (0..c).map(|i| i as f32 / 100.0).collect();
        let mut os = vec![0f32; ow * ow * c + 16];
        let out = aligned(&mut os, ow * ow * c);
        let (mut best, mut best_twin) = (f64::MAX, f64::MAX);
        // Alternating rounds: this host's speed drifts.
        for _ in 0..20 {
            for twin in [false, true] {
                for _ in 0..if twin { 1 } else { 10 } {
                    let t = Instant::now();
                    for (oy, row) in out.chunks_mut(ow * c).enumerate() {
                        let ok = if twin {
                            dw_row_scalar(row, x, &w, Some(&b), &g, oy, 0..ow)
                        } else {
                            dw_row(row, x, &w, Some(&b), &g, oy)
                        };
                        assert!(ok);
                    }
                    let e = t.elapsed().as_secs_f64();
                    if twin {
                        best_twin = best_twin.min(e);
                    } else {
                        best = best.min(e);
                    }
                }
            }
        }
        let macs = (ow * ow * c * k * k) as f64;
        println!(
            "{name:10} {hw}x{hw}x{c} k{k} s{s}: {:.3} ms ({:.1} GMAC/s), scalar twin {:.3} ms",
            best * 1e3,
            macs / best / 1e9,
            best_twin * 1e3
        );
    }
}
