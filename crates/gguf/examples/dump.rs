fn main() {
    let g = npuc_gguf::GgufFile::open(std::env::args().nth(1).unwrap()).unwrap();
    for (k, v) in &g.metadata {
        println!("{k} = {v}");
    }
    for t in g.tensors.iter().take(30) {
        println!("{} {} {:?}", t.name, t.ggml_type, t.dims);
    }
}
