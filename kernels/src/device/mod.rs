//! Where buffers live. Today only the host; the CUDA device joins behind a cargo feature.

use std::fmt;

/// A device that holds buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, reduced by the CPU kernels in [`crate::cpu`].
    #[default]
    Host,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
        }
    }
}
