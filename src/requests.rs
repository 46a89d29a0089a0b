//! CSI requests as a CO sends them, built from a few words; and the check
//! a caller makes of a refusal. Shared by the demo, the benchmarks, the
//! rootless handler tier and the integration tests.

use std::collections::HashMap;
use std::fmt::Debug;
use std::path::Path;

use tonic::{Code, Status};

use crate::csi::volume_capability::access_mode::Mode;
use crate::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use crate::csi::volume_content_source::{Type as ContentType, VolumeSource};
use crate::csi::*;

pub const WRITER: Mode = Mode::SingleNodeWriter;
pub const READER: Mode = Mode::SingleNodeReaderOnly;

pub fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn path_str(p: &Path) -> String {
    p.to_str()
        .expect("paths handed to the driver are UTF-8")
        .to_string()
}

/// The volume uuid: the last of the id's three dot-separated parts.
pub fn uuid_of(volume_id: &str) -> &str {
    volume_id.rsplit('.').next().expect("volume id")
}

/// A mount (filesystem) capability with `mode` and `flags`.
pub fn mount_cap(mode: Mode, flags: &[&str]) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        })),
    }
}

pub fn block_cap(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub fn create_req(name: &str, params: &[(&str, &str)], mode: Mode) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        parameters: map(params),
        volume_capabilities: vec![mount_cap(mode, &[])],
        ..Default::default()
    }
}

pub fn clone_req(
    name: &str,
    params: &[(&str, &str)],
    source_id: &str,
    mode: Mode,
) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(ContentType::Volume(VolumeSource {
                volume_id: source_id.into(),
            })),
        }),
        ..create_req(name, params, mode)
    }
}

pub fn stage_req(volume_id: &str, staging: &Path, cap: VolumeCapability) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: path_str(staging),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn publish_req(
    volume_id: &str,
    staging: &Path,
    target: &Path,
    cap: VolumeCapability,
    readonly: bool,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: path_str(staging),
        target_path: path_str(target),
        volume_capability: Some(cap),
        readonly,
        ..Default::default()
    }
}

/// Asserts the call failed with `code` and a message containing `fragment`;
/// returns the status for further checks.
#[track_caller]
pub fn assert_code<T: Debug>(result: Result<T, Status>, code: Code, fragment: &str) -> Status {
    let status = match result {
        Ok(v) => panic!("expected {code:?} ({fragment:?}), got Ok({v:?})"),
        Err(s) => s,
    };
    assert_eq!(
        status.code(),
        code,
        "wrong code; message: {:?}",
        status.message()
    );
    assert!(
        status.message().contains(fragment),
        "{code:?} message {:?} does not contain {fragment:?}",
        status.message()
    );
    status
}
