//! What a model's server did when a request failed, in the sources' own
//! terms, and the one place it becomes the driver's `Error`.
//!
//! Every scheme (HTTP, the Hub, S3, OCI registries) classifies its
//! library's errors into `Failure`; the engine's retry policy and the
//! caller's gRPC code then follow from `Error` alone.

use std::time::Duration;

use crate::error::Error;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The server says the model, revision or file is not there.
    #[error("{0}")]
    NotFound(String),
    /// Our credentials were refused or lack permission; the message names
    /// the Secret to set or fix.
    #[error("{0}")]
    Denied(String),
    /// Worth retrying: no answer, a reset, a timeout, a 5xx, rate
    /// limiting; `after` when the server said when to come back.
    #[error("{message}")]
    Transient {
        message: String,
        after: Option<Duration>,
    },
    /// The server served what no valid model can be: content that does not
    /// match its digest, an answer its protocol does not allow.
    #[error("{0}")]
    Corrupt(String),
    /// Refused in a way only a change on our side fixes: the file changed
    /// since the model was resolved, another region, an unexpected status
    /// (the message names the parameter to check).
    #[error("{0}")]
    Refused(String),
    /// A network the trust policy keeps pulls away from.
    #[error("{0}")]
    Forbidden(String),
}

impl Failure {
    pub fn transient(message: impl Into<String>) -> Failure {
        Failure::Transient {
            message: message.into(),
            after: None,
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Error {
        match f {
            Failure::NotFound(m) => Error::NotFound(m),
            Failure::Denied(m) | Failure::Refused(m) => Error::Precondition(m),
            Failure::Transient {
                message,
                after: Some(after),
            } => Error::RetryAfter { message, after },
            Failure::Transient { message, .. } => Error::Transient(message),
            Failure::Corrupt(m) => Error::SourceFault(m),
            Failure::Forbidden(m) => Error::NotAllowed(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_becomes_the_error_its_handling_needs() {
        let cases = [
            (Failure::NotFound("n".into()), "NotFound"),
            (Failure::Denied("d".into()), "Precondition"),
            (Failure::Refused("r".into()), "Precondition"),
            (Failure::transient("t"), "Transient"),
            (
                Failure::Transient {
                    message: "busy".into(),
                    after: Some(Duration::from_secs(7)),
                },
                "RetryAfter",
            ),
            (Failure::Corrupt("c".into()), "SourceFault"),
            (Failure::Forbidden("f".into()), "NotAllowed"),
        ];
        for (f, want) in cases {
            let e = Error::from(f.clone());
            let got = format!("{e:?}");
            assert!(got.starts_with(want), "{f:?} became {got}");
        }
    }
}
