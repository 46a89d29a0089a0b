//! Compiles the CSI wire definitions in pure Rust: protox parses the .proto,
//! tonic-prost-build generates client and server code. No system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi/csi.proto");
    let fds = protox::compile(["csi/csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
