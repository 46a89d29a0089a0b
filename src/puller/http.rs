//! `https://` and `http://` model sources: one file at a URL, or a JSON
//! manifest of many files (`https://host/minilm.json#manifest`).
//!
//! Also the HTTP plumbing that `hf://` and `model-registry://` share: the
//! client, the one status-code mapping, Retry-After, and ranged GETs that
//! check what the server actually sent. Never puts a token, a URL's query
//! (it may hold a signature) or its user info into an error, a log line or
//! a `Resolved`.
//!
//! Revision of a single file, first that applies:
//! 1. `#sha256=<hex>` in the URI pins the content: `sha256:<hex>`, and the
//!    engine verifies it;
//! 2. a strong ETag: `etag:<value>`;
//! 3. Last-Modified and size: `modified:<unix seconds>-<size>`;
//! 4. a weak ETag and size: `weak-etag:<value>-<size>`;
//! 5. nothing: `unversioned-<size>`, with a warning, since a changed file
//!    at the same URL with the same size would be taken for the cached one.
//!
//! A manifest is `{"files": [{"path", "url"?, "size"?, "sha256"?}]}`; `url`
//! is absolute or relative to the manifest (default: `path`). Its revision
//! is `manifest:<sha256 of the body>`; entries without a `sha256` also fold
//! their server validators (rules 2-5) into that digest, so a file changed
//! behind an unchanged manifest makes a new revision.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt};
use reqwest::header::{self, HeaderMap};
use reqwest::{Client, Response, StatusCode};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use url::Url;

use super::SourceOptions;
use super::failure::Failure;
use super::source::{MAX_LISTED_FILES, RemoteFile, Resolved, Source, Unpack};
use crate::error::{Error, Result};
use crate::trust::egress;

pub const FORMS: &str =
    "https://host/path/file[#sha256=<hex>], https://host/path/manifest.json#manifest";
/// The secret holding an optional bearer token, sent only to the URI's own
/// origin (not to other hosts a manifest lists, nor across redirects).
pub const TOKEN_SECRET: &str = "httpBearerToken";

/// A dead host should fail fast; a slow body is the engine's stall
/// watchdog's business, so there is no overall timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Manifests and API answers are read into memory; refuse absurd ones.
pub(crate) const MAX_DOCUMENT_BYTES: usize = 16 << 20;
/// A document (manifest, API answer) is small: one that takes longer than
/// this is a server trickling it, not a slow link.
pub(crate) const DOCUMENT_TIMEOUT: Duration = Duration::from_secs(120);
/// HEAD requests in flight while resolving a manifest.
const PROBE_CONCURRENCY: usize = 8;

/// What an `http(s)://` URI names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// One file, optionally pinned by `#sha256=<hex>`.
    File {
        name: String,
        sha256: Option<String>,
    },
    /// A JSON manifest of files (`#manifest`).
    Manifest,
}

/// A parsed `http(s)://` model URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpUri {
    /// The URL to fetch, query included, fragment removed.
    pub url: Url,
    pub target: Target,
}

impl HttpUri {
    /// The URI as it goes into the cache key: no query, no user info.
    pub fn normalized(&self) -> String {
        match self.target {
            Target::Manifest => format!("{}#manifest", redact(&self.url)),
            Target::File { .. } => redact(&self.url),
        }
    }
}

/// Checks an `http(s)://` model URI without touching the network.
pub fn parse(uri: &str) -> Result<HttpUri, String> {
    let mut url = Url::parse(uri).map_err(|e| format!("{uri:?} is not a valid URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(format!(
            "{uri:?} is not an http(s) URL with a host; accepted forms: {FORMS}"
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "credentials in the URL are refused (they would end up in volume attributes); \
             put a bearer token in the {TOKEN_SECRET} secret"
        ));
    }
    let fragment = url.fragment().map(str::to_string);
    url.set_fragment(None);
    let target = match fragment.as_deref() {
        Some("manifest") => Target::Manifest,
        None | Some("") => Target::File {
            name: file_name(&url)?,
            sha256: None,
        },
        Some(f) => match f.strip_prefix("sha256=") {
            Some(hex) if is_sha256(hex) => Target::File {
                name: file_name(&url)?,
                sha256: Some(hex.to_ascii_lowercase()),
            },
            _ => {
                return Err(format!(
                    "fragment #{f} is not understood; use #manifest or #sha256=<64 hex digits>"
                ));
            }
        },
    };
    Ok(HttpUri { url, target })
}

/// The URL's last path segment, decoded: the model's one file name.
fn file_name(url: &Url) -> Result<String, String> {
    let last = url
        .path_segments()
        .and_then(|mut s| s.next_back())
        .unwrap_or("");
    let name = percent_decode(last).ok_or("the file name is not valid percent-encoded UTF-8")?;
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(format!(
            "{} does not end in a file name; a single-file URL needs one, \
             a directory needs a manifest (#manifest)",
            redact(url)
        ));
    }
    Ok(name)
}

/// A service's base URL (an endpoint parameter): http(s), with a host, and
/// without credentials or a query, which would end up in logs.
pub(crate) fn service_url(value: &str, param: &str, example: &str) -> Result<Url> {
    Url::parse(value.trim())
        .ok()
        .filter(|u| {
            matches!(u.scheme(), "http" | "https")
                && u.host_str().is_some()
                && u.username().is_empty()
                && u.password().is_none()
                && u.query().is_none()
        })
        .ok_or_else(|| {
            Error::invalid(
                format!("parameters.{param}"),
                format!("must be an http(s) URL without credentials or query, like {example}"),
            )
        })
}

/// A percent-encoded name, decoded; None when an escape is malformed or
/// the bytes are not UTF-8, so a name never means two things.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let well_formed = s.split('%').skip(1).all(|rest| {
        rest.get(..2)
            .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    if !well_formed {
        return None;
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

pub(crate) fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A URL safe to show: scheme, host, port and path only.
pub(crate) fn redact(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.set_fragment(None);
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.to_string()
}

/// The client every HTTP-based source uses; a tenant's goes through the
/// egress guard, and its redirects stay within the class's prefixes on any
/// host a prefix names (the guard admits such a host by name, so only this
/// check keeps a redirect from another path of it).
pub(crate) fn client(opts: &super::SourceOptions) -> Result<Client> {
    let mut b = Client::builder();
    match opts.proxy() {
        Some(p) => {
            b = b.proxy(
                reqwest::Proxy::all(p)
                    .map_err(|e| Error::Internal(format!("configuring the egress guard: {e}")))?,
            )
        }
        None => b = b.dns_resolver(std::sync::Arc::new(egress::MetadataShield)),
    }
    let allowed = opts.tenant.as_ref().map(|t| t.allowed.clone());
    b.user_agent(concat!("modelcache-csi/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(CONNECT_TIMEOUT)
        // Follows redirects (CDNs, the Hub's LFS storage), never to a
        // link-local address; reqwest drops the Authorization header when a
        // redirect leaves the origin.
        .redirect(reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= 10 {
                return attempt.error("more than 10 redirects");
            }
            if let Some(a) = &allowed
                && a.strays_on_named_host(attempt.url())
            {
                let why = format!(
                    "a redirect to {} leaves the StorageClass's allowedSources on a host it names",
                    crate::trust::allowed::shown(attempt.url().as_str())
                );
                return attempt.error(egress::Refused(why));
            }
            match egress::check_url(attempt.url()) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(egress::Refused(format!("a redirect to {e}"))),
            }
        }))
        .build()
        .map_err(|e| Error::Internal(format!("building the HTTP client: {e}")))
}

/// A failed send or body read: retryable, with the cause chain but never the URL.
pub(crate) fn request_error(what: &str, err: reqwest::Error) -> Failure {
    let err = err.without_url();
    if let Some(why) = egress::refusal_in(&err) {
        return Failure::Forbidden(format!("{what}: {why}"));
    }
    let mut msg = format!("{what}: {err}");
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        let _ = write!(msg, ": {c}");
        cause = c.source();
    }
    Failure::transient(msg)
}

/// The one reading of an HTTP error status, for every HTTP-based scheme.
/// `denied_hint` tells the user which secret to set or fix.
pub(crate) fn status_error(
    what: &str,
    status: StatusCode,
    headers: &HeaderMap,
    denied_hint: &str,
) -> Failure {
    let code = status.as_u16();
    match code {
        404 | 410 => Failure::NotFound(format!("{what}: not found (HTTP {code})")),
        401 | 403 => {
            // The Hub says why on every endpoint, file reads included.
            let gated = headers
                .get("x-error-code")
                .is_some_and(|v| v.as_bytes() == b"GatedRepo");
            let kind = if gated { "gated repo" } else { "access denied" };
            Failure::Denied(format!("{what}: {kind} (HTTP {code}); {denied_hint}"))
        }
        429 | 503 => match retry_after(headers, SystemTime::now()) {
            Some(after) => Failure::Transient {
                message: format!("{what}: HTTP {code}"),
                after: Some(after),
            },
            None => Failure::transient(format!("{what}: HTTP {code}, try again later")),
        },
        408 | 500..=599 => Failure::transient(format!("{what}: HTTP {code}")),
        412 | 416 => Failure::Refused(format!(
            "{what}: HTTP {code}; the file changed since the model was resolved"
        )),
        _ => Failure::Refused(format!("{what}: unexpected HTTP {status}")),
    }
}

/// How long a 429/503 asks us to wait: delay-seconds or an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// GETs a small document (manifest, API answer) with a size limit.
pub(crate) async fn get_document(
    client: &Client,
    url: &Url,
    token: Option<&str>,
    what: &str,
    denied_hint: &str,
) -> Result<(Bytes, HeaderMap)> {
    egress::check_url(url)?;
    let mut req = client.get(url.clone());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| request_error(what, e))?;
    if !resp.status().is_success() {
        return Err(status_error(what, resp.status(), resp.headers(), denied_hint).into());
    }
    let headers = resp.headers().clone();
    let body = read_document(resp, what).await?;
    Ok((body, headers))
}

/// Reads a document's body: at most [`MAX_DOCUMENT_BYTES`], within
/// [`DOCUMENT_TIMEOUT`]; never buffers more, whatever the server sends.
pub(crate) async fn read_document(resp: Response, what: &str) -> Result<Bytes> {
    if let Some(n) = resp.content_length()
        && n > MAX_DOCUMENT_BYTES as u64
    {
        return Err(too_large(what));
    }
    let read = async {
        let mut body = Vec::new();
        let mut chunks = resp.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| request_error(what, e))?;
            if body.len().saturating_add(chunk.len()) > MAX_DOCUMENT_BYTES {
                return Err(too_large(what));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    };
    tokio::time::timeout(DOCUMENT_TIMEOUT, read)
        .await
        .map_err(|_| {
            Error::Transient(format!(
                "{what}: the answer did not arrive within {DOCUMENT_TIMEOUT:?}"
            ))
        })?
}

fn too_large(what: &str) -> Error {
    Error::SourceFault(format!(
        "{what}: the answer is larger than {MAX_DOCUMENT_BYTES} bytes"
    ))
}

/// What a HEAD (or its fallback) says about a file.
#[derive(Clone, Debug, Default)]
pub(crate) struct Probe {
    pub size: Option<u64>,
    /// The server answered `Accept-Ranges: bytes` (or a 206).
    pub ranges: bool,
    pub etag: Option<String>,
    pub last_modified: Option<String>,
}

impl Probe {
    /// The revision from the server's validators (rules 2-4 in the module
    /// doc); None when the server gave none.
    pub fn validator(&self) -> Option<String> {
        let size = self.size.map_or("unknown".into(), |s| s.to_string());
        if let Some(etag) = self.etag.as_deref().filter(|e| !e.starts_with("W/")) {
            return Some(format!("etag:{}", opaque(etag)));
        }
        if let Some(lm) = &self.last_modified {
            return Some(match httpdate::parse_http_date(lm) {
                Ok(t) => {
                    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
                    format!("modified:{secs}-{size}")
                }
                Err(_) => format!("modified:{}-{size}", opaque(lm)),
            });
        }
        let weak = self.etag.as_deref()?.strip_prefix("W/")?;
        Some(format!("weak-etag:{}-{size}", opaque(weak)))
    }

    /// Rule 5: no validators at all.
    pub fn unversioned(&self) -> String {
        match self.size {
            Some(s) => format!("unversioned-{s}"),
            None => "unversioned".into(),
        }
    }
}

/// A validator as it goes into a revision: unquoted when short and
/// plain, else its sha256.
fn opaque(v: &str) -> String {
    let v = v.trim().trim_matches('"');
    if !v.is_empty() && v.len() <= 96 && v.bytes().all(|b| b.is_ascii_graphic() && b != b'"') {
        v.to_string()
    } else {
        format!("sha256-{}", hex::encode(Sha256::digest(v.as_bytes())))
    }
}

/// HEADs a file. A server that refuses HEAD (a presigned S3 URL is signed
/// for GET only) is asked for its first byte instead.
pub(crate) async fn probe(
    client: &Client,
    url: &Url,
    token: Option<&str>,
    what: &str,
    denied_hint: &str,
) -> Result<Probe> {
    egress::check_url(url)?;
    let mut req = client.head(url.clone());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| request_error(what, e))?;
    let status = resp.status();
    if status.is_success() {
        let h = resp.headers();
        return Ok(Probe {
            // Not resp.content_length(): for HEAD that is the empty body's.
            size: header_u64(h, header::CONTENT_LENGTH),
            ranges: header_str(h, header::ACCEPT_RANGES)
                .is_some_and(|v| v.split(',').any(|u| u.trim().eq_ignore_ascii_case("bytes"))),
            etag: header_str(h, header::ETAG).map(str::to_string),
            last_modified: header_str(h, header::LAST_MODIFIED).map(str::to_string),
        });
    }
    if !matches!(status.as_u16(), 403 | 405 | 501) {
        return Err(status_error(what, status, resp.headers(), denied_hint).into());
    }
    let mut req = client.get(url.clone()).header(header::RANGE, "bytes=0-0");
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| request_error(what, e))?;
    let h = resp.headers();
    let etag = header_str(h, header::ETAG).map(str::to_string);
    let last_modified = header_str(h, header::LAST_MODIFIED).map(str::to_string);
    // Dropping `resp` unread closes the connection instead of downloading.
    match resp.status() {
        StatusCode::PARTIAL_CONTENT => Ok(Probe {
            size: header_str(h, header::CONTENT_RANGE)
                .and_then(parse_content_range)
                .and_then(|r| r.2),
            ranges: true,
            etag,
            last_modified,
        }),
        StatusCode::OK => Ok(Probe {
            size: header_u64(h, header::CONTENT_LENGTH),
            ranges: false,
            etag,
            last_modified,
        }),
        s => Err(status_error(what, s, h, denied_hint).into()),
    }
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name)?.to_str().ok().map(str::trim)
}

fn header_u64(h: &HeaderMap, name: header::HeaderName) -> Option<u64> {
    header_str(h, name)?.parse().ok()
}

/// `bytes <first>-<last>/<total or *>`.
fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    (first <= last).then_some((first, last, total))
}

/// One ranged GET.
pub(crate) struct RangeGet<'a> {
    pub url: Url,
    pub token: Option<&'a str>,
    pub offset: u64,
    pub len: Option<u64>,
    /// The file's size from resolve, when known: a server reporting
    /// another total means the file changed under us.
    pub size: Option<u64>,
    pub what: &'a str,
    pub denied_hint: &'a str,
}

/// The bytes a ranged GET produced.
pub(crate) struct Body {
    pub stream: BoxStream<'static, Result<Bytes>>,
    /// False when the server ignored the Range header: the stream is still
    /// exactly the requested bytes (the prefix was read and dropped), but
    /// ranges from this server are wasteful.
    pub ranged: bool,
}

/// GETs bytes `[offset, offset + len)` and checks the answer: a 206 must
/// carry the requested Content-Range; a 200 to a ranged request is the whole
/// file, so its prefix is skipped rather than taken for the range; a body
/// that ends early yields an `Unavailable` error rather than a clean end.
pub(crate) async fn get_range(client: &Client, r: RangeGet<'_>) -> Result<Body> {
    let what = r.what;
    let empty = || Body {
        stream: stream::empty().boxed(),
        ranged: true,
    };
    if r.len == Some(0) {
        return Ok(empty());
    }
    // What we expect to receive, clamped to the known size.
    let asked_end = r.len.map(|l| r.offset.checked_add(l)).map(|e| {
        e.ok_or_else(|| {
            Error::Unsatisfiable(format!(
                "{what}: range {}+{:?} is past 2^64",
                r.offset, r.len
            ))
        })
    });
    let asked_end = asked_end.transpose()?;
    let end = match (asked_end, r.size) {
        (Some(e), Some(s)) => Some(e.min(s)),
        (Some(e), None) => Some(e),
        (None, s) => s,
    };
    if let Some(size) = r.size
        && r.offset >= size
    {
        if r.offset == size {
            return Ok(empty());
        }
        return Err(Error::Unsatisfiable(format!(
            "{what}: offset {} is past the end ({size} bytes)",
            r.offset
        )));
    }
    let ranged_request = r.offset > 0 || r.len.is_some();
    egress::check_url(&r.url)?;
    let mut req = client.get(r.url.clone());
    if ranged_request {
        let range = match asked_end {
            Some(e) => format!("bytes={}-{}", r.offset, e.saturating_sub(1)),
            None => format!("bytes={}-", r.offset),
        };
        req = req.header(header::RANGE, range);
    }
    if let Some(t) = r.token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| request_error(what, e))?;
    let changed = |now: u64, was: u64| {
        Error::Precondition(format!(
            "{what}: the file is now {now} bytes, was {was} when resolved; pull again"
        ))
    };
    match resp.status() {
        StatusCode::PARTIAL_CONTENT if ranged_request => {
            let cr = header_str(resp.headers(), header::CONTENT_RANGE).unwrap_or("");
            let Some((first, last, total)) = parse_content_range(cr) else {
                return Err(Error::Transient(format!(
                    "{what}: 206 without a usable Content-Range ({cr:?})"
                )));
            };
            if let (Some(t), Some(s)) = (total, r.size)
                && t != s
            {
                return Err(changed(t, s));
            }
            let want_last = match (end, total) {
                (Some(e), Some(t)) => Some(e.min(t).saturating_sub(1)),
                (Some(e), None) => Some(e.saturating_sub(1)),
                (None, Some(t)) => Some(t.saturating_sub(1)),
                (None, None) => None,
            };
            if first != r.offset || want_last.is_some_and(|w| w != last) {
                return Err(Error::Transient(format!(
                    "{what}: asked for bytes {}-{}, the server sent {first}-{last}",
                    r.offset,
                    want_last.map_or(String::new(), |w| w.to_string())
                )));
            }
            let expect = (last - first).saturating_add(1);
            Ok(Body {
                stream: body_stream(resp, 0, Some(expect), what.to_string()),
                ranged: true,
            })
        }
        StatusCode::OK => {
            let total = header_u64(resp.headers(), header::CONTENT_LENGTH);
            if let (Some(t), Some(s)) = (total, r.size)
                && t != s
            {
                return Err(changed(t, s));
            }
            if ranged_request {
                tracing::warn!(
                    source = what,
                    offset = r.offset,
                    "the server ignored a Range request; skipping to the offset"
                );
            }
            let end = end.or(total);
            let expect = end.map(|e| e.saturating_sub(r.offset));
            Ok(Body {
                stream: body_stream(resp, r.offset, expect, what.to_string()),
                ranged: !ranged_request,
            })
        }
        s if s.is_success() => Err(Error::Transient(format!(
            "{what}: unexpected HTTP {s} to a GET"
        ))),
        s => Err(status_error(what, s, resp.headers(), r.denied_hint).into()),
    }
}

/// The response body, after dropping `skip` bytes, cut at `expect` bytes;
/// ending before `expect` is an error, never a short clean end.
fn body_stream(
    resp: Response,
    skip: u64,
    expect: Option<u64>,
    what: String,
) -> BoxStream<'static, Result<Bytes>> {
    struct State {
        inner: BoxStream<'static, reqwest::Result<Bytes>>,
        skip: u64,
        expect: Option<u64>,
        got: u64,
        what: String,
        done: bool,
    }
    let state = State {
        inner: resp.bytes_stream().boxed(),
        skip,
        expect,
        got: 0,
        what,
        done: false,
    };
    stream::unfold(state, |mut st| async move {
        loop {
            if st.done || st.expect.is_some_and(|e| st.got >= e) {
                return None;
            }
            match st.inner.next().await {
                Some(Ok(mut chunk)) => {
                    if st.skip > 0 {
                        let n = st.skip.min(chunk.len() as u64);
                        st.skip -= n;
                        chunk = chunk.slice(n as usize..);
                    }
                    if let Some(e) = st.expect {
                        let room = e - st.got;
                        if (chunk.len() as u64) > room {
                            chunk.truncate(room as usize);
                        }
                    }
                    if chunk.is_empty() {
                        continue;
                    }
                    st.got += chunk.len() as u64;
                    return Some((Ok(chunk), st));
                }
                Some(Err(e)) => {
                    st.done = true;
                    let err = request_error(&format!("{} after {} bytes", st.what, st.got), e);
                    return Some((Err(err.into()), st));
                }
                None => {
                    st.done = true;
                    let e = st.expect?;
                    let err = Error::Transient(format!(
                        "{}: the connection ended after {} of {e} bytes",
                        st.what, st.got
                    ));
                    return Some((Err(err), st));
                }
            }
        }
    })
    .boxed()
}

/// The manifest document (see the module doc).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    files: Vec<ManifestEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestEntry {
    path: String,
    url: Option<String>,
    size: Option<u64>,
    sha256: Option<String>,
}

/// An `http(s)://` source.
pub struct HttpSource {
    client: Client,
    uri: HttpUri,
    token: Option<String>,
    ranges: AtomicBool,
    /// Each file's full URL (query included, so never shown) by model
    /// path, from the last resolve; the locator is the redacted form.
    urls: Mutex<HashMap<String, Url>>,
}

impl HttpSource {
    pub fn new(uri: &str, opts: &SourceOptions) -> Result<HttpSource> {
        let uri = parse(uri).map_err(|m| Error::invalid("parameters.source", m))?;
        let token = opts
            .secrets
            .get(TOKEN_SECRET)
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        if token.is_some() && uri.url.scheme() == "http" {
            tracing::warn!(
                source = %uri.normalized(),
                "sending {TOKEN_SECRET} over plain http"
            );
        }
        Ok(HttpSource {
            client: client(opts)?,
            uri,
            token,
            ranges: AtomicBool::new(false),
            urls: Mutex::new(HashMap::new()),
        })
    }

    /// The token, for URLs on the URI's own origin only: a manifest must
    /// not be able to send it to another host.
    fn token_for(&self, url: &Url) -> Option<&str> {
        self.token
            .as_deref()
            .filter(|_| url.origin() == self.uri.url.origin())
    }

    fn denied_hint(&self) -> &'static str {
        if self.token.is_some() {
            "the httpBearerToken secret was rejected"
        } else {
            "set the httpBearerToken secret if the server needs a bearer token"
        }
    }

    async fn resolve_file(&self, name: &str, pinned: Option<&str>) -> Result<Resolved> {
        let url = &self.uri.url;
        let what = redact(url);
        let p = probe(
            &self.client,
            url,
            self.token_for(url),
            &what,
            self.denied_hint(),
        )
        .await?;
        let revision = match pinned {
            Some(hex) => format!("sha256:{hex}"),
            None => p.validator().unwrap_or_else(|| {
                tracing::warn!(
                    source = %what,
                    "the server sends no ETag or Last-Modified: a changed file of the same size \
                     would not be noticed; pin it with #sha256=<hex>"
                );
                p.unversioned()
            }),
        };
        self.ranges
            .store(p.ranges && p.size.is_some(), Ordering::Relaxed);
        *self.urls.lock().unwrap_or_else(|e| e.into_inner()) =
            HashMap::from([(name.to_string(), url.clone())]);
        Ok(Resolved {
            uri: self.uri.normalized(),
            revision,
            files: vec![RemoteFile {
                path: name.to_string(),
                size: p.size,
                sha256: pinned.map(str::to_string),
                locator: what,
                unpack: Unpack::None,
            }],
        })
    }

    async fn resolve_manifest(&self) -> Result<Resolved> {
        let base = &self.uri.url;
        let what = format!("manifest {}", redact(base));
        let (body, _) = get_document(
            &self.client,
            base,
            self.token_for(base),
            &what,
            self.denied_hint(),
        )
        .await?;
        let bad = |m: String| Error::invalid("parameters.source", format!("{what}: {m}"));
        let manifest: Manifest = serde_json::from_slice(&body).map_err(|e| {
            bad(format!(
                "not a manifest ({e}); expected {{\"files\": [{{\"path\", \"url\", \"size\", \"sha256\"}}]}}"
            ))
        })?;
        if manifest.files.is_empty() {
            return Err(bad("lists no files".into()));
        }
        if manifest.files.len() > MAX_LISTED_FILES {
            return Err(Error::OverLimit(format!(
                "{what}: lists more than {MAX_LISTED_FILES} files"
            )));
        }
        // Names are judged by the engine, in one place for every source.
        let mut entries = Vec::with_capacity(manifest.files.len());
        for e in manifest.files {
            let rel = match &e.url {
                Some(u) => u.clone(),
                None => e
                    .path
                    .split('/')
                    .map(encode_segment)
                    .collect::<Vec<_>>()
                    .join("/"),
            };
            let url = base
                .join(&rel)
                .map_err(|err| bad(format!("{:?}: bad url: {err}", e.path)))?;
            if !matches!(url.scheme(), "http" | "https")
                || !url.username().is_empty()
                || url.password().is_some()
            {
                return Err(bad(format!(
                    "{:?}: only http(s) URLs without credentials are allowed",
                    e.path
                )));
            }
            let sha256 = match e.sha256 {
                Some(h) if is_sha256(&h) => Some(h.to_ascii_lowercase()),
                Some(h) => {
                    return Err(bad(format!(
                        "{:?}: sha256 {h:?} is not 64 hex digits",
                        e.path
                    )));
                }
                None => None,
            };
            entries.push((e.path, url, e.size, sha256));
        }
        // One HEAD per file: early NotFound, sizes, range support and
        // validators for the unpinned files.
        let hint = self.denied_hint();
        let jobs: Vec<(Url, Option<String>, String)> = entries
            .iter()
            .map(|(path, url, _, _)| {
                let token = self.token_for(url).map(str::to_string);
                (url.clone(), token, format!("{path} ({})", redact(url)))
            })
            .collect();
        let client = &self.client;
        let probes: Vec<Result<Probe>> = stream::iter(jobs)
            .map(|(url, token, what)| async move {
                probe(client, &url, token.as_deref(), &what, hint).await
            })
            .buffered(PROBE_CONCURRENCY)
            .collect()
            .await;
        let mut revision = Sha256::new();
        revision.update(&body);
        let mut ranges = true;
        let mut files = Vec::with_capacity(entries.len());
        let mut urls = HashMap::with_capacity(entries.len());
        for ((path, url, size, sha256), p) in entries.into_iter().zip(probes) {
            let p = match p {
                Ok(p) => p,
                // A file the manifest pins (size and sha256) needs no answer
                // from its host to be listed: its bytes can still come from
                // peers, checked against the pin, while that host is down.
                Err(e @ (Error::Transient(_) | Error::RetryAfter { .. }))
                    if size.is_some() && sha256.is_some() =>
                {
                    tracing::info!(source = %what, file = %path, error = %e, "the file's host did not answer; listing it as the manifest pins it");
                    Probe {
                        size: None,
                        ranges: false,
                        etag: None,
                        last_modified: None,
                    }
                }
                Err(e) => return Err(e),
            };
            if let (Some(listed), Some(served)) = (size, p.size)
                && listed != served
            {
                return Err(Error::Precondition(format!(
                    "{what}: {path:?} is listed as {listed} bytes, the server has {served}"
                )));
            }
            let size = size.or(p.size);
            ranges &= p.ranges && size.is_some();
            if sha256.is_none() {
                let v = p.validator().unwrap_or_else(|| {
                    tracing::warn!(
                        source = %what,
                        file = %path,
                        "no sha256 in the manifest and no ETag or Last-Modified from the server"
                    );
                    p.unversioned()
                });
                revision.update(format!("\n{path}\0{v}").as_bytes());
            }
            files.push(RemoteFile {
                path: path.clone(),
                size,
                sha256,
                locator: redact(&url),
                unpack: Unpack::None,
            });
            urls.insert(path, url);
        }
        self.ranges.store(ranges, Ordering::Relaxed);
        *self.urls.lock().unwrap_or_else(|e| e.into_inner()) = urls;
        Ok(Resolved {
            uri: self.uri.normalized(),
            revision: format!("manifest:{}", hex::encode(revision.finalize())),
            files,
        })
    }

    /// The full URL of a resolved file; resolves first when this instance
    /// has not (the locator lacks the query, which may be needed).
    async fn url_of(&self, file: &RemoteFile) -> Result<Url> {
        for attempt in 0..2 {
            if let Some(u) = self
                .urls
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&file.path)
            {
                return Ok(u.clone());
            }
            if attempt == 0 {
                self.resolve().await?;
            }
        }
        Err(Error::NotFound(format!(
            "{} no longer lists {:?}",
            self.uri.normalized(),
            file.path
        )))
    }
}

/// Percent-encodes one path segment of a manifest's default file URL.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[async_trait::async_trait]
impl Source for HttpSource {
    /// `#sha256=` pins the one file's content, and so the revision.
    fn pinned(&self) -> Option<crate::puller::source::Pinned> {
        let Target::File {
            name,
            sha256: Some(hex),
        } = &self.uri.target
        else {
            return None;
        };
        Some(crate::puller::source::Pinned {
            uri: self.uri.normalized(),
            revision: format!("sha256:{hex}"),
            files: [(name.clone(), hex.clone())].into(),
        })
    }

    async fn resolve(&self) -> Result<Resolved> {
        match &self.uri.target {
            Target::File { name, sha256 } => self.resolve_file(name, sha256.as_deref()).await,
            Target::Manifest => self.resolve_manifest().await,
        }
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        let url = self.url_of(file).await?;
        let what = format!("{} ({})", file.path, file.locator);
        let body = get_range(
            &self.client,
            RangeGet {
                token: self.token_for(&url),
                url,
                offset,
                len,
                size: file.size,
                what: &what,
                denied_hint: self.denied_hint(),
            },
        )
        .await?;
        if !body.ranged {
            self.ranges.store(false, Ordering::Relaxed);
        }
        Ok(body.stream)
    }

    /// Known after `resolve`: every file's server answered
    /// `Accept-Ranges: bytes` and gave a size. Turns false if a server
    /// later ignores a Range header.
    fn ranges(&self) -> bool {
        self.ranges.load(Ordering::Relaxed)
    }

    /// The query selects the object (a signed URL, `?version=`), so it is
    /// part of the key, though never of the shown URI.
    fn key_scope(&self) -> String {
        self.uri.url.query().unwrap_or_default().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        let u = parse("https://Example.com:443/a/b/model.safetensors?sig=x").unwrap();
        assert_eq!(u.normalized(), "https://example.com/a/b/model.safetensors");
        assert_eq!(u.url.query(), Some("sig=x"));
        assert!(
            matches!(u.target, Target::File { ref name, sha256: None } if name == "model.safetensors")
        );
        let m = parse("http://h/models/minilm.json#manifest").unwrap();
        assert_eq!(m.target, Target::Manifest);
        assert_eq!(m.normalized(), "http://h/models/minilm.json#manifest");
        let hex = "AB".repeat(32);
        let p = parse(&format!("https://h/f%20x.bin#sha256={hex}")).unwrap();
        assert_eq!(
            p.target,
            Target::File {
                name: "f x.bin".into(),
                sha256: Some(hex.to_ascii_lowercase())
            }
        );
        for bad in [
            "https://h/",
            "https://u:p@h/f",
            "ftp://h/f",
            "https://h/f#sha256=12",
            "https://h/f#other",
            "https://h/a%2Fb",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn http_dates() {
        let t = UNIX_EPOCH + Duration::from_secs(784_111_777);
        for s in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(httpdate::parse_http_date(s).ok(), Some(t), "{s}");
        }
        assert!(httpdate::parse_http_date("yesterday").is_err());
        let mut h = HeaderMap::new();
        h.insert(
            header::RETRY_AFTER,
            "Sun, 06 Nov 1994 08:50:07 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&h, t), Some(Duration::from_secs(30)));
        h.insert(header::RETRY_AFTER, "120".parse().unwrap());
        assert_eq!(retry_after(&h, t), Some(Duration::from_secs(120)));
    }

    #[test]
    fn revision_rules() {
        let mut p = Probe {
            size: Some(10),
            ranges: true,
            etag: Some("\"abc\"".into()),
            last_modified: Some("Sun, 06 Nov 1994 08:49:37 GMT".into()),
        };
        assert_eq!(p.validator().as_deref(), Some("etag:abc"));
        p.etag = Some("W/\"weak\"".into());
        assert_eq!(p.validator().as_deref(), Some("modified:784111777-10"));
        p.last_modified = None;
        assert_eq!(p.validator().as_deref(), Some("weak-etag:weak-10"));
        p.etag = None;
        assert_eq!(p.validator(), None);
        assert_eq!(p.unversioned(), "unversioned-10");
    }

    #[test]
    fn content_ranges() {
        assert_eq!(parse_content_range("bytes 0-9/10"), Some((0, 9, Some(10))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
        assert_eq!(parse_content_range("bytes */10"), None);
        assert_eq!(parse_content_range("bytes 9-5/10"), None);
    }

    #[test]
    fn statuses() {
        let h = HeaderMap::new();
        let e = |c: u16| status_error("x", StatusCode::from_u16(c).unwrap(), &h, "hint");
        assert!(matches!(e(404), Failure::NotFound(_)));
        assert!(matches!(e(410), Failure::NotFound(_)));
        assert!(matches!(e(401), Failure::Denied(_)));
        assert!(matches!(e(403), Failure::Denied(_)));
        assert!(matches!(e(503), Failure::Transient { after: None, .. }));
        assert!(matches!(e(429), Failure::Transient { after: None, .. }));
        assert!(matches!(e(502), Failure::Transient { after: None, .. }));
        // A gated repo's file reads as its API documents do (docs/troubleshooting.md).
        let mut gated = HeaderMap::new();
        gated.insert("x-error-code", "GatedRepo".parse().unwrap());
        assert!(matches!(
            status_error("f", StatusCode::UNAUTHORIZED, &gated, "set hfToken"),
            Failure::Denied(m) if m == "f: gated repo (HTTP 401); set hfToken"
        ));
        let mut h = HeaderMap::new();
        h.insert(header::RETRY_AFTER, "3".parse().unwrap());
        let e = status_error("x", StatusCode::TOO_MANY_REQUESTS, &h, "");
        assert!(
            matches!(e, Failure::Transient { after: Some(after), .. } if after == Duration::from_secs(3))
        );
    }
}
