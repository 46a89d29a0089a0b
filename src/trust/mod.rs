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

use ipnet::IpNet;

pub use allowed::AllowedSources;

use crate::error::{Error, Result};

/// StorageClass parameter: the URI prefixes a PVC annotation may name.
pub const ALLOWED_SOURCES: &str = "allowedSources";

/// Parameters whose URL hosts the admin chose, so a tenant's pull may reach
/// them wherever they are (a MinIO on a cluster address, for one).
const ENDPOINT_PARAMS: [&str; 3] = ["s3Endpoint", "hfEndpoint", "modelRegistryURL"];
/// The same, from the driver's environment (set by whoever deploys it).
const ENDPOINT_ENV: [&str; 5] = [
    "HF_ENDPOINT",
    "MODEL_REGISTRY_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
];

/// A source named by a tenant, and the bounds it is pulled within.
#[derive(Debug)]
pub struct Tenant {
    pub allowed: AllowedSources,
    /// Every connection of the pull goes through this.
    pub guard: egress::Guard,
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
        blocked: &[IpNet],
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
        let mut admitted = allowed.named_hosts();
        let env: Vec<String> = ENDPOINT_ENV
            .iter()
            .filter_map(|k| std::env::var(k).ok())
            .collect();
        for url in ENDPOINT_PARAMS
            .iter()
            .filter_map(|k| params.get(*k))
            .chain(env.iter())
        {
            if let Ok(u) = url::Url::parse(url)
                && let Some(host) = u.host_str()
            {
                admitted.push(host.to_string());
                if let Some(port) = u.port_or_known_default() {
                    admitted.push(format!("{host}:{port}"));
                }
            }
        }
        let guard = egress::Guard::new(egress::Policy::new(admitted, blocked.to_vec())).await?;
        Ok(Arc::new(Tenant {
            allowed: allowed.clone(),
            guard,
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
