//! `s3://bucket/prefix`: the objects under a prefix of an S3-compatible
//! bucket (AWS, MinIO, Ceph...) as one model, through `object_store`.
//!
//! `resolve` lists the prefix and names the revision by the exact object
//! versions it saw (keys, sizes, ETags); `read` serves byte ranges pinned to
//! those ETags with `If-Match`, so an object overwritten during a pull fails
//! the pull instead of mixing two versions into one model. Credentials come
//! from the request's secrets or the driver's AWS environment and never
//! reach a log line, an error or a `Resolved`.

use std::collections::{BTreeMap, HashMap};
use std::error::Error as StdError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey, AwsCredential};
use object_store::client::{HttpError, HttpErrorKind};
use object_store::path::Path;
use object_store::{
    ClientOptions, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, RetryConfig,
    StaticCredentialProvider,
};
use sha2::{Digest, Sha256};

use super::SourceOptions;
use super::failure::Failure;
use super::source::{MAX_LISTED_FILES, RemoteFile, Resolved, Source, Unpack};
use crate::error::{Error, Result};

/// The accepted form, for error messages.
pub const FORM: &str = "s3://bucket/prefix";

/// StorageClass parameters read by this source.
pub const PARAM_ENDPOINT: &str = "s3Endpoint";
pub const PARAM_REGION: &str = "s3Region";
pub const PARAM_PATH_STYLE: &str = "s3PathStyle";
/// Secret keys read by this source.
pub const SECRET_ACCESS_KEY_ID: &str = "awsAccessKeyID";
pub const SECRET_SECRET_ACCESS_KEY: &str = "awsSecretAccessKey";
pub const SECRET_SESSION_TOKEN: &str = "awsSessionToken";

const DEFAULT_REGION: &str = "us-east-1";
/// A read that delivers no byte for this long is a dead connection. Whole
/// requests have no deadline: a large range legitimately takes minutes, and
/// the engine's stall watchdog judges progress.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A parsed `s3://bucket/prefix`. The prefix has no leading or trailing '/'
/// and may be empty (the whole bucket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Uri {
    pub bucket: String,
    pub prefix: String,
}

impl S3Uri {
    /// The canonical URI: `s3://bucket/prefix`, or `s3://bucket`.
    pub fn normalized(&self) -> String {
        self.object_uri(&self.prefix)
    }

    fn object_uri(&self, key: &str) -> String {
        if key.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{key}", self.bucket)
        }
    }
}

impl std::fmt::Display for S3Uri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.normalized())
    }
}

/// Checks an `s3://bucket/prefix` URI without touching the network.
pub fn parse(uri: &str) -> Result<S3Uri, String> {
    let rest = uri
        .strip_prefix("s3://")
        .ok_or_else(|| format!("{uri:?} does not start with s3://; the accepted form is {FORM}"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    // Never echo what could be a credential ("s3://key:secret@bucket").
    if bucket.contains('@') || bucket.contains(':') {
        return Err(format!(
            "an s3:// URI must not carry credentials or a port; the accepted form is {FORM}, \
             with the endpoint in the s3Endpoint parameter and credentials in secrets"
        ));
    }
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_".contains(&b))
        && bucket.as_bytes()[0].is_ascii_alphanumeric();
    if !bucket_ok {
        return Err(format!(
            "{uri:?} does not name a valid bucket (3 to 63 letters, digits, '.', '-' or '_'); \
             the accepted form is {FORM}"
        ));
    }
    if prefix.contains(['?', '#']) {
        return Err(format!(
            "{uri:?} has a query or fragment; the accepted form is {FORM}"
        ));
    }
    let prefix = prefix.trim_matches('/');
    if !prefix.is_empty()
        && prefix
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == ".." || s.chars().any(char::is_control))
    {
        return Err(format!(
            "{uri:?} has an empty, '.' or '..' path segment; the accepted form is {FORM}"
        ));
    }
    Ok(S3Uri {
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
    })
}

/// One S3 prefix as a model source.
pub struct S3Source {
    uri: S3Uri,
    store: AmazonS3,
    /// The endpoint, when not AWS's own: part of the cache key.
    endpoint: String,
    /// Each object's metadata as the last `resolve` listed it, by key: what
    /// `read` pins its GETs to.
    pins: Mutex<HashMap<String, ObjectMeta>>,
}

impl std::fmt::Debug for S3Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Source").field("uri", &self.uri).finish()
    }
}

/// Builds the source without touching the network: checks the URI, the
/// parameters and the secrets.
pub fn new(uri: &str, opts: &SourceOptions) -> Result<S3Source> {
    let parsed = parse(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    let (store, endpoint) = build_store(&parsed.bucket, opts)?;
    Ok(S3Source {
        uri: parsed,
        store,
        endpoint,
        pins: Mutex::new(HashMap::new()),
    })
}

fn build_store(bucket: &str, opts: &SourceOptions) -> Result<(AmazonS3, String)> {
    let (builder, scope, allow_http) = configured(bucket, opts)?;
    let mut client = ClientOptions::new();
    if let Some(proxy) = opts.proxy() {
        client = client.with_proxy_url(proxy);
    }
    let client = client
        .with_allow_http(allow_http)
        .with_timeout_disabled()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_read_timeout(READ_TIMEOUT);
    // One quick retry covers a pooled connection the server already closed;
    // real retrying (backoff, giving up) is the engine's.
    let retry = RetryConfig {
        max_retries: 1,
        retry_timeout: Duration::from_secs(10),
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            base: 2.0,
        },
    };
    let store = builder
        .with_client_options(client)
        .with_retry(retry)
        .build()
        .map_err(|e| {
            // Builder errors name options, never their secret values.
            Error::invalid("parameters", format!("cannot configure S3 access: {e}"))
        })?;
    Ok((store, scope))
}

/// The driver's `AWS_*` environment (`AdminEnv`, read at start-up), as
/// object_store's own `from_env` would read it from the process.
fn from_driver_env(opts: &SourceOptions) -> AmazonS3Builder {
    opts.env
        .aws()
        .filter_map(|(k, v)| Some((k.to_ascii_lowercase().parse().ok()?, v)))
        .fold(AmazonS3Builder::new(), |b, (key, value)| {
            b.with_config(key, value)
        })
}

/// The builder for a bucket from the class's parameters, the request's
/// secrets and the driver's environment; with the endpoint as part of the
/// cache key (empty for AWS's own) and whether it speaks plain HTTP.
fn configured(bucket: &str, opts: &SourceOptions) -> Result<(AmazonS3Builder, String, bool)> {
    let params = &opts.params;
    // The driver's AWS_* environment fills whatever the StorageClass leaves
    // out (region, endpoint, and the credential chain: env keys, web
    // identity, instance metadata).
    let mut builder = from_driver_env(opts).with_bucket_name(bucket);

    if let Some(region) = params.get(PARAM_REGION) {
        if region.is_empty()
            || !region
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(Error::invalid(
                format!("parameters.{PARAM_REGION}"),
                format!("{region:?} is not a region name, like us-east-1"),
            ));
        }
        builder = builder.with_region(region);
    } else if builder
        .get_config_value(&AmazonS3ConfigKey::Region)
        .is_none()
    {
        builder = builder.with_region(DEFAULT_REGION);
    }

    let endpoint = match params.get(PARAM_ENDPOINT) {
        Some(e) => Some(parse_endpoint(e)?),
        None => builder
            .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
            .or_else(|| builder.get_config_value(&AmazonS3ConfigKey::Endpoint))
            .map(|e| parse_endpoint(&e))
            .transpose()?,
    };

    // Path style suits custom endpoints (MinIO and most S3-compatibles);
    // virtual-hosted is what AWS recommends for its own endpoints.
    let path_style = match params.get(PARAM_PATH_STYLE).map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        Some(other) => {
            return Err(Error::invalid(
                format!("parameters.{PARAM_PATH_STYLE}"),
                format!("{other:?} is not \"true\" or \"false\""),
            ));
        }
        None => endpoint.is_some(),
    };
    builder = builder.with_virtual_hosted_style_request(!path_style);
    let scope = endpoint
        .as_ref()
        .map(|e| format!("{e} path_style={path_style}"))
        .unwrap_or_default();
    let allow_http = endpoint.as_ref().is_some_and(|e| e.scheme() == "http");
    if let Some(endpoint) = endpoint {
        // object_store expects a virtual-hosted endpoint to name the bucket.
        let endpoint = if path_style {
            endpoint.as_str().trim_end_matches('/').to_string()
        } else {
            let mut e = endpoint.clone();
            let host = format!("{bucket}.{}", endpoint.host_str().unwrap_or_default());
            e.set_host(Some(&host)).map_err(|_| {
                Error::invalid(
                    format!("parameters.{PARAM_ENDPOINT}"),
                    format!(
                        "cannot put bucket {bucket} into the endpoint's host for \
                         virtual-hosted requests; set {PARAM_PATH_STYLE}: \"true\""
                    ),
                )
            })?;
            e.as_str().trim_end_matches('/').to_string()
        };
        // The S3-specific key, so it also overrides AWS_ENDPOINT_URL_S3.
        builder = builder.with_config(AmazonS3ConfigKey::S3Endpoint, endpoint);
    }

    Ok((with_secrets(builder, opts)?, scope, allow_http))
}

/// The request's own keys, which override every credential the driver's
/// environment may hold; a tenant without them is unsigned.
fn with_secrets(builder: AmazonS3Builder, opts: &SourceOptions) -> Result<AmazonS3Builder> {
    let secrets = &opts.secrets;
    match (
        secrets.get(SECRET_ACCESS_KEY_ID),
        secrets.get(SECRET_SECRET_ACCESS_KEY),
    ) {
        (Some(key_id), Some(secret_key)) => {
            let credential = AwsCredential {
                key_id: key_id.clone(),
                secret_key: secret_key.clone(),
                token: secrets.get(SECRET_SESSION_TOKEN).cloned(),
            };
            Ok(builder.with_credentials(Arc::new(StaticCredentialProvider::new(credential))))
        }
        // A tenant's pull never signs with the driver's environment keys,
        // web identity or instance role: unsigned, or the PVC's own secret.
        (None, None) if opts.own_credentials_only() => Ok(builder.with_skip_signature(true)),
        (None, None) => Ok(builder),
        _ => Err(Error::invalid(
            "secrets",
            format!("{SECRET_ACCESS_KEY_ID} and {SECRET_SECRET_ACCESS_KEY} must be given together"),
        )),
    }
}

fn parse_endpoint(endpoint: &str) -> Result<url::Url> {
    let field = format!("parameters.{PARAM_ENDPOINT}");
    let url = url::Url::parse(endpoint).map_err(|_| {
        Error::invalid(
            &field,
            "is not a URL; use the form http(s)://host[:port], like http://127.0.0.1:9000",
        )
    })?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Error::invalid(
            &field,
            "must not carry credentials; put them in the secrets",
        ));
    }
    if !matches!(url.scheme(), "http" | "https")
        || url.host_str().is_none()
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(Error::invalid(
            &field,
            format!(
                "{endpoint:?} is not of the form http(s)://host[:port], like http://127.0.0.1:9000"
            ),
        ));
    }
    Ok(url)
}

impl S3Source {
    pub fn uri(&self) -> &S3Uri {
        &self.uri
    }

    /// Every object under the prefix-as-directory, directory markers
    /// dropped; or the single object the prefix names.
    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>> {
        let uri = self.uri.normalized();
        let prefix = &self.uri.prefix;
        let prefix_path = if prefix.is_empty() {
            None
        } else {
            Some(
                Path::parse(prefix)
                    .map_err(|e| Error::invalid("parameters.source", e.to_string()))?,
            )
        };
        // object_store lists `prefix/`, so `models/minilm` never matches
        // `models/minilm-v2/...`.
        let mut listing = self.store.list(prefix_path.as_ref());
        let mut metas: Vec<ObjectMeta> = Vec::new();
        while let Some(meta) = listing
            .try_next()
            .await
            .map_err(|e| map_err(&uri, "list", e))?
        {
            if metas.len() >= MAX_LISTED_FILES {
                return Err(Error::OverLimit(format!(
                    "{uri}: more than {MAX_LISTED_FILES} objects under this prefix"
                )));
            }
            metas.push(meta);
        }

        if metas.is_empty() {
            // Not a directory: perhaps the prefix is one object.
            if let Some(p) = &prefix_path {
                match self.store.head(p).await {
                    Ok(meta) => {
                        let name = prefix.rsplit('/').next().unwrap_or(prefix).to_string();
                        return Ok(vec![(name, meta)]);
                    }
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(map_err(&uri, "head", e)),
                }
            }
            return Err(Error::NotFound(format!(
                "{uri}: no objects under this prefix (nor an object by this name)"
            )));
        }

        // object_store strips the trailing '/' of a key, so a directory
        // marker `a/b/` arrives as an empty `a/b`.
        let mut by_rel: BTreeMap<String, ObjectMeta> = BTreeMap::new();
        for meta in metas {
            let key = meta.location.as_ref();
            // The server chose what to list; a key outside the prefix is
            // not part of this model, whatever it says.
            let rel = if prefix.is_empty() {
                Some(key)
            } else if key == prefix {
                Some("")
            } else {
                key.strip_prefix(prefix.as_str())
                    .and_then(|r| r.strip_prefix('/'))
            };
            let Some(rel) = rel else {
                return Err(Error::SourceFault(format!(
                    "{uri}: the object store listed the key {key:?}, which is not under the \
                     requested prefix {prefix:?}"
                )));
            };
            let rel = rel.to_string();
            if rel.is_empty() {
                continue; // the marker of the prefix itself
            }
            match by_rel.get(&rel) {
                Some(seen) if seen.size >= meta.size => {}
                _ => {
                    by_rel.insert(rel, meta);
                }
            }
        }
        let rels: Vec<String> = by_rel.keys().cloned().collect();
        let has_children = |rel: &str| {
            let dir = format!("{rel}/");
            // Sorted: children of `rel` sort right after `rel/`.
            let i = rels.partition_point(|r| r.as_str() < dir.as_str());
            rels.get(i).is_some_and(|r| r.starts_with(&dir))
        };
        let mut files = Vec::with_capacity(by_rel.len());
        for (rel, meta) in by_rel {
            if has_children(&rel) {
                if meta.size == 0 {
                    continue; // a directory marker
                }
                return Err(Error::SourceFault(format!(
                    "{}: {rel} is both an object and a directory of other objects; \
                     such a tree cannot be a model directory",
                    self.uri.object_uri(prefix)
                )));
            }
            if meta.size == 0 {
                // An empty object or the marker of an empty directory:
                // only a real object answers HEAD without the slash.
                match self.store.head(&meta.location).await {
                    Ok(real) => files.push((rel, real)),
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(map_err(&uri, "head", e)),
                }
                continue;
            }
            files.push((rel, meta));
        }
        if files.is_empty() {
            return Err(Error::NotFound(format!(
                "{uri}: only empty directories under this prefix"
            )));
        }
        Ok(files)
    }
}

/// The revision: a digest of exactly which object versions make the model.
/// ETags change with content (S3 and MinIO use content hashes), so
/// re-uploading identical bytes keeps the revision and changed bytes do not.
fn revision(files: &[(String, ObjectMeta)]) -> String {
    let mut h = Sha256::new();
    h.update(b"s3 revision v1\n");
    let mut keys: Vec<&ObjectMeta> = files.iter().map(|(_, m)| m).collect();
    keys.sort_by(|a, b| a.location.as_ref().cmp(b.location.as_ref()));
    for m in keys {
        let etag = m.e_tag.as_deref().map(|e| e.trim_matches('"'));
        // Without an ETag, the modification time is the best version we have.
        let last_modified = if etag.is_none() {
            m.last_modified.to_rfc3339()
        } else {
            String::new()
        };
        h.update(
            format!(
                "{}\0{}\0{}\0{}\0{last_modified}\n",
                m.location.as_ref(),
                m.size,
                etag.unwrap_or(""),
                m.version.as_deref().unwrap_or(""),
            )
            .as_bytes(),
        );
    }
    hex::encode(h.finalize())
}

#[async_trait::async_trait]
impl Source for S3Source {
    /// A single-part object's ETag is the MD5 of its bytes (multipart ones
    /// end in `-<parts>`, and say nothing checkable).
    fn origin_md5(&self, file: &RemoteFile) -> Option<String> {
        let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        let etag = pins.get(&file.locator)?.e_tag.as_deref()?.trim_matches('"');
        (etag.len() == 32 && etag.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| etag.to_ascii_lowercase())
    }

    async fn resolve(&self) -> Result<Resolved> {
        let listed = self.list().await?;
        let revision = revision(&listed);
        let mut pins = HashMap::with_capacity(listed.len());
        let files = listed
            .into_iter()
            .map(|(path, meta)| {
                let key = meta.location.as_ref().to_string();
                let file = RemoteFile {
                    path,
                    size: Some(meta.size),
                    // object_store exposes no x-amz-checksum-sha256 on list,
                    // head or get; the engine hashes every byte itself.
                    sha256: None,
                    locator: key.clone(),
                    unpack: Unpack::None,
                };
                pins.insert(key, meta);
                file
            })
            .collect();
        *self.pins.lock().unwrap_or_else(|p| p.into_inner()) = pins;
        Ok(Resolved {
            uri: self.uri.normalized(),
            revision,
            files,
        })
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        let target = self.uri.object_uri(&file.locator);
        let meta = self
            .pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&file.locator)
            .cloned()
            .ok_or_else(|| {
                Error::Internal(format!(
                    "read of {target} before resolve() listed it on this source"
                ))
            })?;
        let size = meta.size;
        if file.size.is_some_and(|s| s != size) {
            // A file from an older resolve than the pins: never mix the two.
            return Err(Error::Precondition(format!(
                "{target}: object changed during the pull; retry to pull the new revision"
            )));
        }
        let end = match len {
            Some(l) => offset.checked_add(l).filter(|e| *e <= size),
            None => (offset <= size).then_some(size),
        }
        .ok_or_else(|| {
            Error::Unsatisfiable(format!(
                "{target}: range {offset}+{len:?} is outside its {size} bytes"
            ))
        })?;
        if offset == end {
            // S3 refuses empty ranges; there is nothing to fetch.
            return Ok(futures::stream::empty().boxed());
        }
        let range = if offset == 0 && end == size {
            None
        } else {
            Some(GetRange::Bounded(offset..end))
        };
        // Pinned by ETag, not by version id: a versioned GET needs
        // s3:GetObjectVersion, which read-only policies often lack.
        let mut options = GetOptions {
            range,
            ..Default::default()
        };
        match &meta.e_tag {
            Some(etag) => options.if_match = Some(etag.clone()),
            None => options.if_unmodified_since = Some(meta.last_modified),
        }
        let result = self
            .store
            .get_opts(&meta.location, options)
            .await
            .map_err(|e| map_err(&target, "get", e))?;
        Ok(result
            .into_stream()
            .map_err(move |e| map_err(&target, "read", e))
            .boxed())
    }

    fn key_scope(&self) -> String {
        self.endpoint.clone()
    }
}

/// What a failed request tells us, from object_store's error chain.
#[derive(Debug, Default)]
struct Inspected {
    status: Option<u16>,
    /// The S3 error code (`NoSuchBucket`, `SignatureDoesNotMatch`...).
    code: Option<String>,
    transport: Option<HttpErrorKind>,
}

fn inspect(err: &(dyn StdError + 'static)) -> Inspected {
    let mut f = Inspected::default();
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(h) = e.downcast_ref::<HttpError>() {
            f.transport.get_or_insert(h.kind());
        }
        // object_store does not export its request error; its status is
        // only in the text ("Server returned non-2xx status code: 404 Not
        // Found: <body>"). The tests pin this format.
        let text = e.to_string();
        if let Some(rest) = text.strip_prefix("Server returned non-2xx status code: ") {
            f.status = rest.get(..3).and_then(|s| s.parse().ok());
            f.code = s3_code(rest);
        } else if let Some(rest) = text.strip_prefix("Server returned error response: ") {
            f.code = s3_code(rest);
        } else if text.starts_with("Received redirect without LOCATION") {
            f.status = Some(301);
        }
        cur = e.source();
    }
    f
}

/// The innermost error's text ("Connection refused (os error 111)").
fn root_cause(err: &(dyn StdError + 'static)) -> String {
    let mut cur = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

fn s3_code(body: &str) -> Option<String> {
    let start = body.find("<Code>")? + "<Code>".len();
    let len = body[start..].find("</Code>")?;
    let code = &body[start..start + len];
    code.bytes()
        .all(|b| b.is_ascii_alphanumeric())
        .then(|| code.to_string())
}

/// Maps an object_store error to the domain error. Response bodies are never
/// quoted: an S3 auth error body echoes the access key id and the string
/// that was signed.
fn map_err(target: &str, op: &str, err: object_store::Error) -> Error {
    match failure_of(target, op, err) {
        Ok(f) => f.into(),
        Err(other) => Error::Internal(format!("{target}: {op} failed: {other}")),
    }
}

/// What the object store did; an error it did not cause comes back as is.
fn failure_of(
    target: &str,
    op: &str,
    err: object_store::Error,
) -> Result<Failure, object_store::Error> {
    use object_store::Error as OsError;
    let seen = inspect(&err);
    let status = match &err {
        OsError::NotFound { .. } => Some(404),
        OsError::Precondition { .. } => Some(412),
        OsError::PermissionDenied { .. } => Some(403),
        OsError::Unauthenticated { .. } => Some(401),
        _ => seen.status,
    };
    let code = seen.code.as_deref().unwrap_or("");
    let sep = if code.is_empty() { "" } else { " " };
    Ok(match status {
        Some(404) if op == "get" || op == "read" => Failure::NotFound(format!(
            "{target} no longer exists: the model changed during the pull; \
             retry to pull the new revision"
        )),
        Some(404) if code.is_empty() => Failure::NotFound(format!("{target}: not found")),
        Some(404) => Failure::NotFound(format!("{target}: not found ({code})")),
        Some(412) => Failure::Refused(format!(
            "{target}: object changed during the pull; retry to pull the new revision"
        )),
        Some(s @ (401 | 403)) => Failure::Denied(format!(
            "{target}: the S3 credentials were rejected or lack permission (HTTP {s}{sep}{code}); \
             check the {SECRET_ACCESS_KEY_ID}/{SECRET_SECRET_ACCESS_KEY} secrets \
             or the driver's AWS credentials"
        )),
        Some(301) => Failure::Refused(format!(
            "{target}: the bucket is in another region (HTTP 301{sep}{code}); set {PARAM_REGION}"
        )),
        Some(s) if s == 429 || s >= 500 => Failure::transient(format!(
            "{target}: the object store answered {op} with HTTP {s}{sep}{code}"
        )),
        Some(s) => Failure::Refused(format!(
            "{target}: the object store refused {op} with HTTP {s}{sep}{code}; \
             check {PARAM_ENDPOINT}, {PARAM_REGION} and {PARAM_PATH_STYLE}"
        )),
        // No response: connection refused or reset, timeout, DNS, TLS.
        // These errors carry no response body, so their text is safe.
        None if seen.transport.is_some() => Failure::transient(format!(
            "{target}: cannot reach the object store to {op}: {err}: {}",
            root_cause(&err)
        )),
        None => match err {
            OsError::InvalidPath { source } => Failure::Corrupt(format!(
                "{target}: an object key is not a usable relative path: {source}"
            )),
            // An answer object_store could not accept (a 200 to a ranged
            // GET, a bad Content-Range, an unparsable listing): the server's
            // doing, not a bug here.
            OsError::Generic { .. } => Failure::Corrupt(format!(
                "{target}: the object store's answer to {op} was invalid: {err}"
            )),
            other => return Err(other),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bucket_and_prefix() {
        let u = parse("s3://models/team/minilm/").unwrap();
        assert_eq!(u.bucket, "models");
        assert_eq!(u.prefix, "team/minilm");
        assert_eq!(u.normalized(), "s3://models/team/minilm");
        let whole = parse("s3://models").unwrap();
        assert_eq!(whole.prefix, "");
        assert_eq!(whole.normalized(), "s3://models");
        assert_eq!(parse("s3://models/").unwrap(), whole);
    }

    #[test]
    fn rejects_malformed_uris_naming_the_form() {
        for bad in [
            "http://models/x",
            "s3://",
            "s3://a/x",
            "s3://UPPER CASE/x",
            "s3://b-k/a//b",
            "s3://b-k/a/../b",
            "s3://b-k/a?versionId=1",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(FORM), "{bad}: {e}");
        }
        let e = parse("s3://AKIA:hunter2@bucket/x").unwrap_err();
        assert!(!e.contains("hunter2") && e.contains(FORM), "{e}");
    }

    #[test]
    fn options_are_checked_without_network() {
        let mut opts = SourceOptions::default();
        opts.params.insert(PARAM_PATH_STYLE.into(), "yes".into());
        let e = new("s3://bucket/x", &opts).unwrap_err();
        assert!(e.to_string().contains(PARAM_PATH_STYLE), "{e}");

        let mut opts = SourceOptions::default();
        opts.params.insert(
            PARAM_ENDPOINT.into(),
            "http://k:hunter2@127.0.0.1:9000".into(),
        );
        let e = new("s3://bucket/x", &opts).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");

        let mut opts = SourceOptions::default();
        opts.secrets
            .insert(SECRET_SECRET_ACCESS_KEY.into(), "hunter2".into());
        let e = new("s3://bucket/x", &opts).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");

        let mut opts = SourceOptions::default();
        opts.params
            .insert(PARAM_ENDPOINT.into(), "http://127.0.0.1:9000".into());
        opts.secrets.insert(SECRET_ACCESS_KEY_ID.into(), "k".into());
        opts.secrets
            .insert(SECRET_SECRET_ACCESS_KEY.into(), "hunter2".into());
        let s = new("s3://bucket/x", &opts).unwrap();
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn the_driver_environment_given_at_start_configures_the_client() {
        let mut opts = SourceOptions {
            env: Arc::new(crate::trust::AdminEnv::from_pairs([
                ("AWS_REGION", "eu-west-3".to_string()),
                ("AWS_ENDPOINT_URL_S3", "http://10.1.2.3:9000".to_string()),
                ("AWS_ACCESS_KEY_ID", "ENVKEY".to_string()),
                ("AWS_NOT_A_SETTING", "x".to_string()),
            ])),
            ..Default::default()
        };
        let (b, scope, http) = configured("bucket", &opts).unwrap();
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::Region).as_deref(),
            Some("eu-west-3")
        );
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::AccessKeyId)
                .as_deref(),
            Some("ENVKEY")
        );
        assert!(
            scope.starts_with("http://10.1.2.3:9000/") && http,
            "{scope}"
        );

        // The class's parameters win over the environment.
        opts.params.insert(PARAM_REGION.into(), "us-west-2".into());
        let (b, _, _) = configured("bucket", &opts).unwrap();
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::Region).as_deref(),
            Some("us-west-2")
        );

        // Without a driver environment nothing comes from the process's.
        let (b, scope, _) = configured("bucket", &SourceOptions::default()).unwrap();
        assert_eq!(b.get_config_value(&AmazonS3ConfigKey::AccessKeyId), None);
        assert_eq!(
            b.get_config_value(&AmazonS3ConfigKey::Region).as_deref(),
            Some(DEFAULT_REGION)
        );
        assert_eq!(scope, "");
    }

    #[test]
    fn s3_error_code_is_extracted_alone() {
        let body = "403 Forbidden: <Error><Code>SignatureDoesNotMatch</Code>\
                    <AWSAccessKeyId>AKIA</AWSAccessKeyId></Error>";
        assert_eq!(s3_code(body).as_deref(), Some("SignatureDoesNotMatch"));
        assert_eq!(s3_code("no xml"), None);
    }
}
