//! [`SharedBuf`]: a buffer the other ranks on this node map once and then read with plain loads.
//!
//! The single-copy all-gather (`comm/direct.rs`) reads each rank's part out of its process with
//! `process_vm_readv`; the kernel pins every page of the part and copies it page by page, which
//! costs as much again as the copy itself while the part is in cache. An all-gather whose input
//! lies in a `SharedBuf` skips that: the rank posts where the buffer is (its memfd, see
//! [`crate::transport::memfd`]), each peer maps the buffer on its first read and keeps the
//! mapping, and every later read is one `memcpy` from the mapping. This is what NCCL's buffer
//! registration and MPI's shared windows do; a trainer's parameter shards, all-gathered at
//! every step, are the case it is for (the ZeRO engine runs on a device communicator, which
//! does not use it).
//!
//! Every buffer this process allocates is in one registry (any communicator's all-gather finds
//! it, split communicators' too). A peer keeps the mappings of the last [`MAPS_PER_RANK`]
//! buffers it read from each rank: a buffer dropped here stays allocated until those peers map
//! newer ones or drop their communicator.

use std::collections::{BTreeMap, VecDeque};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use ringzero_kernels::device::ShareRecord;

use crate::error::{Error, Result};
use crate::transport::memfd::{PeerSegment, Segment};
use crate::Element;

/// The mappings a rank keeps per peer.
pub const MAPS_PER_RANK: usize = 8;

/// A zeroed buffer of `T` that the other ranks of a communicator on this node read straight
/// from this process's memory: an all-gather whose input (or, in place, whose buffer) lies in
/// it costs one `memcpy` per part instead of a `process_vm_readv`
/// ([`Communicator::single_copy_sizes`](crate::Communicator::single_copy_sizes) says which
/// sizes read directly at all). Anywhere else it is ordinary memory: dereference it to a slice.
///
/// Allocate such buffers once and reuse them: each peer keeps its mappings of the last
/// 8 buffers it read from a rank, so a dropped buffer's memory is freed only once the peers
/// have read 8 newer ones of that rank or dropped their communicator.
///
/// ```no_run
/// # use ringzero_collectives::{Collectives, Communicator, SharedBuf};
/// # fn main() -> ringzero_collectives::Result<()> {
/// let comm = Communicator::from_env()?;
/// let full = 1 << 24;
/// let mut shard = SharedBuf::<f32>::zeroed(comm.chunk_range(full).len())?;
/// shard.fill(1.0);
/// let mut params = vec![0f32; full];
/// // The other ranks map `shard` on the first call and copy out of it from then on.
/// comm.all_gather(&shard[..], &mut params)?;
/// # Ok(()) }
/// ```
pub struct SharedBuf<T: Element> {
    seg: Segment,
    len: usize,
    serial: u64,
    fd: i32,
    ino: u64,
    _t: PhantomData<T>,
}

impl<T: Element> SharedBuf<T> {
    /// `len` zeroed elements of shared memory. Fails where the system refuses a memfd
    /// (`memfd_create`, Linux 3.17 and later) or the memory.
    pub fn zeroed(len: usize) -> Result<SharedBuf<T>> {
        let bytes =
            len.checked_mul(std::mem::size_of::<T>())
                .ok_or_else(|| Error::InvalidArgument {
                    op: "SharedBuf::zeroed".into(),
                    msg: format!("{len} elements of {} overflow the address space", T::DTYPE),
                })?;
        let seg = Segment::create("ringzero-shared", bytes).map_err(|e| {
            Error::io(
                format!("creating a shared buffer of {bytes} bytes (memfd)"),
                e,
            )
        })?;
        let (fd, ino) = seg
            .locator()
            .map_err(|e| Error::io("reading the shared buffer's inode", e))?;
        static SERIAL: AtomicU64 = AtomicU64::new(1);
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let start = seg.bytes().as_ptr() as usize;
        let region = Region {
            start,
            bytes,
            fd,
            ino,
            serial,
        };
        registry().insert(start, region);
        Ok(SharedBuf {
            seg,
            len,
            serial,
            fd,
            ino,
            _t: PhantomData,
        })
    }
}

impl<T: Element> SharedBuf<T> {
    /// Where another process opens it (its descriptor here, its inode), for ringzero's own
    /// bench ([`crate::internals::transport::memfd::PeerSegment::open`]).
    #[doc(hidden)]
    pub fn locator(&self) -> (i32, u64) {
        (self.fd, self.ino)
    }
}

impl<T: Element> std::ops::Deref for SharedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // The mapping is page-aligned, so aligned for every element type.
        &bytemuck::cast_slice(self.seg.bytes())[..self.len]
    }
}

impl<T: Element> std::ops::DerefMut for SharedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut(self.seg.bytes_mut())[..len]
    }
}

impl<T: Element> Drop for SharedBuf<T> {
    fn drop(&mut self) {
        let mut reg = registry();
        let start = self.seg.bytes().as_ptr() as usize;
        if reg.get(&start).is_some_and(|r| r.serial == self.serial) {
            reg.remove(&start);
        }
    }
}

impl<T: Element> std::fmt::Debug for SharedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuf<{}>[{}]", T::DTYPE, self.len)
    }
}

/// One live [`SharedBuf`] of this process.
#[derive(Clone, Copy, Debug)]
struct Region {
    start: usize,
    bytes: usize,
    fd: i32,
    ino: u64,
    serial: u64,
}

/// This process's live shared buffers, by first address.
fn registry() -> std::sync::MutexGuard<'static, BTreeMap<usize, Region>> {
    static REGISTRY: Mutex<BTreeMap<usize, Region>> = Mutex::new(BTreeMap::new());
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks a posted record as naming a shared buffer (in `handle[4..8]`).
const SHARED: u32 = 1;

/// Where `record` (this rank's posted input: `handle[..4]` the pid, `offset` its address,
/// `bytes` its length) lies in a shared buffer, if it does: adds the buffer's descriptor,
/// inode, size and the input's offset in it. Record layout: `handle[4..8]` [`SHARED`],
/// `[8..12]` the descriptor, `[16..24]` the buffer's bytes, `[24..32]` the input's offset in
/// it, `[32..40]` the inode; `id` the buffer's serial.
pub(crate) fn mark_shared(record: &mut ShareRecord) {
    let (at, len) = (record.offset as usize, record.bytes as usize);
    let reg = registry();
    let Some((_, r)) = reg.range(..=at).next_back() else {
        return;
    };
    if at + len > r.start + r.bytes {
        return;
    }
    let h = &mut record.handle;
    h[4..8].copy_from_slice(&SHARED.to_le_bytes());
    h[8..12].copy_from_slice(&r.fd.to_le_bytes());
    h[16..24].copy_from_slice(&(r.bytes as u64).to_le_bytes());
    h[24..32].copy_from_slice(&((at - r.start) as u64).to_le_bytes());
    h[32..40].copy_from_slice(&r.ino.to_le_bytes());
    record.id = r.serial;
}

/// A field of a posted record.
fn field<const N: usize>(h: &[u8; 64], at: usize) -> [u8; N] {
    h[at..at + N].try_into().expect("in the handle")
}

/// A mapping of a peer's shared buffer.
struct PeerMap {
    pid: u32,
    serial: u64,
    seg: PeerSegment,
}

/// The other ranks' shared buffers this rank has mapped, per rank, the latest last.
pub(crate) struct PeerMaps {
    maps: Mutex<Vec<VecDeque<PeerMap>>>,
}

impl PeerMaps {
    /// None mapped yet, for `ranks` ranks.
    pub(crate) fn new(ranks: usize) -> PeerMaps {
        PeerMaps {
            maps: Mutex::new((0..ranks).map(|_| VecDeque::new()).collect()),
        }
    }

    /// Copy `dst.len()` bytes at byte `at` of rank `from`'s posted input `record` into `dst`
    /// through this rank's mapping of its shared buffer (`streaming`: with streaming stores).
    /// `Ok(false)` when the input lies in no shared buffer; `Err` when the buffer could not be
    /// mapped (the caller reads with `process_vm_readv` instead).
    pub(crate) fn read(
        &self,
        from: usize,
        record: &ShareRecord,
        at: usize,
        dst: &mut [u8],
        streaming: bool,
    ) -> std::io::Result<bool> {
        let h = &record.handle;
        if u32::from_le_bytes(field(h, 4)) != SHARED {
            return Ok(false);
        }
        let pid = u32::from_le_bytes(field(h, 0));
        let fd = i32::from_le_bytes(field(h, 8));
        let bytes = u64::from_le_bytes(field(h, 16)) as usize;
        let offset = u64::from_le_bytes(field(h, 24)) as usize;
        let ino = u64::from_le_bytes(field(h, 32));
        let start = offset + at;
        if start + dst.len() > bytes {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} bytes at {start} of a {bytes}-byte shared buffer",
                    dst.len()
                ),
            ));
        }
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        let maps = &mut maps[from];
        let found = maps
            .iter()
            .position(|m| m.pid == pid && m.serial == record.id);
        let m = match found {
            Some(i) => &maps[i],
            None => {
                let seg = PeerSegment::open(pid, fd, ino, bytes)?;
                if maps.len() == MAPS_PER_RANK {
                    maps.pop_front();
                }
                maps.push_back(PeerMap {
                    pid,
                    serial: record.id,
                    seg,
                });
                maps.back().expect("just pushed")
            }
        };
        // In bounds: the mapping is at least `bytes` long (checked when it was opened) and
        // `start + dst.len() <= bytes` (checked above). The owner does not write the range
        // during the call that posted it (its caller lent it for the call), and a rank that
        // fails raises the board's abort flag before returning, which every reader checks after
        // its reads.
        let src = &m.seg.bytes()[start..start + dst.len()];
        if streaming {
            ringzero_kernels::cpu::copy_streaming(dst, src).expect("equal lengths");
            ringzero_kernels::cpu::stream_fence();
        } else {
            dst.copy_from_slice(src);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn posted(at: *const u8, len: usize) -> ShareRecord {
        let mut r = ShareRecord::zeroed();
        r.handle[..4].copy_from_slice(&std::process::id().to_le_bytes());
        r.offset = at as u64;
        r.bytes = len as u64;
        r
    }

    use bytemuck::Zeroable;

    #[test]
    fn inputs_inside_a_shared_buffer_are_read_through_a_kept_mapping() {
        let mut buf = SharedBuf::<i32>::zeroed(1000).unwrap();
        for (i, x) in buf.iter_mut().enumerate() {
            *x = i as i32;
        }
        // Elements 100..300 as an input.
        let input = &buf[100..300];
        let mut rec = posted(input.as_ptr().cast(), 800);
        mark_shared(&mut rec);
        assert_eq!(rec.id, buf.serial);
        let peers = PeerMaps::new(2);
        let mut dst = [0u8; 40];
        // Bytes 8.. of the input: elements 102..112.
        assert!(peers.read(1, &rec, 8, &mut dst, false).unwrap());
        let got: &[i32] = bytemuck::cast_slice(&dst);
        assert_eq!(got, &(102..112).collect::<Vec<i32>>()[..]);
        assert_eq!(peers.maps.lock().unwrap()[1].len(), 1);
        // Again: the same mapping.
        assert!(peers.read(1, &rec, 0, &mut dst, true).unwrap());
        assert_eq!(peers.maps.lock().unwrap()[1].len(), 1);
        // Past the buffer's end: refused, nothing read.
        let e = peers.read(1, &rec, 4000, &mut dst, false).unwrap_err();
        assert!(e.to_string().contains("shared buffer"), "{e}");

        // Memory outside any shared buffer, or reaching past one's end, is not marked.
        let plain = [0u8; 64];
        let mut rec = posted(plain.as_ptr(), 64);
        mark_shared(&mut rec);
        assert!(!peers.read(1, &rec, 0, &mut dst, false).unwrap());
        let mut rec = posted(buf[900..].as_ptr().cast(), 800);
        mark_shared(&mut rec);
        assert!(!peers.read(1, &rec, 0, &mut dst, false).unwrap());
    }

    #[test]
    fn a_peer_keeps_its_latest_mappings_only_and_dropped_buffers_leave_the_registry() {
        let peers = PeerMaps::new(1);
        let mut dst = [0u8; 4];
        let mut serials = vec![];
        for k in 0..MAPS_PER_RANK + 2 {
            let mut buf = SharedBuf::<i32>::zeroed(4).unwrap();
            buf[0] = k as i32;
            let mut rec = posted(buf.as_ptr().cast(), 16);
            mark_shared(&mut rec);
            assert!(peers.read(0, &rec, 0, &mut dst, false).unwrap());
            assert_eq!(u32::from_le_bytes(dst), k as u32);
            serials.push(buf.serial);
            let start = buf.as_ptr() as usize;
            drop(buf);
            assert!(registry()
                .get(&start)
                .is_none_or(|r| r.serial != serials[k]));
        }
        let kept: Vec<u64> = peers.maps.lock().unwrap()[0]
            .iter()
            .map(|m| m.serial)
            .collect();
        assert_eq!(kept, serials[2..]);
    }
}
