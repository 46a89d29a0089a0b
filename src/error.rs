//! The driver's one domain error and its one mapping to gRPC status codes.
//!
//! Domain code returns `Error`; only `From<Error> for tonic::Status` below
//! decides which code a caller sees. Messages name what was wrong and how to
//! fix it, and never carry credentials.

use std::io;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in the driver's terms. Each variant says what happened;
/// which gRPC code a caller sees is decided once, in `From<Error> for
/// tonic::Status` below.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is missing or malformed.
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// The named volume, source, file or object does not exist.
    #[error("{0}")]
    NotFound(String),
    /// Same name, incompatible arguments; or a path already used differently.
    #[error("{0}")]
    Conflict(String),
    /// Another operation on the same volume is in progress.
    #[error("{0}")]
    Busy(String),
    /// Something the call needs does not hold: a step skipped (not staged,
    /// not sealed), a setting or tool missing, credentials refused, a record
    /// or seal that fails its check.
    #[error("{0}")]
    Precondition(String),
    /// The caller may not have this: a source outside what the StorageClass
    /// allows, a network the pull may not reach.
    #[error("{0}")]
    NotAllowed(String),
    /// Over a limit: the space a root has, a model's bytes or files, what a
    /// layer may unpack to.
    #[error("{0}")]
    OverLimit(String),
    /// The remote end served something no valid model can be: a listing
    /// that names one file twice or a file inside a file, sizes that
    /// overflow, a body longer than asked, an answer too large to read.
    /// Not retryable: the same server will serve the same thing again.
    #[error("the source served an invalid model: {0}")]
    SourceFault(String),
    /// The request's ranges cannot be met together: a capacity range below
    /// what the content needs, a topology no root can serve.
    #[error("{0}")]
    Unsatisfiable(String),
    /// Worth trying again: a server or a peer did not answer, a pull or a
    /// rehash is still running.
    #[error("{0}")]
    Transient(String),
    /// Transient, and the server said when to come back (Retry-After).
    #[error("{message} (retry after {after:?})")]
    RetryAfter {
        message: String,
        after: std::time::Duration,
    },
    /// A feature this driver does not offer (or not in this mode).
    #[error("{0}")]
    Unsupported(String),
    /// No volume of this driver has this id (a request's `volume_id`, or a
    /// content source's).
    #[error("volume {id} does not exist")]
    NoVolume { id: String },
    /// The model a volume was about to read was evicted from the cache in
    /// between; pulling it again brings it back.
    #[error("model {source_id} was evicted while this volume was being created; retry")]
    Evicted { source_id: String },
    /// An unexpected OS error, with what we were doing and on which path.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A broken invariant of ours, or a task that died.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same error again, for every caller that waited on one shared
    /// operation (an `io::Error` is not `Clone`; its kind and text are kept).
    pub fn replay(&self) -> Error {
        match self {
            Error::Invalid { field, message } => Error::Invalid {
                field: field.clone(),
                message: message.clone(),
            },
            Error::NotFound(m) => Error::NotFound(m.clone()),
            Error::Conflict(m) => Error::Conflict(m.clone()),
            Error::Busy(m) => Error::Busy(m.clone()),
            Error::Precondition(m) => Error::Precondition(m.clone()),
            Error::NotAllowed(m) => Error::NotAllowed(m.clone()),
            Error::OverLimit(m) => Error::OverLimit(m.clone()),
            Error::SourceFault(m) => Error::SourceFault(m.clone()),
            Error::Unsatisfiable(m) => Error::Unsatisfiable(m.clone()),
            Error::Transient(m) => Error::Transient(m.clone()),
            Error::RetryAfter { message, after } => Error::RetryAfter {
                message: message.clone(),
                after: *after,
            },
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::NoVolume { id } => Error::NoVolume { id: id.clone() },
            Error::Evicted { source_id } => Error::Evicted {
                source_id: source_id.clone(),
            },
            Error::Io { op, path, source } => Error::Io {
                op: op.clone(),
                path: path.clone(),
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
            op: what.to_string(),
            path: path.to_path_buf(),
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
            Error::Invalid { .. } => Code::InvalidArgument,
            Error::NotFound(_) | Error::NoVolume { .. } => Code::NotFound,
            Error::Conflict(_) => Code::AlreadyExists,
            Error::Busy(_) => Code::Aborted,
            // The model as served cannot be pulled until its server is
            // fixed: a precondition of the request, not a bug of ours.
            Error::Precondition(_) | Error::SourceFault(_) => Code::FailedPrecondition,
            Error::NotAllowed(_) => Code::PermissionDenied,
            Error::OverLimit(_) => Code::ResourceExhausted,
            Error::Unsatisfiable(_) => Code::OutOfRange,
            Error::Transient(_) | Error::RetryAfter { .. } | Error::Evicted { .. } => {
                Code::Unavailable
            }
            Error::Unsupported(_) => Code::Unimplemented,
            // A full disk is a capacity problem the CO can act on, not a bug.
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
                Code::ResourceExhausted
            }
            Error::Io { source, .. } if source.raw_os_error() == Some(libc::EROFS) => {
                Code::FailedPrecondition
            }
            // A network filesystem's server away or a name replaced under
            // this client: the same call succeeds once it is back.
            Error::Io { source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOTCONN | libc::ESTALE | libc::ETIMEDOUT | libc::EHOSTUNREACH)
                ) =>
            {
                Code::Unavailable
            }
            Error::Io { .. } | Error::Internal(_) => Code::Internal,
        };
        tonic::Status::new(code, err.to_string())
    }
}
