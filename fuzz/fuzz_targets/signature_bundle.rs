//! `signing`: a model's signature file is the publisher's, or an
//! attacker's. The first byte picks what the rest is: a whole bundle
//! (checked with the fixture's P-256 key, against its CA, or as a sigstore
//! keyless bundle against the public-good trusted root, so that the
//! certificates and log entries in it are parsed and checked) or a
//! statement payload as if its signature had held. Neither may panic; a statement accepted names
//! only paths inside the model, once each, with sha256 digests.
#![no_main]

use libfuzzer_sys::fuzz_target;
use modelcache_csi::signing;

const KEY: &str = include_str!("../../tests/fixtures/signing/p256.pub.pem");
const CA: &str = include_str!("../../tests/fixtures/signing/ca.pem");

/// Sigstore's public-good trusted root, as the crate ships it.
static PUBLIC_GOOD: std::sync::LazyLock<signing::SigstoreRoot> =
    std::sync::LazyLock::new(|| signing::SigstoreRoot::new(None));

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let policy = |trusted| {
        signing::Policy::new(signing::Mode::Required, "model.sig", trusted, "fuzz")
            .expect("fixture")
    };
    let signed = match pick % 4 {
        0 => policy(signing::Trusted::PublicKey(KEY)).verify(&PUBLIC_GOOD, rest),
        1 => policy(signing::Trusted::CertificateChain(CA)).verify(&PUBLIC_GOOD, rest),
        2 => policy(signing::Trusted::Sigstore {
            identity: "release@example.com",
            issuer: "https://issuer.example.com",
        })
        .verify(&PUBLIC_GOOD, rest),
        _ => signing::parse_statement("model.sig", rest),
    };
    let Ok(signed) = signed else {
        return;
    };
    for (path, sha) in &signed.files {
        assert!(
            !path.is_empty()
                && !path.starts_with('/')
                && path
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != ".."),
            "{path:?} accepted"
        );
        assert!(
            sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()),
            "{sha:?}"
        );
    }
    let sealed = signed.files.clone();
    signing::check_files(&signed, "model.sig", &sealed).expect("a statement matches its own files");
});
