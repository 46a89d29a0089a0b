//! What the source tests share: a remote file read whole, and a sha256 in
//! hex.

use bytes::Bytes;
use futures::TryStreamExt;
use modelcache_csi::puller::source::{RemoteFile, Source};
use sha2::{Digest, Sha256};

/// `len` bytes of `file` from `offset` (to its end with None); any error
/// panics, naming the file.
pub async fn read_all(
    src: &dyn Source,
    file: &RemoteFile,
    offset: u64,
    len: Option<u64>,
) -> Vec<u8> {
    let chunks: Vec<Bytes> = src
        .read(file, offset, len)
        .await
        .unwrap_or_else(|e| panic!("read {}: {e}", file.path))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("stream {}: {e}", file.path));
    chunks.concat()
}

pub fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}
