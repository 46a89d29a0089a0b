//! A real etcd + kube-apiserver for integration tests, on loopback over a
//! fresh temp dir, ready (`/readyz`) before `start` returns, stopped on Drop.
//!
//!
//! The binaries come from `$MODELCACHE_K8S_BIN` (a dir with `etcd`,
//! `kube-apiserver`, `kubectl`), else from `e2e/k8s/build.sh`, which builds
//! the missing ones from the Go module proxy into a versioned cache (a cold
//! build takes tens of minutes on 2 cores; its output goes to stderr; a warm
//! run takes milliseconds). `e2e/k8s/apiserver.sh` does the starting and
//! stopping; a watchdog it runs stops the servers if this process dies
//! before Drop (e.g. an `ApiServer` kept in a `static`).
//!
//! Identities (static tokens): `admin` (system:masters) and `rescheduler`,
//! `csi-controller`, `csi-node` with no groups at all, so a test grants them
//! exactly what it means to with RBAC objects. The kubeconfig has one context
//! per identity (`--context rescheduler`), current-context `admin`.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, anyhow, bail, ensure};

/// One running etcd + kube-apiserver and their state dir.
pub struct ApiServer {
    env: HashMap<String, String>,
    bin: PathBuf,
    dir: tempfile::TempDir,
    stopped: bool,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn script(name: &str) -> PathBuf {
    repo_root().join("e2e/k8s").join(name)
}

/// The bin dir with etcd, kube-apiserver and kubectl: `$MODELCACHE_K8S_BIN`,
/// or the dir `e2e/k8s/build.sh` prints (it builds only what is missing).
/// Resolved once per test binary.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        let needed = ["etcd", "kube-apiserver", "kubectl"];
        if let Some(p) = std::env::var_os("MODELCACHE_K8S_BIN") {
            let p = PathBuf::from(p);
            if let Some(b) = needed.iter().find(|b| !p.join(b).is_file()) {
                return Err(format!("MODELCACHE_K8S_BIN={}: no {b}", p.display()));
            }
            return Ok(p);
        }
        let build = script("build.sh");
        let out = Command::new("bash")
            .arg(&build)
            .args(needed)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("run {}: {e}", build.display()))?;
        if !out.status.success() {
            return Err(format!("{} failed ({})", build.display(), out.status));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .ok_or_else(|| format!("{} printed no bin dir", build.display()))?;
        Ok(PathBuf::from(dir.trim()))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

impl ApiServer {
    /// Builds the binaries if missing, starts etcd + kube-apiserver and waits
    /// until `/readyz` answers ok.
    pub fn start() -> anyhow::Result<ApiServer> {
        ApiServer::start_at("127.0.0.1")
    }

    /// As `start`, serving on `address` (which must be up) instead of
    /// loopback: for clients in other network namespaces.
    pub fn start_at(address: &str) -> anyhow::Result<ApiServer> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("modelcache-apiserver-")
            .tempdir()
            .context("create apiserver temp dir")?;
        let sh = script("apiserver.sh");
        let out = Command::new("bash")
            .arg(&sh)
            .arg("start")
            .arg(dir.path())
            .env("MODELCACHE_K8S_BIN", &bin)
            .env("MODELCACHE_APISERVER_ADDRESS", address)
            .env(
                "MODELCACHE_APISERVER_OWNER_PID",
                std::process::id().to_string(),
            )
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("run {} start", sh.display()))?;
        if !out.status.success() {
            // Make sure nothing half-started is left behind.
            let _ = Command::new("bash")
                .arg(&sh)
                .arg("stop")
                .arg(dir.path())
                .output();
            bail!(
                "{} start failed ({}):\n{}",
                sh.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let env_path = dir.path().join("env");
        let text = std::fs::read_to_string(&env_path)
            .with_context(|| format!("read {}", env_path.display()))?;
        let env = parse_env(&text);
        for key in [
            "KUBECONFIG",
            "APISERVER_URL",
            "CA_FILE",
            "ADMIN_TOKEN",
            "RESCHEDULER_TOKEN",
        ] {
            ensure!(env.contains_key(key), "{} has no {key}", env_path.display());
        }
        Ok(ApiServer {
            env,
            bin,
            dir,
            stopped: false,
        })
    }

    fn var(&self, key: &str) -> &str {
        self.env.get(key).map(String::as_str).unwrap_or_default()
    }

    /// Admin kubeconfig (with one context per identity).
    pub fn kubeconfig_path(&self) -> PathBuf {
        PathBuf::from(self.var("KUBECONFIG"))
    }

    /// `https://127.0.0.1:<port>`
    pub fn server(&self) -> &str {
        self.var("APISERVER_URL")
    }

    /// Path of the CA that signed the serving cert.
    pub fn ca_path(&self) -> PathBuf {
        PathBuf::from(self.var("CA_FILE"))
    }

    fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg("--kubeconfig")
            .arg(self.kubeconfig_path())
            .arg("--cache-dir")
            .arg(self.dir.path().join("kube-cache"))
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs the built kubectl with this server's kubeconfig (as admin unless
    /// `args` has `--context <identity>`). Blocking.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_command(args)
            .output()
            .unwrap_or_else(|e| panic!("run kubectl {args:?}: {e}"))
    }

    /// `kubectl` with `input` on stdin (e.g. `&["apply", "-f", "-"]`). Blocking.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> Output {
        let mut child = self
            .kubectl_command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run kubectl {args:?}: {e}"));
        let mut stdin = child.stdin.take().expect("kubectl stdin");
        let input = input.to_owned();
        let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("wait for kubectl {args:?}: {e}"));
        let _ = writer.join();
        out
    }

    /// Stops etcd and kube-apiserver (also done on Drop); idempotent.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let sh = script("apiserver.sh");
        let out = Command::new("bash")
            .arg(&sh)
            .arg("stop")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("run {} stop", sh.display()))?;
        ensure!(
            out.status.success(),
            "{} stop failed: {}",
            sh.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("apiserver: {e:#}");
        }
    }
}
