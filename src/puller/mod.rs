//! Model sources fetched by the driver itself, sealed into the store under a
//! content-addressed key so every volume of the same model shares one copy.
//!
//! `source.rs` is the contract every scheme implements; `engine.rs` does the
//! downloading (parallel ranges, streaming sha256, resume after a crash,
//! retries, stall watchdog) and the sealing; each scheme module only
//! resolves a URI and serves byte ranges. Nothing here logs or stores a
//! credential.

mod direct;
pub mod engine;
pub mod failure;
pub mod file;
pub mod hf;
pub mod http;
pub mod oci;
pub mod registry;
pub mod s3;
pub mod slots;
pub mod source;
pub mod unpack;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::cache::manifest::FileEntry;
use crate::error::{Error, Result};
use crate::trust::{Bounds, Tenant, egress};
use source::{Compression, PullLimits, Resolved, Source};

/// StorageClass parameters that lower the driver's pull limits.
pub const PARAM_MAX_MODEL_BYTES: &str = "maxModelBytes";
pub const PARAM_MAX_MODEL_FILES: &str = "maxModelFiles";

/// Every model URI form, for error messages.
pub const ACCEPTED_FORMS: &str = "s3://bucket/prefix, https://host/path/file (or .../manifest.json#manifest), \
     oci://registry/repo:tag or oci://registry/repo@sha256:<digest>, hf://org/repo[@revision], \
     model-registry://model[/version], pvc://[namespace:]claim[/path], file:///absolute/path";

/// Parameters and secrets that configure sources. Parameters come from the
/// StorageClass (validated by the controller); secrets from the CSI
/// request's secrets, never logged.
#[derive(Clone, Default)]
pub struct SourceOptions {
    pub params: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    /// Set when someone the admin does not vouch for named the source (a
    /// tenant; a model registry's answer): no credential of the driver's
    /// environment or instance is used unless the scope says so, and every
    /// connection goes through its egress guard.
    pub tenant: Option<Arc<Tenant>>,
    /// What a URI the class did not write may reach (a registry's answer).
    pub bounds: Bounds,
    /// An admin's source's guard, for clients that take no resolver of
    /// ours (s3, oci): it closes only metadata addresses. `open` sets it;
    /// public only so that callers can build options with `..Default`.
    pub admin_guard: Option<Arc<egress::Guard>>,
    /// The driver's environment (`Config::admin_env`).
    pub env: Arc<crate::trust::AdminEnv>,
}

impl SourceOptions {
    /// The pull's egress guard: the tenant scope's, else the admin's.
    fn guard(&self) -> Option<&Arc<egress::Guard>> {
        self.tenant
            .as_ref()
            .map(|t| &t.guard)
            .or(self.admin_guard.as_ref())
    }

    /// The egress guard's proxy URL for this pull, if its clients use one.
    pub(crate) fn proxy(&self) -> Option<&str> {
        self.guard().map(|g| g.proxy_url())
    }

    /// Only the requester's own secret may sign or authorise this pull.
    pub(crate) fn own_credentials_only(&self) -> bool {
        self.tenant.as_ref().is_some_and(|t| !t.credentials)
    }

    /// A credential from the driver's environment, which only sources an
    /// admin chose (or scoped with `artifactCredentials`) may use.
    pub(crate) fn admin_env(&self, key: &str) -> Option<String> {
        if self.own_credentials_only() {
            return None;
        }
        self.env.get(key).map(str::to_owned)
    }
}

impl std::fmt::Debug for SourceOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceOptions")
            .field("params", &self.params)
            .field("secrets", &self.secrets.keys().collect::<Vec<_>>())
            .field("tenant", &self.tenant.is_some())
            .finish()
    }
}

pub use crate::uri::display_uri;

/// Checks a model URI's form without touching the network or disk.
pub fn validate_uri(uri: &str) -> Result<(), String> {
    let unknown = |what: String| format!("{what}; accepted forms: {ACCEPTED_FORMS}");
    match uri.split_once("://") {
        Some(("file", _)) => file::parse(uri).map(|_| ()),
        Some(("s3", _)) => s3::parse(uri).map(|_| ()),
        Some(("http" | "https", _)) => http::parse(uri).map(|_| ()),
        Some(("oci", _)) => oci::parse(uri).map(|_| ()),
        Some(("hf", _)) => hf::parse(uri).map(|_| ()),
        Some(("model-registry", _)) => registry::parse(uri).map(|_| ()),
        Some(("pvc", _)) => crate::uri::parse_pvc_uri(uri).map(|_| ()),
        Some((scheme, _)) => Err(unknown(format!("scheme {scheme:?} is not supported"))),
        None => Err(unknown(format!("{uri:?} is not a model URI"))),
    }
}

/// The source for a model URI. A `model-registry://` URI is resolved to its
/// artifact's own URI first, so a registry version and a direct URI to the
/// same artifact share one cached copy; that answer is pulled within the
/// class's bounds, as a tenant's URI is (`Tenant::registry_answer`).
pub async fn open(uri: &str, opts: &SourceOptions) -> Result<Arc<dyn Source>> {
    validate_uri(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    let scheme = uri.split_once("://").map(|(s, _)| s).unwrap_or_default();
    let mut opts = opts.clone();
    let uri = if scheme == "model-registry" {
        let (artifact, registry) = registry::resolve_artifact_uri(uri, &opts)
            .await
            .map_err(|e| explain(&opts, e))?;
        validate_uri(&artifact).map_err(|m| {
            Error::invalid(
                "parameters.source",
                format!(
                    "the model registry answered with {}: {m}",
                    display_uri(&artifact)
                ),
            )
        })?;
        match &opts.tenant {
            Some(t) => t.recheck("the model registry's artifact URI", &artifact)?,
            None => {
                let scope = Tenant::registry_answer(
                    &artifact,
                    &registry,
                    &opts.params,
                    &opts.bounds,
                    &opts.env,
                )
                .await?;
                if !scope.credentials {
                    opts.secrets.clear();
                }
                opts.tenant = Some(scope);
            }
        }
        artifact
    } else {
        uri.to_string()
    };
    let uri = uri.as_str();
    let limits = class_limits(&opts.params)?;
    let scheme = uri.split_once("://").map(|(s, _)| s);
    if opts.tenant.is_none() && matches!(scheme, Some("s3" | "oci")) {
        opts.admin_guard = Some(Arc::new(egress::Guard::new(egress::Policy::admin()).await?));
    }
    let opts = &opts;
    let source: Arc<dyn Source> = match scheme {
        Some("file") => {
            let src = file::FileSource::new(uri)?;
            match opts.tenant.as_ref().and_then(|t| t.allowed.file_root(uri)) {
                Some(dir) => Arc::new(src.beneath(dir)),
                None => Arc::new(src),
            }
        }
        Some("s3") => Arc::new(s3::new(uri, opts)?),
        Some("http" | "https") => Arc::new(http::HttpSource::new(uri, opts)?),
        Some("oci") => Arc::new(oci::OciSource::new(uri, opts)?),
        Some("hf") => Arc::new(hf::HfSource::new(uri, opts)?),
        _ => {
            return Err(Error::invalid(
                "parameters.source",
                format!(
                    "the model registry returned {}, which is not a pullable URI; accepted forms: {ACCEPTED_FORMS}",
                    display_uri(uri)
                ),
            ));
        }
    };
    Ok(Arc::new(Scoped {
        inner: source,
        guard: opts.guard().cloned(),
        limits,
        requester: requester_of(opts),
        tenant: opts.tenant.is_some(),
    }))
}

/// A digest of what a pull presents to its origin: the secrets it was
/// given, and whether the driver's environment credentials go along.
fn requester_of(opts: &SourceOptions) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(if opts.own_credentials_only() {
        &b"own"[..]
    } else {
        &b"with-driver-env"[..]
    });
    for (k, v) in &opts.secrets {
        h.update([0]);
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
    }
    hex::encode(h.finalize())
}

fn explain(opts: &SourceOptions, e: Error) -> Error {
    match opts.guard() {
        Some(g) => g.explain(e),
        None => e,
    }
}

/// A source within what its StorageClass allows: a request the egress
/// guard refused fails with the guard's reason (PermissionDenied, never
/// retried) instead of a proxy error, and the class's limits apply. It
/// owns the pull's guard, whose tasks end when the source is dropped.
struct Scoped {
    inner: Arc<dyn Source>,
    guard: Option<Arc<egress::Guard>>,
    limits: Option<PullLimits>,
    requester: String,
    tenant: bool,
}

impl Scoped {
    fn explain(&self, e: Error) -> Error {
        match &self.guard {
            Some(g) => g.explain(e),
            None => e,
        }
    }
}

#[async_trait::async_trait]
impl Source for Scoped {
    async fn resolve(&self) -> Result<Resolved> {
        self.inner.resolve().await.map_err(|e| self.explain(e))
    }

    async fn read(
        &self,
        file: &source::RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<futures::stream::BoxStream<'static, Result<bytes::Bytes>>> {
        use futures::StreamExt;
        let stream = self
            .inner
            .read(file, offset, len)
            .await
            .map_err(|e| self.explain(e))?;
        let Some(guard) = self.guard.clone() else {
            return Ok(stream);
        };
        // The stream holds the guard too: its tasks carry these bytes.
        Ok(stream.map(move |r| r.map_err(|e| guard.explain(e))).boxed())
    }

    fn ranges(&self) -> bool {
        self.inner.ranges()
    }

    fn content_md5(&self, file: &source::RemoteFile) -> Option<String> {
        self.inner.content_md5(file)
    }

    fn origin_md5(&self, file: &source::RemoteFile) -> Option<String> {
        self.inner.origin_md5(file)
    }

    fn pinned(&self) -> Option<source::Pinned> {
        self.inner.pinned()
    }

    fn tenant_named(&self) -> bool {
        self.tenant
    }

    fn distrust(&self, file: &source::RemoteFile) -> bool {
        self.inner.distrust(file)
    }

    fn key_scope(&self) -> String {
        self.inner.key_scope()
    }

    fn limits(&self) -> Option<PullLimits> {
        self.limits.or_else(|| self.inner.limits())
    }

    fn requester(&self) -> Option<String> {
        Some(self.requester.clone())
    }
}

/// The limits a StorageClass sets, if any; a missing one is the driver's.
pub fn class_limits(
    params: &std::collections::BTreeMap<String, String>,
) -> Result<Option<PullLimits>> {
    let get = |key: &str, what: &str| -> Result<Option<u64>> {
        let Some(v) = params.get(key) else {
            return Ok(None);
        };
        let n = match key {
            PARAM_MAX_MODEL_BYTES => source::parse_size(v),
            _ => v
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{v:?} is not a whole number")),
        }
        .map_err(|m| Error::invalid(format!("parameters.{key}"), m))?;
        if n == 0 {
            return Err(Error::invalid(
                format!("parameters.{key}"),
                format!("must be at least 1 {what}"),
            ));
        }
        Ok(Some(n))
    };
    let bytes = get(PARAM_MAX_MODEL_BYTES, "byte")?;
    let files = get(PARAM_MAX_MODEL_FILES, "file")?;
    if bytes.is_none() && files.is_none() {
        return Ok(None);
    }
    Ok(Some(PullLimits {
        max_bytes: bytes.unwrap_or(u64::MAX),
        max_files: files.unwrap_or(u64::MAX),
    }))
}

/// Unpacks a verified layer blob into the model, within `budget`.
pub fn extract_layer(
    blob: &Path,
    c: Compression,
    dest: &Path,
    budget: &unpack::Budget,
) -> Result<Vec<FileEntry>> {
    unpack::extract(blob, c, dest, budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_uris_carry_no_query_or_user_info() {
        assert_eq!(
            display_uri("https://h/m.safetensors?X-Amz-Signature=secret#sha256=ab"),
            "https://h/m.safetensors#sha256=ab"
        );
        assert_eq!(
            display_uri("https://u:p@h/m.json#manifest"),
            "https://h/m.json#manifest"
        );
        for plain in ["hf://org/m@main", "s3://b/p", "oci://r/m:v1", "not a uri"] {
            assert_eq!(display_uri(plain), plain);
        }
    }

    #[test]
    fn class_limits_lower_and_are_checked() {
        let p = |kv: &[(&str, &str)]| {
            class_limits(
                &kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        assert_eq!(p(&[]).unwrap(), None);
        let l = p(&[
            (PARAM_MAX_MODEL_BYTES, "2Gi"),
            (PARAM_MAX_MODEL_FILES, "10"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.max_bytes, l.max_files), (2 << 30, 10));
        let driver = PullLimits::default();
        assert_eq!(driver.lower(Some(l)), l);
        let only_files = p(&[(PARAM_MAX_MODEL_FILES, "5")]).unwrap();
        assert_eq!(driver.lower(only_files).max_bytes, driver.max_bytes);
        for (k, v) in [
            (PARAM_MAX_MODEL_BYTES, "lots"),
            (PARAM_MAX_MODEL_BYTES, "0"),
            (PARAM_MAX_MODEL_BYTES, "99999999999T"),
            (PARAM_MAX_MODEL_FILES, "1k"),
        ] {
            let e = p(&[(k, v)]).unwrap_err();
            assert!(e.to_string().contains(&format!("parameters.{k}")), "{e}");
        }
    }
}
