//! Model URIs as plain values: how one is shown without its secrets, and
//! the `pvc://` form. A leaf, so the puller and the Kubernetes client can
//! both use them without depending on each other.

/// A model URI as it may be shown (events, logs): no query, which may hold
/// a signature, and no user info; the fragment (`#manifest`) stays.
pub fn display_uri(uri: &str) -> String {
    match url::Url::parse(uri) {
        Ok(mut u) if u.query().is_some() || !u.username().is_empty() || u.password().is_some() => {
            u.set_query(None);
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        _ => uri.to_string(),
    }
}

/// `pvc://[namespace:]claim[/path]`: a claim (in the requesting PVC's
/// namespace unless one is given) and a directory inside its volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PvcUri {
    pub namespace: Option<String>,
    pub claim: String,
    pub path: Option<String>,
}

pub const PVC_FORM: &str = "pvc://claim[/path] or pvc://namespace:claim[/path]";

pub fn parse_pvc_uri(uri: &str) -> Result<PvcUri, String> {
    let rest = uri
        .strip_prefix("pvc://")
        .ok_or_else(|| format!("{uri:?} is not {PVC_FORM}"))?;
    let (claim_part, path) = match rest.split_once('/') {
        Some((c, p)) if !p.trim_matches('/').is_empty() => {
            (c, Some(p.trim_matches('/').to_string()))
        }
        Some((c, _)) => (c, None),
        None => (rest, None),
    };
    let (namespace, claim) = match claim_part.split_once(':') {
        Some((ns, c)) => (Some(ns.to_string()), c.to_string()),
        None => (None, claim_part.to_string()),
    };
    let dns = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !dns(&claim) || namespace.as_deref().is_some_and(|n| !dns(n)) {
        return Err(format!("{uri:?} does not name a claim; use {PVC_FORM}"));
    }
    if let Some(p) = &path {
        crate::mount::subpath::validate_syntax(p).map_err(|m| format!("{uri:?}: the path {m}"))?;
    }
    Ok(PvcUri {
        namespace,
        claim,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvc_uris() {
        assert_eq!(
            parse_pvc_uri("pvc://models/minilm/v1").unwrap(),
            PvcUri {
                namespace: None,
                claim: "models".into(),
                path: Some("minilm/v1".into())
            }
        );
        assert_eq!(
            parse_pvc_uri("pvc://team-a:models").unwrap(),
            PvcUri {
                namespace: Some("team-a".into()),
                claim: "models".into(),
                path: None
            }
        );
        for bad in [
            "pvc://",
            "pvc://Models",
            "pvc://a/../etc",
            "pvc://a:/x",
            "s3://x",
        ] {
            assert!(parse_pvc_uri(bad).is_err(), "{bad}");
        }
    }
}
