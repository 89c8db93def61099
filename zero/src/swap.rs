//! The NVMe tier (ZeRO-Infinity's): the optimizer state of the offloaded buckets in one file
//! per rank, read into host buffers before a bucket's CPU step and written back after it.
//!
//! - **Layout**: bucket `b` owns a region of `parts` stretches (the fp32 master, then each
//!   optimizer state), each rounded up to 4096 bytes, so every read and write is aligned for
//!   direct I/O; a `Staged` buffer holds one region in the same layout.
//! - **Direct I/O**: the file is opened with `O_DIRECT` (the page cache would hold a second copy
//!   of state that is on the disk to save memory); a filesystem that refuses it (tmpfs) gets
//!   buffered I/O, said once in the log. Each region moves in `aio.block_size` requests spread
//!   over `aio.thread_count` threads.
//! - **Safety**: the file is created new (`O_EXCL`) under `nvme_path` for this engine, its whole
//!   size reserved at once (`fallocate`), so a disk that is too small is an error when the
//!   engine is built — naming the bytes needed — rather than a step that fails half-written;
//!   it is removed when the engine drops. It is working memory, not a checkpoint: after a crash
//!   a run resumes from `save_checkpoint`'s files, never from a swap file.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Aio;
use crate::error::ZeroError;

const ALIGN: usize = 4096;

/// One page: buffers of pages suit direct I/O and every dtype.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; ALIGN]);

/// Host memory holding one bucket's region: `parts` stretches of `elems` f32s, `stride` bytes
/// apart.
pub(crate) struct Staged {
    mem: Box<[Page]>,
    stride: usize,
    elems: usize,
    parts: usize,
}

impl Staged {
    fn bytes(&self) -> &[u8] {
        bytemuck_pages(&self.mem, self.stride * self.parts)
    }

    /// Bytes of host memory it holds.
    pub(crate) fn capacity(&self) -> usize {
        self.mem.len() * ALIGN
    }

    /// The stretches: the master first, then the states.
    pub(crate) fn parts_mut(&mut self) -> Vec<&mut [f32]> {
        let (stride, elems, parts) = (self.stride, self.elems, self.parts);
        let all = pages_mut(&mut self.mem, stride * parts);
        all.chunks_mut(stride)
            .map(|c| bytemuck::cast_slice_mut::<u8, f32>(&mut c[..elems * 4]))
            .collect()
    }
}

fn bytemuck_pages(p: &[Page], len: usize) -> &[u8] {
    // SAFETY: `Page` is plain bytes with no padding; the slice covers whole pages.
    let all = unsafe { std::slice::from_raw_parts(p.as_ptr().cast::<u8>(), p.len() * ALIGN) };
    &all[..len]
}

fn pages_mut(p: &mut [Page], len: usize) -> &mut [u8] {
    // SAFETY: as in `bytemuck_pages`, borrowed mutably from `p`.
    let all =
        unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr().cast::<u8>(), p.len() * ALIGN) };
    &mut all[..len]
}

/// The start of a buffer that I/O threads fill in disjoint pieces.
struct Base(*mut u8);
// SAFETY: the threads write disjoint pieces (see `Swap::read`), so sharing the pointer is as
// safe as splitting the slice.
unsafe impl Sync for Base {}

/// The swap file of one engine (see the module docs).
pub(crate) struct Swap {
    /// What it holds: `optimizer` state or `param` shards (DeepSpeed's key names).
    what: &'static str,
    path: PathBuf,
    file: File,
    /// Whether the file was opened with `O_DIRECT`.
    direct: bool,
    /// Per bucket: (byte offset of its region, f32s per stretch); `None` for a bucket whose
    /// state is not on this tier.
    regions: Vec<Option<(u64, usize)>>,
    parts: usize,
    block: usize,
    threads: usize,
    size: u64,
    /// Bytes read and written so far.
    read: AtomicU64,
    written: AtomicU64,
}

/// Bytes of one stretch of `elems` f32s, rounded up to the alignment.
fn stride(elems: usize) -> usize {
    (elems * 4).div_ceil(ALIGN).max(1) * ALIGN
}

impl Swap {
    /// A new swap file under `dir` for rank `rank`: a region per bucket whose entry in `elems`
    /// is `Some(f32s per stretch)`, `parts` stretches each, the whole size reserved now.
    pub(crate) fn create(
        dir: &Path,
        (what, rank): (&'static str, usize),
        elems: &[Option<usize>],
        parts: usize,
        aio: &Aio,
    ) -> Result<Swap, ZeroError> {
        let io = |what: String| move |e: std::io::Error| ZeroError::Offload(format!("{what}: {e}"));
        std::fs::create_dir_all(dir).map_err(io(format!(
            "creating the NVMe tier's directory {} (offload_{what}.nvme_path)",
            dir.display()
        )))?;
        let path = dir.join(format!(
            "ringzero-swap-{what}-rank{rank}-pid{}-{:x}.bin",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        ));
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create_new(true);
            if direct {
                o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
            }
            o.open(&path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                let f = open(false).map_err(io(format!("creating {}", path.display())))?;
                (f, false)
            }
            Err(e) => return Err(io(format!("creating {}", path.display()))(e)),
        };
        if !direct {
            tracing::info!(
                target: "ringzero::zero",
                "{}: the filesystem refuses direct I/O (O_DIRECT); the NVMe tier reads and \
                 writes through the page cache",
                dir.display()
            );
        }
        let mut at = 0u64;
        let regions = elems
            .iter()
            .map(|e| {
                e.map(|n| {
                    let r = (at, n);
                    at += (stride(n) * parts) as u64;
                    r
                })
            })
            .collect();
        let swap = Swap {
            what,
            path,
            file,
            direct,
            regions,
            parts,
            block: aio.block_size,
            threads: aio.thread_count,
            size: at,
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
        };
        // Reserve every byte now: a full disk fails here, not in a step.
        if at > 0 {
            rustix::fs::fallocate(&swap.file, rustix::fs::FallocateFlags::empty(), 0, at).map_err(
                |e| {
                    ZeroError::Offload(format!(
                        "reserving {at} bytes for the {what} state in {} \
                         (offload_{what}.nvme_path): {e}; free that much space there or \
                         choose another directory",
                        dir.display()
                    ))
                },
            )?;
        }
        Ok(swap)
    }

    /// A host buffer that holds the largest region.
    pub(crate) fn staged(&self) -> Staged {
        let elems = self
            .regions
            .iter()
            .flatten()
            .map(|r| r.1)
            .max()
            .unwrap_or(0);
        let s = stride(elems);
        Staged {
            mem: vec![Page([0; ALIGN]); (s * self.parts) / ALIGN].into_boxed_slice(),
            stride: s,
            elems,
            parts: self.parts,
        }
    }

    /// Shape `buf` for bucket `b`'s region: its byte offset in the file and length.
    pub(crate) fn shape(&self, b: usize, buf: &mut Staged) -> (u64, usize) {
        let (at, elems) = self.regions[b].expect("bucket on the NVMe tier");
        buf.stride = stride(elems);
        buf.elems = elems;
        (at, buf.stride * self.parts)
    }

    /// Bytes of bucket `b`'s region (each stretch rounded up to 4096).
    pub(crate) fn region_bytes(&self, b: usize) -> usize {
        let (_, elems) = self.regions[b].expect("bucket on the NVMe tier");
        stride(elems) * self.parts
    }

    /// Read bucket `b`'s region into the host memory at `host`.
    ///
    /// # Safety
    /// `host` must start [`Swap::region_bytes`]`(b)` bytes of writable host memory, aligned to
    /// 4096 and borrowed by nothing else until this returns.
    pub(crate) unsafe fn read_raw(&self, b: usize, host: *mut u8) -> Result<(), ZeroError> {
        let (at, _) = self.regions[b].expect("bucket on the NVMe tier");
        let len = self.region_bytes(b);
        let base = Base(host);
        self.blocks(len, |off, n| -> std::io::Result<()> {
            let base = &base;
            // SAFETY: `blocks` hands out disjoint `(off, n)` pieces of the `len` bytes the
            // caller lends at `host` until this returns.
            let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(off), n) };
            self.file.read_exact_at(piece, at + off as u64)
        })
        .map_err(|e| self.failed("reading", b, e))?;
        self.read.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Write bucket `b`'s region from the host memory at `host`.
    ///
    /// # Safety
    /// `host` must start [`Swap::region_bytes`]`(b)` bytes of readable host memory, aligned to
    /// 4096 and not written until this returns.
    pub(crate) unsafe fn write_raw(&self, b: usize, host: *const u8) -> Result<(), ZeroError> {
        let (at, _) = self.regions[b].expect("bucket on the NVMe tier");
        let len = self.region_bytes(b);
        // SAFETY: guaranteed by the caller.
        let bytes = unsafe { std::slice::from_raw_parts(host, len) };
        self.blocks(len, |off, n| {
            self.file
                .write_all_at(&bytes[off..off + n], at + off as u64)
        })
        .map_err(|e| self.failed("writing", b, e))?;
        self.written.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Read bucket `b`'s state into `buf`.
    pub(crate) fn read(&self, b: usize, buf: &mut Staged) -> Result<(), ZeroError> {
        let (_, len) = self.shape(b, buf);
        let bytes = pages_mut(&mut buf.mem, len);
        // SAFETY: `bytes` is the region's length of `buf`'s pages (page-aligned), borrowed
        // mutably until this returns.
        unsafe { self.read_raw(b, bytes.as_mut_ptr()) }
    }

    /// Write `buf` as bucket `b`'s state.
    pub(crate) fn write(&self, b: usize, buf: &mut Staged) -> Result<(), ZeroError> {
        let (_, len) = self.shape(b, buf);
        let bytes = &buf.bytes()[..len];
        // SAFETY: `bytes` is the region's length of `buf`'s pages, borrowed until this returns.
        unsafe { self.write_raw(b, bytes.as_ptr()) }
    }

    /// `f(offset, length)` over `len` bytes in blocks, on up to `threads` threads.
    fn blocks(
        &self,
        len: usize,
        f: impl Fn(usize, usize) -> std::io::Result<()> + Sync,
    ) -> std::io::Result<()> {
        let count = len.div_ceil(self.block);
        let threads = self.threads.clamp(1, count.max(1));
        let per = count.div_ceil(threads);
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let f = &f;
                    sc.spawn(move || {
                        for k in t * per..((t + 1) * per).min(count) {
                            let off = k * self.block;
                            f(off, self.block.min(len - off))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles
                .into_iter()
                .try_for_each(|h| h.join().expect("an I/O thread panicked"))
        })
    }

    fn failed(&self, what: &str, b: usize, e: std::io::Error) -> ZeroError {
        ZeroError::Offload(format!(
            "{what} bucket {b}'s {} in {}: {e}",
            self.what,
            self.path.display()
        ))
    }

    /// Bytes the file holds.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Bytes read and written so far.
    pub(crate) fn moved(&self) -> (u64, u64) {
        (
            self.read.load(Ordering::Relaxed),
            self.written.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(target: "ringzero::zero", "removing {}: {e}", self.path.display());
        }
    }
}

/// The NVMe tier's throughput against a plain direct-I/O copy of the same bytes on the same
/// disk, measured in one run ([`bench()`]; `ringzero nvme`). GB/s are 10⁹ bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierBench {
    /// Bytes moved each way per round.
    pub bytes: u64,
    /// Whether the filesystem took `O_DIRECT` (buffered I/O measures the page cache).
    pub direct: bool,
    /// The tier's writes and reads (its `aio` settings: block size, threads).
    pub tier_write_gbs: f64,
    /// (see `tier_write_gbs`)
    pub tier_read_gbs: f64,
    /// One thread writing and reading the same bytes from the same buffer in 8 MiB requests,
    /// `O_DIRECT` where the filesystem takes it.
    pub plain_write_gbs: f64,
    /// (see `plain_write_gbs`)
    pub plain_read_gbs: f64,
}

/// Write and read `bytes` through the NVMe tier in `dir` with `aio`'s settings, then the same
/// bytes with one thread's plain `pwrite`/`pread` to a file beside it; the best of `rounds`
/// rounds each. Both files are removed.
pub fn bench(dir: &Path, bytes: usize, aio: &Aio, rounds: usize) -> Result<TierBench, ZeroError> {
    let elems = bytes.div_ceil(4).max(1);
    let swap = Swap::create(dir, ("optimizer", 0), &[Some(elems)], 1, aio)?;
    let mut buf = swap.staged();
    for (i, x) in buf.parts_mut()[0].iter_mut().enumerate() {
        *x = i as f32;
    }
    let len = swap.size() as f64;
    let best = |f: &mut dyn FnMut() -> Result<(), ZeroError>| -> Result<f64, ZeroError> {
        let mut t = f64::INFINITY;
        for _ in 0..rounds.max(1) {
            let t0 = std::time::Instant::now();
            f()?;
            t = t.min(t0.elapsed().as_secs_f64());
        }
        Ok(len / t / 1e9)
    };
    let tier_write_gbs = best(&mut || swap.write(0, &mut buf))?;
    let tier_read_gbs = best(&mut || swap.read(0, &mut buf))?;
    let direct = swap.direct;
    drop(swap);
    // The plain copy: one thread, 8 MiB requests, the same bytes.
    let path = dir.join(format!("ringzero-plain-{}.bin", std::process::id()));
    let io = |what: &str| {
        let p = path.display().to_string();
        let what = what.to_string();
        move |e: std::io::Error| ZeroError::Offload(format!("{what} {p}: {e}"))
    };
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(true);
    if direct {
        o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
    }
    let file = o.open(&path).map_err(io("creating"))?;
    // From and into the tier's own buffer: the same bytes in the same memory (how fast O_DIRECT
    // moves a buffer depends on the buffer's pages too).
    const REQ: usize = 8 << 20;
    let n = len as usize;
    let plain = (|| -> Result<(f64, f64), ZeroError> {
        let w = best(&mut || {
            for (k, c) in bytemuck_pages(&buf.mem, n).chunks(REQ).enumerate() {
                file.write_all_at(c, (k * REQ) as u64)
                    .map_err(io("writing"))?;
            }
            Ok(())
        })?;
        let r = best(&mut || {
            for (k, c) in pages_mut(&mut buf.mem, n).chunks_mut(REQ).enumerate() {
                file.read_exact_at(c, (k * REQ) as u64)
                    .map_err(io("reading"))?;
            }
            Ok(())
        })?;
        Ok((w, r))
    })();
    let _ = std::fs::remove_file(&path);
    let (plain_write_gbs, plain_read_gbs) = plain?;
    Ok(TierBench {
        bytes: len as u64,
        direct,
        tier_write_gbs,
        tier_read_gbs,
        plain_write_gbs,
        plain_read_gbs,
    })
}
