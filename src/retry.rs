//! Work that may pass later, tried again: one backoff policy (exponential,
//! jittered, bounded in total) for every such retry in the crate, so
//! that no module grows a loop of its own.

use std::future::Future;
use std::time::Duration;

use backon::Retryable;

use crate::error::{Error, Result};

/// How a retry backs off: the first wait, doubled each time up to `max`,
/// each jittered to between half and all of itself (retries from many
/// nodes do not arrive in lockstep); no retry after `times` of them, nor
/// once `total` has been waited (None: no such bound).
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    pub total: Option<Duration>,
    pub times: Option<usize>,
}

impl Backoff {
    /// The waits, in order, for a loop that keeps its own state between
    /// tries (a range resumed where it stopped).
    pub fn delays(self) -> Delays {
        Delays {
            policy: self,
            tries: 0,
            waited: Duration::ZERO,
        }
    }
}

/// The waits of one `Backoff`, for one retried piece of work.
#[derive(Clone, Debug)]
pub struct Delays {
    policy: Backoff,
    tries: usize,
    waited: Duration,
}

impl Delays {
    /// The wait before the next try after `e`, or None when the policy is
    /// spent. A server's Retry-After takes the place of the policy's wait,
    /// up to ten minutes (a server may ask for hours).
    pub fn after(&mut self, e: &Error) -> Option<Duration> {
        let wait = self.next()?;
        Some(retry_after(e).unwrap_or(wait))
    }
}

impl Iterator for Delays {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let p = &self.policy;
        if p.times.is_some_and(|t| self.tries >= t) {
            return None;
        }
        let exp = p.first.saturating_mul(1u32 << self.tries.min(16));
        let wait = exp.min(p.max).mul_f64(0.5 + fastrand::f64() * 0.5);
        if p.total.is_some_and(|t| self.waited + wait > t) {
            return None;
        }
        self.tries += 1;
        self.waited += wait;
        Some(wait)
    }
}

/// The wait a server asked for, bounded.
fn retry_after(e: &Error) -> Option<Duration> {
    match e {
        Error::RetryAfter { after, .. } => Some((*after).min(Duration::from_secs(600))),
        _ => None,
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
    op.retry(backoff.delays())
        .when(|e| retryable(e))
        .adjust(|e, wait| wait.map(|w| retry_after(e).unwrap_or(w)))
        .notify(|e, wait| tracing::warn!(error = %e, retry_in = ?wait, "{what}; trying again"))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const QUICK: Backoff = Backoff {
        first: Duration::from_millis(1),
        max: Duration::from_millis(4),
        total: Some(Duration::from_millis(200)),
        times: None,
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

    #[test]
    fn the_waits_grow_are_jittered_and_end_where_the_policy_says() {
        let ms = Duration::from_millis;
        let p = Backoff {
            first: ms(100),
            max: ms(400),
            total: None,
            times: Some(5),
        };
        let waits: Vec<_> = p.delays().collect();
        assert_eq!(waits.len(), 5, "{waits:?}");
        for (w, full) in waits.iter().zip([100, 200, 400, 400, 400]) {
            assert!(*w >= ms(full / 2) && *w <= ms(full), "{waits:?}");
        }
        // A total bound ends the waits before it is passed.
        let total = Backoff {
            total: Some(ms(500)),
            times: None,
            ..p
        };
        let waited: Duration = total.delays().sum();
        assert!(waited <= ms(500) && waited >= ms(150), "{waited:?}");
        // A server's Retry-After replaces the wait, bounded to ten minutes.
        let mut d = p.delays();
        let asked = Error::RetryAfter {
            message: "busy".into(),
            after: Duration::from_secs(3),
        };
        assert_eq!(d.after(&asked), Some(Duration::from_secs(3)));
        let hours = Error::RetryAfter {
            message: "busy".into(),
            after: Duration::from_secs(7200),
        };
        assert_eq!(d.after(&hours), Some(Duration::from_secs(600)));
        assert!(d.after(&Error::Transient("x".into())).unwrap() <= ms(400));
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
