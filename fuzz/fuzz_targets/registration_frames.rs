//! The frame reader in front of our Unix sockets (`uds::rewrite_requests`,
//! serving kubelet's registration socket and the CSI endpoint): it reads
//! whatever a local client writes, HTTP/2 frames and HPACK header blocks,
//! and re-encodes request headers for h2. The input is the client's byte
//! stream. Whatever it is, the shim must not panic or hang (libFuzzer's
//! -timeout catches that), and what it hands the gRPC server must be whole
//! frames whose header blocks decode, in order, with one HPACK decoder (as
//! h2 keeps one per connection), and carry no `:authority` h2 would refuse.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loona_hpack::Decoder;
use modelcache_csi::uds::rewrite_requests;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let mut out = Vec::new();
    // A byte slice and a Vec never return Pending.
    let _ = futures::executor::block_on(rewrite_requests(&mut input, &mut out));

    if data.len() < 24 {
        assert!(out.is_empty());
        return;
    }
    assert_eq!(out[..24], data[..24], "the preface passes through");
    let mut rest = &out[24..];
    let mut decoder = Decoder::new();
    let mut block: Option<(Vec<u8>, [u8; 4])> = None;
    while !rest.is_empty() {
        assert!(
            rest.len() >= 9,
            "a truncated frame header reached the server"
        );
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let (kind, flags, stream) = (rest[3], rest[4], [rest[5], rest[6], rest[7], rest[8]]);
        assert!(
            rest.len() >= 9 + len,
            "a truncated frame reached the server"
        );
        let payload = &rest[9..9 + len];
        rest = &rest[9 + len..];
        let stray = match (kind, &mut block) {
            (HEADERS, None) => {
                assert!(
                    len <= 16_384,
                    "a HEADERS frame over the initial MAX_FRAME_SIZE"
                );
                assert_eq!(flags & PADDED, 0, "the shim writes no padding");
                let skip = if flags & PRIORITY != 0 { 5 } else { 0 };
                let fragment = payload.get(skip..).expect("PRIORITY set on a short frame");
                block = Some((fragment.to_vec(), stream));
                None
            }
            (CONTINUATION, Some((b, s))) => {
                assert_eq!(*s, stream, "CONTINUATION on another stream");
                assert!(len <= 16_384);
                b.extend_from_slice(payload);
                None
            }
            (CONTINUATION, None) => Some("a CONTINUATION without HEADERS"),
            (_, Some(_)) => Some("a header block interrupted"),
            (_, None) => continue,
        };
        // Frames the shim passes through as they came are the server's
        // problem (h2 refuses them); what the shim wrote itself is not.
        if stray.is_some() {
            return;
        }
        if flags & END_HEADERS != 0 {
            let (b, _) = block.take().expect("a block is open");
            let headers = decoder
                .decode(&b)
                .unwrap_or_else(|e| panic!("a re-encoded block does not decode: {e:?}"));
            for (name, value) in &headers {
                if name.as_slice() == b":authority" {
                    assert!(
                        http::uri::Authority::try_from(value.as_slice()).is_ok(),
                        "an invalid :authority reached the server: {value:?}"
                    );
                }
            }
        }
    }
});
