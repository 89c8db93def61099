//! [`Counters`]: the bytes and frames a rank's links moved, read by the flight recorder, the
//! bench and the tests.

/// Byte counters of one rank's links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Payload bytes sent to the next rank.
    pub bytes_sent: u64,
    /// Payload bytes received from the previous rank.
    pub bytes_received: u64,
    /// Frames sent.
    pub frames_sent: u64,
    /// Bytes copied between device scratch and host staging slots (explicit-copy staging,
    /// `RINGZERO_STAGING=copy`; both directions).
    pub bytes_staged: u64,
    /// Bytes this rank's direct steps wrote into other ranks' buffers (device communicators
    /// whose ranks all map each other's buffers, `RINGZERO_DEVICE_ALGO`).
    pub bytes_direct: u64,
    /// Bytes this rank's single-copy all-gathers read through its mappings of other ranks'
    /// [`SharedBuf`](crate::SharedBuf)s (host communicators; part of no other counter).
    pub bytes_mapped: u64,
}

/// The counts of two sets of links together.
impl std::ops::Add for Counters {
    type Output = Counters;
    fn add(self, o: Counters) -> Counters {
        Counters {
            bytes_sent: self.bytes_sent + o.bytes_sent,
            bytes_received: self.bytes_received + o.bytes_received,
            frames_sent: self.frames_sent + o.frames_sent,
            bytes_staged: self.bytes_staged + o.bytes_staged,
            bytes_direct: self.bytes_direct + o.bytes_direct,
            bytes_mapped: self.bytes_mapped + o.bytes_mapped,
        }
    }
}
