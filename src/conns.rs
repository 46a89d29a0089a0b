//! Connections an unauthenticated listener (metrics and health, peers)
//! takes: a bound in all and a share per source address, so that one
//! client's idle or slow connections cannot hold every slot (kubelet's
//! probe among them), and a socket whose peer stops reading or writing is
//! closed after a bound instead of held for ever.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::lock::{Share, Shares};

/// How many connections a listener serves at once, in all and per source
/// address; a connection over its source's share waits for that source's
/// turn, never for another source's. Connections open at all (served or
/// waiting) are bounded too: beyond that a new one is closed at once.
pub struct Admission {
    shares: Shares<IpAddr>,
    open: Arc<Semaphore>,
}

/// One admitted connection, released when dropped.
pub struct Admitted {
    _share: Share<IpAddr>,
    _open: OwnedSemaphorePermit,
}

/// A connection accepted but not yet admitted: it counts against the
/// listener's open connections.
pub struct Opened(OwnedSemaphorePermit);

impl Admission {
    /// `all` served at once, `per_source` of them from one address, and
    /// `open` accepted in all (served or waiting for their turn).
    pub fn new(all: usize, per_source: usize, open: usize) -> Admission {
        Admission {
            shares: Shares::new(all, per_source),
            open: Arc::new(Semaphore::new(open.max(all).max(1))),
        }
    }

    /// Room for one more open connection, or None: close it at once.
    pub fn open(&self) -> Option<Opened> {
        self.open.clone().try_acquire_owned().ok().map(Opened)
    }

    /// Waits for `from`'s turn (its share of slots), then for a slot.
    pub async fn admit(&self, opened: Opened, from: IpAddr) -> Admitted {
        Admitted {
            _share: self.shares.acquire(from).await,
            _open: opened.0,
        }
    }
}

/// A socket whose reads or writes fail with `TimedOut` once they have
/// waited `stall` without moving a byte: a peer that stopped reading an
/// answer, or sends a request a byte a minute, lets its slot go.
pub struct Stalls<S> {
    inner: S,
    stall: Duration,
    read_since: Option<Pin<Box<tokio::time::Sleep>>>,
    write_since: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Stalls<S> {
    pub fn new(inner: S, stall: Duration) -> Stalls<S> {
        Stalls {
            inner,
            stall,
            read_since: None,
            write_since: None,
        }
    }
}

/// `Pending` from `inner`: start (or check) the stall clock; past it, an
/// error. Anything else stops the clock.
fn watch<T>(
    polled: Poll<io::Result<T>>,
    clock: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    stall: Duration,
    cx: &mut Context<'_>,
) -> Poll<io::Result<T>> {
    if !polled.is_pending() {
        *clock = None;
        return polled;
    }
    let sleep = clock.get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
    match sleep.as_mut().poll(cx) {
        Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no byte moved for {stall:?}"),
        ))),
        Poll::Pending => Poll::Pending,
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Stalls<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        let polled = Pin::new(&mut me.inner).poll_read(cx, buf);
        watch(polled, &mut me.read_since, me.stall, cx)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Stalls<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        let polled = Pin::new(&mut me.inner).poll_write(cx, buf);
        watch(polled, &mut me.write_since, me.stall, cx)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = &mut *self;
        let polled = Pin::new(&mut me.inner).poll_flush(cx);
        watch(polled, &mut me.write_since, me.stall, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A source over its share waits for its own turn; another source
    /// gets in meanwhile; open connections are bounded.
    #[tokio::test]
    async fn a_source_holds_its_share_and_others_still_get_in() {
        let a = Arc::new(Admission::new(4, 2, 6));
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        let two: IpAddr = "10.0.0.2".parse().unwrap();
        let x = a.admit(a.open().unwrap(), one).await;
        let y = a.admit(a.open().unwrap(), one).await;
        let third = {
            let (a, opened) = (a.clone(), a.open().unwrap());
            tokio::spawn(async move { drop(a.admit(opened, one).await) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !third.is_finished(),
            "a third from one source got in beside two"
        );
        let z = a.admit(a.open().unwrap(), two).await;
        drop(x);
        third.await.expect("its turn came");
        // Six open at most: y and z, and four more.
        let more: Vec<Opened> = std::iter::from_fn(|| a.open()).collect();
        assert_eq!(more.len(), 4, "open connections beyond the bound");
        drop((y, z, more));
        assert_eq!(a.shares.keys(), 0);
    }

    #[tokio::test]
    async fn a_stalled_reader_or_writer_is_cut_off() {
        let (client, server) = tokio::io::duplex(64);
        let mut server = Stalls::new(server, Duration::from_millis(100));
        // Nobody writes: the read fails after the stall.
        let mut buf = [0u8; 8];
        let e = server.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // Nobody reads: the writes fill the pipe, then fail.
        let big = vec![0u8; 1024];
        let e = loop {
            if let Err(e) = server.write_all(&big).await {
                break e;
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(client);
    }
}
