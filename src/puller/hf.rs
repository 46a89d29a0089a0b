//! `hf://org/repo[@revision]`: a model repository on the Hugging Face Hub
//! (or a mirror speaking its HTTP API), pinned to one commit.
//!
//! Uses only the documented endpoints: `/api/models/{repo}/revision/{rev}`
//! (commit sha and file list), `/api/models/{repo}/tree/{sha}?recursive=true`
//! (sizes, and the sha256 of LFS files) and `/{repo}/resolve/{sha}/{path}`
//! (the bytes, usually a redirect to the LFS/Xet CDN). Every file is read
//! at the resolved commit, never at the branch, so a push during a pull
//! cannot mix two revisions. The token goes to the endpoint only.

use bytes::Bytes;
use futures::stream::BoxStream;
use reqwest::header::HeaderMap;
use reqwest::{Client, StatusCode};
use serde::Deserialize;
use url::Url;

use super::SourceOptions;
use super::failure::Failure;
use super::http::{self, RangeGet};
use super::source::{MAX_LISTED_FILES, RemoteFile, Resolved, Source, Unpack};
use crate::error::{Error, Result};

pub const FORMS: &str = "hf://org/repo[@revision]";
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
pub const DEFAULT_REVISION: &str = "main";
/// StorageClass parameter naming a Hub mirror; else env `HF_ENDPOINT`.
pub const ENDPOINT_PARAM: &str = "hfEndpoint";
/// Comma-separated globs: only matching files are pulled (all when unset).
pub const ALLOW_PARAM: &str = "hfAllowPatterns";
/// Comma-separated globs: matching files are left out.
pub const IGNORE_PARAM: &str = "hfIgnorePatterns";
/// Secret with a Hub access token; else env `HF_TOKEN`.
pub const TOKEN_SECRET: &str = "hfToken";
/// Keys other tools give a Hub token under (huggingface_hub's environment
/// names, KServe's secrets): taken as `hfToken`, in this order, when it is
/// absent, so a Secret made for them works here too.
pub const TOKEN_SECRET_ALIASES: [&str; 3] = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "token"];
/// Tree pages followed before giving up (the Hub sends ~1000 entries a page).
const MAX_TREE_PAGES: usize = 1000;

/// A parsed `hf://` URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfUri {
    /// `org/name` (or a legacy `name`).
    pub repo: String,
    /// Branch, tag or commit sha as written; `main` when absent.
    pub revision: String,
}

/// Checks an `hf://` URI without touching the network.
pub fn parse(uri: &str) -> Result<HfUri, String> {
    let rest = uri
        .strip_prefix("hf://")
        .ok_or_else(|| format!("{uri:?} does not start with hf://"))?;
    let (repo, revision) = match rest.split_once('@') {
        Some((r, rev)) => (r, rev),
        None => (rest, DEFAULT_REVISION),
    };
    let parts: Vec<&str> = repo.split('/').collect();
    let part_ok = |p: &&str| {
        !p.is_empty()
            && *p != "."
            && *p != ".."
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if parts.is_empty() || parts.len() > 2 || !parts.iter().all(part_ok) {
        return Err(format!(
            "{uri:?}: the repo must be org/name of letters, digits, '-', '_' and '.'; \
             accepted form: {FORMS}"
        ));
    }
    if revision.is_empty()
        || !revision
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"?#%\\".contains(&b))
    {
        return Err(format!(
            "{uri:?}: the revision after '@' must be a branch, tag or commit sha"
        ));
    }
    Ok(HfUri {
        repo: repo.to_string(),
        revision: revision.to_string(),
    })
}

/// `GET /api/models/{repo}/revision/{rev}`, the parts we use.
#[derive(Deserialize)]
struct ModelInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Option<Vec<Sibling>>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
}

/// One entry of `GET /api/models/{repo}/tree/{sha}?recursive=true`.
#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    size: Option<u64>,
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    /// The sha256 of the file's content.
    oid: String,
    size: u64,
}

/// An `hf://` source.
pub struct HfSource {
    client: Client,
    endpoint: Url,
    uri: HfUri,
    token: Option<String>,
    filter: Filter,
}

/// Which of a repo's files to pull. `*` crosses `/`, as in huggingface_hub's
/// allow_patterns and ignore_patterns (fnmatch), so `*.json` also matches
/// `1_Pooling/config.json`.
#[derive(Default)]
struct Filter {
    allow: Vec<String>,
    ignore: Vec<String>,
    allow_set: Option<globset::GlobSet>,
    ignore_set: Option<globset::GlobSet>,
}

/// The globs of `value` (comma-separated), sorted and deduplicated, and
/// their set; None for no globs. The one judge of `hfAllowPatterns` and
/// `hfIgnorePatterns`, for a StorageClass and for `cache prefetch` alike.
pub fn patterns(key: &str, value: &str) -> Result<(Vec<String>, Option<globset::GlobSet>)> {
    let mut pats: Vec<String> = value
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if pats.is_empty() {
        return Ok((pats, None));
    }
    pats.sort();
    pats.dedup();
    let mut b = globset::GlobSetBuilder::new();
    for p in &pats {
        let g = globset::Glob::new(p).map_err(|e| {
            Error::invalid(
                format!("parameters.{key}"),
                format!("{p:?} is not a glob ({e}); give comma-separated globs such as *.safetensors,*.json"),
            )
        })?;
        b.add(g);
    }
    let set = b
        .build()
        .map_err(|e| Error::invalid(format!("parameters.{key}"), e.to_string()))?;
    Ok((pats, Some(set)))
}

impl Filter {
    fn new(params: &std::collections::BTreeMap<String, String>) -> Result<Filter> {
        let list = |key: &str| patterns(key, params.get(key).map_or("", String::as_str));
        let (allow, allow_set) = list(ALLOW_PARAM)?;
        let (ignore, ignore_set) = list(IGNORE_PARAM)?;
        Ok(Filter {
            allow,
            ignore,
            allow_set,
            ignore_set,
        })
    }

    fn keeps(&self, path: &str) -> bool {
        self.allow_set.as_ref().is_none_or(|s| s.is_match(path))
            && !self.ignore_set.as_ref().is_some_and(|s| s.is_match(path))
    }

    /// Part of the model's identity: another subset of a repo is another model.
    fn suffix(&self) -> String {
        let mut q = Vec::new();
        if !self.allow.is_empty() {
            q.push(format!("allow={}", self.allow.join(",")));
        }
        if !self.ignore.is_empty() {
            q.push(format!("ignore={}", self.ignore.join(",")));
        }
        if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        }
    }
}

impl HfSource {
    pub fn new(uri: &str, opts: &SourceOptions) -> Result<HfSource> {
        let uri = parse(uri).map_err(|m| Error::invalid("parameters.source", m))?;
        let endpoint = opts
            .params
            .get(ENDPOINT_PARAM)
            .cloned()
            .or_else(|| opts.env.get("HF_ENDPOINT").map(str::to_owned))
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let endpoint =
            super::http::service_url(&endpoint, ENDPOINT_PARAM, "https://huggingface.co")?;
        let token = std::iter::once(TOKEN_SECRET)
            .chain(TOKEN_SECRET_ALIASES)
            .find_map(|k| opts.secrets.get(k).cloned())
            .or_else(|| opts.admin_env("HF_TOKEN"))
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        Ok(HfSource {
            client: http::client(opts)?,
            endpoint,
            uri,
            token,
            filter: Filter::new(&opts.params)?,
        })
    }

    /// `{endpoint}/{segments...}`, each segment percent-encoded (a '/' in
    /// a revision becomes %2F, as the Hub expects).
    fn url(&self, segments: &[&str]) -> Url {
        let mut u = self.endpoint.clone();
        if let Ok(mut p) = u.path_segments_mut() {
            p.pop_if_empty().extend(segments);
        }
        u
    }

    fn repo_segments(&self) -> Vec<&str> {
        self.uri.repo.split('/').collect()
    }

    fn denied_hint(&self) -> &'static str {
        if self.token.is_some() {
            "the hfToken has no access to this repo; for a gated repo, accept its terms \
             on the Hub with the token's account"
        } else {
            "the repo may not exist, or it is gated or private: set the hfToken secret"
        }
    }

    fn error(&self, what: &str, status: StatusCode, headers: &HeaderMap) -> Failure {
        let code = headers.get("x-error-code").and_then(|v| v.to_str().ok());
        match (status.as_u16(), code) {
            (404, Some("RevisionNotFound")) => Failure::NotFound(format!(
                "{what}: revision {:?} not found",
                self.uri.revision
            )),
            (401 | 403, Some("GatedRepo")) => Failure::Denied(format!(
                "{what}: gated repo (HTTP {}); {}",
                status.as_u16(),
                self.denied_hint()
            )),
            _ => http::status_error(what, status, headers, self.denied_hint()),
        }
    }

    /// GETs an API document, mapping the Hub's error codes.
    async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        url: &Url,
        what: &str,
    ) -> Result<(T, HeaderMap)> {
        crate::trust::egress::check_url(url)?;
        let mut req = self.client.get(url.clone());
        if let Some(t) = self.token_for(url) {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| http::request_error(what, e))?;
        if !resp.status().is_success() {
            return Err(self.error(what, resp.status(), resp.headers()).into());
        }
        let headers = resp.headers().clone();
        let body = http::read_document(resp, what).await?;
        let doc = serde_json::from_slice(&body)
            .map_err(|e| Error::Transient(format!("{what}: unexpected answer: {e}")))?;
        Ok((doc, headers))
    }

    /// The token, for the endpoint's own origin only.
    fn token_for(&self, url: &Url) -> Option<&str> {
        self.token
            .as_deref()
            .filter(|_| url.origin() == self.endpoint.origin())
    }

    fn what(&self) -> String {
        format!("hf://{}@{}", self.uri.repo, self.uri.revision)
    }
}

/// The `rel="next"` URL of a `Link` header.
fn next_link(headers: &HeaderMap) -> Option<String> {
    for value in headers.get_all(reqwest::header::LINK) {
        for link in value.to_str().ok()?.split(',') {
            let mut parts = link.split(';');
            let target = parts.next()?.trim();
            let is_next = parts.any(|p| {
                let p = p.trim().replace(' ', "");
                p == "rel=\"next\"" || p == "rel=next"
            });
            if is_next {
                return Some(target.trim_start_matches('<').trim_end_matches('>').into());
            }
        }
    }
    None
}

fn is_commit(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[async_trait::async_trait]
impl Source for HfSource {
    async fn resolve(&self) -> Result<Resolved> {
        let what = self.what();
        let mut segs = vec!["api", "models"];
        segs.extend(self.repo_segments());
        segs.extend(["revision", self.uri.revision.as_str()]);
        let (info, _) = self.get_json::<ModelInfo>(&self.url(&segs), &what).await?;
        let sha = info
            .sha
            .filter(|s| is_commit(s))
            .ok_or_else(|| Error::Transient(format!("{what}: the Hub sent no commit sha")))?
            .to_ascii_lowercase();

        let mut segs = vec!["api", "models"];
        segs.extend(self.repo_segments());
        segs.extend(["tree", sha.as_str()]);
        let mut page = self.url(&segs);
        page.query_pairs_mut().append_pair("recursive", "true");
        let mut tree = std::collections::HashMap::new();
        for n in 0.. {
            if n == MAX_TREE_PAGES {
                return Err(Error::Transient(format!(
                    "{what}: the file listing has more than {MAX_TREE_PAGES} pages"
                )));
            }
            let (entries, headers) = self.get_json::<Vec<TreeEntry>>(&page, &what).await?;
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                tree.insert(e.path.clone(), e);
            }
            if tree.len() > MAX_LISTED_FILES {
                return Err(Error::OverLimit(format!(
                    "{what}: the repo lists more than {MAX_LISTED_FILES} files"
                )));
            }
            match next_link(&headers) {
                Some(next) => {
                    page = page.join(&next).map_err(|e| {
                        Error::Transient(format!("{what}: bad pagination link: {e}"))
                    })?;
                }
                None => break,
            }
        }

        // The revision's file list is the authority; the tree adds sizes
        // and digests. A repo answering without siblings is listed by its tree.
        let mut names: Vec<String> = match info.siblings {
            Some(s) => s.into_iter().map(|s| s.rfilename).collect(),
            None => tree.keys().cloned().collect(),
        };
        names.sort();
        let listed = names.len();
        names.retain(|n| self.filter.keeps(n));
        if names.is_empty() && listed > 0 {
            return Err(Error::invalid(
                format!("parameters.{ALLOW_PARAM}"),
                format!(
                    "{what}: {ALLOW_PARAM} {:?} and {IGNORE_PARAM} {:?} leave none of the repo's {listed} files",
                    self.filter.allow.join(","),
                    self.filter.ignore.join(",")
                ),
            ));
        }
        let mut files = Vec::with_capacity(names.len());
        for name in names {
            let entry = tree.get(&name).ok_or_else(|| {
                Error::Transient(format!(
                    "{what}: {name:?} is in the commit but not in its tree listing"
                ))
            })?;
            let (size, sha256) = match &entry.lfs {
                Some(lfs) => (
                    Some(lfs.size),
                    http::is_sha256(&lfs.oid).then(|| lfs.oid.to_ascii_lowercase()),
                ),
                None => (entry.size, None),
            };
            files.push(RemoteFile {
                locator: format!("{sha}/{name}"),
                path: name,
                size,
                sha256,
                unpack: Unpack::None,
            });
        }
        if files.is_empty() {
            return Err(Error::NotFound(format!("{what}: the repo has no files")));
        }
        Ok(Resolved {
            // Without the revision: @main and @<its sha> share one cache entry.
            uri: format!("hf://{}{}", self.uri.repo, self.filter.suffix()),
            revision: sha,
            files,
        })
    }

    async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: Option<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes>>> {
        let (sha, path) = file
            .locator
            .split_once('/')
            .filter(|(sha, _)| is_commit(sha))
            .ok_or_else(|| {
                Error::Internal(format!("hf locator {:?} is not <sha>/<path>", file.locator))
            })?;
        let mut segs = self.repo_segments();
        segs.extend(["resolve", sha]);
        segs.extend(path.split('/'));
        let url = self.url(&segs);
        let what = format!("hf://{}@{sha}/{path}", self.uri.repo);
        let token = self.token_for(&url);
        let denied_hint = self.denied_hint();
        let body = http::get_range(
            &self.client,
            RangeGet {
                url,
                token,
                offset,
                len,
                size: file.size,
                what: &what,
                denied_hint,
            },
        )
        .await?;
        Ok(body.stream)
    }

    fn key_scope(&self) -> String {
        self.endpoint.to_string()
    }

    /// A commit sha pins the repo's files.
    fn pinned(&self) -> Option<crate::puller::source::Pinned> {
        let sha = self.uri.revision.to_ascii_lowercase();
        is_commit(&sha).then(|| crate::puller::source::Pinned {
            uri: format!("hf://{}{}", self.uri.repo, self.filter.suffix()),
            revision: sha,
            files: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        let u = parse("hf://sentence-transformers/all-MiniLM-L6-v2").unwrap();
        assert_eq!(u.repo, "sentence-transformers/all-MiniLM-L6-v2");
        assert_eq!(u.revision, "main");
        let u = parse("hf://gpt2@refs/pr/1").unwrap();
        assert_eq!(
            (u.repo.as_str(), u.revision.as_str()),
            ("gpt2", "refs/pr/1")
        );
        for bad in [
            "hf://",
            "hf://a/b/c",
            "hf://a/../b",
            "hf://a b/c",
            "hf://a/b@",
            "s3://a/b",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn link_header() {
        let mut h = HeaderMap::new();
        h.insert(
            reqwest::header::LINK,
            "<https://hf.co/api/models/a/b/tree/x?cursor=abc>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(
            next_link(&h).as_deref(),
            Some("https://hf.co/api/models/a/b/tree/x?cursor=abc")
        );
        assert_eq!(next_link(&HeaderMap::new()), None);
    }
}
