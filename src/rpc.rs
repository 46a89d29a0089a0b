//! What every gRPC handler does at its edge: require fields, read a capacity
//! range, log an error once inside the call's span, and turn it into a status.

use tonic::{Response, Status};

use crate::error::{Error, Result};

pub fn require<'a>(value: &'a str, field: &str) -> Result<&'a str> {
    if value.is_empty() {
        return Err(Error::invalid(field, "is required"));
    }
    Ok(value)
}

/// Runs a handler's work inside its span (which names the volume), and
/// answers with `respond` there, so a failure is logged once, with it.
pub async fn handle<T>(
    span: tracing::Span,
    work: impl std::future::Future<Output = Result<T>>,
) -> std::result::Result<Response<T>, Status> {
    use tracing::Instrument;
    async move { respond(work.await) }.instrument(span).await
}

pub fn respond<T>(result: Result<T>) -> std::result::Result<Response<T>, Status> {
    match result {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            match &e {
                Error::Io { .. } | Error::Internal(_) => tracing::error!(error = %e, "failed"),
                Error::Busy(_) => tracing::debug!(error = %e, "busy"),
                _ => tracing::warn!(error = %e, "refused"),
            }
            Err(e.into())
        }
    }
}

/// How long a handler may work before its caller gives up: the caller's
/// `grpc-timeout` less a margin for the answer to reach it, or None when
/// the caller set no deadline.
pub fn budget<T>(req: &tonic::Request<T>) -> Option<std::time::Duration> {
    let raw = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let timeout = parse_grpc_timeout(raw)?;
    // A second, or a tenth of a short deadline, to send the answer back.
    let margin = (timeout / 10).min(std::time::Duration::from_secs(1));
    Some(timeout.saturating_sub(margin))
}

/// `grpc-timeout`: at most 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(raw: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The size a capacity range asks a volume to grow to: at least
/// `required_bytes`, else `limit_bytes`.
pub fn grow_target(range: Option<&crate::csi::CapacityRange>) -> Result<i64> {
    let Some(r) = range else {
        return Err(Error::invalid(
            "capacity_range",
            "is required: the size to grow the volume to",
        ));
    };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Error::invalid(
            "capacity_range",
            "required_bytes and limit_bytes cannot be negative",
        ));
    }
    if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
        return Err(Error::Unsatisfiable(format!(
            "capacity_range.required_bytes {} is above its limit_bytes {}",
            r.required_bytes, r.limit_bytes
        )));
    }
    match (r.required_bytes, r.limit_bytes) {
        (0, 0) => Err(Error::invalid(
            "capacity_range",
            "names no size: set required_bytes to the size to grow to",
        )),
        (0, limit) => Ok(limit),
        (required, _) => Ok(required),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn grpc_timeouts() {
        assert_eq!(parse_grpc_timeout("10S"), Some(Duration::from_secs(10)));
        assert_eq!(
            parse_grpc_timeout("9999m"),
            Some(Duration::from_millis(9999))
        );
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        for bad in ["", "S", "10", "10x", "123456789S", "-1S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
        let mut req = tonic::Request::new(());
        assert_eq!(budget(&req), None);
        req.metadata_mut()
            .insert("grpc-timeout", "10S".parse().unwrap());
        assert_eq!(budget(&req), Some(Duration::from_secs(9)));
    }
}
