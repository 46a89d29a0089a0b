//! One pull per model: a call finds the seal, or leads the transfer, or
//! joins the one running; the requester proves its access at the origin
//! wherever it would otherwise be served bytes it never fetched.

use super::*;

impl Engine {
    /// The sealed model, or the transfer this call leads or joins, once
    /// the requester has proved its access where it must.
    pub(super) async fn hit_or_pull(
        &self,
        ask: &Ask<'_>,
        root: &Root,
        source: Arc<dyn Source>,
        sink: &dyn ProgressSink,
        listed: &Listed<'_>,
    ) -> Result<Pulled> {
        let (resolved, sid) = (listed.resolved, listed.sid);
        if let Some(hit) = self
            .hit(root, sid, source.as_ref(), resolved, ask.signature)
            .await?
        {
            sink.resolved(sid.as_str(), &resolved.uri, &resolved.revision);
            return Ok(hit);
        }
        // Whoever learns the model's id may be answered from the pull
        // that holds it (`jobs::Early`): a requester that will not
        // fetch every byte itself (another pull runs, or work an
        // earlier one left is resumed) proves its access first, and so
        // does every tenant, so that a refusal looks the same whether
        // the model is sealed, arriving or neither. Joining a pull that
        // presents the same credentials is pulling.
        let (lead, joins_own) = self.access.lead_or_join(sid.as_str(), source.as_ref(), || {
            self.inflight.try_lock(sid)
        });
        let own = lead.is_some() && !source.tenant_named() && {
            let (r, s) = (root.clone(), sid.clone());
            !blocking(move || Ok(cache::pull::left_over(&r, &s))).await?
        };
        if !own && !joins_own {
            self.access
                .admit(sid.as_str(), source.as_ref(), resolved, listed.outage)
                .await?;
        }
        sink.resolved(sid.as_str(), &resolved.uri, &resolved.revision);
        // The lead goes before the lock (declared after it), so the
        // next leader is never named while this one's name stands.
        let (_joined, _lead) = match lead {
            Some(held) => held,
            None => {
                let g = self.inflight.lock(sid).await;
                (g, self.access.lead(sid.as_str(), source.as_ref()))
            }
        };
        if let Some(hit) = self
            .hit(root, sid, source.as_ref(), resolved, ask.signature)
            .await?
        {
            return Ok(hit);
        }
        self.transfer(ask, root, source, sink, listed).await
    }
}
