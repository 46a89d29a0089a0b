//! Model signatures: an OpenSSF model-signing bundle (`model.sig`, made
//! by `model_signing sign key` or `sign certificate`) checked against a
//! class's policy, and its signed file list against exactly the files a
//! seal holds.
//!
//! The bundle is a sigstore bundle whose DSSE envelope carries an in-toto
//! statement; its predicate lists every file of the model with its sha256
//! (serialization method `files`). Verifying means: the envelope's
//! signature is the trusted key's (the class's public key, or the key of a
//! signing certificate that chains to the class's CAs) over DSSE's
//! pre-authentication encoding of the payload, and the statement names the
//! same set of paths with the same digests as the seal, less the paths the
//! statement itself says it ignores.
//!
//! Keys are ECDSA on P-256, P-384 or P-521, each with the hash
//! model_signing pairs with the curve; anything else is refused by name,
//! never skipped. Certificate paths are checked by rustls-webpki, at the
//! signing certificate's notBefore as model_signing does (the bundle has
//! no trusted timestamp), and ECDSA runs on aws-lc-rs: both are already
//! linked for TLS, reviewed, and maintained, so no cryptography of ours.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine as _;
use rustls_pki_types::{CertificateDer, SignatureVerificationAlgorithm, UnixTime};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use x509_cert::der::{Decode, DecodePem, Encode};
use x509_cert::spki::{ObjectIdentifier, SubjectPublicKeyInfoOwned};

use crate::cache::manifest::{FileEntry, LinkEntry};
use crate::error::{Error, IoContext, Result};

/// A signature file larger than this is refused before it is parsed: a
/// statement lists a path and a digest per file (about 150 bytes), so
/// this bounds a model at about 100,000 files.
pub const MAX_SIGNATURE_BYTES: usize = 16 << 20;

/// Where a model keeps its signature unless the class says otherwise:
/// model_signing's default name, at the model's root.
pub const DEFAULT_FILE: &str = "model.sig";

const BUNDLE_MEDIA_PREFIX: &str = "application/vnd.dev.sigstore.bundle";
const IN_TOTO: &str = "application/vnd.in-toto+json";
const STATEMENT_V1: &str = "https://in-toto.io/Statement/v1";
const MODEL_SIGNING_V1: &str = "https://model_signing/signature/v1.0";

const EC_PUBLIC_KEY: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.2.1");
const P256: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7");
const P384: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.132.0.34");
const P521: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.132.0.35");
const CODE_SIGNING: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.6.1.5.5.7.3.3");
/// id-kp-codeSigning's DER value bytes, as webpki takes an EKU.
const CODE_SIGNING_DER: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x03];

/// What a verified signature says: who signed, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signed {
    /// Who signed: `key sha256:<hex>` (the SubjectPublicKeyInfo's digest),
    /// or the signing certificate's subject, names and issuer.
    pub signer: String,
    /// Every signed file: path -> sha256 (lowercase hex).
    pub files: BTreeMap<String, String>,
    /// Paths (and the trees under them) the signer left out on purpose.
    pub ignored: Vec<String>,
}

/// How a class treats signatures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No model is sealed or handed out without a valid signature.
    Required,
    /// A present signature must be valid; a missing one is recorded as
    /// unsigned.
    Optional,
}

/// A class's signature policy: what must sign, where the signature is.
pub struct Policy {
    pub mode: Mode,
    /// The signature's path inside the model.
    pub file: String,
    trust: Trust,
    /// What the policy was built from, for comparing policies.
    given: String,
}

enum Trust {
    Key(PublicKey),
    /// Trust anchors (DER): a signing certificate must chain to one.
    Chain(Vec<CertificateDer<'static>>),
    /// Sigstore keyless: a certificate for this identity from this OIDC
    /// issuer, under the trusted root's CAs, in its transparency log.
    Sigstore {
        identity: String,
        issuer: String,
    },
}

impl PartialEq for Policy {
    fn eq(&self, other: &Policy) -> bool {
        self.mode == other.mode && self.file == other.file && self.given == other.given
    }
}
impl Eq for Policy {}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("mode", &self.mode)
            .field("file", &self.file)
            .field("trust", &self.trusts())
            .finish()
    }
}

/// Where a class's trust comes from, as its parameters give it.
pub enum Trusted<'a> {
    /// `signaturePublicKey`: a PEM public key.
    PublicKey(&'a str),
    /// `signatureCertificateChain`: PEM CA certificates.
    CertificateChain(&'a str),
    /// `signatureIdentity` and `signatureIssuer`: a sigstore keyless
    /// signer, checked against the driver's sigstore trusted root.
    Sigstore { identity: &'a str, issuer: &'a str },
}

impl Policy {
    /// A policy over `trusted`; an error names the class parameter
    /// (`key_field`) and what it takes.
    pub fn new(mode: Mode, file: &str, trusted: Trusted<'_>, key_field: &str) -> Result<Policy> {
        let (trust, given) = match trusted {
            Trusted::PublicKey(pem) => (
                Trust::Key(PublicKey::from_pem(pem, key_field)?),
                format!("key\0{pem}"),
            ),
            Trusted::CertificateChain(pem) => (
                Trust::Chain(anchors(pem, key_field)?),
                format!("chain\0{pem}"),
            ),
            Trusted::Sigstore { identity, issuer } => (
                Trust::Sigstore {
                    identity: identity.to_string(),
                    issuer: issuer.to_string(),
                },
                format!("sigstore\0{identity}\0{issuer}"),
            ),
        };
        Ok(Policy {
            mode,
            file: file.to_string(),
            trust,
            given,
        })
    }

    /// What this policy trusts, for messages.
    pub fn trusts(&self) -> String {
        match &self.trust {
            Trust::Key(k) => format!("the class's key {}", k.fingerprint),
            Trust::Chain(a) => format!("a certificate under the class's {} CA(s)", a.len()),
            Trust::Sigstore { identity, issuer } => {
                format!("sigstore identity {identity} (issuer {issuer})")
            }
        }
    }

    /// Verifies the bundle `bytes` (the model's signature file) under this
    /// policy (a keyless signer against `sigstore`), and returns what it
    /// signs.
    pub fn verify(&self, sigstore: &SigstoreRoot, bytes: &[u8]) -> Result<Signed> {
        let file = self.file.as_str();
        let bundle = parse_bundle(file, bytes)?;
        let env = &bundle.dsse_envelope;
        let b64 = base64::engine::general_purpose::STANDARD;
        let payload = b64
            .decode(env.payload.as_bytes())
            .map_err(|e| refused(file, format_args!("its payload is not base64: {e}")))?;
        let msg = pae(&env.payload_type, &payload);
        let sigs: Vec<Vec<u8>> = env
            .signatures
            .iter()
            .filter_map(|s| b64.decode(s.sig.as_bytes()).ok())
            .collect();
        let signer = match &self.trust {
            Trust::Key(key) => {
                if !sigs.iter().any(|sig| key.verifies(&msg, sig)) {
                    return Err(refused(
                        file,
                        format_args!(
                            "is not signed by the class's key ({}), or its payload was changed after signing",
                            key.fingerprint
                        ),
                    ));
                }
                format!("key {}", key.fingerprint)
            }
            Trust::Chain(anchors) => {
                let leaf = Leaf::of(file, &bundle, anchors)?;
                if !sigs.iter().any(|sig| leaf.verifies(&msg, sig)) {
                    return Err(refused(
                        file,
                        format_args!(
                            "is not signed by the key of its certificate ({}), or its payload was changed after signing",
                            leaf.identity
                        ),
                    ));
                }
                leaf.identity
            }
            Trust::Sigstore { identity, issuer } => {
                keyless(sigstore, file, bytes, &payload, identity, issuer)?
            }
        };
        // Only a signed payload is parsed further: what it says is now the
        // signer's word, not an attacker's.
        let mut signed = parse_statement(file, &payload)?;
        signed.signer = signer;
        Ok(signed)
    }

    /// The policy's verdict on a model whose files are `sealed` (path ->
    /// sha256) with `symlinks`, and whose signature file held `signature`
    /// (None: the model has none): who signed, or None for an unsigned
    /// model an optional policy lets through.
    pub fn check(
        &self,
        sigstore: &SigstoreRoot,
        signature: Option<&[u8]>,
        sealed: &BTreeMap<String, String>,
        symlinks: &[String],
    ) -> Result<Option<String>> {
        let Some(bytes) = signature else {
            return match self.mode {
                Mode::Optional => Ok(None),
                Mode::Required => Err(refused(
                    &self.file,
                    format_args!(
                        "is not in the model, and its class requires a signature by {} (modelSignature: required); \
                         sign the model with `model_signing sign` and publish {} beside its files",
                        self.trusts(),
                        self.file
                    ),
                )),
            };
        };
        let signed = self.verify(sigstore, bytes)?;
        check_files(&signed, &self.file, sealed)?;
        if let Some(link) = symlinks.iter().find(|l| !ignored(&signed, &self.file, l)) {
            return Err(refused(
                &self.file,
                format_args!(
                    "cannot vouch for the model's symlink {link:?}: model signatures cover regular files only"
                ),
            ));
        }
        Ok(Some(signed.signer))
    }
}

impl Policy {
    /// The verdict on a model of `files` and `symlinks` whose tree is at
    /// `dir`, from which the signature file is read when the model holds
    /// one (a regular file of the tree: never through a link).
    pub fn check_dir(
        &self,
        sigstore: &SigstoreRoot,
        files: &[FileEntry],
        symlinks: &[LinkEntry],
        dir: &Path,
    ) -> Result<Option<String>> {
        let sealed: BTreeMap<String, String> = files
            .iter()
            .map(|f| (f.path.clone(), f.sha256.clone()))
            .collect();
        let links: Vec<String> = symlinks.iter().map(|l| l.path.clone()).collect();
        let signature = match files.iter().find(|f| f.path == self.file) {
            None => None,
            Some(f) if f.size > MAX_SIGNATURE_BYTES as u64 => {
                return Err(refused(
                    &self.file,
                    format_args!(
                        "is {} bytes, over the {MAX_SIGNATURE_BYTES} a signature may be",
                        f.size
                    ),
                ));
            }
            Some(_) => {
                let at = dir.join(&self.file);
                let mut bytes = Vec::new();
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                    .open(&at)
                    .and_then(|f| {
                        f.take(MAX_SIGNATURE_BYTES as u64 + 1)
                            .read_to_end(&mut bytes)
                    })
                    .ctx("read the signature", &at)?;
                Some(bytes)
            }
        };
        self.check(sigstore, signature.as_deref(), &sealed, &links)
    }
}

fn refused(file: &str, why: impl std::fmt::Display) -> Error {
    Error::Precondition(format!("signature {file}: {why}"))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bundle {
    media_type: String,
    #[serde(default)]
    verification_material: Material,
    dsse_envelope: Envelope,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Material {
    #[serde(default)]
    x509_certificate_chain: Option<CertChain>,
    #[serde(default)]
    certificate: Option<RawCert>,
}

#[derive(Deserialize)]
struct CertChain {
    certificates: Vec<RawCert>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawCert {
    raw_bytes: String,
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

/// The bundle in `bytes`, bounded and checked for the one shape verified
/// here: a sigstore bundle whose DSSE envelope carries an in-toto
/// statement.
fn parse_bundle(file: &str, bytes: &[u8]) -> Result<Bundle> {
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
    if bundle.dsse_envelope.payload_type != IN_TOTO {
        return Err(refused(
            file,
            format_args!(
                "signs a {:?} payload, not an in-toto statement",
                bundle.dsse_envelope.payload_type
            ),
        ));
    }
    Ok(bundle)
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

/// The ECDSA verification model_signing's signatures need for a key on
/// `curve`: the curve's own hash, the signature in DER.
fn ecdsa_for(
    curve: Option<ObjectIdentifier>,
) -> Option<&'static dyn SignatureVerificationAlgorithm> {
    use webpki::aws_lc_rs::{ECDSA_P256_SHA256, ECDSA_P384_SHA384, ECDSA_P521_SHA512};
    match curve? {
        c if c == P256 => Some(ECDSA_P256_SHA256),
        c if c == P384 => Some(ECDSA_P384_SHA384),
        c if c == P521 => Some(ECDSA_P521_SHA512),
        _ => None,
    }
}

/// The named curve of an EC SubjectPublicKeyInfo, if it is one.
fn curve_of(spki: &SubjectPublicKeyInfoOwned) -> Option<ObjectIdentifier> {
    if spki.algorithm.oid != EC_PUBLIC_KEY {
        return None;
    }
    spki.algorithm
        .parameters
        .as_ref()?
        .decode_as::<ObjectIdentifier>()
        .ok()
}

/// A public key in PEM, on a curve this module verifies.
struct PublicKey {
    alg: &'static dyn SignatureVerificationAlgorithm,
    point: Vec<u8>,
    /// `sha256:<hex>` of its SubjectPublicKeyInfo (DER).
    fingerprint: String,
}

impl PublicKey {
    fn from_pem(pem: &str, field: &str) -> Result<PublicKey> {
        let bad = |why: String| {
            Error::invalid(
                format!("parameters.{field}"),
                format!(
                    "{why}; give an ECDSA public key (P-256, P-384 or P-521) in PEM, as `openssl ec -pubout` writes it"
                ),
            )
        };
        let spki = SubjectPublicKeyInfoOwned::from_pem(pem.trim())
            .map_err(|e| bad(format!("not a PEM public key: {e}")))?;
        let alg = ecdsa_for(curve_of(&spki)).ok_or_else(|| {
            bad(format!(
                "a key of algorithm {} is not one model_signing signs with",
                spki.algorithm.oid
            ))
        })?;
        let der = spki.to_der().map_err(|e| bad(e.to_string()))?;
        Ok(PublicKey {
            alg,
            point: spki.subject_public_key.raw_bytes().to_vec(),
            fingerprint: format!("sha256:{}", hex::encode(Sha256::digest(&der))),
        })
    }

    fn verifies(&self, msg: &[u8], sig: &[u8]) -> bool {
        self.alg.verify_signature(&self.point, msg, sig).is_ok()
    }
}

/// The CA certificates of `pem`, each usable as a trust anchor.
fn anchors(pem: &str, field: &str) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |why: String| {
        Error::invalid(
            format!("parameters.{field}"),
            format!("{why}; give the PEM CA certificate(s) that signing certificates chain to"),
        )
    };
    let pem = pem.trim();
    // x509-cert 0.2.5's chain reader underflows on an empty input.
    let certs = if pem.is_empty() {
        Vec::new()
    } else {
        x509_cert::Certificate::load_pem_chain(pem.as_bytes())
            .map_err(|e| bad(format!("not PEM certificates: {e}")))?
    };
    if certs.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    let mut out = Vec::new();
    for c in certs {
        let der = CertificateDer::from(c.to_der().map_err(|e| bad(e.to_string()))?);
        webpki::anchor_from_trusted_cert(&der).map_err(|e| {
            bad(format!(
                "certificate {} cannot anchor a chain: {e}",
                c.tbs_certificate.subject
            ))
        })?;
        out.push(der);
    }
    Ok(out)
}

/// A bundle's signing certificate, its path to the class's CAs checked.
struct Leaf {
    der: CertificateDer<'static>,
    alg: &'static dyn SignatureVerificationAlgorithm,
    identity: String,
}

impl Leaf {
    fn of(file: &str, bundle: &Bundle, anchors: &[CertificateDer<'static>]) -> Result<Leaf> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let m = &bundle.verification_material;
        let raw: Vec<&RawCert> = match (&m.x509_certificate_chain, &m.certificate) {
            (Some(chain), _) => chain.certificates.iter().collect(),
            (None, Some(c)) => vec![c],
            (None, None) => {
                return Err(refused(
                    file,
                    "carries no signing certificate (signed with a bare key?), and the class trusts certificates under its CAs",
                ));
            }
        };
        let mut ders = Vec::new();
        for c in raw {
            let der = b64.decode(c.raw_bytes.as_bytes()).map_err(|e| {
                refused(
                    file,
                    format_args!("holds a certificate that is not base64: {e}"),
                )
            })?;
            ders.push(CertificateDer::from(der));
        }
        let Some((leaf_der, intermediates)) = ders.split_first() else {
            return Err(refused(file, "carries an empty certificate chain"));
        };
        let cert = x509_cert::Certificate::from_der(leaf_der).map_err(|e| {
            refused(
                file,
                format_args!("its signing certificate is not X.509 DER: {e}"),
            )
        })?;
        let tbs = &cert.tbs_certificate;
        let identity = identity(&cert, leaf_der);
        let ee = webpki::EndEntityCert::try_from(leaf_der).map_err(|e| {
            refused(
                file,
                format_args!("its signing certificate is not usable: {e}"),
            )
        })?;
        let trust: Vec<_> = anchors
            .iter()
            .filter_map(|a| webpki::anchor_from_trusted_cert(a).ok())
            .collect();
        // At the certificate's own start, as model_signing verifies: the
        // signature was made while it was valid, and nothing in the bundle
        // says when more precisely.
        let at = UnixTime::since_unix_epoch(tbs.validity.not_before.to_unix_duration());
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &trust,
            intermediates,
            at,
            webpki::KeyUsage::required_if_present(CODE_SIGNING_DER),
            None,
            None,
        )
        .map_err(|e| {
            refused(
                file,
                format_args!(
                    "its signing certificate ({identity}) does not chain to the class's CAs for code signing: {e:?}"
                ),
            )
        })?;
        if !may_sign(tbs) {
            return Err(refused(
                file,
                format_args!(
                    "its signing certificate ({identity}) may not sign: it has neither the digitalSignature key usage nor the codeSigning extended key usage"
                ),
            ));
        }
        let alg = ecdsa_for(curve_of(&tbs.subject_public_key_info)).ok_or_else(|| {
            refused(
                file,
                format_args!(
                    "its signing certificate's key ({}) is not one model_signing signs with (ECDSA P-256, P-384, P-521)",
                    tbs.subject_public_key_info.algorithm.oid
                ),
            )
        })?;
        Ok(Leaf {
            der: leaf_der.clone().into_owned(),
            alg,
            identity,
        })
    }

    fn verifies(&self, msg: &[u8], sig: &[u8]) -> bool {
        webpki::EndEntityCert::try_from(&self.der)
            .is_ok_and(|ee| ee.verify_signature(self.alg, msg, sig).is_ok())
    }
}

/// The trusted root keyless signatures are checked against: an admin's
/// `--sigstore-trust-root`, else sigstore's public-good instance as the
/// crate ships it; built when a keyless signature is first checked.
#[derive(Default)]
pub struct SigstoreRoot {
    json: Option<std::sync::Arc<str>>,
    verifier: std::sync::OnceLock<std::result::Result<sigstore_verify::Verifier, String>>,
}

impl SigstoreRoot {
    /// The root in `json` (a `trusted_root.json`), or with None the
    /// public-good instance's.
    pub fn new(json: Option<std::sync::Arc<str>>) -> SigstoreRoot {
        SigstoreRoot {
            json,
            verifier: Default::default(),
        }
    }

    /// Whether `json` is a usable trusted root: an error names what is
    /// wrong with it, so a driver given a bad one stops at its start.
    pub fn check(json: &str) -> Result<()> {
        sigstore_verifier(json).map(drop)
    }

    fn verifier(&self) -> Result<&sigstore_verify::Verifier> {
        self.verifier
            .get_or_init(|| {
                let json = self.json.as_deref();
                sigstore_verifier(
                    json.unwrap_or(sigstore_verify::trust_root::SIGSTORE_PRODUCTION_TRUSTED_ROOT),
                )
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Internal(e.clone()))
    }
}

impl std::fmt::Debug for SigstoreRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.json {
            Some(_) => "SigstoreRoot(--sigstore-trust-root)",
            None => "SigstoreRoot(public-good)",
        })
    }
}

fn sigstore_verifier(json: &str) -> Result<sigstore_verify::Verifier> {
    let bad = |e: String| {
        Error::invalid(
            "--sigstore-trust-root",
            format!(
                "not a usable sigstore trusted root ({e}); give a trusted_root.json as sigstore's TUF repository publishes it"
            ),
        )
    };
    let root = sigstore_verify::trust_root::TrustedRoot::from_json(json)
        .map_err(|e| bad(e.to_string()))?;
    sigstore_verify::Verifier::new(&root).map_err(|e| bad(e.to_string()))
}

/// Checks a keyless signature: the bundle's certificate, its SCT, its
/// transparency-log entry and the DSSE signature, offline against the
/// trusted root, for `identity` from `issuer`, and bound to the statement
/// in `payload` by its subject (the digest of its files' digests, as
/// model_signing computes it). Returns who signed.
fn keyless(
    sigstore: &SigstoreRoot,
    file: &str,
    bytes: &[u8],
    payload: &[u8],
    identity: &str,
    issuer: &str,
) -> Result<String> {
    use sigstore_verify::types::{Artifact, ArtifactDigest, Sha256Hash};
    let verifier = sigstore.verifier()?;
    let text = std::str::from_utf8(bytes)
        .map_err(|e| refused(file, format_args!("is not UTF-8 JSON: {e}")))?;
    let bundle = sigstore_verify::types::Bundle::from_json(text)
        .map_err(|e| refused(file, format_args!("is not a sigstore bundle: {e}")))?;
    let subject = Sha256Hash::new(statement_root(file, payload)?);
    let policy = sigstore_verify::VerificationPolicy::new(identity, issuer);
    let verified = verifier
        .verify(Artifact::Digest(ArtifactDigest::sha256(subject)), &bundle, &policy)
        .map_err(|e| {
            refused(
                file,
                format_args!(
                    "its sigstore signature does not hold for identity {identity} from issuer {issuer}: {e}"
                ),
            )
        })?;
    // What the certificate says, now that it is proven, not what the
    // class asked for.
    Ok(format!(
        "sigstore {} (issuer {})",
        verified.identity().map_or(identity, |i| i.as_str()),
        verified.issuer().unwrap_or(issuer)
    ))
}

/// The digest model_signing names a statement's subject by: sha256 over
/// its files' digests, in the order listed.
fn statement_root(file: &str, payload: &[u8]) -> Result<[u8; 32]> {
    let statement: Statement = serde_json::from_slice(payload).map_err(|e| {
        refused(
            file,
            format_args!("its statement is not a model-signing statement: {e}"),
        )
    })?;
    let mut h = Sha256::new();
    for r in &statement.predicate.resources {
        let digest = hex::decode(&r.digest).map_err(|_| {
            refused(
                file,
                format_args!("lists {:?} with a digest that is not hex", r.name),
            )
        })?;
        h.update(digest);
    }
    Ok(h.finalize().into())
}

/// Whether a certificate's key usages allow signing, as model_signing
/// asks: digitalSignature, or the codeSigning extended usage.
fn may_sign(tbs: &x509_cert::TbsCertificate) -> bool {
    use x509_cert::ext::pkix::{ExtendedKeyUsage, KeyUsage};
    let digital = matches!(tbs.get::<KeyUsage>(), Ok(Some((_, ku))) if ku.digital_signature());
    let code = matches!(tbs.get::<ExtendedKeyUsage>(), Ok(Some((_, eku))) if eku.0.contains(&CODE_SIGNING));
    digital || code
}

/// Who a certificate names: its subject, its e-mail and URI names, its
/// issuer, and its own digest.
fn identity(cert: &x509_cert::Certificate, der: &[u8]) -> String {
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let tbs = &cert.tbs_certificate;
    let names: Vec<String> = match tbs.get::<SubjectAltName>() {
        Ok(Some((_, san))) => san
            .0
            .iter()
            .filter_map(|n| match n {
                GeneralName::Rfc822Name(s) => Some(s.to_string()),
                GeneralName::UniformResourceIdentifier(s) => Some(s.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let names = if names.is_empty() {
        String::new()
    } else {
        format!(" <{}>", names.join(", "))
    };
    format!(
        "certificate \"{}\"{names} issued by \"{}\", sha256:{}",
        tbs.subject,
        tbs.issuer,
        hex::encode(Sha256::digest(der))
    )
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

    /// None of these policies is keyless; the root is never built.
    static PUBLIC_GOOD: SigstoreRoot = SigstoreRoot {
        json: None,
        verifier: std::sync::OnceLock::new(),
    };

    // Made by the real CLI (model-signing 1.1.1), see the fixtures' README:
    // `sign key` with P-256, P-384 and P-521 keys, `sign certificate` with
    // a code-signing certificate (and one for TLS only) under a private CA.
    const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/signing");

    fn read(name: &str) -> Vec<u8> {
        std::fs::read(format!("{DIR}/{name}")).unwrap()
    }

    fn pem(name: &str) -> String {
        String::from_utf8(read(name)).unwrap()
    }

    fn key(name: &str) -> Policy {
        Policy::new(
            Mode::Required,
            DEFAULT_FILE,
            Trusted::PublicKey(&pem(name)),
            "signaturePublicKey",
        )
        .unwrap()
    }

    fn chain(name: &str) -> Policy {
        Policy::new(
            Mode::Required,
            DEFAULT_FILE,
            Trusted::CertificateChain(&pem(name)),
            "signatureCertificateChain",
        )
        .unwrap()
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
        for curve in ["p256", "p384", "p521"] {
            let policy = key(&format!("{curve}.pub.pem"));
            let signed = policy
                .verify(&PUBLIC_GOOD, &read(&format!("{curve}.sig")))
                .unwrap_or_else(|e| panic!("{curve}: {e}"));
            assert!(
                signed.signer.starts_with("key sha256:") && signed.signer.len() == 75,
                "{}",
                signed.signer
            );
            assert_eq!(signed.files, sealed(), "{curve}");
            check_files(&signed, "model.sig", &sealed()).unwrap();
            // The signature file itself and ignored paths are not the model's.
            let mut with_sig = sealed();
            with_sig.insert("model.sig".into(), "0".repeat(64));
            with_sig.insert(".git/HEAD".into(), "1".repeat(64));
            check_files(&signed, "model.sig", &with_sig).unwrap();
            let who = policy
                .check(
                    &PUBLIC_GOOD,
                    Some(&read(&format!("{curve}.sig"))),
                    &with_sig,
                    &[".git/x".into()],
                )
                .unwrap();
            assert_eq!(who, Some(signed.signer));
        }
    }

    #[test]
    fn a_certificate_under_the_class_ca_verifies_and_names_its_holder() {
        let signed = chain("ca.pem")
            .verify(&PUBLIC_GOOD, &read("cert.sig"))
            .unwrap();
        assert!(
            signed.signer.starts_with(
                "certificate \"CN=release-bot,O=Example Models\" <models@example.com> \
                 issued by \"CN=Example Models Signing CA,O=Example Models\", sha256:"
            ),
            "{}",
            signed.signer
        );
        assert_eq!(signed.files, sealed());

        let m = refusal(chain("other-ca.pem").verify(&PUBLIC_GOOD, &read("cert.sig")));
        assert!(m.contains("does not chain to the class's CAs"), "{m}");
        // A certificate for TLS servers only may not sign models.
        let m = refusal(chain("ca.pem").verify(&PUBLIC_GOOD, &read("tls.sig")));
        assert!(m.contains("code signing"), "{m}");
        // A bare-key signature has no certificate to chain.
        let m = refusal(chain("ca.pem").verify(&PUBLIC_GOOD, &read("p256.sig")));
        assert!(m.contains("no signing certificate"), "{m}");
        // The certificate's key did not sign an edited payload.
        let m = refusal(chain("ca.pem").verify(&PUBLIC_GOOD, &edited(&read("cert.sig"))));
        assert!(m.contains("payload was changed"), "{m}");
        // A key policy does not take a certificate's signature for its own.
        let m = refusal(key("p256.pub.pem").verify(&PUBLIC_GOOD, &read("cert.sig")));
        assert!(m.contains("not signed by the class's key"), "{m}");
    }

    /// `bundle` with a.txt's digest changed in its payload, signatures
    /// kept.
    fn edited(bundle: &[u8]) -> Vec<u8> {
        let mut bundle: serde_json::Value = serde_json::from_slice(bundle).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        let payload = b64
            .decode(bundle["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap();
        let sha_a = &sealed()["a.txt"];
        let edited = String::from_utf8(payload)
            .unwrap()
            .replace(sha_a, &"0".repeat(64));
        bundle["dsseEnvelope"]["payload"] = b64.encode(edited).into();
        serde_json::to_vec(&bundle).unwrap()
    }

    #[test]
    fn another_key_an_edited_payload_and_changed_files_are_refused() {
        let sig = read("p256.sig");
        let m = refusal(key("other.pub.pem").verify(&PUBLIC_GOOD, &sig));
        assert!(m.contains("not signed by the class's key"), "{m}");
        let m = refusal(key("p384.pub.pem").verify(&PUBLIC_GOOD, &sig));
        assert!(m.contains("not signed"), "{m}");
        let m = refusal(key("p256.pub.pem").verify(&PUBLIC_GOOD, &edited(&sig)));
        assert!(m.contains("payload was changed"), "{m}");

        let policy = key("p256.pub.pem");
        let signed = policy.verify(&PUBLIC_GOOD, &sig).unwrap();
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
        let m = refusal(policy.check(&PUBLIC_GOOD, Some(&sig), &sealed(), &["config.json".into()]));
        assert!(m.contains("symlink \"config.json\""), "{m}");
    }

    #[test]
    fn a_missing_signature_is_refused_or_recorded_as_unsigned() {
        let m = refusal(key("p256.pub.pem").check(&PUBLIC_GOOD, None, &sealed(), &[]));
        assert!(
            m.starts_with("signature model.sig: is not in the model") && m.contains("required"),
            "{m}"
        );
        let optional = Policy::new(
            Mode::Optional,
            "sigs/model.sig",
            Trusted::PublicKey(&pem("p256.pub.pem")),
            "signaturePublicKey",
        )
        .unwrap();
        assert_eq!(
            optional.check(&PUBLIC_GOOD, None, &sealed(), &[]).unwrap(),
            None
        );
        // Optional never means "any signature will do".
        let m = refusal(optional.check(&PUBLIC_GOOD, Some(&read("p384.sig")), &sealed(), &[]));
        assert!(
            m.contains("signature sigs/model.sig") && m.contains("not signed"),
            "{m}"
        );
    }

    #[test]
    fn hostile_files_get_clear_errors() {
        let policy = key("p256.pub.pem");
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
            let m = refusal(policy.verify(&PUBLIC_GOOD, &bytes));
            assert!(m.contains(want), "{want}: {m}");
        }
        // A certificate that is not one.
        let mut bundle: serde_json::Value = serde_json::from_slice(&read("cert.sig")).unwrap();
        bundle["verificationMaterial"]["x509CertificateChain"]["certificates"][0]["rawBytes"] =
            "AAAA".into();
        let m =
            refusal(chain("ca.pem").verify(&PUBLIC_GOOD, &serde_json::to_vec(&bundle).unwrap()));
        assert!(m.contains("not X.509 DER"), "{m}");

        for (trusted, field, want) in [
            (
                Trusted::PublicKey("not a key"),
                "signaturePublicKey",
                "not a PEM public key",
            ),
            (
                Trusted::PublicKey(&pem("ca.pem")),
                "signaturePublicKey",
                "not a PEM public key",
            ),
            (
                Trusted::CertificateChain("nope"),
                "signatureCertificateChain",
                "PEM CA certificate",
            ),
            (
                Trusted::CertificateChain(&pem("p256.pub.pem")),
                "signatureCertificateChain",
                "not PEM certificates",
            ),
            (
                Trusted::CertificateChain(""),
                "signatureCertificateChain",
                "holds no certificate",
            ),
        ] {
            let e = Policy::new(Mode::Required, DEFAULT_FILE, trusted, field).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { field: f, .. } if *f == format!("parameters.{field}"))
                    && e.to_string().contains(want),
                "{e:?}"
            );
        }
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
