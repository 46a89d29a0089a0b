//! The CSI v1 wire types and services, generated from proto/csi/csi.proto.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("csi.v1");

/// Kubelet's plugin-registration API, from proto/csi/kubelet/pluginregistration.proto.
pub mod pluginregistration {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("pluginregistration");
}
