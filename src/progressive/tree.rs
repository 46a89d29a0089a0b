//! A model's tree as its listing gives it, before any byte has arrived:
//! every directory and file with its final size, by FUSE inode number.

use std::collections::BTreeMap;

/// Inode 1 is the root, as FUSE requires.
pub const ROOT: u64 = 1;

#[derive(Debug)]
pub enum Node {
    Dir {
        /// Child name → inode, sorted, so readdir offsets are stable.
        children: BTreeMap<String, u64>,
        parent: u64,
    },
    File {
        /// Its index in the listing, which is also its gate's.
        index: usize,
        size: u64,
        /// Its path in the model, relative to the root.
        path: String,
    },
}

#[derive(Debug)]
pub struct Tree {
    /// By inode - 1.
    nodes: Vec<Node>,
    /// Listing index → inode.
    files: Vec<u64>,
}

impl Tree {
    /// The tree of `files` (relative paths with `/` between components, and
    /// final sizes). A path that is empty, absolute, has `.`/`..` or an empty
    /// component, or that names a file as a directory (or twice), is refused:
    /// the listing passed the engine's checks already, and this must not
    /// build a different tree from what the seal will name.
    pub fn new(files: &[(String, u64)]) -> Result<Tree, String> {
        let mut t = Tree {
            nodes: vec![Node::Dir {
                children: BTreeMap::new(),
                parent: ROOT,
            }],
            files: Vec::with_capacity(files.len()),
        };
        for (index, (path, size)) in files.iter().enumerate() {
            let parts: Vec<&str> = path.split('/').collect();
            if parts
                .iter()
                .any(|p| p.is_empty() || *p == "." || *p == "..")
            {
                return Err(format!("{path:?} is not a plain relative path"));
            }
            let mut dir = ROOT;
            for (i, part) in parts.iter().enumerate() {
                let last = i + 1 == parts.len();
                let next = t.nodes.len() as u64 + 1;
                let Node::Dir { children, .. } = &mut t.nodes[(dir - 1) as usize] else {
                    return Err(format!("{path:?} passes through a file"));
                };
                match children.get(*part) {
                    Some(_) if last => return Err(format!("{path:?} is listed twice")),
                    Some(&child) => dir = child,
                    None => {
                        children.insert(part.to_string(), next);
                        if last {
                            t.files.push(next);
                        }
                        t.nodes.push(if last {
                            Node::File {
                                index,
                                size: *size,
                                path: path.clone(),
                            }
                        } else {
                            Node::Dir {
                                children: BTreeMap::new(),
                                parent: dir,
                            }
                        });
                        dir = next;
                    }
                }
            }
        }
        Ok(t)
    }

    pub fn get(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(ino.checked_sub(1)? as usize)
    }

    /// The listing index of the file at `path`.
    pub fn index_of(&self, path: &str) -> Option<usize> {
        let mut ino = ROOT;
        for part in path.split('/') {
            ino = self.lookup(ino, part)?;
        }
        match self.get(ino)? {
            Node::File { index, .. } => Some(*index),
            Node::Dir { .. } => None,
        }
    }

    /// The listed path of file `index`.
    pub fn path_of(&self, index: usize) -> Option<&str> {
        match self.get(*self.files.get(index)?)? {
            Node::File { path, .. } => Some(path),
            Node::Dir { .. } => None,
        }
    }

    /// The listed size of file `index`.
    pub fn size_of(&self, index: usize) -> Option<u64> {
        match self.get(*self.files.get(index)?)? {
            Node::File { size, .. } => Some(*size),
            Node::Dir { .. } => None,
        }
    }

    pub fn lookup(&self, dir: u64, name: &str) -> Option<u64> {
        match self.get(dir)? {
            Node::Dir { children, .. } => children.get(name).copied(),
            Node::File { .. } => None,
        }
    }

    /// Directories and files, for statfs.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_tree_is_known_from_the_listing() {
        let files = [
            ("config.json".to_string(), 2),
            ("tokenizer/vocab/vocab.txt".to_string(), 4),
            ("tokenizer/merges.txt".to_string(), 8),
        ];
        let t = Tree::new(&files).unwrap();
        let tok = t.lookup(ROOT, "tokenizer").unwrap();
        let vocab = t.lookup(tok, "vocab").unwrap();
        let f = t.lookup(vocab, "vocab.txt").unwrap();
        assert!(matches!(
            t.get(f),
            Some(Node::File {
                index: 1,
                size: 4,
                ..
            })
        ));
        assert!(matches!(t.get(vocab), Some(Node::Dir { parent, .. }) if *parent == tok));
        assert_eq!(t.lookup(ROOT, "nope"), None);
        assert_eq!(t.path_of(2), Some("tokenizer/merges.txt"));
        assert_eq!(t.index_of("tokenizer/merges.txt"), Some(2));
        assert_eq!(t.index_of("tokenizer"), None);
        assert_eq!(t.len(), 6);
        for bad in ["", "/abs", "a//b", "../x", "a/./b"] {
            assert!(Tree::new(&[(bad.to_string(), 1)]).is_err(), "{bad}");
        }
        assert!(Tree::new(&[("a".into(), 1), ("a/b".into(), 1)]).is_err());
        assert!(Tree::new(&[("a".into(), 1), ("a".into(), 1)]).is_err());
    }
}
