//! StorageClass parameters and mutable (VolumeAttributesClass) parameters:
//! every key is known, every value checked, and an error names the key and
//! what it accepts.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use crate::cache::{Backend, Role, Verify};
use crate::error::{Error, Result};

pub const BACKEND: &str = "backend";
pub const ROLE: &str = "role";
pub const SHARED_PATH: &str = "sharedPath";
pub const IMAGE_LOCATION: &str = "imageLocation";
pub const SUB_PATH: &str = "subPath";
pub const VERIFY: &str = "verify";
pub const SOURCE: &str = "source";
pub const ALLOW_CROSS_NAMESPACE: &str = "allowCrossNamespacePVC";
pub use crate::trust::{ALLOWED_SOURCES, ARTIFACT_CREDENTIALS};
pub const MODEL_SIGNATURE: &str = "modelSignature";
pub const SIGNATURE_PUBLIC_KEY: &str = "signaturePublicKey";
pub const SIGNATURE_CERTIFICATE_CHAIN: &str = "signatureCertificateChain";
pub const SIGNATURE_FILE: &str = "signatureFile";
pub const SIGNATURE_IDENTITY: &str = "signatureIdentity";
pub const SIGNATURE_ISSUER: &str = "signatureIssuer";
pub const PROGRESSIVE: &str = "progressive";

/// Options handed to the model source; see `puller`.
pub const SOURCE_OPTIONS: [&str; 10] = [
    "s3Endpoint",
    "s3Region",
    "s3PathStyle",
    "ociPlainHTTP",
    "hfEndpoint",
    "hfAllowPatterns",
    "hfIgnorePatterns",
    "modelRegistryURL",
    crate::puller::PARAM_MAX_MODEL_BYTES,
    crate::puller::PARAM_MAX_MODEL_FILES,
];

const KNOWN: [&str; 27] = [
    BACKEND,
    PROGRESSIVE,
    MODEL_SIGNATURE,
    SIGNATURE_PUBLIC_KEY,
    SIGNATURE_CERTIFICATE_CHAIN,
    SIGNATURE_IDENTITY,
    SIGNATURE_ISSUER,
    SIGNATURE_FILE,
    ALLOWED_SOURCES,
    ARTIFACT_CREDENTIALS,
    ALLOW_CROSS_NAMESPACE,
    ROLE,
    SHARED_PATH,
    IMAGE_LOCATION,
    SUB_PATH,
    VERIFY,
    SOURCE,
    SOURCE_OPTIONS[0],
    SOURCE_OPTIONS[1],
    SOURCE_OPTIONS[2],
    SOURCE_OPTIONS[3],
    SOURCE_OPTIONS[4],
    SOURCE_OPTIONS[5],
    SOURCE_OPTIONS[6],
    SOURCE_OPTIONS[7],
    SOURCE_OPTIONS[8],
    SOURCE_OPTIONS[9],
];

/// external-provisioner adds these (PVC name, namespace, PV name) with
/// --extra-create-metadata; they are information, not settings.
const PROVISIONER_PREFIX: &str = "csi.storage.k8s.io/";

pub const SEALED: &str = "sealed";
pub const PINNED: &str = "pinned";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageLocation {
    Node,
    Shared,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub backend: Option<Backend>,
    pub role: Option<Role>,
    pub shared_path: Option<PathBuf>,
    pub image_location: Option<ImageLocation>,
    pub sub_path: Option<String>,
    pub verify: Option<Verify>,
    pub source: Option<String>,
    pub source_options: BTreeMap<String, String>,
    /// `pvc://` may name a claim in another namespace.
    pub allow_cross_namespace: bool,
    /// What a PVC's own source annotation (or a registry's answer) may
    /// name; None: nothing (a registry's own host).
    pub allowed_sources: Option<crate::trust::AllowedSources>,
    /// Where a registry's answer may take the class's credentials.
    pub artifact_credentials: Option<crate::trust::AllowedSources>,
    /// Whose signature a model must carry (`modelSignature` and its
    /// trust); None: signatures are not checked.
    pub signature: Option<std::sync::Arc<crate::signing::Policy>>,
    /// `progressive`: "true" answers a model's create, stage and publish
    /// once its listing is known (reads wait for each file's bytes);
    /// "false" only once the model is sealed; unset, once every file is
    /// verified, where that can be served (`plan`).
    pub progressive: Option<bool>,
}

fn one_of<T: Copy>(key: &str, value: &str, options: &[(&str, T)]) -> Result<T> {
    options
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<_> = options.iter().map(|(n, _)| *n).collect();
            Error::invalid(
                format!("parameters.{key}"),
                format!(
                    "{value:?} is not accepted; use one of: {}",
                    names.join(", ")
                ),
            )
        })
}

impl Params {
    pub fn parse(map: &HashMap<String, String>) -> Result<Params> {
        let mut p = Params {
            signature: signature_policy(map)?,
            ..Params::default()
        };
        let mut keys: Vec<_> = map.keys().collect();
        keys.sort();
        for key in keys {
            p.set(key, &map[key])?;
        }
        p.check()?;
        Ok(p)
    }

    /// Takes one parameter, or says why it is refused.
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            BACKEND => {
                self.backend = Some(one_of(
                    key,
                    value,
                    &[
                        ("local", Backend::Local),
                        ("shared", Backend::Shared),
                        ("xfs", Backend::Xfs),
                    ],
                )?)
            }
            ROLE => {
                self.role = Some(one_of(
                    key,
                    value,
                    &[("source", Role::Source), ("cache", Role::Cache)],
                )?)
            }
            SHARED_PATH => {
                let path = PathBuf::from(value);
                if !path.is_absolute() {
                    return Err(Error::invalid(
                        format!("parameters.{key}"),
                        format!(
                            "{value:?} must be an absolute path given to the driver with --shared-path"
                        ),
                    ));
                }
                self.shared_path = Some(path);
            }
            IMAGE_LOCATION => {
                self.image_location = Some(one_of(
                    key,
                    value,
                    &[
                        ("node", ImageLocation::Node),
                        ("shared", ImageLocation::Shared),
                    ],
                )?)
            }
            SUB_PATH => {
                crate::mount::subpath::validate_syntax(value)
                    .map_err(|m| Error::invalid(format!("parameters.{key}"), m))?;
                self.sub_path = Some(value.trim_end_matches('/').to_string());
            }
            ALLOWED_SOURCES => {
                self.allowed_sources = Some(
                    crate::trust::AllowedSources::parse(value)
                        .map_err(|m| Error::invalid(format!("parameters.{key}"), m))?,
                );
            }
            ARTIFACT_CREDENTIALS => {
                self.artifact_credentials = Some(
                    crate::trust::AllowedSources::parse(value)
                        .map_err(|m| Error::invalid(format!("parameters.{key}"), m))?,
                );
            }
            PROGRESSIVE => {
                self.progressive = Some(one_of(key, value, &[("true", true), ("false", false)])?);
            }
            ALLOW_CROSS_NAMESPACE => {
                self.allow_cross_namespace =
                    one_of(key, value, &[("true", true), ("false", false)])?;
            }
            VERIFY => {
                self.verify = Some(one_of(
                    key,
                    value,
                    &[("size", Verify::Size), ("full", Verify::Full)],
                )?)
            }
            SOURCE => {
                crate::puller::validate_uri(value)
                    .map_err(|m| Error::invalid(format!("parameters.{key}"), m))?;
                self.source = Some(value.to_string());
            }
            k if SOURCE_OPTIONS.contains(&k) => {
                source_option(k, value)?;
                self.source_options.insert(k.to_string(), value.to_string());
            }
            MODEL_SIGNATURE
            | SIGNATURE_PUBLIC_KEY
            | SIGNATURE_CERTIFICATE_CHAIN
            | SIGNATURE_IDENTITY
            | SIGNATURE_ISSUER
            | SIGNATURE_FILE => {}
            k if k.starts_with(PROVISIONER_PREFIX) => {}
            other => {
                return Err(Error::invalid(
                    format!("parameters.{other}"),
                    format!("unknown parameter; accepted: {}", KNOWN.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// Refuses parameters that do not go together.
    fn check(&self) -> Result<()> {
        if self.image_location.is_some() && self.backend != Some(Backend::Xfs) {
            return Err(Error::invalid(
                format!("parameters.{IMAGE_LOCATION}"),
                "only applies to backend: xfs",
            ));
        }
        if self.progressive == Some(true) {
            if let Some(b) = self.backend.filter(|b| *b != Backend::Local) {
                return Err(Error::invalid(
                    format!("parameters.{PROGRESSIVE}"),
                    format!(
                        "only applies to backend: local (a node's own directory, filled and \
                         served by that node's driver), not {b}; remove it or use backend: local"
                    ),
                ));
            }
            if self.signature.is_some() {
                return Err(Error::invalid(
                    format!("parameters.{PROGRESSIVE}"),
                    "cannot be combined with modelSignature: a signature covers the whole \
                     model and is checked at the seal, so a pod would read files before the \
                     signature is; use one or the other",
                ));
            }
        }
        if self.role == Some(Role::Source) {
            for (set, key) in [
                (self.progressive.is_some(), PROGRESSIVE),
                (self.sub_path.is_some(), SUB_PATH),
                (self.verify.is_some(), VERIFY),
                (self.source.is_some(), SOURCE),
                (self.allowed_sources.is_some(), ALLOWED_SOURCES),
                (self.artifact_credentials.is_some(), ARTIFACT_CREDENTIALS),
                (self.signature.is_some(), MODEL_SIGNATURE),
                (
                    !self.source_options.is_empty(),
                    "s3Endpoint, s3Region, s3PathStyle, ociPlainHTTP, hfEndpoint, hfAllowPatterns, hfIgnorePatterns, modelRegistryURL",
                ),
            ] {
                if set {
                    return Err(Error::invalid(
                        format!("parameters.{key}"),
                        "only applies to cache volumes, not to role: source",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Checks a source option's value (`SOURCE_OPTIONS`).
fn source_option(k: &str, value: &str) -> Result<()> {
    if k.starts_with("maxModel") {
        let one = BTreeMap::from([(k.to_string(), value.to_string())]);
        crate::puller::class_limits(&one)?;
    } else if k.ends_with("Endpoint") || k.ends_with("URL") {
        let ok = url::Url::parse(value)
            .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
        if !ok {
            return Err(Error::invalid(
                format!("parameters.{k}"),
                format!("{value:?} is not an http(s) URL like https://host:port"),
            ));
        }
    } else if matches!(
        k,
        crate::puller::hf::ALLOW_PARAM | crate::puller::hf::IGNORE_PARAM
    ) {
        crate::puller::hf::patterns(k, value)?;
    } else if k == "s3Region" {
        if value.is_empty() || value.contains(char::is_whitespace) {
            return Err(Error::invalid(
                format!("parameters.{k}"),
                format!("{value:?} is not a region name like us-east-1"),
            ));
        }
    } else if !matches!(value, "true" | "false") {
        return Err(Error::invalid(
            format!("parameters.{k}"),
            format!("{value:?} is not accepted; use \"true\" or \"false\""),
        ));
    }
    Ok(())
}

/// The class's signature policy: `modelSignature` with exactly one trust
/// (a key or a CA chain), and where the signature is; None when off.
fn signature_policy(
    map: &HashMap<String, String>,
) -> Result<Option<std::sync::Arc<crate::signing::Policy>>> {
    use crate::signing::{DEFAULT_FILE, Mode, Policy, Trusted};
    let field = |k: &str| format!("parameters.{k}");
    let mode = match map.get(MODEL_SIGNATURE).map(String::as_str) {
        None | Some("off") => None,
        Some(v) => Some(one_of(
            MODEL_SIGNATURE,
            v,
            &[
                ("required", Mode::Required),
                ("optional", Mode::Optional),
                // Never reached ("off" is matched above); listed for the
                // error's choices.
                ("off", Mode::Optional),
            ],
        )?),
    };
    let key = map.get(SIGNATURE_PUBLIC_KEY);
    let chain = map.get(SIGNATURE_CERTIFICATE_CHAIN);
    let identity = map.get(SIGNATURE_IDENTITY);
    let issuer = map.get(SIGNATURE_ISSUER);
    let Some(mode) = mode else {
        if let Some(k) = [
            SIGNATURE_PUBLIC_KEY,
            SIGNATURE_CERTIFICATE_CHAIN,
            SIGNATURE_IDENTITY,
            SIGNATURE_ISSUER,
            SIGNATURE_FILE,
        ]
        .into_iter()
        .find(|k| map.contains_key(*k))
        {
            return Err(Error::invalid(
                field(k),
                "applies only with modelSignature: required or optional; without it signatures are not checked",
            ));
        }
        return Ok(None);
    };
    let file = map.get(SIGNATURE_FILE).map_or(DEFAULT_FILE, String::as_str);
    let inside = !file.is_empty()
        && !file.starts_with('/')
        && file
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if !inside {
        return Err(Error::invalid(
            field(SIGNATURE_FILE),
            format!(
                "{file:?} is not a path inside the model; give one relative to its root, like {DEFAULT_FILE}"
            ),
        ));
    }
    let keyless = match (identity, issuer) {
        (Some(identity), Some(issuer)) if !identity.is_empty() && !issuer.is_empty() => {
            Some(Trusted::Sigstore { identity, issuer })
        }
        (None, None) => None,
        (Some(_), _) => {
            return Err(Error::invalid(
                field(SIGNATURE_ISSUER),
                "goes with signatureIdentity: the OIDC issuer that vouched for the identity, e.g. https://accounts.google.com",
            ));
        }
        (None, Some(_)) => {
            return Err(Error::invalid(
                field(SIGNATURE_IDENTITY),
                "goes with signatureIssuer: the signer's e-mail or URI as its sigstore certificate names it",
            ));
        }
    };
    let mut given = [
        key.map(|k| (Trusted::PublicKey(k), SIGNATURE_PUBLIC_KEY)),
        chain.map(|c| (Trusted::CertificateChain(c), SIGNATURE_CERTIFICATE_CHAIN)),
        keyless.map(|k| (k, SIGNATURE_IDENTITY)),
    ]
    .into_iter()
    .flatten();
    let (trusted, key_field) = match (given.next(), given.next()) {
        (Some(one), None) => one,
        (Some(_), Some((_, second))) => {
            return Err(Error::invalid(
                field(second),
                "give one of signaturePublicKey, signatureCertificateChain, or signatureIdentity with signatureIssuer",
            ));
        }
        (None, _) => {
            return Err(Error::invalid(
                field(MODEL_SIGNATURE),
                "needs whom to trust: signaturePublicKey (a PEM public key), signatureCertificateChain \
                 (PEM CA certificates), or signatureIdentity with signatureIssuer (a sigstore keyless signer)",
            ));
        }
    };
    Ok(Some(std::sync::Arc::new(Policy::new(
        mode, file, trusted, key_field,
    )?)))
}

/// Mutable (VolumeAttributesClass) parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutable {
    /// Some(true) asks for a seal; sealing cannot be undone.
    pub sealed: Option<bool>,
    /// Keeps a pulled model from eviction while set.
    pub pinned: Option<bool>,
}

/// A StorageClass's parameters as external-provisioner passes them to
/// CreateVolume: without its own `csi.storage.k8s.io/` keys (secret
/// references and the like), for callers that read a class themselves.
pub fn class_parameters(parameters: Option<BTreeMap<String, String>>) -> HashMap<String, String> {
    parameters
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !k.starts_with(MODIFY_METADATA))
        .collect()
}

/// external-resizer's `--extra-modify-metadata` adds the PVC's and PV's
/// names to every ControllerModifyVolume under this prefix; they name
/// objects, they are not attributes of the volume.
const MODIFY_METADATA: &str = "csi.storage.k8s.io/";
pub const PV_NAME: &str = "csi.storage.k8s.io/pv/name";

/// A modify request's parameters, split into the class's own (as its
/// VolumeAttributesClass lists them) and the PV's name, when given.
pub fn split_modify_metadata(
    map: &HashMap<String, String>,
) -> (BTreeMap<String, String>, Option<String>) {
    let attributes = map
        .iter()
        .filter(|(k, _)| !k.starts_with(MODIFY_METADATA))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    (attributes, map.get(PV_NAME).cloned())
}

pub fn parse_mutable(map: &HashMap<String, String>) -> Result<Mutable> {
    let mut m = Mutable::default();
    for (key, value) in map {
        let slot = match key.as_str() {
            SEALED => &mut m.sealed,
            PINNED => &mut m.pinned,
            _ => {
                return Err(Error::invalid(
                    format!("mutable_parameters.{key}"),
                    format!("unknown mutable parameter; accepted: {SEALED}, {PINNED}"),
                ));
            }
        };
        *slot = Some(match value.as_str() {
            "true" => true,
            "false" => false,
            other => {
                return Err(Error::invalid(
                    format!("mutable_parameters.{key}"),
                    format!("{other:?} is not accepted; use \"true\" or \"false\""),
                ));
            }
        });
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Hub's file filters are globs on a class, not flags: before,
    /// every value but "true"/"false" was refused, so a class could not
    /// leave out a Llama repo's original/ checkpoint.
    #[test]
    fn hub_patterns_are_globs_on_a_class() {
        let map = |k: &str, v: &str| {
            HashMap::from([
                ("source".to_string(), "hf://org/m".to_string()),
                (k.to_string(), v.to_string()),
            ])
        };
        let p = Params::parse(&map("hfIgnorePatterns", "original/*,*.pth")).unwrap();
        assert_eq!(p.source_options["hfIgnorePatterns"], "original/*,*.pth");
        Params::parse(&map("hfAllowPatterns", "*.safetensors,*.json")).unwrap();
        let e = Params::parse(&map("hfAllowPatterns", "model-[.safetensors")).unwrap_err();
        assert!(
            matches!(&e, Error::Invalid { field, message } if field == "parameters.hfAllowPatterns" && message.contains("not a glob")),
            "{e}"
        );
    }

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn modify_metadata_is_not_an_attribute() {
        let (attributes, pv) = split_modify_metadata(&map(&[
            (SEALED, "true"),
            ("csi.storage.k8s.io/pvc/name", "src"),
            ("csi.storage.k8s.io/pvc/namespace", "team-a"),
            (PV_NAME, "pvc-123"),
        ]));
        assert_eq!(
            attributes,
            BTreeMap::from([(SEALED.to_string(), "true".to_string())])
        );
        assert_eq!(pv.as_deref(), Some("pvc-123"));
        let plain: HashMap<String, String> = attributes.into_iter().collect();
        assert_eq!(parse_mutable(&plain).unwrap().sealed, Some(true));
        // A class read by the driver itself loses its secret references.
        let class = class_parameters(Some(BTreeMap::from([
            ("source".to_string(), "s3://m/x".to_string()),
            (
                "csi.storage.k8s.io/provisioner-secret-name".to_string(),
                "creds".to_string(),
            ),
        ])));
        assert_eq!(class, map(&[("source", "s3://m/x")]));
    }

    #[test]
    fn errors_name_the_parameter_and_the_choices() {
        let e = Params::parse(&map(&[("backend", "nfs")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("parameters.backend") && e.contains("local, shared, xfs"),
            "{e}"
        );
        let e = Params::parse(&map(&[("colour", "red")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("parameters.colour") && e.contains("accepted"),
            "{e}"
        );
        let e = Params::parse(&map(&[("subPath", "../etc")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("parameters.subPath"), "{e}");
        let e = Params::parse(&map(&[("imageLocation", "node")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("backend: xfs"), "{e}");
        let e = Params::parse(&map(&[("role", "source"), ("subPath", "a")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cache volumes"), "{e}");
    }

    #[test]
    fn allowed_sources_is_parsed_and_checked() {
        let p = Params::parse(&map(&[("allowedSources", "hf://, s3://models/")])).unwrap();
        let a = p.allowed_sources.unwrap();
        assert!(a.permits("hf://org/repo").is_ok());
        assert!(a.permits("file:///etc").is_err());
        let e = Params::parse(&map(&[("allowedSources", "ftp://x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("parameters.allowedSources"), "{e}");
        let e = Params::parse(&map(&[("role", "source"), ("allowedSources", "hf://")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("parameters.allowedSources"), "{e}");
    }

    #[test]
    fn signature_parameters_are_checked_together() {
        let key = include_str!("../../tests/fixtures/signing/p256.pub.pem");
        let ca = include_str!("../../tests/fixtures/signing/ca.pem");
        let p = Params::parse(&map(&[
            ("modelSignature", "required"),
            ("signaturePublicKey", key),
        ]))
        .unwrap();
        let policy = p.signature.unwrap();
        assert_eq!(policy.mode, crate::signing::Mode::Required);
        assert_eq!(policy.file, "model.sig");
        let p = Params::parse(&map(&[
            ("modelSignature", "optional"),
            ("signatureCertificateChain", ca),
            ("signatureFile", "sigs/model.sig"),
        ]))
        .unwrap();
        assert_eq!(p.signature.unwrap().file, "sigs/model.sig");
        assert!(
            Params::parse(&map(&[("modelSignature", "off")]))
                .unwrap()
                .signature
                .is_none()
        );

        for (kv, field, want) in [
            (
                vec![("modelSignature", "yes")],
                "modelSignature",
                "required, optional, off",
            ),
            (
                vec![("modelSignature", "required")],
                "modelSignature",
                "signaturePublicKey",
            ),
            (
                vec![("signaturePublicKey", key)],
                "signaturePublicKey",
                "modelSignature",
            ),
            (
                vec![("modelSignature", "off"), ("signatureFile", "x.sig")],
                "signatureFile",
                "modelSignature",
            ),
            (
                vec![
                    ("modelSignature", "required"),
                    ("signaturePublicKey", key),
                    ("signatureCertificateChain", ca),
                ],
                "signatureCertificateChain",
                "give one of",
            ),
            (
                vec![
                    ("modelSignature", "required"),
                    ("signaturePublicKey", key),
                    ("signatureFile", "../model.sig"),
                ],
                "signatureFile",
                "inside the model",
            ),
            (
                vec![
                    ("modelSignature", "required"),
                    ("signaturePublicKey", "junk"),
                ],
                "signaturePublicKey",
                "PEM",
            ),
            (
                vec![("signatureIdentity", "me@example.com")],
                "signatureIdentity",
                "modelSignature",
            ),
            (
                vec![
                    ("modelSignature", "required"),
                    ("signatureIdentity", "me@example.com"),
                ],
                "signatureIssuer",
                "OIDC issuer",
            ),
            (
                vec![
                    ("modelSignature", "required"),
                    ("signatureIdentity", "me@example.com"),
                    ("signatureIssuer", "https://issuer.example.com"),
                    ("signaturePublicKey", key),
                ],
                "signatureIdentity",
                "give one of",
            ),
            (
                vec![
                    ("role", "source"),
                    ("modelSignature", "required"),
                    ("signaturePublicKey", key),
                ],
                "modelSignature",
                "cache volumes",
            ),
        ] {
            let e = Params::parse(&map(&kv)).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { field: f, .. } if *f == format!("parameters.{field}"))
                    && e.to_string().contains(want),
                "{kv:?}: {e:?}"
            );
        }
    }

    #[test]
    fn provisioner_metadata_is_accepted() {
        let p = Params::parse(&map(&[
            ("csi.storage.k8s.io/pvc/name", "x"),
            ("backend", "shared"),
        ]))
        .unwrap();
        assert_eq!(p.backend, Some(Backend::Shared));
    }

    #[test]
    fn mutable_parameters() {
        assert_eq!(
            parse_mutable(&map(&[("sealed", "true")])).unwrap().sealed,
            Some(true)
        );
        assert_eq!(
            parse_mutable(&map(&[("pinned", "false")])).unwrap().pinned,
            Some(false)
        );
        assert_eq!(parse_mutable(&map(&[])).unwrap(), Mutable::default());
        assert!(parse_mutable(&map(&[("XXX_FakeKey", "1")])).is_err());
        assert!(parse_mutable(&map(&[("sealed", "yes")])).is_err());
    }
}
