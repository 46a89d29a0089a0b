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
        let problems =
            crate::offload::blocking(move || Ok(crate::provision::health::problems(&cfg))).await?;
        for p in &problems {
            tracing::warn!(problem = %p, "not ready");
        }
        Ok(Response::new(ProbeResponse {
            ready: Some(problems.is_empty()),
        }))
    }
}
