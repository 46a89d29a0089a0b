//! Pulls this process was asked for, kept on disk until they end, so a
//! restart resumes them without waiting for a new call.
//!
//! A record's `Phase` says how far its pull had come for the volume that
//! wants it; the seal removes the record.
//!
//! A record is the CreateVolume request that started a pull, written under
//! this process's own `--state-dir` (`wanted/`), never into a root: a
//! `shared` root is writable by every node, and a record there could make
//! a driver pull, with an admin's authority, a source no StorageClass
//! named. Secrets never touch the disk: a class's provisioner secret is
//! read again from the class (`KubeApi::claim_class_secret`) and a PVC's
//! own from its annotation; a pull whose secret cannot be read again is
//! not recorded and resumes at the provisioner's next call.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prost::Message;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::csi::{CapacityRange, TopologyRequirement, VolumeCapability};
use crate::error::{IoContext, Result};
use crate::provision::plan::{CreateRequest, InlineSource};
use crate::state;

/// One wanted pull: the request without its secrets.
#[derive(Serialize, Deserialize)]
struct Record {
    name: String,
    params: BTreeMap<String, String>,
    mutable: BTreeMap<String, String>,
    /// Protobuf, hex: the CSI messages have no serde form.
    capabilities: Vec<String>,
    capacity: Option<(i64, i64)>,
    content_volume: Option<String>,
    topology: Option<String>,
    /// A progressive inline volume's source and pod (`node::inline`).
    #[serde(default)]
    inline: Option<InlineRecord>,
    /// The pull ran with its class's provisioner secret, which is not
    /// here: the resume reads it again (`KubeApi::claim_class_secret`).
    #[serde(default)]
    class_secret: bool,
    #[serde(default)]
    phase: Phase,
}

/// How far a wanted pull had come for its volume. The record is written
/// at `Requested` and goes at the seal, so a sealed pull has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Asked for, and no volume answered yet: the provisioner's next call
    /// would find the pull running.
    #[default]
    Requested,
    /// Its volume was answered once the listing was known (progressive):
    /// readers wait on files still arriving, and only the pull brings them.
    Listed,
    /// Its volume was answered once every file was verified: readers read
    /// the pull's own files until the seal.
    Verified,
}

/// A pull to resume, as recorded.
pub struct Wanted {
    pub req: CreateRequest,
    /// Its class's provisioner secret must be read again first.
    pub class_secret: bool,
    pub phase: Phase,
}

#[derive(Serialize, Deserialize)]
struct InlineRecord {
    uri: String,
    pod: Option<(String, String)>,
}

/// Volume names are the caller's strings: the file is named by their hash.
fn path(dir: &Path, name: &str) -> PathBuf {
    let h = hex::encode(Sha256::digest(name.as_bytes()));
    dir.join(format!("{}.json", &h[..32]))
}

/// Records in `dir` that `req` wants a pull; `class_secret`: it pulls
/// with its class's provisioner secret (not written). A record already
/// there keeps its phase.
pub fn save(dir: &Path, req: &CreateRequest, class_secret: bool) -> Result<()> {
    let rec = Record {
        name: req.name.clone(),
        params: req.params.clone().into_iter().collect(),
        mutable: req.mutable.clone().into_iter().collect(),
        capabilities: req
            .capabilities
            .iter()
            .map(|c| hex::encode(c.encode_to_vec()))
            .collect(),
        capacity: req
            .capacity
            .as_ref()
            .map(|c| (c.required_bytes, c.limit_bytes)),
        content_volume: req.content_volume.clone(),
        topology: req
            .topology
            .as_ref()
            .map(|t| hex::encode(t.encode_to_vec())),
        inline: req.inline.as_ref().map(|i| InlineRecord {
            uri: i.uri.clone(),
            pod: i.pod.clone(),
        }),
        class_secret,
        phase: Phase::Requested,
    };
    let p = path(dir, &req.name);
    // A resumed pull is recorded again: how far it had come stands.
    let phase = match state::read_json::<Record>(&p) {
        Ok(Some(before)) => before.phase,
        _ => Phase::Requested,
    };
    let rec = Record { phase, ..rec };
    state::write_json(&p, &rec).ctx("record a wanted pull", &p)
}

/// Notes that the volume of the pull for `name` was answered at `phase`
/// (no record: nothing to note). Written whole or not at all, since the
/// record is what a restart resumes; its caller writes it after the
/// answer, which so waits for no fsync behind the model's writeback. A
/// note racing the seal's removal may write the record back; the resume
/// finds its pull finished and removes it.
pub fn advance(dir: &Path, name: &str, phase: Phase) -> Result<()> {
    let p = path(dir, name);
    let Some(mut rec) = state::read_json::<Record>(&p).ctx("read a wanted pull", &p)? else {
        return Ok(());
    };
    if rec.phase < phase {
        rec.phase = phase;
        state::write_json(&p, &rec).ctx("record a wanted pull's phase", &p)?;
    }
    Ok(())
}

/// Whether a pull for `name` is recorded.
pub fn exists(dir: &Path, name: &str) -> bool {
    path(dir, name).is_file()
}

/// The pull for `name` ended (or nothing wants it any more).
pub fn remove(dir: &Path, name: &str) -> Result<()> {
    let p = path(dir, name);
    state::remove_file(&p).ctx("remove a wanted pull", &p)
}

/// Every request recorded in `dir`. A record that cannot be read is
/// dropped with a warning: the provisioner's retry still comes.
pub fn load(d: &Path) -> Vec<Wanted> {
    let names = state::list_names(d).unwrap_or_default();
    let mut out = Vec::new();
    for n in names.iter().filter(|n| n.ends_with(".json")) {
        let p = d.join(n);
        match state::read_json::<Record>(&p).map(|r| r.map(decode)) {
            Ok(Some(Ok(req))) => out.push(req),
            Ok(None) => {}
            Ok(Some(Err(e))) | Err(e) => {
                tracing::warn!(record = %p.display(), error = %e, "dropping an unreadable wanted-pull record");
                let _ = state::remove_file(&p);
            }
        }
    }
    out
}

fn decode(r: Record) -> std::io::Result<Wanted> {
    let bad = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let proto = |h: &str| hex::decode(h).map_err(|e| bad(e.to_string()));
    let capabilities = r
        .capabilities
        .iter()
        .map(|h| VolumeCapability::decode(proto(h)?.as_slice()).map_err(|e| bad(e.to_string())))
        .collect::<std::io::Result<Vec<_>>>()?;
    let topology = match &r.topology {
        Some(h) => Some(
            TopologyRequirement::decode(proto(h)?.as_slice()).map_err(|e| bad(e.to_string()))?,
        ),
        None => None,
    };
    let req = CreateRequest {
        name: r.name,
        params: r.params.into_iter().collect(),
        mutable: r.mutable.into_iter().collect(),
        capabilities,
        capacity: r
            .capacity
            .map(|(required_bytes, limit_bytes)| CapacityRange {
                required_bytes,
                limit_bytes,
            }),
        content_volume: r.content_volume,
        topology,
        secrets: Default::default(),
        budget: None,
        inline: r.inline.map(|i| InlineSource {
            uri: i.uri,
            pod: i.pod,
        }),
        progress: None,
        class: None,
    };
    Ok(Wanted {
        req,
        class_secret: r.class_secret,
        phase: r.phase,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_the_round_trip_without_its_secrets() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("wanted");
        let cap = VolumeCapability {
            access_mode: Some(crate::csi::volume_capability::AccessMode { mode: 5 }),
            access_type: None,
        };
        let req = CreateRequest {
            name: "pvc-../weird name".into(),
            params: [("source".to_string(), "s3://b/m".to_string())].into(),
            mutable: Default::default(),
            capabilities: vec![cap.clone()],
            capacity: Some(CapacityRange {
                required_bytes: 5,
                limit_bytes: 0,
            }),
            content_volume: None,
            topology: None,
            secrets: [("k".to_string(), "hunter2-value".to_string())].into(),
            budget: Some(std::time::Duration::from_secs(3)),
            inline: None,
            progress: None,
            class: None,
        };
        save(&dir, &req, true).unwrap();
        let on_disk = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(on_disk, 1);
        let text = std::fs::read_to_string(path(&dir, &req.name)).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        let back = load(&dir);
        assert_eq!(back.len(), 1);
        assert!(back[0].class_secret);
        assert_eq!(back[0].phase, Phase::Requested);
        advance(&dir, &req.name, Phase::Verified).unwrap();
        // A phase never goes back.
        advance(&dir, &req.name, Phase::Listed).unwrap();
        let back = load(&dir);
        assert_eq!(back[0].phase, Phase::Verified);
        assert!(back[0].class_secret, "the rest of the record stays");
        // Recorded again by a resume: the phase stands.
        save(&dir, &req, true).unwrap();
        assert_eq!(load(&dir)[0].phase, Phase::Verified);
        let back: Vec<_> = back.into_iter().map(|w| w.req).collect();
        assert_eq!(back[0].name, req.name);
        assert_eq!(back[0].params, req.params);
        assert_eq!(back[0].capabilities, vec![cap]);
        assert_eq!(back[0].capacity, req.capacity);
        assert!(back[0].secrets.is_empty());
        assert!(back[0].inline.is_none());
        remove(&dir, &req.name).unwrap();
        assert!(load(&dir).is_empty());

        // A progressive inline volume's record keeps its pod's source.
        let inline = CreateRequest {
            name: "inline-csi-0123".into(),
            inline: Some(InlineSource {
                uri: "s3://b/m".into(),
                pod: Some(("team-a".into(), "reader".into())),
            }),
            ..req
        };
        save(&dir, &inline, false).unwrap();
        let back = load(&dir);
        assert!(!back[0].class_secret);
        let i = back[0].req.inline.as_ref().expect("the inline source");
        assert_eq!(i.uri, "s3://b/m");
        assert_eq!(i.pod, Some(("team-a".into(), "reader".into())));
    }
}
