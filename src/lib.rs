//! modelcache-csi: a CSI driver that puts sealed, verified machine-learning
//! models into pods as shared read-only volumes.

pub mod admin; // `modelcache-csi cache`: the node operator's view of the cache
pub mod beneath; // openat2 beneath a directory, retried while a rename settles
pub mod cache; // sealed sources, seals and volume records on disk
pub mod capability; // what a VolumeCapability asks for, and whether we can give it
pub mod client; // CSI client over a Unix socket
pub mod config; // process settings from flags
pub mod conns; // connections an open listener takes: bounded in all and per source, stalls cut off
pub mod context; // what one process's handlers and reconcilers share
pub mod controller; // CSI Controller service: validate, lock, call the provisioner
pub mod csi; // generated CSI v1 types and services
pub mod demo; // the `demo` command
pub mod error; // the domain error and its one mapping to gRPC codes
pub mod identity; // CSI Identity service and readiness
pub mod kubeapi; // the requesting PVC, pvc:// claims and PVC events, via the Kubernetes API
pub mod lock; // per-volume operation guards
pub mod metrics; // Prometheus metrics and the /metrics, /healthz endpoint
pub mod modify_agent; // on a node: VolumeAttributesClass changes to its node-local volumes
pub mod mount; // mounts, the mount table, loop devices, safe subpaths
pub mod node; // CSI Node service: stage, publish, stats
pub mod offload; // blocking filesystem work, off the async runtime's threads
pub mod outcome; // one result of work that outlives its callers, awaited within each deadline
pub mod peer; // peer fill: serving sealed models to other nodes, filling from them first
pub mod prefetch; // on a node: ModelPrefetch models pulled before any pod asks
pub mod progress; // a pull's progress, and where it is reported
pub mod progressive; // progressive volumes: a FUSE view of a model still arriving, verified bytes only
pub mod provision; // requests turned into volumes: resolve, plan, execute, seal, delete
pub mod puller; // model URIs fetched and sealed by the driver
pub mod requests; // CSI requests as a CO sends them, for the demo, benchmarks and tests
pub mod rescheduler; // clears selected-node from PVCs stuck on nodes without the driver
pub mod retry; // work that may pass later, tried again with the crate's one backoff
#[cfg(test)]
mod rootless; // the rootless tier: both services in process over the fake mounter
pub mod rpc; // the edge of every handler: required fields, logging, status
pub mod server; // binding the endpoint and serving
pub mod signing; // model signatures (OpenSSF model-signing bundles) checked against a key and a seal
pub mod state; // atomic, durable JSON records
pub mod trust; // what a tenant may name as a source, and the network its pull may reach
pub mod uds; // binding our Unix sockets, and the shim that lets any gRPC client in
pub mod uri; // model URIs as values: shown without secrets, the pvc:// form
