//! The driver's view of the machine: the CUDA devices and what it says about each pair.

use serde::{Deserialize, Serialize};

/// A CUDA device as the driver lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CudaDevice {
    /// Ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// Name.
    pub name: String,
    /// PCI bus id, lower case like sysfs (`0000:3b:00.0`).
    pub pci_bus_id: String,
    /// UUID, hex.
    pub uuid: String,
}

/// What the driver says about peer access from `a` to `b`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CudaPeer {
    /// From this ordinal.
    pub a: usize,
    /// To this ordinal.
    pub b: usize,
    /// `cuDeviceCanAccessPeer`.
    pub can_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is better).
    pub performance_rank: i32,
}

/// The driver's view of the machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CudaInventory {
    /// Devices.
    pub devices: Vec<CudaDevice>,
    /// Every ordered pair of different devices.
    pub peers: Vec<CudaPeer>,
}

impl CudaInventory {
    /// The device at PCI address `bdf` (sysfs spelling), if CUDA sees it.
    pub fn by_bdf(&self, bdf: &str) -> Option<&CudaDevice> {
        self.devices
            .iter()
            .find(|d| d.pci_bus_id.eq_ignore_ascii_case(bdf))
    }

    /// The peer facts from `a` to `b`.
    pub fn peer(&self, a: usize, b: usize) -> Option<&CudaPeer> {
        self.peers.iter().find(|p| p.a == a && p.b == b)
    }
}
