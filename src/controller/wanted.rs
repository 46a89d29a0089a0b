//! Pulls this process was asked for, kept on disk until they end, so a
//! restart resumes them without waiting for a new call.
//!
//! A record is the CreateVolume request that started a pull, written into
//! the root the pull fills, under the process that owns it (a node's
//! provisioner, or the central controller: they share `shared` roots).
//! Secrets never touch the disk: a pull that needs the class's secret is
//! not recorded and resumes at the provisioner's next call, which brings
//! the secret again; a PVC's own secret is read again from the API.

use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::volumes::CreateRequest;
use crate::cache::Root;
use crate::csi::{CapacityRange, TopologyRequirement, VolumeCapability};
use crate::error::{IoContext, Result};
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
}

fn dir(root: &Root, owner: &str) -> PathBuf {
    root.dir.join("wanted").join(owner)
}

/// Volume names are the caller's strings: the file is named by their hash.
fn path(root: &Root, owner: &str, name: &str) -> PathBuf {
    let h = hex::encode(Sha256::digest(name.as_bytes()));
    dir(root, owner).join(format!("{}.json", &h[..32]))
}

/// Records that `req` wants a pull into `root`.
pub fn save(root: &Root, owner: &str, req: &CreateRequest) -> Result<()> {
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
    };
    let p = path(root, owner, &req.name);
    state::write_json(&p, &rec).ctx("record a wanted pull", &p)
}

/// The pull for `name` ended (or nothing wants it any more).
pub fn remove(root: &Root, owner: &str, name: &str) -> Result<()> {
    let p = path(root, owner, name);
    state::remove_file(&p).ctx("remove a wanted pull", &p)
}

/// Every recorded request of `owner` in `root`. A record that cannot be
/// read is dropped with a warning: the provisioner's retry still comes.
pub fn load(root: &Root, owner: &str) -> Vec<CreateRequest> {
    let d = dir(root, owner);
    let names = state::list_names(&d).unwrap_or_default();
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

fn decode(r: Record) -> std::io::Result<CreateRequest> {
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
    Ok(CreateRequest {
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Roots;
    use crate::config::Config;

    #[test]
    fn a_request_survives_the_round_trip_without_its_secrets() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = Config {
            node_id: Some("n1".into()),
            state_dir: tmp.path().to_path_buf(),
            ..Config::default()
        };
        let root = Roots::from_config(&cfg).roots.remove(0);
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
            secrets: [("k".to_string(), "secret".to_string())].into(),
            budget: Some(std::time::Duration::from_secs(3)),
        };
        save(&root, "n1", &req).unwrap();
        let on_disk = std::fs::read_dir(dir(&root, "n1")).unwrap().count();
        assert_eq!(on_disk, 1);
        let text = std::fs::read_to_string(path(&root, "n1", &req.name)).unwrap();
        assert!(!text.contains("secret"), "{text}");
        assert!(load(&root, "controller").is_empty(), "another owner's");
        let back = load(&root, "n1");
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].name, req.name);
        assert_eq!(back[0].params, req.params);
        assert_eq!(back[0].capabilities, vec![cap]);
        assert_eq!(back[0].capacity, req.capacity);
        assert!(back[0].secrets.is_empty());
        remove(&root, "n1", &req.name).unwrap();
        assert!(load(&root, "n1").is_empty());
    }
}
