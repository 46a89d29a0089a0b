//! Staging a progressive volume whose model is not sealed yet: the FUSE
//! view of the model's pull on the staging path, served by this process,
//! kept following the model's pulls (a failed pull runs again with a new
//! partial view) until the seal, and handed to the keeper so that a
//! restart of this process takes the view over instead of breaking it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cache::partial::Partial;
use crate::cache::{self, Root, Roots};
use crate::error::{Error, IoContext, Result};
use crate::mount::Mounter;
use crate::progressive::keeper::Keeper;
use crate::progressive::{self, fuse, gate::Gates, tree::Tree};
use crate::state;
use tracing::Instrument;

/// The view's name in the mount table: `fuse.modelcache`.
pub const FS_NAME: &str = "modelcache";

pub use crate::progressive::WAIT_BOUND;

/// Whether a mount found on a staging path's content is a progressive view.
pub fn is_view(fs_type: &str) -> bool {
    fs_type.strip_prefix("fuse.") == Some(FS_NAME)
}

/// What a server taking a view over needs that the kernel does not keep:
/// which volume it shows, and the listing its inode numbers come from.
#[derive(Serialize, Deserialize)]
struct ViewRecord {
    content: PathBuf,
    volume_id: String,
    listing: Vec<(String, u64)>,
}

/// A view's name in the records: a digest of its mount point.
fn view_key(content: &Path) -> String {
    let h = hex::encode(Sha256::digest(content.as_os_str().as_encoded_bytes()));
    h[..32].to_string()
}

/// The progressive views this node serves: their records (under the state
/// directory's `views/`) and the keeper that holds their connections.
/// Progressive views a node serves at once.
pub const MAX_VIEWS: usize = 64;

pub struct Views {
    dir: PathBuf,
    keeper: Option<Keeper>,
}

impl Views {
    pub fn new(state_dir: &Path, keeper: Option<&Path>) -> Views {
        Views {
            dir: state_dir.join("views"),
            keeper: keeper.map(Keeper::new),
        }
    }

    fn record_path(&self, content: &Path) -> PathBuf {
        self.dir.join(format!("{}.json", view_key(content)))
    }

    /// The view's passthrough ids (`fuse::Volume::with_ids_file`): they
    /// belong to its connection, so they go with it.
    fn ids_path(&self, content: &Path) -> PathBuf {
        self.dir.join(format!("{}.passthrough", view_key(content)))
    }

    /// Mounts the view of volume `volume_id` (model `sid` in `root`) on
    /// `content` (an empty directory inside the staging path's wrapper)
    /// and serves it. The model's pull must run in this process with its
    /// listing known; otherwise UNAVAILABLE, and kubelet's retry finds it
    /// (a restart resumes the pull, see `provision::pulls`).
    pub fn mount(
        &self,
        m: &dyn Mounter,
        root: &Root,
        volume_id: &str,
        sid: &cache::SourceId,
        content: &Path,
    ) -> Result<()> {
        let Some(pull) = root.pulls.get(sid).filter(|p| p.listing().is_some()) else {
            return Err(Error::Transient(format!(
                "model {sid} of progressive volume {volume_id} is neither sealed nor being \
                 pulled on this node yet; its pull is started again by the provisioner, retry"
            )));
        };
        // Each view costs two threads and a request buffer until its model
        // seals: a node serves a bounded number; more stages wait (kubelet
        // retries) for one to end or for their model's seal, after which a
        // stage is an ordinary mount.
        let serving = std::fs::read_dir(&self.dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                    .count()
            })
            .unwrap_or(0);
        if serving >= MAX_VIEWS {
            return Err(Error::Transient(format!(
                "this node serves {serving} progressive views already (at most {MAX_VIEWS}); \
                 volume {volume_id} is staged once one of them ends or its model is sealed, retry"
            )));
        }
        let rec = ViewRecord {
            content: content.to_path_buf(),
            volume_id: volume_id.to_string(),
            listing: pull.listing().unwrap_or_default().to_vec(),
        };
        let at = self.record_path(content);
        std::fs::create_dir_all(&self.dir).ctx("create", &self.dir)?;
        // Ids of a connection before this one mean nothing on a new one.
        let ids = self.ids_path(content);
        state::remove_file(&ids).ctx("remove", &ids)?;
        state::write_json(&at, &rec).ctx("write", &at)?;
        let dev = match m.mount_fuse(content, FS_NAME) {
            Ok(dev) => dev,
            Err(e) => {
                let _ = state::remove_file(&at);
                return Err(Error::io("mount the progressive view on", content, e));
            }
        };
        if let Some(k) = &self.keeper
            && let Err(e) = k.hold(&content.to_string_lossy(), &dev)
        {
            // Served all the same; only a restart would break it.
            tracing::warn!(volume = %volume_id, error = %e, "the keeper does not hold this view: a restart of the driver would break its pods' reads");
        }
        start(root, sid, rec, dev, false, ids)
    }

    /// The view on `content` is unmounted: its record and its kept
    /// connection go.
    pub fn forget(&self, content: &Path) {
        // Released whether or not its record survived: a held connection
        // without a record would be kept for ever.
        if let Some(k) = &self.keeper
            && let Err(e) = k.release(&content.to_string_lossy())
        {
            tracing::warn!(view = %content.display(), error = %e, "the keeper did not release the view");
        }
        let at = self.record_path(content);
        if !at.exists() {
            return;
        }
        let _ = state::remove_file(&self.ids_path(content));
        let _ = state::remove_file(&at);
    }

    /// At start: takes over every view a previous process served, from
    /// the connections the keeper held for it. The pods' requests waited
    /// in the kernel meanwhile; those the old process had read are sent
    /// again. A view whose connection nobody kept is dead (its pods' reads
    /// fail with ENOTCONN until they are restarted), and is logged.
    pub fn take_over(&self, m: &dyn Mounter, roots: &Roots) {
        let kept = match &self.keeper {
            Some(k) => match k.take_all() {
                Ok(kept) => kept,
                Err(e) => {
                    tracing::warn!(error = %e, "could not take progressive views over from the keeper");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        let mut served = std::collections::BTreeSet::new();
        for (key, dev) in kept {
            let content = PathBuf::from(&key);
            match self.take_one(m, roots, &content, dev) {
                Ok(()) => {
                    served.insert(self.record_path(&content));
                }
                Err(e) => {
                    tracing::warn!(view = %key, error = %e, "a kept view was not taken over");
                    self.forget(&content);
                }
            }
        }
        let Ok(records) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for r in records.flatten() {
            if !served.contains(&r.path())
                && let Ok(Some(rec)) = state::read_json::<ViewRecord>(&r.path())
            {
                if m.entry_at(&rec.content)
                    .ok()
                    .flatten()
                    .is_some_and(|e| is_view(&e.fs_type))
                {
                    tracing::warn!(view = %rec.content.display(), volume = %rec.volume_id, "this view's connection was not kept (no keeper ran): its pods' reads fail until they are restarted");
                } else {
                    let _ = state::remove_file(&self.ids_path(&rec.content));
                    let _ = state::remove_file(&r.path());
                }
            }
        }
    }

    fn take_one(
        &self,
        m: &dyn Mounter,
        roots: &Roots,
        content: &Path,
        dev: std::os::fd::OwnedFd,
    ) -> Result<()> {
        let mounted = m
            .entry_at(content)
            .ctx("look up the mount at", content)?
            .is_some_and(|e| is_view(&e.fs_type));
        if !mounted {
            return Err(Error::NotFound(format!(
                "no view is mounted at {} any more",
                content.display()
            )));
        }
        let at = self.record_path(content);
        let rec: ViewRecord = state::read_json(&at)
            .ctx("read", &at)?
            .ok_or_else(|| Error::NotFound(format!("no record of the view at {}", at.display())))?;
        let (root, vol) = cache::lookup(roots, &rec.volume_id)?;
        let sid = vol.source;
        tracing::info!(volume = %rec.volume_id, view = %content.display(), "taking a progressive view over");
        start(&root, &sid, rec, dev, true, self.ids_path(content))
    }
}

/// Serves a view on `dev` from threads of this process, and follows its
/// model; `resumed`: a server before this one negotiated the connection.
fn start(
    root: &Root,
    sid: &cache::SourceId,
    rec: ViewRecord,
    dev: std::os::fd::OwnedFd,
    resumed: bool,
    ids: PathBuf,
) -> Result<()> {
    let tree = Arc::new(Tree::new(&rec.listing).map_err(|e| {
        Error::Internal(format!("the listing of model {sid} cannot be shown: {e}"))
    })?);
    let gates = Arc::new(Gates::new(rec.listing.len()));
    let vol = Arc::new(
        fuse::Volume::new(
            tree.clone(),
            gates.clone(),
            vec![root.pull_area(sid).data(), root.source(sid).data()],
            WAIT_BOUND,
        )
        .with_ids_file(ids),
    );
    // Dropped when the server ends, however it ends: the follower stops.
    let (serving, stopped) = tokio::sync::watch::channel(());
    let id = rec.volume_id.clone();
    std::thread::Builder::new()
        .name("progressive-fuse".into())
        .spawn(move || {
            let _serving = serving;
            let served = match resumed {
                true => fuse::serve_resumed(dev, vol),
                false => fuse::serve(dev, vol),
            };
            if let Err(e) = served {
                tracing::warn!(volume = %id, error = %e, "the progressive view stopped");
            }
        })
        .map_err(|e| Error::io("start the server of", &rec.content, e))?;
    let follower = Follower {
        root: root.clone(),
        sid: sid.clone(),
        files: rec.listing.len(),
        tree,
        gates,
        stopped,
        following: Weak::new(),
    };
    let span = tracing::info_span!("progressive", volume = %rec.volume_id);
    // Its waits are on channels only, so a thread of its own runs it
    // without a runtime.
    std::thread::Builder::new()
        .name("progressive-follow".into())
        .spawn(move || futures::executor::block_on(follower.run().instrument(span)))
        .map_err(|e| Error::io("start the follower of", &rec.content, e))?;
    Ok(())
}

/// Keeps a view's gates following its model: each pull of it in turn,
/// then the seal, which opens every gate.
struct Follower {
    root: Root,
    sid: cache::SourceId,
    files: usize,
    tree: Arc<Tree>,
    gates: Arc<Gates>,
    /// Ends when the view's server does.
    stopped: tokio::sync::watch::Receiver<()>,
    /// The pull followed last.
    following: Weak<Partial>,
}

impl Follower {
    async fn run(mut self) {
        let mut starts = self.root.pulls.starts();
        loop {
            starts.borrow_and_update();
            // While a pull runs, its verdicts open the gates until it ends.
            if let Some(pull) = self.root.pulls.get(&self.sid) {
                let mut stage = pull.stage();
                self.follow(pull);
                tokio::select! {
                    _ = self.stopped.changed() => return,
                    () = async { while stage.changed().await.is_ok() {} } => continue,
                }
            }
            // No pull runs: one that ended before the look above left its
            // seal before it ended, and one that starts after it is heard.
            if cache::read_seal(&self.root, &self.sid)
                .ok()
                .flatten()
                .is_some()
            {
                // Every file is in place and verified; the view reads the
                // sealed source from here on.
                for i in 0..self.files {
                    self.gates.verified(i);
                }
                tracing::info!("the model is sealed; every file of the view is readable");
                return;
            }
            tokio::select! {
                _ = self.stopped.changed() => return,
                _ = starts.changed() => {}
            }
        }
    }

    /// Opens gates on `pull`'s verdicts, once per pull.
    fn follow(&mut self, pull: Arc<Partial>) {
        if Weak::ptr_eq(&self.following, &Arc::downgrade(&pull)) {
            return;
        }
        progressive::follow(&pull, &self.tree, &self.gates);
        // Readers already waiting asked the pull that ended.
        for i in self.gates.asked() {
            if let Some(path) = self.tree.path_of(i) {
                pull.want(path);
            }
        }
        self.following = Arc::downgrade(&pull);
    }
}
