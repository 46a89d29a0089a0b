//! A class's signature policy where a pull meets it: a listing that
//! cannot pass is refused before any fetch, a sealed model is judged
//! again for each class that asks for it (a hit, or a tenant's sealed
//! source), and a fetched tree before its seal (`Engine::vouch`).

use super::*;

/// The policy's verdict on a fetched tree before its seal, taken off the
/// runtime with the tree.
pub(super) struct Vouch {
    policy: Option<Arc<Policy>>,
    sigstore: Arc<crate::signing::SigstoreRoot>,
}

impl Vouch {
    /// Who signed the tree at `data`, None when the policy lets an
    /// unsigned one through or there is no policy.
    pub(super) fn tree(&self, tree: &cache::manifest::Tree, data: &Path) -> Result<Option<String>> {
        match &self.policy {
            Some(p) => p.check_dir(&self.sigstore, &tree.files, &tree.symlinks, data),
            None => Ok(None),
        }
    }
}

impl Engine {
    pub(super) fn vouch(&self, policy: Option<&Arc<Policy>>) -> Vouch {
        Vouch {
            policy: policy.cloned(),
            sigstore: self.sigstore.clone(),
        }
    }

    /// The sealed model, if it is, for a requester the origin would serve
    /// (`Access::prove`) and the class's policy admits.
    pub(super) async fn hit(
        &self,
        root: &Root,
        sid: &SourceId,
        source: &dyn Source,
        resolved: &Resolved,
        signature: Option<&Arc<Policy>>,
    ) -> Result<Option<Pulled>> {
        let Some(seal) = sealed(root, sid).await? else {
            return Ok(None);
        };
        self.access.prove(sid.as_str(), source, resolved).await?;
        let signed = self.vouch_sealed(root, sid, &seal, signature).await?;
        Ok(Some(Pulled {
            sid: sid.clone(),
            seal,
            hit: true,
            signed,
        }))
    }

    /// A sealed model judged by the asking class's policy: its signature
    /// file is read from the seal, never fetched again with the weights.
    /// Without a policy, what the seal recorded.
    pub async fn vouch_sealed(
        &self,
        root: &Root,
        sid: &SourceId,
        seal: &Seal,
        policy: Option<&Arc<Policy>>,
    ) -> Result<Option<String>> {
        let Some(policy) = policy.cloned() else {
            return Ok(seal.signed_by.clone());
        };
        // No signature in the seal: nothing to read, so no view (an XFS
        // image would be mounted for it) is opened.
        if !seal.files.iter().any(|f| f.path == policy.file) {
            return policy.check_dir(&self.sigstore, &seal.files, &seal.symlinks, Path::new(""));
        }
        let (r, s, seal) = (root.clone(), sid.clone(), seal.clone());
        let sigstore = self.sigstore.clone();
        blocking(move || {
            let mut verdict = None;
            r.backend.store().view_sealed(&r, &s, &mut |data| {
                verdict = Some(policy.check_dir(&sigstore, &seal.files, &seal.symlinks, data));
            })?;
            verdict
                .unwrap_or_else(|| Err(Error::Internal("the sealed view was never opened".into())))
        })
        .await
    }
}

/// A listing that cannot pass a required signature policy: no signature
/// file among plain files (layers may still unpack one), refused before
/// a byte is fetched.
pub(super) fn unsigned_listing(
    sigstore: &crate::signing::SigstoreRoot,
    policy: &Policy,
    resolved: &Resolved,
) -> Result<()> {
    let layered = resolved
        .files
        .iter()
        .any(|f| !matches!(f.unpack, Unpack::None));
    if policy.mode != crate::signing::Mode::Required
        || layered
        || resolved.files.iter().any(|f| f.path == policy.file)
    {
        return Ok(());
    }
    policy
        .check(sigstore, None, &Default::default(), &[])
        .map(drop)
}
