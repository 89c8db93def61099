//! Memory that other processes on this node map: a sealed `memfd` ([`Segment::create`]) that a
//! peer opens through `/proc/<pid>/fd/<fd>` and maps read-only ([`PeerSegment::open`]). What
//! [`crate::SharedBuf`] is made of; the single-copy all-gather reads such memory with plain
//! loads instead of a `process_vm_readv` per call (`comm/direct.rs`).
//!
//! Why a memfd: it has no name in any directory, so nothing is left behind when a process dies,
//! and its pages live as long as some process maps it. The owner seals its size (no shrinking,
//! no growing) before anyone can open it, so a peer's mapping never reaches past the end of the
//! file (which would raise `SIGBUS`); the peer checks the seals, the size and the inode before it
//! maps. Opening `/proc/<pid>/fd/<fd>` needs the permission `process_vm_readv` needs (same user;
//! Yama's scope allowing it, see [`super::cma::allow_readers`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use rustix::fs::{MemfdFlags, SealFlags};

/// The seals a segment carries: its size is fixed for good.
fn fixed_size() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// This process's segment: `bytes` of zeroed memory, mapped read-write here.
pub struct Segment {
    map: memmap2::MmapMut,
    file: File,
    bytes: usize,
}

impl Segment {
    /// A new segment of `bytes` (zeroed), sealed at that size. `name` shows in `/proc/<pid>/fd`.
    pub fn create(name: &str, bytes: usize) -> io::Result<Segment> {
        let fd: OwnedFd =
            rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        let file = File::from(fd);
        // A mapping is at least one byte long: an empty buffer keeps one page.
        file.set_len(bytes.max(1) as u64)?;
        rustix::fs::fcntl_add_seals(&file, fixed_size())?;
        // SAFETY: the file is this process's own memfd, sealed at its size, so the mapping never
        // reaches past its end; other processes only ever map it read-only.
        let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
        Ok(Segment { map, file, bytes })
    }

    /// The memory, `bytes` long.
    pub fn bytes(&self) -> &[u8] {
        &self.map[..self.bytes]
    }

    /// The memory, `bytes` long.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.bytes]
    }

    /// Where another process finds it: this process's descriptor and the file's inode.
    pub fn locator(&self) -> io::Result<(i32, u64)> {
        Ok((self.file.as_raw_fd(), self.file.metadata()?.ino()))
    }
}

/// Another process's segment, mapped read-only here.
pub struct PeerSegment {
    map: memmap2::Mmap,
}

impl PeerSegment {
    /// Map process `pid`'s segment behind descriptor `fd`, which must be the file with inode
    /// `ino`, sealed at no fewer than `bytes` bytes.
    pub fn open(pid: u32, fd: i32, ino: u64, bytes: usize) -> io::Result<PeerSegment> {
        let file = File::open(format!("/proc/{pid}/fd/{fd}"))?;
        let meta = file.metadata()?;
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if meta.ino() != ino {
            return Err(invalid(format!(
                "descriptor {fd} of process {pid} is no longer the shared buffer (inode {} \
                 where {ino} was posted)",
                meta.ino()
            )));
        }
        if !rustix::fs::fcntl_get_seals(&file)?.contains(SealFlags::SHRINK) {
            return Err(invalid(format!(
                "descriptor {fd} of process {pid} is not sealed against shrinking"
            )));
        }
        if meta.len() < bytes as u64 {
            return Err(invalid(format!(
                "process {pid}'s shared buffer has {} bytes, {bytes} were posted",
                meta.len()
            )));
        }
        // SAFETY: the file cannot shrink (sealed, checked above) and holds at least `bytes`
        // bytes, so every page of a `bytes`-long mapping stays backed. The owner writes it only
        // between the calls that read it (see `comm/direct.rs`).
        let map = unsafe { memmap2::MmapOptions::new().len(bytes.max(1)).map(&file)? };
        Ok(PeerSegment { map })
    }

    /// The mapped memory, at least the `bytes` it was opened for. Its owner writes it only
    /// between the calls that read it (see `comm/direct.rs`).
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_maps_what_the_owner_wrote_and_checks_what_it_opens() {
        let mut seg = Segment::create("ringzero-test", 10_000).unwrap();
        seg.bytes_mut()[9_999] = 7;
        let (fd, ino) = seg.locator().unwrap();
        let pid = std::process::id();
        let peer = PeerSegment::open(pid, fd, ino, 10_000).unwrap();
        assert_eq!(peer.bytes()[9_999], 7);
        // A wrong inode, a size beyond the file, a descriptor that is no segment: refused.
        assert!(PeerSegment::open(pid, fd, ino + 1, 10_000).is_err());
        let e = PeerSegment::open(pid, fd, ino, 1 << 20).err().unwrap();
        assert!(e.to_string().contains("1048576 were posted"), "{e}");
        let other = File::open("/proc/self/status").unwrap();
        let oino = other.metadata().unwrap().ino();
        assert!(PeerSegment::open(pid, other.as_raw_fd(), oino, 1).is_err());
        // Its size is sealed.
        assert!(seg.file.set_len(1).is_err());
        let empty = Segment::create("ringzero-test", 0).unwrap();
        assert!(empty.bytes().is_empty());
    }
}
