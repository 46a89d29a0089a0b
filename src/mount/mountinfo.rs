//! Parser for `/proc/self/mountinfo` (see proc_pid_mountinfo(5)).
//!
//! Paths are kept as raw bytes so a mount point that is not UTF-8 still
//! compares equal to the path the caller holds.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem that forms the root of this mount.
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options: "ro"/"rw", "nosuid", "nodev", "noexec", "relatime", ...
    pub mount_options: Vec<String>,
    pub fs_type: String,
    pub source: String,
    /// Per-superblock options, e.g. "ro", "norecovery", "nouuid".
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// Read-only either for this mount or for the whole superblock; both stop writes.
    pub fn is_readonly(&self) -> bool {
        self.has_option("ro")
    }

    /// True if `o` is among the per-mount or the per-superblock options.
    pub fn has_option(&self, o: &str) -> bool {
        self.mount_options
            .iter()
            .chain(&self.super_options)
            .any(|x| x == o)
    }
}

/// Parse the full text of a mountinfo file.
pub fn parse(text: &str) -> Result<Vec<MountEntry>, String> {
    parse_bytes(text.as_bytes())
}

/// Read the calling thread's view of the mount table.
pub fn read_table() -> io::Result<Vec<MountEntry>> {
    let path = "/proc/self/mountinfo";
    let bytes =
        std::fs::read(path).map_err(|e| io::Error::new(e.kind(), format!("read {path}: {e}")))?;
    parse_bytes(&bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("parse {path}: {e}")))
}

/// The topmost mount whose mount point is exactly `path` (canonicalized by the caller).
pub fn mount_at<'a>(table: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    let here: Vec<&MountEntry> = table.iter().filter(|m| m.mount_point == path).collect();
    // A mount stacked on another at the same place has the lower one as its
    // parent, so the topmost is the one nobody here is parented to. Listing
    // order usually agrees; it breaks ties.
    here.iter()
        .rev()
        .find(|m| !here.iter().any(|o| o.parent_id == m.mount_id))
        .or(here.last())
        .copied()
}

/// Every mount at or below `dir`, deepest first, so unmounting in this order never hits EBUSY
/// from a child mount.
pub fn mounts_under<'a>(table: &'a [MountEntry], dir: &Path) -> Vec<&'a MountEntry> {
    // Reversed first so that, at equal depth, a later (stacked) mount precedes the one it covers;
    // the sort is stable.
    let mut found: Vec<&MountEntry> = table
        .iter()
        .rev()
        .filter(|m| m.mount_point.starts_with(dir))
        .collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.mount_point.components().count()));
    found
}

fn parse_bytes(bytes: &[u8]) -> Result<Vec<MountEntry>, String> {
    bytes
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .map(|(i, line)| {
            parse_line(line)
                .map_err(|e| format!("line {}: {e}: {:?}", i + 1, String::from_utf8_lossy(line)))
        })
        .collect()
}

fn parse_line(line: &[u8]) -> Result<MountEntry, String> {
    // Split on single spaces: the kernel escapes spaces inside fields, and an
    // empty source shows up as two adjacent spaces, which must stay a field.
    let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    if fields.len() < 6 {
        return Err(format!(
            "expected at least 6 fields before the separator, found {}",
            fields.len()
        ));
    }
    // Optional fields (shared:N, master:N, ...) come between field 6 and the lone "-".
    let sep = fields[6..]
        .iter()
        .position(|f| *f == b"-")
        .map(|p| p + 6)
        .ok_or("missing \"-\" separator")?;
    let after = &fields[sep + 1..];
    if after.len() < 2 {
        return Err("expected filesystem type and source after the separator".into());
    }

    let colon = fields[2]
        .iter()
        .position(|&b| b == b':')
        .ok_or("major:minor without ':'")?;
    let (major, minor) = (&fields[2][..colon], &fields[2][colon + 1..]);
    Ok(MountEntry {
        mount_id: number(fields[0], "mount id")?,
        parent_id: number(fields[1], "parent id")?,
        major: number(major, "major")?,
        minor: number(minor, "minor")?,
        root: path(fields[3]),
        mount_point: path(fields[4]),
        mount_options: options(fields[5]),
        fs_type: text(after[0]),
        source: text(after[1]),
        // Absent on some very old kernels; an empty list is the honest answer.
        super_options: after.get(2).map(|f| options(f)).unwrap_or_default(),
    })
}

fn number(field: &[u8], what: &str) -> Result<u32, String> {
    std::str::from_utf8(field)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad {what} {:?}", String::from_utf8_lossy(field)))
}

/// A comma-separated, escaped option list.
pub(super) fn options(field: &[u8]) -> Vec<String> {
    text(field)
        .split(',')
        .filter(|o| !o.is_empty())
        .map(String::from)
        .collect()
}

fn text(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape(field)).into_owned()
}

fn path(field: &[u8]) -> PathBuf {
    OsString::from_vec(unescape(field)).into()
}

/// Undo the kernel's `\ooo` octal escaping of space, tab, newline and backslash.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(
                    d.iter()
                        .fold(0u8, |acc, c| acc.wrapping_mul(8).wrapping_add(c - b'0')),
                );
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
36 27 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
40 27 7:3 /models/a\\040b /var/lib/kubelet/pods/x/volumes/my\\040vol ro,nosuid,nodev,relatime shared:5 master:2 propagate_from:2 unbindable - xfs /dev/loop3 ro,attr2,inode64,norecovery,nouuid
41 27 0:50 / /mnt/weird\\011tab\\012nl\\134bs rw - tmpfs  rw
";

    #[test]
    fn parses_realistic_lines() {
        let t = parse(SAMPLE).unwrap();
        assert_eq!(t.len(), 5);

        let proc = &t[0];
        assert_eq!((proc.mount_id, proc.parent_id), (22, 27));
        assert_eq!((proc.major, proc.minor), (0, 21));
        assert_eq!(
            proc.mount_options,
            ["rw", "nosuid", "nodev", "noexec", "relatime"]
        );
        assert_eq!(proc.fs_type, "proc");

        let bind = &t[2];
        assert_eq!(bind.root, Path::new("/mnt1"));
        assert_eq!(bind.source, "/dev/root");
        assert_eq!(bind.super_options, ["rw", "errors=continue"]);

        let vol = &t[3];
        assert_eq!(vol.root, Path::new("/models/a b"));
        assert_eq!(
            vol.mount_point,
            Path::new("/var/lib/kubelet/pods/x/volumes/my vol")
        );
        assert_eq!((vol.major, vol.minor), (7, 3));
        assert_eq!(vol.fs_type, "xfs");
        assert_eq!(vol.source, "/dev/loop3");
        assert!(vol.is_readonly());
        assert!(vol.has_option("norecovery") && vol.has_option("nouuid"));
        assert!(vol.has_option("nosuid"));
        assert!(
            !vol.has_option("master:2"),
            "optional fields are not options"
        );
        assert!(!t[1].is_readonly());

        let weird = &t[4];
        assert_eq!(weird.mount_point, Path::new("/mnt/weird\ttab\nnl\\bs"));
        assert_eq!(weird.source, "", "an empty source stays a field");
        assert_eq!(weird.super_options, ["rw"]);
    }

    #[test]
    fn ro_superblock_under_rw_mount_is_readonly() {
        let t = parse("50 27 7:1 / /a rw,relatime - xfs /dev/loop1 ro,norecovery\n").unwrap();
        assert!(t[0].is_readonly());
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in [
            "22 27 0:21 / /proc rw shared:1 proc proc rw",
            "x 27 0:21 / /proc rw - proc proc rw",
            "22 27 021 / /proc rw - proc proc rw",
            "22 27 0:21 / /proc rw -",
            "22 27",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.starts_with("line 1:"), "{err}");
        }
    }

    #[test]
    fn mount_at_picks_topmost_of_stacked_mounts() {
        // 61 is stacked on 60, then 62 on 61; listed out of order on purpose.
        let t = parse(
            "\
60 27 7:1 / /target rw - xfs /dev/loop1 ro
62 61 0:40 / /target rw - tmpfs tmpfs rw
61 60 7:2 / /target rw - xfs /dev/loop2 ro
63 27 0:41 / /target2 rw - tmpfs tmpfs rw
",
        )
        .unwrap();
        assert_eq!(mount_at(&t, Path::new("/target")).unwrap().mount_id, 62);
        assert_eq!(mount_at(&t, Path::new("/target2")).unwrap().mount_id, 63);
        assert!(mount_at(&t, Path::new("/targ")).is_none());
        assert!(mount_at(&t, Path::new("/target/sub")).is_none());

        let listed_order = parse(
            "\
70 27 0:1 / /s rw - tmpfs a rw
71 70 0:2 / /s rw - tmpfs b rw
",
        )
        .unwrap();
        assert_eq!(
            mount_at(&listed_order, Path::new("/s")).unwrap().source,
            "b"
        );
    }

    #[test]
    fn mounts_under_lists_deepest_first() {
        let t = parse(
            "\
1 0 0:1 / / rw - ext4 /dev/vda rw
10 1 0:10 / /pods rw - tmpfs t rw
11 10 0:11 / /pods/a rw - tmpfs t rw
12 11 0:12 / /pods/a/b/c rw - tmpfs t rw
13 11 0:13 / /pods/a/b rw - tmpfs t rw
14 11 0:14 / /pods/ab rw - tmpfs t rw
15 11 0:15 / /pods/a rw - tmpfs t rw
",
        )
        .unwrap();
        let ids: Vec<u32> = mounts_under(&t, Path::new("/pods/a"))
            .iter()
            .map(|m| m.mount_id)
            .collect();
        assert_eq!(ids, [12, 13, 15, 11]);
    }

    #[test]
    fn reads_the_live_table() {
        let t = read_table().unwrap();
        assert!(mount_at(&t, Path::new("/")).is_some());
        assert!(mount_at(&t, Path::new("/proc")).is_some_and(|m| m.fs_type == "proc"));
    }
}
