//! Progressive volumes (issue #24): a model served to pods while it is
//! still arriving, through a FUSE filesystem whose tree comes from the
//! listing and whose reads wait for each file to be verified. This is the
//! serving half: the tree, the gates and the server; the fill that opens
//! the gates is the pull engine's.

pub mod fuse;
pub mod gate;
pub mod tree;
