//! The host: kernel, NVIDIA driver, virtualisation, container, privileges, /dev/shm, memlock, IPC
//! namespace, IOMMU. Read from a sysfs root and a procfs root so fixtures can stand in for both;
//! the few facts that only the live system has (effective uid) are read only when the roots are the
//! real ones.

use std::path::Path;

use serde::Serialize;

/// What the host looks like.
#[derive(Clone, Debug, Serialize)]
pub struct Host {
    /// Kernel release.
    pub kernel: Option<String>,
    /// First line of /proc/driver/nvidia/version, if the driver is loaded.
    pub nvidia_driver: Option<String>,
    /// Running under a hypervisor (cpuinfo `hypervisor` flag or a DMI vendor that says so).
    pub virtual_machine: Option<String>,
    /// Signs of a container (cgroup names, marker files).
    pub container: Option<String>,
    /// Effective uid 0 (only known on the live system).
    pub root: Option<bool>,
    /// Size of the /dev/shm mount in bytes, from the mount table.
    pub shm_bytes: Option<u64>,
    /// Free bytes in /dev/shm (live system only).
    pub shm_free_bytes: Option<u64>,
    /// Max locked memory in bytes (None: unlimited or unknown).
    pub memlock_bytes: Option<u64>,
    /// Whether memlock is unlimited.
    pub memlock_unlimited: bool,
    /// This process's IPC namespace differs from PID 1's.
    pub private_ipc_namespace: Option<bool>,
    /// An MPS daemon's process (`nvidia-cuda-mps-control` or `-server`) and its pid, from procfs.
    /// Without one, processes that share a GPU take turns on it.
    pub mps: Option<String>,
    /// IOMMU: kernel command-line parameters about it.
    pub iommu_cmdline: Vec<String>,
    /// IOMMU: groups present (the IOMMU is active).
    pub iommu_active: bool,
}

/// The first process under `procfs` whose name says it is an MPS daemon: `name (pid N)`.
fn mps_process(procfs: &Path) -> Option<String> {
    let entries = std::fs::read_dir(procfs).ok()?;
    // Bounded: one pass over the pid directories that exist.
    entries.flatten().find_map(|e| {
        let name = e.file_name();
        let pid = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))?;
        let comm = read(&e.path().join("comm"))?;
        let comm = comm.trim();
        comm.starts_with("nvidia-cuda-mps")
            .then(|| format!("{comm} (pid {pid})"))
    })
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

/// Read the host facts.
pub fn read_host(sysfs: &Path, procfs: &Path, live: bool) -> Host {
    let kernel = read(&procfs.join("sys/kernel/osrelease")).map(|s| s.trim().to_string());
    let nvidia_driver = read(&procfs.join("driver/nvidia/version"))
        .and_then(|s| s.lines().next().map(str::to_string));
    let hypervisor = read(&procfs.join("cpuinfo")).is_some_and(|c| {
        c.lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|w| w == "hypervisor"))
    });
    let dmi = read(&sysfs.join("class/dmi/id/sys_vendor")).map(|s| s.trim().to_string());
    let virtual_machine = match (hypervisor, dmi) {
        (true, Some(v)) => Some(format!("hypervisor flag set; system vendor `{v}`")),
        (true, None) => Some("hypervisor flag set".into()),
        (false, _) => None,
    };
    let cgroup = read(&procfs.join("1/cgroup")).unwrap_or_default();
    let container = ["docker", "kubepods", "containerd", "lxc", "libpod"]
        .iter()
        .find(|k| cgroup.contains(*k))
        .map(|k| format!("PID 1's cgroup mentions `{k}`"))
        .or_else(|| {
            (live && Path::new("/.dockerenv").exists()).then(|| "/.dockerenv exists".into())
        })
        .or_else(|| {
            (live && Path::new("/run/.containerenv").exists())
                .then(|| "/run/.containerenv exists".into())
        });
    let shm_bytes = read(&procfs.join("mounts")).and_then(|m| {
        m.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && f[1] == "/dev/shm").then(|| {
                f[3].split(',')
                    .find_map(|o| o.strip_prefix("size="))
                    .and_then(parse_size)
            })?
        })
    });
    let shm_free_bytes = if live {
        rustix::fs::statvfs("/dev/shm")
            .ok()
            .map(|s| s.f_bavail * s.f_frsize)
    } else {
        None
    };
    let (memlock_bytes, memlock_unlimited) = read(&procfs.join("self/limits"))
        .and_then(|l| {
            l.lines()
                .find(|x| x.starts_with("Max locked memory"))
                .map(|x| {
                    let soft = x.split_whitespace().nth(3).unwrap_or("");
                    if soft == "unlimited" {
                        (None, true)
                    } else {
                        (soft.parse().ok(), false)
                    }
                })
        })
        .unwrap_or((None, false));
    let ns = |p: &str| std::fs::read_link(procfs.join(p)).ok();
    let private_ipc_namespace = match (ns("self/ns/ipc"), ns("1/ns/ipc")) {
        (Some(a), Some(b)) => Some(a != b),
        _ => None,
    };
    let iommu_cmdline = read(&procfs.join("cmdline"))
        .map(|c| {
            c.split_whitespace()
                .filter(|w| w.contains("iommu"))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let iommu_active =
        std::fs::read_dir(sysfs.join("kernel/iommu_groups")).is_ok_and(|mut d| d.next().is_some());
    let root = live.then(|| rustix::process::geteuid().is_root());
    let mps = mps_process(procfs);
    Host {
        mps,
        kernel,
        nvidia_driver,
        virtual_machine,
        container,
        root,
        shm_bytes,
        shm_free_bytes,
        memlock_bytes,
        memlock_unlimited,
        private_ipc_namespace,
        iommu_cmdline,
        iommu_active,
    }
}

/// The type of IOMMU group `g` (`DMA`, `DMA-FQ`, `identity`, ...).
pub fn iommu_group_type(sysfs: &Path, g: u32) -> Option<String> {
    read(&sysfs.join(format!("kernel/iommu_groups/{g}/type"))).map(|s| s.trim().to_string())
}

/// `65536k`, `64m`, `1g`, or bytes.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (n, m) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<u64>().ok().map(|v| v * m)
}
