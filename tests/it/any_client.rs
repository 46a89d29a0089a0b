//! Any gRPC client can talk to the driver's sockets, whatever `:authority`
//! it makes up for a Unix socket: grpc-go with a bare path (kubelet) sends
//! the path, gRPC C-core (Python grpcio, C++) sends it percent-encoded.
//! h2 alone resets such streams with PROTOCOL_ERROR.
//!
//! Requests are written here frame by frame, as those clients' arrive, and
//! the CSI socket is also called from real Python grpcio (installed by
//! tests/scripts/deps/grpcio.sh, pinned and cached).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::harness::*;
use modelcache_csi::csi::{
    GetPluginInfoRequest, GetPluginInfoResponse, ProbeRequest, ProbeResponse,
};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn wait_for_socket(p: &Path, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !p.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HPACK "literal header field without indexing, new name", no Huffman.
fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    assert!(name.len() < 127 && value.len() < 127);
    out.push(0x00);
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.push(value.len() as u8);
    out.extend_from_slice(value.as_bytes());
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// One unary call with an empty request message, written frame by frame
/// with the given `:authority`; the response message's bytes, or how the
/// server refused the stream.
async fn raw_call(sock: &Path, method: &str, authority: &str) -> Result<Vec<u8>, String> {
    let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let mut block = Vec::new();
    literal(&mut block, ":method", "POST");
    literal(&mut block, ":scheme", "http");
    literal(&mut block, ":path", method);
    literal(&mut block, ":authority", authority);
    literal(&mut block, "content-type", "application/grpc");
    literal(&mut block, "te", "trailers");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // DATA: an empty message, END_STREAM
    s.write_all(&out).await.unwrap();

    let mut body = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut head = [0u8; 9];
        tokio::time::timeout_at(deadline, s.read_exact(&mut head))
            .await
            .expect("an answer in time")
            .map_err(|e| format!("connection closed before the answer: {e}"))?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.unwrap();
        match kind {
            0x4 if flags & 0x1 == 0 => s.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap(),
            0x3 => return Err(format!("RST_STREAM {payload:?} on stream {stream}")),
            0x7 => return Err(format!("GOAWAY {payload:?}")),
            0x0 if stream == 1 => body.extend_from_slice(&payload),
            0x1 if stream == 1 && flags & 0x1 != 0 => break, // trailers
            _ => {}
        }
    }
    if body.len() < 5 {
        return Err(format!("no message in {body:?}"));
    }
    Ok(body[5..].to_vec())
}

/// Kubelet (grpc-go dialing a bare path) sends the registration socket's
/// path as `:authority`.
#[tokio::test]
async fn the_registration_socket_answers_a_socket_path_authority() {
    let reg = tempfile::tempdir().unwrap();
    let _d = Driver::start_with(&["--registration-dir", reg.path().to_str().unwrap()]).await;
    let sock = reg.path().join("modelcache.csi.io-reg.sock");
    wait_for_socket(&sock, 10).await;
    let body = raw_call(
        &sock,
        "/pluginregistration.Registration/GetInfo",
        sock.to_str().unwrap(),
    )
    .await
    .unwrap();
    let info = modelcache_csi::csi::pluginregistration::PluginInfo::decode(&body[..]).unwrap();
    assert_eq!(info.name, "modelcache.csi.io");
    assert_eq!(info.r#type, "CSIPlugin");
}

/// The authorities real clients send for the CSI socket, and a valid one.
#[tokio::test]
async fn the_csi_socket_answers_any_authority() {
    let d = Driver::start().await;
    let path = d.socket.to_str().unwrap();
    let c_core = path.trim_start_matches('/').replace('/', "%2F");
    for (client, authority) in [
        ("grpc-go, bare path", path.to_string()),
        ("gRPC C-core (grpcio, C++)", c_core),
        ("grpc-go, unix:// target", "localhost".to_string()),
    ] {
        let body = raw_call(&d.socket, "/csi.v1.Identity/GetPluginInfo", &authority)
            .await
            .unwrap_or_else(|e| panic!("{client} ({authority}): {e}"));
        let info = GetPluginInfoResponse::decode(&body[..]).unwrap();
        assert_eq!(info.name, "modelcache.csi.io", "{client}");
    }
}

/// The venv's python with grpcio, from the pinned, cached install script.
fn grpcio_python() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/grpcio.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run tests/scripts/deps/grpcio.sh");
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Calls each method with an empty request through grpcio's generic
/// unary call (bytes in, bytes out: no generated stubs needed) and prints
/// `method hex` per answer, or `method FAILED code details`.
const GRPCIO_CLIENT: &str = r#"
import sys, grpc
target, methods = sys.argv[1], sys.argv[2:]
failed = False
with grpc.insecure_channel(target) as ch:
    for m in methods:
        try:
            print(m, ch.unary_unary(m)(b"", timeout=10).hex())
        except grpc.RpcError as e:
            failed = True
            print(m, "FAILED", e.code(), e.details())
sys.exit(1 if failed else 0)
"#;

#[tokio::test]
async fn python_grpcio_calls_the_csi_socket() {
    let python = grpcio_python();
    let d = Driver::start().await;
    let mut identity = d.client.identity.clone();
    let probe = identity
        .probe(ProbeRequest {})
        .await
        .expect("Probe from tonic")
        .into_inner();
    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .expect("GetPluginInfo from tonic")
        .into_inner();
    for target in [
        format!("unix:{}", d.socket.display()),
        format!("unix://{}", d.socket.display()),
    ] {
        let out = tokio::process::Command::new(&python)
            .args(["-c", GRPCIO_CLIENT, &target])
            .args(["/csi.v1.Identity/GetPluginInfo", "/csi.v1.Identity/Probe"])
            .output()
            .await
            .expect("run python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "grpcio via {target}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let answers: Vec<Vec<u8>> = stdout
            .lines()
            .map(|l| {
                let hex = l.split_once(' ').map(|(_, h)| h).unwrap_or_default();
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect()
            })
            .collect();
        assert_eq!(answers.len(), 2, "{stdout}");
        let got_info = GetPluginInfoResponse::decode(&answers[0][..]).unwrap();
        assert_eq!(got_info.name, "modelcache.csi.io", "{target}");
        assert_eq!(got_info, info, "{target}");
        assert_eq!(
            ProbeResponse::decode(&answers[1][..]).unwrap(),
            probe,
            "{target}"
        );
    }
}
