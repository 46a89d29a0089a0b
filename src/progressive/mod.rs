//! Progressive volumes (issue #24): a model served to pods while it is
//! still arriving, through a FUSE filesystem whose tree comes from the
//! listing and whose reads wait for each file to be verified. This is the
//! serving half: the tree, the gates and the server; the fill that opens
//! the gates is the pull engine's.

pub mod fuse;
pub mod gate;
pub mod tree;

use std::sync::Arc;

use crate::cache::partial::Partial;

/// Opens the gate of each file of `tree` as `pull` verifies it.
pub fn follow(pull: &Partial, tree: &Arc<tree::Tree>, gates: &Arc<gate::Gates>) {
    let (tree, gates) = (tree.clone(), gates.clone());
    pull.subscribe(Box::new(move |path| {
        if let Some(index) = tree.index_of(path) {
            gates.verified(index);
        }
    }));
}
