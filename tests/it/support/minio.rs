//! A real MinIO server for tests: started on a free loopback port over a
//! fresh temp dir, ready before `start` returns, killed on Drop.
//!
//! The binary
//! comes from `$MODELCACHE_MINIO`, else from `tests/scripts/deps/minio.sh` (which
//! builds it once, cached). GET requests are counted from MinIO's own
//! Prometheus v3 metrics, which are live (the v2 ones are cached for
//! seconds): `minio_api_requests_total{name="GetObject"}` server-wide and
//! `minio_bucket_api_total{name="GetObject"}` per bucket. Both count every
//! GetObject the server answered, failed ones (404, 412) included.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;

use super::harness::free_port;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::signer::Signer;
use object_store::{ObjectStoreExt, PutPayload};
use sha2::{Digest, Sha256};

pub const ROOT_USER: &str = "modelcache-test";
pub const ROOT_PASSWORD: &str = "modelcache-test-password";
pub const REGION: &str = "us-east-1";

/// One running MinIO and its data dir.
pub struct Minio {
    /// `http://127.0.0.1:<port>`
    pub endpoint: String,
    pub port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

/// The MinIO binary: `$MODELCACHE_MINIO`, or whatever `tests/scripts/deps/minio.sh`
/// prints (building it on first use).
pub fn binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("MODELCACHE_MINIO") {
            return PathBuf::from(p);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/deps/minio.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
        assert!(out.status.success(), "{} failed", script.display());
        let path = String::from_utf8(out.stdout).expect("minio.sh prints a path");
        PathBuf::from(path.trim())
    })
    .clone()
}

impl Minio {
    /// Starts MinIO and waits until it reports ready.
    pub fn start() -> Minio {
        Minio::start_with_env(&[])
    }

    /// Like `start`, with more environment (say, a KMS key).
    pub fn start_with_env(env: &[(&str, &str)]) -> Minio {
        let bin = binary();
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).expect("create data dir");
        let log = dir.path().join("minio.log");
        // The free port can be taken between probing and binding: retry.
        for _ in 0..5 {
            let port = free_port();
            let mut child = Command::new(&bin)
                .args(["server", "--quiet", "--address"])
                .arg(format!("127.0.0.1:{port}"))
                .arg(&data)
                .env("MINIO_ROOT_USER", ROOT_USER)
                .env("MINIO_ROOT_PASSWORD", ROOT_PASSWORD)
                .env("MINIO_BROWSER", "off")
                .env("MINIO_PROMETHEUS_AUTH_TYPE", "public")
                .env("MINIO_UPDATE", "off")
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("create log"))
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            if wait_ready(&mut child, port, Duration::from_secs(30)) {
                return Minio {
                    endpoint: format!("http://127.0.0.1:{port}"),
                    port,
                    child: Some(child),
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "MinIO did not start: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Kills the server (for "object store down" tests); idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn http(&self, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        http(self.port, method, path, b"")
    }

    fn http_body(&self, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, String)> {
        http(self.port, method, path, body)
    }

    /// Parameters for `SourceOptions::params` that point a source at this server.
    pub fn params(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("s3Endpoint".to_string(), self.endpoint.clone()),
            ("s3Region".to_string(), REGION.to_string()),
            ("s3PathStyle".to_string(), "true".to_string()),
        ])
    }

    /// Secrets for `SourceOptions::secrets`: the root credentials.
    pub fn secrets(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("awsAccessKeyID".to_string(), ROOT_USER.to_string()),
            ("awsSecretAccessKey".to_string(), ROOT_PASSWORD.to_string()),
        ])
    }

    /// An object_store client for `bucket` with the root credentials.
    pub fn store(&self, bucket: &str) -> AmazonS3 {
        AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_region(REGION)
            .with_bucket_name(bucket)
            .with_access_key_id(ROOT_USER)
            .with_secret_access_key(ROOT_PASSWORD)
            .build()
            .expect("build S3 client")
    }

    /// Creates a bucket (object_store has no call for it: a presigned PUT).
    pub async fn create_bucket(&self, bucket: &str) {
        let url = self
            .store(bucket)
            .signed_url(
                reqwest::Method::PUT,
                &ObjectPath::from(""),
                Duration::from_secs(60),
            )
            .await
            .expect("presign bucket creation");
        let path = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_string(),
        };
        let (status, body) = self.http("PUT", &path).expect("create bucket");
        assert_eq!(status, 200, "create bucket {bucket}: {body}");
    }

    /// Uploads `data` as `key`.
    pub async fn put(&self, bucket: &str, key: &str, data: impl Into<PutPayload>) {
        self.store(bucket)
            .put(&ObjectPath::parse(key).expect("key"), data.into())
            .await
            .unwrap_or_else(|e| panic!("put {bucket}/{key}: {e}"));
    }

    /// PUTs an empty object under a key object_store cannot name, such as a
    /// directory marker `dir/` (its paths drop a trailing '/').
    pub fn put_raw_key(&self, bucket: &str, key: &str) {
        let path = format!("/{bucket}/{}", uri_encode(key, false));
        let (status, body) = self
            .http_body("PUT", &self.presign("PUT", &path, None), b"")
            .expect("raw put");
        assert_eq!(status, 200, "PUT {bucket}/{key}: {body}");
    }

    /// Sets a bucket policy (S3 PutBucketPolicy), e.g. to let anyone list a
    /// bucket but not read its objects.
    pub fn set_policy(&self, bucket: &str, policy: &serde_json::Value) {
        let url = self.presign("PUT", &format!("/{bucket}"), Some("policy="));
        let (status, body) = self
            .http_body("PUT", &url, policy.to_string().as_bytes())
            .expect("put bucket policy");
        assert!(
            status == 200 || status == 204,
            "policy of {bucket}: {status} {body}"
        );
    }

    /// `path` with a SigV4 presigned query (root credentials, unsigned
    /// payload); `extra` is a query parameter of the request, already in
    /// canonical form.
    fn presign(&self, method: &str, path: &str, extra: Option<&str>) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let (date, datetime) = amz_dates(now);
        let scope = format!("{date}/{REGION}/s3/aws4_request");
        let mut query = format!(
            "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={}&X-Amz-Date={datetime}\
             &X-Amz-Expires=300&X-Amz-SignedHeaders=host",
            uri_encode(&format!("{ROOT_USER}/{scope}"), true)
        );
        // Canonical order: 'X-Amz-*' sorts before lowercase names.
        if let Some(e) = extra {
            query = format!("{query}&{e}");
        }
        let canonical = format!(
            "{method}\n{path}\n{query}\nhost:127.0.0.1:{}\n\nhost\nUNSIGNED-PAYLOAD",
            self.port
        );
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{datetime}\n{scope}\n{}",
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let mut k = hmac(format!("AWS4{ROOT_PASSWORD}").as_bytes(), date.as_bytes());
        for part in [REGION, "s3", "aws4_request"] {
            k = hmac(&k, part.as_bytes());
        }
        let signature = hex::encode(hmac(&k, to_sign.as_bytes()));
        format!("{path}?{query}&X-Amz-Signature={signature}")
    }

    /// Uploads every file under `dir` as `prefix/<relative path>`; returns the
    /// relative paths ('/'-separated) and sizes, sorted.
    pub async fn upload_dir(&self, bucket: &str, prefix: &str, dir: &Path) -> Vec<(String, u64)> {
        let store = self.store(bucket);
        let mut uploaded = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).expect("read dir") {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let rel = path
                    .strip_prefix(dir)
                    .expect("under dir")
                    .to_str()
                    .expect("utf-8 path")
                    .to_string();
                let key = if prefix.is_empty() {
                    rel.clone()
                } else {
                    format!("{}/{rel}", prefix.trim_end_matches('/'))
                };
                let data = std::fs::read(&path).expect("read file");
                let size = data.len() as u64;
                store
                    .put(&ObjectPath::parse(&key).expect("key"), data.into())
                    .await
                    .unwrap_or_else(|e| panic!("put {key}: {e}"));
                uploaded.push((rel, size));
            }
        }
        uploaded.sort();
        uploaded
    }

    /// GetObject requests the server has answered, over all buckets.
    pub fn get_object_count(&self) -> u64 {
        self.settled(|| {
            self.metric(
                "/minio/metrics/v3/api/requests",
                "minio_api_requests_total{",
                &[r#"name="GetObject""#],
            )
        })
    }

    /// Bytes the server has sent in answers to S3 calls (objects, and the
    /// small listings): what an origin's egress bill counts.
    pub fn sent_bytes(&self) -> u64 {
        self.settled(|| {
            self.metric(
                "/minio/metrics/v3/api/requests",
                "minio_api_requests_traffic_sent_bytes{",
                &[r#"type="s3""#],
            )
        })
    }

    /// GetObject requests the server has answered for one bucket.
    pub fn get_object_count_in(&self, bucket: &str) -> u64 {
        self.settled(|| {
            self.metric(
                &format!("/minio/metrics/v3/bucket/api/{bucket}"),
                "minio_bucket_api_total{",
                &[r#"name="GetObject""#, &format!(r#"bucket="{bucket}""#)],
            )
        })
    }

    /// MinIO counts a request when its handler returns, which can be just
    /// after the client has every byte (or has gone, killed mid-request).
    /// A count is taken once it stops moving, so each request lands on the
    /// side of the measurement it belongs to.
    fn settled(&self, read: impl Fn() -> u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut last = read();
        loop {
            std::thread::sleep(Duration::from_millis(150));
            let now = read();
            if now == last || Instant::now() > deadline {
                return now;
            }
            last = now;
        }
    }

    /// Sums the samples of `series` whose labels contain all of `labels`
    /// (0 when MinIO has not served such a request yet).
    fn metric(&self, path: &str, series: &str, labels: &[&str]) -> u64 {
        let (status, body) = self.http("GET", path).expect("fetch metrics");
        assert_eq!(status, 200, "GET {path}: {body}");
        body.lines()
            .filter(|l| l.starts_with(series) && labels.iter().all(|lab| l.contains(lab)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}

/// (YYYYMMDD, YYYYMMDDTHHMMSSZ) for a Unix time, as SigV4 wants them.
fn amz_dates(unix: u64) -> (String, String) {
    let t = chrono::DateTime::from_timestamp(unix as i64, 0).expect("a time after 1970");
    (
        t.format("%Y%m%d").to_string(),
        t.format("%Y%m%dT%H%M%SZ").to_string(),
    )
}

fn uri_encode(s: &str, encode_slash: bool) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b'/' if !encode_slash => "/".to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn hmac(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |x: u8| block.iter().map(|b| b ^ x).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}

/// Polls the readiness endpoint; false when MinIO exited or timed out.
fn wait_ready(child: &mut Child, port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        // "Ready" comes before the object layer: until then S3 calls answer
        // 503 XMinioServerNotInitialized. An anonymous ListBuckets answers
        // 403 once they work.
        if matches!(http(port, "GET", "/minio/health/ready", b""), Ok((200, _)))
            && matches!(http(port, "GET", "/", b""), Ok((s, _)) if s != 503 && s != 0)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A plain HTTP/1.0 request to the server on `port`: (status, body).
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, String)> {
    let mut conn = TcpStream::connect(("127.0.0.1", port))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        conn,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )?;
    conn.write_all(body)?;
    let mut resp = String::new();
    conn.read_to_string(&mut resp)?;
    let status = resp
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

impl Drop for Minio {
    fn drop(&mut self) {
        self.stop();
    }
}
