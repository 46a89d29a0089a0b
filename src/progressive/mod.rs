//! Progressive volumes (issue #24): a model served to pods while it is
//! still arriving, through a FUSE filesystem whose tree comes from the
//! listing and whose reads wait for each file (or each chunk, under a
//! chunk table) to be verified. This is the
//! serving half: the tree, the gates and the server; the fill that opens
//! the gates is the pull engine's.

pub mod fuse;
pub mod gate;
pub mod keeper;
pub mod tree;

use std::sync::Arc;
use std::time::Duration;

/// How long a read of a file not yet verified waits before it answers
/// EIO: long enough for a shard of a large model on a slow origin, short
/// enough that a stalled fill fails a model load instead of hanging it.
pub const WAIT_BOUND: Duration = Duration::from_secs(600);

use crate::cache::partial::{Partial, Verdict};

/// Opens the gate of each file of `tree` as `pull` verifies it, and tells
/// the pull which files readers wait for, so it fetches them next.
pub fn follow(pull: &Arc<Partial>, tree: &Arc<tree::Tree>, gates: &Arc<gate::Gates>) {
    // Weak: the pull's listeners hold the gates, and the view must end
    // with its pull (`Pulls::get` finds only live pulls).
    let (t, p) = (tree.clone(), Arc::downgrade(pull));
    gates.set_asker(Box::new(move |index| {
        if let (Some(path), Some(pull)) = (t.path_of(index), p.upgrade()) {
            pull.want(path);
        }
    }));
    let (tree, gates) = (tree.clone(), gates.clone());
    pull.subscribe(Box::new(move |path, verdict| {
        if let Some(index) = tree.index_of(path) {
            match verdict {
                Verdict::Verified => gates.verified(index),
                Verdict::Failed(why) => gates.failed(index, why.clone()),
                Verdict::Readable { bytes, at } => gates.readable(index, *bytes, at.clone()),
                Verdict::Refetching(_) => gates.refetching(index),
            }
        }
    }));
}
