//! The API side of CreateVolume: what a request names, read from the
//! Kubernetes API (the PVC's own source and secret, a pod's inline source,
//! a `pvc://` claim, the content volume) and admitted under the class.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::cache::{self, External};
use crate::error::{Error, Result};
use crate::kubeapi;
use crate::puller::engine::{NoProgress, ProgressSink};
use crate::puller::{self, SourceOptions};
use crate::trust::Tenant;
use kube::ResourceExt;

use super::Provisioner;
use super::params::Params;
use super::plan::{CreateRequest, InlineSource, Owner, Resolved};
/// How a pull goes: with what credentials and policy, told to whom, for
/// which PVC.
pub(super) struct PullInputs {
    pub(super) options: SourceOptions,
    /// The class's signature policy: never the tenant's to set.
    pub(super) signature: Option<Arc<crate::signing::Policy>>,
    pub(super) sink: Arc<dyn ProgressSink>,
    pub(super) owner: Option<Owner>,
    /// The StorageClass whose own `source` this pull is (neither the PVC
    /// nor a pod named one), and that source: the class a node holding
    /// the model is warm for.
    pub(super) class: Option<(String, String)>,
}

/// What a `pvc://` source turned out to be.
enum PvcSource {
    /// A volume of this driver: read its sealed source in place.
    Volume {
        id: String,
        sub_path: Option<String>,
    },
    /// Another PV's bytes on this node, read-only in place.
    External {
        external: External,
        sub_path: Option<String>,
    },
}

impl Provisioner {
    /// What the request names, from the API: the PVC's own source and
    /// secret, a pod's inline source, a `pvc://` claim, the content volume.
    pub(super) async fn resolve(
        &self,
        req: &CreateRequest,
        mut params: Params,
    ) -> Result<(Resolved, PullInputs)> {
        let mut secrets: BTreeMap<String, String> = req.secrets.clone().into_iter().collect();
        // The requesting PVC (external-provisioner --extra-create-metadata)
        // may name its own source and pull secret.
        let pvc = match (
            &self.kube,
            req.params.get(kubeapi::PVC_NAMESPACE),
            req.params.get(kubeapi::PVC_NAME),
        ) {
            (Some(k), Some(ns), Some(name)) => Some((ns.clone(), k.pvc(ns, name).await?)),
            _ => None,
        };
        // A source the PVC names is the tenant's choice: bounded by the
        // class's allowedSources, pulled through the egress guard, and with
        // the PVC's own secret only, never the class's or the driver's.
        let mut tenant = None;
        let events = self.events_for(pvc.as_ref().map(|(_, c)| c), req.inline.as_ref());
        if let Some(inline) = &req.inline {
            let field = "volumeAttributes.source";
            tenant = Some(
                self.admit(field, &inline.uri, &params, events.as_deref())
                    .await?,
            );
            params.source = Some(inline.uri.clone());
        }
        if let (Some((ns, claim)), Some(k)) = (&pvc, &self.kube) {
            if let Some(src) = claim.annotations().get(kubeapi::SOURCE_ANNOTATION) {
                let field = format!("PVC annotation {}", kubeapi::SOURCE_ANNOTATION);
                tenant = Some(self.admit(&field, src, &params, events.as_deref()).await?);
                params.source = Some(src.clone());
                secrets.clear();
            }
            if let Some(secret) = claim.annotations().get(kubeapi::SECRET_ANNOTATION) {
                // A missing grant is the admin's to fix: say so on the PVC too.
                let read = k.secret(ns, secret).await.inspect_err(|e| {
                    if let Some(ev) = &events {
                        let uri = params.source.as_deref().unwrap_or("the model");
                        ev.failed(crate::trust::allowed::shown(uri), &e.to_string());
                    }
                })?;
                secrets.extend(read);
            }
        }
        // A pvc:// source is either one of our volumes (read like a clone)
        // or another PV's bytes on this node.
        let mut content_volume = req.content_volume.clone();
        let requester_ns = pvc.as_ref().map(|(ns, _)| ns.as_str());
        let external = self
            .pvc_source(&mut params, requester_ns, &mut content_volume)
            .await?;
        let content = match content_volume {
            Some(id) => Some(self.content_volume(&id).await?),
            None => None,
        };
        let sink: Arc<dyn ProgressSink> = match (&events, &req.progress) {
            (Some(e), _) => e.clone(),
            (None, Some(p)) => p.clone(),
            (None, None) => Arc::new(NoProgress),
        };
        let class = match (&tenant, &content, &external, &params.source) {
            (None, None, None, Some(source)) => {
                class_of(req, pvc.as_ref().map(|(_, c)| c)).map(|name| (name, source.clone()))
            }
            _ => None,
        };
        let pull = PullInputs {
            options: SourceOptions {
                params: params.source_options.clone(),
                secrets,
                tenant,
                bounds: crate::trust::Bounds {
                    allowed: params.allowed_sources.clone(),
                    credentialed: params.artifact_credentials.clone(),
                    ranges: self.cfg.tenant_ranges.clone(),
                },
                admin_guard: None,
                env: self.cfg.admin_env.clone(),
            },
            signature: params.signature.clone(),
            sink,
            owner: owner_of(pvc.as_ref(), req.inline.as_ref()),
            class,
        };
        Ok((
            Resolved {
                params,
                content,
                external,
            },
            pull,
        ))
    }

    /// The volume a clone names as its content source.
    async fn content_volume(&self, id: &str) -> Result<(cache::Root, cache::VolumeRecord)> {
        cache::lookup_off_runtime(&self.roots, id)
            .await
            .map_err(|_| {
                Error::NotFound(format!(
                    "volume_content_source.volume.volume_id {id} does not exist"
                ))
            })
    }

    /// Where a pull's progress and refusals are told: the requesting PVC,
    /// or an inline volume's pod.
    fn events_for(
        &self,
        claim: Option<&k8s_openapi::api::core::v1::PersistentVolumeClaim>,
        inline: Option<&InlineSource>,
    ) -> Option<Arc<kubeapi::PvcEvents>> {
        let k = self.kube.as_ref()?;
        let every = self.cfg.progress_every;
        match (claim, inline.and_then(|i| i.pod.as_ref())) {
            (Some(claim), _) => Some(Arc::new(k.pull_events(claim, every))),
            (None, Some((ns, name))) => Some(Arc::new(k.pod_pull_events(ns, name, every))),
            (None, None) => None,
        }
    }

    /// A `pvc://` source is either one of our volumes (read like a clone:
    /// `content_volume` names it) or another PV's bytes on this node (the
    /// answer); either way its subPath joins the class's.
    async fn pvc_source(
        &self,
        params: &mut Params,
        requester_ns: Option<&str>,
        content_volume: &mut Option<String>,
    ) -> Result<Option<External>> {
        let Some(src) = params.source.clone().filter(|s| s.starts_with("pvc://")) else {
            return Ok(None);
        };
        let found = self
            .resolve_pvc(&src, requester_ns, params.allow_cross_namespace)
            .await?;
        params.source = None;
        Ok(match found {
            PvcSource::Volume { id, sub_path } => {
                *content_volume = Some(id);
                params.sub_path = join_sub(sub_path, params.sub_path.take());
                None
            }
            PvcSource::External { external, sub_path } => {
                params.sub_path = join_sub(sub_path, params.sub_path.take());
                Some(external)
            }
        })
    }

    /// A source a tenant named (in `field`), admitted under the class's
    /// allowedSources; a refusal is told on the PVC or pod, too.
    async fn admit(
        &self,
        field: &str,
        uri: &str,
        params: &Params,
        events: Option<&kubeapi::PvcEvents>,
    ) -> Result<Arc<Tenant>> {
        let admitted = match puller::validate_uri(uri) {
            Err(m) => Err(Error::invalid(field, m)),
            Ok(()) => {
                Tenant::admit(
                    field,
                    uri,
                    params.allowed_sources.as_ref(),
                    &params.source_options,
                    &self.cfg.tenant_ranges,
                    &self.cfg.admin_env,
                )
                .await
            }
        };
        if let (Err(e), Some(ev)) = (&admitted, events) {
            ev.refused(&e.to_string());
        }
        admitted
    }

    /// Resolves `pvc://[ns:]claim[/path]` to what its bound PV holds.
    async fn resolve_pvc(
        &self,
        uri: &str,
        requester_ns: Option<&str>,
        cross_ns: bool,
    ) -> Result<PvcSource> {
        let field = "parameters.source";
        let u = crate::uri::parse_pvc_uri(uri).map_err(|m| Error::invalid(field, m))?;
        let kube = self.kube.as_ref().ok_or_else(|| {
            Error::Precondition(format!(
                "{uri} needs Kubernetes API access and the PVC's namespace: run the provisioner with --extra-create-metadata and the driver in the cluster (or with --kubeconfig)"
            ))
        })?;
        let requester_ns = requester_ns.ok_or_else(|| {
            Error::Precondition(format!("{uri}: the requesting PVC is unknown; run external-provisioner with --extra-create-metadata"))
        })?;
        let ns = match &u.namespace {
            Some(ns) if ns != requester_ns && !cross_ns => {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{uri} names a claim in namespace {ns}, but the PVC is in {requester_ns}; a StorageClass must set {}: \"true\" to allow that",
                        super::params::ALLOW_CROSS_NAMESPACE
                    ),
                ));
            }
            Some(ns) => ns.clone(),
            None => requester_ns.to_string(),
        };
        let claim = kube.pvc(&ns, &u.claim).await?;
        if ns != requester_ns {
            consented(&claim, &ns, requester_ns, uri)?;
        }
        let pv_name = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|_| claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .ok_or_else(|| {
                Error::Precondition(format!("claim {ns}/{} is not bound yet", u.claim))
            })?;
        let pv = kube.pv(&pv_name).await?;
        let spec = pv.spec.unwrap_or_default();
        if let Some(csi) = &spec.csi
            && csi.driver == self.cfg.driver_name
        {
            return Ok(PvcSource::Volume {
                id: csi.volume_handle.clone(),
                sub_path: u.path,
            });
        }
        let block = spec.volume_mode.as_deref() == Some("Block");
        let local_path = spec.local.as_ref().map(|l| l.path.clone());
        let host_path = spec.host_path.as_ref().map(|h| h.path.clone());
        let trusted = pv
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(kubeapi::TRUSTED_FILESYSTEM_ANNOTATION))
            .is_some_and(|v| v == "true");
        match (local_path.or(host_path), block) {
            (Some(_), true) if !trusted => Err(Error::NotAllowed(format!(
                "{uri}: PV {pv_name} is a block device whose filesystem its users can write; \
                 the node's kernel mounts only filesystems the driver sealed itself or an admin \
                 vouched for. An admin may annotate the PV {}: \"true\" once its content is \
                 trusted and no longer written",
                kubeapi::TRUSTED_FILESYSTEM_ANNOTATION
            ))),
            (Some(device), true) => {
                if u.path.is_some() {
                    return Err(Error::invalid(
                        field,
                        format!(
                            "{uri}: a block PV has no directories; drop the path and use parameter subPath"
                        ),
                    ));
                }
                Ok(PvcSource::External {
                    external: External::XfsBlock { device },
                    sub_path: None,
                })
            }
            (Some(path), false) => Ok(PvcSource::External {
                external: External::Dir { path },
                sub_path: u.path,
            }),
            (None, _) => Err(Error::invalid(
                field,
                format!(
                    "PV {pv_name} behind {uri} is of a type that cannot be exposed read-only in place; supported: volumes of {}, hostPath and local PVs (directories), and block-mode local PVs holding XFS",
                    self.cfg.driver_name
                ),
            )),
        }
    }
}

/// A writable source may never be promised more than the filesystem can
/// still give: its free space beyond the reserve (`--min-free`). Neither
/// a directory nor a sparse image is allocated up front, so this is the
/// bound a size gets where no quota enforces it.
/// A claim named across namespaces must say that the requester's
/// namespace may read it (`modelcache.csi.io/shared-with`): the class's
/// `allowCrossNamespacePVC` is the admin's leave, this is the owner's.
fn consented(
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaim,
    ns: &str,
    requester_ns: &str,
    uri: &str,
) -> Result<()> {
    let shared = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kubeapi::SHARED_WITH_ANNOTATION));
    let ok = shared.is_some_and(|v| {
        v.split(',')
            .map(str::trim)
            .any(|n| n == requester_ns || n == "*")
    });
    if ok {
        return Ok(());
    }
    Err(Error::NotAllowed(format!(
        "{uri}: claim {ns}/{} does not consent to be read from namespace {requester_ns}; its owner \
         may annotate it {}: \"{requester_ns}\" (comma-separated namespaces, or \"*\")",
        claim.metadata.name.as_deref().unwrap_or_default(),
        kubeapi::SHARED_WITH_ANNOTATION
    )))
}

fn join_sub(a: Option<String>, b: Option<String>) -> Option<String> {
    match (a, b) {
        (Some(a), Some(b)) => Some(format!("{a}/{b}")),
        (a, b) => a.or(b),
    }
}

/// Who wants a pull: the requesting PVC, or an inline volume's pod.
fn owner_of(
    pvc: Option<&(String, k8s_openapi::api::core::v1::PersistentVolumeClaim)>,
    inline: Option<&InlineSource>,
) -> Option<Owner> {
    match (pvc, inline.and_then(|i| i.pod.as_ref())) {
        (Some((ns, c)), _) => Some(Owner::Pvc {
            namespace: ns.clone(),
            name: c.name_any(),
        }),
        (None, Some((ns, pod))) => Some(Owner::Pod {
            namespace: ns.clone(),
            name: pod.clone(),
        }),
        (None, None) => None,
    }
}

/// The StorageClass a request came through, where it names one: the
/// request's own, else its PVC's.
fn class_of(
    req: &CreateRequest,
    claim: Option<&k8s_openapi::api::core::v1::PersistentVolumeClaim>,
) -> Option<String> {
    req.class
        .clone()
        .or_else(|| claim.and_then(|c| c.spec.as_ref()?.storage_class_name.clone()))
}
