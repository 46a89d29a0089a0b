//! Process-wide settings, taken from flags once at start-up.

use std::path::PathBuf;

use crate::cache::Backend;

#[derive(Clone, Debug)]
pub struct Config {
    pub driver_name: String,
    /// Set when this process serves a node (or provisions node-local volumes).
    pub node_id: Option<String>,
    pub state_dir: PathBuf,
    /// Filesystems mounted at the same path on every node; the first is the default.
    pub shared_paths: Vec<PathBuf>,
    pub backends: Vec<Backend>,
}

impl Config {
    /// The topology key NodeGetInfo reports and node-local volumes require.
    pub fn topology_key(&self) -> String {
        format!("topology.{}/node", self.driver_name)
    }

    pub fn backend_enabled(&self, b: Backend) -> bool {
        self.backends.contains(&b)
    }
}
