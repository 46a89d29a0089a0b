//! Source ids: what a source's directory is named, and the one place that
//! knows their forms.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Whether `uuid` is a volume uuid (32 lowercase hex digits).
pub fn is_volume_uuid(uuid: &str) -> bool {
    uuid.len() == 32 && uuid.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A source's id, and the one place that knows its forms: 32 lowercase
/// hex digits (a source volume's own uuid), or a kind letter and 31 of
/// them: `m` for a pulled model (a digest of what it is), `x` for a cache
/// volume over another driver's bytes (its volume uuid). Anything else,
/// `..` and `/` included, never parses, so it never becomes part of a path.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SourceId(String);

/// What a source id stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// A source volume's own bytes: the user's data.
    Volume,
    /// A model the puller fetched, content-addressed, evictable.
    Model,
    /// Another driver's bytes, exposed in place; nothing on disk.
    External,
}

impl SourceId {
    /// `None` for anything that is not one of our ids.
    pub fn parse(sid: &str) -> Option<SourceId> {
        let hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let ok = sid.len() == 32
            && match sid.as_bytes()[0] {
                b'm' | b'x' => hex(&sid[1..]),
                _ => hex(sid),
            };
        ok.then(|| SourceId(sid.to_string()))
    }

    /// The id of a pulled model whose identity hashes to `digest`.
    pub fn model(digest: &[u8]) -> SourceId {
        SourceId(format!("m{}", &hex::encode(digest)[..31]))
    }

    /// The id of the source a source volume of `uuid` owns.
    pub fn volume(uuid: &str) -> Option<SourceId> {
        is_volume_uuid(uuid).then(|| SourceId(uuid.to_string()))
    }

    /// The id of a cache volume of `uuid` over another driver's bytes: a
    /// name no source of ours can take.
    pub fn external(uuid: &str) -> Option<SourceId> {
        is_volume_uuid(uuid).then(|| SourceId(format!("x{}", &uuid[..31])))
    }

    pub fn kind(&self) -> SourceKind {
        match self.0.as_bytes()[0] {
            b'm' => SourceKind::Model,
            b'x' => SourceKind::External,
            _ => SourceKind::Volume,
        }
    }

    /// Whether the puller fetched it (and eviction may take it).
    pub fn is_model(&self) -> bool {
        self.kind() == SourceKind::Model
    }

    /// `sid` as a pulled model's id; `None` for anything else.
    pub fn parse_model(sid: &str) -> Option<SourceId> {
        SourceId::parse(sid).filter(SourceId::is_model)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for SourceId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SourceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SourceId {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<SourceId, String> {
        SourceId::parse(&s).ok_or_else(|| format!("source id {s:?} is malformed"))
    }
}

impl From<SourceId> for String {
    fn from(s: SourceId) -> String {
        s.0
    }
}

impl PartialEq<str> for SourceId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for SourceId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for SourceId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}
