//! `allowedSources`: the URI prefixes a StorageClass lets its PVCs name.
//!
//! A prefix matches on URI structure, never on raw text: the scheme must be
//! equal, the authority (host, bucket, org, registry) equal as a whole, and
//! the path must continue at a boundary, so `s3://models/llama` admits
//! `s3://models/llama/7b` but not `s3://models/llama-evil`, and
//! `https://cdn.example.com` never admits `https://cdn.example.com.evil.net`
//! or `https://cdn.example.com@evil.net`. What may continue a prefix's last
//! segment depends on the scheme: a tag or digest for `oci`, a revision for
//! `hf`, a query or fragment for `http(s)`, nothing for the others, where
//! `file:///models?x` is a sibling directory. A tenant URI with user info
//! or a dot segment is refused before any matching, so no spelling of a
//! path can climb out of an allowed prefix.

use std::fmt;

use super::egress;

/// Schemes a prefix may name; `pvc` and `file` only when named explicitly.
const SCHEMES: [&str; 8] = [
    "s3",
    "http",
    "https",
    "oci",
    "hf",
    "model-registry",
    "pvc",
    "file",
];

/// One `scheme://[authority[/path]]` prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Prefix {
    raw: String,
    scheme: String,
    /// None: any authority (the prefix was just `scheme://`).
    authority: Option<String>,
    /// Starts with '/' or is empty.
    path: String,
}

/// The parsed `allowedSources` parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowedSources {
    prefixes: Vec<Prefix>,
}

/// A URI split at its structure: what a prefix is matched against.
struct Parts<'a> {
    scheme: &'a str,
    authority: &'a str,
    /// From the end of the authority (query and fragment included).
    rest: &'a str,
}

/// Only http(s) URIs have a query and a fragment. Elsewhere '?' and '#' are
/// part of a name (`file:///m?x` is the directory "m?x") or refused by the
/// scheme's parser.
fn has_query(scheme: &str) -> bool {
    scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")
}

/// What may follow a prefix that does not end in '/': a new segment, or
/// what the scheme reads as not part of the name (`:tag`, `@digest`,
/// `@revision`, a query).
fn boundaries(scheme: &str) -> &'static [char] {
    match scheme {
        "oci" => &['/', ':', '@'],
        "hf" => &['/', '@'],
        "http" | "https" => &['/', '?', '#'],
        _ => &['/'],
    }
}

fn split(uri: &str) -> Option<Parts<'_>> {
    let (scheme, after) = uri.split_once("://")?;
    let end = if has_query(scheme) {
        after.find(['/', '?', '#'])
    } else {
        after.find('/')
    }
    .unwrap_or(after.len());
    Some(Parts {
        scheme,
        authority: &after[..end],
        rest: &after[end..],
    })
}

impl AllowedSources {
    /// Parses a comma-separated list of prefixes; an error says which entry
    /// is wrong and what is accepted.
    pub fn parse(value: &str) -> Result<AllowedSources, String> {
        let mut prefixes = Vec::new();
        for raw in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let parts = split(raw).ok_or_else(|| {
                format!("{raw:?} is not a URI prefix like hf:// or s3://bucket/models/")
            })?;
            let scheme = parts.scheme.to_ascii_lowercase();
            if !SCHEMES.contains(&scheme.as_str()) {
                return Err(format!(
                    "{raw:?}: scheme {:?} is not a model source scheme (accepted: {})",
                    parts.scheme,
                    SCHEMES.join(", ")
                ));
            }
            if parts.authority.contains('@') {
                return Err(format!("{raw:?} must not carry user info"));
            }
            if has_dot_segment(parts.scheme, parts.rest) || raw.chars().any(char::is_control) {
                return Err(format!(
                    "{raw:?} has a '.' or '..' segment or a control character"
                ));
            }
            if parts.authority.contains(['?', '#']) || parts.rest.contains(['?', '#']) {
                return Err(format!("{raw:?}: a prefix cannot have a query or fragment"));
            }
            let authority = match (parts.authority.is_empty(), parts.rest.is_empty()) {
                // `scheme://`: any authority; `file:///x` has an empty one.
                (true, true) => None,
                _ => Some(fold_authority(&scheme, parts.authority)),
            };
            prefixes.push(Prefix {
                raw: raw.to_string(),
                scheme,
                authority,
                path: parts.rest.to_string(),
            });
        }
        if prefixes.is_empty() {
            return Err("lists no prefix; give comma-separated URI prefixes like \
                 hf://,s3://models/,oci://registry.example.com/"
                .into());
        }
        Ok(AllowedSources { prefixes })
    }

    /// Whether a tenant may name `uri`; the error says why not and lists
    /// what is allowed.
    pub fn permits(&self, uri: &str) -> Result<(), String> {
        refuse_hostile_form(uri)?;
        let parts = split(uri).ok_or_else(|| format!("{:?} is not a model URI", shown(uri)))?;
        let scheme = parts.scheme.to_ascii_lowercase();
        let authority = fold_authority(&scheme, parts.authority);
        let ok = self.prefixes.iter().any(|p| {
            p.scheme == scheme
                && match &p.authority {
                    None => true,
                    Some(a) => *a == authority && path_within(&scheme, &p.path, parts.rest),
                }
        });
        if ok {
            Ok(())
        } else {
            // The class's list stays unsaid: which hosts and buckets an
            // admin opened is not a tenant's to learn from a refusal.
            Err(format!(
                "{} is outside the {} source prefix(es) this StorageClass allows (allowedSources; \
                 its admin can tell you which)",
                shown(uri),
                self.prefixes.len()
            ))
        }
    }

    /// The `host:port`s that prefixes name explicitly, a missing port
    /// being the scheme's (an OCI registry's both 443 and 80, for plain
    /// HTTP): the only ones a tenant's pull may reach on private,
    /// loopback or blocked addresses, and only on that port.
    pub fn named_hosts(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in &self.prefixes {
            let Some(a) = p.authority.as_deref().filter(|a| !a.is_empty()) else {
                continue;
            };
            let defaults: &[u16] = match p.scheme.as_str() {
                "http" => &[80],
                "https" => &[443],
                "oci" => &[443, 80],
                _ => continue,
            };
            match split_port(a) {
                (host, Some(port)) => out.push(egress::host_port(host, port)),
                (host, None) => out.extend(defaults.iter().map(|d| egress::host_port(host, *d))),
            }
        }
        out
    }

    /// The directory a tenant's `file://` URI is confined to: the path of
    /// the longest `file://` prefix that admits it (none for a bare
    /// `file://`, which admits the whole host).
    pub fn file_root(&self, uri: &str) -> Option<std::path::PathBuf> {
        let parts = split(uri)?;
        self.prefixes
            .iter()
            .filter(|p| p.scheme == "file")
            .filter(|p| match &p.authority {
                None => true,
                Some(a) => *a == parts.authority && path_within("file", &p.path, parts.rest),
            })
            .map(|p| {
                if p.path.is_empty() {
                    "/".to_string()
                } else {
                    p.path.clone()
                }
            })
            .max_by_key(String::len)
            // `file://` alone admits the whole host: nothing to confine to.
            .filter(|p| !p.trim_end_matches('/').is_empty())
            .map(std::path::PathBuf::from)
    }

    /// Whether `url` is on a host some prefix names (so it is reachable
    /// only by that name) but outside every prefix: a redirect there would
    /// reach a path of an admitted host that the class never allowed.
    pub fn strays_on_named_host(&self, url: &url::Url) -> bool {
        let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
            return false;
        };
        let hp = egress::host_port(host, port);
        self.named_hosts().contains(&hp) && self.permits(url.as_str()).is_err()
    }
}

impl fmt::Display for AllowedSources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let raw: Vec<_> = self.prefixes.iter().map(|p| p.raw.as_str()).collect();
        f.write_str(&raw.join(","))
    }
}

/// An authority as its scheme compares it: host names ignore case; S3
/// buckets, Hub orgs, claims and registry model names do not.
fn fold_authority(scheme: &str, authority: &str) -> String {
    match scheme {
        "http" | "https" | "oci" => authority.to_ascii_lowercase(),
        _ => authority.to_string(),
    }
}

/// `host[:port]` (IPv6 in brackets) split at its port.
fn split_port(authority: &str) -> (&str, Option<u16>) {
    if let Some(rest) = authority.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((h, tail)) => (h, tail.strip_prefix(':').and_then(|p| p.parse().ok())),
            None => (authority, None),
        };
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (authority, None),
        },
        None => (authority, None),
    }
}

/// The URI without query or fragment, which may carry secrets.
pub fn shown(uri: &str) -> &str {
    let end = uri.find(['?', '#']).unwrap_or(uri.len());
    &uri[..end]
}

/// `rest` continues `prefix` at a boundary of `scheme` (lowercase).
fn path_within(scheme: &str, prefix: &str, rest: &str) -> bool {
    if prefix.is_empty() || prefix == "/" {
        return true;
    }
    let Some(tail) = rest.strip_prefix(prefix) else {
        return false;
    };
    prefix.ends_with('/') || tail.is_empty() || tail.starts_with(boundaries(scheme))
}

/// A '.' or '..' path segment, literal or percent-encoded, or a backslash.
fn has_dot_segment(scheme: &str, rest: &str) -> bool {
    let end = if has_query(scheme) {
        rest.find(['?', '#'])
    } else {
        None
    };
    let path = &rest[..end.unwrap_or(rest.len())];
    path.split('/').any(|seg| {
        let decoded = percent_encoding::percent_decode_str(seg).decode_utf8_lossy();
        decoded == "." || decoded == ".." || decoded.contains(['\\', '/'])
    })
}

/// What no tenant URI may look like, whatever the prefixes say.
fn refuse_hostile_form(uri: &str) -> Result<(), String> {
    if uri.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("a source URI must not contain control characters or spaces".into());
    }
    let parts = split(uri).ok_or_else(|| format!("{:?} is not a model URI", shown(uri)))?;
    if parts.authority.contains('@') {
        return Err(format!(
            "{}: user info in a source URI is refused; credentials go in the PVC's source secret",
            parts.scheme
        ));
    }
    if has_dot_segment(parts.scheme, parts.rest) {
        return Err(format!(
            "{} has a '.' or '..' path segment (or a backslash); name the path directly",
            shown(uri)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(list: &str) -> AllowedSources {
        AllowedSources::parse(list).unwrap()
    }

    #[test]
    fn prefixes_match_on_structure() {
        let a = allowed(
            "hf://, s3://models/llama, oci://registry.example.com, https://cdn.example.com/m/",
        );
        for ok in [
            "hf://org/repo",
            "hf://org/repo@main",
            "s3://models/llama",
            "s3://models/llama/7b",
            "oci://registry.example.com/repo:tag",
            "oci://REGISTRY.example.com/repo@sha256:00",
            "https://cdn.example.com/m/model.safetensors",
            "https://cdn.example.com/m/x.json?sig=1#manifest",
        ] {
            assert_eq!(a.permits(ok), Ok(()), "{ok}");
        }
        for bad in [
            "s3://models/llama-evil/x",
            "s3://models/other",
            "s3://models2/llama",
            "oci://registry.example.com.evil.net/repo",
            "oci://registry.example.com:5000/repo",
            "https://cdn.example.com@evil.net/m/x",
            "https://cdn.example.com/m2/x",
            "https://cdn.example.com/m/../secret/x",
            "https://cdn.example.com/m/%2e%2e/secret/x",
            "https://cdn.example.com/m/a\\..\\b",
            "http://cdn.example.com/m/x",
            "file:///var/lib/kubelet/pki",
            "pvc://other:claim",
            "model-registry://m/1",
        ] {
            assert!(a.permits(bad).is_err(), "{bad} was permitted");
        }
    }

    #[test]
    fn file_and_pvc_only_when_named() {
        let a = allowed("file:///models/");
        assert_eq!(a.permits("file:///models/bert"), Ok(()));
        assert!(a.permits("file:///models/../etc").is_err());
        assert!(a.permits("file:///modelsx/bert").is_err());
        assert!(a.permits("file:///etc/shadow").is_err());
        assert!(allowed("hf://").permits("file:///models/bert").is_err());
        let a = allowed("pvc://team-a:weights/");
        assert_eq!(a.permits("pvc://team-a:weights/bert"), Ok(()));
        assert!(a.permits("pvc://team-b:weights/bert").is_err());
    }

    #[test]
    fn bad_lists_name_the_entry() {
        for (list, word) in [
            ("", "no prefix"),
            ("gopher://x", "gopher"),
            ("hf", "not a URI prefix"),
            ("https://u:p@host/", "user info"),
            ("https://host/a/../b", "'..'"),
        ] {
            let e = AllowedSources::parse(list).unwrap_err();
            assert!(e.contains(word), "{list}: {e}");
        }
    }

    #[test]
    fn named_hosts_are_explicit_network_hosts() {
        let a = allowed(
            "hf://, s3://models/, http://127.0.0.1:9000/m/, oci://reg.local:5000, https://CDN.example, oci://r.example, http://[::1]:81/",
        );
        assert_eq!(
            a.named_hosts(),
            vec![
                "127.0.0.1:9000",
                "reg.local:5000",
                "cdn.example:443",
                "r.example:443",
                "r.example:80",
                "[::1]:81"
            ]
        );
        let u = |s: &str| url::Url::parse(s).unwrap();
        assert!(!a.strays_on_named_host(&u("http://127.0.0.1:9000/m/x")));
        assert!(a.strays_on_named_host(&u("http://127.0.0.1:9000/admin")));
        assert!(!a.strays_on_named_host(&u("https://elsewhere.example/admin")));
    }

    #[test]
    fn a_file_uri_is_confined_to_its_longest_prefix() {
        let a = allowed("file:///models/, file:///models/team-a/, hf://");
        let root = |u: &str| a.file_root(u).map(|p| p.display().to_string());
        assert_eq!(root("file:///models/x").as_deref(), Some("/models/"));
        assert_eq!(
            root("file:///models/team-a/m").as_deref(),
            Some("/models/team-a/")
        );
        assert_eq!(allowed("file://").file_root("file:///etc"), None);
    }

    #[test]
    fn names_compare_as_their_scheme_does() {
        let a = allowed("s3://Models/, hf://OrgA, pvc://team-a:Claim, https://CDN.Example/m/");
        assert!(a.permits("s3://Models/x").is_ok());
        assert!(
            a.permits("s3://models/x").is_err(),
            "a bucket is case-sensitive"
        );
        assert!(a.permits("hf://OrgA/m").is_ok());
        assert!(
            a.permits("hf://orga/m").is_err(),
            "a Hub org is case-sensitive"
        );
        assert!(
            a.permits("pvc://team-a:claim").is_err(),
            "a claim is case-sensitive"
        );
        assert!(
            a.permits("https://cdn.example/m/w").is_ok(),
            "a host is not"
        );
    }

    #[test]
    fn refusals_never_show_a_query() {
        let e = allowed("hf://")
            .permits("https://h/x?X-Amz-Signature=secret")
            .unwrap_err();
        assert!(!e.contains("secret"), "{e}");
    }

    /// Found with fuzz/fuzz_targets/allowed_sources.rs (its boundary and
    /// user-info properties): a prefix admitted any URI that continued it
    /// with '?', '#', ':' or '@', whatever the scheme, and '?' ended the
    /// authority of every scheme. Only http(s) has a query and fragment, and
    /// only oci and hf read ':' or '@' as a tag or revision; elsewhere these
    /// name a sibling of the allowed directory, key prefix or file.
    #[test]
    fn a_prefix_continues_only_where_its_scheme_has_a_boundary() {
        let a = allowed(
            "file:///models, s3://models/llama, pvc://team-a:weights/bert, \
             https://cdn.example.com/m/model.bin, oci://registry.example.com/repo, hf://org/repo",
        );
        for bad in [
            "file:///models?x",
            "file:///models#x",
            "file:///models:old",
            "file:///models@x",
            "file:///models#/../../etc",
            "s3://models/llama@x/y",
            "s3://models/llama:x",
            "s3://models/llama?/../secret",
            "pvc://team-a:weights/bert@x",
            "pvc://team-a:weights?/bert",
            "https://cdn.example.com/m/model.bin:x",
            "https://cdn.example.com/m/model.bin@x",
            "oci://registry.example.com/repo?x",
            "hf://org/repo:x",
        ] {
            assert!(a.permits(bad).is_err(), "{bad} was permitted");
        }
        for ok in [
            "file:///models",
            "file:///models/bert",
            "s3://models/llama/7b",
            "pvc://team-a:weights/bert/onnx",
            "https://cdn.example.com/m/model.bin?sig=1",
            "https://cdn.example.com/m/model.bin#sha256=00",
            "oci://registry.example.com/repo:v1",
            "oci://registry.example.com/repo@sha256:00",
            "hf://org/repo@main",
        ] {
            assert_eq!(a.permits(ok), Ok(()), "{ok}");
        }
        assert!(AllowedSources::parse("s3://models?x").is_err());
        assert!(allowed("hf://").permits("hf://org?sig=2#x@evil").is_err());
    }

    /// Found by fuzz/fuzz_targets/allowed_sources.rs: a URI without "://"
    /// was refused with the whole URI, query included.
    #[test]
    fn a_malformed_uri_is_refused_without_its_query() {
        let e = allowed("hf://")
            .permits("https:/h/x?X-Amz-Signature=secret")
            .unwrap_err();
        assert!(!e.contains("secret"), "{e}");
        assert!(e.contains("https:/h/x"), "{e}");
    }
}
