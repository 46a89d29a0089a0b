//! `model-registry://model[/version]`: a model version registered in a
//! Kubeflow Model Registry, resolved to the URI of its model artifact
//! (s3://, https://, oci://, hf://...), which the puller then fetches with
//! that scheme's own source.
//!
//! Speaks the registry's REST API v1alpha3 (`api/openapi/model-registry.yaml`
//! in kubeflow/model-registry): find the registered model by name, its
//! version by name (or the newest live one), then the version's newest
//! model artifact. Never fetches bytes itself, and refuses an artifact that
//! points back at a model registry.
//!
//! Also accepts KServe's model-registry storage-initializer forms
//! `model-registry://<registry host>/model[/version]`, where the host must
//! be the configured registry's.

use reqwest::Client;
use serde::Deserialize;
use url::Url;

use super::SourceOptions;
use super::http;
use crate::error::{Error, Result};

pub const FORMS: &str = "model-registry://model[/version]";
/// StorageClass parameter with the registry's base URL; else env `MODEL_REGISTRY_URL`.
pub const URL_PARAM: &str = "modelRegistryURL";
/// Secret with a bearer token for the registry.
pub const TOKEN_SECRET: &str = "modelRegistryToken";
const API: [&str; 3] = ["api", "model_registry", "v1alpha3"];
const PAGE_SIZE: &str = "100";
/// List pages followed before giving up.
const MAX_PAGES: usize = 100;

/// A parsed `model-registry://` URI: one to three decoded path segments;
/// which is the host, model or version depends on the configured registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryUri {
    pub segments: Vec<String>,
}

/// Checks a `model-registry://` URI without touching the network.
pub fn parse(uri: &str) -> Result<RegistryUri, String> {
    let rest = uri
        .strip_prefix("model-registry://")
        .ok_or_else(|| format!("{uri:?} does not start with model-registry://"))?;
    if rest.contains(['?', '#']) {
        return Err(format!(
            "{uri:?}: no query or fragment; accepted form: {FORMS}"
        ));
    }
    let segments = rest
        .split('/')
        .map(http::percent_decode)
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| format!("{uri:?} is not valid percent-encoded UTF-8"))?;
    if segments.is_empty()
        || segments.len() > 3
        || segments
            .iter()
            .any(|s| s.is_empty() || s.chars().any(|c| !(' '..='~').contains(&c)))
    {
        return Err(format!(
            "{uri:?}: expected {FORMS} (names of printable ASCII, '/' as %2F)"
        ));
    }
    Ok(RegistryUri { segments })
}

/// The parts of a `RegisteredModel`, `ModelVersion` or `Artifact` we use.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entity {
    id: Option<String>,
    name: Option<String>,
    state: Option<String>,
    create_time_since_epoch: Option<String>,
    artifact_type: Option<String>,
    uri: Option<String>,
}

impl Entity {
    fn id_num(&self) -> u64 {
        self.id.as_deref().and_then(|i| i.parse().ok()).unwrap_or(0)
    }

    /// Newest first: creation time, then id (ids grow with creation).
    fn age_key(&self) -> (u64, u64) {
        let created = self
            .create_time_since_epoch
            .as_deref()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (created, self.id_num())
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EntityList {
    #[serde(default)]
    items: Vec<Entity>,
    next_page_token: Option<String>,
}

struct Registry {
    client: Client,
    base: Url,
    token: Option<String>,
}

impl Registry {
    fn url(&self, path: &[&str], query: &[(&str, &str)]) -> Url {
        let mut u = self.base.clone();
        if let Ok(mut p) = u.path_segments_mut() {
            p.pop_if_empty().extend(API).extend(path);
        }
        if !query.is_empty() {
            u.query_pairs_mut().extend_pairs(query);
        }
        u
    }

    fn denied_hint(&self) -> &'static str {
        if self.token.is_some() {
            "the modelRegistryToken secret was rejected"
        } else {
            "set the modelRegistryToken secret"
        }
    }

    async fn get<T: for<'de> Deserialize<'de>>(&self, url: &Url, what: &str) -> Result<T> {
        let (body, _) = http::get_document(
            &self.client,
            url,
            self.token.as_deref(),
            what,
            self.denied_hint(),
        )
        .await?;
        serde_json::from_slice(&body)
            .map_err(|e| Error::Transient(format!("{what}: unexpected answer: {e}")))
    }

    /// Every item of a paged list.
    async fn list(&self, path: &[&str], query: &[(&str, &str)], what: &str) -> Result<Vec<Entity>> {
        let mut items = Vec::new();
        let mut token = String::new();
        for _ in 0..MAX_PAGES {
            let mut q = query.to_vec();
            q.push(("pageSize", PAGE_SIZE));
            if !token.is_empty() {
                q.push(("nextPageToken", &token));
            }
            let page: EntityList = self.get(&self.url(path, &q), what).await?;
            let empty = page.items.is_empty();
            items.extend(page.items);
            match page.next_page_token {
                Some(t) if !t.is_empty() && !empty && t != token => token = t,
                _ => return Ok(items),
            }
        }
        Err(Error::Transient(format!(
            "{what}: more than {MAX_PAGES} pages"
        )))
    }
}

/// Resolves a `model-registry://` URI to its model artifact's URI, and the
/// registry's base URL that answered. The registry comes from
/// `opts.params["modelRegistryURL"]` (else env `MODEL_REGISTRY_URL`), its
/// token from `opts.secrets["modelRegistryToken"]`. The answer is whoever
/// registered the version's to choose: the caller bounds it.
pub async fn resolve_artifact_uri(uri: &str, opts: &SourceOptions) -> Result<(String, Url)> {
    let parsed = parse(uri).map_err(|m| Error::invalid("parameters.source", m))?;
    let base = opts
        .params
        .get(URL_PARAM)
        .cloned()
        .or_else(|| opts.env.get("MODEL_REGISTRY_URL").map(str::to_owned))
        .filter(|u| !u.trim().is_empty())
        .ok_or_else(|| {
            Error::invalid(
                format!("parameters.{URL_PARAM}"),
                "model-registry:// sources need the registry's URL, like \
                 http://model-registry-service.kubeflow.svc:8080 (or env MODEL_REGISTRY_URL)",
            )
        })?;
    let base = super::http::service_url(
        &base,
        URL_PARAM,
        "http://model-registry-service.kubeflow.svc:8080",
    )?;
    // host[:port] as KServe's storage initializer writes it in URIs.
    let authority = match (base.host_str(), base.port()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_string(),
        _ => String::new(),
    };
    let segs = &parsed.segments;
    let (model, version) = match segs.len() {
        1 => (&segs[0], None),
        2 if segs[0] == authority => (&segs[1], None),
        2 => (&segs[0], Some(&segs[1])),
        _ if segs[0] == authority => (&segs[1], Some(&segs[2])),
        _ => {
            return Err(Error::invalid(
                "parameters.source",
                format!(
                    "{uri:?} names registry {:?}, but {URL_PARAM} is {}; expected {FORMS}",
                    segs[0],
                    http::redact(&base)
                ),
            ));
        }
    };
    let token = opts
        .secrets
        .get(TOKEN_SECRET)
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let reg = Registry {
        client: http::client(opts)?,
        base: base.clone(),
        token,
    };

    let what = format!("registered model {model:?}");
    let found: Entity = reg
        .get(&reg.url(&["registered_model"], &[("name", model)]), &what)
        .await?;
    let model_id = found
        .id
        .filter(|_| found.name.as_deref() == Some(model.as_str()))
        .ok_or_else(|| Error::NotFound(format!("{what}: not in the model registry")))?;

    let versions_path = ["registered_models", model_id.as_str(), "versions"];
    let version = match version {
        Some(v) => {
            let what = format!("version {v:?} of model {model:?}");
            // Older registries ignore `name` here; the exact match below
            // holds either way.
            reg.list(&versions_path, &[("name", v)], &what)
                .await?
                .into_iter()
                .filter(|e| e.name.as_deref() == Some(v.as_str()))
                .max_by_key(Entity::id_num)
                .ok_or_else(|| Error::NotFound(format!("{what}: not in the model registry")))?
        }
        None => {
            let what = format!("versions of model {model:?}");
            reg.list(
                &versions_path,
                &[("orderBy", "ID"), ("sortOrder", "DESC")],
                &what,
            )
            .await?
            .into_iter()
            .filter(|e| e.state.as_deref() != Some("ARCHIVED"))
            .max_by_key(Entity::id_num)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "model {model:?} has no live version in the registry"
                ))
            })?
        }
    };
    let version_id = version.id.clone().unwrap_or_default();
    let version_name = version.name.clone().unwrap_or_default();

    let what = format!("artifacts of model {model:?} version {version_name:?}");
    let artifact = reg
        .list(
            &["model_versions", version_id.as_str(), "artifacts"],
            &[("artifactType", "model-artifact")],
            &what,
        )
        .await?
        .into_iter()
        .filter(|a| a.artifact_type.as_deref() == Some("model-artifact"))
        .filter(|a| a.uri.as_deref().is_some_and(|u| !u.trim().is_empty()))
        .filter(|a| {
            !matches!(
                a.state.as_deref(),
                Some("DELETED" | "MARKED_FOR_DELETION" | "ABANDONED")
            )
        })
        .max_by_key(Entity::age_key)
        .ok_or_else(|| Error::NotFound(format!("{what}: no model artifact with a URI")))?;
    let artifact_uri = artifact.uri.unwrap_or_default().trim().to_string();
    match artifact_uri.split_once("://") {
        Some(("model-registry", _)) => Err(Error::invalid(
            "parameters.source",
            format!(
                "{what}: the artifact points at another model-registry:// URI; refusing a loop"
            ),
        )),
        Some((scheme, _)) if !scheme.is_empty() => {
            tracing::info!(model = %model, version = %version_name, "resolved through the model registry");
            Ok((artifact_uri, base))
        }
        _ => Err(Error::Precondition(format!(
            "{what}: the model artifact's uri has no scheme://"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        assert_eq!(parse("model-registry://iris").unwrap().segments, ["iris"]);
        assert_eq!(
            parse("model-registry://my%20model/v1.0").unwrap().segments,
            ["my model", "v1.0"]
        );
        assert_eq!(
            parse("model-registry://h:8080/m/v").unwrap().segments.len(),
            3
        );
        for bad in [
            "model-registry://",
            "model-registry://a//b",
            "model-registry://a/b/c/d",
            "model-registry://a?x=1",
            "model-registry://a/%zz",
            "hf://a",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
