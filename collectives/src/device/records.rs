//! The fixed-size records a device communicator's ranks trade at set-up: each rank's device
//! ([`DeviceInfo`]), each receive FIFO's connect info ([`ConnectInfo`], 256 bytes as NCCL's), and
//! the text fields inside them.

use bytemuck::{Pod, Zeroable};

use crate::error::{Error, Result};
use crate::transport::TransportKind;

/// What every rank tells the others about its device (fixed size, all-gathered).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct DeviceInfo {
    /// Device UUID (zero when it has none).
    pub uuid: [u8; 16],
    /// 1 when `uuid` is meaningful.
    pub has_uuid: u32,
    /// Process id.
    pub pid: u32,
    /// Device name (`cuda:0`, `host`), NUL-padded.
    pub name: [u8; 24],
    /// Bytes free in the rank's shm directory (host staging sizes its slots by the least).
    pub shm_free: u64,
}
const _: () = assert!(std::mem::size_of::<DeviceInfo>() == 56);

/// How to attach to a rank's receive FIFO (fixed size, all-gathered).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct ConnectInfo {
    /// Slot bytes.
    pub slot_bytes: u64,
    /// Slots.
    pub slots: u32,
    /// 1 shm staging, 3 cuda_ipc.
    pub kind: u32,
    /// CUDA IPC handle of the device slots (cuda_ipc).
    pub ipc: [u8; 64],
    /// Path of the shm file (data or control block), NUL-padded.
    pub path: [u8; 128],
    /// TCP connections to open (tcp).
    pub sockets: u32,
    /// Zero.
    pub _reserved: [u32; 11],
}
const _: () = assert!(std::mem::size_of::<ConnectInfo>() == 256);

pub(super) fn kind_code(k: TransportKind) -> u32 {
    match k {
        TransportKind::Shm => 1,
        TransportKind::Tcp => 2,
        TransportKind::CudaIpc => 3,
    }
}

pub(super) fn text<const N: usize>(s: &str) -> [u8; N] {
    let mut b = [0u8; N];
    let n = s.len().min(N);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

pub(super) fn path_text(p: &std::path::Path) -> Result<[u8; 128]> {
    let s = p.to_string_lossy();
    if s.len() >= 128 {
        return Err(Error::config(
            "RINGZERO_SHM_DIR",
            format!("the shm path `{s}` is longer than 127 bytes; use a shorter directory"),
        ));
    }
    Ok(text(&s))
}

pub(super) fn untext(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Bytes of a probe finding in the all-gathered record.
pub(super) const FINDING_BYTES: usize = 320;

/// How many tcp connections a send edge of `kind` to the FIFO `theirs` describes has.
pub(super) fn sent_sockets(theirs: &ConnectInfo, kind: TransportKind) -> usize {
    match kind {
        TransportKind::Tcp => theirs.sockets as usize,
        _ => 0,
    }
}
