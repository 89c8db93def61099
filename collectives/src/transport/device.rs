//! The link contract for device buffers, and its one implementation over a shared-memory FIFO.
//!
//! The device engine never touches payload bytes itself: it queues kernels and copies on a stream
//! that read and write *slot addresses*, and it keeps several frames in flight, because a frame may
//! only be published once the work writing it has completed, and a slot may only be given back once
//! the kernel reading it has. So the device contract differs from the host one ([`super::SendLink`])
//! in two ways: a slot is an address the device can use, and reserve/post and peek/release are
//! split so that up to `slots` frames can be between the two.
//!
//! Both device transports inside a node are the same shared-memory FIFO protocol
//! ([`super::shm`]: head, tail, slot headers, abort flag); they differ only in where the slots'
//! bytes are:
//! - `cuda_ipc`: in the receiver's device memory (`cuMemAlloc`, exported with an IPC handle and
//!   opened by the sender), the shm file holding only the control block;
//! - `shm` (host staging): in the shm file itself, page-locked and mapped into each process's device
//!   address space, so the sender's kernel writes its result straight into the receiver's staging
//!   slot and the receiver's kernel reduces straight out of it (no separate host↔device copies).
//!
//! A [`FifoSend`]/[`FifoRecv`] is therefore the shm FIFO plus the device address of slot 0 and an
//! owner that keeps that memory mapped (an IPC mapping, an exported allocation, a host
//! registration) for as long as the link lives.
//!
//! Between nodes, [`TcpDevSend`]/[`TcpDevRecv`] wrap the tcp transport's staging slots, page-locked
//! and mapped into the device: the sender's kernel writes a frame's payload into a staging slot
//! and the frame is written to the socket once that work completes; the receiver reads frames
//! into its slots while kernels still reduce out of earlier ones. Socket traffic, device copies
//! and kernels of consecutive slices overlap, up to `slots` frames per direction.

use std::any::Any;
use std::time::Duration;

use super::shm::{ShmRecv, ShmSend};
use super::tcp::{TcpRecv, TcpSend};
use super::{LinkResult, TransportKind};
use crate::wire::{Expect, FrameHeader};

pub use ringzero_kernels::DevPtr;

/// The sending half of a device ring edge.
pub trait DevSendLink: Send {
    /// The backend.
    fn kind(&self) -> TransportKind;
    /// Largest payload of one frame.
    fn slot_bytes(&self) -> usize;
    /// The address of the next free slot, reserved for a frame [`DevSendLink::post`] publishes
    /// later; `None` while every credit is taken. Reservations are posted in order.
    fn reserve(&mut self) -> LinkResult<Option<DevPtr>>;
    /// Publish the oldest reserved slot (its bytes are complete).
    fn post(&mut self, header: &FrameHeader) -> LinkResult<()>;
    /// Move posted frames along (tcp: write them from the staging slots). Whether any moved.
    fn progress(&mut self) -> LinkResult<bool> {
        Ok(false)
    }
    /// Whether every posted frame has left this process.
    fn flushed(&self) -> bool {
        true
    }
    /// Device scratch standing in for the reserved slot at `slot` (explicit-copy host staging:
    /// a kernel writes its result here and a copy moves it into the slot), if the link has it.
    fn scratch(&self, _slot: DevPtr) -> Option<DevPtr> {
        None
    }
    /// Whether the peer is still there.
    fn health(&mut self) -> LinkResult<()>;
    /// Tell the peer this rank aborts.
    fn abort(&mut self, reason: &str);
}

/// The receiving half of a device ring edge.
pub trait DevRecvLink: Send {
    /// The backend.
    fn kind(&self) -> TransportKind;
    /// The address of the next frame not yet consumed, once it has arrived and matches `expect`.
    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<DevPtr>>;
    /// Move past the frame peeked last; its slot stays held until [`DevRecvLink::release`].
    fn consume(&mut self);
    /// Give the oldest held slot back (the kernel reading it has completed).
    fn release(&mut self) -> LinkResult<()>;
    /// Device scratch for the held slot at `slot` (explicit-copy host staging: the slot is copied
    /// here before a kernel reads it), if the link has it.
    fn scratch(&self, _slot: DevPtr) -> Option<DevPtr> {
        None
    }
    /// Whether the peer is still there.
    fn health(&mut self) -> LinkResult<()>;
    /// Tell the peer this rank aborts.
    fn abort(&mut self, reason: &str);
}

/// Keeps a link's slot memory usable (dropped before the FIFO's own mapping).
pub type Keep = Box<dyn Any + Send>;

/// The device side of an shm FIFO, the same at both ends: where its slots are for the device
/// (slot `i` at `base + i × slot_bytes`), what keeps that memory usable, and optional device
/// scratch parallel to the slots (explicit-copy staging).
struct DevSlots {
    keep: Keep,
    kind: TransportKind,
    base: DevPtr,
    slot_bytes: usize,
    /// Scratch base and its owner.
    scratch: Option<(DevPtr, Keep)>,
}

impl DevSlots {
    fn new(kind: TransportKind, base: DevPtr, slot_bytes: usize, keep: Keep) -> DevSlots {
        DevSlots {
            keep,
            kind,
            base,
            slot_bytes,
            scratch: None,
        }
    }

    /// The device address of slot `i`.
    fn addr(&self, i: usize) -> DevPtr {
        self.base + (i * self.slot_bytes) as u64
    }

    /// The scratch of the slot at device address `slot`.
    fn scratch(&self, slot: DevPtr) -> Option<DevPtr> {
        self.scratch.as_ref().map(|(b, _)| b + (slot - self.base))
    }
}

/// Sender over an shm FIFO whose slots start at device address `base`.
pub struct FifoSend {
    // Declared first so it is dropped first: a host registration must end while the shm file is
    // still mapped.
    dev: DevSlots,
    ctl: ShmSend,
}

impl FifoSend {
    /// Wrap `ctl`; slot `i` is at `base + i * slot_bytes` (the FIFO's geometry).
    pub fn new(ctl: ShmSend, kind: TransportKind, base: DevPtr, keep: Keep) -> FifoSend {
        let (_, slot_bytes) = ctl.geometry();
        FifoSend {
            dev: DevSlots::new(kind, base, slot_bytes, keep),
            ctl,
        }
    }

    /// Give the link device scratch of one slot per slot (base address and owner), if any.
    pub fn with_scratch(mut self, scratch: Option<(DevPtr, Keep)>) -> Self {
        self.dev.scratch = scratch;
        self
    }
}

impl DevSendLink for FifoSend {
    fn kind(&self) -> TransportKind {
        self.dev.kind
    }
    fn slot_bytes(&self) -> usize {
        self.dev.slot_bytes
    }
    fn reserve(&mut self) -> LinkResult<Option<DevPtr>> {
        Ok(self.ctl.reserve_slot()?.map(|s| self.dev.addr(s)))
    }
    fn post(&mut self, header: &FrameHeader) -> LinkResult<()> {
        self.ctl.post_slot(header)
    }
    fn scratch(&self, slot: DevPtr) -> Option<DevPtr> {
        self.dev.scratch(slot)
    }
    fn health(&mut self) -> LinkResult<()> {
        super::SendLink::health(&mut self.ctl)
    }
    fn abort(&mut self, reason: &str) {
        super::SendLink::abort(&mut self.ctl, reason)
    }
}

/// Receiver over an shm FIFO whose slots start at device address `base`.
pub struct FifoRecv {
    // Declared first so it is dropped first (as in `FifoSend`).
    dev: DevSlots,
    ctl: ShmRecv,
}

impl FifoRecv {
    /// Wrap `ctl`; slot `i` is at `base + i * slot_bytes`.
    pub fn new(ctl: ShmRecv, kind: TransportKind, base: DevPtr, keep: Keep) -> FifoRecv {
        let (_, slot_bytes) = ctl.geometry();
        FifoRecv {
            dev: DevSlots::new(kind, base, slot_bytes, keep),
            ctl,
        }
    }

    /// Give the link device scratch of one slot per slot (base address and owner), if any.
    pub fn with_scratch(mut self, scratch: Option<(DevPtr, Keep)>) -> Self {
        self.dev.scratch = scratch;
        self
    }
}

/// How long a dropped `cuda_ipc` receiver waits for its sender to close its IPC mapping of the
/// slots before it frees them.
const IMPORT_CLOSE_WAIT: Duration = Duration::from_secs(2);

impl Drop for FifoRecv {
    fn drop(&mut self) {
        // CUDA leaves it undefined to free exported memory before every importer has closed its
        // IPC mapping, and the sender (another process) drops its end on its own schedule. So the
        // slots are freed only once the sender has detached (or exited); if it has not within
        // the wait (a hung or stuck peer), they are left allocated until this process exits.
        if self.dev.kind == TransportKind::CudaIpc
            && !self.ctl.sender_detached_within(IMPORT_CLOSE_WAIT)
        {
            tracing::warn!(
                target: "ringzero::device",
                "the sender still had this rank's device slots open after {:?}; leaving them \
                 allocated until the process exits",
                IMPORT_CLOSE_WAIT
            );
            std::mem::forget(std::mem::replace(&mut self.dev.keep, Box::new(())));
        }
    }
}

impl DevRecvLink for FifoRecv {
    fn kind(&self) -> TransportKind {
        self.dev.kind
    }
    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<DevPtr>> {
        Ok(self.ctl.peek_slot(expect)?.map(|s| self.dev.addr(s)))
    }
    fn consume(&mut self) {
        self.ctl.consume()
    }
    fn release(&mut self) -> LinkResult<()> {
        self.ctl.release_oldest()
    }
    fn scratch(&self, slot: DevPtr) -> Option<DevPtr> {
        self.dev.scratch(slot)
    }
    fn health(&mut self) -> LinkResult<()> {
        super::RecvLink::health(&mut self.ctl)
    }
    fn abort(&mut self, reason: &str) {
        super::RecvLink::abort(&mut self.ctl, reason)
    }
}

/// Sender over TCP whose staging slots are mapped into the device at `base` (slot `i` at
/// `base + i × stride`).
pub struct TcpDevSend {
    // Declared first so it is dropped first: the registration ends while the staging memory (in
    // `tcp`) is still mapped.
    _keep: Keep,
    tcp: TcpSend,
    base: DevPtr,
    stride: usize,
}

impl TcpDevSend {
    /// Wrap `tcp`, whose staging (see [`TcpSend::staging`]) the device sees at `base`.
    pub fn new(tcp: TcpSend, base: DevPtr, stride: usize, keep: Keep) -> TcpDevSend {
        TcpDevSend {
            _keep: keep,
            tcp,
            base,
            stride,
        }
    }
}

impl DevSendLink for TcpDevSend {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn slot_bytes(&self) -> usize {
        super::SendLink::slot_bytes(&self.tcp)
    }
    fn reserve(&mut self) -> LinkResult<Option<DevPtr>> {
        Ok(self
            .tcp
            .reserve_slot()
            .map(|s| self.base + (s * self.stride) as u64))
    }
    fn post(&mut self, header: &FrameHeader) -> LinkResult<()> {
        self.tcp.post_slot(header)?;
        super::SendLink::progress(&mut self.tcp).map(|_| ())
    }
    fn progress(&mut self) -> LinkResult<bool> {
        super::SendLink::progress(&mut self.tcp)
    }
    fn flushed(&self) -> bool {
        super::SendLink::flushed(&self.tcp)
    }
    fn health(&mut self) -> LinkResult<()> {
        super::SendLink::health(&mut self.tcp)
    }
    fn abort(&mut self, reason: &str) {
        super::SendLink::abort(&mut self.tcp, reason)
    }
}

/// Receiver over TCP whose receive slots are mapped into the device at `base`.
pub struct TcpDevRecv {
    // Declared first so it is dropped first (as for the sender).
    _keep: Keep,
    tcp: TcpRecv,
    base: DevPtr,
    stride: usize,
}

impl TcpDevRecv {
    /// Wrap `tcp`, whose slots (see [`TcpRecv::staging`]) the device sees at `base`.
    pub fn new(tcp: TcpRecv, base: DevPtr, stride: usize, keep: Keep) -> TcpDevRecv {
        TcpDevRecv {
            _keep: keep,
            tcp,
            base,
            stride,
        }
    }
}

impl DevRecvLink for TcpDevRecv {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn peek(&mut self, expect: &Expect) -> LinkResult<Option<DevPtr>> {
        Ok(self
            .tcp
            .peek_slot(expect)?
            .map(|s| self.base + (s * self.stride) as u64))
    }
    fn consume(&mut self) {
        self.tcp.consume()
    }
    fn release(&mut self) -> LinkResult<()> {
        self.tcp.release_oldest()
    }
    fn health(&mut self) -> LinkResult<()> {
        super::RecvLink::health(&mut self.tcp)
    }
    fn abort(&mut self, reason: &str) {
        super::RecvLink::abort(&mut self.tcp, reason)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    /// A stand-in owner of device slots that records whether it was dropped (freed).
    struct Freed(Arc<AtomicBool>);
    impl Drop for Freed {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn ipc_pair(freed: &Arc<AtomicBool>) -> (FifoSend, FifoRecv) {
        let dir = std::env::temp_dir();
        let name = format!(
            "ringzero-ipc-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let ctl = ShmRecv::create_control(&dir, &name, 2, 4096, 0).unwrap();
        let rx = FifoRecv::new(
            ctl,
            TransportKind::CudaIpc,
            0x1000,
            Box::new(Freed(freed.clone())),
        );
        let ctl = ShmSend::attach_control(&dir.join(&name), 2, 4096, 1).unwrap();
        let tx = FifoSend::new(ctl, TransportKind::CudaIpc, 0x1000, Box::new(()));
        (tx, rx)
    }

    #[test]
    fn exported_slots_are_freed_only_after_the_importer_detached() {
        // The sender drops first: the receiver frees at once.
        let freed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = ipc_pair(&freed);
        drop(tx);
        let t = Instant::now();
        drop(rx);
        assert!(freed.load(Ordering::SeqCst));
        assert!(t.elapsed() < IMPORT_CLOSE_WAIT);

        // The sender is still attached: the receiver waits, then leaves the slots allocated.
        let freed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = ipc_pair(&freed);
        let t = Instant::now();
        drop(rx);
        assert!(t.elapsed() >= IMPORT_CLOSE_WAIT);
        assert!(
            !freed.load(Ordering::SeqCst),
            "freed while the importer still had it open"
        );
        drop(tx);

        // The sender detaches while the receiver waits: freed then.
        let freed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = ipc_pair(&freed);
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(tx);
        });
        let t = Instant::now();
        drop(rx);
        late.join().unwrap();
        assert!(freed.load(Ordering::SeqCst));
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < IMPORT_CLOSE_WAIT);
    }
}
