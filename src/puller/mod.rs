//! Model sources fetched by the driver itself, sealed into the store under a
//! content-addressed key so every volume of the same model shares one copy.
//!
//! This build implements `file://` (a local tree, for tests and air-gapped
//! nodes). A model is staged in a unique temporary directory beside its
//! final place, hashed as it is copied, fsynced, given its seal, and renamed
//! into place: a half-written model is never visible, and losing a race to
//! another puller is a success.

pub mod file;

use crate::cache::{Root, Seal};
use crate::error::Result;

pub const ACCEPTED_FORMS: &str = "file:///absolute/path";

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

/// Makes sure the model named by `uri` is sealed in `root`; returns its
/// source id and seal.
pub fn ensure(root: &Root, uri: &str) -> Result<(String, Seal)> {
    file::ensure(root, uri)
}
