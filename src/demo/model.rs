//! A generated stand-in for a Hugging Face model directory: `config.json`,
//! `tokenizer.json` and safetensors weights with a valid header, filled with
//! deterministic pseudo-random bytes (incompressible, never sparse).
//!
//! Used by the demo and the benchmark so both move real bytes without a
//! download. It only writes files; it never mounts.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Floats per weight row: keeps every tensor a plausible [rows, 1024] matrix.
const COLS: u64 = 1024;
const ROW_BYTES: u64 = COLS * 4;

/// What was written.
#[derive(Clone, Debug)]
pub struct Model {
    pub files: Vec<PathBuf>,
    /// Bytes in all files, headers and JSON included.
    pub total_bytes: u64,
    /// The largest weight file, relative to the model directory.
    pub main_file: String,
}

/// Writes a model with about `weight_bytes` of F32 weights into `dir`,
/// split into shards of at most `shard_bytes` (one file when it fits, named
/// `model.safetensors` as Hugging Face does). Every file is fsynced, so the
/// caller's later timings do not pay for this write-back. Setting `stop`
/// ends it within a MiB with `ErrorKind::Interrupted`.
pub fn write(
    dir: &Path,
    weight_bytes: u64,
    shard_bytes: u64,
    seed: u64,
    stop: &AtomicBool,
) -> io::Result<Model> {
    let rows_total = (weight_bytes / ROW_BYTES).max(1);
    let rows_per_shard = (shard_bytes / ROW_BYTES).max(1);
    let shards = rows_total.div_ceil(rows_per_shard);
    let mut rng = SplitMix64(seed);
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut main_file = String::new();
    let mut rows_left = rows_total;
    for i in 0..shards {
        let rows = rows_left.min(rows_per_shard);
        rows_left -= rows;
        let name = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        };
        let tensor = format!("layers.{i}.weight");
        write_safetensors(&dir.join(&name), &tensor, rows, &mut rng, stop)?;
        weight_map.insert(tensor, name.clone().into());
        if main_file.is_empty() {
            main_file = name.clone();
        }
        files.push(dir.join(name));
    }
    let mut json_files = vec![
        (
            "config.json",
            serde_json::json!({
                "architectures": ["DemoModel"],
                "model_type": "demo",
                "hidden_size": COLS,
                "num_hidden_layers": shards,
                "torch_dtype": "float32",
            }),
        ),
        ("tokenizer.json", tokenizer_json()),
    ];
    if shards > 1 {
        json_files.push((
            "model.safetensors.index.json",
            serde_json::json!({
                "metadata": { "total_size": rows_total * ROW_BYTES },
                "weight_map": weight_map,
            }),
        ));
    }
    for (name, value) in json_files {
        let path = dir.join(name);
        let mut f = File::create(&path)?;
        serde_json::to_writer_pretty(&mut f, &value)?;
        f.sync_all()?;
        files.push(path);
    }
    File::open(dir)?.sync_all()?;
    let mut total_bytes = 0;
    for f in &files {
        total_bytes += std::fs::metadata(f)?.len();
    }
    Ok(Model {
        files,
        total_bytes,
        main_file,
    })
}

/// The safetensors header for one F32 tensor of `rows` × 1024: an 8-byte
/// little-endian length, then JSON padded with spaces to an 8-byte boundary.
pub fn safetensors_header(tensor: &str, rows: u64) -> Vec<u8> {
    let data_len = rows * ROW_BYTES;
    let json = serde_json::json!({
        "__metadata__": { "format": "pt" },
        tensor: { "dtype": "F32", "shape": [rows, COLS], "data_offsets": [0, data_len] },
    })
    .to_string();
    let mut header = json.into_bytes();
    while !(8 + header.len()).is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out
}

fn write_safetensors(
    path: &Path,
    tensor: &str,
    rows: u64,
    rng: &mut SplitMix64,
    stop: &AtomicBool,
) -> io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(&safetensors_header(tensor, rows))?;
    let mut left = rows * ROW_BYTES;
    let mut buf = vec![0u8; MIB as usize];
    while left > 0 {
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "stopped"));
        }
        let n = left.min(MIB) as usize;
        rng.fill(&mut buf[..n]);
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// A small but well-formed tokenizer file: a word-level vocabulary.
fn tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        .into_iter()
        .map(String::from)
        .chain((0..996).map(|i| format!("tok{i}")))
        .enumerate()
        .map(|(i, t)| (t, i.into()))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "model": { "type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]" },
        "pre_tokenizer": { "type": "Whitespace" },
    })
}

/// splitmix64: fast, deterministic, good enough to defeat compression and dedup.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_describes_the_data() {
        let h = safetensors_header("w", 3);
        assert_eq!(h.len() % 8, 0);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h.len());
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["w"]["dtype"], "F32");
        assert_eq!(v["w"]["shape"], serde_json::json!([3, 1024]));
        assert_eq!(v["w"]["data_offsets"], serde_json::json!([0, 3 * 4096]));
    }

    #[test]
    fn sharded_model_files_add_up() {
        let go = AtomicBool::new(false);
        let dir = tempfile::tempdir().unwrap();
        let m = write(dir.path(), 10 * ROW_BYTES, 4 * ROW_BYTES, 7, &go).unwrap();
        let names: Vec<_> = m
            .files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&"model-00003-of-00003.safetensors".to_string()));
        assert!(names.contains(&"model.safetensors.index.json".to_string()));
        let third = std::fs::metadata(dir.path().join("model-00003-of-00003.safetensors")).unwrap();
        assert_eq!(
            third.len(),
            safetensors_header("layers.2.weight", 2).len() as u64 + 2 * ROW_BYTES
        );
        // Deterministic: the same seed writes the same bytes.
        let again = tempfile::tempdir().unwrap();
        write(again.path(), 10 * ROW_BYTES, 4 * ROW_BYTES, 7, &go).unwrap();
        let a = std::fs::read(dir.path().join(&m.main_file)).unwrap();
        let b = std::fs::read(again.path().join(&m.main_file)).unwrap();
        assert_eq!(a, b);
        let stopped = tempfile::tempdir().unwrap();
        let err = write(
            stopped.path(),
            10 * ROW_BYTES,
            4 * ROW_BYTES,
            7,
            &AtomicBool::new(true),
        );
        assert_eq!(err.unwrap_err().kind(), io::ErrorKind::Interrupted);
    }
}
