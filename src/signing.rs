//! Model signatures: an OpenSSF model-signing bundle (`model.sig`, made by
//! `model_signing sign key`) checked against a public key, and its signed
//! file list against exactly the files a seal holds.
//!
//! The bundle is a sigstore bundle whose DSSE envelope carries an in-toto
//! statement; its predicate lists every file of the model with its sha256
//! (serialization method `files`). Verifying means: the envelope's
//! signature is the key's over DSSE's pre-authentication encoding of the
//! payload, and the statement names the same set of paths with the same
//! digests as the seal, less the paths the statement itself says it
//! ignores. Only key signatures on P-256 and P-384 (the curves
//! `model_signing sign key` accepts besides P-521) are verified here;
//! anything else is refused by name, never skipped.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// A signature file larger than this is refused before it is parsed: a
/// statement lists a path and a digest per file (about 150 bytes), so
/// this bounds a model at about 100,000 files.
pub const MAX_SIGNATURE_BYTES: usize = 16 << 20;

const BUNDLE_MEDIA_PREFIX: &str = "application/vnd.dev.sigstore.bundle";
const IN_TOTO: &str = "application/vnd.in-toto+json";
const STATEMENT_V1: &str = "https://in-toto.io/Statement/v1";
const MODEL_SIGNING_V1: &str = "https://model_signing/signature/v1.0";

/// What a verified signature says: who signed, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signed {
    /// `sha256:<hex>` of the signing key's SubjectPublicKeyInfo (DER).
    pub signer: String,
    /// Every signed file: path -> sha256 (lowercase hex).
    pub files: BTreeMap<String, String>,
    /// Paths (and the trees under them) the signer left out on purpose.
    pub ignored: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bundle {
    media_type: String,
    dsse_envelope: Envelope,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    payload: String,
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Deserialize)]
struct EnvelopeSignature {
    sig: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Statement {
    #[serde(rename = "_type")]
    kind: String,
    predicate_type: String,
    predicate: Predicate,
}

#[derive(Deserialize)]
struct Predicate {
    resources: Vec<Resource>,
    serialization: Serialization,
}

#[derive(Deserialize)]
struct Resource {
    name: String,
    algorithm: String,
    digest: String,
}

#[derive(Deserialize)]
struct Serialization {
    method: String,
    #[serde(default)]
    hash_type: Option<String>,
    #[serde(default)]
    ignore_paths: Vec<String>,
}

fn refused(file: &str, why: impl std::fmt::Display) -> Error {
    Error::Precondition(format!("signature {file}: {why}"))
}

/// DSSE's pre-authentication encoding: what the signature covers.
fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {} {} ",
        payload_type.len(),
        payload_type,
        payload.len()
    )
    .into_bytes();
    out.extend_from_slice(payload);
    out
}

/// A public key in PEM, on a curve this module verifies.
enum Key {
    P256(p256::ecdsa::VerifyingKey),
    P384(p384::ecdsa::VerifyingKey),
}

impl Key {
    fn parse(pem: &str) -> Result<(Key, String)> {
        use p256::pkcs8::DecodePublicKey;
        use p256::pkcs8::EncodePublicKey;
        let bad = |why: String| {
            Error::invalid(
                "parameters.signaturePublicKey",
                format!(
                    "{why}; give a PEM public key (P-256 or P-384) as `openssl ec -pubout` writes it"
                ),
            )
        };
        let (key, der) = if let Ok(k) = p256::ecdsa::VerifyingKey::from_public_key_pem(pem) {
            let der = k.to_public_key_der().map_err(|e| bad(e.to_string()))?;
            (Key::P256(k), der)
        } else if let Ok(k) = p384::ecdsa::VerifyingKey::from_public_key_pem(pem) {
            let der = k.to_public_key_der().map_err(|e| bad(e.to_string()))?;
            (Key::P384(k), der)
        } else {
            return Err(bad("not a P-256 or P-384 public key".into()));
        };
        let fingerprint = format!("sha256:{}", hex::encode(Sha256::digest(der.as_bytes())));
        Ok((key, fingerprint))
    }

    /// Whether `sig` (DER, as model_signing writes it) is this key's over
    /// `msg`, hashed as model_signing hashes for the curve.
    fn verifies(&self, msg: &[u8], sig: &[u8]) -> bool {
        use p256::ecdsa::signature::Verifier;
        match self {
            Key::P256(k) => {
                p256::ecdsa::DerSignature::from_bytes(sig).is_ok_and(|s| k.verify(msg, &s).is_ok())
            }
            Key::P384(k) => {
                p384::ecdsa::DerSignature::from_bytes(sig).is_ok_and(|s| k.verify(msg, &s).is_ok())
            }
        }
    }
}

/// Verifies the bundle `bytes` (read from `file`) with `public_key_pem`,
/// and returns what it signs.
pub fn verify_with_key(file: &str, bytes: &[u8], public_key_pem: &str) -> Result<Signed> {
    let (key, signer) = Key::parse(public_key_pem)?;
    if bytes.len() > MAX_SIGNATURE_BYTES {
        return Err(refused(
            file,
            format_args!(
                "is {} bytes, over the {MAX_SIGNATURE_BYTES} a signature may be",
                bytes.len()
            ),
        ));
    }
    let bundle: Bundle = serde_json::from_slice(bytes).map_err(|e| {
        refused(
            file,
            format_args!("is not a model-signing bundle (sigstore bundle JSON): {e}"),
        )
    })?;
    if !bundle.media_type.starts_with(BUNDLE_MEDIA_PREFIX) {
        return Err(refused(
            file,
            format_args!(
                "has media type {:?}, not a sigstore bundle",
                bundle.media_type
            ),
        ));
    }
    let env = bundle.dsse_envelope;
    if env.payload_type != IN_TOTO {
        return Err(refused(
            file,
            format_args!(
                "signs a {:?} payload, not an in-toto statement",
                env.payload_type
            ),
        ));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let payload = b64
        .decode(env.payload.as_bytes())
        .map_err(|e| refused(file, format_args!("its payload is not base64: {e}")))?;
    let signed_by_key = env.signatures.iter().any(|s| {
        b64.decode(s.sig.as_bytes())
            .is_ok_and(|sig| key.verifies(&pae(&env.payload_type, &payload), &sig))
    });
    if !signed_by_key {
        return Err(refused(
            file,
            format_args!(
                "is not signed by the class's key ({signer}), or its payload was changed after signing"
            ),
        ));
    }
    // Only a signed payload is parsed further: what it says is now the
    // signer's word, not an attacker's.
    let mut signed = parse_statement(file, &payload)?;
    signed.signer = signer;
    Ok(signed)
}

/// The files an in-toto statement signs (a payload already verified),
/// with no signer named yet.
pub fn parse_statement(file: &str, payload: &[u8]) -> Result<Signed> {
    let statement: Statement = serde_json::from_slice(payload).map_err(|e| {
        refused(
            file,
            format_args!("its statement is not a model-signing statement: {e}"),
        )
    })?;
    statement_files(file, statement)
}

fn statement_files(file: &str, s: Statement) -> Result<Signed> {
    if s.kind != STATEMENT_V1 || s.predicate_type != MODEL_SIGNING_V1 {
        return Err(refused(
            file,
            format_args!(
                "signs a {:?} statement of predicate {:?}; supported: {STATEMENT_V1} with {MODEL_SIGNING_V1}",
                s.kind, s.predicate_type
            ),
        ));
    }
    let ser = s.predicate.serialization;
    if ser.method != "files" {
        return Err(refused(
            file,
            format_args!(
                "uses serialization method {:?}; only \"files\" (a sha256 per file, model_signing's default) is supported: sign again without --use_shards",
                ser.method
            ),
        ));
    }
    if ser.hash_type.as_deref().is_some_and(|h| h != "sha256") {
        return Err(refused(
            file,
            format_args!("hashes with {:?}; only sha256 is supported", ser.hash_type),
        ));
    }
    let mut files = BTreeMap::new();
    for r in s.predicate.resources {
        if r.algorithm != "sha256"
            || r.digest.len() != 64
            || !r.digest.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(refused(
                file,
                format_args!("lists {:?} with a digest that is not a sha256", r.name),
            ));
        }
        if r.name.is_empty()
            || r.name.starts_with('/')
            || r.name
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(refused(
                file,
                format_args!("lists {:?}, which is not a path inside the model", r.name),
            ));
        }
        if files
            .insert(r.name.clone(), r.digest.to_ascii_lowercase())
            .is_some()
        {
            return Err(refused(file, format_args!("lists {:?} twice", r.name)));
        }
    }
    Ok(Signed {
        signer: String::new(),
        files,
        ignored: ser.ignore_paths,
    })
}

/// Whether `path` is one the signer ignored (the path itself or a tree
/// under it), or the signature file itself.
fn ignored(signed: &Signed, file: &str, path: &str) -> bool {
    path == file
        || signed.ignored.iter().any(|i| {
            path == i
                || path
                    .strip_prefix(i.as_str())
                    .is_some_and(|r| r.starts_with('/'))
        })
}

/// The sealed files (path -> sha256) are exactly the signed ones: the same
/// paths, each with the same digest, less what the signer ignored.
pub fn check_files(signed: &Signed, file: &str, sealed: &BTreeMap<String, String>) -> Result<()> {
    for (path, sha) in sealed.iter().filter(|(p, _)| !ignored(signed, file, p)) {
        match signed.files.get(path) {
            None => {
                return Err(refused(
                    file,
                    format_args!(
                        "does not sign {path:?}, which the model holds (added after signing?)"
                    ),
                ));
            }
            Some(want) if !want.eq_ignore_ascii_case(sha) => {
                return Err(refused(
                    file,
                    format_args!(
                        "signs {path:?} with sha256 {want}, the model's is {sha} (changed after signing?)"
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    if let Some(path) = signed.files.keys().find(|p| !sealed.contains_key(*p)) {
        return Err(refused(
            file,
            format_args!("signs {path:?}, which the model does not hold (removed after signing?)"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made by the real CLI (model-signing 1.1.1): `model_signing sign key
    // tests/fixtures/signing/model --private_key K --signature S`, with
    // P-256 and P-384 keys from `openssl ecparam -genkey`.
    const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/signing");

    fn read(name: &str) -> Vec<u8> {
        std::fs::read(format!("{DIR}/{name}")).unwrap()
    }

    fn pem(name: &str) -> String {
        String::from_utf8(read(name)).unwrap()
    }

    fn sealed() -> BTreeMap<String, String> {
        ["a.txt", "sub/w.bin"]
            .into_iter()
            .map(|p| {
                let sha = hex::encode(Sha256::digest(read(&format!("model/{p}"))));
                (p.to_string(), sha)
            })
            .collect()
    }

    fn refusal(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::Precondition(m)) => m,
            other => panic!("not refused as a precondition: {other:?}"),
        }
    }

    #[test]
    fn signatures_by_the_cli_verify_and_match_the_files() {
        for curve in ["p256", "p384"] {
            let signed = verify_with_key(
                "model.sig",
                &read(&format!("{curve}.sig")),
                &pem(&format!("{curve}.pub.pem")),
            )
            .unwrap_or_else(|e| panic!("{curve}: {e}"));
            assert!(signed.signer.starts_with("sha256:") && signed.signer.len() == 71);
            assert_eq!(signed.files, sealed(), "{curve}");
            check_files(&signed, "model.sig", &sealed()).unwrap();
            // The signature file itself and ignored paths are not the model's.
            let mut with_sig = sealed();
            with_sig.insert("model.sig".into(), "0".repeat(64));
            with_sig.insert(".git/HEAD".into(), "1".repeat(64));
            check_files(&signed, "model.sig", &with_sig).unwrap();
        }
    }

    #[test]
    fn another_key_an_edited_payload_and_changed_files_are_refused() {
        let sig = read("p256.sig");
        let m = refusal(verify_with_key("model.sig", &sig, &pem("other.pub.pem")));
        assert!(m.contains("not signed by the class's key"), "{m}");
        let m = refusal(verify_with_key("model.sig", &sig, &pem("p384.pub.pem")));
        assert!(m.contains("not signed"), "{m}");

        // The payload says another digest for a.txt: its signature no
        // longer holds.
        let mut bundle: serde_json::Value = serde_json::from_slice(&sig).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        let payload = b64
            .decode(bundle["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap();
        let sha_a = &sealed()["a.txt"];
        let edited = String::from_utf8(payload)
            .unwrap()
            .replace(sha_a, &"0".repeat(64));
        bundle["dsseEnvelope"]["payload"] = b64.encode(edited).into();
        let m = refusal(verify_with_key(
            "model.sig",
            &serde_json::to_vec(&bundle).unwrap(),
            &pem("p256.pub.pem"),
        ));
        assert!(m.contains("payload was changed"), "{m}");

        let signed = verify_with_key("model.sig", &sig, &pem("p256.pub.pem")).unwrap();
        let mut changed = sealed();
        changed.insert("a.txt".into(), "f".repeat(64));
        let m = refusal(check_files(&signed, "model.sig", &changed));
        assert!(
            m.contains("\"a.txt\"") && m.contains("changed after signing"),
            "{m}"
        );
        let mut added = sealed();
        added.insert("evil.pkl".into(), "e".repeat(64));
        let m = refusal(check_files(&signed, "model.sig", &added));
        assert!(
            m.contains("\"evil.pkl\"") && m.contains("added after signing"),
            "{m}"
        );
        let mut removed = sealed();
        removed.remove("sub/w.bin");
        let m = refusal(check_files(&signed, "model.sig", &removed));
        assert!(m.contains("\"sub/w.bin\"") && m.contains("removed"), "{m}");
    }

    #[test]
    fn hostile_files_get_clear_errors() {
        let key = pem("p256.pub.pem");
        for (bytes, want) in [
            (b"not json".to_vec(), "not a model-signing bundle"),
            (b"[]".to_vec(), "not a model-signing bundle"),
            (
                br#"{"mediaType": 7, "dsseEnvelope": {}}"#.to_vec(),
                "not a model-signing bundle",
            ),
            (
                br#"{"mediaType": "text/plain", "dsseEnvelope": {"payload": "", "payloadType": "x", "signatures": []}}"#.to_vec(),
                "not a sigstore bundle",
            ),
            (
                br#"{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json", "dsseEnvelope": {"payload": "!!", "payloadType": "application/vnd.in-toto+json", "signatures": []}}"#.to_vec(),
                "not base64",
            ),
            (
                format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
                "not a model-signing bundle",
            ),
            (vec![b' '; MAX_SIGNATURE_BYTES + 1], "over the"),
        ] {
            let m = refusal(verify_with_key("model.sig", &bytes, &key));
            assert!(m.contains(want), "{want}: {m}");
        }
        let bad_key = verify_with_key("model.sig", &read("p256.sig"), "not a key");
        assert!(
            matches!(bad_key, Err(Error::Invalid { ref field, .. }) if field == "parameters.signaturePublicKey"),
            "{bad_key:?}"
        );
    }

    #[test]
    fn statements_the_driver_cannot_check_are_refused_by_name() {
        let statement = |method: &str, name: &str| -> Statement {
            serde_json::from_value(serde_json::json!({
                "_type": STATEMENT_V1,
                "predicateType": MODEL_SIGNING_V1,
                "predicate": {
                    "resources": [{"name": name, "algorithm": "sha256", "digest": "a".repeat(64)}],
                    "serialization": {"method": method, "hash_type": "sha256"}
                }
            }))
            .unwrap()
        };
        let m = refusal(statement_files("model.sig", statement("shards", "a")));
        assert!(
            m.contains("\"shards\"") && m.contains("only \"files\""),
            "{m}"
        );
        for name in ["../etc/passwd", "/abs", "a//b", ""] {
            let m = refusal(statement_files("model.sig", statement("files", name)));
            assert!(m.contains("not a path inside the model"), "{name:?}: {m}");
        }
    }
}
