//! CSI ephemeral inline volumes: a model named in the pod spec
//! (`volumeAttributes.source`), pulled or reused, staged and published
//! read-only at NodePublish, and released at NodeUnpublish so eviction can
//! reclaim it.
//!
//! There is no StorageClass in a pod spec, so the admin names one
//! (`--inline-storage-class`): its parameters govern every inline volume
//! (backend, allowedSources, endpoints, limits, verify) exactly as they
//! govern a PVC that names its own source. The source is the tenant's and is
//! admitted the same way (docs/security.md); the credentials are the pod's
//! own `nodePublishSecretRef`, never the class's.
//!
//! Underneath, an inline volume is a cache volume of this node's controller
//! (named after kubelet's volume id), staged at a private path in the state
//! dir. A small record there ties the two, so NodeUnpublish, a retry or a
//! restart finds what to undo.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::capability::MountRequest;
use crate::context::Context;
use crate::csi::VolumeCapability;
use crate::error::{Error, IoContext, Result};
use crate::offload::blocking;
use crate::provision::Provisioner;
use crate::provision::{CreateRequest, InlineSource};
use crate::state;

use super::ops::NodeOps;

/// kubelet marks an inline volume's NodePublish with this.
pub const EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";
const POD_NAME: &str = "csi.storage.k8s.io/pod.name";
const POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
/// Keys kubelet adds (podInfoOnMount); not the user's attributes.
const KUBELET_PREFIX: &str = "csi.storage.k8s.io/";

/// What a pod's `volumeAttributes` may hold.
pub const SOURCE: &str = "source";
pub const SUB_PATH: &str = "subPath";

/// Whether a NodePublish is for an inline volume.
pub fn is_inline(context: &HashMap<String, String>) -> bool {
    context.get(EPHEMERAL).is_some_and(|v| v == "true")
}

/// A pod's inline volume, as its attributes ask for it.
#[derive(Debug, PartialEq, Eq)]
pub struct Wanted {
    pub source: String,
    pub sub_path: Option<String>,
    /// (namespace, name) of the pod, for its events.
    pub pod: Option<(String, String)>,
}

/// Reads and checks a pod's `volumeAttributes`: `source` is required and
/// nothing but `source` and `subPath` is accepted, so a typo is an error
/// rather than a silently different volume.
pub fn parse(context: &HashMap<String, String>) -> Result<Wanted> {
    let mut keys: Vec<&String> = context
        .keys()
        .filter(|k| !k.starts_with(KUBELET_PREFIX))
        .collect();
    keys.sort();
    for k in keys {
        if k != SOURCE && k != SUB_PATH {
            return Err(Error::invalid(
                format!("volumeAttributes.{k}"),
                format!(
                    "unknown attribute of an inline volume; accepted: {SOURCE}, {SUB_PATH} \
                     (everything else comes from the admin's inline StorageClass)"
                ),
            ));
        }
    }
    let source = context
        .get(SOURCE)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            Error::invalid(
                format!("volumeAttributes.{SOURCE}"),
                "is required: the model URI, e.g. hf://org/repo@revision",
            )
        })?
        .clone();
    let sub_path = context.get(SUB_PATH).filter(|s| !s.is_empty()).cloned();
    if let Some(s) = &sub_path {
        crate::mount::subpath::validate_syntax(s)
            .map_err(|m| Error::invalid(format!("volumeAttributes.{SUB_PATH}"), m))?;
    }
    let pod = match (context.get(POD_NAMESPACE), context.get(POD_NAME)) {
        (Some(ns), Some(name)) => Some((ns.clone(), name.clone())),
        _ => None,
    };
    Ok(Wanted {
        source,
        sub_path,
        pod,
    })
}

/// kubelet's inline volume ids are `csi-<hex>`; anything that could leave
/// the inline directory is refused before it names a path.
fn check_id(volume_id: &str) -> Result<()> {
    let ok = !volume_id.is_empty()
        && volume_id.len() <= 128
        && volume_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && !volume_id.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "volume_id",
            format!(
                "{volume_id:?} is not an inline volume id (letters, digits, '-' and '_', at most 128)"
            ),
        ))
    }
}

/// Ties kubelet's inline volume id to the cache volume behind it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    cache_volume: String,
}

pub struct Inline {
    ctx: Context,
    provisioner: Arc<Provisioner>,
    ops: Arc<NodeOps>,
    dir: PathBuf,
}

impl Inline {
    pub fn new(ctx: &Context, provisioner: Arc<Provisioner>, ops: Arc<NodeOps>) -> Inline {
        Inline {
            dir: ctx.cfg.state_dir.join("inline"),
            ctx: ctx.clone(),
            provisioner,
            ops,
        }
    }

    fn record_path(&self, volume_id: &str) -> PathBuf {
        self.dir.join(format!("{volume_id}.json"))
    }

    fn staging(&self, volume_id: &str) -> PathBuf {
        self.dir.join(volume_id)
    }

    /// NodePublish of an inline volume: pull or reuse the model, stage it
    /// privately, publish it read-only. A pull that outlasts `budget`
    /// answers UNAVAILABLE with its progress and goes on; kubelet's retry
    /// joins it.
    #[allow(clippy::too_many_arguments)]
    pub async fn publish(
        &self,
        volume_id: &str,
        context: &HashMap<String, String>,
        secrets: &HashMap<String, String>,
        capability: VolumeCapability,
        mount: MountRequest,
        target: PathBuf,
        budget: Option<Duration>,
    ) -> Result<()> {
        check_id(volume_id)?;
        let wanted = parse(context)?;
        let class = self.ctx.cfg.inline_class.as_deref().ok_or_else(|| {
            Error::Precondition(
                "inline volumes of this driver are off: an admin enables them by naming a \
                 StorageClass of this driver with --inline-storage-class (its parameters, \
                 allowedSources above all, decide what pods may name)"
                    .into(),
            )
        })?;
        let kube = self.ctx.kube.as_ref().ok_or_else(|| {
            Error::Precondition(
                "inline volumes need the driver's Kubernetes API access (--kube-api), to read \
                 the inline StorageClass"
                    .into(),
            )
        })?;
        let sc = kube.storage_class(class).await.map_err(|e| match e {
            Error::NotFound(_) => Error::Precondition(format!(
                "inline volumes follow StorageClass {class} (--inline-storage-class), which does \
                 not exist: an admin creates it to enable them, with allowedSources naming what \
                 pods may pull (deploy/csi-driver/examples/inline.yaml)"
            )),
            e => e,
        })?;
        if sc.provisioner != self.ctx.cfg.driver_name {
            return Err(Error::Precondition(format!(
                "--inline-storage-class {class} is a StorageClass of {}, not of {}",
                sc.provisioner, self.ctx.cfg.driver_name
            )));
        }
        let mut params = crate::provision::params::class_parameters(sc.parameters);
        // The volume reads a model; what it reads is the pod's to name.
        params.remove(crate::provision::params::SOURCE);
        if let Some(sub) = &wanted.sub_path {
            params.insert(crate::provision::params::SUB_PATH.into(), sub.clone());
        }
        let record_path = self.record_path(volume_id);
        let name = format!("inline-{volume_id}");
        let (rec, _) = self
            .provisioner
            .create(CreateRequest {
                name,
                params,
                mutable: HashMap::new(),
                capabilities: vec![capability],
                capacity: None,
                content_volume: None,
                topology: None,
                secrets: secrets.clone(),
                budget,
                inline: Some(InlineSource {
                    uri: wanted.source.clone(),
                    pod: wanted.pod.clone(),
                }),
                progress: None,
                class: None,
            })
            .await?;
        // Recorded before anything is mounted: whatever happens next,
        // NodeUnpublish finds the volume to release.
        {
            let (p, r) = (
                record_path.clone(),
                Record {
                    cache_volume: rec.id.clone(),
                },
            );
            let dir = self.dir.clone();
            blocking(move || {
                std::fs::create_dir_all(&dir).ctx("create", &dir)?;
                state::write_json(&p, &r).ctx("write", &p)
            })
            .await?;
        }
        let staging = self.staging(volume_id);
        {
            let s = staging.clone();
            blocking(move || std::fs::create_dir_all(&s).ctx("create", &s)).await?;
        }
        self.ops
            .stage(&rec.id, staging.clone(), mount.clone(), budget)
            .await?;
        self.ops
            .publish(&rec.id, staging, target, mount, true)
            .await
    }

    /// NodeUnpublish: `Ok(false)` when `volume_id` is not an inline volume
    /// of this node. Idempotent: each step tolerates its work being done.
    pub async fn unpublish(&self, volume_id: &str, target: PathBuf) -> Result<bool> {
        if check_id(volume_id).is_err() {
            return Ok(false);
        }
        let record_path = self.record_path(volume_id);
        let rec: Option<Record> = {
            let p = record_path.clone();
            blocking(move || state::read_json(&p).ctx("read", &p)).await?
        };
        let Some(rec) = rec else {
            return Ok(false);
        };
        self.ops.unpublish(target).await?;
        let staging = self.staging(volume_id);
        self.ops.unstage(&rec.cache_volume, staging.clone()).await?;
        // The reference goes with the cache volume: the model is evictable
        // once no other volume reads it.
        self.provisioner.delete(&rec.cache_volume).await?;
        blocking(move || {
            match std::fs::remove_dir(&staging) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &staging, e)),
            }
            state::remove_file(&record_path).ctx("remove", &record_path)
        })
        .await?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn attributes_name_a_source_and_nothing_unknown() {
        let ok = parse(&ctx(&[
            (EPHEMERAL, "true"),
            (POD_NAME, "p"),
            (POD_NAMESPACE, "team-a"),
            (SOURCE, "hf://org/m@abc"),
            (SUB_PATH, "onnx"),
        ]))
        .unwrap();
        assert_eq!(
            ok,
            Wanted {
                source: "hf://org/m@abc".into(),
                sub_path: Some("onnx".into()),
                pod: Some(("team-a".into(), "p".into())),
            }
        );
        let cases = [
            (ctx(&[(EPHEMERAL, "true")]), "volumeAttributes.source"),
            (ctx(&[(SOURCE, "")]), "volumeAttributes.source"),
            (
                ctx(&[(SOURCE, "hf://o/m"), ("s3Endpoint", "http://10.0.0.1")]),
                "volumeAttributes.s3Endpoint",
            ),
            (
                ctx(&[(SOURCE, "hf://o/m"), ("allowedSources", "file://")]),
                "volumeAttributes.allowedSources",
            ),
            (
                ctx(&[(SOURCE, "hf://o/m"), (SUB_PATH, "../x")]),
                "volumeAttributes.subPath",
            ),
            // A pod cannot switch off or replace the class's signature policy.
            (
                ctx(&[(SOURCE, "hf://o/m"), ("modelSignature", "off")]),
                "volumeAttributes.modelSignature",
            ),
            (
                ctx(&[(SOURCE, "hf://o/m"), ("signaturePublicKey", "-----BEGIN")]),
                "volumeAttributes.signaturePublicKey",
            ),
        ];
        for (c, field) in cases {
            let e = parse(&c).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { field: f, .. } if f == field),
                "{c:?}: {e}"
            );
        }
    }

    #[test]
    fn only_kubelets_ids_name_a_path() {
        for good in ["csi-0123abcd", "csi-a_b"] {
            assert!(check_id(good).is_ok(), "{good}");
        }
        for bad in ["", "../x", "a/b", "-x", ".", "csi-ä", &"a".repeat(129)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_kubelet_marks_a_volume_inline() {
        assert!(is_inline(&ctx(&[(EPHEMERAL, "true")])));
        assert!(!is_inline(&ctx(&[(EPHEMERAL, "false")])));
        assert!(!is_inline(&ctx(&[])));
    }
}
