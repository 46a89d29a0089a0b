//! Work that may pass later, tried again: one backoff policy (exponential,
//! jittered, bounded in total) for every such retry in the crate, so
//! that no module grows a loop of its own.

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use crate::error::{Error, Result};

/// How a retry backs off: the first wait, doubled each time up to `max`,
/// each jittered, and no retry once `total` has been waited.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    pub total: Duration,
}

impl Backoff {
    fn builder(self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.first)
            .with_max_delay(self.max)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(usize::MAX)
            .with_total_delay(Some(self.total))
    }
}

/// Whether an error may pass by itself: an origin, peer or API that did
/// not answer, or something not there yet.
pub fn transient(e: &Error) -> bool {
    matches!(e, Error::Transient(_) | Error::RetryAfter { .. })
}

/// Runs `op` until it succeeds, fails for a reason `retryable` says will
/// not pass, or `backoff` is spent; each retry is logged with `what`.
pub async fn retry<T, F, Fut>(
    what: &str,
    backoff: Backoff,
    retryable: impl Fn(&Error) -> bool,
    op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    op.retry(backoff.builder())
        .when(|e| retryable(e))
        .notify(|e, wait| tracing::info!(error = %e, retry_in = ?wait, "{what}: trying again"))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const QUICK: Backoff = Backoff {
        first: Duration::from_millis(1),
        max: Duration::from_millis(4),
        total: Duration::from_millis(200),
    };

    #[tokio::test]
    async fn transient_failures_are_tried_again_and_others_are_not() {
        let tries = AtomicUsize::new(0);
        let got = retry("test", QUICK, transient, || async {
            match tries.fetch_add(1, Ordering::SeqCst) {
                0..=2 => Err(Error::Transient("not yet".into())),
                n => Ok(n),
            }
        })
        .await
        .unwrap();
        assert_eq!(got, 3);
        let tries = AtomicUsize::new(0);
        let e = retry("test", QUICK, transient, || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(Error::NotFound("gone".into()))
        })
        .await
        .unwrap_err();
        assert!(matches!(e, Error::NotFound(_)));
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_retry_gives_up_once_its_total_wait_is_spent() {
        let start = std::time::Instant::now();
        let e = retry("test", QUICK, transient, || async {
            Err::<(), _>(Error::Transient("never".into()))
        })
        .await
        .unwrap_err();
        assert!(matches!(e, Error::Transient(_)));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
}
