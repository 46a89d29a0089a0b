//! `controller::params::Params::parse` and `parse_mutable`: a StorageClass's
//! and a VolumeAttributesClass's parameters, as CreateVolume and
//! ControllerModifyVolume receive them. The input is text, one `key=value`
//! a line, the class's parameters, then a line `--`, then the mutable ones;
//! the seeds (fuzz/corpus/storage_class_params) name every known key, and
//! the mutator splices them. An accepted map yields checked values; a
//! refused one is always InvalidArgument naming the key's field; the answer
//! does not depend on the map's iteration order.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use modelcache_csi::cache::{Backend, Role};
use modelcache_csi::error::Error;
use modelcache_csi::provision::params::{self, Params, parse_mutable};

/// The keys a StorageClass may set, besides `params::SOURCE_OPTIONS` and
/// csi.storage.k8s.io/ ones.
const CLASS_KEYS: [&str; 17] = [
    params::BACKEND,
    params::PROGRESSIVE,
    params::MODEL_SIGNATURE,
    params::SIGNATURE_PUBLIC_KEY,
    params::SIGNATURE_CERTIFICATE_CHAIN,
    params::SIGNATURE_FILE,
    params::SIGNATURE_IDENTITY,
    params::SIGNATURE_ISSUER,
    params::ROLE,
    params::SHARED_PATH,
    params::IMAGE_LOCATION,
    params::SUB_PATH,
    params::VERIFY,
    params::SOURCE,
    params::ALLOW_CROSS_NAMESPACE,
    params::ALLOWED_SOURCES,
    params::ARTIFACT_CREDENTIALS,
];

fn known(key: &str) -> bool {
    CLASS_KEYS.contains(&key)
        || params::SOURCE_OPTIONS.contains(&key)
        || key.starts_with("csi.storage.k8s.io/")
}

fn entries(lines: &str) -> HashMap<String, String> {
    lines
        .lines()
        .map(|l| l.split_once('=').unwrap_or((l, "")))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn invalid_field(e: &Error) -> &str {
    match e {
        Error::Invalid { field, .. } => field,
        other => panic!("a parameter error must be InvalidArgument, got {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (class, mutable) = text.split_once("\n--\n").unwrap_or((text, ""));
    let map = entries(class);
    let parsed = Params::parse(&map);
    // Same entries in a new map: another hasher seed, another order.
    let again = Params::parse(&map.clone().into_iter().collect());
    match (&parsed, &again) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("the verdict depends on the order of {map:?}"),
    }
    match &parsed {
        Ok(p) => {
            if let Some(s) = &p.source {
                assert_eq!(modelcache_csi::puller::validate_uri(s), Ok(()));
            }
            if let Some(path) = &p.shared_path {
                assert!(path.is_absolute(), "{path:?}");
            }
            if let Some(sub) = &p.sub_path {
                assert_eq!(modelcache_csi::mount::subpath::validate_syntax(sub), Ok(()));
            }
            if p.image_location.is_some() {
                assert_eq!(p.backend, Some(Backend::Xfs));
            }
            if p.role == Some(Role::Source) {
                assert!(p.source.is_none() && p.sub_path.is_none() && p.verify.is_none());
                assert!(p.allowed_sources.is_none() && p.source_options.is_empty());
                assert!(p.artifact_credentials.is_none());
                assert!(p.progressive.is_none() && p.signature.is_none());
            }
            if p.progressive == Some(true) {
                assert!(p.backend.is_none_or(|b| b == Backend::Local));
                assert!(p.signature.is_none());
            }
            for k in map.keys() {
                assert!(known(k), "unknown key {k:?} accepted");
            }
            // Limits were checked when the class was.
            assert!(modelcache_csi::puller::class_limits(&p.source_options).is_ok());
        }
        Err(e) => assert!(invalid_field(e).starts_with("parameters."), "{e}"),
    }

    let map = entries(mutable);
    match parse_mutable(&map) {
        Ok(m) => {
            assert!(
                map.keys()
                    .all(|k| k == params::SEALED || k == params::PINNED)
            );
            assert_eq!(m.sealed.is_some(), map.contains_key(params::SEALED));
            assert_eq!(m.pinned.is_some(), map.contains_key(params::PINNED));
        }
        Err(e) => assert!(invalid_field(&e).starts_with("mutable_parameters."), "{e}"),
    }
});
