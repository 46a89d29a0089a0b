//! Who may name what. An admin's StorageClass names any source; a tenant's
//! PVC annotation may name only what the class's `allowedSources` admits,
//! is pulled through the egress guard, and with the PVC's own secret only.
//!
//! This module decides; it never fetches. The puller obeys the `Tenant`
//! scope it is handed (no admin credentials, every connection through the
//! guard) and the controller refuses what `Tenant::admit` refuses. See
//! docs/security.md for the threat model.

pub mod allowed;
pub mod egress;

use std::sync::Arc;

pub use allowed::AllowedSources;

use crate::error::{Error, Result};

/// StorageClass parameter: the URI prefixes a PVC annotation may name.
pub const ALLOWED_SOURCES: &str = "allowedSources";

/// Parameters whose URL hosts the admin chose, so a tenant's pull may reach
/// them wherever they are (a MinIO on a cluster address, for one).
const ENDPOINT_PARAMS: [&str; 3] = ["s3Endpoint", "hfEndpoint", "modelRegistryURL"];

/// The driver's own environment, as far as pulls read it: default
/// endpoints and credentials an admin set on the driver's container, and
/// the S3 client's `AWS_*` settings. Read once at start-up, so that library
/// code never consults the process's environment and tests give each
/// driver its own.
#[derive(Clone, Default)]
pub struct AdminEnv {
    vars: std::collections::BTreeMap<&'static str, String>,
    /// Every `AWS_*` variable: the S3 client's region, endpoint and
    /// credential chain (keys, web identity, container and instance
    /// metadata), as the AWS SDKs read them.
    aws: std::collections::BTreeMap<String, String>,
}

/// Names only: the values hold credentials.
impl std::fmt::Debug for AdminEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminEnv")
            .field("vars", &self.vars.keys().collect::<Vec<_>>())
            .field("aws", &self.aws.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl AdminEnv {
    /// Endpoints an admin's environment names: tenants' pulls may reach
    /// their hosts, as the class's own endpoint parameters.
    pub const ENDPOINTS: [&'static str; 5] = [
        "HF_ENDPOINT",
        "MODEL_REGISTRY_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT",
    ];
    /// Credentials, used only by pulls the admin vouches for.
    pub const CREDENTIALS: [&'static str; 1] = ["HF_TOKEN"];

    fn names() -> impl Iterator<Item = &'static str> {
        Self::ENDPOINTS.into_iter().chain(Self::CREDENTIALS)
    }

    /// The variables above and every `AWS_*` one, from this process's
    /// environment.
    pub fn from_process() -> AdminEnv {
        Self::from_pairs(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// Only the variables above and `AWS_*` are kept; an empty value counts
    /// as unset.
    pub fn from_pairs<K: AsRef<str>>(pairs: impl IntoIterator<Item = (K, String)>) -> AdminEnv {
        let mut env = AdminEnv::default();
        for (k, v) in pairs {
            let k = k.as_ref();
            if v.trim().is_empty() {
                continue;
            }
            if k.starts_with("AWS_") {
                env.aws.insert(k.to_string(), v.clone());
            }
            if let Some(name) = Self::names().find(|&n| n == k) {
                env.vars.insert(name, v);
            }
        }
        env
    }

    /// The `AWS_*` variables, for the S3 client to configure itself from.
    pub fn aws(&self) -> impl Iterator<Item = (&str, &str)> {
        self.aws.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars.get(key).map(String::as_str)
    }

    /// The endpoints set, in [`AdminEnv::ENDPOINTS`] order.
    pub fn endpoints(&self) -> impl Iterator<Item = &str> {
        Self::ENDPOINTS.into_iter().filter_map(|k| self.get(k))
    }
}

/// StorageClass parameter: the URI prefixes a model registry's answer may
/// carry the class's credentials to (its provisioner secret and the
/// driver's environment); any other answer is pulled with none.
pub const ARTIFACT_CREDENTIALS: &str = "artifactCredentials";

/// What a URI the class did not write itself may reach: a tenant's
/// annotation or inline attribute, or a model registry's answer to the
/// class's own `model-registry://` source.
#[derive(Clone, Debug, Default)]
pub struct Bounds {
    /// `allowedSources`.
    pub allowed: Option<AllowedSources>,
    /// `artifactCredentials`.
    pub credentialed: Option<AllowedSources>,
    /// The node's networks closed to, or opened for, such pulls.
    pub ranges: egress::Ranges,
}

/// A source named by someone the admin does not vouch for (a tenant, or
/// whoever registers model versions), and the bounds it is pulled within.
#[derive(Debug)]
pub struct Tenant {
    pub allowed: AllowedSources,
    /// Every connection of the pull goes through this.
    pub guard: Arc<egress::Guard>,
    /// The class's and the driver's credentials may follow this pull (a
    /// registry answer within `artifactCredentials`); otherwise only the
    /// requester's own secret is used.
    pub credentials: bool,
}

impl Tenant {
    /// The scope for a source named in `field` (a PVC annotation), under a
    /// class whose `allowedSources` is `allowed` and whose other parameters
    /// are `params`.
    pub async fn admit(
        field: &str,
        uri: &str,
        allowed: Option<&AllowedSources>,
        params: &std::collections::BTreeMap<String, String>,
        ranges: &egress::Ranges,
        env: &AdminEnv,
    ) -> Result<Arc<Tenant>> {
        let allowed = allowed.ok_or_else(|| {
            Error::invalid(
                field,
                format!(
                    "this StorageClass does not let PVCs or inline volumes name their own source; an admin must \
                     set the StorageClass parameter {ALLOWED_SOURCES} (comma-separated URI \
                     prefixes, e.g. hf://,s3://models/) to allow it"
                ),
            )
        })?;
        allowed
            .permits(uri)
            .map_err(|m| Error::NotAllowed(format!("{field}: {m}")))?;
        Tenant::scope(allowed, params, ranges, env, false).await
    }

    /// The scope for a model registry's answer to a `model-registry://`
    /// source that the class itself names: whoever registers a version
    /// chooses that URI, so it is held to the class's `allowedSources`
    /// like a tenant's (without one, only the registry's own host), goes
    /// through the egress guard, and carries the class's credentials only
    /// within `artifactCredentials`.
    pub async fn registry_answer(
        artifact: &str,
        registry: &url::Url,
        params: &std::collections::BTreeMap<String, String>,
        bounds: &Bounds,
        env: &AdminEnv,
    ) -> Result<Arc<Tenant>> {
        const WHAT: &str = "the model registry's artifact URI";
        let own_host;
        let allowed = match &bounds.allowed {
            Some(a) => a,
            None => {
                let (Some(host), Some(port)) =
                    (registry.host_str(), registry.port_or_known_default())
                else {
                    return Err(Error::Internal(format!(
                        "registry URL {registry} has no host"
                    )));
                };
                own_host = AllowedSources::parse(&format!(
                    "{}://{}/",
                    registry.scheme(),
                    egress::host_port(host, port)
                ))
                .map_err(Error::Internal)?;
                if own_host.permits(artifact).is_err() {
                    return Err(Error::NotAllowed(format!(
                        "{WHAT} {} is not on the registry's own host, and this StorageClass does not \
                         say what else a registry may answer with: an admin must list the artifacts' \
                         URI prefixes (e.g. s3://models/) in the StorageClass parameter {ALLOWED_SOURCES}",
                        allowed::shown(artifact)
                    )));
                }
                &own_host
            }
        };
        allowed
            .permits(artifact)
            .map_err(|m| Error::NotAllowed(format!("{WHAT}: {m}")))?;
        let credentials = bounds
            .credentialed
            .as_ref()
            .is_some_and(|c| c.permits(artifact).is_ok());
        Tenant::scope(allowed, params, &bounds.ranges, env, credentials).await
    }

    /// A pull within `allowed`, behind a guard of its own that admits the
    /// hosts the class names.
    async fn scope(
        allowed: &AllowedSources,
        params: &std::collections::BTreeMap<String, String>,
        ranges: &egress::Ranges,
        env: &AdminEnv,
        credentials: bool,
    ) -> Result<Arc<Tenant>> {
        let policy = egress::Policy::tenant(admitted_hosts(allowed, params, env), ranges.clone());
        Ok(Arc::new(Tenant {
            allowed: allowed.clone(),
            guard: Arc::new(egress::Guard::new(policy).await?),
            credentials,
        }))
    }

    /// A URI the pull reached on its own (a registry's artifact URI) must
    /// be one the class allows, too.
    pub fn recheck(&self, what: &str, uri: &str) -> Result<()> {
        self.allowed
            .permits(uri)
            .map_err(|m| Error::NotAllowed(format!("{what}: {m}")))
    }
}

/// The `host:port`s a class names: its prefixes' hosts and its endpoint
/// parameters' (and the driver's environment's, set by whoever deploys
/// it), each on its own port only.
fn admitted_hosts(
    allowed: &AllowedSources,
    params: &std::collections::BTreeMap<String, String>,
    env: &AdminEnv,
) -> Vec<String> {
    let mut admitted = allowed.named_hosts();
    for url in ENDPOINT_PARAMS
        .iter()
        .filter_map(|k| params.get(*k).map(String::as_str))
        .chain(env.endpoints())
    {
        if let Ok(u) = url::Url::parse(url)
            && let (Some(host), Some(port)) = (u.host_str(), u.port_or_known_default())
        {
            admitted.push(egress::host_port(host, port));
        }
    }
    admitted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_environment_endpoints_are_admitted_like_the_class_parameters() {
        let allowed = AllowedSources::parse("hf://").unwrap();
        let params = [("s3Endpoint".to_string(), "http://10.0.0.5:9000".to_string())].into();
        let env = AdminEnv::from_pairs([
            ("HF_ENDPOINT", "http://10.0.0.7:8080".to_string()),
            ("AWS_ENDPOINT", String::new()),
            ("PATH", "/bin".to_string()),
        ]);
        let hosts = admitted_hosts(&allowed, &params, &env);
        assert!(hosts.contains(&"10.0.0.5:9000".to_string()), "{hosts:?}");
        assert!(hosts.contains(&"10.0.0.7:8080".to_string()), "{hosts:?}");
        let without = admitted_hosts(&allowed, &params, &AdminEnv::default());
        assert!(
            !without.contains(&"10.0.0.7:8080".to_string()),
            "{without:?}"
        );
    }

    #[test]
    fn the_admin_environment_keeps_only_what_pulls_read() {
        let env = AdminEnv::from_pairs([
            ("HF_TOKEN", "t".to_string()),
            ("AWS_ENDPOINT_URL", "http://s3.local".to_string()),
            ("HF_ENDPOINT", " ".to_string()),
            ("HOME", "/root".to_string()),
        ]);
        assert_eq!(env.get("HF_TOKEN"), Some("t"));
        assert_eq!(env.get("HF_ENDPOINT"), None, "blank is unset");
        assert_eq!(env.get("HOME"), None, "not a variable pulls read");
        assert_eq!(env.endpoints().collect::<Vec<_>>(), ["http://s3.local"]);
        assert_eq!(
            env.aws().collect::<Vec<_>>(),
            [("AWS_ENDPOINT_URL", "http://s3.local")]
        );
    }

    #[test]
    fn the_admin_environment_never_prints_a_value() {
        let env = AdminEnv::from_pairs([
            ("HF_TOKEN", "hf_secretvalue".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "awssecretvalue".to_string()),
        ]);
        let shown = format!("{env:?}");
        assert!(
            shown.contains("HF_TOKEN") && shown.contains("AWS_SECRET_ACCESS_KEY"),
            "{shown}"
        );
        assert!(!shown.contains("secretvalue"), "{shown}");
    }
}
