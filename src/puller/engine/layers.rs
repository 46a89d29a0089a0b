//! Unpacking verified layer blobs in manifest order, growing an XFS
//! image that turns out too small for what a layer unpacks to.

use super::*;
use crate::cache::store::{GROWTH_RESERVE, Growth};

/// Unpacks verified layers one at a time, in manifest order, so later
/// layers override and white out earlier ones as the image spec says.
pub(super) fn unpack_layers(
    work: &PullArea,
    extract: Extract,
    mut layers: Vec<Fetched>,
    mut budget: Budget,
) -> Result<Vec<FileEntry>> {
    layers.sort_by_key(|l| match l {
        Fetched::Layer { index, .. } => *index,
        Fetched::File(_) | Fetched::Failed(_) => 0,
    });
    let mut lists = Vec::new();
    for l in layers {
        let Fetched::Layer {
            key,
            blob,
            compression,
            subdir,
            extracted,
            ..
        } = l
        else {
            continue;
        };
        // Each layer gets what the ones before it left.
        let spend = |budget: &mut Budget, files: &[FileEntry]| {
            let bytes = files.iter().map(|f| f.size).fold(0, u64::saturating_add);
            budget.bytes = budget.bytes.saturating_sub(bytes);
            budget.entries = budget.entries.saturating_sub(files.len() as u64);
        };
        if let Some(done) = extracted {
            spend(&mut budget, &done);
            lists.push(done);
            continue;
        }
        let target = if subdir.is_empty() {
            work.data().to_path_buf()
        } else {
            work.data().join(&subdir)
        };
        fs::create_dir_all(&target).ctx("create", &target)?;
        let mut files = extract_growing(work, extract, &blob, compression, &target, &budget)?;
        spend(&mut budget, &files);
        if !subdir.is_empty() {
            for f in &mut files {
                f.path = format!("{subdir}/{}", f.path);
            }
        }
        let mut st = load_state(work, &key)?;
        st.extracted = Some(files.clone());
        save_state(work, &st)?;
        let _ = fs::remove_file(&blob);
        lists.push(files);
    }
    crate::puller::unpack::merge(work.data(), lists)
}

/// Times an xfs image may grow for one layer: 2^8 times its first size.
pub(super) const MAX_GROWTH: u32 = 8;

/// Unpacks one layer. On the xfs backend the image was sized from the
/// compressed bytes, so a layer can unpack to more than it holds: then the
/// image grows (doubling, as far as the disk under it allows) and the
/// layer is unpacked again from the start, which replaces every file the
/// failed attempt wrote.
pub(super) fn extract_growing(
    work: &PullArea,
    extract: Extract,
    blob: &Path,
    compression: Compression,
    target: &Path,
    budget: &Budget,
) -> Result<Vec<FileEntry>> {
    let mut grown = 0;
    loop {
        let err = match extract(blob, compression, target, budget) {
            Err(e) if e.is_no_space() && grown < MAX_GROWTH => e,
            r => return r,
        };
        match work.grow()? {
            Growth::Fixed => return Err(err),
            Growth::NoRoom { size, free } => {
                return Err(Error::OverLimit(format!(
                    "layer {} unpacks to more than its {size}-byte image holds, and {} has no room to grow it ({free} bytes free beyond a {GROWTH_RESERVE}-byte reserve): {err}",
                    blob.display(),
                    work.dir().display()
                )));
            }
            Growth::Grew { from, to } => warn!(
                image_bytes = from,
                grow_to = to,
                "a layer unpacks to more than its image holds; grew the image"
            ),
        }
        grown += 1;
    }
}

impl Engine {
    /// Unpacks `layers` within what is left: the model's limits less its
    /// plain files `entries`, and never more than the cache has room for.
    pub(super) async fn unpack_within(
        &self,
        root: &Root,
        pull: &Pull<'_>,
        work: &Arc<PullArea>,
        capacity: Option<u64>,
        entries: &[FileEntry],
        layers: Vec<Fetched>,
    ) -> Result<Vec<FileEntry>> {
        let plain: u64 = entries
            .iter()
            .map(|e: &FileEntry| e.size)
            .fold(0, u64::saturating_add);
        let (w, x, r, limits) = (work.clone(), self.extract, root.clone(), pull.limits);
        let plain_files = entries.len() as u64;
        let mut seal = cache::manifest::SealMeter::default();
        for e in entries {
            seal.file(&e.path, e.size);
        }
        blocking(move || {
                    let room = cache::evict::available(&r, capacity)?;
                    let by_limit = limits.max_bytes.saturating_sub(plain);
                    let budget = Budget {
                        bytes: by_limit.min(room),
                        bytes_limit: if by_limit <= room {
                            format!(
                                "the model's limit of {} bytes, --max-model-bytes or the class's maxModelBytes",
                                limits.max_bytes
                            )
                        } else {
                            format!("the room left in {}", r.describe())
                        },
                        entries: limits.max_files.saturating_sub(plain_files),
                        entries_limit: format!(
                            "the model's limit of {} files, --max-model-files or the class's maxModelFiles",
                            limits.max_files
                        ),
                        seal: std::sync::Mutex::new(seal),
                    };
                    unpack_layers(&w, x, layers, budget)
                })
                .await
    }
}
