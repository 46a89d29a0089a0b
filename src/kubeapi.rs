//! What the controller asks the Kubernetes API, when it has access: the
//! requesting PVC (its source annotation and pull-secret reference), the PV
//! behind a `pvc://` claim, and events on the PVC for pull progress.
//!
//! external-provisioner's `--extra-create-metadata` puts the PVC's name and
//! namespace into CreateVolume's parameters; that is how a request is tied
//! to its PVC. Secrets are read only from the PVC's own namespace, and
//! never logged.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Node, ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttributesClass};
use kube::api::{ListParams, Patch, PatchParams};
pub use kube::runtime::events::EventType;
use kube::runtime::events::{Event, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};

use crate::error::{Error, Result};
use crate::progress::{Progress, ProgressSink};

pub const PVC_NAME: &str = "csi.storage.k8s.io/pvc/name";
pub const PVC_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";

/// Annotations a user sets on a PVC.
pub const SOURCE_ANNOTATION: &str = "modelcache.csi.io/source";
pub const SECRET_ANNOTATION: &str = "modelcache.csi.io/source-secret";
/// An admin's annotation on a block PV: its filesystem may be mounted by
/// the node's kernel (read-only) for `pvc://` sources.
/// On a PVC: the namespaces (comma-separated, or `*`) whose PVCs may read
/// it through `pvc://namespace:claim`; the claim owner's consent.
pub const SHARED_WITH_ANNOTATION: &str = "modelcache.csi.io/shared-with";
pub const TRUSTED_FILESYSTEM_ANNOTATION: &str = "modelcache.csi.io/trusted-filesystem";

/// An RFC 1123 subdomain, as Kubernetes object names are.
fn is_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[derive(Clone)]
pub struct KubeApi {
    client: Client,
    driver: String,
    /// The node this process serves, if any: the instance its events name.
    node: Option<String>,
}

fn api_error(what: &str, e: kube::Error) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 404 => Error::NotFound(format!("{what} does not exist")),
        kube::Error::Api(s) if s.code == 403 || s.code == 401 => Error::Precondition(format!(
            "the driver may not read {what}: {}; check its RBAC",
            s.message
        )),
        other => Error::Transient(format!("reading {what} from the Kubernetes API: {other}")),
    }
}

/// A StorageClass's provisioner secret, as external-provisioner reads it.
pub const CLASS_SECRET_NAME: &str = "csi.storage.k8s.io/provisioner-secret-name";
pub const CLASS_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/provisioner-secret-namespace";

/// `template` (a class's provisioner secret name or namespace) with
/// `${pvc.namespace}`, `${pvc.name}` and `${pv.name}` filled in, as
/// external-provisioner fills them; `None` if any other `${...}` is left
/// (a PVC annotation: a tenant may have changed it since the create, and
/// a read now could name another secret than the create's).
pub fn fill_secret_template(
    template: &str,
    pvc_ns: &str,
    pvc_name: &str,
    pv: &str,
) -> Option<String> {
    let filled = template
        .replace("${pvc.namespace}", pvc_ns)
        .replace("${pvc.name}", pvc_name)
        .replace("${pv.name}", pv);
    (!filled.contains("${")).then_some(filled)
}

/// A Secret's data as text; `named_by` says who named it, for the error.
fn secret_strings(s: Secret, named_by: &str) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (k, v) in s.data.unwrap_or_default() {
        let v = String::from_utf8(v.0).map_err(|_| {
            Error::invalid(
                named_by,
                format!(
                    "key {k} of Secret {}/{} is not UTF-8 text",
                    s.metadata.namespace.as_deref().unwrap_or_default(),
                    s.metadata.name.as_deref().unwrap_or_default()
                ),
            )
        })?;
        out.insert(k, v);
    }
    for (k, v) in s.string_data.unwrap_or_default() {
        out.insert(k, v);
    }
    Ok(out)
}

/// The component an admin applies to let the driver read source secrets in
/// one namespace (a Role and RoleBinding there).
pub const SECRET_GRANT: &str = "deploy/csi-driver/components/tenant-source-secrets";

/// The driver holds no cluster-wide Secret access, so a 403 here means no
/// admin granted this namespace; say exactly what to grant.
fn secret_error(namespace: &str, name: &str, e: kube::Error) -> Error {
    match e {
        kube::Error::Api(s) if s.code == 403 => Error::Precondition(format!(
            "the driver may not read Secret {namespace}/{name}, named by PVC annotation \
             {SECRET_ANNOTATION} ({}). An admin must grant the driver's service accounts \
             `get` on Secrets in namespace {namespace}: a Role and RoleBinding there, for \
             example the kustomize component {SECRET_GRANT} with `namespace: {namespace}` \
             (docs/kubernetes.md, \"Source secrets of tenants\")",
            s.message
        )),
        e => api_error(&format!("Secret {namespace}/{name}"), e),
    }
}

impl KubeApi {
    pub fn new(client: Client, driver: &str, node: Option<&str>) -> KubeApi {
        KubeApi {
            client,
            driver: driver.to_string(),
            node: node.map(str::to_owned),
        }
    }

    pub async fn pvc(&self, namespace: &str, name: &str) -> Result<PersistentVolumeClaim> {
        Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| api_error(&format!("PVC {namespace}/{name}"), e))
    }

    /// Whether a pod exists, and is being deleted: by listing its
    /// namespace's pods by name, since the driver may list pods but never
    /// read one (deploy/csi-driver/base/rbac-node.yaml).
    pub async fn pod_deleting(&self, namespace: &str, name: &str) -> Result<bool> {
        let found =
            Api::<k8s_openapi::api::core::v1::Pod>::namespaced(self.client.clone(), namespace)
                .list_metadata(
                    &kube::api::ListParams::default().fields(&format!("metadata.name={name}")),
                )
                .await
                .map_err(|e| api_error(&format!("pod {namespace}/{name}"), e))?;
        match found.items.first() {
            Some(p) => Ok(p.metadata.deletion_timestamp.is_some()),
            None => Err(Error::NotFound(format!("pod {namespace}/{name}"))),
        }
    }

    pub async fn pv(&self, name: &str) -> Result<PersistentVolume> {
        Api::<PersistentVolume>::all(self.client.clone())
            .get(name)
            .await
            .map_err(|e| api_error(&format!("PV {name}"), e))
    }

    /// This driver (and, on a node, the node) as the source of events.
    fn reporter(&self) -> Reporter {
        Reporter {
            controller: self.driver.clone(),
            instance: self.node.clone(),
        }
    }

    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub async fn volume_attributes_class(&self, name: &str) -> Result<VolumeAttributesClass> {
        Api::<VolumeAttributesClass>::all(self.client.clone())
            .get(name)
            .await
            .map_err(|e| api_error(&format!("VolumeAttributesClass {name}"), e))
    }

    /// Sets one annotation on a PV (a merge patch: nothing else changes).
    pub async fn annotate_pv(&self, name: &str, key: &str, value: &str) -> Result<()> {
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        Api::<PersistentVolume>::all(self.client.clone())
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| api_error(&format!("PV {name}"), e))
    }

    /// One event on `pvc` from this driver (and node), best effort.
    pub async fn pvc_event(
        &self,
        pvc: &PersistentVolumeClaim,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let recorder = Recorder::new(self.client.clone(), self.reporter());
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &pvc.object_ref(&())).await {
            tracing::debug!(error = %e, "could not record an event");
        }
    }

    /// A Secret's data as strings, from the PVC's own namespace only.
    pub async fn secret(&self, namespace: &str, name: &str) -> Result<BTreeMap<String, String>> {
        // The name comes from a tenant's annotation and becomes part of a
        // request path: only a real object name may get that far.
        if !is_object_name(name) {
            return Err(Error::invalid(
                format!("PVC annotation {SECRET_ANNOTATION}"),
                format!(
                    "{name:?} is not a Secret name (lowercase letters, digits, '-' and '.', \
                     at most 253 characters)"
                ),
            ));
        }
        let s = Api::<Secret>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| secret_error(namespace, name, e))?;
        secret_strings(s, &format!("annotation {SECRET_ANNOTATION}"))
    }

    /// The provisioner secret of the StorageClass of PVC `pvc_ns/pvc_name`
    /// (bound to PV `pv`), read again as external-provisioner read it for
    /// the PVC's CreateVolume; `None` when the class names none. Only for
    /// a pull that a restart resumes: the admin's secret, from wherever
    /// the admin's class says, which the driver may read only where RBAC
    /// lets it (deploy/: this driver's namespace).
    pub async fn claim_class_secret(
        &self,
        pvc_ns: &str,
        pvc_name: &str,
        pv: &str,
    ) -> Result<Option<BTreeMap<String, String>>> {
        let pvc = self.pvc(pvc_ns, pvc_name).await?;
        let class = pvc.spec.and_then(|s| s.storage_class_name).ok_or_else(|| {
            Error::Precondition(format!("PVC {pvc_ns}/{pvc_name} names no StorageClass"))
        })?;
        let raw = self
            .storage_class(&class)
            .await?
            .parameters
            .unwrap_or_default();
        let (name, ns) = match (raw.get(CLASS_SECRET_NAME), raw.get(CLASS_SECRET_NAMESPACE)) {
            (None, None) => return Ok(None),
            (Some(n), Some(s)) => (n, s),
            _ => {
                return Err(Error::Precondition(format!(
                    "StorageClass {class} names half of its provisioner secret \
                     ({CLASS_SECRET_NAME}, {CLASS_SECRET_NAMESPACE})"
                )));
            }
        };
        let fill = |t: &str| {
            fill_secret_template(t, pvc_ns, pvc_name, pv)
                .filter(|v| is_object_name(v))
                .ok_or_else(|| {
                    Error::Precondition(format!(
                        "StorageClass {class}'s provisioner secret {t:?} cannot be read again: \
                         only ${{pvc.namespace}}, ${{pvc.name}} and ${{pv.name}} are filled in \
                         (a PVC's annotations may have changed since its create)"
                    ))
                })
        };
        let (name, ns) = (fill(name)?, fill(ns)?);
        let s = Api::<Secret>::namespaced(self.client.clone(), &ns)
            .get(&name)
            .await
            .map_err(|e| api_error(&format!("Secret {ns}/{name}"), e))?;
        secret_strings(s, &format!("StorageClass {class}'s provisioner secret")).map(Some)
    }

    /// Events on `pvc` for a pull, rate-limited to one progress event per
    /// `every`; they carry bytes, rate and ETA, never a credential. Pods
    /// waiting for the PVC get the same news, so `kubectl describe pod`
    /// says why the pod waits.
    pub fn pull_events(&self, pvc: &PersistentVolumeClaim, every: Duration) -> PvcEvents {
        PvcEvents {
            client: self.client.clone(),
            reporter: self.reporter(),
            reference: pvc.object_ref(&()),
            narrate_waiting_pods: true,
            every,
            last: Mutex::new(None),
            handle: tokio::runtime::Handle::current(),
        }
    }

    /// The same events on a pod, for the pull behind its inline volume.
    pub fn pod_pull_events(&self, namespace: &str, name: &str, every: Duration) -> PvcEvents {
        PvcEvents {
            client: self.client.clone(),
            reporter: self.reporter(),
            reference: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                ..Default::default()
            },
            narrate_waiting_pods: false,
            every,
            last: Mutex::new(None),
            handle: tokio::runtime::Handle::current(),
        }
    }

    pub async fn storage_class(&self, name: &str) -> Result<StorageClass> {
        Api::<StorageClass>::all(self.client.clone())
            .get(name)
            .await
            .map_err(|e| api_error(&format!("StorageClass {name}"), e))
    }

    /// Node `node`'s labels.
    pub async fn node_labels(&self, node: &str) -> Result<BTreeMap<String, String>> {
        let n = Api::<Node>::all(self.client.clone())
            .get(node)
            .await
            .map_err(|e| api_error(&format!("Node {node}"), e))?;
        Ok(n.metadata.labels.unwrap_or_default())
    }

    /// Sets (a value) or removes (`None`) each of `labels` on Node `node`,
    /// in one merge patch that touches nothing else.
    pub async fn label_node(
        &self,
        node: &str,
        labels: &BTreeMap<String, Option<String>>,
    ) -> Result<()> {
        let patch = serde_json::json!({"metadata": {"labels": labels}});
        Api::<Node>::all(self.client.clone())
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 403 || s.code == 401 => Error::Precondition(format!(
                    "the driver may not label Node {node}: {}; its account needs `patch` on nodes, \
                     and the admission policy modelcache-csi-node-labels lets it change only its own \
                     Node's warm labels, with its pod's bound token",
                    s.message
                )),
                e => Error::Transient(format!("labelling Node {node}: {e}")),
            })
    }
}

/// A store of what `events` says (a reflector) and a stream telling of
/// each change to it: every informer of the driver's agents is one.
pub fn informer<K>(
    events: impl futures::Stream<
        Item = kube::runtime::watcher::Result<kube::runtime::watcher::Event<K>>,
    > + Send
    + 'static,
) -> (
    kube::runtime::reflector::Store<K>,
    impl futures::Stream<Item = ()>,
)
where
    K: Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    let (reader, writer) = kube::runtime::reflector::store();
    let stream = kube::runtime::reflector::reflector(writer, events)
        .default_backoff()
        .touched_objects()
        .map(|_| ());
    (reader, stream)
}

pub struct PvcEvents {
    client: Client,
    reporter: Reporter,
    reference: ObjectReference,
    /// Whether pods waiting for the PVC hear the news too (not when the
    /// reference is a pod already).
    narrate_waiting_pods: bool,
    every: Duration,
    last: Mutex<Option<Instant>>,
    handle: tokio::runtime::Handle,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

/// What a pod waiting for the PVC is told, for each PVC event.
fn pod_reason(pvc_reason: &str) -> &'static str {
    match pvc_reason {
        "ModelSealed" => "ModelReady",
        "PullFailed" => "ModelPullFailed",
        "SourceRefused" => "ModelSourceRefused",
        _ => "WaitingForModel",
    }
}

/// Whether `pod` has not started and mounts claim `pvc` (directly, or as
/// the claim of a generic ephemeral volume, named `<pod>-<volume>`).
fn waits_for(pod: &Pod, pvc: &str) -> bool {
    let started = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p != "Pending");
    let name = pod.name_any();
    let volumes = pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
    !started
        && volumes.into_iter().any(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == pvc)
                || (v.ephemeral.is_some() && format!("{name}-{}", v.name) == pvc)
        })
}

/// Narrations (pod listings) running at once in this process.
static NARRATIONS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
/// Pods per list request: a page's memory is bounded whatever a
/// namespace holds.
const POD_PAGE: u32 = 100;
/// Pages followed before giving up (50,000 Pending pods).
const MAX_POD_PAGES: usize = 500;

/// The pods of `ns` still Pending on claim `pvc`, listed in pages of
/// Pending pods only (`status.phase` is a field pods can be selected by):
/// one request per hundred Pending pods, however many run.
async fn waiting_pods(
    client: &kube::Client,
    ns: &str,
    pvc: &str,
) -> std::result::Result<Vec<k8s_openapi::api::core::v1::ObjectReference>, kube::Error> {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let mut params = ListParams::default()
        .fields("status.phase=Pending")
        .limit(POD_PAGE);
    let mut waiting = Vec::new();
    for _ in 0..MAX_POD_PAGES {
        let page = api.list(&params).await?;
        waiting.extend(
            page.items
                .iter()
                .filter(|p| waits_for(p, pvc))
                .map(|p| p.object_ref(&())),
        );
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => params = params.continue_token(&c),
            _ => break,
        }
    }
    Ok(waiting)
}

impl PvcEvents {
    fn emit(&self, type_: EventType, reason: &str, note: String) {
        if self.narrate_waiting_pods {
            self.tell_waiting_pods(type_, reason, &note);
        }
        // A recorder of its own for every event: one shared recorder folds
        // events of one reason into a series that keeps the first note, so
        // `kubectl describe pvc` would show the first progress for ever.
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        let reference = self.reference.clone();
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Pull".into(),
            secondary: None,
        };
        // Events are best effort: a slow API must not slow the pull.
        self.handle.spawn(async move {
            if let Err(e) = recorder.publish(&event, &reference).await {
                tracing::debug!(error = %e, "could not record an event");
            }
        });
    }
}

impl PvcEvents {
    /// The same news on every pod waiting for the PVC. Best effort: a
    /// driver without `list pods` only narrates on the PVC.
    fn tell_waiting_pods(&self, type_: EventType, reason: &str, note: &str) {
        let (Some(ns), Some(pvc)) = (
            self.reference.namespace.clone(),
            self.reference.name.clone(),
        ) else {
            return;
        };
        let (client, reporter) = (self.client.clone(), self.reporter.clone());
        let event = Event {
            type_,
            reason: pod_reason(reason).into(),
            note: Some(format!("PVC {pvc}: {note}")),
            action: "WaitForModel".into(),
            secondary: Some(self.reference.clone()),
        };
        self.handle.spawn(async move {
            // Bounded: a few narrations at a time in the whole process; one
            // that cannot start soon is skipped (progress comes again).
            let Ok(Ok(_turn)) =
                tokio::time::timeout(Duration::from_secs(5), NARRATIONS.acquire()).await
            else {
                tracing::debug!("narration skipped: others are still listing pods");
                return;
            };
            let waiting = match waiting_pods(&client, &ns, &pvc).await {
                Ok(w) => w,
                Err(e) => {
                    tracing::debug!(error = %e, "could not list pods waiting for the PVC");
                    return;
                }
            };
            for pod in waiting {
                let recorder = Recorder::new(client.clone(), reporter.clone());
                if let Err(e) = recorder.publish(&event, &pod).await {
                    tracing::debug!(error = %e, "could not record an event on a waiting pod");
                }
            }
        });
    }

    /// A source the PVC named was refused before any pull.
    pub fn refused(&self, error: &str) {
        self.emit(EventType::Warning, "SourceRefused", error.to_string());
    }
}

impl ProgressSink for PvcEvents {
    fn started(&self, uri: &str, total: Option<u64>) {
        let size = total.map(|t| format!(" ({})", mib(t))).unwrap_or_default();
        self.emit(
            EventType::Normal,
            "PullStarted",
            format!("pulling {uri}{size}"),
        );
    }

    fn progress(&self, p: &Progress) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|l| l.elapsed() < self.every) {
            return;
        }
        *last = Some(Instant::now());
        let of = p
            .total
            .map(|t| format!(" of {}", mib(t)))
            .unwrap_or_default();
        let eta = p
            .eta
            .map(|e| format!(", ETA {}s", e.as_secs()))
            .unwrap_or_default();
        self.emit(
            EventType::Normal,
            "PullProgress",
            format!(
                "{}{of} at {:.1} MiB/s{eta}{}",
                mib(p.bytes),
                p.rate_bytes_per_sec / 1048576.0,
                p.from
                    .as_ref()
                    .map(|f| format!(", {f}"))
                    .unwrap_or_default()
            ),
        );
    }

    fn refetching(&self, _uri: &str, file: &str, why: &str) {
        self.emit(
            EventType::Warning,
            "FileFailedVerification",
            format!("{file} failed verification: {why}"),
        );
    }

    fn sealed(&self, s: &crate::progress::Sealed<'_>) {
        self.emit(
            EventType::Normal,
            "ModelSealed",
            format!(
                "{} at revision {}: {} verified and sealed in {:.1}s{}{}",
                s.uri,
                s.revision,
                mib(s.bytes),
                s.took.as_secs_f64(),
                s.signed_by
                    .map(|w| format!(", signed by {w}"))
                    .unwrap_or_default(),
                s.from.map(|f| format!(", {f}")).unwrap_or_default()
            ),
        );
    }

    fn failed(&self, uri: &str, error: &str) {
        self.emit(
            EventType::Warning,
            "PullFailed",
            format!("pulling {} failed: {error}", crate::uri::display_uri(uri)),
        );
    }
}

/// Annotations the driver's PVC watchers read (the rescheduler's and the
/// modify agent's); all else a tenant wrote is dropped before it is stored.
const KEPT_PVC_ANNOTATIONS: [&str; 3] = [
    "volume.kubernetes.io/selected-node",
    "volume.kubernetes.io/storage-provisioner",
    "volume.beta.kubernetes.io/storage-provisioner",
];

/// A PVC as the driver's informers keep it: without what a tenant can
/// grow (annotations other than the provisioning ones, labels,
/// finalizers, a label selector) or what the apiserver adds
/// (managedFields). A PVC may carry 256 KiB of annotations and stay
/// Pending for free, so whole objects would put every tenant's bytes in
/// every node's memory.
pub fn slim_pvc(pvc: &mut PersistentVolumeClaim) {
    let m = &mut pvc.metadata;
    m.managed_fields = None;
    m.labels = None;
    m.finalizers = None;
    m.owner_references = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| KEPT_PVC_ANNOTATIONS.contains(&k.as_str()));
    }
    if let Some(spec) = pvc.spec.as_mut() {
        spec.selector = None;
    }
}

/// A Node as the rescheduler keeps it: its name, labels and conditions
/// (without their messages). What kubelet writes besides (the images it
/// holds, capacity, addresses, its system info) is most of a Node's 10 to
/// 30 KiB, and a fleet's worth of it would be the rescheduler's memory.
pub fn slim_node(node: &mut k8s_openapi::api::core::v1::Node) {
    let m = &mut node.metadata;
    m.managed_fields = None;
    m.annotations = None;
    m.owner_references = None;
    node.spec = None;
    if let Some(st) = node.status.take() {
        let conditions = st.conditions.map(|cs| {
            cs.into_iter()
                .map(|c| k8s_openapi::api::core::v1::NodeCondition {
                    message: None,
                    reason: None,
                    last_heartbeat_time: None,
                    ..c
                })
                .collect()
        });
        node.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            conditions,
            ..Default::default()
        });
    }
}

/// A PV as the rescheduler keeps it: its name and the claim it is bound
/// to, all it asks of one.
pub fn slim_pv(pv: &mut k8s_openapi::api::core::v1::PersistentVolume) {
    let m = &mut pv.metadata;
    m.managed_fields = None;
    m.annotations = None;
    m.labels = None;
    m.finalizers = None;
    pv.status = None;
    if let Some(spec) = pv.spec.take() {
        pv.spec = Some(k8s_openapi::api::core::v1::PersistentVolumeSpec {
            claim_ref: spec.claim_ref,
            ..Default::default()
        });
    }
}

/// An informer (`informer`) whose objects `slim` trims before they are
/// stored.
pub fn slim_informer<K>(
    api: Api<K>,
    slim: fn(&mut K),
) -> (
    kube::runtime::reflector::Store<K>,
    impl futures::Stream<Item = ()>,
)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    use kube::runtime::WatchStreamExt;
    informer(kube::runtime::watcher(api, kube::runtime::watcher::Config::default()).modify(slim))
}

/// Claims listed per page by `slim_pvcs` (kube's default is 500).
const PVC_PAGE: u32 = 50;

/// Every PVC of the cluster, slimmed (`slim_pvc`) before it is stored: the
/// trigger and the store for a `Controller::for_stream`.
pub fn slim_pvcs(
    client: kube::Client,
) -> (
    kube::runtime::reflector::Store<PersistentVolumeClaim>,
    impl futures::Stream<
        Item = std::result::Result<PersistentVolumeClaim, kube::runtime::watcher::Error>,
    > + Send
    + 'static,
) {
    use kube::runtime::WatchStreamExt;
    let (reader, writer) = kube::runtime::reflector::store();
    let stream = kube::runtime::watcher(
        Api::<PersistentVolumeClaim>::all(client),
        // Whole objects arrive, a page at a time, before `slim_pvc` trims
        // them: a page of 500 claims carrying large annotations (a tenant
        // writes them) would be hundreds of MiB.
        kube::runtime::watcher::Config::default().page_size(PVC_PAGE),
    )
    .default_backoff()
    .modify(slim_pvc)
    .reflect(writer)
    .applied_objects();
    (reader, stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slim_node_keeps_its_labels_and_conditions_only() {
        let mut node: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "gpu-1", "labels": {"pool": "gpu"}, "annotations": {"a": "b"}},
                "spec": {"podCIDR": "10.0.0.0/24"},
                "status": {
                    "conditions": [{"type": "Ready", "status": "False", "reason": "KubeletDown",
                        "message": "a long message", "lastHeartbeatTime": "2026-12-07T09:00:00Z",
                        "lastTransitionTime": "2026-12-07T08:00:00Z"}],
                    "images": [{"names": ["registry.example.com/a:1"], "sizeBytes": 1}],
                    "capacity": {"cpu": "8"},
                },
            }))
            .unwrap();
        slim_node(&mut node);
        assert_eq!(
            serde_json::to_value(&node).unwrap(),
            serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "gpu-1", "labels": {"pool": "gpu"}},
                "status": {"conditions": [{"type": "Ready", "status": "False",
                    "lastTransitionTime": "2026-12-07T08:00:00Z"}]},
            })
        );
    }

    #[test]
    fn a_slim_pv_keeps_its_claim_only() {
        let mut pv: k8s_openapi::api::core::v1::PersistentVolume =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "pv-1", "annotations": {"a": "b"}, "finalizers": ["f"]},
                "spec": {
                    "claimRef": {"namespace": "team", "name": "llm", "uid": "u1"},
                    "csi": {"driver": "modelcache.csi.io", "volumeHandle": "v1",
                        "volumeAttributes": {"source": "m1"}},
                    "capacity": {"storage": "1Gi"},
                },
                "status": {"phase": "Bound"},
            }))
            .unwrap();
        slim_pv(&mut pv);
        assert_eq!(
            serde_json::to_value(&pv).unwrap(),
            serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": "pv-1"},
                "spec": {"claimRef": {"namespace": "team", "name": "llm", "uid": "u1"}},
            })
        );
    }

    #[test]
    fn pods_that_wait_for_a_claim() {
        let pod = |phase: &str, volumes: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "team"},
                "spec": {"containers": [], "volumes": volumes},
                "status": {"phase": phase},
            }))
            .unwrap()
        };
        let claim =
            serde_json::json!([{"name": "m", "persistentVolumeClaim": {"claimName": "minilm"}}]);
        let eph = serde_json::json!([{"name": "model", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]);
        assert!(waits_for(&pod("Pending", claim.clone()), "minilm"));
        assert!(!waits_for(&pod("Running", claim.clone()), "minilm"));
        assert!(!waits_for(&pod("Pending", claim), "other"));
        assert!(waits_for(&pod("Pending", eph.clone()), "web-model"));
        assert!(!waits_for(&pod("Pending", eph), "model"));
        assert_eq!(pod_reason("PullProgress"), "WaitingForModel");
        assert_eq!(pod_reason("PullFailed"), "ModelPullFailed");
    }

    #[test]
    fn object_names() {
        for ok in ["hf-token", "a", "a.b-c", "x1"] {
            assert!(is_object_name(ok), "{ok}");
        }
        for bad in [
            "",
            "../x",
            "a/b",
            "A",
            "-a",
            "a..b",
            "a b",
            "a%2fb",
            &"a".repeat(254),
        ] {
            assert!(!is_object_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_forbidden_secret_says_what_to_grant() {
        let forbidden = kube::Error::Api(
            kube::core::Status::failure(
                "secrets \"creds\" is forbidden: User \"system:serviceaccount:modelcache-csi:modelcache-csi-node\" cannot get resource \"secrets\" in API group \"\" in the namespace \"team\"",
                "Forbidden",
            )
            .with_code(403)
            .boxed(),
        );
        let e = secret_error("team", "creds", forbidden);
        assert!(matches!(e, Error::Precondition(_)), "{e:?}");
        let m = e.to_string();
        for want in [
            "Secret team/creds",
            SECRET_ANNOTATION,
            "namespace team",
            "Role and RoleBinding",
            SECRET_GRANT,
            "system:serviceaccount:modelcache-csi:modelcache-csi-node",
        ] {
            assert!(m.contains(want), "{want:?} missing from {m}");
        }
        let missing = kube::Error::Api(
            kube::core::Status::failure("not found", "NotFound")
                .with_code(404)
                .boxed(),
        );
        assert!(matches!(
            secret_error("team", "creds", missing),
            Error::NotFound(m) if m.contains("Secret team/creds")
        ));
    }

    #[test]
    fn a_class_secret_template_is_filled_from_the_claim_and_never_from_its_annotations() {
        let fill = |t| fill_secret_template(t, "team-a", "llm", "pvc-123");
        assert_eq!(fill("creds").as_deref(), Some("creds"));
        assert_eq!(fill("${pvc.namespace}").as_deref(), Some("team-a"));
        assert_eq!(
            fill("${pvc.name}-${pv.name}").as_deref(),
            Some("llm-pvc-123")
        );
        // Annotations change after the create: such a template is never
        // resolved again.
        assert_eq!(fill("${pvc.annotations['team/secret']}"), None);
        assert_eq!(fill("x-${unknown}"), None);
    }
}
