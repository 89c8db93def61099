//! `ringzero diag`: why multi-GPU communication hangs or crawls. Host, IOMMU, PCI topology and ACS
//! are read from sysfs/procfs (under root prefixes, so fixtures stand in for a machine); probes run
//! in child processes under a watchdog; every GPU pair gets a verdict with its evidence, and the
//! fixes are ranked by reach: environment now, root commands (printed, never run), boot/BIOS.
//!
//! The CUDA part ([`cuda`]) lists devices and peer facts and probes peer copies, host staging,
//! CUDA IPC and ringzero's own ring, all in child processes. Without a CUDA driver or GPU, pairs
//! are judged from topology, IOMMU and ACS alone and the report says the CUDA probes did not run.
//!
//! After a job failed, `diag --flight DIR` ([`flight`]) joins the flight records its ranks wrote
//! and names the rank that was missing, late or calling something else.

pub mod acs;
pub mod cuda;
pub mod flight;
pub mod host;
pub mod pci;
pub mod probe;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use acs::AcsRead;
use host::Host;
use pci::{PathClass, PciDevice, Route};
use probe::{ProbeResult, ProbeStatus};

/// The child side of `ringzero diag-probe NAME`: run probe `name` (a host probe of
/// [`probe`] or a CUDA probe of [`cuda`]) and return its result (printed as JSON by the caller).
pub fn probe_child(name: &str) -> ProbeResult {
    if let Some(r) = probe::host_child(name) {
        return r;
    }
    let Some(p) = cuda::CudaProbe::parse(name) else {
        return ProbeResult::new(
            name,
            ProbeStatus::FAILED,
            None,
            format!("unknown probe `{name}` (expected shm, tcp, hang or cuda-…)"),
        );
    };
    match std::env::current_exe() {
        Ok(exe) => cuda::child(name, p, &exe),
        Err(e) => ProbeResult::new(
            name,
            ProbeStatus::FAILED,
            None,
            format!("finding this executable: {e}"),
        ),
    }
}

/// What to look at.
#[derive(Clone, Debug)]
pub struct DiagArgs {
    /// Where sysfs is (`/sys`).
    pub sysfs_root: PathBuf,
    /// Where procfs is (`/proc`).
    pub procfs_root: PathBuf,
    /// Probes to run in child processes (`shm`, `tcp`, `hang`; `cuda` for the CUDA set).
    pub probes: Vec<String>,
    /// `RINGZERO_P2P_DISABLE` is set where diag runs.
    pub p2p_disabled: bool,
    /// Watchdog timeout per probe.
    pub probe_timeout: Duration,
    /// The executable that runs probes (`ringzero`).
    pub exe: PathBuf,
}

/// Per-pair verdicts, as the issue tracker and users name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[allow(non_camel_case_types)]
pub enum Verdict {
    /// Nothing stands in the way.
    OK,
    /// Peer traffic takes a detour (ACS redirect): expect low bandwidth, or hangs under an IOMMU.
    SLOW,
    /// Data arrived wrong.
    WRONG_DATA,
    /// A probe hung.
    HANG,
    /// The platform does not support peer-to-peer on this path.
    UNSUPPORTED,
    /// Peer-to-peer is switched off by policy (environment).
    POLICY_OFF,
    /// Ranks cannot share IPC handles (namespaces).
    IPC_BLOCKED,
}

impl Verdict {
    fn severity(self) -> u8 {
        match self {
            Verdict::OK => 0,
            Verdict::POLICY_OFF | Verdict::SLOW | Verdict::UNSUPPORTED | Verdict::IPC_BLOCKED => 1,
            Verdict::WRONG_DATA | Verdict::HANG => 2,
        }
    }
}

/// How far a fix reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Reach {
    /// An environment variable, for the next run.
    Environment,
    /// A command that needs root (printed, never run), until reboot.
    RootCommand,
    /// Kernel command line, BIOS, container settings.
    BootOrBios,
}

/// One fix.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fix {
    /// Its reach.
    pub reach: Reach,
    /// What to do.
    pub what: String,
    /// Why, and what it costs.
    pub why: String,
}

/// A GPU pair.
#[derive(Clone, Debug, Serialize)]
pub struct Pair {
    /// First GPU's BDF.
    pub a: String,
    /// Second GPU's BDF.
    pub b: String,
    /// The route between them.
    pub route: Route,
    /// The verdict.
    pub verdict: Verdict,
    /// What it rests on.
    pub evidence: Vec<String>,
}

/// The whole diagnosis.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Host facts.
    pub host: Host,
    /// Warnings about the host (small /dev/shm, memlock, namespaces).
    pub host_findings: Vec<String>,
    /// NVIDIA GPUs found in sysfs.
    pub gpus: Vec<PciDevice>,
    /// Every pair of GPUs.
    pub pairs: Vec<Pair>,
    /// The CUDA devices and peer facts, or why there are none.
    pub cuda: cuda::CudaSection,
    /// Probe results.
    pub probes: Vec<ProbeResult>,
    /// Fixes, most immediate first.
    pub fixes: Vec<Fix>,
    /// 0 OK, 1 degraded, 2 broken.
    pub exit_code: i32,
}

/// Smallest /dev/shm that does not get a warning.
pub const SHM_WARN_BYTES: u64 = 512 << 20;

/// Diagnose. `progress` is told what runs.
pub fn diagnose(a: &DiagArgs, progress: &mut dyn FnMut(&str)) -> std::io::Result<Report> {
    let live = a.sysfs_root == Path::new("/sys") && a.procfs_root == Path::new("/proc");
    let host = host::read_host(&a.sysfs_root, &a.procfs_root, live);
    let devices = pci::scan(&a.sysfs_root)?;
    let gpus: Vec<PciDevice> = devices
        .iter()
        .filter(|d| d.is_nvidia_gpu())
        .cloned()
        .collect();
    let mut probes = Vec::new();
    let mut cuda_section = cuda::CudaSection {
        inventory: None,
        note: "CUDA probes not asked for (--probes without `cuda`)".into(),
    };
    for p in &a.probes {
        if p == "cuda" {
            let (section, results) = cuda::diagnose(&a.exe, a.probe_timeout, progress);
            cuda_section = section;
            probes.extend(results);
            continue;
        }
        progress(&format!(
            "probing {p} (watchdog {:.0}s)",
            a.probe_timeout.as_secs_f64()
        ));
        probes.push(probe::run(&a.exe, p, a.probe_timeout));
    }
    let mut fixes = Vec::new();
    let mut host_findings = Vec::new();
    judge_host(&host, !gpus.is_empty(), &mut host_findings, &mut fixes);
    let staging = probes.iter().find(|p| p.name == "shm").and_then(|p| p.gbs);
    let mut pairs = Vec::new();
    for (i, x) in gpus.iter().enumerate() {
        for y in &gpus[i + 1..] {
            pairs.push(judge_pair(
                x,
                y,
                &devices,
                &a.sysfs_root,
                &host,
                staging,
                &CudaView {
                    section: &cuda_section,
                    probes: &probes,
                    p2p_disabled: a.p2p_disabled,
                },
                &mut fixes,
            ));
        }
    }
    fixes.sort_by_key(|f| f.reach);
    fixes.dedup();
    let worst_pair = pairs
        .iter()
        .map(|p| p.verdict.severity())
        .max()
        .unwrap_or(0);
    let worst_probe = probes
        .iter()
        .map(|p| match p.status {
            ProbeStatus::OK => 0,
            _ => 2,
        })
        .max()
        .unwrap_or(0);
    let host_level = u8::from(!host_findings.is_empty());
    let exit_code = worst_pair.max(worst_probe).max(host_level) as i32;
    Ok(Report {
        host,
        host_findings,
        gpus,
        pairs,
        cuda: cuda_section,
        probes,
        fixes,
        exit_code,
    })
}

fn judge_host(h: &Host, have_gpu: bool, findings: &mut Vec<String>, fixes: &mut Vec<Fix>) {
    if let Some(shm) = h.shm_bytes.filter(|b| *b < SHM_WARN_BYTES) {
        findings.push(format!(
            "/dev/shm is only {} MiB (a container's default is 64 MiB): shared-memory transports (ringzero's, NCCL's) \
             fail or fall back when it fills",
            shm >> 20
        ));
        fixes.push(Fix {
            reach: Reach::Environment,
            what: "RINGZERO_SHM_DISABLE=1".into(),
            why: "use TCP between ranks of this node instead of the small /dev/shm (slower)".into(),
        });
        fixes.push(Fix {
            reach: Reach::BootOrBios,
            what: "restart the container with a larger /dev/shm: docker run --shm-size=8g (or --ipc=host)".into(),
            why: format!("/dev/shm is {} MiB", shm >> 20),
        });
    }
    if have_gpu && !h.memlock_unlimited && h.memlock_bytes.is_some_and(|b| b < 64 << 20) {
        findings.push(format!(
            "max locked memory is {} KiB: pinned host staging buffers (P2P-off fallback) cannot be registered",
            h.memlock_bytes.unwrap_or(0) >> 10
        ));
        fixes.push(Fix {
            reach: Reach::BootOrBios,
            what: "raise the memlock limit: ulimit -l unlimited (docker: --ulimit memlock=-1)"
                .into(),
            why: "cuMemHostRegister needs locked memory".into(),
        });
    }
    if h.private_ipc_namespace == Some(true) {
        findings.push(
            "this process is in its own IPC namespace (not PID 1's): ranks in other containers cannot share CUDA IPC \
             handles or /dev/shm with it"
                .into(),
        );
        fixes.push(Fix {
            reach: Reach::BootOrBios,
            what: "run all ranks' containers with --ipc=host (or in one container)".into(),
            why: "CUDA IPC and shared memory need one IPC namespace".into(),
        });
    }
}

/// What the CUDA part found, for judging pairs.
struct CudaView<'a> {
    section: &'a cuda::CudaSection,
    probes: &'a [ProbeResult],
    p2p_disabled: bool,
}

impl CudaView<'_> {
    fn probe(&self, p: cuda::CudaProbe) -> Option<&ProbeResult> {
        let name = p.name();
        self.probes.iter().find(|r| r.name == name)
    }

    /// The CUDA side of pair `x`–`y`: `None` with the reason when it cannot be judged.
    fn judge(&self, x: &PciDevice, y: &PciDevice) -> Result<cuda::Judged, String> {
        let Some(inv) = &self.section.inventory else {
            return Err(format!("CUDA: {}", self.section.note));
        };
        let (Some(a), Some(b)) = (inv.by_bdf(&x.bdf), inv.by_bdf(&y.bdf)) else {
            return Err(
                "CUDA does not see both GPUs (CUDA_VISIBLE_DEVICES?): no CUDA facts for this pair"
                    .into(),
            );
        };
        let (a, b) = (a.ordinal.min(b.ordinal), a.ordinal.max(b.ordinal));
        let host_copy = [a, b]
            .iter()
            .filter_map(|&o| self.probe(cuda::CudaProbe::Staging(o))?.gbs)
            .reduce(f64::min);
        let staged = self
            .probes
            .iter()
            .find(|r| r.name.starts_with("cuda-ring-staged:") && r.status == ProbeStatus::OK)
            .and_then(|r| r.gbs);
        Ok(cuda::judge(cuda::PairFacts {
            peers: [inv.peer(a, b), inv.peer(b, a)],
            copy: self.probe(cuda::CudaProbe::Copy(a, b)),
            ring: self.probe(cuda::CudaProbe::Ring {
                a,
                b,
                staged: false,
            }),
            staging_busbw: staged,
            host_copy_gbs: host_copy,
            p2p_disabled: self.p2p_disabled,
        }))
    }
}

#[allow(clippy::too_many_arguments)]
fn judge_pair(
    x: &PciDevice,
    y: &PciDevice,
    devices: &[PciDevice],
    sysfs: &Path,
    host: &Host,
    staging_gbs: Option<f64>,
    cuda_view: &CudaView<'_>,
    fixes: &mut Vec<Fix>,
) -> Pair {
    let route = pci::route(x, y);
    let mut verdict = Verdict::OK;
    let mut evidence = vec![format!(
        "path {:?} through {} bridge(s): {}",
        route.class,
        route.bridges.len(),
        route.bridges.join(" → ")
    )];
    let worse = |v: Verdict, current: &mut Verdict| {
        if v.severity() > current.severity() || *current == Verdict::OK {
            *current = v;
        }
    };
    let p2p_off = Fix {
        reach: Reach::Environment,
        what: "RINGZERO_P2P_DISABLE=1".into(),
        why: match staging_gbs {
            Some(g) => format!("stage through host shared memory instead of peer copies (measured here: {g:.2} GB/s per link)"),
            None => "stage through host shared memory instead of peer copies".into(),
        },
    };

    // IOMMU: translated DMA on bare metal breaks peer-to-peer.
    let types: Vec<Option<String>> = [x, y]
        .iter()
        .map(|d| d.iommu_group.and_then(|g| host::iommu_group_type(sysfs, g)))
        .collect();
    for (d, t) in [x, y].iter().zip(&types) {
        if let (Some(g), Some(t)) = (d.iommu_group, t) {
            evidence.push(format!("{} is in IOMMU group {g} (type {t})", d.bdf));
        }
    }
    let translated = types.iter().flatten().any(|t| t == "DMA" || t == "DMA-FQ");
    if translated && host.virtual_machine.is_none() {
        worse(Verdict::UNSUPPORTED, &mut verdict);
        evidence.push(
            "the IOMMU translates DMA for these GPUs on bare metal: CUDA does not support peer-to-peer under IOMMU \
             translation (copies hang or return wrong data)"
                .into(),
        );
        fixes.push(p2p_off.clone());
        fixes.push(Fix {
            reach: Reach::BootOrBios,
            what: "boot with the IOMMU in pass-through: add `iommu=pt` (Intel: `intel_iommu=on iommu=pt`) to the kernel command line"
                .into(),
            why: "identity-mapped DMA lets GPUs address each other".into(),
        });
    }

    // ACS on every bridge of the route.
    let mut unreadable = Vec::new();
    for bdf in &route.bridges {
        let Some(b) = devices.iter().find(|d| &d.bdf == bdf) else {
            continue;
        };
        match &b.acs {
            Some(AcsRead::Found { ctrl, offset }) => {
                let names = acs::decode(*ctrl);
                evidence.push(format!(
                    "bridge {bdf}: ACS control {ctrl:#06x} at {offset:#x}{}",
                    if names.is_empty() {
                        " (all off)".into()
                    } else {
                        format!(": {}", names.join(", "))
                    }
                ));
                if ctrl & acs::REDIRECT_BITS != 0 {
                    worse(Verdict::SLOW, &mut verdict);
                    fixes.push(p2p_off.clone());
                    fixes.push(Fix {
                        reach: Reach::RootCommand,
                        what: format!("setpci -s {bdf} ECAP_ACS+0x6.w=0000"),
                        why: format!("clear ACS redirection on bridge {bdf} so peer traffic stays in the switch (until reboot)"),
                    });
                    fixes.push(Fix {
                        reach: Reach::BootOrBios,
                        what:
                            "disable ACS in the BIOS (often `PCIe ACS` / `ACS Enable` / `ACSCtl`)"
                                .into(),
                        why: "ACS redirects peer-to-peer requests through the root complex".into(),
                    });
                }
            }
            Some(AcsRead::Unreadable { len }) => {
                unreadable.push(format!("{bdf} ({len} bytes visible)"))
            }
            Some(AcsRead::Broken(why)) => evidence.push(format!(
                "bridge {bdf}: ACS unknown, config space corrupt: {why}"
            )),
            Some(AcsRead::Absent) | None => {}
        }
    }
    if !unreadable.is_empty() {
        evidence.push(format!(
            "ACS control could not be read on {}: without root, sysfs shows only the first 64 bytes of config space",
            unreadable.join(", ")
        ));
        let behind_switch = matches!(route.class, PathClass::PIX | PathClass::PXB);
        if behind_switch && x.iommu_group.is_some() && x.iommu_group != y.iommu_group {
            worse(Verdict::SLOW, &mut verdict);
            evidence.push(format!(
                "inferred: {} and {} sit under one switch but in different IOMMU groups ({} vs {}), which happens when \
                 ACS is enabled on the switch ports",
                x.bdf,
                y.bdf,
                x.iommu_group.unwrap_or(0),
                y.iommu_group.unwrap_or(0)
            ));
            fixes.push(p2p_off.clone());
            fixes.push(Fix {
                reach: Reach::RootCommand,
                what: "sudo ringzero diag".into(),
                why: "read the ACS registers themselves (needs root)".into(),
            });
        }
    }
    if route.class == PathClass::SYS {
        worse(Verdict::UNSUPPORTED, &mut verdict);
        evidence.push("the GPUs hang off different CPU sockets: CUDA rarely offers peer access across the CPU interconnect".into());
        fixes.push(p2p_off.clone());
    }
    match cuda_view.judge(x, y) {
        Ok(j) => {
            worse(j.verdict, &mut verdict);
            evidence.extend(j.evidence);
            fixes.extend(j.fixes);
        }
        Err(why) => evidence.push(why),
    }
    Pair {
        a: x.bdf.clone(),
        b: y.bdf.clone(),
        route,
        verdict,
        evidence,
    }
}

/// The report as text.
pub fn text(r: &Report) -> String {
    let mut s = String::from("== Host\n");
    s += &host_text(r);
    s += "\n== IOMMU\n";
    let h = &r.host;
    s += &format!("active            {}\n", h.iommu_active);
    s += &format!(
        "kernel parameters {}\n",
        if h.iommu_cmdline.is_empty() {
            "none".into()
        } else {
            h.iommu_cmdline.join(" ")
        }
    );
    s += "\n== PCI topology\n";
    if r.gpus.is_empty() {
        s += "no NVIDIA GPU found\n";
    }
    for g in &r.gpus {
        s += &format!(
            "GPU {} [{:04x}:{:04x}] link {} x{} (max {} x{}), NUMA {}, IOMMU group {}\n",
            g.bdf,
            g.vendor,
            g.device,
            g.link[0],
            g.link[1],
            g.link[2],
            g.link[3],
            g.numa_node.map_or("-".into(), |n| n.to_string()),
            g.iommu_group.map_or("-".into(), |n| n.to_string())
        );
    }
    s += "\n== CUDA\n";
    s += &format!("{}\n", r.cuda.note);
    if let Some(inv) = &r.cuda.inventory {
        for d in &inv.devices {
            s += &format!(
                "cuda:{} {} at {} (UUID {})\n",
                d.ordinal, d.name, d.pci_bus_id, d.uuid
            );
        }
        for p in &inv.peers {
            s += &format!(
                "cuda:{} → cuda:{}: can access peer {}, access supported {}, native atomics {}, performance rank {}\n",
                p.a, p.b, p.can_access, p.access_supported, p.native_atomics, p.performance_rank
            );
        }
    }
    s += "\n== Probes\n";
    if r.probes.is_empty() {
        s += "none run\n";
    }
    for p in &r.probes {
        s += &format!(
            "{:<6} {:?}{}: {}{}\n",
            p.name,
            p.status,
            p.gbs.map_or(String::new(), |g| format!(" ({g:.2} GB/s)")),
            p.detail,
            p.fell_back.as_ref().map_or(String::new(), |w| format!(
                " [fell back to host staging: {w}]"
            ))
        );
    }
    s += "\n== Verdicts\n";
    if r.pairs.is_empty() {
        s += "no GPU pair to judge\n";
    }
    for p in &r.pairs {
        s += &format!("{} ↔ {}: {:?}\n", p.a, p.b, p.verdict);
        for e in &p.evidence {
            s += &format!("    - {e}\n");
        }
    }
    s += "\n== Fixes (most immediate first; commands are printed, never run)\n";
    if r.fixes.is_empty() {
        s += "nothing to fix\n";
    }
    for f in &r.fixes {
        let reach = match f.reach {
            Reach::Environment => "environment, now",
            Reach::RootCommand => "root, until reboot",
            Reach::BootOrBios => "boot / BIOS / container",
        };
        s += &format!("[{reach}] {}\n    {}\n", f.what, f.why);
    }
    s += &format!(
        "\nexit code {} ({})\n",
        r.exit_code,
        ["OK", "degraded", "broken"][r.exit_code.clamp(0, 2) as usize]
    );
    s
}

/// The host section of [`text`]: kernel, driver, VM and container signs, /dev/shm, memlock, IPC
/// namespace, MPS, and what was found wrong with them.
fn host_text(r: &Report) -> String {
    let mut s = String::new();
    let h = &r.host;
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    s += &format!("kernel            {}\n", opt(&h.kernel));
    s += &format!(
        "NVIDIA driver     {}\n",
        h.nvidia_driver
            .clone()
            .unwrap_or_else(|| "not loaded".into())
    );
    s += &format!(
        "virtual machine   {}\n",
        h.virtual_machine
            .clone()
            .unwrap_or_else(|| "no sign".into())
    );
    s += &format!(
        "container         {}\n",
        h.container.clone().unwrap_or_else(|| "no sign".into())
    );
    s += &format!(
        "root              {}\n",
        h.root.map_or("unknown (fixture)".into(), |r| r.to_string())
    );
    s += &format!(
        "/dev/shm          {}{}\n",
        h.shm_bytes
            .map_or("size unknown".into(), |b| format!("{} MiB", b >> 20)),
        h.shm_free_bytes
            .map_or(String::new(), |b| format!(", {} MiB free", b >> 20))
    );
    s += &format!(
        "memlock           {}\n",
        if h.memlock_unlimited {
            "unlimited".into()
        } else {
            h.memlock_bytes
                .map_or("unknown".into(), |b| format!("{} KiB", b >> 10))
        }
    );
    s += &format!(
        "IPC namespace     {}\n",
        match h.private_ipc_namespace {
            Some(true) => "private (not PID 1's)",
            Some(false) => "shared with PID 1",
            None => "unknown",
        }
    );
    s += &format!(
        "MPS               {}\n",
        match &h.mps {
            Some(p) => format!("{p}: processes sharing a GPU run side by side"),
            None if r.gpus.is_empty() => "not running".into(),
            None => "not running: processes that share a GPU take turns on it \
                     (`nvidia-cuda-mps-control -d` runs them side by side)"
                .into(),
        }
    );
    for f in &r.host_findings {
        s += &format!("! {f}\n");
    }
    s
}
