//! A made volume's life after CreateVolume: delete, expand, seal, modify,
//! list and capacity, idle eviction.

use std::collections::HashMap;

use crate::cache::{self, Role, Root, Seal, VolumeId, VolumeRecord};
use crate::csi::Topology;
use crate::error::{Error, Result};
use crate::offload::blocking;

use super::params::Params;
use super::plan;
use super::{Listed, Provisioner};

impl Provisioner {
    pub async fn delete(&self, volume_id: &str) -> Result<()> {
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let root = self.roots.for_id(&id)?.clone();
        let rec = {
            let (r, uuid) = (root.clone(), id.uuid.clone());
            blocking(move || cache::read_volume(&r, &uuid)).await?
        };
        let Some(rec) = rec else {
            return Ok(());
        };
        let _g = self.sources.lock(&rec.source).await;
        blocking(move || delete_volume(&root, &id.uuid, &rec)).await
    }

    /// ControllerExpandVolume to `target` bytes. Returns the size and
    /// whether the node must finish it. A directory source has no size
    /// beyond its record, which grows here; an image's bytes grow on the
    /// node that has it staged (NodeExpandVolume), where its loop device
    /// and mount are, so this only checks that it may and has the room.
    /// Another node's volume is that node's to check and grow.
    pub async fn expand(&self, volume_id: &str, target: i64) -> Result<(i64, bool)> {
        if let Some(id) = VolumeId::parse(volume_id)
            && self.roots.for_id(&id).is_err()
        {
            return Ok((target, true));
        }
        let (root, rec) = self.lookup(volume_id).await?;
        let _g = self.sources.lock(&rec.source).await;
        blocking(move || {
            cache::grow::check(&root, &rec, target)?;
            // An image (a store with a filesystem type) grows where it is
            // mounted; a directory is its record.
            if root.backend.store().fs_type().is_some() {
                return Ok((target.max(rec.capacity_bytes), true));
            }
            Ok((cache::grow::record(&root, &rec, target)?, false))
        })
        .await
    }

    /// Seals a source volume; a cache volume is sealed by construction.
    pub async fn seal(&self, volume_id: &str) -> Result<Seal> {
        let (root, rec) = self.lookup(volume_id).await?;
        let _g = self.sources.lock(&rec.source).await;
        let origin = format!("volume {} ({})", rec.name, rec.id);
        let sid = rec.source.clone();
        blocking(move || cache::seal_source(&root, &sid, &origin)).await
    }

    pub async fn modify(&self, volume_id: &str, mutable: &HashMap<String, String>) -> Result<()> {
        let (attributes, pv_name) = super::params::split_modify_metadata(mutable);
        let attributes: HashMap<_, _> = attributes.into_iter().collect();
        let m = super::params::parse_mutable(&attributes)?;
        if let Some(id) = VolumeId::parse(volume_id)
            && let Err(not_here) = self.roots.for_id(&id)
        {
            return self
                .modified_on_node(volume_id, &attributes, pv_name.as_deref(), not_here)
                .await;
        }
        let (root, rec) = self.lookup(volume_id).await?;
        if let Some(pin) = m.pinned {
            if !rec.source.is_model() {
                return Err(Error::invalid(
                    "mutable_parameters.pinned",
                    "only volumes of pulled models (parameter source) can pin them; source volumes are never evicted",
                ));
            }
            let (r, sid) = (root.clone(), rec.source.clone());
            let uuid = VolumeId::parse(&rec.id).map(|i| i.uuid).unwrap_or_default();
            blocking(move || cache::evict::set_volume_pin(&r, &sid, &uuid, pin)).await?;
        }
        match (m.sealed, rec.role) {
            (Some(true), Role::Source) => self.seal(volume_id).await.map(|_| ()),
            (Some(false), _) => {
                let sealed = blocking(move || cache::read_seal(&root, &rec.source)).await?;
                if sealed.is_some() {
                    return Err(Error::invalid(
                        "mutable_parameters.sealed",
                        format!("volume {volume_id} is sealed, and sealing cannot be undone"),
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// ControllerModifyVolume for a volume in a root this process does not
    /// serve: a node-local volume of another node, whose driver applies the
    /// change and reports on the PV (`node_report`). Without the PV's name
    /// (external-resizer's --extra-modify-metadata) or API access there is
    /// nothing to read, and the answer says so.
    async fn modified_on_node(
        &self,
        volume_id: &str,
        attributes: &HashMap<String, String>,
        pv_name: Option<&str>,
        not_here: Error,
    ) -> Result<()> {
        let (Some(kube), Some(pv_name)) = (&self.kube, pv_name) else {
            return Err(Error::Precondition(format!(
                "{not_here}. A node-local volume is modified by its node's driver, which reports on \
                 the PV: run external-resizer with --extra-modify-metadata and give this \
                 controller Kubernetes API access, so it can read that report"
            )));
        };
        let pv = kube.pv(pv_name).await?;
        let handle = pv.spec.as_ref().and_then(|s| s.csi.as_ref());
        if handle.map(|c| c.volume_handle.as_str()) != Some(volume_id) {
            return Err(Error::Precondition(format!(
                "PV {pv_name} is not volume {volume_id}"
            )));
        }
        let Some(node) = node_of(&pv, &self.cfg.topology_key()) else {
            return Err(not_here);
        };
        let wanted = attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let report = super::node_report::Report::from_annotations(pv.metadata.annotations.as_ref());
        super::node_report::answer(volume_id, &node, &wanted, report.as_ref())
    }

    /// Every volume this controller serves, ordered by id.
    pub fn list(&self) -> Result<Vec<Listed>> {
        Ok(self.list_page("", usize::MAX)?.0)
    }

    /// Up to `max` volumes whose ids sort after `after`, in id order, and
    /// the token for the next page (empty when none is left). Only the
    /// page's records are read: a page costs the same with 10 volumes as
    /// with 10,000, beyond listing the directories' names.
    pub fn list_page(&self, after: &str, max: usize) -> Result<(Vec<Listed>, String)> {
        if !after.is_empty() && VolumeId::parse(after).is_none() {
            return Err(Error::Busy(format!(
                "starting_token {after:?} was not issued by this driver; list again from the start"
            )));
        }
        let mut ids = Vec::new();
        for r in &self.roots.roots {
            for uuid in cache::volume_uuids(r)? {
                let id = r.volume_id(&uuid);
                if id.as_str() > after {
                    ids.push((id, r, uuid));
                }
            }
        }
        ids.sort_by(|a, b| a.0.cmp(&b.0));
        let mut page = Vec::new();
        let mut left = ids.into_iter();
        for (_, root, uuid) in left.by_ref() {
            if let Some(rec) = cache::read_listed(root, &uuid)? {
                page.push((rec, plan::topology_of(&self.cfg, root)));
            }
            if page.len() == max {
                break;
            }
        }
        let next = match (left.len(), page.last()) {
            (0, _) | (_, None) => String::new(),
            (_, Some((rec, _))) => rec.id.clone(),
        };
        Ok((page, next))
    }

    /// Free bytes where a volume with these parameters would go, or 0 for a
    /// topology segment this controller cannot provision in, and at a node
    /// for one claim's shared volume when a central controller provisions
    /// those.
    pub fn capacity(
        &self,
        params: &HashMap<String, String>,
        topology: Option<&Topology>,
    ) -> Result<i64> {
        // Read before the class is judged whole: a shared class with a bad
        // parameter is still the central controller's (which names the
        // parameter), never a node's to take and fail the same way.
        let says_shared = |key: &str| params.get(key).is_some_and(|v| v == "shared");
        let names_shared =
            says_shared(super::params::BACKEND) || says_shared(super::params::IMAGE_LOCATION);
        let parsed = Params::parse(params);
        let shared = match &parsed {
            Ok(p) => !plan::is_node_local(p),
            Err(_) => names_shared,
        };
        if self.cfg.shared_central && shared && params.contains_key(crate::kubeapi::PVC_NAME) {
            // A question about one claim (external-provisioner's node
            // deployment asks it, with --extra-create-metadata, before it
            // takes an Immediate claim): a shared volume is the central
            // controller's to provision, so this node has no room for it,
            // or every node would race the controller for each shared
            // claim (and for one the controller cannot provision yet, take
            // it and fail the same way). Without a claim it is
            // CSIStorageCapacity's question, and the room is real: the
            // scheduler places WaitForFirstConsumer pods of shared classes
            // by it.
            return Ok(0);
        }
        let p = parsed?;
        let root = match plan::select_root(&self.cfg, &self.roots, &p) {
            Ok(r) => r,
            Err(Error::Precondition(_)) => return Ok(0),
            Err(e) => return Err(e),
        };
        if let (Some(node), Some(t)) = (&root.node, topology)
            && t.segments.get(&self.cfg.topology_key()) != Some(node)
        {
            return Ok(0);
        }
        let cap = self.cfg.pull.capacity.get(&root.backend).copied();
        let free = cache::evict::available(&root, cap)?;
        Ok(in_steps(free).min(i64::MAX as u64) as i64)
    }

    /// Evicts pulled models nobody has used for `idle`, in every root.
    pub fn evict_idle(&self, idle: std::time::Duration) {
        for root in &self.roots.roots {
            match cache::evict::evict_idle(root, idle) {
                Ok(gone) if !gone.is_empty() => {
                    self.metrics.evictions.inc_by(gone.len() as u64);
                    tracing::info!(root = %root.dir.display(), evicted = ?gone, "evicted idle models")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(root = %root.dir.display(), error = %e, "eviction failed"),
            }
        }
    }

    pub fn volume_context(&self, rec: &VolumeRecord) -> HashMap<String, String> {
        let root_dir = VolumeId::parse(&rec.id)
            .and_then(|id| self.roots.by_key(id.backend, &id.root_key))
            .map(|r| r.dir.clone())
            .unwrap_or_default();
        let mut ctx = HashMap::from([
            ("backend".to_string(), rec.backend.to_string()),
            ("role".to_string(), rec.role.as_str().to_string()),
            ("source".to_string(), rec.source.to_string()),
            ("verify".to_string(), rec.verify.as_str().to_string()),
            ("root".to_string(), root_dir.display().to_string()),
        ]);
        if let Some(s) = &rec.sub_path {
            ctx.insert("subPath".into(), s.clone());
        }
        if let Some(m) = &rec.model {
            ctx.insert("model".into(), m.clone());
        }
        if let Some(r) = &rec.revision {
            ctx.insert("revision".into(), r.clone());
        }
        if let Some(w) = &rec.signed_by {
            ctx.insert("signedBy".into(), w.clone());
        }
        ctx
    }
}

/// Removes a volume's record and what only it held, under its source's
/// lock; a source still read or written is refused, naming who.
fn delete_volume(root: &Root, uuid: &str, rec: &VolumeRecord) -> Result<()> {
    match rec.role {
        Role::Cache => {
            // The record goes first: while it exists, so does its reference.
            cache::remove_volume(root, uuid)?;
            cache::remove_ref(root, &rec.source, uuid)?;
        }
        Role::Source => {
            let mut users = Vec::new();
            for r in cache::refs(root, &rec.source)? {
                match cache::read_volume(root, &r)? {
                    Some(v) => users.push(format!("{} ({})", v.name, v.id)),
                    // A reference without a record: a create that died.
                    None => cache::remove_ref(root, &rec.source, &r)?,
                }
            }
            if !users.is_empty() {
                return Err(Error::Precondition(format!(
                    "source volume {} is read by cache volumes {}; delete them first",
                    rec.id,
                    users.join(", ")
                )));
            }
            let writers = cache::writers(root, &rec.source)?;
            if !writers.is_empty() {
                return Err(Error::Precondition(format!(
                    "source volume {} is still staged on node(s) {}",
                    rec.id,
                    writers.join(", ")
                )));
            }
            cache::delete_source(root, &rec.source)?;
            cache::remove_volume(root, uuid)?;
        }
    }
    Ok(())
}

/// The node a node-local PV is pinned to, by the driver's topology key.
pub fn node_of(pv: &k8s_openapi::api::core::v1::PersistentVolume, key: &str) -> Option<String> {
    pv.spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == key && e.operator == "In")
        .and_then(|e| e.values.as_ref()?.first().cloned())
}

/// The room a capacity answer reports: rounded down to a power-of-two step
/// of at most 1/64 of itself. external-provisioner writes a node's
/// CSIStorageCapacity object for each class whenever its answer changes,
/// at every poll; exact free bytes change with every write to the disk, so
/// each poll rewrote every class's object on every node, and at the
/// provisioner's client rate a new class's capacity queued behind them for
/// tens of seconds. Rounding down never offers room that is not there.
fn in_steps(free: u64) -> u64 {
    match free / 64 {
        0 => free,
        part => {
            let step = 1u64 << (63 - part.leading_zeros());
            free - free % step
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_answered_in_steps_that_never_offer_more() {
        for free in [
            0,
            1,
            63,
            64,
            65,
            1000,
            4095,
            1 << 20,
            27_852_779_112,
            u64::MAX,
        ] {
            let r = in_steps(free);
            assert!(r <= free, "{free} -> {r}");
            assert!(free - r <= free / 64, "{free} -> {r}: more than 1/64 lost");
        }
        // Writes that move the free space within a step change nothing.
        let base = 27_852_779_112u64;
        let step = in_steps(base);
        assert_eq!(in_steps(base - 4096), step);
        assert_eq!(in_steps(base - 100 * 1024), step);
        assert_ne!(in_steps(base - (1 << 29)), step);
    }

    #[test]
    fn a_node_local_pv_names_its_node_by_the_topology_key() {
        let pv = |key: &str, op: &str| -> k8s_openapi::api::core::v1::PersistentVolume {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "pv1"},
                "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": key, "operator": op, "values": ["node-2"]}]}
                ]}}}
            }))
            .unwrap()
        };
        let key = "topology.modelcache.csi.io/node";
        assert_eq!(node_of(&pv(key, "In"), key), Some("node-2".into()));
        assert_eq!(node_of(&pv("kubernetes.io/hostname", "In"), key), None);
        assert_eq!(node_of(&pv(key, "NotIn"), key), None);
        assert_eq!(node_of(&Default::default(), key), None);
    }
}
