//! The CSI v1 wire types and services, generated from proto/csi/csi.proto.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("csi.v1");
