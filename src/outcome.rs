//! One outcome, many waiters: the result of work that outlives the calls
//! waiting for it (a pull job, a full rehash), each waiter bounded by its
//! own deadline. It never runs the work and never holds a lock.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::error::Error;

/// What the work sends once: None while it runs.
pub type Outcome<T> = Option<Result<T, Arc<Error>>>;

/// Waits for `done` at most `wait` (forever when None). None: the deadline
/// came first and the work goes on. `what` names the work if it ended
/// without sending an outcome.
pub async fn wait<T: Clone>(
    done: &watch::Receiver<Outcome<T>>,
    what: &str,
    wait: Option<Duration>,
) -> Option<Result<T, Error>> {
    let mut done = done.clone();
    let finished = async {
        loop {
            if let Some(outcome) = done.borrow_and_update().clone() {
                return outcome;
            }
            if done.changed().await.is_err() {
                return Err(Arc::new(Error::Internal(format!(
                    "{what} ended without an outcome"
                ))));
            }
        }
    };
    let outcome = match wait {
        None => finished.await,
        Some(w) => tokio::time::timeout(w, finished).await.ok()?,
    };
    Some(outcome.map_err(|e| e.replay()))
}
