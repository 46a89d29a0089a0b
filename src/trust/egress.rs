//! The egress guard: every connection a pull makes goes through an
//! in-process HTTP proxy on loopback, which resolves the target itself and
//! connects only to addresses the pull's policy allows.
//!
//! Checking names before a request is not enough: a redirect, a `#manifest`
//! entry, a registry's blob redirect or a DNS answer that changes between
//! the check and the connect (rebinding) all reach addresses no check saw.
//! Here the check and the connect are one step on the resolved address, and
//! every client library we use (reqwest, object_store, oci-client) honours
//! a proxy, so no code path can bypass it. A tenant's pull (and a registry's
//! answer) gets `Policy::tenant`; an admin's s3 and oci sources get
//! `Policy::admin`, which closes only metadata services.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Metadata services that hand out a node's credentials, outside
/// link-local: AWS's IPv6 endpoint, Alibaba, Azure's wireserver, Oracle.
const METADATA: [&str; 4] = [
    "fd00:ec2::254",
    "100.100.100.200",
    "168.63.129.16",
    "192.0.0.192",
];

/// Ranges a tenant's pull does not reach unless the admin opens them
/// (`--tenant-open-networks`) or the StorageClass names the host: private,
/// shared (CGNAT), unique-local and reserved space, where a node's
/// neighbours, the VPC and cluster services live.
const PRIVATE: [(&str, &str); 14] = [
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (CGNAT, RFC 6598)"),
    ("192.0.0.0/24", "reserved for IETF protocols"),
    ("192.0.2.0/24", "reserved for documentation"),
    ("198.51.100.0/24", "reserved for documentation"),
    ("203.0.113.0/24", "reserved for documentation"),
    ("198.18.0.0/15", "reserved for benchmarking"),
    ("240.0.0.0/4", "reserved"),
    ("fc00::/7", "unique-local (IPv6 private)"),
    ("fec0::/10", "site-local (deprecated IPv6 private)"),
    ("2001:db8::/32", "reserved for documentation"),
    ("100::/64", "discard-only"),
];

/// The IPv4 address an IPv6 one stands for, in every form a stack or a
/// NAT64 gateway would deliver to IPv4: mapped (`::ffff:a.b.c.d`),
/// compatible (`::a.b.c.d`), NAT64 (`64:ff9b::/96`, `64:ff9b:1::/48`) and
/// 6to4 (`2002:aabb:ccdd::/48`).
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let o = v6.octets();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    match s {
        // ::a.b.c.d, but not :: or ::1.
        [0, 0, 0, 0, 0, 0, hi, _] if hi != 0 => Some(tail),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(tail),
        [0x64, 0xff9b, 1, ..] => Some(tail),
        [0x2002, ..] => Some(Ipv4Addr::new(o[2], o[3], o[4], o[5])),
        _ => None,
    }
}

/// The address as the network will treat it: an IPv6 form of an IPv4
/// address is that IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// Cloud metadata, which no pull reaches whoever chose its source or names
/// its host: a compromised origin or a tenant's DNS can point anywhere, and
/// these addresses hand out the node's own credentials.
pub fn metadata_refusal(ip: IpAddr) -> Option<String> {
    let ip = canonical(ip);
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    let known = METADATA
        .iter()
        .any(|m| m.parse::<IpAddr>().is_ok_and(|m| m == ip));
    (link_local || known)
        .then(|| "a cloud metadata address (link-local or a known metadata service)".to_string())
}

/// The networks tenant pulls are kept from, and those the admin opened.
#[derive(Clone, Debug, Default)]
pub struct Ranges {
    /// `--tenant-blocked-networks`: closed even where a private range
    /// would be opened.
    pub blocked: Vec<IpNet>,
    /// `--tenant-open-networks`: private or reserved networks tenants may
    /// reach (a model mirror on the VPC).
    pub open: Vec<IpNet>,
}

impl Ranges {
    /// Why a tenant's pull may not reach `ip` (the rule, not the address),
    /// or None when it may. Metadata is `metadata_refusal`'s, checked first.
    pub fn closed(&self, ip: IpAddr) -> Option<String> {
        let ip = canonical(ip);
        let fixed = match ip {
            IpAddr::V4(v4) if v4.is_loopback() => Some("loopback"),
            IpAddr::V6(v6) if v6.is_loopback() => Some("loopback"),
            IpAddr::V4(v4) if v4.is_unspecified() || v4.octets()[0] == 0 => Some("unspecified"),
            IpAddr::V6(v6) if v6.is_unspecified() => Some("unspecified"),
            IpAddr::V4(v4) if v4.is_multicast() || v4.is_broadcast() => {
                Some("multicast or broadcast")
            }
            IpAddr::V6(v6) if v6.is_multicast() => Some("multicast"),
            _ => None,
        };
        if let Some(why) = fixed {
            return Some(why.to_string());
        }
        if let Some(net) = self.blocked.iter().find(|n| n.contains(&ip)) {
            return Some(format!(
                "in a blocked network {net} (--tenant-blocked-networks)"
            ));
        }
        if self.open.iter().any(|n| n.contains(&ip)) {
            return None;
        }
        PRIVATE.iter().find_map(|(net, what)| {
            let net: IpNet = net.parse().ok()?;
            net.contains(&ip).then(|| {
                format!("{what}, which tenant pulls reach only where an admin opens it (--tenant-open-networks)")
            })
        })
    }
}

impl Ranges {
    /// Why a host name an admin allowed still may not reach `ip`: loopback,
    /// or a blocked network unless `name` is a cluster service's
    /// (`*.svc`, `*.svc.<cluster domain>`), which the cluster's DNS
    /// answers and no tenant does.
    fn closed_to_names(&self, ip: IpAddr, name: &str) -> Option<String> {
        let ip = canonical(ip);
        if ip.is_loopback() {
            return Some("loopback".into());
        }
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let service = name.ends_with(".svc") || name.contains(".svc.");
        match self.blocked.iter().find(|n| n.contains(&ip)) {
            Some(net) if !service => Some(format!(
                "a blocked network {net} (--tenant-blocked-networks), and it is not a cluster service name"
            )),
            _ => None,
        }
    }
}

/// A refusal raised inside an HTTP client (resolver, redirect policy), found
/// again in its error chain so the pull fails with it, unretried.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The refusal in an error's source chain, if any.
pub fn refusal_in(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<Refused>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}

/// A URL whose host is a link-local address literal (no resolver sees it).
pub fn check_url(url: &url::Url) -> Result<()> {
    let ip = match url.host() {
        Some(url::Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(url::Host::Ipv6(v6)) => IpAddr::V6(v6),
        _ => return Ok(()),
    };
    match metadata_refusal(ip) {
        Some(why) => Err(Error::NotAllowed(format!(
            "{ip} is {why}; no model source may reach it"
        ))),
        None => Ok(()),
    }
}

/// reqwest's resolver for sources an admin chose: the system's answers,
/// less link-local ones (a name pointed at the metadata service).
pub struct MetadataShield;

impl reqwest::dns::Resolve for MetadataShield {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(why) = addrs.iter().find_map(|a| metadata_refusal(a.ip())) {
                return Err(Box::new(Refused(format!(
                    "{host} resolves to {why}; no model source may reach it"
                )))
                    as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// `host:port` as policies compare it: lowercase, IPv6 in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    let h = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    if h.contains(':') {
        format!("[{h}]:{port}")
    } else {
        format!("{h}:{port}")
    }
}

/// What one pull may reach.
#[derive(Debug)]
pub struct Policy {
    /// `host:port` (see `host_port`) named by the StorageClass (an
    /// allowedSources prefix or an endpoint parameter), so reachable even
    /// on closed addresses; never on metadata ones.
    admitted: Vec<String>,
    /// None for an admin's source: only metadata is closed.
    ranges: Option<Ranges>,
    /// The first refusal, so the pull fails with it instead of a proxy error.
    refusal: Mutex<Option<String>>,
    /// Upstream connections made for this policy: proof that a client
    /// really went through the guard.
    connections: std::sync::atomic::AtomicUsize,
    /// Upstream connections open now (a tunnel or a forwarded request).
    open: std::sync::atomic::AtomicUsize,
}

impl Policy {
    /// A tenant's pull: `admitted` are `host:port` strings.
    pub fn tenant(admitted: Vec<String>, ranges: Ranges) -> Policy {
        Policy {
            admitted: admitted
                .iter()
                .filter_map(|a| {
                    let (h, p) = a.rsplit_once(':')?;
                    Some(host_port(h, p.parse().ok()?))
                })
                .collect(),
            ranges: Some(ranges),
            refusal: Mutex::new(None),
            connections: Default::default(),
            open: Default::default(),
        }
    }

    /// An admin's source reaches what the admin chose, except metadata.
    pub fn admin() -> Policy {
        Policy {
            admitted: Vec::new(),
            ranges: None,
            refusal: Mutex::new(None),
            connections: Default::default(),
            open: Default::default(),
        }
    }

    fn admits(&self, host: &str, port: u16) -> bool {
        let hp = host_port(host, port);
        self.admitted.contains(&hp)
    }

    /// Resolves `host` and returns the addresses to connect to, or why not.
    pub async fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> std::result::Result<Vec<SocketAddr>, String> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let literal = bare.parse::<IpAddr>().ok();
        let addrs: Vec<SocketAddr> = match literal {
            Some(ip) => vec![SocketAddr::new(ip, port)],
            None => tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| format!("cannot resolve {bare}: {e}"))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(format!("{bare} resolves to no address"));
        }
        // What a name resolves to stays unsaid: internal DNS answers are
        // not the requester's to learn. Every address must pass; a mixed
        // answer is how rebinding hides.
        let is = if literal.is_some() {
            "is"
        } else {
            "resolves to"
        };
        if let Some(why) = addrs.iter().find_map(|a| metadata_refusal(a.ip())) {
            return Err(format!(
                "{}: {is} {why}; no model source may reach it, whoever names it",
                host_port(bare, port)
            ));
        }
        let Some(ranges) = &self.ranges else {
            return Ok(addrs);
        };
        if self.admits(bare, port) {
            // An admin named this host: its port is open, wherever an
            // address names it. A name is only as good as its DNS, which
            // a tenant may control: it never reaches loopback, nor a
            // blocked network unless it is the cluster's own service name.
            if literal.is_none()
                && let Some(why) = addrs
                    .iter()
                    .find_map(|a| ranges.closed_to_names(a.ip(), bare))
            {
                return Err(format!(
                    "{} resolves to {why}; a name the StorageClass allows reaches neither (name the address itself to open it)",
                    host_port(bare, port)
                ));
            }
            return Ok(addrs);
        }
        if let Some(why) = addrs.iter().find_map(|a| ranges.closed(a.ip())) {
            let hp = host_port(bare, port);
            return Err(format!(
                "{hp} {is} {why}; a tenant's source may reach it only if the StorageClass names \
                 {hp} (an allowedSources prefix or an endpoint parameter)"
            ));
        }
        Ok(addrs)
    }

    fn refuse(&self, why: &str) {
        let mut r = self.refusal.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(|| why.to_string());
    }

    /// How many upstream connections the guard made for this policy.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Upstream connections open now; none once a pull's clients are gone.
    pub fn open_now(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The refusal that made a request fail, if any.
    pub fn refusal(&self) -> Option<String> {
        self.refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// One pull's guard: a proxy listener of its own on loopback, so the port
/// names the policy. (A header would not do: clients drop proxy
/// credentials when a plain-http redirect changes host.) No credential is
/// needed, because the guard only narrows what the node's own network
/// position reaches; a local process that finds the port gains nothing.
/// Every task it starts (connections, tunnels, upstream halves) ends when
/// it is dropped, so nothing outlives the pull.
#[derive(Debug)]
pub struct Guard {
    pub policy: Arc<Policy>,
    url: String,
    stop: CancellationToken,
}

impl Guard {
    /// Starts a listener for `policy`; it stops when the guard is dropped.
    pub async fn new(policy: Policy) -> Result<Guard> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| Error::Internal(format!("binding the egress guard on loopback: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Internal(format!("egress guard address: {e}")))?;
        let policy = Arc::new(policy);
        let stop = CancellationToken::new();
        tokio::spawn(stop.clone().run_until_cancelled_owned(serve(
            listener,
            policy.clone(),
            stop.clone(),
        )));
        Ok(Guard {
            policy,
            url: format!("http://{addr}"),
            stop,
        })
    }

    /// The proxy URL, for client configuration.
    pub fn proxy_url(&self) -> &str {
        &self.url
    }

    /// An error of a request through this guard, replaced by the refusal
    /// that caused it: a tenant gets told why, and the engine does not
    /// retry what will never be allowed.
    pub fn explain(&self, err: Error) -> Error {
        match self.policy.refusal() {
            Some(why) => Error::NotAllowed(why),
            None => err,
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Counts an upstream connection as open while it lives.
struct Open(Arc<Policy>);

impl Open {
    fn new(p: Arc<Policy>) -> Open {
        p.open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Open(p)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

async fn serve(listener: TcpListener, policy: Arc<Policy>, stop: CancellationToken) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "egress guard: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (policy, inner) = (policy.clone(), stop.clone());
        tokio::spawn(stop.clone().run_until_cancelled_owned(async move {
            let service =
                hyper::service::service_fn(move |req| handle(policy.clone(), inner.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "egress guard connection ended");
            }
        }));
    }
}

/// Copies both ways until either side ends: an HTTP client that gives up
/// closes its side, and a silent upstream must not keep the tunnel (a task
/// and two sockets) alive after it.
async fn tunnel(client: hyper::upgrade::Upgraded, upstream: TcpStream) {
    let (mut cr, mut cw) = tokio::io::split(TokioIo::new(client));
    let (mut ur, mut uw) = upstream.into_split();
    tokio::select! {
        _ = tokio::io::copy(&mut cr, &mut uw) => {}
        _ = tokio::io::copy(&mut ur, &mut cw) => {}
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn reply(status: StatusCode, text: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(text))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

async fn handle(
    policy: Arc<Policy>,
    stop: CancellationToken,
    req: Request<Incoming>,
) -> std::result::Result<Response<Body>, hyper::Error> {
    let (host, port) = match target(&req) {
        Some(t) => t,
        None => {
            return Ok(reply(
                StatusCode::BAD_REQUEST,
                "the egress guard needs CONNECT host:port or an absolute http:// URI".into(),
            ));
        }
    };
    let addrs = match policy.resolve(&host, port).await {
        Ok(a) => a,
        Err(why) => {
            tracing::warn!(host = %host, port, reason = %why, "egress refused");
            policy.refuse(&why);
            return Ok(reply(StatusCode::FORBIDDEN, why));
        }
    };
    let upstream = match connect(&addrs).await {
        Ok(s) => {
            policy
                .connections
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            s
        }
        Err(e) => {
            return Ok(reply(
                StatusCode::BAD_GATEWAY,
                format!("connecting to {host}:{port}: {e}"),
            ));
        }
    };
    let open = Open::new(policy.clone());
    if req.method() == Method::CONNECT {
        tokio::spawn(stop.run_until_cancelled_owned(async move {
            let _open = open;
            match hyper::upgrade::on(req).await {
                Ok(up) => tunnel(up, upstream).await,
                Err(e) => tracing::debug!(error = %e, "egress guard: upgrade failed"),
            }
        }));
        return Ok(Response::new(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        ));
    }
    forward(req, upstream, &host, port, stop, open).await
}

/// `CONNECT host:port`, or the host and port of an absolute `http://` URI.
fn target(req: &Request<Incoming>) -> Option<(String, u16)> {
    let uri = req.uri();
    if req.method() == Method::CONNECT {
        let a = uri.authority()?;
        return Some((a.host().to_string(), a.port_u16()?));
    }
    if uri.scheme_str() != Some("http") {
        return None;
    }
    Some((uri.host()?.to_string(), uri.port_u16().unwrap_or(80)))
}

async fn connect(addrs: &[SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("no address");
    for a in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = e,
            Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
        }
    }
    Err(last)
}

/// A plain-http request, sent in origin form on its own upstream connection.
async fn forward(
    req: Request<Incoming>,
    upstream: TcpStream,
    host: &str,
    port: u16,
    stop: CancellationToken,
    open: Open,
) -> std::result::Result<Response<Body>, hyper::Error> {
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = match path.parse() {
        Ok(u) => u,
        Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, "bad request path".into())),
    };
    parts.headers.remove(hyper::header::PROXY_AUTHORIZATION);
    parts.headers.remove("proxy-connection");
    if !parts.headers.contains_key(hyper::header::HOST) {
        let h = if port == 80 {
            host.to_string()
        } else {
            format!("{host}:{port}")
        };
        if let Ok(v) = h.parse() {
            parts.headers.insert(hyper::header::HOST, v);
        }
    }
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(x) => x,
            Err(e) => {
                return Ok(reply(
                    StatusCode::BAD_GATEWAY,
                    format!("talking to {host}:{port}: {e}"),
                ));
            }
        };
    tokio::spawn(stop.run_until_cancelled_owned(async move {
        let _open = open;
        let _ = conn.await;
    }));
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => Ok(resp.map(|b| b.boxed())),
        Err(e) => Ok(reply(
            StatusCode::BAD_GATEWAY,
            format!("talking to {host}:{port}: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_addresses() {
        let ranges = Ranges {
            blocked: vec!["10.96.0.0/12".parse().unwrap()],
            open: vec!["10.1.0.0/16".parse().unwrap()],
        };
        for (ip, word) in [
            ("127.0.0.1", "loopback"),
            ("127.8.9.10", "loopback"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::127.0.0.1", "loopback"),
            ("64:ff9b::7f00:1", "loopback"),
            ("2002:7f00:1::", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("10.96.0.1", "--tenant-blocked-networks"),
            ("10.0.0.1", "RFC 1918"),
            ("172.20.1.1", "RFC 1918"),
            ("192.168.1.1", "RFC 1918"),
            ("::ffff:192.168.1.1", "RFC 1918"),
            ("64:ff9b::a00:1", "RFC 1918"),
            ("100.64.0.1", "CGNAT"),
            ("fd12::1", "unique-local"),
            ("240.0.0.1", "reserved"),
            ("198.18.0.1", "benchmarking"),
        ] {
            let why = ranges.closed(ip.parse().unwrap());
            assert!(
                why.as_deref().is_some_and(|w| w.contains(word)),
                "{ip}: {why:?}"
            );
        }
        for ip in [
            "93.184.216.34",
            "10.1.2.3",
            "2606:4700::1",
            "::ffff:93.184.216.34",
        ] {
            assert_eq!(ranges.closed(ip.parse().unwrap()), None, "{ip}");
        }
        // Metadata, wherever a provider put it, in any IPv6 dress.
        for ip in [
            "169.254.169.254",
            "fe80::1",
            "fd00:ec2::254",
            "100.100.100.200",
            "168.63.129.16",
            "192.0.0.192",
            "::ffff:169.254.169.254",
            "::169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::6464:64c8",
        ] {
            assert!(metadata_refusal(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["93.184.216.34", "10.0.0.1", "100.100.100.201"] {
            assert!(metadata_refusal(ip.parse().unwrap()).is_none(), "{ip}");
        }
    }

    #[tokio::test]
    async fn a_named_host_is_admitted_on_its_port_never_on_metadata() {
        let p = Policy::tenant(
            vec!["127.0.0.1:9000".into(), "169.254.169.254:80".into()],
            Ranges::default(),
        );
        assert!(p.resolve("127.0.0.1", 9000).await.is_ok());
        let e = p.resolve("127.0.0.1", 22).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
        let e = p.resolve("169.254.169.254", 80).await.unwrap_err();
        assert!(e.contains("metadata"), "{e}");
        // An admin's source reaches private ranges, never metadata.
        let admin = Policy::admin();
        assert!(admin.resolve("10.0.0.1", 80).await.is_ok());
        assert!(admin.resolve("127.0.0.1", 80).await.is_ok());
        let e = admin.resolve("[fd00:ec2::254]", 80).await.unwrap_err();
        assert!(e.contains("metadata"), "{e}");
        // A name the class allows never reaches loopback (its DNS may be
        // the tenant's); the address itself, named, does.
        let named = Policy::tenant(vec!["localhost:9000".into()], Ranges::default());
        let e = named.resolve("localhost", 9000).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
        let blocked = Ranges {
            blocked: vec!["127.0.0.0/8".parse().unwrap()],
            open: vec![],
        };
        assert!(
            blocked
                .closed_to_names("127.0.0.1".parse().unwrap(), "x.example")
                .is_some()
        );
        let svc = Ranges {
            blocked: vec!["10.96.0.0/12".parse().unwrap()],
            open: vec![],
        };
        assert!(
            svc.closed_to_names("10.96.0.10".parse().unwrap(), "minio.store.svc")
                .is_none()
        );
        assert!(
            svc.closed_to_names(
                "10.96.0.10".parse().unwrap(),
                "minio.store.svc.cluster.local"
            )
            .is_none()
        );
        let why = svc
            .closed_to_names("10.96.0.10".parse().unwrap(), "models.team-a.example")
            .unwrap();
        assert!(why.contains("--tenant-blocked-networks"), "{why}");
        // A name's answer is not repeated back to the requester.
        let e = Policy::tenant(vec![], Ranges::default())
            .resolve("localhost", 80)
            .await
            .unwrap_err();
        assert!(
            e.contains("resolves to loopback") && !e.contains("127.0.0.1"),
            "{e}"
        );
    }

    /// Sends `head` to the guard of `g` and returns its status line and the
    /// open stream.
    async fn ask(g: &Guard, head: String) -> (String, TcpStream) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let url = url::Url::parse(g.proxy_url()).unwrap();
        let mut s = TcpStream::connect((url.host_str().unwrap(), url.port().unwrap()))
            .await
            .unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            if s.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            buf.push(byte[0]);
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        (text.lines().next().unwrap_or_default().to_string(), s)
    }

    /// A one-shot upstream that answers any request with `hello`.
    async fn upstream() -> (u16, tokio::task::JoinHandle<usize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut served = 0;
            while let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(2), l.accept()).await
            {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                    )
                    .await;
                served += 1;
            }
            served
        });
        (port, task)
    }

    #[tokio::test]
    async fn tunnels_and_forwards_only_what_the_policy_admits() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (port, served) = upstream().await;
        let open = Guard::new(Policy::tenant(
            vec![format!("127.0.0.1:{port}")],
            Ranges::default(),
        ))
        .await
        .unwrap();
        // CONNECT, then HTTP through the tunnel.
        let (status, mut s) = ask(
            &open,
            format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
        )
        .await;
        assert!(status.contains("200"), "{status}");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.ends_with("hello"), "{body}");
        // Plain http in absolute form.
        let (status, _) = ask(
            &open,
            format!("GET http://127.0.0.1:{port}/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
        )
        .await;
        assert!(status.contains("200"), "{status}");

        // A policy that does not name the host reaches nothing, and says why.
        let closed = Guard::new(Policy::tenant(vec![], Ranges::default()))
            .await
            .unwrap();
        for head in [
            format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
            format!("GET http://localhost:{port}/x HTTP/1.1\r\nHost: localhost\r\n\r\n"),
        ] {
            let (status, _) = ask(&closed, head).await;
            assert!(status.contains("403"), "{status}");
        }
        let why = closed.policy.refusal().unwrap();
        assert!(why.contains("loopback"), "{why}");
        let e = closed.explain(Error::Transient("proxy said 403".into()));
        assert!(matches!(e, Error::NotAllowed(_)), "{e:?}");
        // A dropped guard serves no one.
        let gone = url::Url::parse(open.proxy_url()).unwrap();
        drop(open);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect((gone.host_str().unwrap(), gone.port().unwrap()))
                .await
                .is_err(),
            "the guard of a finished pull still listens"
        );
        assert_eq!(
            served.await.unwrap(),
            2,
            "only the admitted requests arrived"
        );
    }

    /// An upstream that accepts and never answers, as a hung origin does.
    #[tokio::test]
    async fn a_silent_upstream_keeps_nothing_open_once_the_client_leaves() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                kept.push(s);
            }
        });
        let g = Guard::new(Policy::tenant(
            vec![format!("127.0.0.1:{port}")],
            Ranges::default(),
        ))
        .await
        .unwrap();
        let policy = g.policy.clone();
        let connect = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n");
        let settled = |want: usize| {
            let policy = policy.clone();
            async move {
                for _ in 0..200 {
                    if policy.open_now() == want {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                false
            }
        };
        // A client that times out and retries, 100 times.
        for _ in 0..100 {
            let (status, s) = ask(&g, connect.clone()).await;
            assert!(status.contains("200"), "{status}");
            drop(s);
        }
        assert!(
            settled(0).await,
            "{} tunnels outlived their clients",
            policy.open_now()
        );
        assert_eq!(policy.connections(), 100);
        // A tunnel still in use ends with its pull's guard.
        let (_, _client) = ask(&g, connect.clone()).await;
        assert!(settled(1).await);
        drop(g);
        assert!(settled(0).await, "a tunnel outlived its guard");
        held.abort();
    }

    #[tokio::test]
    async fn admitted_hosts_pass_closed_ones_do_not() {
        let p = Policy::tenant(vec!["127.0.0.1:9000".into()], Ranges::default());
        assert!(p.resolve("127.0.0.1", 9000).await.is_ok());
        let e = p.resolve("127.0.0.1", 9001).await.unwrap_err();
        assert!(
            e.contains("loopback") && e.contains("allowedSources"),
            "{e}"
        );
        let e = p.resolve("localhost", 80).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
        let e = p.resolve("[::1]", 80).await.unwrap_err();
        assert!(e.contains("loopback"), "{e}");
    }
}
