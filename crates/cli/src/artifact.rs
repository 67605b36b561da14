//! `npuc inspect` for `.npuc` artifacts.

use anyhow::Result;
use npuc_format::{Artifact, GraphDesc, TypeDesc};
use npuc_ir::infer::InferResult;
use npuc_ir::TypeInfo;
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

fn ty(t: &Option<TypeDesc>) -> String {
    fn dims(s: &Option<Vec<npuc_format::DimDesc>>) -> String {
        match s {
            None => "[*]".into(),
            Some(d) => format!(
                "[{}]",
                d.iter()
                    .map(|d| match d {
                        npuc_format::DimDesc::Fixed(n) => n.to_string(),
                        npuc_format::DimDesc::Sym(s) => s.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
    match t {
        Some(TypeDesc::Tensor { dtype, shape }) => {
            format!("{}{}", dtype.as_deref().unwrap_or("?"), dims(shape))
        }
        Some(other) => format!("{other:?}"),
        None => "?".into(),
    }
}

/// `TypeInfo` in the notation of [`ty`].
pub fn ir_ty(t: &TypeInfo) -> String {
    match t {
        TypeInfo::Tensor { dtype, shape } => {
            let dims = match shape {
                None => "[*]".to_string(),
                Some(d) => format!(
                    "[{}]",
                    d.iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            };
            let dt = dtype.map(|d| d.to_string()).unwrap_or_else(|| "?".into());
            format!("{dt}{dims}")
        }
        other => format!("{other:?}"),
    }
}

/// Every node output of graph `name` in node order with its statically inferred type
/// (`npuc_ir::infer`, with the `npuc` op definitions), and how many lack a static shape.
fn value_types(a: &Artifact, name: &str) -> (Vec<serde_json::Value>, usize) {
    let Ok(m) = a.model(Some(name)) else {
        return (vec![], 0);
    };
    let r = npuc_ir::infer::infer_model(&m, &HashMap::new());
    let mut values = vec![];
    let mut incomplete = 0;
    for n in &m.graph.nodes {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            let t = r.type_of(o);
            if !t.is_some_and(InferResult::is_complete) {
                incomplete += 1;
            }
            let t = t.map(ir_ty).unwrap_or_else(|| "?".into());
            values.push(json!({"name": o, "type": t}));
        }
    }
    (values, incomplete)
}

fn weight_refs(g: &GraphDesc) -> Vec<usize> {
    fn walk(b: &npuc_format::BodyDesc, out: &mut Vec<usize>) {
        out.extend(b.initializers.iter().map(|(_, i)| *i));
        for n in &b.nodes {
            for (_, a) in &n.attrs {
                match a {
                    npuc_format::AttrDesc::Tensor(i) | npuc_format::AttrDesc::SparseTensor(i) => {
                        out.push(*i)
                    }
                    npuc_format::AttrDesc::Tensors(v) | npuc_format::AttrDesc::SparseTensors(v) => {
                        out.extend(v)
                    }
                    npuc_format::AttrDesc::Graph(b) => walk(b, out),
                    npuc_format::AttrDesc::Graphs(bs) => bs.iter().for_each(|b| walk(b, out)),
                    _ => {}
                }
            }
        }
    }
    let mut v = vec![];
    walk(&g.body, &mut v);
    v
}

/// The JSON document `npuc inspect --json` prints for an artifact. Its schema is documented in
/// docs/FORMAT.md and held by a snapshot test.
pub fn inspect_json(a: &Artifact, verify: bool) -> serde_json::Value {
    // Value types come from the op definitions, which the op packs bring.
    crate::register_ops();
    let m = &a.meta;
    // A weight is shared when more than one graph refers to it.
    let mut users: BTreeMap<usize, HashSet<usize>> = BTreeMap::new();
    for (gi, g) in m.graphs.iter().enumerate() {
        for w in weight_refs(g) {
            users.entry(w).or_default().insert(gi);
        }
    }
    let wbytes = |i: &usize| m.weights.get(*i).map(|w| w.len).unwrap_or(0);
    let graphs: Vec<serde_json::Value> = m
        .graphs
        .iter()
        .enumerate()
        .map(|(gi, g)| {
            let refs: HashSet<usize> = weight_refs(g).into_iter().collect();
            let own: u64 = refs.iter().filter(|i| users[i].len() == 1).map(wbytes).sum();
            let shared: u64 = refs.iter().filter(|i| users[i].len() > 1).map(wbytes).sum();
            let mut hist: BTreeMap<String, usize> = BTreeMap::new();
            for n in &g.body.nodes {
                let k = if n.domain.is_empty() { n.op.clone() } else { format!("{}::{}", n.domain, n.op) };
                *hist.entry(k).or_default() += 1;
            }
            let _ = gi;
            let (values, incomplete) = value_types(a, &g.name);
            json!({
                "name": g.name,
                "inputs": g.body.inputs.iter().map(|i| json!({"name": i.name, "type": ty(&i.ty)})).collect::<Vec<_>>(),
                "outputs": g.body.outputs.iter().map(|i| json!({"name": i.name, "type": ty(&i.ty)})).collect::<Vec<_>>(),
                "kv_cache": g.kv_cache.iter().map(|(n, r)| json!({"name": n, "role": r})).collect::<Vec<_>>(),
                "nodes": g.body.nodes.len(),
                "nodes_before_optimization": g.info.nodes_before,
                "op_histogram": hist,
                "weight_bytes_own": own,
                "weight_bytes_shared": shared,
                "arena_bytes": g.info.arena_bytes,
                "peak_memory_bytes": g.info.arena_bytes + own + shared,
                "source": g.info.source,
                "values": values,
                "values_without_static_shape": incomplete,
            })
        })
        .collect();
    let unique: u64 = m.weights.iter().map(|w| w.len).sum();
    let referenced: u64 = m
        .graphs
        .iter()
        .map(|g| weight_refs(g).iter().map(wbytes).sum::<u64>())
        .sum();
    let mut doc = json!({
        "format_version": format!("{}.{}", m.format_major, m.format_minor),
        "producer": format!("{} {}", m.producer, m.producer_version),
        "target": {"name": m.target.name, "arch": m.target.arch, "features": m.target.features},
        "file_bytes": a.file_len,
        "sources": m.sources.iter().map(|s| json!({"name": s.name, "xxh3_128": s.xxh3_128, "bytes": s.bytes})).collect::<Vec<_>>(),
        "options": m.options,
        "graphs": graphs,
        "totals": {
            "graphs": m.graphs.len(),
            "weights": m.weights.len(),
            "weight_bytes_unique": unique,
            "weight_bytes_referenced": referenced,
        },
    });
    if verify {
        let bad = a.verify_weights();
        doc["verify"] = json!({"weights_checked": m.weights.len(), "corrupt_weights": bad});
    }
    doc
}

pub fn inspect(path: &Path, json_out: bool, verify: bool) -> Result<()> {
    // `--verify` reports corrupt weights itself (all of them, by index).
    let a = if verify {
        Artifact::open_unverified(path)?
    } else {
        Artifact::open(path)?
    };
    let doc = inspect_json(&a, verify);
    if json_out {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        // `--verify` fails on corrupt weights whatever the output format.
        let bad = &doc["verify"]["corrupt_weights"];
        if bad.as_array().is_some_and(|b| !b.is_empty()) {
            anyhow::bail!(
                "weights {bad} of '{}' fail their checksum; the file is corrupt: recompile it",
                path.display()
            );
        }
    } else {
        println!(
            "artifact  {} ({:.2} MB)",
            path.display(),
            a.file_len as f64 / 1e6
        );
        println!(
            "format    {}   producer {}",
            doc["format_version"].as_str().unwrap_or(""),
            doc["producer"].as_str().unwrap_or("")
        );
        println!("target    {}", doc["target"]["name"].as_str().unwrap_or(""));
        for g in doc["graphs"].as_array().into_iter().flatten() {
            println!(
                "graph '{}': {} nodes (from {})",
                g["name"].as_str().unwrap_or(""),
                g["nodes"],
                g["nodes_before_optimization"]
            );
            for i in g["inputs"].as_array().into_iter().flatten() {
                println!(
                    "  input   {:<24} {}",
                    i["name"].as_str().unwrap_or(""),
                    i["type"].as_str().unwrap_or("")
                );
            }
            for o in g["outputs"].as_array().into_iter().flatten() {
                println!(
                    "  output  {:<24} {}",
                    o["name"].as_str().unwrap_or(""),
                    o["type"].as_str().unwrap_or("")
                );
            }
            for k in g["kv_cache"].as_array().into_iter().flatten() {
                println!(
                    "  kv      {:<24} {}",
                    k["name"].as_str().unwrap_or(""),
                    k["role"].as_str().unwrap_or("")
                );
            }
            println!(
                "  weights {:.2} MB own, {:.2} MB shared; arena {:.2} MB",
                g["weight_bytes_own"].as_f64().unwrap_or(0.0) / 1e6,
                g["weight_bytes_shared"].as_f64().unwrap_or(0.0) / 1e6,
                g["arena_bytes"].as_f64().unwrap_or(0.0) / 1e6
            );
            let values = g["values"].as_array().map_or(0, |v| v.len());
            match g["values_without_static_shape"].as_u64().unwrap_or(0) {
                0 => println!("  values  {values}, every shape static (--json lists them)"),
                u => println!(
                    "  values  {values}, {u} without a static shape (--json lists every type)"
                ),
            }
            if let Some(h) = g["op_histogram"].as_object() {
                let line: Vec<String> = h.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                println!("  ops     {}", line.join(" "));
            }
        }
        let t = &doc["totals"];
        println!(
            "total     {} graphs, {} weights, {:.2} MB stored, {:.2} MB referenced",
            t["graphs"],
            t["weights"],
            t["weight_bytes_unique"].as_f64().unwrap_or(0.0) / 1e6,
            t["weight_bytes_referenced"].as_f64().unwrap_or(0.0) / 1e6
        );
        if let Some(v) = doc.get("verify") {
            let bad = v["corrupt_weights"]
                .as_array()
                .map(|a| a.len())
                .unwrap_or(0);
            if bad == 0 {
                println!("verify    all {} weight checksums OK", v["weights_checked"]);
            } else {
                anyhow::bail!("{bad} weights of '{}' fail their checksum ({}); the file is corrupt: recompile it", path.display(), v["corrupt_weights"]);
            }
        }
    }
    Ok(())
}
