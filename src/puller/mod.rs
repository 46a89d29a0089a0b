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
pub mod file;
pub mod hf;
pub mod http;
pub mod oci;
pub mod registry;
pub mod s3;
pub mod source;
pub mod unpack;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::cache::manifest::FileEntry;
use crate::error::{Error, Result};
use source::{Compression, Source};

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
}

impl std::fmt::Debug for SourceOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceOptions")
            .field("params", &self.params)
            .field("secrets", &self.secrets.keys().collect::<Vec<_>>())
            .finish()
    }
}

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
        Some(("pvc", _)) => crate::kubeapi::parse_pvc_uri(uri).map(|_| ()),
        Some((scheme, _)) => Err(unknown(format!("scheme {scheme:?} is not supported"))),
        None => Err(unknown(format!("{uri:?} is not a model URI"))),
    }
}

/// The source for a model URI. A `model-registry://` URI is resolved to its
/// artifact's own URI first, so a registry version and a direct URI to the
/// same artifact share one cached copy.
pub async fn open(uri: &str, opts: &SourceOptions) -> Result<Arc<dyn Source>> {
    validate_uri(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    let scheme = uri.split_once("://").map(|(s, _)| s).unwrap_or_default();
    let uri = if scheme == "model-registry" {
        registry::resolve_artifact_uri(uri, opts).await?
    } else {
        uri.to_string()
    };
    let uri = uri.as_str();
    Ok(match uri.split_once("://").map(|(s, _)| s) {
        Some("file") => Arc::new(file::FileSource::new(uri)?),
        Some("s3") => Arc::new(s3::new(uri, opts)?),
        Some("http" | "https") => Arc::new(http::HttpSource::new(uri, opts)?),
        Some("oci") => Arc::new(oci::OciSource::new(uri, opts)?),
        Some("hf") => Arc::new(hf::HfSource::new(uri, opts)?),
        _ => {
            return Err(Error::invalid(
                "parameters.source",
                format!(
                    "the model registry returned {uri:?}, which is not a pullable URI; accepted forms: {ACCEPTED_FORMS}"
                ),
            ));
        }
    })
}

/// Unpacks a verified layer blob into the model.
pub fn extract_layer(blob: &Path, c: Compression, dest: &Path) -> Result<Vec<FileEntry>> {
    unpack::extract(blob, c, dest)
}
