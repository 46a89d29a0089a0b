//! Staging a progressive volume whose model is not sealed yet: the FUSE
//! view of the model's pull on the staging path, served by this process
//! until it is unmounted, and kept following the model's pulls (a failed
//! pull runs again with a new partial view) until the seal.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::cache::partial::{self, Partial};
use crate::cache::{self, Root, VolumeRecord};
use crate::error::{Error, IoContext, Result};
use crate::mount::Mounter;
use crate::progressive::{self, fuse, gate::Gates, tree::Tree};

/// The view's name in the mount table: `fuse.modelcache`.
pub const FS_NAME: &str = "modelcache";

/// How long a read of a file not yet verified waits before it answers
/// EIO: long enough for a shard of a large model on a slow origin, short
/// enough that a stalled fill fails a model load instead of hanging it.
pub const WAIT_BOUND: Duration = Duration::from_secs(600);

/// How often the follower looks for a new pull of the model, or its seal.
const FOLLOW_EVERY: Duration = Duration::from_millis(100);

/// Whether a mount found on a staging path's content is a progressive view.
pub fn is_view(fs_type: &str) -> bool {
    fs_type.strip_prefix("fuse.") == Some(FS_NAME)
}

/// Mounts the view of `rec`'s model on `content` (an empty directory
/// inside the staging path's wrapper) and serves it from threads of this
/// process. The model's pull must run in this process with its listing
/// known; otherwise UNAVAILABLE, and kubelet's retry finds it (a restart
/// resumes the pull, see `provision::wanted`).
pub fn mount(m: &dyn Mounter, root: &Root, rec: &VolumeRecord, content: &Path) -> Result<()> {
    let sid = &rec.source;
    let Some(pull) = partial::lookup(sid.as_str()).filter(|p| p.listing().is_some()) else {
        return Err(Error::Transient(format!(
            "model {sid} of progressive volume {} is neither sealed nor being pulled on this \
             node yet; its pull is started again by the provisioner, retry",
            rec.id
        )));
    };
    let listing = pull.listing().unwrap_or_default().to_vec();
    let tree = Arc::new(Tree::new(&listing).map_err(|e| {
        Error::Internal(format!("the listing of model {sid} cannot be shown: {e}"))
    })?);
    let gates = Arc::new(Gates::new(listing.len()));
    let vol = Arc::new(fuse::Volume::new(
        tree.clone(),
        gates.clone(),
        vec![root.pull_area(sid).data(), root.source(sid).data()],
        WAIT_BOUND,
    ));
    let dev = m
        .mount_fuse(content, FS_NAME)
        .ctx("mount the progressive view on", content)?;
    let serving = Arc::new(AtomicBool::new(true));
    let (s, id) = (serving.clone(), rec.id.clone());
    let spawned = std::thread::Builder::new()
        .name("progressive-fuse".into())
        .spawn(move || {
            if let Err(e) = fuse::serve(dev, vol) {
                tracing::warn!(volume = %id, error = %e, "the progressive view stopped");
            }
            s.store(false, Ordering::Relaxed);
        });
    if let Err(e) = spawned {
        let _ = m.unmount(content);
        return Err(Error::io("start the server of", content, e));
    }
    let follower = Follower {
        root: root.clone(),
        sid: sid.to_string(),
        files: listing.len(),
        tree,
        gates,
        serving,
        following: Weak::new(),
    };
    let id = rec.id.clone();
    std::thread::Builder::new()
        .name("progressive-follow".into())
        .spawn(move || follower.run(&id))
        .map_err(|e| Error::io("start the follower of", content, e))?;
    Ok(())
}

/// Keeps a view's gates following its model: each pull of it in turn,
/// then the seal, which opens every gate.
struct Follower {
    root: Root,
    sid: String,
    files: usize,
    tree: Arc<Tree>,
    gates: Arc<Gates>,
    serving: Arc<AtomicBool>,
    /// The pull followed now; weak, so that a pull's end is seen.
    following: Weak<Partial>,
}

impl Follower {
    fn run(mut self, volume: &str) {
        let _span = tracing::info_span!("progressive", volume = %volume).entered();
        while self.serving.load(Ordering::Relaxed) {
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
            if let Some(pull) = partial::lookup(&self.sid)
                && !Weak::ptr_eq(&self.following, &Arc::downgrade(&pull))
            {
                progressive::follow(&pull, &self.tree, &self.gates);
                // Readers already waiting asked the pull that ended.
                for i in self.gates.asked() {
                    if let Some(path) = self.tree.path_of(i) {
                        pull.want(path);
                    }
                }
                self.following = Arc::downgrade(&pull);
            }
            std::thread::sleep(FOLLOW_EVERY);
        }
    }
}
