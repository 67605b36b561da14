//! The self-contained HTML report of `npuc verify --report`: an inline SVG plot of SQNR per layer
//! in graph order with the threshold line and the first bad layer highlighted, and the table.
//! No scripts, fonts or other network resources.

use super::{fmt_db, VerifyReport};
use std::fmt::Write;

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Plot geometry (SVG user units).
const W: f64 = 1000.0;
const H: f64 = 360.0;
const L: f64 = 56.0;
const R: f64 = 16.0;
const T: f64 = 16.0;
const B: f64 = 40.0;

/// Renders the report. Each layer is one `<circle class="pt">` (exact layers are drawn at the
/// top of the axis as hollow circles); the first bad layer has class `pt bad`.
pub fn render(r: &VerifyReport, title: &str) -> String {
    let finite: Vec<f64> = r
        .layers
        .iter()
        .map(|l| l.sqnr_db)
        .filter(|x| x.is_finite())
        .collect();
    let mut ymax = finite.iter().cloned().fold(r.threshold_db, f64::max);
    let mut ymin = finite
        .iter()
        .cloned()
        .fold(r.threshold_db.min(0.0), f64::min);
    ymax = (ymax / 10.0).ceil() * 10.0 + 10.0; // headroom for the exact (infinite) layers
    ymin = (ymin / 10.0).floor() * 10.0;
    let n = r.layers.len().max(1);
    let x_of = |i: usize| L + (W - L - R) * (i as f64 + 0.5) / n as f64;
    let y_of = |v: f64| {
        let v = if v.is_finite() { v } else { ymax };
        T + (H - T - B) * (1.0 - (v - ymin) / (ymax - ymin))
    };
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="SQNR per layer">"#
    );
    let _ = write!(
        svg,
        r##"<rect x="{L}" y="{T}" width="{}" height="{}" fill="#fafafa" stroke="#999"/>"##,
        W - L - R,
        H - T - B
    );
    // Horizontal grid every 10 dB.
    let mut g = ymin;
    while g <= ymax + 1e-9 {
        let y = y_of(g);
        let _ = write!(
            svg,
            r##"<line x1="{L}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e3e3e3"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{g}</text>"##,
            W - R,
            L - 4.0,
            y + 4.0
        );
        g += 10.0;
    }
    let _ = write!(
        svg,
        r#"<text x="14" y="{:.1}" font-size="12" transform="rotate(-90 14 {:.1})" text-anchor="middle">SQNR (dB)</text><text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">layer (graph order)</text>"#,
        (T + H - B) / 2.0,
        (T + H - B) / 2.0,
        (L + W - R) / 2.0,
        H - 8.0
    );
    // The line through the finite points.
    let mut path = String::new();
    for (i, l) in r.layers.iter().enumerate() {
        let _ = write!(
            path,
            "{}{:.1},{:.1} ",
            if path.is_empty() { "M" } else { "L" },
            x_of(i),
            y_of(l.sqnr_db)
        );
    }
    if !path.is_empty() {
        let _ = write!(
            svg,
            r##"<path d="{}" fill="none" stroke="#4a78b5" stroke-width="1"/>"##,
            path.trim_end()
        );
    }
    let ty = y_of(r.threshold_db);
    let _ = write!(
        svg,
        r##"<line class="threshold" x1="{L}" x2="{}" y1="{ty:.1}" y2="{ty:.1}" stroke="#d33" stroke-dasharray="6 4"/><text x="{}" y="{:.1}" font-size="11" fill="#d33" text-anchor="end">threshold {} dB</text>"##,
        W - R,
        W - R - 4.0,
        ty - 4.0,
        r.threshold_db
    );
    for (i, l) in r.layers.iter().enumerate() {
        let bad = Some(i) == r.first_bad;
        let (class, rad, fill) = if bad {
            ("pt bad", 6.0, "#d33")
        } else if l.sqnr_db.is_finite() {
            ("pt", 2.5, "#4a78b5")
        } else {
            ("pt", 2.5, "none")
        };
        let _ = write!(
            svg,
            r##"<circle class="{class}" cx="{:.1}" cy="{:.1}" r="{rad}" fill="{fill}" stroke="#4a78b5"><title>#{i} {} ({}): {} dB</title></circle>"##,
            x_of(i),
            y_of(l.sqnr_db),
            esc(&l.name),
            esc(&l.op),
            fmt_db(l.sqnr_db)
        );
    }
    svg.push_str("</svg>");

    let mut rows = String::new();
    for (i, l) in r.layers.iter().enumerate() {
        let cls = if Some(i) == r.first_bad {
            " class=\"bad\""
        } else if l.sqnr_db < r.threshold_db {
            " class=\"low\""
        } else {
            ""
        };
        let _ = writeln!(
            rows,
            "<tr{cls}><td>{i}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.6}</td><td>{:.4e}</td></tr>",
            esc(&l.name),
            esc(&l.op),
            fmt_db(l.sqnr_db),
            l.cosine,
            l.max_abs_err
        );
    }
    let first = match r.first_bad {
        Some(i) => format!(
            "first bad layer: <b>{}</b> (op {}, node {}): SQNR {} dB &lt; {} dB",
            esc(&r.layers[i].name),
            esc(&r.layers[i].op),
            esc(&r.layers[i].node),
            fmt_db(r.layers[i].sqnr_db),
            r.threshold_db
        ),
        None => format!("no layer below {} dB", r.threshold_db),
    };
    let mut outs = String::new();
    for o in &r.outputs {
        let _ = writeln!(
            outs,
            "<li>output {}: SQNR {} dB, cosine {:.6}, max abs err {:.4e}</li>",
            esc(&o.name),
            fmt_db(o.sqnr_db),
            o.cosine,
            o.max_abs_err
        );
    }
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>npuc verify: {title}</title>
<style>
body{{font-family:sans-serif;margin:1.5em;color:#222}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} td:nth-child(2),td:nth-child(3){{text-align:left}}
tr.bad{{background:#f7c6c6;font-weight:bold}} tr.low{{background:#fdeaea}}
</style></head><body>
<h1>npuc verify: {title}</h1>
<p>{n} layers compared over {samples} sample(s); SQNR accumulated over all samples. Exact layers (infinite SQNR) are drawn as hollow circles at the top.</p>
<p>{first}</p>
<ul>{outs}</ul>
{svg}
<table><thead><tr><th>#</th><th>layer</th><th>op</th><th>SQNR dB</th><th>cosine</th><th>max abs err</th></tr></thead>
<tbody>
{rows}</tbody></table>
</body></html>
"#,
        title = esc(title),
        n = r.layers.len(),
        samples = r.samples,
    )
}
