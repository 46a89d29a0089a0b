//! `modelcache-csi cache`: the node operator's view of what the driver
//! holds (what, how big, how recently used, pinned, used by which volumes),
//! and the few things an operator does to it: verify, pin, unpin, evict,
//! prefetch. It works on the node's state directory, next to a running
//! driver: every change goes through the same cache functions the driver
//! uses, which are safe across processes.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cache::manifest::{self, Seal};
use crate::cache::{self, Root, Roots, SourceId, evict};
use crate::config::Config;
use crate::error::{Error, IoContext, Result};
use crate::offload::blocking;
use crate::provision::params::Params;
use crate::puller::engine::{Engine, Progress, ProgressSink};
use crate::puller::{self, SourceOptions};
use crate::state;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(clap::Subcommand, Debug)]
pub enum CacheCommand {
    /// Every pulled model and source volume, in every root.
    Ls,
    /// One entry in full: its seal, files and the volumes that use it.
    Show { id: String },
    /// Rehash every file against the seal and report each mismatch.
    Verify { id: String },
    /// Keep a pulled model however long it is unused.
    Pin { id: String },
    /// Let eviction reclaim a pulled model again.
    Unpin { id: String },
    /// Remove a pulled model now; refused while a volume uses it or it is pinned.
    Evict { id: String },
    /// Drop the writer lease a dead node holds on an unsealed source volume.
    ///
    /// Another node can then stage it writable, or it can be sealed. Only
    /// for a node that is gone (deleted, or down for good): a live node's
    /// pods would go on writing what another node then writes too.
    ReleaseWriter {
        /// The source volume's id (`cache ls`).
        id: String,
        /// The node whose lease to drop (as `cache show` lists it under Writers).
        #[arg(long)]
        node: String,
    },
    /// Pull a model URI into the cache before any pod asks for it.
    Prefetch {
        uri: String,
        /// A source parameter, as a StorageClass gives it and checked as a class's is (e.g. s3Endpoint=http://minio:9000, hfIgnorePatterns=original/*); repeatable.
        #[arg(long = "param", value_name = "KEY=VALUE")]
        params: Vec<String>,
        /// A file of credentials, one KEY=VALUE per line, as a provisioner
        /// secret holds them (e.g. awsAccessKeyID=...).
        #[arg(long, value_name = "FILE")]
        secrets_file: Option<PathBuf>,
        /// The backend to pull into (default: the first enabled).
        #[arg(long)]
        backend: Option<String>,
        /// Pin the model once it is sealed.
        #[arg(long)]
        pin: bool,
    },
}

/// What `ls` and `show` say of one entry.
#[derive(Debug, Serialize)]
pub struct Entry {
    pub id: String,
    pub backend: String,
    /// `model` (pulled, evictable) or `source` (a source volume).
    pub kind: &'static str,
    pub sealed: bool,
    pub origin: Option<String>,
    pub revision: Option<String>,
    pub bytes: u64,
    pub files: usize,
    pub sealed_unix: Option<u64>,
    pub last_used_unix: Option<u64>,
    pub pinned: bool,
    /// Volume ids that read it.
    pub volumes: Vec<String>,
    /// Nodes that hold it writable (unsealed sources).
    pub writers: Vec<String>,
    /// Who signed it, as verified by signature policies: when it was
    /// sealed, and when volumes of other classes were made over it.
    pub signed_by: Vec<String>,
    pub path: PathBuf,
    /// Why its seal cannot be read (torn, over its bound, forged): it
    /// serves no volume, counts as nothing, and is evicted when unused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
}

/// The node whose driver wrote the node-local volume records under
/// `state_dir`, when no node was named: a record's `node` is taken only
/// if its root key, which hashes the node's name with the root's
/// directory, matches the record's volume id, so a record from another
/// node's directory, copied here, names nobody.
pub fn node_from_records(state_dir: &Path) -> Option<String> {
    use crate::cache::Backend;
    use crate::cache::layout::{Reserve, VolumeId};
    for backend in Backend::ALL {
        if !backend.store().placement().on_node {
            continue;
        }
        let dir = state_dir.join(backend.as_str());
        let Ok(entries) = std::fs::read_dir(dir.join("volumes")) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(text) = std::fs::read(e.path()) else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text) else {
                continue;
            };
            let (Some(node), Some(id)) = (
                v["node"].as_str(),
                v["id"].as_str().and_then(VolumeId::parse),
            ) else {
                continue;
            };
            let root = Root::with_anchor(
                backend,
                dir.clone(),
                Some(node.to_string()),
                state_dir.to_path_buf(),
                Reserve::default(),
            );
            if root.key == id.root_key {
                return Some(node.to_string());
            }
        }
    }
    None
}

/// Runs one command; what it prints goes to stdout, failures are errors.
pub async fn run(cfg: Config, output: Output, cmd: CacheCommand) -> Result<()> {
    let roots = crate::cache::Roots::of(&cfg);
    if roots.roots.is_empty() {
        return Err(Error::invalid(
            "--node-id",
            "no root is enabled: node-local backends need --node-id (or NODE_ID, or NODE_NAME as in the node plugin's container), shared ones --shared-path",
        ));
    }
    match cmd {
        CacheCommand::Ls => {
            let entries = blocking(move || list(&roots)).await?;
            print(output, &entries, || table(&entries))
        }
        CacheCommand::Show { id } => {
            let (root, id) = find(&roots, &id)?;
            let (e, seal) = blocking(move || {
                let e = entry(&root, &id)?;
                let seal = match e.unreadable {
                    Some(_) => None,
                    None => cache::read_seal(&root, &id)?,
                };
                Ok((e, seal))
            })
            .await?;
            #[derive(Serialize)]
            struct Shown<'a> {
                #[serde(flatten)]
                entry: &'a Entry,
                seal: Option<&'a Seal>,
            }
            let shown = Shown {
                entry: &e,
                seal: seal.as_ref(),
            };
            print(output, &shown, || show(&e, seal.as_ref()))
        }
        CacheCommand::Verify { id } => {
            let (root, id) = find(&roots, &id)?;
            let report = blocking(move || verify(&root, &id, output)).await?;
            print(output, &report, || {
                if report.mismatches.is_empty() {
                    format!(
                        "{}: {} files, {} verified against the seal",
                        report.id,
                        report.files,
                        human_bytes(report.bytes)
                    )
                } else {
                    let mut s = format!(
                        "{}: {} of {} files do not match the seal:",
                        report.id,
                        report.mismatches.len(),
                        report.files
                    );
                    for m in &report.mismatches {
                        s.push_str(&format!("\n  {}: {}", m.path, m.problem));
                    }
                    s
                }
            })?;
            if report.mismatches.is_empty() {
                Ok(())
            } else {
                Err(Error::Precondition(format!(
                    "{} does not match its seal ({} files)",
                    report.id,
                    report.mismatches.len()
                )))
            }
        }
        CacheCommand::Pin { id } => set_pinned(&roots, &id, true, output).await,
        CacheCommand::Unpin { id } => set_pinned(&roots, &id, false, output).await,
        CacheCommand::Evict { id } => {
            let (root, id) = find(&roots, &id)?;
            let gone = blocking(move || do_evict(&root, &id)).await?;
            print(output, &gone, || format!("{} evicted", gone.id))
        }
        CacheCommand::ReleaseWriter { id, node } => {
            let (root, id) = find(&roots, &id)?;
            let (id, h) = blocking(move || {
                let src = root.open_source(&id)?;
                cache::lease::break_lease(&src, &id, &node).map(|h| (id, h))
            })
            .await?;
            let staging = h.lease.as_ref().map(|l| l.staging.clone());
            print(
                output,
                &serde_json::json!({"id": id, "node": h.node, "staging": staging}),
                || format!("{id}: the writer lease of {} is released", h.describe()),
            )
        }
        CacheCommand::Prefetch {
            uri,
            params,
            secrets_file,
            backend,
            pin,
        } => {
            prefetch(
                &cfg,
                &roots,
                output,
                &uri,
                &params,
                secrets_file.as_deref(),
                backend,
                pin,
            )
            .await
        }
    }
}

fn print<T: Serialize>(output: Output, value: &T, human: impl FnOnce() -> String) -> Result<()> {
    match output {
        Output::Json => {
            let s = serde_json::to_string_pretty(value)
                .map_err(|e| Error::Internal(format!("encode JSON: {e}")))?;
            println!("{s}");
        }
        Output::Table => println!("{}", human()),
    }
    Ok(())
}

/// The root that holds `id`, and `id` as the source id it must be.
fn find(roots: &Roots, id: &str) -> Result<(Root, SourceId)> {
    let Some(sid) = SourceId::parse(id) else {
        return Err(Error::invalid(
            "ID",
            format!("{id:?} is not a source or model id (see `modelcache-csi cache ls`)"),
        ));
    };
    roots
        .roots
        .iter()
        .find(|r| cache::source_exists(r, &sid))
        .map(|r| (r.clone(), sid))
        .ok_or_else(|| {
            Error::NotFound(format!(
                "{id} is in none of this node's roots ({}); see `modelcache-csi cache ls`",
                roots
                    .roots
                    .iter()
                    .map(|r| r.describe())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

fn list(roots: &Roots) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    for root in &roots.roots {
        let dir = root.sources_dir();
        for name in state::list_names(&dir).ctx("list", &dir)? {
            if let Some(sid) = SourceId::parse(&name) {
                out.push(entry(root, &sid)?);
            }
        }
    }
    Ok(out)
}

fn entry(root: &Root, sid: &SourceId) -> Result<Entry> {
    let (seal, unreadable) = match cache::read_seal(root, sid) {
        Ok(seal) => (seal, None),
        Err(Error::Precondition(why)) => (None, Some(why)),
        Err(e) => return Err(e),
    };
    let model = sid.is_model();
    let uuids = evict::live_refs(root, sid)?;
    let volumes = uuids.iter().map(|uuid| root.volume_id(uuid)).collect();
    let mut signed_by: Vec<String> = seal.iter().filter_map(|s| s.signed_by.clone()).collect();
    for uuid in &uuids {
        if let Some(w) = cache::read_volume(root, uuid)?.and_then(|v| v.signed_by)
            && !signed_by.contains(&w)
        {
            signed_by.push(w);
        }
    }
    let bytes = match &seal {
        Some(s) => s.total_bytes,
        None => du(&root.source(sid).data()),
    };
    Ok(Entry {
        id: sid.to_string(),
        backend: root.backend.to_string(),
        kind: if model { "model" } else { "source" },
        sealed: seal.is_some(),
        origin: seal.as_ref().map(|s| s.origin.clone()),
        revision: seal.as_ref().and_then(|s| s.revision.clone()),
        bytes,
        files: seal.as_ref().map(|s| s.files.len()).unwrap_or(0),
        sealed_unix: seal.as_ref().map(|s| s.sealed_unix),
        last_used_unix: Some(evict::last_used(root, sid)).filter(|t| *t > 0),
        pinned: evict::is_pinned(root, sid),
        volumes,
        writers: cache::writers(root, sid)?,
        signed_by,
        path: root.source(sid).dir,
        unreadable,
    })
}

/// Bytes of regular files under `dir` (an unsealed source has no seal to
/// say); 0 when it cannot be read.
fn du(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn ago(unix: Option<u64>) -> String {
    let Some(t) = unix else {
        return "-".into();
    };
    let s = cache::now_unix().saturating_sub(t);
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86400 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

fn table(entries: &[Entry]) -> String {
    if entries.is_empty() {
        return "nothing cached on this node".into();
    }
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING).set_header([
        "ID",
        "BACKEND",
        "KIND",
        "ORIGIN",
        "SIZE",
        "FILES",
        "LAST USED",
        "PINNED",
        "VOLUMES",
    ]);
    for e in entries {
        let origin = match (&e.origin, e.sealed) {
            _ if e.unreadable.is_some() => "(seal unreadable: see `cache show`)".into(),
            (Some(o), _) => o.clone(),
            (None, false) if !e.writers.is_empty() => {
                format!("(unsealed, written on {})", e.writers.join(", "))
            }
            (None, _) => "(unsealed)".into(),
        };
        t.add_row([
            e.id.clone(),
            e.backend.clone(),
            e.kind.to_string(),
            origin,
            human_bytes(e.bytes),
            e.files.to_string(),
            ago(e.last_used_unix),
            if e.pinned { "yes" } else { "no" }.to_string(),
            e.volumes.len().to_string(),
        ]);
    }
    t.to_string()
}

fn show(e: &Entry, seal: Option<&Seal>) -> String {
    let mut s = format!(
        "ID:        {}\nBackend:   {}\nKind:      {}\nPath:      {}\nSealed:    {}\nOrigin:    {}\nRevision:  {}\nSize:      {} ({} bytes) in {} files\nLast used: {}\nPinned:    {}\nVolumes:   {}\n",
        e.id,
        e.backend,
        e.kind,
        e.path.display(),
        match e.sealed_unix {
            Some(_) => ago(e.sealed_unix),
            None => "no".into(),
        },
        e.origin.as_deref().unwrap_or("-"),
        e.revision.as_deref().unwrap_or("-"),
        human_bytes(e.bytes),
        e.bytes,
        e.files,
        ago(e.last_used_unix),
        if e.pinned { "yes" } else { "no" },
        if e.volumes.is_empty() {
            "none".to_string()
        } else {
            e.volumes.join(", ")
        },
    );
    if !e.writers.is_empty() {
        s.push_str(&format!("Writers:   {}\n", e.writers.join(", ")));
    }
    if let Some(why) = &e.unreadable {
        s.push_str(&format!(
            "Unreadable: {why}; it serves no volume, counts as nothing and is evicted when unused (or `cache evict`)\n"
        ));
    }
    if e.sealed {
        s.push_str(&format!(
            "Signed by: {}\n",
            if e.signed_by.is_empty() {
                "not checked (no class with modelSignature has used it)".to_string()
            } else {
                e.signed_by.join("; ")
            }
        ));
    }
    if let Some(peers) = seal.map(|s| &s.filled_from).filter(|p| !p.is_empty()) {
        s.push_str(&format!(
            "Peers:     {} (bytes checked against the origin's digests)\n",
            peers.join(", ")
        ));
    }
    if let Some(seal) = seal {
        s.push_str("Files:\n");
        for f in &seal.files {
            s.push_str(&format!(
                "  {:>10}  {}  {}\n",
                human_bytes(f.size),
                &f.sha256[..16.min(f.sha256.len())],
                f.path
            ));
        }
    }
    s.trim_end().to_string()
}

#[derive(Debug, Serialize)]
pub struct Mismatch {
    pub path: String,
    pub problem: String,
}

#[derive(Debug, Serialize)]
pub struct VerifyReport {
    pub id: String,
    pub files: usize,
    pub bytes: u64,
    pub mismatches: Vec<Mismatch>,
}

/// Rehashes every file of a sealed entry, through the store's read-only
/// view of it (an XFS image is mounted `ro,norecovery,nouuid` for the time
/// of the check).
fn verify(root: &Root, sid: &SourceId, output: Output) -> Result<VerifyReport> {
    let seal = cache::read_seal(root, sid)?.ok_or_else(|| {
        Error::Precondition(format!(
            "{sid} is not sealed: there is nothing to verify it against"
        ))
    })?;
    let mut report = None;
    root.backend.store().view_sealed(root, sid, &mut |data| {
        report = Some(rehash(data, &seal, sid, output));
    })?;
    report.unwrap_or_else(|| Err(Error::Internal(format!("{sid} was not verified"))))
}

fn rehash(data: &Path, seal: &Seal, sid: &str, output: Output) -> Result<VerifyReport> {
    let bar = bar(output, Some(seal.total_bytes), &format!("verifying {sid}"));
    let mut mismatches = Vec::new();
    for f in &seal.files {
        let path = data.join(&f.path);
        let problem = match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("missing".to_string()),
            Err(e) => Some(format!("cannot be read: {e}")),
            Ok(m) if !m.is_file() => Some("no longer a regular file".into()),
            Ok(m) if m.len() != f.size => {
                Some(format!("{} bytes, the seal recorded {}", m.len(), f.size))
            }
            Ok(_) => match manifest::hash_file(&path) {
                Ok((_, sha)) if sha == f.sha256 => None,
                Ok((_, sha)) => Some(format!("sha256 {sha}, the seal recorded {}", f.sha256)),
                Err(e) => Some(format!("cannot be read: {e}")),
            },
        };
        bar.add(f.size);
        if let Some(problem) = problem {
            mismatches.push(Mismatch {
                path: f.path.clone(),
                problem,
            });
        }
    }
    bar.finish();
    Ok(VerifyReport {
        id: sid.to_string(),
        files: seal.files.len(),
        bytes: seal.total_bytes,
        mismatches,
    })
}

#[derive(Serialize)]
struct Changed {
    id: String,
    pinned: bool,
}

async fn set_pinned(roots: &Roots, id: &str, pinned: bool, output: Output) -> Result<()> {
    let (root, sid) = find(roots, id)?;
    if !sid.is_model() {
        return Err(Error::Precondition(format!(
            "{id} is a source volume, never evicted: only pulled models are pinned"
        )));
    }
    blocking(move || evict::set_pinned(&root, &sid, pinned)).await?;
    let c = Changed {
        id: id.to_string(),
        pinned,
    };
    print(output, &c, || {
        format!(
            "{id} {}",
            if pinned {
                "pinned: eviction leaves it"
            } else {
                "unpinned: eviction may reclaim it when unused"
            }
        )
    })
}

#[derive(Serialize)]
struct Evicted {
    id: String,
    bytes: u64,
}

fn do_evict(root: &Root, sid: &SourceId) -> Result<Evicted> {
    if !sid.is_model() {
        return Err(Error::Precondition(format!(
            "{sid} is a source volume: it goes with its volume (delete the PVC), never by eviction"
        )));
    }
    let e = entry(root, sid)?;
    if !e.volumes.is_empty() {
        return Err(Error::Precondition(format!(
            "{sid} is in use by {} volume(s): {}; delete their PVCs first",
            e.volumes.len(),
            e.volumes.join(", ")
        )));
    }
    if e.pinned {
        return Err(Error::Precondition(format!(
            "{sid} is pinned: `modelcache-csi cache unpin {sid}` first"
        )));
    }
    if !evict::evict(root, sid)? {
        return Err(Error::Precondition(format!(
            "{sid} gained a volume while it was being evicted; it stays"
        )));
    }
    Ok(Evicted {
        id: sid.to_string(),
        bytes: e.bytes,
    })
}

#[derive(Serialize)]
struct Prefetched<'a> {
    id: &'a str,
    origin: &'a str,
    revision: Option<&'a str>,
    bytes: u64,
    files: usize,
    already_cached: bool,
    pinned: bool,
    seconds: f64,
}

/// `--param KEY=VALUE`s, checked as a StorageClass's parameters are
/// (`Params::parse`, with `uri` as its `source`): only what a class says of
/// its source is taken, and each refusal names `--param KEY`.
fn source_params(uri: &str, params: &[String]) -> Result<Params> {
    use crate::provision::params::{SOURCE, SOURCE_OPTIONS};
    let mut map = HashMap::new();
    for p in params {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| Error::invalid("--param", format!("{p:?} must look like KEY=VALUE")))?;
        let source_key = SOURCE_OPTIONS.contains(&k)
            || k == crate::trust::ALLOWED_SOURCES
            || k == crate::trust::ARTIFACT_CREDENTIALS;
        if !source_key {
            return Err(Error::invalid(
                format!("--param {k}"),
                format!(
                    "not a parameter of a model's source: --param takes what a StorageClass says of \
                     its source ({}, {}, {}); the model is the URI, the backend --backend",
                    SOURCE_OPTIONS.join(", "),
                    crate::trust::ALLOWED_SOURCES,
                    crate::trust::ARTIFACT_CREDENTIALS
                ),
            ));
        }
        map.insert(k.to_string(), v.to_string());
    }
    map.insert(SOURCE.to_string(), uri.to_string());
    Params::parse(&map).map_err(|e| match e {
        Error::Invalid { field, message } => Error::Invalid {
            field: match field.strip_prefix("parameters.") {
                Some(k) => format!("--param {k}"),
                None => field,
            },
            message,
        },
        e => e,
    })
}

#[allow(clippy::too_many_arguments)]
async fn prefetch(
    cfg: &Config,
    roots: &Roots,
    output: Output,
    uri: &str,
    params: &[String],
    secrets_file: Option<&Path>,
    backend: Option<String>,
    pin: bool,
) -> Result<()> {
    puller::validate_uri(uri).map_err(|m| Error::invalid("URI", m))?;
    let mut opts = SourceOptions::default();
    let params = source_params(uri, params)?;
    opts.params = params.source_options;
    // What a registry's answer may reach, as a StorageClass would say it.
    opts.bounds = crate::trust::Bounds {
        allowed: params.allowed_sources,
        credentialed: params.artifact_credentials,
        ranges: cfg.tenant_ranges.clone(),
    };
    if let Some(f) = secrets_file {
        let text = std::fs::read_to_string(f).ctx("read", f)?;
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (k, v) = line.split_once('=').ok_or_else(|| {
                Error::invalid(
                    "--secrets-file",
                    format!("{}: a line is not KEY=VALUE", f.display()),
                )
            })?;
            opts.secrets
                .insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    let root = match &backend {
        None => roots.roots[0].clone(),
        Some(b) => roots
            .roots
            .iter()
            .find(|r| r.backend.as_str() == b)
            .cloned()
            .ok_or_else(|| {
                Error::invalid(
                    "--backend",
                    format!("{b:?} is not enabled here (see --backends, --node-id, --shared-path)"),
                )
            })?,
    };
    let source = puller::open(uri, &opts).await?;
    let mut pull_cfg = cfg.pull.clone();
    pull_cfg.progress_every = Duration::from_millis(500);
    let engine = Engine::new(pull_cfg, puller::extract_layer);
    let sink = BarSink {
        bar: Mutex::new(None),
        output,
    };
    let t0 = Instant::now();
    let pulled = engine.pull(&root, source, &sink).await;
    if let Some(b) = sink.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
        b.finish();
    }
    let pulled = pulled?;
    if pin {
        let (r, sid) = (root.clone(), pulled.sid.clone());
        blocking(move || evict::set_pinned(&r, &sid, true)).await?;
    }
    let done = Prefetched {
        id: &pulled.sid,
        origin: &pulled.seal.origin,
        revision: pulled.seal.revision.as_deref(),
        bytes: pulled.seal.total_bytes,
        files: pulled.seal.files.len(),
        already_cached: pulled.hit,
        pinned: pin || evict::is_pinned(&root, &pulled.sid),
        seconds: t0.elapsed().as_secs_f64(),
    };
    print(output, &done, || {
        format!(
            "{} {} as {} ({}, {} files) in {:.1}s{}",
            if done.already_cached {
                "already cached:"
            } else {
                "pulled, verified and sealed:"
            },
            done.origin,
            done.id,
            human_bytes(done.bytes),
            done.files,
            done.seconds,
            if done.pinned { ", pinned" } else { "" }
        )
    })
}

/// Progress for a human: a live bar on a terminal, a line every few
/// seconds otherwise, nothing for `--output json`.
struct Bar {
    bar: Option<indicatif::ProgressBar>,
    label: String,
    total: Option<u64>,
    done: Mutex<(u64, Instant)>,
}

fn bar(output: Output, total: Option<u64>, label: &str) -> Bar {
    let live = output == Output::Table && std::io::stderr().is_terminal();
    let bar = live.then(|| {
        let b = match total {
            Some(t) => indicatif::ProgressBar::new(t),
            None => indicatif::ProgressBar::no_length(),
        };
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_message(label.to_string());
        b
    });
    Bar {
        bar,
        label: label.to_string(),
        total,
        done: Mutex::new((0, Instant::now())),
    }
}

impl Bar {
    fn add(&self, n: u64) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        d.0 += n;
        self.set_locked(&mut d, None, None);
    }

    fn set(&self, bytes: u64, rate: Option<f64>, eta: Option<Duration>) {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        d.0 = bytes;
        self.set_locked(&mut d, rate, eta);
    }

    fn set_locked(&self, d: &mut (u64, Instant), rate: Option<f64>, eta: Option<Duration>) {
        match &self.bar {
            Some(b) => b.set_position(d.0),
            None if self.label.is_empty() => {}
            None => {
                if d.1.elapsed() >= Duration::from_secs(5) {
                    d.1 = Instant::now();
                    eprintln!("{}", line(&self.label, d.0, self.total, rate, eta));
                }
            }
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

fn line(
    label: &str,
    bytes: u64,
    total: Option<u64>,
    rate: Option<f64>,
    eta: Option<Duration>,
) -> String {
    let mut s = format!("{label}: {}", human_bytes(bytes));
    if let Some(t) = total {
        s.push_str(&format!(
            " of {} ({:.0}%)",
            human_bytes(t),
            100.0 * bytes as f64 / t.max(1) as f64
        ));
    }
    if let Some(r) = rate {
        s.push_str(&format!(" at {}/s", human_bytes(r as u64)));
    }
    if let Some(e) = eta {
        s.push_str(&format!(", ETA {}s", e.as_secs()));
    }
    s
}

/// The engine's progress, drawn as a [`Bar`] once the size is known.
struct BarSink {
    bar: Mutex<Option<Arc<Bar>>>,
    output: Output,
}

impl ProgressSink for BarSink {
    fn started(&self, uri: &str, total: Option<u64>) {
        let label = if self.output == Output::Json {
            String::new()
        } else {
            format!("pulling {}", puller::display_uri(uri))
        };
        if self.output == Output::Table && !std::io::stderr().is_terminal() {
            eprintln!("{label}: started");
        }
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Arc::new(bar(self.output, total, &label)));
    }

    fn progress(&self, p: &Progress) {
        let b = self.bar.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(b) = b {
            b.set(p.bytes, Some(p.rate_bytes_per_sec), p.eta);
        }
    }

    fn refetching(&self, _uri: &str, file: &str, why: &str) {
        if self.output != Output::Json {
            eprintln!("{file} failed verification: {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_lines_read_well() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(
            line(
                "pulling s3://b/m",
                1 << 30,
                Some(4 << 30),
                Some(64.0 * 1048576.0),
                Some(Duration::from_secs(48))
            ),
            "pulling s3://b/m: 1.0 GiB of 4.0 GiB (25%) at 64.0 MiB/s, ETA 48s"
        );
    }

    /// `cache prefetch --param` takes a class's source parameters with the
    /// class's own checks, and names `--param KEY` in each refusal.
    #[test]
    fn params_are_checked_as_a_class_checks_them() {
        let uri = "hf://org/m";
        let ok = source_params(
            uri,
            &[
                "hfEndpoint=http://hub:8080".into(),
                "hfIgnorePatterns=original/*,*.pth".into(),
                "allowedSources=hf://org/".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            ok.source_options
                .get("hfIgnorePatterns")
                .map(String::as_str),
            Some("original/*,*.pth")
        );
        assert!(ok.allowed_sources.is_some());
        for (param, field) in [
            ("s3PathStyle=maybe", "--param s3PathStyle"),
            ("hfAllowPatterns=[a", "--param hfAllowPatterns"),
            ("backend=local", "--param backend"),
            ("role=source", "--param role"),
            ("nonsense=1", "--param nonsense"),
            ("novalue", "--param"),
        ] {
            match source_params(uri, &[param.into()]) {
                Err(Error::Invalid { field: f, message }) => {
                    assert_eq!(f, field, "{param}: {message}")
                }
                other => panic!("{param}: {other:?}"),
            }
        }
    }
}
