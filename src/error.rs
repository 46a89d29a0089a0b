//! The driver's one domain error and its one mapping to gRPC status codes.
//!
//! Domain code returns `Error`; only `From<Error> for tonic::Status` below
//! decides which code a caller sees. Messages name what was wrong and how to
//! fix it, and never carry credentials.

use std::io;
use std::path::Path;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is missing or malformed.
    #[error("{field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("{0}")]
    NotFound(String),
    /// Same name, incompatible arguments; or a path already used differently.
    #[error("{0}")]
    AlreadyExists(String),
    /// Another operation on the same volume is in progress.
    #[error("{0}")]
    Aborted(String),
    /// The caller skipped a step, or the object is not in a state that allows the call.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The caller may not have this: a source outside what the StorageClass
    /// allows, a network the pull may not reach.
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    ResourceExhausted(String),
    /// The remote end served something no valid model can be: a listing
    /// that names one file twice or a file inside a file, sizes that
    /// overflow, a body longer than asked, an answer too large to read.
    /// Not retryable: the same server will serve the same thing again.
    #[error("the source served an invalid model: {0}")]
    SourceFault(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Unavailable(String),
    /// Unavailable, and the server said when to come back (Retry-After).
    #[error("{message} (retry after {after:?})")]
    RetryAfter {
        message: String,
        after: std::time::Duration,
    },
    #[error("{0}")]
    Unimplemented(String),
    /// An unexpected OS error, with what we were doing and on which path.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same error again, for every caller that waited on one shared
    /// operation (an `io::Error` is not `Clone`; its kind and text are kept).
    pub fn replay(&self) -> Error {
        match self {
            Error::InvalidArgument { field, message } => Error::InvalidArgument {
                field: field.clone(),
                message: message.clone(),
            },
            Error::NotFound(m) => Error::NotFound(m.clone()),
            Error::AlreadyExists(m) => Error::AlreadyExists(m.clone()),
            Error::Aborted(m) => Error::Aborted(m.clone()),
            Error::FailedPrecondition(m) => Error::FailedPrecondition(m.clone()),
            Error::PermissionDenied(m) => Error::PermissionDenied(m.clone()),
            Error::ResourceExhausted(m) => Error::ResourceExhausted(m.clone()),
            Error::SourceFault(m) => Error::SourceFault(m.clone()),
            Error::OutOfRange(m) => Error::OutOfRange(m.clone()),
            Error::Unavailable(m) => Error::Unavailable(m.clone()),
            Error::RetryAfter { message, after } => Error::RetryAfter {
                message: message.clone(),
                after: *after,
            },
            Error::Unimplemented(m) => Error::Unimplemented(m.clone()),
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::Internal(m) => Error::Internal(m.clone()),
        }
    }

    /// A full filesystem (or quota), as opposed to any other failure.
    pub fn is_no_space(&self) -> bool {
        matches!(self, Error::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }

    /// Wraps an OS error with the operation and the path it concerned.
    pub fn io(what: &str, path: &Path, source: io::Error) -> Self {
        Error::Io {
            context: format!("{what} {}", path.display()),
            source,
        }
    }
}

/// Attaches "what, on which path" to io results.
pub trait IoContext<T> {
    fn ctx(self, what: &str, path: &Path) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, what: &str, path: &Path) -> Result<T> {
        self.map_err(|e| Error::io(what, path, e))
    }
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        use tonic::Code;
        let code = match &err {
            Error::InvalidArgument { .. } => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::Aborted(_) => Code::Aborted,
            // The model as served cannot be pulled until its server is
            // fixed: a precondition of the request, not a bug of ours.
            Error::FailedPrecondition(_) | Error::SourceFault(_) => Code::FailedPrecondition,
            Error::PermissionDenied(_) => Code::PermissionDenied,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::OutOfRange(_) => Code::OutOfRange,
            Error::Unavailable(_) | Error::RetryAfter { .. } => Code::Unavailable,
            Error::Unimplemented(_) => Code::Unimplemented,
            // A full disk is a capacity problem the CO can act on, not a bug.
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
                Code::ResourceExhausted
            }
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::EROFS) => {
                Code::FailedPrecondition
            }
            Error::Io { .. } | Error::Internal(_) => Code::Internal,
        };
        tonic::Status::new(code, err.to_string())
    }
}
