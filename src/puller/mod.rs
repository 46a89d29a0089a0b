//! Model sources fetched by the driver itself, sealed into the store under a
//! content-addressed key so every volume of the same model shares one copy.
//!
//! `source.rs` is the contract every scheme implements; `engine.rs` does the
//! downloading (parallel ranges, streaming sha256, resume after a crash,
//! retries, stall watchdog) and the sealing; each scheme module only
//! resolves a URI and serves byte ranges. Nothing here logs or stores a
//! credential.

pub mod engine;
pub mod file;
pub mod oci;
pub mod s3;
pub mod source;
pub mod unpack;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::cache::manifest::FileEntry;
use crate::error::{Error, Result};
use source::{Compression, Source};

pub const ACCEPTED_FORMS: &str = "file:///absolute/path";

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
    match uri.split_once("://") {
        Some(("file", _)) => file::parse(uri).map(|_| ()),
        Some((scheme, _)) => Err(format!(
            "scheme {scheme:?} is not supported; accepted forms: {ACCEPTED_FORMS}"
        )),
        None => Err(format!(
            "{uri:?} is not a model URI; accepted forms: {ACCEPTED_FORMS}"
        )),
    }
}

/// The source for a model URI. Validation errors name the parameter.
pub fn open(uri: &str, _opts: &SourceOptions) -> Result<Arc<dyn Source>> {
    validate_uri(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    match uri.split_once("://").map(|(s, _)| s) {
        Some("file") => Ok(Arc::new(file::FileSource::new(uri)?)),
        _ => Err(Error::invalid(
            "parameters.source",
            format!("accepted forms: {ACCEPTED_FORMS}"),
        )),
    }
}

/// Unpacks a verified layer blob into the model.
pub fn extract_layer(_blob: &Path, _c: Compression, _dest: &Path) -> Result<Vec<FileEntry>> {
    Err(Error::Unimplemented(
        "layer unpacking is not available in this build".into(),
    ))
}
