//! CSI Node service: validate the request, lock the volume, call `ops`.

pub mod absent;
pub mod inline;
pub mod ops;
pub mod progressive;
pub mod registration;
pub mod verify;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::info_span;

use crate::capability;
use crate::csi::node_server::Node;
use crate::csi::node_service_capability::{Rpc, rpc::Type as RpcType};
use crate::csi::*;
use crate::error::{Error, Result};
use crate::lock::OpLocks;
use crate::rpc::{handle, require};

pub use ops::NodeOps;

pub struct NodeService {
    ops: Arc<NodeOps>,
    /// Inline volumes, when this process also runs the controller.
    inline: Option<Arc<inline::Inline>>,
    locks: OpLocks,
}

fn path(value: &str, field: &str) -> Result<PathBuf> {
    let p = PathBuf::from(require(value, field)?);
    if !p.is_absolute() {
        return Err(Error::invalid(
            field,
            format!("{value:?} must be an absolute path"),
        ));
    }
    Ok(p)
}

fn capability_of(cap: Option<&VolumeCapability>) -> Result<capability::MountRequest> {
    let cap = cap.ok_or_else(|| Error::invalid("volume_capability", "is required"))?;
    capability::parse(cap, "volume_capability")
}

impl NodeService {
    pub fn new(ops: Arc<NodeOps>) -> Self {
        NodeService {
            ops,
            inline: None,
            locks: OpLocks::default(),
        }
    }

    pub fn with_inline(mut self, inline: Arc<inline::Inline>) -> Self {
        self.inline = Some(inline);
        self
    }

    async fn stage(
        &self,
        req: NodeStageVolumeRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<NodeStageVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let staging = path(&req.staging_target_path, "staging_target_path")?;
        let cap = capability_of(req.volume_capability.as_ref())?;
        let guard = self.locks.try_lock(&req.volume_id)?;
        guard
            .hold(self.ops.stage(&req.volume_id, staging, cap, budget))
            .await?;
        tracing::info!("staged");
        Ok(NodeStageVolumeResponse {})
    }

    async fn expand(&self, req: NodeExpandVolumeRequest) -> Result<NodeExpandVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        // The record is read under the volume's lock, so a grow that just
        // finished is seen; and an unknown volume is the first thing to say
        // (csi-sanity asks for NotFound before the path is looked at).
        let guard = self.locks.try_lock(&req.volume_id)?;
        guard.hold(self.expand_held(req)).await
    }

    /// The rest of `expand`, under the volume's lock.
    async fn expand_held(&self, req: NodeExpandVolumeRequest) -> Result<NodeExpandVolumeResponse> {
        let found = self.ops.lookup(&req.volume_id).await?;
        let volume_path = path(&req.volume_path, "volume_path")?;
        let staging = match req.staging_target_path.as_str() {
            "" => None,
            s => Some(path(s, "staging_target_path")?),
        };
        let target = match &req.capacity_range {
            Some(_) => Some(crate::rpc::grow_target(req.capacity_range.as_ref())?),
            None => None,
        };
        if let Some(cap) = &req.volume_capability {
            capability::parse(cap, "volume_capability")?;
        }
        let capacity_bytes = self.ops.expand(found, volume_path, staging, target).await?;
        tracing::info!(capacity_bytes, "expanded");
        Ok(NodeExpandVolumeResponse { capacity_bytes })
    }

    async fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<NodeUnstageVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let staging = path(&req.staging_target_path, "staging_target_path")?;
        let guard = self.locks.try_lock(&req.volume_id)?;
        guard
            .hold(self.ops.unstage(&req.volume_id, staging))
            .await?;
        tracing::info!("unstaged");
        Ok(NodeUnstageVolumeResponse {})
    }

    async fn publish(
        &self,
        req: NodePublishVolumeRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<NodePublishVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let target = path(&req.target_path, "target_path")?;
        let cap = capability_of(req.volume_capability.as_ref())?;
        if inline::is_inline(&req.volume_context) {
            let inline = self.inline.as_ref().ok_or_else(|| {
                Error::Precondition(
                    "inline volumes need the controller service in the node's driver \
                     (--mode all, as deploy/csi-driver runs it)"
                        .into(),
                )
            })?;
            let guard = self.locks.try_lock(&req.volume_id)?;
            let capability = req.volume_capability.clone().unwrap_or_default();
            guard
                .hold(inline.publish(
                    &req.volume_id,
                    &req.volume_context,
                    &req.secrets,
                    capability,
                    cap,
                    target,
                    budget,
                ))
                .await?;
            tracing::info!("published an inline volume");
            return Ok(NodePublishVolumeResponse {});
        }
        let staging = path(&req.staging_target_path, "staging_target_path")?;
        let guard = self.locks.try_lock_at(&req.volume_id, &target)?;
        guard
            .hold(
                self.ops
                    .publish(&req.volume_id, staging, target, cap, req.readonly),
            )
            .await?;
        tracing::info!("published");
        Ok(NodePublishVolumeResponse {})
    }

    async fn unpublish(
        &self,
        req: NodeUnpublishVolumeRequest,
    ) -> Result<NodeUnpublishVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let target = path(&req.target_path, "target_path")?;
        let guard = self.locks.try_lock_at(&req.volume_id, &target)?;
        guard
            .hold(async {
                if let Some(inline) = &self.inline
                    && inline.unpublish(&req.volume_id, target.clone()).await?
                {
                    tracing::info!("unpublished an inline volume and released its model");
                    return Ok(NodeUnpublishVolumeResponse {});
                }
                self.ops.unpublish(target).await?;
                tracing::info!("unpublished");
                Ok(NodeUnpublishVolumeResponse {})
            })
            .await
    }

    async fn stats(&self, req: NodeGetVolumeStatsRequest) -> Result<NodeGetVolumeStatsResponse> {
        require(&req.volume_id, "volume_id")?;
        let vpath = PathBuf::from(require(&req.volume_path, "volume_path")?);
        let staging =
            (!req.staging_target_path.is_empty()).then(|| PathBuf::from(&req.staging_target_path));
        let (st, condition) = self.ops.stats(&req.volume_id, vpath, staging).await?;
        let frsize = st.fragment_size() as i64;
        let total = st.blocks() as i64 * frsize;
        let available = st.blocks_available() as i64 * frsize;
        let used = total - st.blocks_free() as i64 * frsize;
        let inodes = st.files() as i64;
        let inodes_free = st.files_available() as i64;
        Ok(NodeGetVolumeStatsResponse {
            usage: vec![
                VolumeUsage {
                    available,
                    total,
                    used,
                    unit: volume_usage::Unit::Bytes as i32,
                },
                VolumeUsage {
                    available: inodes_free,
                    total: inodes,
                    used: inodes - st.files_free() as i64,
                    unit: volume_usage::Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(VolumeCondition {
                abnormal: condition.abnormal,
                message: condition.message,
            }),
        })
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let budget = crate::rpc::budget(&request);
        let req = request.into_inner();
        let span = info_span!("NodeStageVolume", volume.id = %req.volume_id, staging = %req.staging_target_path);
        handle(span, self.stage(req, budget)).await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = info_span!("NodeUnstageVolume", volume.id = %req.volume_id, staging = %req.staging_target_path);
        handle(span, self.unstage(req)).await
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let budget = crate::rpc::budget(&request);
        let req = request.into_inner();
        let span =
            info_span!("NodePublishVolume", volume.id = %req.volume_id, target = %req.target_path);
        handle(span, self.publish(req, budget)).await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let span = info_span!("NodeUnpublishVolume", volume.id = %req.volume_id, target = %req.target_path);
        handle(span, self.unpublish(req)).await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("NodeGetVolumeStats", volume.id = %req.volume_id),
            self.stats(req),
        )
        .await
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("NodeExpandVolume", volume.id = %req.volume_id),
            self.expand(req),
        )
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            RpcType::StageUnstageVolume,
            RpcType::GetVolumeStats,
            RpcType::VolumeCondition,
            RpcType::ExpandVolume,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let node_id = self.ops.cfg.node_id.clone().unwrap_or_default();
        Ok(Response::new(NodeGetInfoResponse {
            accessible_topology: Some(Topology {
                segments: HashMap::from([(self.ops.cfg.topology_key(), node_id.clone())]),
            }),
            node_id,
            max_volumes_per_node: 0,
        }))
    }
}
