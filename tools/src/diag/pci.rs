//! PCI topology from sysfs alone: every device's place in the hierarchy (from the path its
//! `/sys/bus/pci/devices/<bdf>` link points to), its link speed and width, NUMA node, IOMMU group,
//! and for bridges the ACS control register. Everything is read under a root prefix so tests run on
//! fixture trees.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::acs::{self, AcsRead};

/// One PCI function.
#[derive(Clone, Debug, Serialize)]
pub struct PciDevice {
    /// Domain:bus:device.function.
    pub bdf: String,
    /// From the root complex (`pci0000:00`) down to this device.
    pub path: Vec<String>,
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Class code (24 bits).
    pub class: u32,
    /// NUMA node, if the platform says.
    pub numa_node: Option<i32>,
    /// Current link speed and width, max speed and width, as sysfs prints them.
    pub link: [String; 4],
    /// IOMMU group, if any.
    pub iommu_group: Option<u32>,
    /// Bytes of config space readable.
    pub config_len: usize,
    /// ACS control register (bridges only).
    #[serde(skip)]
    pub acs: Option<AcsRead>,
}

impl PciDevice {
    /// An NVIDIA display or 3D controller.
    pub fn is_nvidia_gpu(&self) -> bool {
        self.vendor == 0x10de && self.class >> 16 == 0x03
    }

    /// A PCI-to-PCI bridge (root port, switch port).
    pub fn is_bridge(&self) -> bool {
        self.class >> 8 == 0x0604
    }
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn hex(p: &Path) -> Option<u32> {
    read(p).and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
}

/// Every PCI function under `sysfs/bus/pci/devices`, sorted by BDF.
pub fn scan(sysfs: &Path) -> std::io::Result<Vec<PciDevice>> {
    let dir = sysfs.join("bus/pci/devices");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let root = std::fs::canonicalize(sysfs)?;
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        let bdf = e.file_name().to_string_lossy().into_owned();
        let real: PathBuf = std::fs::canonicalize(e.path())?;
        let rel = real.strip_prefix(&root).unwrap_or(&real);
        let path: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .skip_while(|c| !c.starts_with("pci"))
            .collect();
        let d = e.path();
        let config = std::fs::read(d.join("config")).unwrap_or_default();
        let class = hex(&d.join("class")).unwrap_or(0);
        let link = [
            "current_link_speed",
            "current_link_width",
            "max_link_speed",
            "max_link_width",
        ]
        .map(|f| read(&d.join(f)).unwrap_or_else(|| "?".into()));
        let iommu_group = std::fs::read_link(d.join("iommu_group"))
            .ok()
            .and_then(|t| t.file_name().and_then(|n| n.to_str()?.parse().ok()));
        let mut dev = PciDevice {
            bdf,
            path,
            vendor: hex(&d.join("vendor")).unwrap_or(0) as u16,
            device: hex(&d.join("device")).unwrap_or(0) as u16,
            class,
            numa_node: read(&d.join("numa_node"))
                .and_then(|s| s.parse().ok())
                .filter(|n: &i32| *n >= 0),
            link,
            iommu_group,
            config_len: config.len(),
            acs: None,
        };
        if dev.is_bridge() {
            dev.acs = Some(acs::read_acs(&config));
        }
        out.push(dev);
    }
    out.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    Ok(out)
}

/// nvidia-smi's path classes, from closest to farthest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PathClass {
    /// Through at most one PCIe switch.
    PIX,
    /// Through several PCIe switches, not the host bridge.
    PXB,
    /// Through the host bridge (one root complex).
    PHB,
    /// Across host bridges within a NUMA node.
    NODE,
    /// Across NUMA nodes (the CPU interconnect).
    SYS,
}

/// The route between two devices.
#[derive(Clone, Debug, Serialize)]
pub struct Route {
    /// Path class.
    pub class: PathClass,
    /// Bridges on the way, in order (BDFs).
    pub bridges: Vec<String>,
}

/// The route from `a` to `b`.
pub fn route(a: &PciDevice, b: &PciDevice) -> Route {
    let common = a
        .path
        .iter()
        .zip(&b.path)
        .take_while(|(x, y)| x == y)
        .count();
    let ups = &a.path[common.max(1).min(a.path.len())..a.path.len().saturating_sub(1)];
    let downs = &b.path[common.max(1).min(b.path.len())..b.path.len().saturating_sub(1)];
    let mut bridges: Vec<String> = ups.iter().rev().cloned().collect();
    if common >= 2 {
        // The lowest common ancestor is a bridge both sides pass through.
        bridges.push(a.path[common - 1].clone());
    }
    bridges.extend(downs.iter().cloned());
    let class = match common {
        0 if a.numa_node.is_some() && a.numa_node != b.numa_node => PathClass::SYS,
        0 => PathClass::NODE,
        1 => PathClass::PHB,
        _ if bridges.len() <= 3 => PathClass::PIX,
        _ => PathClass::PXB,
    };
    Route { class, bridges }
}
