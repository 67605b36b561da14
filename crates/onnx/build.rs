//! Generates the ONNX protobuf types from the vendored protos (onnx-ml and onnx-data, from the
//! onnx 1.22.0 wheel) in pure Rust: no `protoc` needed.
fn main() {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["onnx/onnx-ml.proto", "onnx/onnx-data.proto"], ["proto"])
        .expect("compile onnx protos");
    prost_build::Config::new()
        .bytes([".onnx.TensorProto.raw_data"])
        .compile_fds(fds)
        .expect("generate onnx types");
}
