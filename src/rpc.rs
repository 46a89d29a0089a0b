//! What every gRPC handler does at its edge: require fields, log an error
//! once inside the call's span, and turn it into a status.

use tonic::{Response, Status};

use crate::error::{Error, Result};

pub fn require<'a>(value: &'a str, field: &str) -> Result<&'a str> {
    if value.is_empty() {
        return Err(Error::invalid(field, "is required"));
    }
    Ok(value)
}

pub fn respond<T>(result: Result<T>) -> std::result::Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            match &e {
                Error::Io { .. } | Error::Internal(_) => tracing::error!(error = %e, "failed"),
                Error::Aborted(_) => tracing::debug!(error = %e, "busy"),
                _ => tracing::warn!(error = %e, "refused"),
            }
            Err(e.into())
        }
    }
}
