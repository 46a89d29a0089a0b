//! Connections an unauthenticated listener (metrics and health, peers)
//! takes: a bound in all and a share per source address, so that one
//! client's idle or slow connections cannot hold every slot (kubelet's
//! probe among them), and a socket whose peer stops reading or writing is
//! closed after a bound instead of held for ever.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::lock::{Share, Shares};

/// How many connections a listener serves at once, in all and per source
/// address; a connection over its source's share waits for that source's
/// turn, never for another source's, and at most `wait` before it is
/// closed. Connections open at all (served or waiting) are bounded too,
/// in all and per source (sixteen shares): beyond that a new one is
/// closed at once, so one address cannot fill the listener's room either.
pub struct Admission {
    shares: Shares<IpAddr>,
    open: Arc<Semaphore>,
    open_per_source: usize,
    opened: Arc<Mutex<HashMap<IpAddr, usize>>>,
    wait: Duration,
}

/// One admitted connection, released when dropped.
pub struct Admitted {
    _share: Share<IpAddr>,
    _open: Opened,
}

/// A connection accepted but not yet admitted: it counts against the
/// listener's open connections, in all and for its source.
pub struct Opened {
    _slot: OwnedSemaphorePermit,
    opened: Arc<Mutex<HashMap<IpAddr, usize>>>,
    from: IpAddr,
}

impl Drop for Opened {
    fn drop(&mut self) {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = opened.get_mut(&self.from) {
            *n -= 1;
            if *n == 0 {
                opened.remove(&self.from);
            }
        }
    }
}

impl Admission {
    /// `all` served at once, `per_source` of them from one address, and
    /// `open` accepted in all (served or waiting for their turn, at most
    /// `wait`).
    pub fn new(all: usize, per_source: usize, open: usize, wait: Duration) -> Admission {
        let per_source = per_source.max(1);
        Admission {
            shares: Shares::new(all, per_source),
            open: Arc::new(Semaphore::new(open.max(all).max(1))),
            open_per_source: per_source * 16,
            opened: Arc::default(),
            wait,
        }
    }

    /// Room for one more open connection from `from`, or None: close it
    /// at once.
    pub fn open(&self, from: IpAddr) -> Option<Opened> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        let n = opened.entry(from).or_default();
        if *n >= self.open_per_source {
            if *n == 0 {
                opened.remove(&from);
            }
            return None;
        }
        let slot = self.open.clone().try_acquire_owned().ok()?;
        *n += 1;
        Some(Opened {
            _slot: slot,
            opened: self.opened.clone(),
            from,
        })
    }

    /// Waits for the source's turn (its share of slots), then for a slot;
    /// None when that took longer than the listener's wait.
    pub async fn admit(&self, opened: Opened) -> Option<Admitted> {
        let share = tokio::time::timeout(self.wait, self.shares.acquire(opened.from))
            .await
            .ok()?;
        Some(Admitted {
            _share: share,
            _open: opened,
        })
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

    /// A source over its share waits for its own turn, and is closed past
    /// the wait; another source gets in meanwhile; open connections are
    /// bounded in all and per source.
    #[tokio::test]
    async fn a_source_holds_its_share_and_others_still_get_in() {
        let a = Arc::new(Admission::new(4, 2, 12, Duration::from_millis(300)));
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        let two: IpAddr = "10.0.0.2".parse().unwrap();
        let x = a.admit(a.open(one).unwrap()).await.unwrap();
        let y = a.admit(a.open(one).unwrap()).await.unwrap();
        let third = {
            let (a, opened) = (a.clone(), a.open(one).unwrap());
            tokio::spawn(async move { a.admit(opened).await.is_some() })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !third.is_finished(),
            "a third from one source got in beside two"
        );
        let z = a.admit(a.open(two).unwrap()).await.unwrap();
        assert!(
            !third.await.unwrap(),
            "it waited past the bound and was let in"
        );
        drop(x);
        let w = a
            .admit(a.open(one).unwrap())
            .await
            .expect("a freed share is taken again");
        // Twelve open in all at most: y, z and w, and nine more; and one
        // source no more than sixteen shares (32) either.
        let more: Vec<Opened> = std::iter::from_fn(|| a.open(one)).collect();
        assert_eq!(more.len(), 9, "open beyond the bound");
        let b = Admission::new(4, 2, 100, Duration::from_secs(1));
        let one_source: Vec<Opened> = std::iter::from_fn(|| b.open(one)).collect();
        assert_eq!(
            one_source.len(),
            32,
            "open from one source beyond its bound"
        );
        assert!(b.open(two).is_some(), "another source still opens");
        drop((y, z, w, more, one_source));
        assert_eq!(a.shares.keys(), 0);
        assert!(a.opened.lock().unwrap().is_empty());
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
