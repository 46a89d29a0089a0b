//! What the integration tests share: the driver under test (`harness`) and
//! the real services they run it against.

pub mod apiserver;
pub mod fixtures;
pub mod fleet;
pub mod gluster;
pub mod harness;
pub mod minio;
pub mod reading;
pub mod registry;
