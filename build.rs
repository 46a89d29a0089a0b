//! Compiles the CSI wire definitions, and kubelet's plugin-registration API,
//! in pure Rust: protox parses the .proto files, tonic-prost-build generates
//! client and server code. No system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi/csi.proto");
    println!("cargo:rerun-if-changed=proto/csi/kubelet/pluginregistration.proto");
    let fds = protox::compile(
        ["csi/csi.proto", "csi/kubelet/pluginregistration.proto"],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
