//! Peer fill: each node serves the models it holds to the drivers of
//! other nodes, and fills a model it lacks from them before the origin.
//!
//! - `directory`: who holds what, published as one Lease per node in the
//!   driver's namespace (the Kubernetes API is the only shared state).
//! - `server`: the node's peer endpoint, for drivers holding the cluster's
//!   peer token only, with upload caps.
//! - `tls`: the key and certificate each run serves peers with, pinned by
//!   its Lease, and the clients that accept only the pinned one.
//! - `fill`: a `Source` in front of the origin that takes whole chunks
//!   from peers, checks each against the seal's chunk table and the file
//!   against the origin's sha256, and falls back to the origin per range.

pub mod directory;
pub mod fill;
pub mod relay;
pub mod server;
pub mod tls;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cache::{Root, Roots, SourceId};
pub use crate::config::{PeerConfig, PeerToken};
use crate::error::{Error, Result};
use k8s_openapi::api::core::v1::Secret;

// The protocol between peers, shared by `server` and `fill`.

/// How long a peer still pulling holds a request for a chunk it has not
/// got yet, while its pull moves; under the engine's stall window, so a
/// stream waiting on it is never taken for a stalled one.
pub const WAIT_FOR_CHUNK: Duration = Duration::from_secs(15);
/// How long a request waits for an upload slot before it is turned away
/// (one that waits for the chunk queues within that wait's bound).
pub const SLOT_WAIT: Duration = Duration::from_secs(1);
/// The header naming why a request was refused (`busy`, `not_yet`, ...).
pub const REFUSED: &str = "x-modelcache-refused";
/// The header a peer sends its chunk's digest in.
pub const CHUNK_DIGEST: &str = "x-modelcache-chunk-sha256";

/// The roots whose sealed models this node serves to peers: node-local
/// ones (a directory tree, or XFS images, read through a mount the server
/// opens). A shared root is one copy for every node already.
pub fn servable(roots: &Roots) -> Vec<Root> {
    roots
        .roots
        .iter()
        .filter(|r| fillable(r))
        .cloned()
        .collect()
}

/// Whether peers may fill `root`: a node-local root of any store.
pub fn fillable(root: &Root) -> bool {
    root.node.is_some()
}

/// Whether `sid` names a pulled model (only those are shared).
pub fn is_model(sid: &str) -> bool {
    SourceId::parse_model(sid).is_some()
}

/// The cluster's peer credential, read again now and then so that a
/// rotation takes effect without a restart: one token a line, the first
/// presented, any accepted.
pub struct Tokens {
    source: PeerToken,
    secrets: Option<kube::Api<Secret>>,
    cached: Mutex<Vec<String>>,
}

/// The key of the peer Secret that holds the tokens.
pub const SECRET_KEY: &str = "token";

const REFRESH_EVERY: Duration = Duration::from_secs(15);

/// How soon a node without a token yet reads its Secret again: the
/// controller creates it at install, within seconds.
const MISSING_RETRY: Duration = Duration::from_secs(2);

impl Tokens {
    /// Reads the tokens once. A Secret the controller has not created yet
    /// leaves this node without peers (it neither serves nor asks them)
    /// until [`Tokens::keep_fresh`] reads one: the node's CSI service must
    /// not wait on it, since unpublishing a pod's volume never needs a
    /// peer. An unreadable file, an empty or short token, or a Secret the
    /// account may not read is an error at start.
    pub async fn open(source: PeerToken, client: kube::Client, namespace: &str) -> Result<Tokens> {
        let secrets = matches!(source, PeerToken::Secret(_))
            .then(|| kube::Api::<Secret>::namespaced(client, namespace));
        let t = Tokens {
            source,
            secrets,
            cached: Mutex::new(Vec::new()),
        };
        match t.refresh().await {
            Ok(()) => {}
            Err(e) if crate::retry::transient(&e) => {
                tracing::warn!(error = %e, "no peer token yet: this node neither serves nor asks peers until it reads one");
            }
            Err(e) => return Err(e),
        }
        Ok(t)
    }

    /// Fixed tokens, for tests and embedding.
    pub fn fixed(tokens: &[&str]) -> Tokens {
        Tokens {
            source: PeerToken::File(PathBuf::new()),
            secrets: None,
            cached: Mutex::new(tokens.iter().map(|t| t.to_string()).collect()),
        }
    }

    async fn refresh(&self) -> Result<()> {
        let (field, text) = match &self.source {
            PeerToken::File(path) => {
                let p = path.clone();
                let text = crate::offload::blocking(move || {
                    std::fs::read_to_string(&p).map_err(|e| {
                        Error::invalid(
                            "--peer-token-file",
                            format!("cannot read {}: {e}", p.display()),
                        )
                    })
                })
                .await?;
                ("--peer-token-file", text)
            }
            PeerToken::Secret(name) => {
                let api = self.secrets.as_ref().expect("a Secret source has its API");
                ("--peer-token-secret", secret_tokens(api, name).await?)
            }
        };
        let tokens = parse_tokens(&text).map_err(|m| Error::invalid(field, m))?;
        *self.cached.lock().unwrap_or_else(|p| p.into_inner()) = tokens;
        Ok(())
    }

    /// Reads the tokens again every `REFRESH_EVERY`; a source briefly
    /// unreadable (a file being rotated) keeps the old ones.
    pub fn keep_fresh(self: Arc<Self>) {
        tokio::spawn(async move {
            loop {
                let missing = !self.ready();
                tokio::time::sleep(if missing {
                    MISSING_RETRY
                } else {
                    REFRESH_EVERY
                })
                .await;
                match self.refresh().await {
                    Ok(()) if missing => {
                        tracing::info!("read the peer token: peers serve and are asked")
                    }
                    Ok(()) => {}
                    Err(e) if missing => tracing::debug!(error = %e, "still no peer token"),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not read the peer tokens again; keeping the old ones")
                    }
                }
            }
        });
    }

    fn current(&self) -> Vec<String> {
        self.cached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a token has been read: without one no peer is asked.
    pub fn ready(&self) -> bool {
        !self.current().is_empty()
    }

    /// The token this node presents.
    pub fn presented(&self) -> String {
        self.current().into_iter().next().unwrap_or_default()
    }

    /// Whether `given` is one of the tokens, compared in constant time.
    pub fn accepts(&self, given: &str) -> bool {
        self.current().iter().fold(false, |ok, t| {
            ok | constant_time_eq(t.as_bytes(), given.as_bytes())
        })
    }
}

/// The tokens in Secret `name`. Node plugins never create it (their
/// account may not create Secrets): the controller does, once
/// ([`ensure_token_secret`]).
async fn secret_tokens(api: &kube::Api<Secret>, name: &str) -> Result<String> {
    let api_error = |e: kube::Error| {
        Error::Precondition(format!(
            "--peer-token-secret {name}: {e}; the node plugin's service account needs get on that Secret (resourceNames) in its namespace"
        ))
    };
    let s = api.get_opt(name).await.map_err(api_error)?.ok_or_else(|| {
        Error::Transient(format!(
            "--peer-token-secret {name} does not exist yet: the controller creates it at install (--create-peer-token-secret), or create it yourself with a key {SECRET_KEY:?}"
        ))
    })?;
    let data = s.data.unwrap_or_default();
    let v = data.get(SECRET_KEY).ok_or_else(|| {
        Error::invalid(
            "--peer-token-secret",
            format!("Secret {name} has no key {SECRET_KEY:?}"),
        )
    })?;
    String::from_utf8(v.0.clone()).map_err(|_| {
        Error::invalid(
            "--peer-token-secret",
            format!("Secret {name}'s {SECRET_KEY} is not text"),
        )
    })
}

/// Creates Secret `name` in `namespace` with a random peer token unless it
/// exists: the controller's job at install, so that no node's account may
/// create Secrets. An existing one (made by an admin, or rotated) is left
/// alone.
pub async fn ensure_token_secret(client: kube::Client, namespace: &str, name: &str) -> Result<()> {
    let api = kube::Api::<Secret>::namespaced(client, namespace);
    let api_error = |e: kube::Error| {
        Error::Transient(format!(
            "--create-peer-token-secret {name}: {e}; the controller's service account needs get and create on Secrets in {namespace}"
        ))
    };
    if api.get_opt(name).await.map_err(api_error)?.is_some() {
        return Ok(());
    }
    let mut raw = [0u8; 32];
    getrandom(&mut raw)?;
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "modelcache-csi"}},
        "type": "Opaque",
        "stringData": {SECRET_KEY: hex::encode(raw)},
    }))
    .expect("a valid Secret");
    match api.create(&Default::default(), &secret).await {
        Ok(_) => {
            tracing::info!(secret = name, "created the cluster's peer token");
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(api_error(e)),
    }
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::Internal(format!("read /dev/urandom: {e}")))
}

fn parse_tokens(text: &str) -> std::result::Result<Vec<String>, String> {
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    if tokens.is_empty() || tokens.iter().any(|t| t.len() < 16) {
        return Err(
            "it must hold at least one token of 16 characters or more, one a line (make one with `head -c 32 /dev/urandom | base64`)"
                .into(),
        );
    }
    Ok(tokens)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Starts serving peers and publishing this node's models; returns the
/// fill the engine uses.
pub async fn start(
    cfg: PeerConfig,
    node: String,
    ctx: &crate::context::Context,
    client: kube::Client,
) -> anyhow::Result<Arc<fill::PeerFill>> {
    let (driver, roots) = (&ctx.cfg.driver_name, &ctx.roots);
    let namespace = cfg
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let tokens = Arc::new(Tokens::open(cfg.token.clone(), client.clone(), &namespace).await?);
    tokens.clone().keep_fresh();
    let served = servable(roots);
    let identity = tls::Identity::generate()?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("--peer-listen {}: {e}", cfg.listen))?;
    let dir = Arc::new(directory::Directory::new(
        client,
        &namespace,
        node.clone(),
        driver,
        cfg.advertise.to_string(),
        identity.pin_hex(),
        served.clone(),
    ));
    tokio::spawn(dir.clone().run());
    let srv = Arc::new(server::PeerServer::new(
        served,
        tokens.clone(),
        cfg.max_uploads,
        cfg.upload_bytes_per_sec,
        ctx.metrics.clone(),
    ));
    tokio::spawn(srv.serve(listener, identity.acceptor().clone()));
    tracing::info!(listen = %cfg.listen, advertise = %cfg.advertise, %namespace, "serving peers");
    Ok(Arc::new(fill::PeerFill::new(
        dir,
        tokens,
        node,
        cfg.networks.clone(),
        ctx.metrics.clone(),
    )))
}
