//! CSI Identity service: who we are, what we offer, and whether every
//! enabled backend can work on this host right now.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::config::Config;
use crate::csi::identity_server::Identity;
use crate::csi::plugin_capability::{Service, service::Type as ServiceType};
use crate::csi::*;

pub struct IdentityService {
    cfg: Arc<Config>,
    controller: bool,
}

impl IdentityService {
    pub fn new(cfg: Arc<Config>, controller: bool) -> Self {
        IdentityService { cfg, controller }
    }
}

/// Reasons the enabled backends cannot work; empty when all can.
pub fn problems(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for root in cfg.roots().roots {
        // A name of this check's own: two checks at once (a liveness probe
        // beside Probe) must not remove each other's file and fail.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = std::fs::create_dir_all(&root.dir).and_then(|_| {
            let probe = root.dir.join(format!(".probe-{}-{n}", std::process::id()));
            std::fs::write(&probe, b"")?;
            std::fs::remove_file(&probe)
        }) {
            out.push(format!("{} is not writable: {e}", root.describe()));
        }
    }
    out.extend(
        cfg.backends
            .iter()
            .filter_map(|b| b.store().unusable(&cfg.shared_paths)),
    );
    out
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.cfg.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let mut types = vec![ServiceType::VolumeAccessibilityConstraints];
        if self.controller {
            types.push(ServiceType::ControllerService);
        }
        let mut capabilities: Vec<PluginCapability> = types
            .into_iter()
            .map(|t| PluginCapability {
                r#type: Some(plugin_capability::Type::Service(Service {
                    r#type: t as i32,
                })),
            })
            .collect();
        // A source grows while a pod writes it (xfs_growfs is online).
        capabilities.push(PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: plugin_capability::volume_expansion::Type::Online as i32,
                },
            )),
        });
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let cfg = self.cfg.clone();
        let problems = crate::offload::blocking(move || Ok(problems(&cfg))).await?;
        for p in &problems {
            tracing::warn!(problem = %p, "not ready");
        }
        Ok(Response::new(ProbeResponse {
            ready: Some(problems.is_empty()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forty checks at once, as a burst of liveness probes and Probe calls
    /// makes them: none sees another's probe file vanish.
    #[test]
    fn concurrent_checks_do_not_race() {
        let d = tempfile::tempdir().unwrap();
        let cfg = Config::for_node("n", d.path());
        let failed: Vec<String> = std::thread::scope(|s| {
            let all: Vec<_> = (0..40)
                .map(|_| s.spawn(|| (0..20).flat_map(|_| problems(&cfg)).collect::<Vec<_>>()))
                .collect();
            all.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        assert!(
            failed.is_empty(),
            "{} failures, first: {:?}",
            failed.len(),
            failed.first()
        );
    }
}
