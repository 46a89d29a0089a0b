//! CSI Controller service: validate the request, lock, call the provisioner.
//!
//! Handlers stay thin; decisions live in `provision`. CreateVolume's lock
//! is the provisioner's, on the volume *name* (a retry may race its
//! original, and a resume both); everything else locks the id here.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::info_span;

use crate::capability;
use crate::csi::controller_server::Controller;
use crate::csi::controller_service_capability::{Rpc, rpc::Type as RpcType};
use crate::csi::volume_content_source::{Type as ContentType, VolumeSource};
use crate::csi::*;
use crate::error::{Error, Result};
use crate::lock::OpLocks;
use crate::rpc::{handle, require};

use crate::provision::{self, Provisioner};

#[derive(Clone)]
pub struct ControllerService {
    provisioner: Arc<Provisioner>,
    locks: OpLocks,
}

impl ControllerService {
    pub fn new(provisioner: Arc<Provisioner>) -> Self {
        ControllerService {
            provisioner,
            locks: OpLocks::default(),
        }
    }

    fn to_volume(&self, rec: &provision::VolumeRecord, topology: Vec<Topology>) -> Volume {
        Volume {
            capacity_bytes: rec.capacity_bytes,
            volume_id: rec.id.clone(),
            volume_context: self.provisioner.volume_context(rec),
            content_source: rec.content_source.as_ref().map(|id| VolumeContentSource {
                r#type: Some(ContentType::Volume(VolumeSource {
                    volume_id: id.clone(),
                })),
            }),
            accessible_topology: topology,
        }
    }

    async fn create(
        &self,
        req: CreateVolumeRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<CreateVolumeResponse> {
        require(&req.name, "name")?;
        if req.volume_capabilities.is_empty() {
            return Err(Error::invalid(
                "volume_capabilities",
                "at least one capability is required",
            ));
        }
        let content_volume = match req.volume_content_source.and_then(|c| c.r#type) {
            None => None,
            Some(ContentType::Snapshot(_)) => {
                return Err(Error::invalid(
                    "volume_content_source.snapshot",
                    "snapshots are not supported: create cache volumes from a sealed source PVC \
                     (dataSource kind PersistentVolumeClaim) or from a model URI (parameter source)",
                ));
            }
            Some(ContentType::Volume(v)) => {
                Some(require(&v.volume_id, "volume_content_source.volume.volume_id")?.to_string())
            }
        };
        let (rec, topology) = self
            .provisioner
            .create(provision::CreateRequest {
                name: req.name,
                params: req.parameters,
                mutable: req.mutable_parameters,
                capabilities: req.volume_capabilities,
                capacity: req.capacity_range,
                content_volume,
                topology: req.accessibility_requirements,
                secrets: req.secrets,
                budget,
                inline: None,
                progress: None,
                class: None,
            })
            .await?;
        tracing::info!(volume.id = %rec.id, role = rec.role.as_str(), "volume ready");
        Ok(CreateVolumeResponse {
            volume: Some(self.to_volume(&rec, topology)),
        })
    }

    async fn delete(&self, req: DeleteVolumeRequest) -> Result<DeleteVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let guard = self.locks.try_lock(&req.volume_id)?;
        guard.hold(self.provisioner.delete(&req.volume_id)).await?;
        Ok(DeleteVolumeResponse {})
    }

    async fn validate(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> Result<ValidateVolumeCapabilitiesResponse> {
        require(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(Error::invalid(
                "volume_capabilities",
                "at least one capability is required",
            ));
        }
        let (root, rec) = self.provisioner.lookup(&req.volume_id).await?;
        Ok(
            match capability::check(&req.volume_capabilities, &root, rec.role) {
                Ok(_) => ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(validate_volume_capabilities_response::Confirmed {
                        volume_context: req.volume_context,
                        volume_capabilities: req.volume_capabilities,
                        parameters: req.parameters,
                        mutable_parameters: req.mutable_parameters,
                    }),
                    message: String::new(),
                },
                Err(e) => ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: e.to_string(),
                },
            },
        )
    }

    async fn list(&self, req: ListVolumesRequest) -> Result<ListVolumesResponse> {
        if req.max_entries < 0 {
            return Err(Error::invalid("max_entries", "must not be negative"));
        }
        let max = match req.max_entries {
            0 => usize::MAX,
            n => n as usize,
        };
        let p = self.provisioner.clone();
        let (page, next_token) =
            crate::offload::blocking(move || p.list_page(&req.starting_token, max)).await?;
        let entries = page
            .into_iter()
            .map(|(rec, topo)| list_volumes_response::Entry {
                volume: Some(self.to_volume(&rec, topo)),
                status: None,
            })
            .collect();
        Ok(ListVolumesResponse {
            entries,
            next_token,
        })
    }

    async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let target = crate::rpc::grow_target(req.capacity_range.as_ref())?;
        if let Some(cap) = &req.volume_capability {
            capability::parse(cap, "volume_capability")?;
        }
        let guard = self.locks.try_lock(&req.volume_id)?;
        let (capacity_bytes, node_expansion_required) = guard
            .hold(self.provisioner.expand(&req.volume_id, target))
            .await?;
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes,
            node_expansion_required,
        })
    }

    fn capacity(&self, req: GetCapacityRequest) -> Result<GetCapacityResponse> {
        if let Some(cap) = req.volume_capabilities.first() {
            capability::parse(cap, "volume_capabilities[0]")?;
        }
        let available = self
            .provisioner
            .capacity(&req.parameters, req.accessible_topology.as_ref())?;
        Ok(GetCapacityResponse {
            available_capacity: available,
            maximum_volume_size: None,
            minimum_volume_size: None,
        })
    }

    async fn modify(
        &self,
        req: ControllerModifyVolumeRequest,
    ) -> Result<ControllerModifyVolumeResponse> {
        require(&req.volume_id, "volume_id")?;
        let guard = self.locks.try_lock(&req.volume_id)?;
        guard
            .hold(
                self.provisioner
                    .modify(&req.volume_id, &req.mutable_parameters),
            )
            .await?;
        Ok(ControllerModifyVolumeResponse {})
    }
}

fn unimplemented<T>(what: &str) -> std::result::Result<Response<T>, Status> {
    Err(Error::Unsupported(format!("{what} is not offered by modelcache-csi")).into())
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let budget = crate::rpc::budget(&request);
        let req = request.into_inner();
        handle(
            info_span!("CreateVolume", volume.name = %req.name),
            self.create(req, budget),
        )
        .await
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("DeleteVolume", volume.id = %req.volume_id),
            self.delete(req),
        )
        .await
    }

    async fn controller_publish_volume(
        &self,
        _: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        unimplemented("ControllerPublishVolume")
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume")
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("ValidateVolumeCapabilities", volume.id = %req.volume_id),
            self.validate(req),
        )
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let span = info_span!("ListVolumes");
        handle(span, self.list(req)).await
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = request.into_inner();
        handle(info_span!("GetCapacity"), async { self.capacity(req) }).await
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let capabilities = [
            RpcType::CreateDeleteVolume,
            RpcType::ListVolumes,
            RpcType::GetCapacity,
            RpcType::CloneVolume,
            RpcType::ModifyVolume,
            RpcType::ExpandVolume,
        ]
        .into_iter()
        .map(|t| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(Rpc {
                r#type: t as i32,
            })),
        })
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        _: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        unimplemented("CreateSnapshot")
    }

    async fn delete_snapshot(
        &self,
        _: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        unimplemented("DeleteSnapshot")
    }

    async fn list_snapshots(
        &self,
        _: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        unimplemented("ListSnapshots")
    }

    async fn get_snapshot(
        &self,
        _: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        unimplemented("GetSnapshot")
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("ControllerExpandVolume", volume.id = %req.volume_id),
            self.expand(req),
        )
        .await
    }

    async fn controller_get_volume(
        &self,
        _: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }

    async fn controller_modify_volume(
        &self,
        request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        handle(
            info_span!("ControllerModifyVolume", volume.id = %req.volume_id),
            self.modify(req),
        )
        .await
    }
}
