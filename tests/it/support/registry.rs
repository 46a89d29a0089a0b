//! A real OCI registry for tests: Debian's docker-registry (CNCF
//! distribution 2.8, installed by `tests/scripts/deps/registry.sh`) serving plain
//! HTTP on 127.0.0.1 at a free port, with its config and storage in a temp
//! dir, killed on Drop. It counts blob GETs from the registry's access log
//! and pushes, with oci-client, ORAS-style artifacts, modelcar images,
//! image indexes and malicious layers.
//!

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use modelcache_csi::puller::SourceOptions;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{ImageIndexEntry, OciImageIndex, OciImageManifest, Platform};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};

use super::harness::free_port;

pub const TITLE: &str = "org.opencontainers.image.title";
/// What ORAS gives a plain file when no type is named: a tar type, although
/// the blob is not a tar. The title annotation is what says "file".
pub const ORAS_FILE: &str = "application/vnd.oci.image.layer.v1.tar";
pub const LAYER_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const IMAGE_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const EMPTY_CONFIG: &str = "application/vnd.oci.empty.v1+json";
pub const ARTIFACT_TYPE: &str = "application/vnd.modelcache.test.model.v1";

/// The one account of a registry started with `start_with_auth`.
pub const USERNAME: &str = "modelcache";
pub const PASSWORD: &str = "modelcache-test-password";
/// bcrypt (cost 4, the registry's minimum) of PASSWORD, precomputed so the
/// harness needs no htpasswd tool.
const PASSWORD_BCRYPT: &str = "$2b$04$h3T2KKQFdsp0q1oe2QbrVOMjE7j0WX36mKCBiBylnNVBrQOEPVCmq";

/// One running registry.
pub struct Registry {
    /// `127.0.0.1:<port>`
    pub addr: String,
    child: Option<Child>,
    /// Every line the registry printed, stdout (access log) and stderr.
    log: Arc<Mutex<Vec<String>>>,
    client: Client,
    /// What the harness pushes with: Basic USERNAME/PASSWORD or anonymous.
    auth: RegistryAuth,
    _dir: tempfile::TempDir,
}

/// What a push produced.
#[derive(Clone, Debug)]
pub struct Pushed {
    /// The manifest digest, `sha256:...`.
    pub digest: String,
    /// The manifest's size in bytes (for an index entry).
    pub size: i64,
    pub layers: Vec<PushedLayer>,
}

#[derive(Clone, Debug)]
pub struct PushedLayer {
    pub digest: String,
    pub size: u64,
}

/// A layer built in memory: the blob as pushed and the digest of its
/// uncompressed tar (the image config's diff_id).
pub struct TarLayer {
    pub blob: Vec<u8>,
    pub diff_id: String,
}

fn registry_binary() -> PathBuf {
    if let Ok(p) = std::env::var("MODELCACHE_REGISTRY") {
        return PathBuf::from(p);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/registry.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed; install docker-registry or set MODELCACHE_REGISTRY",
        script.display()
    );
    let path = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    PathBuf::from(path)
}

fn collect_lines(stream: impl Read + Send + 'static, log: Arc<Mutex<Vec<String>>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            log.lock().unwrap().push(line);
        }
    });
}

impl Registry {
    /// Starts an open registry and waits until `/v2/` answers.
    pub async fn start() -> Registry {
        Registry::start_inner(false).await
    }

    /// Starts a registry that demands HTTP Basic USERNAME/PASSWORD (htpasswd)
    /// for every request.
    pub async fn start_with_auth() -> Registry {
        Registry::start_inner(true).await
    }

    async fn start_inner(with_auth: bool) -> Registry {
        let bin = registry_binary();
        let mut last_log = String::new();
        // The port is free when picked; another process may take it before
        // the registry binds, so a bind failure gets a new port.
        for _ in 0..3 {
            let dir = tempfile::Builder::new()
                .prefix("mc-registry-")
                .tempdir()
                .expect("create temp dir");
            let addr = format!("127.0.0.1:{}", free_port());
            let config = dir.path().join("config.yml");
            let mut yaml = format!(
                "version: 0.1\n\
                 log:\n  level: info\n  formatter: text\n  accesslog:\n    disabled: false\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: {addr}\n  secret: modelcache-test\n",
                dir.path().join("storage").display()
            );
            if with_auth {
                let htpasswd = dir.path().join("htpasswd");
                fs::write(&htpasswd, format!("{USERNAME}:{PASSWORD_BCRYPT}\n"))
                    .expect("write htpasswd");
                yaml.push_str(&format!(
                    "auth:\n  htpasswd:\n    realm: modelcache-test\n    path: {}\n",
                    htpasswd.display()
                ));
            }
            fs::write(&config, yaml).expect("write registry config");
            let mut child = Command::new(&bin)
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            let log = Arc::new(Mutex::new(Vec::new()));
            collect_lines(child.stdout.take().unwrap(), log.clone());
            collect_lines(child.stderr.take().unwrap(), log.clone());
            let client = Client::try_from(ClientConfig {
                protocol: ClientProtocol::Http,
                use_monolithic_push: true,
                ..ClientConfig::default()
            })
            .expect("build OCI client");
            let auth = if with_auth {
                RegistryAuth::Basic(USERNAME.into(), PASSWORD.into())
            } else {
                RegistryAuth::Anonymous
            };
            let mut reg = Registry {
                addr,
                child: Some(child),
                log,
                client,
                auth,
                _dir: dir,
            };
            if reg.wait_ready().await {
                return reg;
            }
            last_log = reg.log_text();
            reg.stop();
            if !last_log.contains("address already in use") {
                break;
            }
        }
        panic!("the registry did not start; its log:\n{last_log}");
    }

    async fn wait_ready(&mut self) -> bool {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("build HTTP client");
        let url = format!("http://{}/v2/", self.addr);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && child.try_wait().ok().flatten().is_some()
            {
                return false;
            }
            // An authenticating registry answers 401 once it is serving.
            if let Ok(r) = http.get(&url).send().await
                && (r.status().is_success() || r.status() == reqwest::StatusCode::UNAUTHORIZED)
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Kills the registry; later requests fail to connect.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// `oci://<addr>/<rest>`, e.g. `uri("model:v1")`.
    pub fn uri(&self, rest: &str) -> String {
        format!("oci://{}/{rest}", self.addr)
    }

    /// Source options for this registry: plain HTTP, and the account's
    /// secrets when it demands them.
    pub fn options(&self) -> SourceOptions {
        let mut opts = SourceOptions::default();
        opts.params.insert("ociPlainHTTP".into(), "true".into());
        if let RegistryAuth::Basic(u, p) = &self.auth {
            opts.secrets.insert("ociUsername".into(), u.clone());
            opts.secrets.insert("ociPassword".into(), p.clone());
        }
        opts
    }

    /// How many GET requests for blob `digest` (`sha256:...`) the registry
    /// has logged so far, whatever their status.
    pub fn blob_get_count(&self, digest: &str) -> usize {
        let needle = format!("/blobs/{digest} HTTP/");
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("\"GET /v2/") && l.contains(&needle))
            .count()
    }

    /// Waits (up to 5 s) until at least `n` blob GETs are logged: the access
    /// log line is written just after the response, so a client can finish
    /// reading before it appears. Returns the count.
    pub async fn wait_blob_gets(&self, digest: &str, n: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let c = self.blob_get_count(digest);
            if c >= n || Instant::now() > deadline {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Every blob GET the registry has answered so far, whatever its digest
    /// or status. An access log line is written only after its response,
    /// so a marker request is sent first and its line awaited (up to 5 s):
    /// requests answered before the call are then counted.
    pub async fn settled_blob_gets(&self) -> usize {
        let marker = format!(
            "/v2/modelcache-settle-{}/tags/list",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        );
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("build HTTP client");
        // Unknown repository: a 404 (or 401), logged all the same.
        let _ = http
            .get(format!("http://{}{marker}", self.addr))
            .send()
            .await;
        let needle = format!("\"GET {marker} HTTP/");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.log.lock().unwrap().iter().any(|l| l.contains(&needle)) {
            assert!(
                Instant::now() < deadline,
                "the registry never logged the marker request"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("\"GET /v2/") && l.contains("/blobs/sha256:"))
            .count()
    }

    fn reference(&self, repo_tag: &str) -> Reference {
        let (repo, tag) = repo_tag
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("{repo_tag:?} is not repo:tag"));
        Reference::with_tag(self.addr.clone(), repo.to_string(), tag.to_string())
    }

    /// Pushes `layers` with `config` under `repo:tag`.
    pub async fn push(
        &self,
        repo_tag: &str,
        layers: Vec<ImageLayer>,
        config: Config,
        artifact_type: Option<&str>,
    ) -> Pushed {
        let reference = self.reference(repo_tag);
        let mut manifest = OciImageManifest::build(&layers, &config, None);
        manifest.artifact_type = artifact_type.map(str::to_string);
        let pushed_layers = manifest
            .layers
            .iter()
            .map(|l| PushedLayer {
                digest: l.digest.clone(),
                size: l.size as u64,
            })
            .collect();
        self.client
            .push(&reference, &layers, config, &self.auth, Some(manifest))
            .await
            .unwrap_or_else(|e| panic!("push {repo_tag}: {e}\n{}", self.log_text()));
        let digest = self
            .client
            .fetch_manifest_digest(&reference, &self.auth)
            .await
            .expect("read back the manifest digest");
        // Its size as stored (oci-client serializes canonically).
        let (body, _) = self
            .client
            .pull_manifest_raw(
                &reference,
                &self.auth,
                &["application/vnd.oci.image.manifest.v1+json"],
            )
            .await
            .expect("read back the manifest");
        Pushed {
            digest,
            size: body.len() as i64,
            layers: pushed_layers,
        }
    }

    /// An ORAS-style artifact: one layer per file under `dir` (sorted),
    /// titled with its path relative to `dir`, typed as ORAS types plain
    /// files; an empty config and an artifactType.
    pub async fn push_artifact(&self, repo_tag: &str, dir: &Path) -> Pushed {
        let mut layers = Vec::new();
        for rel in files_under(dir) {
            let data = fs::read(dir.join(&rel)).expect("read model file");
            let annotations = BTreeMap::from([(TITLE.to_string(), rel.clone())]);
            layers.push(ImageLayer::new(data, ORAS_FILE.into(), Some(annotations)));
        }
        let config = Config::new(b"{}".to_vec(), EMPTY_CONFIG.into(), None);
        self.push(repo_tag, layers, config, Some(ARTIFACT_TYPE))
            .await
    }

    /// A runnable image (linux/amd64 or `arch`) with tar+gzip `layers`.
    pub async fn push_image(&self, repo_tag: &str, layers: Vec<TarLayer>, arch: &str) -> Pushed {
        let diff_ids: Vec<&str> = layers.iter().map(|l| l.diff_id.as_str()).collect();
        let config = serde_json::json!({
            "architecture": arch,
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let config = Config::new(
            serde_json::to_vec(&config).unwrap(),
            IMAGE_CONFIG.into(),
            None,
        );
        let layers = layers
            .into_iter()
            .map(|l| ImageLayer::new(l.blob, LAYER_TAR_GZIP.into(), None))
            .collect();
        self.push(repo_tag, layers, config, None).await
    }

    /// A modelcar image: `dir` under `models/` in two tar+gzip layers, the
    /// small files deflated, the large ones (weights, which hardly
    /// compress) in stored gzip blocks, as deflating 90 MB with a debug
    /// build would dominate the test's time.
    pub async fn push_modelcar(&self, repo_tag: &str, dir: &Path) -> Pushed {
        let (large, small): (Vec<Entry>, Vec<Entry>) = dir_entries(dir, "models")
            .into_iter()
            .partition(|e| matches!(e, Entry::File(_, data) if data.len() > 16 << 20));
        let layers = vec![tar_gz(&small), tar_gz_stored(&large)];
        self.push_image(repo_tag, layers, "amd64").await
    }

    /// An image index naming `manifests` as (pushed image, architecture).
    pub async fn push_index(&self, repo_tag: &str, manifests: &[(&Pushed, &str)]) -> String {
        let reference = self.reference(repo_tag);
        let index = OciImageIndex {
            schema_version: 2,
            media_type: Some("application/vnd.oci.image.index.v1+json".into()),
            artifact_type: None,
            annotations: None,
            manifests: manifests
                .iter()
                .map(|(p, arch)| ImageIndexEntry {
                    media_type: "application/vnd.oci.image.manifest.v1+json".into(),
                    digest: p.digest.clone(),
                    size: p.size,
                    platform: Some(
                        serde_json::from_value::<Platform>(
                            serde_json::json!({"architecture": arch, "os": "linux"}),
                        )
                        .unwrap(),
                    ),
                    annotations: None,
                    artifact_type: None,
                })
                .collect(),
        };
        self.client
            .push_manifest_list(&reference, &self.auth, index)
            .await
            .unwrap_or_else(|e| panic!("push index {repo_tag}: {e}"));
        self.client
            .fetch_manifest_digest(&reference, &self.auth)
            .await
            .expect("read back the index digest")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Regular files under `dir`, relative, '/'-separated, sorted.
pub fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for e in fs::read_dir(dir.join(&rel)).expect("read model dir") {
            let e = e.unwrap();
            let child = rel.join(e.file_name());
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(child);
            } else if ft.is_file() {
                out.push(child.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

/// One tar entry to build: a file, a directory, a symlink, or raw header
/// name bytes (which `tar::Builder` would refuse: `..`, absolute).
pub enum Entry {
    Dir(String),
    File(String, Vec<u8>),
    Symlink(String, String),
    RawFile(Vec<u8>, Vec<u8>),
}

/// `dir`'s directories and files, under `prefix/`.
pub fn dir_entries(dir: &Path, prefix: &str) -> Vec<Entry> {
    let mut entries = vec![Entry::Dir(prefix.to_string())];
    let mut dirs = std::collections::BTreeSet::new();
    for rel in files_under(dir) {
        if let Some((parent, _)) = rel.rsplit_once('/')
            && dirs.insert(parent.to_string())
        {
            entries.push(Entry::Dir(format!("{prefix}/{parent}")));
        }
        let data = fs::read(dir.join(&rel)).expect("read model file");
        entries.push(Entry::File(format!("{prefix}/{rel}"), data));
    }
    entries
}

/// A plain tar of `entries`.
pub fn tar(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_mtime(0);
        match e {
            Entry::Dir(name) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, name, std::io::empty()).unwrap();
            }
            Entry::File(name, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, name, &data[..]).unwrap();
            }
            Entry::Symlink(name, target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, name, target).unwrap();
            }
            Entry::RawFile(name, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                h.as_old_mut().name[..name.len()].copy_from_slice(name);
                h.set_cksum();
                b.append(&h, &data[..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// A gzip-compressed tar of `entries`. Compressed by the system's `gzip -1`
/// when present: a debug build of the Rust deflater takes many seconds on
/// a real model.
pub fn tar_gz(entries: &[Entry]) -> TarLayer {
    let raw = tar(entries);
    let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(&raw)));
    let blob = gzip_with_system(&raw).unwrap_or_else(|| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&raw).unwrap();
        gz.finish().unwrap()
    });
    TarLayer { blob, diff_id }
}

/// A gzip of `entries` in stored (uncompressed) deflate blocks: still a
/// real tar+gzip layer, but written here by hand, as even flate2's stored
/// mode takes seconds per 90 MB in a debug build.
pub fn tar_gz_stored(entries: &[Entry]) -> TarLayer {
    let raw = tar(entries);
    let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(&raw)));
    // RFC 1952 header: magic, deflate, no flags, no mtime, no extra flags, unix.
    let mut blob = Vec::with_capacity(raw.len() + raw.len() / 65_535 * 5 + 64);
    blob.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3]);
    let mut chunks = raw.chunks(65_535).peekable();
    if chunks.peek().is_none() {
        blob.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(chunk) = chunks.next() {
        // RFC 1951 stored block: BFINAL on the last, BTYPE 00, LEN, NLEN.
        blob.push(u8::from(chunks.peek().is_none()));
        let len = chunk.len() as u16;
        blob.extend_from_slice(&len.to_le_bytes());
        blob.extend_from_slice(&(!len).to_le_bytes());
        blob.extend_from_slice(chunk);
    }
    let mut crc = flate2::Crc::new();
    crc.update(&raw);
    blob.extend_from_slice(&crc.sum().to_le_bytes());
    blob.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    TarLayer { blob, diff_id }
}

fn gzip_with_system(raw: &[u8]) -> Option<Vec<u8>> {
    let mut child = Command::new("gzip")
        .args(["-1", "-n", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let input = raw.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().ok()?;
    writer.join().ok()?.ok()?;
    out.status.success().then_some(out.stdout)
}

/// A layer whose entry climbs out of the model: `../evil`.
pub fn tar_slip_layer() -> TarLayer {
    tar_gz(&[
        Entry::File("models/ok.txt".into(), b"fine".to_vec()),
        Entry::RawFile(b"../evil".to_vec(), b"pwned".to_vec()),
    ])
}

/// A layer that plants `link -> /etc` and then writes `link/passwd`.
pub fn symlink_escape_layer() -> TarLayer {
    tar_gz(&[
        Entry::Symlink("link".into(), "/etc".into()),
        Entry::File("link/passwd".into(), b"root::0:0::/:/bin/sh\n".to_vec()),
    ])
}
