//! Every model-URI parser on one string: `puller::validate_uri` (which
//! dispatches by scheme), each scheme's own parser, and `pvc://` claims.
//! Besides "never panics", the properties the driver relies on: the
//! dispatcher agrees with the scheme's parser, nothing accepted climbs out
//! with a `..`, and a canonical (cache-key) form parses back to itself.
#![no_main]

use std::path::Component;

use libfuzzer_sys::fuzz_target;
use modelcache_csi::mount::subpath::validate_syntax;
use modelcache_csi::puller::{file, hf, http, oci, registry, s3, validate_uri};
use modelcache_csi::uri::parse_pvc_uri;

fuzz_target!(|data: &[u8]| {
    let Ok(uri) = std::str::from_utf8(data) else {
        return;
    };
    let valid = validate_uri(uri).is_ok();

    let s3 = s3::parse(uri);
    if let Ok(u) = &s3 {
        assert!(
            !u.prefix.starts_with('/') && !u.prefix.ends_with('/'),
            "{u:?}"
        );
        assert!(
            u.prefix.is_empty()
                || u.prefix
                    .split('/')
                    .all(|s| !s.is_empty() && s != "." && s != ".."),
            "{u:?}"
        );
        assert_eq!(
            s3::parse(&u.normalized()).as_ref(),
            Ok(u),
            "{uri:?} is not canonical"
        );
    }

    let http = http::parse(uri);
    if let Ok(u) = &http {
        assert!(matches!(u.url.scheme(), "http" | "https") && u.url.host_str().is_some());
        assert!(
            u.url.username().is_empty() && u.url.password().is_none(),
            "{uri:?}"
        );
        assert!(u.url.fragment().is_none());
        if let http::Target::File { name, .. } = &u.target {
            assert!(!name.is_empty() && name != "." && name != ".." && !name.contains('/'));
        }
    }

    let oci = oci::parse(uri);
    if let Ok(u) = &oci {
        assert!(u.tag.is_some() || u.digest.is_some());
        assert!(!u.registry.contains('@') && !u.repository.split('/').any(|c| c == ".."));
        assert_eq!(
            oci::parse(&u.to_string()).as_ref(),
            Ok(u),
            "{uri:?} is not canonical"
        );
    }

    let hf = hf::parse(uri);
    if let Ok(u) = &hf {
        assert!(
            u.repo
                .split('/')
                .all(|p| !p.is_empty() && p != "." && p != ".."),
            "{u:?}"
        );
        assert!(!u.revision.is_empty());
    }

    let reg = registry::parse(uri);
    if let Ok(u) = &reg {
        assert!((1..=3).contains(&u.segments.len()) && u.segments.iter().all(|s| !s.is_empty()));
    }

    let file = file::parse(uri);
    if let Ok(p) = &file {
        assert!(
            p.is_absolute() && !p.components().any(|c| c == Component::ParentDir),
            "{p:?}"
        );
    }

    let pvc = parse_pvc_uri(uri);
    if let Ok(p) = &pvc {
        assert!(!p.claim.is_empty());
        if let Some(path) = &p.path {
            assert_eq!(validate_syntax(path), Ok(()), "{uri:?}");
        }
    }

    // The dispatcher accepts exactly what its scheme's parser accepts.
    let by_scheme = match uri.split_once("://").map(|(s, _)| s) {
        Some("s3") => s3.is_ok(),
        Some("http" | "https") => http.is_ok(),
        Some("oci") => oci.is_ok(),
        Some("hf") => hf.is_ok(),
        Some("model-registry") => reg.is_ok(),
        Some("file") => file.is_ok(),
        Some("pvc") => pvc.is_ok(),
        _ => false,
    };
    assert_eq!(valid, by_scheme, "{uri:?}");
});
