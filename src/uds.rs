//! The Unix sockets our gRPC servers listen on (the CSI endpoint and
//! kubelet's registration socket): binding them, and a shim in front of h2
//! so that every gRPC client is answered, whatever `:authority` it sends.
//!
//! A Unix socket has no host, so clients make one up. grpc-go with a bare
//! path as the target (kubelet's plugin watcher) sends the socket path;
//! gRPC C-core (Python grpcio, C++) sends the path percent-encoded, e.g.
//! `tmp%2Fcsi.sock`. h2, under tonic, rejects both as malformed and resets
//! every stream with PROTOCOL_ERROR (kubernetes/kubernetes#108254).
//!
//! The shim sits between the socket and the gRPC server. It re-encodes
//! each request header block, putting `:authority: localhost` in place of a
//! value that is not a valid authority, which is what grpc-go itself sends
//! for `unix://` targets. Every other frame, and the whole server-to-client
//! direction, passes through byte for byte; message bodies are never
//! looked at. A header block it cannot decode ends the connection.

use std::io;
use std::path::{Path, PathBuf};

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const PREFACE_LEN: usize = 24;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// SETTINGS_MAX_FRAME_SIZE's initial value, which our h2 server keeps: a
/// client may send no larger frame, so one is refused before anything is
/// allocated for it.
const MAX_FRAME: usize = 16_384;
/// No client sends a request header block larger than this.
const MAX_BLOCK: usize = 64 << 10;
/// The decoded header list's size (RFC 7541: name + value + 32 a field),
/// bounded as h2 bounds it: a block of one-byte references to a 4 KiB
/// table entry would otherwise decode to gigabytes.
const MAX_HEADER_LIST: usize = 64 << 10;
/// SETTINGS_HEADER_TABLE_SIZE's initial value, which our server keeps: a
/// dynamic table size update above it is a protocol error.
const MAX_TABLE: usize = 4096;

/// Binds a Unix socket, replacing one a killed predecessor left, and
/// renames it into place at once. The path appears only once the socket
/// listens, so a client that dials the moment the file appears is never
/// refused.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    bind_hidden(path)?.publish()
}

/// A listening socket that clients cannot find yet: bound under a hidden
/// name (kubelet's plugin watcher skips dot files) until [`Bound::publish`]
/// renames it to its path. A server publishes once it answers: gRPC
/// clients (the CSI sidecars among them) give up on a socket that accepts
/// and then does not speak for a second.
pub struct Bound {
    listener: UnixListener,
    /// The hidden name and the path; none for a socket already in place.
    rename: Option<(PathBuf, PathBuf)>,
    published: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Binds `path`'s socket under a hidden name in its directory.
pub fn bind_hidden(path: &Path) -> anyhow::Result<Bound> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let hidden = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    match std::fs::remove_file(&hidden) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let listener = UnixListener::bind(&hidden)?;
    Ok(Bound {
        listener,
        rename: Some((hidden, path.to_path_buf())),
        published: None,
    })
}

impl Bound {
    /// A socket its clients can already reach (bound by the caller).
    pub fn visible(listener: UnixListener) -> Bound {
        Bound {
            listener,
            rename: None,
            published: None,
        }
    }

    /// `tx` is sent to once the socket is in place.
    pub fn on_publish(mut self, tx: tokio::sync::oneshot::Sender<()>) -> Bound {
        self.published = Some(tx);
        self
    }

    /// Renames the socket into place, over whatever a killed predecessor
    /// left.
    pub fn publish(self) -> anyhow::Result<UnixListener> {
        if let Some((hidden, path)) = &self.rename
            && let Err(e) = std::fs::rename(hidden, path)
        {
            let _ = std::fs::remove_file(hidden);
            return Err(anyhow::anyhow!(
                "rename {} to {}: {e}",
                hidden.display(),
                path.display()
            ));
        }
        if let Some(tx) = self.published {
            let _ = tx.send(());
        }
        Ok(self.listener)
    }
}

/// Connections accepted on `listener`, each relayed through the shim to
/// the in-process end that the gRPC server reads.
pub fn incoming(listener: UnixListener) -> ReceiverStream<io::Result<DuplexStream>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            // The server going away (socket rebound) ends this loop and
            // closes the old listener.
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let item = accepted.map(|(sock, _)| {
                let (ours, theirs) = tokio::io::duplex(64 * 1024);
                tokio::spawn(async move {
                    if let Err(e) = relay(sock, ours).await {
                        tracing::debug!(error = %e, "a gRPC connection ended");
                    }
                });
                theirs
            });
            if tx.send(item).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

async fn relay(client: UnixStream, server: DuplexStream) -> io::Result<()> {
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = tokio::io::split(server);
    let up = async {
        let r = rewrite_requests(&mut client_r, &mut server_w).await;
        let _ = server_w.shutdown().await;
        r
    };
    let down = async {
        let r = tokio::io::copy(&mut server_r, &mut client_w).await;
        let _ = client_w.shutdown().await;
        r.map(|_| ())
    };
    let (a, b) = tokio::join!(up, down);
    a.and(b)
}

/// A header block being collected from HEADERS and CONTINUATION frames.
struct Block {
    stream: [u8; 4],
    end_stream: bool,
    priority: Vec<u8>,
    fragment: Vec<u8>,
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Copies client-to-server HTTP/2, rewriting request header blocks.
pub async fn rewrite_requests<R, W>(r: &mut R, w: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE_LEN];
    r.read_exact(&mut preface).await?;
    w.write_all(&preface).await?;
    let mut decoder = Decoder::new();
    decoder.set_max_allowed_table_size(MAX_TABLE);
    let mut encoder = Encoder::new();
    let mut pending: Option<Block> = None;
    loop {
        let mut head = [0u8; 9];
        match r.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = [head[5], head[6], head[7], head[8]];
        // Our h2 server keeps the initial SETTINGS_MAX_FRAME_SIZE, so a
        // larger frame is a protocol error whatever its type: refused
        // before anything is allocated for it.
        if len > MAX_FRAME {
            return Err(bad("frame larger than SETTINGS_MAX_FRAME_SIZE"));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload).await?;
        let header_frame = matches!(
            (kind, pending.is_some()),
            (FRAME_HEADERS, false) | (FRAME_CONTINUATION, true)
        );
        if !header_frame {
            if pending.is_some() {
                return Err(bad("header block interrupted by another frame"));
            }
            // Whole frames only: the server never sees a truncated one.
            w.write_all(&head).await?;
            w.write_all(&payload).await?;
            w.flush().await?;
            continue;
        }
        match (kind, pending.as_mut()) {
            (FRAME_HEADERS, None) => {
                let mut p = &payload[..];
                if flags & FLAG_PADDED != 0 {
                    let (&pad, rest) =
                        p.split_first().ok_or_else(|| bad("empty padded HEADERS"))?;
                    p = rest
                        .get(..rest.len().saturating_sub(pad as usize))
                        .filter(|_| pad as usize <= rest.len())
                        .ok_or_else(|| bad("HEADERS padding longer than the frame"))?;
                }
                let mut priority = Vec::new();
                if flags & FLAG_PRIORITY != 0 {
                    let (a, b) = p
                        .split_at_checked(5)
                        .ok_or_else(|| bad("HEADERS priority truncated"))?;
                    priority = a.to_vec();
                    p = b;
                }
                pending = Some(Block {
                    stream,
                    end_stream: flags & FLAG_END_STREAM != 0,
                    priority,
                    fragment: p.to_vec(),
                });
            }
            (FRAME_CONTINUATION, Some(b)) if b.stream == stream => {
                b.fragment.extend_from_slice(&payload);
                if b.fragment.len() > MAX_BLOCK {
                    return Err(bad("request header block too large"));
                }
            }
            // A CONTINUATION of another stream interrupts the block.
            _ => return Err(bad("header block interrupted by another frame")),
        }
        if flags & FLAG_END_HEADERS != 0 {
            let b = pending.take().expect("a block is pending");
            let block = reencode(&mut decoder, &mut encoder, &b.fragment)?;
            write_headers(w, &b, &block).await?;
        }
    }
}

fn reencode(decoder: &mut Decoder, encoder: &mut Encoder, block: &[u8]) -> io::Result<Vec<u8>> {
    let mut headers = Vec::new();
    let mut size = 0usize;
    decoder
        .decode_with_cb(block, |n, v| {
            size = size.saturating_add(n.len() + v.len() + 32);
            // Past the limit nothing more is copied; the block is refused
            // once decoding (which must go on, for the table) ends.
            if size <= MAX_HEADER_LIST {
                headers.push((n.into_owned(), v.into_owned()));
            }
        })
        .map_err(|e| bad(&format!("cannot decode a request header block: {e:?}")))?;
    if size > MAX_HEADER_LIST {
        return Err(bad("request header list too large"));
    }
    for (name, value) in headers.iter_mut() {
        if name.as_slice() == b":authority"
            && http::uri::Authority::try_from(value.as_slice()).is_err()
        {
            tracing::debug!(authority = %String::from_utf8_lossy(value), "replacing an invalid :authority");
            *value = b"localhost".to_vec();
        }
    }
    Ok(encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice()))))
}

async fn write_headers<W: AsyncWrite + Unpin>(
    w: &mut W,
    b: &Block,
    block: &[u8],
) -> io::Result<()> {
    let first_room = MAX_FRAME - b.priority.len();
    let (first, mut rest) = block.split_at(block.len().min(first_room));
    let mut flags = if b.end_stream { FLAG_END_STREAM } else { 0 };
    if !b.priority.is_empty() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    let mut payload = b.priority.clone();
    payload.extend_from_slice(first);
    write_frame(w, FRAME_HEADERS, flags, b.stream, &payload).await?;
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = tail;
        let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        write_frame(w, FRAME_CONTINUATION, flags, b.stream, chunk).await?;
    }
    w.flush().await
}

async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: u8,
    flags: u8,
    stream: [u8; 4],
    payload: &[u8],
) -> io::Result<()> {
    let len = (payload.len() as u32).to_be_bytes();
    let head = [
        len[1], len[2], len[3], kind, flags, stream[0], stream[1], stream[2], stream[3],
    ];
    w.write_all(&head).await?;
    w.write_all(payload).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = (payload.len() as u32).to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    /// Runs the shim over `input`; what reached the server, or the error.
    async fn shim(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        rewrite_requests(&mut &input[..], &mut out)
            .await
            .map(|()| out)
    }

    fn with_preface(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut v = PREFACE.to_vec();
        frames.iter().for_each(|f| v.extend_from_slice(f));
        v
    }

    #[tokio::test]
    async fn frames_are_bounded_before_they_are_read() {
        // A DATA frame of the largest size passes through byte for byte.
        let data = frame(0x0, 0, &vec![7u8; MAX_FRAME]);
        let out = shim(with_preface(std::slice::from_ref(&data)))
            .await
            .unwrap();
        assert_eq!(&out[PREFACE_LEN..], &data[..]);
        // One that claims 16 MiB is refused on its header, before its
        // bytes arrive (there are none here) and before anything of it
        // reaches the server.
        let mut lying = frame(0x0, 0, &[]);
        lying[..3].copy_from_slice(&[0xff, 0xff, 0xff]);
        let mut input = with_preface(&[lying]);
        let mut out = Vec::new();
        let e = rewrite_requests(&mut &input[..], &mut out)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("MAX_FRAME_SIZE"), "{e}");
        assert_eq!(
            out.len(),
            PREFACE_LEN,
            "part of a refused frame was passed on"
        );
        // A header frame over the limit likewise; a truncated frame never
        // reaches the server.
        let big = frame(FRAME_HEADERS, FLAG_END_HEADERS, &vec![0u8; MAX_FRAME + 1]);
        assert!(shim(with_preface(&[big])).await.is_err());
        // A CONTINUATION on another stream than its HEADERS ends the
        // connection (found by fuzz/fuzz_targets/registration_frames.rs).
        let mut other = frame(FRAME_CONTINUATION, FLAG_END_HEADERS, &[0x82]);
        other[8] = 3;
        let open = frame(FRAME_HEADERS, 0, &[0x83]);
        let e = shim(with_preface(&[open, other])).await.unwrap_err();
        assert!(e.to_string().contains("interrupted"), "{e}");
        input = with_preface(&[frame(0x0, 0, &[1; 100])]);
        input.truncate(input.len() - 10);
        let mut out = Vec::new();
        assert!(rewrite_requests(&mut &input[..], &mut out).await.is_err());
        assert_eq!(out.len(), PREFACE_LEN);
    }

    #[tokio::test]
    async fn an_hpack_bomb_and_a_table_over_its_size_are_refused() {
        let mut enc = Encoder::new();
        let value = vec![b'x'; 4000];
        // The first block puts a 4 KiB field in the dynamic table...
        let mut block = enc.encode([(&b"x-bomb"[..], &value[..])]);
        // ...and then refers to it, one byte (index 62) a time.
        block.extend(std::iter::repeat_n(0x80 | 62, 100));
        let e = shim(with_preface(&[frame(
            FRAME_HEADERS,
            FLAG_END_HEADERS,
            &block,
        )]))
        .await
        .unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        // A dynamic table size update to 1 MiB (0x3f, then 1048576-31 in
        // 7-bit groups), over the 4 KiB the server allows.
        let mut update = vec![0x3f];
        let mut n = (1usize << 20) - 31;
        while n >= 128 {
            update.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        update.push(n as u8);
        update.extend(enc.encode([(&b":authority"[..], &b"localhost"[..])]));
        assert!(
            shim(with_preface(&[frame(
                FRAME_HEADERS,
                FLAG_END_HEADERS,
                &update
            )]))
            .await
            .is_err()
        );
        // A plain request passes, its authority made valid.
        let ok = Encoder::new().encode([
            (&b":method"[..], &b"POST"[..]),
            (&b":authority"[..], &b"/var/lib/kubelet/csi.sock"[..]),
        ]);
        let out = shim(with_preface(&[frame(FRAME_HEADERS, FLAG_END_HEADERS, &ok)]))
            .await
            .unwrap();
        let decoded = Decoder::new().decode(&out[PREFACE_LEN + 9..]).unwrap();
        assert!(decoded.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
    }
}
