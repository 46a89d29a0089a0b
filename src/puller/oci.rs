//! `oci://registry[:port]/repository:tag` or `...@sha256:<digest>`: a model
//! stored in an OCI registry, as an artifact or as a "modelcar" image.
//!
//! Resolution pulls the manifest (an image index is followed to its
//! linux/amd64 entry, or to its only entry) and lists one `RemoteFile` per
//! layer, decided layer by layer:
//! - a ModelPack layer (`application/vnd.cncf.model.*`) is unpacked at the
//!   model root when its type ends in `.tar`, `.tar+gzip` or `.tar+zstd`,
//!   and is the file named by its `org.opencontainers.image.title`
//!   annotation when it ends in `.raw`;
//! - any other layer with a title annotation is that file, whatever its
//!   media type (ORAS gives plain files the type `...layer.v1.tar`), unless
//!   ORAS marked it `io.deis.oras.content.unpack=true` (a packed directory);
//! - a layer without a title and with a tar media type (OCI, Docker) is
//!   unpacked at the model root, in manifest order: this is how a modelcar
//!   image (a container image with the model under `/models`) is pulled,
//!   whole; a volume then uses `subPath: models`.
//!
//! The cache identity is `oci://registry/repository` (no tag, no digest)
//! plus the revision, the digest of the image manifest whose layers were
//! listed: a tag and the digest it points to share one sealed copy. Blob
//! reads are ranged GETs through oci-client, streamed, never buffered
//! whole. Credentials come only from the `ociUsername`/`ociPassword`
//! secrets and never appear in a URI, an error or a log line.

use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use oci_client::client::{BlobResponse, ClientConfig, ClientProtocol, linux_amd64_resolver};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use super::failure::Failure;
use crate::error::{Error, Result};
use crate::puller::SourceOptions;
use crate::puller::source::{Compression, RemoteFile, Resolved, Source, Unpack};

pub const ACCEPTED_FORM: &str = "oci://registry/repo:tag or oci://registry/repo@sha256:<digest>";

/// StorageClass parameter: "true" talks plain HTTP to the registry.
pub const PARAM_PLAIN_HTTP: &str = "ociPlainHTTP";
pub const SECRET_USERNAME: &str = "ociUsername";
pub const SECRET_PASSWORD: &str = "ociPassword";

const TITLE: &str = "org.opencontainers.image.title";
const ORAS_UNPACK: &str = "io.deis.oras.content.unpack";
const MODELPACK_PREFIX: &str = "application/vnd.cncf.model.";
const EMPTY_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";

/// A parsed `oci://` URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OciUri {
    /// host[:port], lowercase.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`; wins over the tag when both are given.
    pub digest: Option<String>,
}

impl OciUri {
    /// The cache identity: registry and repository, without tag or digest.
    pub fn normalized(&self) -> String {
        format!("oci://{}/{}", self.registry, self.repository)
    }

    fn reference(&self) -> Reference {
        match (&self.digest, &self.tag) {
            (Some(d), _) => {
                Reference::with_digest(self.registry.clone(), self.repository.clone(), d.clone())
            }
            (None, Some(t)) => {
                Reference::with_tag(self.registry.clone(), self.repository.clone(), t.clone())
            }
            (None, None) => unreachable!("parse requires a tag or a digest"),
        }
    }
}

impl std::fmt::Display for OciUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// Checks an `oci://` URI's form without touching the network.
pub fn parse(uri: &str) -> Result<OciUri, String> {
    let rest = uri.strip_prefix("oci://").ok_or_else(|| {
        format!("{uri:?} does not start with oci://; accepted forms: {ACCEPTED_FORM}")
    })?;
    let Some((registry, path)) = rest.split_once('/') else {
        return Err(format!(
            "{uri:?} names no repository; accepted forms: {ACCEPTED_FORM}"
        ));
    };
    if registry.contains('@') {
        // Never echo the URI here: the part before '@' may be a password.
        return Err(format!(
            "an oci:// URI must not carry credentials; put them in the {SECRET_USERNAME} and {SECRET_PASSWORD} secrets; accepted forms: {ACCEPTED_FORM}"
        ));
    }
    let registry_ok = !registry.is_empty()
        && registry
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
    if !registry_ok {
        return Err(format!(
            "{uri:?} has an invalid registry host {registry:?}; accepted forms: {ACCEPTED_FORM}"
        ));
    }
    let (name_tag, digest) = match path.split_once('@') {
        Some((n, d)) => {
            let hex = d.strip_prefix("sha256:").unwrap_or("");
            if hex.len() != 64 || !hex.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')) {
                return Err(format!(
                    "{uri:?} has digest {d:?}; a digest is sha256: followed by 64 lowercase hex digits; accepted forms: {ACCEPTED_FORM}"
                ));
            }
            (n, Some(d.to_string()))
        }
        None => (path, None),
    };
    let (repository, tag) = match name_tag.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
        _ => (name_tag, None),
    };
    let component_ok = |c: &str| {
        !c.is_empty()
            && c.chars()
                .all(|ch| matches!(ch, 'a'..='z' | '0'..='9' | '.' | '_' | '-'))
            && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
            && c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
    };
    if !repository.split('/').all(component_ok) {
        return Err(format!(
            "{uri:?} has an invalid repository {repository:?} (lowercase letters, digits and . _ - between slashes); accepted forms: {ACCEPTED_FORM}"
        ));
    }
    if let Some(t) = &tag {
        let ok = t.len() <= 128
            && t.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !ok {
            return Err(format!(
                "{uri:?} has an invalid tag {t:?}; accepted forms: {ACCEPTED_FORM}"
            ));
        }
    }
    if tag.is_none() && digest.is_none() {
        return Err(format!(
            "{uri:?} names neither a tag nor a digest; accepted forms: {ACCEPTED_FORM}"
        ));
    }
    Ok(OciUri {
        registry: registry.to_ascii_lowercase(),
        repository: repository.to_string(),
        tag,
        digest,
    })
}

pub struct OciSource {
    uri: OciUri,
    reference: Reference,
    client: Client,
    auth: RegistryAuth,
    plain_http: bool,
}

impl std::fmt::Debug for OciSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OciSource")
            .field("uri", &self.uri)
            .finish_non_exhaustive()
    }
}

/// Follows an image index to its linux/amd64 entry, or to its only entry
/// (an artifact index usually names no platform).
fn pick_manifest(entries: &[ImageIndexEntry]) -> Option<String> {
    linux_amd64_resolver(entries).or_else(|| match entries {
        [only] => Some(only.digest.clone()),
        _ => None,
    })
}

impl OciSource {
    pub fn new(uri: &str, opts: &SourceOptions) -> Result<OciSource> {
        let uri = parse(uri).map_err(|m| Error::invalid("source", m))?;
        let plain_http = match opts.params.get(PARAM_PLAIN_HTTP).map(String::as_str) {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(Error::invalid(
                    format!("parameters.{PARAM_PLAIN_HTTP}"),
                    format!("{other:?} is neither \"true\" nor \"false\""),
                ));
            }
        };
        let auth = match (
            opts.secrets.get(SECRET_USERNAME),
            opts.secrets.get(SECRET_PASSWORD),
        ) {
            (Some(u), Some(p)) => RegistryAuth::Basic(u.clone(), p.clone()),
            (None, None) => RegistryAuth::Anonymous,
            _ => {
                return Err(Error::invalid(
                    "secrets",
                    format!("{SECRET_USERNAME} and {SECRET_PASSWORD} must be given together"),
                ));
            }
        };
        let config = ClientConfig {
            protocol: if plain_http {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            platform_resolver: Some(Box::new(pick_manifest)),
            connect_timeout: Some(Duration::from_secs(10)),
            // Per read, not per request: a slow but moving layer is fine;
            // the engine's watchdog handles stalls longer than this.
            read_timeout: Some(Duration::from_secs(60)),
            // A tenant's pull, blob redirects included, goes through the guard.
            https_proxy: opts.proxy().map(str::to_string),
            http_proxy: opts.proxy().map(str::to_string),
            ..ClientConfig::default()
        };
        let client = Client::try_from(config)
            .map_err(|e| Error::Internal(format!("cannot build the OCI client: {e}")))?;
        Ok(OciSource {
            reference: uri.reference(),
            uri,
            client,
            auth,
            plain_http,
        })
    }
}

#[async_trait::async_trait]
impl Source for OciSource {
    /// `@sha256:` pins the manifest, and so every layer.
    fn pinned(&self) -> Option<crate::puller::source::Pinned> {
        self.uri
            .digest
            .as_ref()
            .map(|d| crate::puller::source::Pinned {
                uri: self.uri.normalized(),
                revision: d.clone(),
                files: Default::default(),
            })
    }

    async fn resolve(&self) -> Result<Resolved> {
        let (manifest, digest) = self
            .client
            .pull_image_manifest(&self.reference, &self.auth)
            .await
            .map_err(|e| map_error(&self.uri.to_string(), e))?;
        let files = files_of(&manifest)
            .map_err(|m| Error::Precondition(format!("{} (manifest {digest}): {m}", self.uri)))?;
        Ok(Resolved {
            uri: self.uri.normalized(),
            revision: digest,
            files,
        })
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        if len == Some(0) {
            return Ok(stream::empty().boxed());
        }
        let what = format!("blob {} of {}", file.locator, self.uri.normalized());
        let layer = OciDescriptor {
            digest: file.locator.clone(),
            size: file.size.map_or(0, |s| s as i64),
            media_type: "application/octet-stream".into(),
            ..OciDescriptor::default()
        };
        // Blob requests authenticate only with auth stored for the registry.
        self.client
            .store_auth_if_needed(self.reference.resolve_registry(), &self.auth)
            .await;
        let response = self
            .client
            .pull_blob_stream_partial(&self.reference, &layer, offset, len)
            .await
            .map_err(|e| map_error(&what, e))?;
        let (body, skip) = match response {
            BlobResponse::Partial(s) => (s.stream, 0),
            // The registry ignored the Range header: skip to the offset here.
            BlobResponse::Full(s) => (s.stream, offset),
        };
        Ok(window(body, skip, len, what))
    }

    /// The same registry name over plain http is another server.
    fn key_scope(&self) -> String {
        if self.plain_http {
            "http".into()
        } else {
            String::new()
        }
    }
}

/// Lists a manifest's layers as model files or layers to unpack.
fn files_of(manifest: &OciImageManifest) -> Result<Vec<RemoteFile>, String> {
    let mut files: Vec<RemoteFile> = Vec::new();
    for layer in &manifest.layers {
        if layer.media_type == EMPTY_MEDIA_TYPE {
            continue;
        }
        let digest = &layer.digest;
        let sha256 = digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
            .map(str::to_ascii_lowercase)
            .ok_or_else(|| {
                format!(
                    "layer {digest} is not addressed by a sha256 digest; only sha256 is supported"
                )
            })?;
        let size = u64::try_from(layer.size)
            .map_err(|_| format!("layer {digest} has a negative size {}", layer.size))?;
        let (path, unpack) = match classify(layer)? {
            Layer::File(path) => (path, Unpack::None),
            Layer::Tar(c) => (String::new(), Unpack::Tar(c)),
        };
        if !path.is_empty() && files.iter().any(|f| f.path == path) {
            return Err(format!("two layers are titled {path:?}"));
        }
        files.push(RemoteFile {
            path,
            size: Some(size),
            sha256: Some(sha256),
            locator: digest.clone(),
            unpack,
        });
    }
    Ok(files)
}

enum Layer {
    /// A model file at this path.
    File(String),
    /// A tar layer unpacked at the model root.
    Tar(Compression),
}

fn classify(layer: &OciDescriptor) -> Result<Layer, String> {
    let mt = layer.media_type.as_str();
    let digest = &layer.digest;
    let annotation = |k: &str| layer.annotations.as_ref().and_then(|a| a.get(k));
    let title = annotation(TITLE);
    if mt.starts_with(MODELPACK_PREFIX) {
        if let Some(c) = tar_compression(mt) {
            return Ok(Layer::Tar(c));
        }
        if mt.ends_with(".raw") {
            let t = title.ok_or_else(|| {
                format!("layer {digest} ({mt}) has no {TITLE} annotation naming its file")
            })?;
            return title_path(t, digest).map(Layer::File);
        }
        return Err(format!(
            "layer {digest} has unsupported ModelPack media type {mt}"
        ));
    }
    let oras_dir = annotation(ORAS_UNPACK).is_some_and(|v| v == "true");
    if let Some(t) = title
        && !oras_dir
    {
        return title_path(t, digest).map(Layer::File);
    }
    if let Some(c) = tar_compression(mt) {
        return Ok(Layer::Tar(c));
    }
    Err(format!(
        "layer {digest} has media type {mt}, which is not a tar layer, and no {TITLE} annotation naming its file"
    ))
}

/// The compression of a tar layer media type, or None if it is not one.
fn tar_compression(media_type: &str) -> Option<Compression> {
    let mt = media_type.to_ascii_lowercase();
    if mt.ends_with(".tar") {
        Some(Compression::None)
    } else if mt.ends_with(".tar+gzip") || mt.ends_with(".tar.gzip") {
        Some(Compression::Gzip)
    } else if mt.ends_with(".tar+zstd") || mt.ends_with(".tar.zstd") {
        Some(Compression::Zstd)
    } else {
        None
    }
}

/// A title annotation as a model path: relative, '/'-separated, no '..'.
fn title_path(title: &str, digest: &str) -> Result<String, String> {
    let trimmed = title.trim_start_matches("./");
    let bad = trimmed.is_empty()
        || trimmed.starts_with('/')
        || trimmed.contains('\0')
        || trimmed.split('/').any(|c| matches!(c, "" | "." | ".."));
    if bad {
        return Err(format!(
            "layer {digest} is titled {title:?}, which is not a relative path inside the model"
        ));
    }
    Ok(trimmed.to_string())
}

/// The bytes `[skip, skip + len)` of `body`, with transport errors as
/// `Unavailable`; a body ending before `len` bytes is an error too.
fn window(
    body: BoxStream<'static, std::io::Result<Bytes>>,
    skip: u64,
    len: Option<u64>,
    what: String,
) -> BoxStream<'static, Result<Bytes>> {
    struct State {
        body: BoxStream<'static, std::io::Result<Bytes>>,
        skip: u64,
        left: Option<u64>,
        what: String,
        done: bool,
    }
    let state = State {
        body,
        skip,
        left: len,
        what,
        done: false,
    };
    stream::unfold(state, |mut st| async move {
        loop {
            if st.done || st.left == Some(0) {
                return None;
            }
            let mut chunk = match st.body.next().await {
                Some(Ok(c)) => c,
                Some(Err(e)) => {
                    st.done = true;
                    let err = Error::Transient(format!("reading {}: {e}", st.what));
                    return Some((Err(err), st));
                }
                None => {
                    st.done = true;
                    let left = st.left.unwrap_or(0);
                    if left == 0 && st.skip == 0 {
                        return None;
                    }
                    let err = Error::Transient(format!(
                        "reading {}: the registry ended the blob {} bytes early",
                        st.what,
                        left + st.skip
                    ));
                    return Some((Err(err), st));
                }
            };
            if st.skip > 0 {
                let n = st.skip.min(chunk.len() as u64);
                chunk = chunk.slice(n as usize..);
                st.skip -= n;
            }
            if chunk.is_empty() {
                continue;
            }
            if let Some(left) = st.left.as_mut() {
                if chunk.len() as u64 > *left {
                    chunk.truncate(*left as usize);
                }
                *left -= chunk.len() as u64;
            }
            return Some((Ok(chunk), st));
        }
    })
    .boxed()
}

/// The one mapping from oci-client errors to domain errors. `what` names the
/// object (a URI without credentials, or a blob of one).
fn map_error(what: &str, err: OciDistributionError) -> Failure {
    use OciDistributionError as E;
    let by_status = |code: u16, detail: &str| match code {
        404 => Failure::NotFound(format!("{what} was not found in the registry")),
        401 | 403 => refused(what, code),
        408 | 429 | 500..=599 => Failure::transient(format!(
            "the registry answered HTTP {code} for {what}; {detail}"
        )),
        _ => Failure::Refused(format!(
            "the registry answered HTTP {code} for {what}; {detail}"
        )),
    };
    match err {
        E::UnauthorizedError { .. } => refused(what, 401),
        E::AuthenticationFailure(_) => Failure::Denied(format!(
            "the registry's token service refused the credentials for {what}; check the {SECRET_USERNAME}/{SECRET_PASSWORD} secrets"
        )),
        E::RegistryError { envelope, .. } => {
            let codes = || envelope.errors.iter().map(|e| &e.code);
            let detail = envelope
                .errors
                .iter()
                .map(|e| e.message.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            if codes().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                Failure::NotFound(format!("{what} was not found in the registry ({detail})"))
            } else if codes()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                refused(what, 403)
            } else if codes().any(|c| matches!(c, OciErrorCode::Toomanyrequests)) {
                Failure::transient(format!(
                    "the registry is rate-limiting requests for {what}: {detail}"
                ))
            } else {
                Failure::Refused(format!("the registry refused {what}: {detail}"))
            }
        }
        E::ServerError { code, message, .. } => by_status(code, message.trim()),
        E::RequestError(e) => match e.status() {
            Some(s) => by_status(s.as_u16(), "request failed"),
            None => Failure::transient(format!(
                "cannot reach the registry for {what}: {}",
                chain(&e)
            )),
        },
        E::IoError(e) => Failure::transient(format!("cannot reach the registry for {what}: {e}")),
        E::ImageManifestNotFoundError(_) => Failure::NotFound(format!(
            "{what} is an image index with several entries and none for linux/amd64"
        )),
        E::DigestError(e) => Failure::Corrupt(format!(
            "the registry served {what} with content that does not match its digest: {e}"
        )),
        e @ (E::ManifestParsingError(_)
        | E::VersionedParsingError(_)
        | E::UnsupportedMediaTypeError(_)
        | E::UnsupportedSchemaVersionError(_)
        | E::ManifestEncodingError(_)
        | E::JsonError(_)) => Failure::Refused(format!(
            "{what} is not an OCI image or artifact manifest: {e}"
        )),
        e => Failure::Refused(format!("the registry request for {what} failed: {e}")),
    }
}

fn refused(what: &str, code: u16) -> Failure {
    Failure::Denied(format!(
        "the registry refused access to {what} (HTTP {code}); check the {SECRET_USERNAME}/{SECRET_PASSWORD} secrets"
    ))
}

/// An error and its causes on one line ("error sending request ...:
/// connection refused"); reqwest's own message hides the cause.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let msg = c.to_string();
        if !s.contains(&msg) {
            s.push_str(": ");
            s.push_str(&msg);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn uri_forms() {
        let u = parse("oci://Registry.example:5000/org/model:v1").unwrap();
        assert_eq!(
            (
                u.registry.as_str(),
                u.repository.as_str(),
                u.tag.as_deref(),
                u.digest.as_deref()
            ),
            ("registry.example:5000", "org/model", Some("v1"), None)
        );
        assert_eq!(u.normalized(), "oci://registry.example:5000/org/model");
        let u = parse(&format!("oci://r/m@{D}")).unwrap();
        assert_eq!((u.tag, u.digest.as_deref()), (None, Some(D)));
        let u = parse(&format!("oci://r/m:v2@{D}")).unwrap();
        assert_eq!(u.reference().digest(), Some(D));
        assert_eq!(u.to_string(), format!("oci://r/m:v2@{D}"));

        for bad in [
            "https://r/m:v1",
            "oci://r",
            "oci://r/m",
            "oci://r/Model:v1",
            "oci://r/m:bad/tag",
            "oci://r/m@sha256:abc",
            "oci://r/m@md5:0123",
            "oci:///m:v1",
            "oci://r//m:v1",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(ACCEPTED_FORM), "{bad}: {err}");
        }
        let err = parse("oci://user:hunter2@r/m:v1").unwrap_err();
        assert!(
            !err.contains("hunter2") && err.contains("ociUsername"),
            "{err}"
        );
    }

    #[test]
    fn options() {
        let mut opts = SourceOptions::default();
        opts.params.insert(PARAM_PLAIN_HTTP.into(), "yes".into());
        let err = OciSource::new("oci://r/m:v1", &opts)
            .unwrap_err()
            .to_string();
        assert!(err.contains("parameters.ociPlainHTTP"), "{err}");
        opts.params.insert(PARAM_PLAIN_HTTP.into(), "true".into());
        opts.secrets.insert(SECRET_USERNAME.into(), "u".into());
        let err = OciSource::new("oci://r/m:v1", &opts)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be given together"), "{err}");
        opts.secrets.insert(SECRET_PASSWORD.into(), "p".into());
        assert!(OciSource::new("oci://r/m:v1", &opts).is_ok());
    }

    fn layer(media_type: &str, annotations: &[(&str, &str)]) -> OciDescriptor {
        OciDescriptor {
            media_type: media_type.into(),
            digest: D.into(),
            size: 7,
            annotations: (!annotations.is_empty()).then(|| {
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>()
            }),
            ..OciDescriptor::default()
        }
    }

    fn kind(l: &OciDescriptor) -> Result<(String, Unpack), String> {
        let mut m = OciImageManifest::default();
        m.layers.push(l.clone());
        let f = files_of(&m)?.remove(0);
        assert_eq!(f.locator, D);
        assert_eq!(f.sha256.as_deref(), Some(&D[7..]));
        Ok((f.path, f.unpack))
    }

    #[test]
    fn layer_classification() {
        let file = |p: &str| Ok((p.to_string(), Unpack::None));
        let tar = |c| Ok((String::new(), Unpack::Tar(c)));
        // ORAS files: title wins over the (misleading) default tar type.
        assert_eq!(
            kind(&layer(
                "application/vnd.oci.image.layer.v1.tar",
                &[(TITLE, "config.json")]
            )),
            file("config.json")
        );
        assert_eq!(
            kind(&layer(
                "application/octet-stream",
                &[(TITLE, "./1_Pooling/config.json")]
            )),
            file("1_Pooling/config.json")
        );
        // ORAS directories and image layers unpack at the root.
        assert_eq!(
            kind(&layer(
                "application/vnd.oci.image.layer.v1.tar+gzip",
                &[(TITLE, "dir"), (ORAS_UNPACK, "true")]
            )),
            tar(Compression::Gzip)
        );
        assert_eq!(
            kind(&layer("application/vnd.oci.image.layer.v1.tar", &[])),
            tar(Compression::None)
        );
        assert_eq!(
            kind(&layer("application/vnd.oci.image.layer.v1.tar+zstd", &[])),
            tar(Compression::Zstd)
        );
        assert_eq!(
            kind(&layer(
                "application/vnd.docker.image.rootfs.diff.tar.gzip",
                &[]
            )),
            tar(Compression::Gzip)
        );
        // ModelPack.
        assert_eq!(
            kind(&layer(
                "application/vnd.cncf.model.weight.v1.tar",
                &[(TITLE, "model.safetensors")]
            )),
            tar(Compression::None)
        );
        assert_eq!(
            kind(&layer("application/vnd.cncf.model.doc.v1.tar+gzip", &[])),
            tar(Compression::Gzip)
        );
        assert_eq!(
            kind(&layer(
                "application/vnd.cncf.model.weight.v1.raw",
                &[(TITLE, "w.bin")]
            )),
            file("w.bin")
        );
        // Refusals.
        assert!(
            kind(&layer("application/vnd.cncf.model.weight.v1.raw", &[]))
                .unwrap_err()
                .contains("no org.opencontainers.image.title")
        );
        assert!(
            kind(&layer("application/json", &[]))
                .unwrap_err()
                .contains("not a tar layer")
        );
        assert!(
            kind(&layer("application/json", &[(TITLE, "../x")]))
                .unwrap_err()
                .contains("not a relative path")
        );
        assert!(
            kind(&layer("application/json", &[(TITLE, "/etc/x")]))
                .unwrap_err()
                .contains("not a relative path")
        );
        let mut sha512 = layer("application/vnd.oci.image.layer.v1.tar", &[]);
        sha512.digest = format!("sha512:{}", "a".repeat(128));
        assert!(kind(&sha512).unwrap_err().contains("only sha256"));
        // The empty descriptor some artifacts carry is skipped.
        let mut m = OciImageManifest::default();
        m.layers.push(layer(EMPTY_MEDIA_TYPE, &[]));
        assert!(files_of(&m).unwrap().is_empty());
        // Two files of the same name.
        m.layers = vec![layer("x/y", &[(TITLE, "a")]), layer("x/y", &[(TITLE, "a")])];
        assert!(
            files_of(&m)
                .unwrap_err()
                .contains("two layers are titled \"a\"")
        );
    }

    #[test]
    fn platform_choice() {
        let entry = |digest: &str, arch: &str| {
            serde_json::from_value::<ImageIndexEntry>(serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": digest, "size": 1,
                "platform": {"architecture": arch, "os": "linux"}
            }))
            .unwrap()
        };
        let both = [entry("sha256:arm", "arm64"), entry("sha256:amd", "amd64")];
        assert_eq!(pick_manifest(&both).as_deref(), Some("sha256:amd"));
        assert_eq!(pick_manifest(&both[..1]).as_deref(), Some("sha256:arm"));
        assert_eq!(pick_manifest(&[both[0].clone(), both[0].clone()]), None);
    }

    #[test]
    fn error_mapping() {
        use OciDistributionError as E;
        let server = |code: u16| E::ServerError {
            code,
            url: "http://r/v2/m/manifests/v1".into(),
            message: "body".into(),
        };
        assert!(matches!(map_error("x", server(404)), Failure::NotFound(_)));
        assert!(matches!(map_error("x", server(401)), Failure::Denied(_)));
        assert!(matches!(map_error("x", server(403)), Failure::Denied(_)));
        assert!(matches!(
            map_error("x", server(503)),
            Failure::Transient { after: None, .. }
        ));
        assert!(matches!(
            map_error("x", server(429)),
            Failure::Transient { after: None, .. }
        ));
        let unauthorized = E::UnauthorizedError { url: "u".into() };
        let msg = map_error("oci://r/m", unauthorized).to_string();
        assert!(
            msg.contains("HTTP 401") && msg.contains("ociUsername"),
            "{msg}"
        );
        let envelope: oci_client::errors::OciEnvelope = serde_json::from_str(
            r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#,
        )
        .unwrap();
        let e = E::RegistryError {
            envelope,
            url: "u".into(),
        };
        assert!(matches!(map_error("x", e), Failure::NotFound(_)));
        let envelope: oci_client::errors::OciEnvelope =
            serde_json::from_str(r#"{"errors":[{"code":"DENIED","message":"no"}]}"#).unwrap();
        let e = E::RegistryError {
            envelope,
            url: "u".into(),
        };
        assert!(matches!(map_error("x", e), Failure::Denied(_)));
        let e = E::IoError(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(
            map_error("x", e),
            Failure::Transient { after: None, .. }
        ));
    }

    #[tokio::test]
    async fn window_skips_truncates_and_reports_short_bodies() {
        let body = || {
            stream::iter(vec![
                Ok(Bytes::from_static(b"0123")),
                Ok(Bytes::from_static(b"4567")),
                Ok(Bytes::from_static(b"89")),
            ])
            .boxed()
        };
        let collect = |s: BoxStream<'static, Result<Bytes>>| async move {
            let parts: Vec<Result<Bytes>> = s.collect().await;
            let mut out = Vec::new();
            for p in parts {
                out.extend_from_slice(&p?);
            }
            Ok::<_, Error>(out)
        };
        assert_eq!(
            collect(window(body(), 0, None, "b".into())).await.unwrap(),
            b"0123456789"
        );
        assert_eq!(
            collect(window(body(), 5, Some(3), "b".into()))
                .await
                .unwrap(),
            b"567"
        );
        assert_eq!(
            collect(window(body(), 3, None, "b".into())).await.unwrap(),
            b"3456789"
        );
        let err = collect(window(body(), 8, Some(5), "b".into()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Transient(_)) && err.to_string().contains("3 bytes early"),
            "{err}"
        );
    }
}
