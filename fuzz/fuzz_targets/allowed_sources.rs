//! `trust::AllowedSources`: the first line of the input is a StorageClass's
//! `allowedSources` value, each further line a URI a tenant's PVC names.
//! The properties are the trust boundary's (docs/security.md), checked
//! against an independent reading of the URI rather than the module's own
//! helpers: a permitted URI has no user info, no control character or space,
//! no `.`/`..` segment however it is spelled, and lies under one listed
//! prefix, continuing it only at a boundary its scheme gives a meaning to.
#![no_main]

use libfuzzer_sys::fuzz_target;
use modelcache_csi::trust::AllowedSources;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (list, uris) = text.split_once('\n').unwrap_or((text, ""));
    let Ok(allowed) = AllowedSources::parse(list) else {
        return;
    };
    let shown = allowed.to_string();
    assert_eq!(
        AllowedSources::parse(&shown).as_ref(),
        Ok(&allowed),
        "{list:?}"
    );
    let _ = allowed.named_hosts();
    let prefixes: Vec<String> = shown.split(',').map(str::to_ascii_lowercase).collect();

    for uri in uris.split('\n') {
        let verdict = allowed.permits(uri);
        if let Err(e) = &verdict {
            // Refusals may be logged and put in PVC events: never a query
            // (from its '?' or '#' on, which no prefix and no fixed text has).
            if let Some(i) = uri.find(['?', '#'])
                && uri.len() - i >= 8
            {
                assert!(!e.contains(&uri[i..]), "{e:?} shows the query of {uri:?}");
            }
            continue;
        }
        assert!(
            !uri.chars().any(|c| c.is_control() || c.is_whitespace()),
            "{uri:?} permitted with a control character or space"
        );
        let (scheme, after) = uri.split_once("://").expect("a permitted URI has a scheme");
        let scheme = scheme.to_ascii_lowercase();
        // Only http(s) ends a path at '?' or '#'; `file:///m?x` is the
        // directory "/m?x", and the other schemes' parsers read them as
        // part of a name or refuse them.
        let delimiters: &[char] = match scheme.as_str() {
            "http" | "https" => &['/', '?', '#'],
            _ => &['/'],
        };
        let end = after.find(delimiters).unwrap_or(after.len());
        assert!(
            !after[..end].contains('@'),
            "{uri:?} permitted with user info"
        );
        let path = &after[end..];
        let path = match scheme.as_str() {
            "http" | "https" => &path[..path.find(['?', '#']).unwrap_or(path.len())],
            _ => path,
        };
        let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
        assert!(
            !decoded.split(['/', '\\']).any(|s| s == "." || s == ".."),
            "{uri:?} permitted with a dot segment"
        );
        // What may follow a prefix that does not end in '/' without naming
        // a sibling of its last segment: a new segment, or what the scheme
        // reads as something other than the path (a query, a tag, a
        // revision).
        let boundaries: &[char] = match scheme.as_str() {
            "oci" => &['/', ':', '@'],
            "hf" => &['/', '@'],
            "http" | "https" => &['/', '?', '#'],
            _ => &['/'],
        };
        let lower = uri.to_ascii_lowercase();
        let under = prefixes.iter().any(|p| {
            let base = p.trim_end_matches('/');
            lower.strip_prefix(base).is_some_and(|tail| {
                tail.is_empty() || p.ends_with("://") || tail.starts_with(boundaries)
            })
        });
        assert!(
            under,
            "{uri:?} permitted by {shown:?} but under none of its prefixes"
        );
    }
});
