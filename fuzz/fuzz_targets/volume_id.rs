//! `cache::VolumeId::parse`: DeleteVolume and the node calls get only this
//! string, from whoever calls the CSI socket. An accepted id is exactly
//! `<backend>.<8 hex>.<32 hex>` and prints back to itself; an id built from
//! those parts is always accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use modelcache_csi::cache::{Backend, VolumeId};

fuzz_target!(|data: &[u8]| {
    if let Ok(id) = std::str::from_utf8(data)
        && let Some(v) = VolumeId::parse(id)
    {
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        assert!(hex(&v.root_key, 8) && hex(&v.uuid, 32), "{v:?}");
        assert_eq!(format!("{}.{}.{}", v.backend, v.root_key, v.uuid), id);
    }
    // The other direction: the parts of any id we could mint.
    if data.len() >= 21 {
        let backend = Backend::ALL[data[0] as usize % Backend::ALL.len()];
        let id = format!(
            "{backend}.{}.{}",
            lower_hex(&data[1..5]),
            lower_hex(&data[5..21])
        );
        let v = VolumeId::parse(&id).unwrap_or_else(|| panic!("{id} was refused"));
        assert_eq!(v.backend, backend);
    }
});

fn lower_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
