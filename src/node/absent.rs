//! The Node service of a controller-only process: no node capabilities, every
//! node RPC refused.
//!
//! A controller-only driver has no node to serve, but external-resizer asks
//! `NodeGetCapabilities` on the controller's socket at start (to learn whether
//! expansion needs a node step) and exits when the answer is `Unimplemented`,
//! so the controller Deployment's resizer never came up. "No capabilities" is
//! the true answer; every other node RPC says which process serves it.

use tonic::{Request, Response, Status};

use crate::csi::node_server::Node;
use crate::csi::*;

/// Answers `NodeGetCapabilities` with none; refuses the rest.
#[derive(Debug, Default, Clone, Copy)]
pub struct AbsentNode;

fn refused(rpc: &str) -> Status {
    crate::error::Error::Unsupported(format!(
        "{rpc}: this modelcache-csi process runs --mode=controller; node RPCs go to the node plugin (--mode=node or all)"
    ))
    .into()
}

#[tonic::async_trait]
impl Node for AbsentNode {
    async fn node_stage_volume(
        &self,
        _: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        Err(refused("NodeStageVolume"))
    }

    async fn node_unstage_volume(
        &self,
        _: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        Err(refused("NodeUnstageVolume"))
    }

    async fn node_publish_volume(
        &self,
        _: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        Err(refused("NodePublishVolume"))
    }

    async fn node_unpublish_volume(
        &self,
        _: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        Err(refused("NodeUnpublishVolume"))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        Err(refused("NodeGetVolumeStats"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        Err(refused("NodeExpandVolume"))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse::default()))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Err(refused("NodeGetInfo"))
    }
}
