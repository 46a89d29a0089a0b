//! The driver registers itself with kubelet: it serves kubelet's
//! plugin-registration API on a socket in the plugins_registry directory,
//! answered here by a client speaking that API as kubelet's plugin watcher
//! does. A refusal from kubelet fails /healthz; a removed socket is bound
//! again; SIGTERM removes it so kubelet deregisters the plugin.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::harness::*;
use modelcache_csi::csi::pluginregistration::registration_client::RegistrationClient;
use modelcache_csi::csi::pluginregistration::{InfoRequest, RegistrationStatus};

async fn wait_for_socket(p: &Path, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !p.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn kubelet(socket: &Path) -> RegistrationClient<tonic::transport::Channel> {
    let ch = modelcache_csi::client::channel(socket.to_path_buf())
        .await
        .expect("connect to the registration socket");
    RegistrationClient::new(ch)
}

#[tokio::test]
async fn registers_with_kubelet_and_reports_refusal_in_healthz() {
    let reg = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let regdir = reg.path().to_str().unwrap();
    let mut d = Driver::start_with(&[
        "--registration-dir",
        regdir,
        "--kubelet-registration-path",
        "/var/lib/kubelet/plugins/modelcache.csi.io/csi.sock",
        "--metrics-address",
        &addr,
    ])
    .await;
    let sock = reg.path().join("modelcache.csi.io-reg.sock");
    wait_for_socket(&sock, 10).await;

    let info = kubelet(&sock)
        .await
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, "modelcache.csi.io");
    assert_eq!(
        info.endpoint,
        "/var/lib/kubelet/plugins/modelcache.csi.io/csi.sock"
    );
    assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);

    // Kubelet then dials the CSI endpoint (here the test socket) for NodeGetInfo.
    let node = d
        .client
        .node
        .clone()
        .node_get_info(modelcache_csi::csi::NodeGetInfoRequest {})
        .await
        .expect("NodeGetInfo")
        .into_inner();
    assert_eq!(node.node_id, NODE);

    kubelet(&sock)
        .await
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .expect("notify registered");
    let h = http_get(port, "/healthz");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");

    kubelet(&sock)
        .await
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "plugin version 9.9 not supported".into(),
        })
        .await
        .expect("notify refused");
    let h = http_get(port, "/healthz");
    assert!(h.starts_with("HTTP/1.1 503"), "{h}");
    assert!(
        h.contains("kubelet refused the plugin registration: plugin version 9.9 not supported"),
        "{h}"
    );

    // A wiped plugins_registry: the socket comes back, and a fresh
    // registration round starts (health no longer reports the old refusal).
    std::fs::remove_file(&sock).unwrap();
    wait_for_socket(&sock, 15).await;
    let info = kubelet(&sock)
        .await
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo after rebind");
    assert_eq!(info.into_inner().name, "modelcache.csi.io");
    let h = http_get(port, "/healthz");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");

    let term = std::process::Command::new("kill")
        .args(["-TERM", &d.pid().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let st = d.wait_exit(20).expect("driver exits on SIGTERM");
    assert!(st.success(), "exit status {st}");
    assert!(!sock.exists(), "registration socket left behind");
}

#[tokio::test]
async fn healthz_fails_when_a_backend_cannot_work() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = Driver::start_with(&["--metrics-address", &addr]).await;
    let h = http_get(port, "/healthz");
    assert!(h.starts_with("HTTP/1.1 200"), "{h}");
    // The local backend's root becomes a file: nothing can be created there.
    let root = d.state_dir.clone();
    std::fs::remove_dir_all(&root).unwrap();
    std::fs::write(&root, b"not a directory").unwrap();
    let h = http_get(port, "/healthz");
    assert!(h.starts_with("HTTP/1.1 503"), "{h}");
    assert!(h.contains("is not writable"), "{h}");
    std::fs::remove_file(&root).unwrap();
}

#[tokio::test]
async fn registration_flags_are_checked() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
        .args([
            "--endpoint",
            "unix:///tmp/unused-mc.sock",
            "--mode",
            "controller",
            "--registration-dir",
            "/tmp",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--mode node or all"), "{err}");

    // Its own state dir: the default is the host's /var/lib/modelcache-csi,
    // which the driver creates before it checks the registration dir.
    let state = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_modelcache-csi"))
        .args([
            "--endpoint",
            "unix:///tmp/unused-mc2.sock",
            "--node-id",
            "n1",
            "--registration-dir",
            "/nonexistent/plugins_registry",
        ])
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--registration-dir /nonexistent/plugins_registry does not exist"),
        "{err}"
    );
}
