//! CreateVolume decided before anything is written: what the request
//! resolved to (its parameters after the PVC's or pod's own source, a
//! `pvc://` claim, a content volume) becomes one `Plan`, the root, the
//! record to write and the one kind of work that makes it true.
//!
//! Pure: it reads no file and calls no API, so every rule is table-tested
//! here without root. `volumes` gathers the inputs (the API, the records)
//! and executes the plan off the async runtime.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::partial::Stage;
use crate::cache::{self, Backend, External, Role, Root, Roots, SourceId, Verify, VolumeRecord};
use crate::capability;
use crate::config::Config;
use crate::csi::{CapacityRange, Topology, TopologyRequirement, VolumeCapability};
use crate::error::{Error, Result};
use crate::progress::ProgressSink;

use super::params::{ImageLocation, Params};

/// Nominal size of a directory-backed source when the request names none.
pub const DEFAULT_CAPACITY: i64 = 1 << 30;

#[derive(Clone)]
pub struct CreateRequest {
    pub name: String,
    pub params: HashMap<String, String>,
    pub mutable: HashMap<String, String>,
    pub capabilities: Vec<VolumeCapability>,
    pub capacity: Option<CapacityRange>,
    pub content_volume: Option<String>,
    pub topology: Option<TopologyRequirement>,
    pub secrets: HashMap<String, String>,
    /// How long the caller waits; a pull still running then goes on
    /// without it (see `pulls`).
    pub budget: Option<std::time::Duration>,
    /// A source named in a pod's inline volume (`node::inline`), pulled
    /// with `secrets` as they are (the pod's own nodePublishSecretRef).
    pub inline: Option<InlineSource>,
    /// Who hears of a pull when no PVC or pod does (`prefetch`).
    pub progress: Option<Arc<dyn ProgressSink>>,
    /// The StorageClass whose parameters these are, when no PVC names it
    /// (`prefetch`).
    pub class: Option<String>,
}

/// A tenant's source from a pod spec: admitted exactly like a PVC's
/// `modelcache.csi.io/source`, against the class's allowedSources.
#[derive(Clone, Debug)]
pub struct InlineSource {
    pub uri: String,
    /// (namespace, name) of the pod, which hears of the pull.
    pub pod: Option<(String, String)>,
}

/// What the request named, once the API has been asked.
pub struct Resolved {
    /// The class's parameters, with the source the PVC, the pod or a
    /// `pvc://` claim settled on.
    pub params: Params,
    /// The volume this one is created from (dataSource, or a `pvc://`
    /// claim of this driver), with the root that holds it.
    pub content: Option<(Root, VolumeRecord)>,
    /// Another PV's bytes on this node (`pvc://` of another driver).
    pub external: Option<External>,
}

/// One CreateVolume, decided.
#[derive(Debug)]
pub struct Plan {
    pub root: Root,
    /// The record as it will be written; a cache volume's size, model and
    /// revision are known only once its source is sealed.
    pub record: VolumeRecord,
    pub work: Work,
    pub required: i64,
    pub limit: i64,
}

/// The one kind of work a plan needs.
#[derive(Debug, PartialEq)]
pub enum Work {
    /// An empty, writable source of `record.capacity_bytes`.
    NewSource,
    /// A writable copy of a source volume.
    CopySource { from: VolumeRecord },
    /// Another PV's bytes, read in place: the path must exist on the node.
    External { path: String },
    /// A cache volume of a sealed source volume.
    Clone { from: VolumeRecord },
    /// A cache volume of a model the puller fetches (or already holds),
    /// answered when `until` says.
    Pull { uri: String, until: Until },
}

/// When a pulled model's volume answers. Unless the class says, once
/// every file is verified, where the node that pulls serves the volume
/// from the pull's own files until the seal (backend local), and no
/// signature is left to check at the seal.
fn until_of(params: &Params, backend: Backend) -> Until {
    match params.progressive {
        Some(true) => Until::Listed,
        Some(false) => Until::Sealed,
        None if backend == Backend::Local && params.signature.is_none() => Until::Verified,
        None => Until::Sealed,
    }
}

/// Decides a CreateVolume from what it resolved to.
pub fn plan(cfg: &Config, roots: &Roots, req: &CreateRequest, r: Resolved) -> Result<Plan> {
    let Resolved {
        mut params,
        content,
        external,
    } = r;
    let role = role_of(&params, content.is_some(), external.is_some())?;
    // The StorageClass's source is a default; a PVC's own dataSource is
    // more specific and wins.
    if content.is_some() {
        params.source = None;
    }
    let root = root_of(
        cfg,
        roots,
        &params,
        content.as_ref().map(|(r, _)| r),
        external.is_some(),
    )?;
    capability::check(&req.capabilities, &root, role)?;
    check_topology(cfg, &root, req.topology.as_ref())?;
    let (required, limit) = capacity_range(req)?;

    let uuid = cache::uuid_for_name(&cfg.driver_name, &req.name);
    let mut record = VolumeRecord {
        id: root.volume_id(&uuid),
        name: req.name.clone(),
        backend: root.backend,
        role,
        source: SourceId::volume(&uuid)
            .ok_or_else(|| Error::Internal(format!("malformed volume uuid {uuid}")))?,
        sub_path: params.sub_path.clone(),
        model: None,
        revision: None,
        external: external.clone(),
        verify: params.verify.unwrap_or(Verify::Size),
        capacity_bytes: 0,
        node: root.node.clone(),
        content_source: content.as_ref().map(|(_, c)| c.id.clone()),
        namespace: None,
        signed_by: None,
        progressive: false,
        request: fingerprint(req),
        created_unix: cache::now_unix(),
    };
    let work = match (role, content, external) {
        (Role::Source, None, _) => {
            record.capacity_bytes = new_source_capacity(root.backend, required, limit)?;
            Work::NewSource
        }
        (Role::Source, Some((_, from)), _) => {
            record.capacity_bytes = required.max(from.capacity_bytes);
            Work::CopySource { from }
        }
        (Role::Cache, _, Some(_)) if params.signature.is_some() => {
            return Err(Error::Precondition(
                "a PV of another driver is read in place and never sealed, so this class's \
                 signature policy (modelSignature) cannot be checked over it; copy the model \
                 into a source volume of this driver and seal it, or use a class without modelSignature"
                    .into(),
            ));
        }
        (Role::Cache, _, Some(e)) => {
            // Not a source of ours: a name no source id can take.
            record.source = SourceId::external(&uuid)
                .ok_or_else(|| Error::Internal(format!("malformed volume uuid {uuid}")))?;
            record.capacity_bytes = required.max(1);
            Work::External {
                path: e.path().to_string(),
            }
        }
        (Role::Cache, Some((_, from)), None) => Work::Clone { from },
        (Role::Cache, None, None) => Work::Pull {
            uri: params.source.clone().unwrap_or_default(),
            until: until_of(&params, root.backend),
        },
    };
    Ok(Plan {
        root,
        record,
        work,
        required,
        limit,
    })
}

/// The volume's role: as the class says, else a source when nothing is
/// read from, a cache when something is; refused where it cannot be.
fn role_of(params: &Params, content: bool, external: bool) -> Result<Role> {
    let role = match (params.role, content, &params.source, external) {
        (Some(r), ..) => r,
        (None, false, None, false) => Role::Source,
        (None, ..) => Role::Cache,
    };
    if role == Role::Source && external {
        return Err(Error::invalid(
            "parameters.role",
            "a pvc:// claim of another driver can only be read: use role cache",
        ));
    }
    if role == Role::Cache && !content && params.source.is_none() && !external {
        return Err(Error::invalid(
            "parameters.role",
            "a cache volume needs a source: set parameter source to a model URI, or \
             create the PVC with a dataSource naming a sealed source PVC",
        ));
    }
    Ok(role)
}

/// The root a volume goes into. The content source decides it: a cache
/// volume reads its source in place, so it cannot live anywhere else;
/// another driver's PV (`external`) is read on its own node.
fn root_of(
    cfg: &Config,
    roots: &Roots,
    params: &Params,
    content: Option<&Root>,
    external: bool,
) -> Result<Root> {
    Ok(match content {
        Some(root) => {
            if let Some(b) = params.backend
                && b != root.backend
            {
                return Err(Error::invalid(
                    "parameters.backend",
                    format!(
                        "{b} differs from the source volume's backend {}: a volume created \
                     from a source must use the source's backend and storage",
                        root.backend
                    ),
                ));
            }
            if params.shared_path.is_some() && select_root(cfg, roots, params)?.key != root.key {
                return Err(Error::invalid(
                    "parameters.sharedPath",
                    format!("the source volume lives in {}", root.describe()),
                ));
            }
            root.clone()
        }
        None if external => roots.node_local(Backend::Local).cloned().ok_or_else(|| {
            Error::Precondition(
                "a pvc:// claim of another driver is read on the node that holds it: run the \
             controller on the node (--node-id) with backend local"
                    .into(),
            )
        })?,
        None => select_root(cfg, roots, params)?,
    })
}

/// Who wants a pull: a PVC, or the pod of an inline volume. When it is
/// gone, nothing will ever ask for the pull again, and it is cancelled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    Pvc { namespace: String, name: String },
    Pod { namespace: String, name: String },
}

impl Owner {
    pub fn namespace(&self) -> &str {
        match self {
            Owner::Pvc { namespace, .. } | Owner::Pod { namespace, .. } => namespace,
        }
    }
}

/// When a create that pulls a model may answer, and so how the pull runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// Once the model is sealed: durable, recorded, immutable.
    Sealed,
    /// Once every file is verified, its bytes maybe not yet durable: the
    /// volume is served from the pull's own files until the seal, and the
    /// pull writes through the page cache, where its pods read them.
    Verified,
    /// Once the listing is known (a progressive volume): fetched in the
    /// listing's order, each file readable as it is verified.
    Listed,
}

impl Until {
    /// Whether a pull at `stage` lets the volume answer before the seal.
    pub fn answers_at(self, stage: Stage) -> bool {
        match self {
            Until::Sealed => false,
            Until::Verified => stage == Stage::Verified,
            Until::Listed => stage >= Stage::Listed,
        }
    }
}

/// `capacity_range` as (required, limit), 0 meaning unset.
fn capacity_range(req: &CreateRequest) -> Result<(i64, i64)> {
    let (required, limit) = req
        .capacity
        .as_ref()
        .map(|c| (c.required_bytes, c.limit_bytes))
        .unwrap_or((0, 0));
    if required < 0 || limit < 0 {
        return Err(Error::invalid(
            "capacity_range",
            "required_bytes and limit_bytes must not be negative",
        ));
    }
    if limit > 0 && required > limit {
        return Err(Error::invalid(
            "capacity_range",
            format!("required_bytes {required} exceeds limit_bytes {limit}"),
        ));
    }
    Ok((required, limit))
}

/// The size of a new, empty source: what was asked, at least what its
/// backend needs, at most the limit.
fn new_source_capacity(backend: Backend, required: i64, limit: i64) -> Result<i64> {
    let min = backend.store().min_source_bytes() as i64;
    if limit > 0 && limit < min {
        return Err(Error::Unsatisfiable(format!(
            "capacity_range.limit_bytes {limit} is below the {min} bytes a source of backend \
             {backend} needs"
        )));
    }
    let capacity = if required > 0 {
        required.max(min)
    } else {
        DEFAULT_CAPACITY.max(min)
    };
    Ok(if limit > 0 {
        capacity.min(limit)
    } else {
        capacity
    })
}

/// Whether a class's volumes live on one node (`local`, `xfs` images on
/// the node) rather than on a filesystem every node mounts.
pub fn is_node_local(p: &Params) -> bool {
    // `imageLocation` is accepted for xfs only (`params`).
    p.backend
        .unwrap_or(Backend::Local)
        .store()
        .placement()
        .on_node
        && p.image_location != Some(ImageLocation::Shared)
}

/// The root a new volume without a content source goes to.
/// Where an installed driver's shared filesystem is switched on, since the
/// chart and the kustomize base ship with none.
const SHARED_OFF_HINT: &str = " (installed from deploy/: the Helm value shared.hostPath, \
     or the kustomize component deploy/csi-driver/components/shared)";

pub fn select_root(cfg: &Config, roots: &Roots, p: &Params) -> Result<Root> {
    let backend = p.backend.unwrap_or(Backend::Local);
    let node_local = is_node_local(p);
    if node_local && cfg.node_id.is_none() {
        // A claim of a node-local class reached the central controller:
        // enabling the backend here would be the wrong fix.
        return Err(Error::Precondition(format!(
            "parameters.backend: {backend} keeps each volume on one node, and only that \
             node's driver provisions it (the DaemonSet's external-provisioner, \
             --node-deployment), for a claim the scheduler has placed on the node. This is \
             the central controller, which holds no node's disk. With volumeBindingMode: \
             WaitForFirstConsumer the scheduler places the claim; with Immediate a node's \
             provisioner takes it (--node-deployment-immediate-binding, on any node the \
             class's allowedTopologies name, with the capacity). If the claim stays Pending, \
             the driver pod of its node (or of every allowed node) is not running, or no \
             allowed node has the room; for a volume every node reaches use backend: shared, \
             or xfs with imageLocation: shared"
        )));
    }
    if !cfg.backend_enabled(backend) {
        return Err(Error::invalid(
            "parameters.backend",
            format!(
                "backend {backend} is not enabled on this driver (enabled: {}); \
                 start it with --backends including {backend}{}",
                cfg.backends
                    .iter()
                    .map(|b| b.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if backend == Backend::Shared {
                    SHARED_OFF_HINT
                } else {
                    ""
                }
            ),
        ));
    }
    if node_local {
        if p.shared_path.is_some() {
            return Err(Error::invalid(
                "parameters.sharedPath",
                format!(
                    "does not apply to node-local backend {backend}; for xfs set imageLocation: shared"
                ),
            ));
        }
        return roots.node_local(backend).cloned().ok_or_else(|| {
            Error::Precondition(format!(
                "backend {backend} keeps volumes on the node, so the controller must run on \
                 the node with --node-id (distributed provisioning)"
            ))
        });
    }
    let path = match &p.shared_path {
        Some(path) => path.clone(),
        None => cfg.shared_paths.first().cloned().ok_or_else(|| {
            Error::invalid(
                "parameters.sharedPath",
                format!(
                    "backend {backend} needs a shared filesystem: start the driver with \
                     --shared-path{SHARED_OFF_HINT}"
                ),
            )
        })?,
    };
    roots.shared(backend, &path).cloned().ok_or_else(|| {
        Error::invalid(
            "parameters.sharedPath",
            format!(
                "{} is not one of the driver's --shared-path values ({})",
                path.display(),
                cfg.shared_paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })
}

/// Where a volume of `root` is reachable: its node, for node-local roots.
pub fn topology_of(cfg: &Config, root: &Root) -> Vec<Topology> {
    root.node
        .as_ref()
        .map(|n| {
            vec![Topology {
                segments: HashMap::from([(cfg.topology_key(), n.clone())]),
            }]
        })
        .unwrap_or_default()
}

/// A node-local root can serve the request only if its node is allowed.
fn check_topology(cfg: &Config, root: &Root, req: Option<&TopologyRequirement>) -> Result<()> {
    let (Some(node), Some(req)) = (&root.node, req) else {
        return Ok(());
    };
    if req.requisite.is_empty() {
        return Ok(());
    }
    let key = cfg.topology_key();
    if req
        .requisite
        .iter()
        .any(|t| t.segments.get(&key) == Some(node))
    {
        return Ok(());
    }
    Err(Error::OverLimit(format!(
        "this controller provisions {} volumes only on node {node}, which the requisite \
         topology does not include",
        root.backend
    )))
}

/// Canonical JSON of the arguments that define a volume, so a retry with
/// the same arguments matches and anything else does not.
pub fn fingerprint(req: &CreateRequest) -> String {
    use std::collections::BTreeMap;
    #[derive(serde::Serialize)]
    struct F<'a> {
        params: BTreeMap<&'a str, &'a str>,
        mutable: BTreeMap<&'a str, &'a str>,
        required: i64,
        limit: i64,
        content: Option<&'a str>,
        caps: Vec<String>,
        // Absent for every other volume, so their fingerprints are as before.
        #[serde(skip_serializing_if = "Option::is_none")]
        inline: Option<&'a str>,
    }
    let mut caps: Vec<String> = req.capabilities.iter().map(|c| format!("{c:?}")).collect();
    caps.sort();
    let f = F {
        params: req
            .params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect(),
        mutable: req
            .mutable
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect(),
        required: req.capacity.as_ref().map_or(0, |c| c.required_bytes),
        limit: req.capacity.as_ref().map_or(0, |c| c.limit_bytes),
        content: req.content_volume.as_deref(),
        caps,
        inline: req.inline.as_ref().map(|i| i.uri.as_str()),
    };
    serde_json::to_string(&f).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::volume_capability::access_mode::Mode;
    use crate::csi::volume_capability::{AccessMode, AccessType, MountVolume};
    use crate::csi::{CapacityRange, VolumeCapability};

    /// A node's controller with every backend and one shared path; nothing
    /// is created on disk.
    fn config(dir: &std::path::Path) -> Config {
        Config {
            node_id: Some("n1".into()),
            state_dir: dir.join("state"),
            shared_paths: vec![dir.join("shared")],
            backends: vec![Backend::Local, Backend::Xfs, Backend::Shared],
            ..Config::default()
        }
    }

    fn cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }
    }

    fn request(params: &[(&str, &str)]) -> CreateRequest {
        CreateRequest {
            name: "pvc-1".into(),
            params: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            mutable: HashMap::new(),
            capabilities: vec![cap(Mode::SingleNodeWriter)],
            capacity: None,
            content_volume: None,
            topology: None,
            secrets: HashMap::new(),
            budget: None,
            inline: None,
            progress: None,
            class: None,
        }
    }

    fn source_volume(root: &Root, capacity: i64) -> VolumeRecord {
        let uuid = cache::uuid_for_name("modelcache.csi.io", "the-source");
        VolumeRecord {
            id: root.volume_id(&uuid),
            name: "the-source".into(),
            backend: root.backend,
            role: Role::Source,
            source: SourceId::volume(&uuid).unwrap(),
            sub_path: None,
            model: None,
            revision: None,
            external: None,
            verify: Verify::Size,
            capacity_bytes: capacity,
            node: root.node.clone(),
            content_source: None,
            namespace: None,
            signed_by: None,
            progressive: false,
            request: String::new(),
            created_unix: 0,
        }
    }

    struct Case {
        what: &'static str,
        req: CreateRequest,
        content: Option<(Root, VolumeRecord)>,
        external: Option<External>,
    }

    fn run(cfg: &Config, c: Case) -> Result<Plan> {
        let roots = crate::cache::Roots::of(cfg);
        let params = super::super::params::Params::parse(&c.req.params)?;
        plan(
            cfg,
            &roots,
            &c.req,
            Resolved {
                params,
                content: c.content,
                external: c.external,
            },
        )
    }

    fn case(what: &'static str, req: CreateRequest) -> Case {
        Case {
            what,
            req,
            content: None,
            external: None,
        }
    }

    #[test]
    fn each_request_gets_one_kind_of_work_on_the_right_root() {
        let d = tempfile::tempdir().unwrap();
        let cfg = config(d.path());
        let roots = crate::cache::Roots::of(&cfg);
        let local = roots.node_local(Backend::Local).unwrap().clone();
        let from = source_volume(&local, 5 << 30);
        let mut sized = request(&[("backend", "xfs")]);
        sized.capacity = Some(CapacityRange {
            required_bytes: 1,
            limit_bytes: 0,
        });
        let mut bigger_copy = request(&[("role", "source")]);
        bigger_copy.capacity = Some(CapacityRange {
            required_bytes: 7 << 30,
            limit_bytes: 0,
        });
        let reader = |params: &[(&str, &str)]| {
            let mut r = request(params);
            r.capabilities = vec![cap(Mode::MultiNodeReaderOnly)];
            r
        };
        // (case, work, backend, node-local, role, capacity)
        let table: Vec<(Case, Work, Backend, bool, Role, i64)> = vec![
            (
                case("nothing named: an empty local source", request(&[])),
                Work::NewSource,
                Backend::Local,
                true,
                Role::Source,
                DEFAULT_CAPACITY,
            ),
            (
                case("a tiny xfs source is the smallest image", sized),
                Work::NewSource,
                Backend::Xfs,
                true,
                Role::Source,
                cache::xfs::MIN_IMAGE_BYTES as i64,
            ),
            (
                case(
                    "a model URI: a pulled cache volume",
                    request(&[("source", "s3://models/minilm")]),
                ),
                Work::Pull {
                    uri: "s3://models/minilm".into(),
                    until: Until::Verified,
                },
                Backend::Local,
                true,
                Role::Cache,
                0,
            ),
            (
                case(
                    "a shared pulled model for readers on every node",
                    reader(&[("backend", "shared"), ("source", "hf://org/m")]),
                ),
                Work::Pull {
                    uri: "hf://org/m".into(),
                    until: Until::Sealed,
                },
                Backend::Shared,
                false,
                Role::Cache,
                0,
            ),
            (
                Case {
                    content: Some((local.clone(), from.clone())),
                    ..case(
                        "a dataSource beats the class's source: a clone",
                        request(&[("role", "cache"), ("source", "s3://models/other")]),
                    )
                },
                Work::Clone { from: from.clone() },
                Backend::Local,
                true,
                Role::Cache,
                0,
            ),
            (
                Case {
                    content: Some((local.clone(), from.clone())),
                    ..case(
                        "a source from a source: a copy, at least as big",
                        bigger_copy,
                    )
                },
                Work::CopySource { from: from.clone() },
                Backend::Local,
                true,
                Role::Source,
                7 << 30,
            ),
            (
                Case {
                    external: Some(External::Dir {
                        path: "/mnt/disks/m".into(),
                    }),
                    ..case("another driver's PV, read in place", request(&[]))
                },
                Work::External {
                    path: "/mnt/disks/m".into(),
                },
                Backend::Local,
                true,
                Role::Cache,
                1,
            ),
        ];
        for (c, work, backend, node_local, role, capacity) in table {
            let what = c.what;
            let p = run(&cfg, c).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(p.work, work, "{what}");
            assert_eq!(p.root.backend, backend, "{what}");
            assert_eq!(p.root.node.is_some(), node_local, "{what}");
            assert_eq!(p.record.node, p.root.node, "{what}");
            assert_eq!(p.record.backend, backend, "{what}");
            assert_eq!(p.record.role, role, "{what}");
            assert_eq!(p.record.capacity_bytes, capacity, "{what}");
            assert!(p.record.id.contains(&p.root.key), "{what}: {}", p.record.id);
        }
    }

    #[test]
    fn a_bad_request_names_its_field_before_anything_is_written() {
        let d = tempfile::tempdir().unwrap();
        let cfg = config(d.path());
        let local = crate::cache::Roots::of(&cfg)
            .node_local(Backend::Local)
            .unwrap()
            .clone();
        let from = source_volume(&local, 1 << 30);
        let with_capacity = |required, limit| {
            let mut r = request(&[]);
            r.capacity = Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            });
            r
        };
        let elsewhere = {
            let mut r = request(&[]);
            r.topology = Some(TopologyRequirement {
                requisite: vec![Topology {
                    segments: HashMap::from([(cfg.topology_key(), "n2".into())]),
                }],
                preferred: vec![],
            });
            r
        };
        let mut xfs_small = request(&[("backend", "xfs")]);
        xfs_small.capacity = Some(CapacityRange {
            required_bytes: 0,
            limit_bytes: 4096,
        });
        // (case, the field an InvalidArgument names, or the other error's kind)
        let table: Vec<(Case, &str)> = vec![
            (
                case("a cache volume of nothing", request(&[("role", "cache")])),
                "parameters.role",
            ),
            (
                Case {
                    external: Some(External::Dir { path: "/x".into() }),
                    ..case(
                        "a writable view of another driver's PV",
                        request(&[("role", "source")]),
                    )
                },
                "parameters.role",
            ),
            (
                Case {
                    content: Some((local.clone(), from.clone())),
                    ..case(
                        "a clone onto another backend",
                        request(&[("backend", "xfs")]),
                    )
                },
                "parameters.backend",
            ),
            (
                case(
                    "a shared path for a node-local backend",
                    request(&[("sharedPath", "/srv/models")]),
                ),
                "parameters.sharedPath",
            ),
            (
                case(
                    "a shared path the driver does not serve",
                    request(&[("backend", "shared"), ("sharedPath", "/srv/other")]),
                ),
                "parameters.sharedPath",
            ),
            (
                case("a node-local volume for readers on every node", {
                    let mut r = request(&[("source", "s3://models/x")]);
                    r.capabilities = vec![cap(Mode::MultiNodeReaderOnly)];
                    r
                }),
                "volume_capabilities[0].access_mode",
            ),
            (
                case("a negative size", with_capacity(-1, 0)),
                "capacity_range",
            ),
            (
                case("more required than allowed", with_capacity(5, 4)),
                "capacity_range",
            ),
            (
                case("an xfs image below its minimum", xfs_small),
                "OutOfRange",
            ),
            (
                case("another node's topology", elsewhere),
                "ResourceExhausted",
            ),
        ];
        for (c, want) in table {
            let what = c.what;
            let e = run(&cfg, c).expect_err(what);
            let got = match &e {
                Error::Invalid { field, .. } => field.as_str(),
                Error::Unsatisfiable(_) => "OutOfRange",
                Error::OverLimit(_) => "ResourceExhausted",
                other => panic!("{what}: unexpected {other:?}"),
            };
            assert_eq!(got, want, "{what}: {e}");
        }
    }

    #[test]
    fn what_the_driver_was_not_started_for_is_a_precondition_or_a_field() {
        let d = tempfile::tempdir().unwrap();
        // A central controller: no node, local only.
        let central = Config {
            state_dir: d.path().join("state"),
            ..Config::default()
        };
        // A node-local class's claim at the central controller: it says
        // who provisions it instead, never to enable a backend here,
        // whether or not this controller runs that backend.
        for params in [&[][..], &[("backend", "xfs")], &[("backend", "local")]] {
            let e = run(&central, case("a node-local volume", request(params))).unwrap_err();
            assert!(
                matches!(e, Error::Precondition(ref m)
                    if m.contains("--node-deployment-immediate-binding")
                        && m.contains("allowedTopologies")
                        && m.contains("central controller")
                        && !m.contains("--backends")),
                "{params:?}: {e}"
            );
        }
        let node_local_only = Config {
            node_id: Some("n1".into()),
            ..central.clone()
        };
        let e = run(
            &node_local_only,
            case("a backend not enabled", request(&[("backend", "xfs")])),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Invalid { ref field, ref message }
                if field == "parameters.backend" && message.contains("--backends")),
            "{e}"
        );
        // The chart and the kustomize base ship without a shared
        // filesystem: the refusal says where an installed driver gets one.
        let e = run(
            &node_local_only,
            case("shared, not enabled", request(&[("backend", "shared")])),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Invalid { ref field, ref message }
                if field == "parameters.backend"
                    && message.contains("shared.hostPath")
                    && message.contains("components/shared")),
            "{e}"
        );
        let shared_only = Config {
            backends: vec![Backend::Shared],
            ..central
        };
        let e = run(
            &shared_only,
            case("no shared path", request(&[("backend", "shared")])),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Invalid { ref field, ref message } if field == "parameters.sharedPath"
                && message.contains("--shared-path") && message.contains("shared.hostPath")),
            "{e}"
        );
    }

    #[test]
    fn a_name_always_plans_the_same_volume_and_its_arguments_are_its_fingerprint() {
        let d = tempfile::tempdir().unwrap();
        let cfg = config(d.path());
        let a = run(&cfg, case("a", request(&[("source", "s3://models/x")]))).unwrap();
        let again = run(
            &cfg,
            case("a again", request(&[("source", "s3://models/x")])),
        )
        .unwrap();
        assert_eq!(a.record.id, again.record.id);
        assert_eq!(a.record.request, again.record.request);
        let changed = run(
            &cfg,
            case("a, other source", request(&[("source", "s3://models/y")])),
        )
        .unwrap();
        assert_eq!(a.record.id, changed.record.id);
        assert_ne!(a.record.request, changed.record.request);
        let mut other = request(&[("source", "s3://models/x")]);
        other.name = "pvc-2".into();
        let other = run(&cfg, case("another name", other)).unwrap();
        assert_ne!(a.record.id, other.record.id);
    }
}
