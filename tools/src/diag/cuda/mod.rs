//! The CUDA part of `ringzero diag`. Nothing here touches the driver in the diagnosing process:
//! the device inventory (devices, PCI bus ids, `cuDeviceCanAccessPeer` and the P2P attributes per
//! pair) and every probe run in child processes under the watchdog, so a driver that hangs on
//! `cuInit` or on a peer copy is killed and reported as HANG instead of hanging the tool.
//!
//! Probes (the child side is [`child`]):
//! - `cuda-inventory`: the device list and peer facts;
//! - `cuda-copy:A:B`: timed peer copies of patterned data (never zeros) A→B and B→A after
//!   `cuCtxEnablePeerAccess` (A = B: a copy within one device), every byte checked;
//! - `cuda-staging:A`: timed pinned host→device and device→host copies, every byte checked;
//! - `cuda-ring:A:B` / `cuda-ring-staged:A:B`: ringzero's own ring on device buffers in two
//!   processes (device A and device B; one GPU can hold both), with its automatic transport (CUDA
//!   IPC expected) or with `RINGZERO_P2P_DISABLE=1` (host staging): the edges' transports and
//!   reasons, an exact all-reduce, and its bus bandwidth.
//!
//! [`judge`] turns the inventory and the probes of one GPU pair into a verdict with evidence and
//! fixes; it is pure, so it is tested on made-up findings.

use ringzero_collectives::Collectives;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::probe::{pattern, ProbeResult, ProbeStatus};

pub(super) fn result(
    name: &str,
    status: ProbeStatus,
    gbs: Option<f64>,
    detail: String,
) -> ProbeResult {
    ProbeResult::new(name, status, gbs, detail)
}

/// The child side: run CUDA probe `p` named `name`.
pub fn child(name: &str, p: CudaProbe, exe: &std::path::Path) -> ProbeResult {
    let out = match p {
        CudaProbe::Inventory => inventory().map(|inv| {
            let mut r = result(
                name,
                ProbeStatus::OK,
                None,
                format!("{} CUDA device(s)", inv.devices.len()),
            );
            r.cuda = Some(inv);
            r
        }),
        CudaProbe::Copy(a, b) => copy(name, a, b),
        CudaProbe::Staging(a) => staging(name, a),
        CudaProbe::Ring { a, b, staged } => Ok(ring(name, exe, a, b, staged)),
    };
    out.unwrap_or_else(|e| result(name, ProbeStatus::FAILED, None, e))
}

use ringzero_kernels::device::cuda::{raw, Gpu};
use ringzero_kernels::device::{DeviceError, Stream};
use ringzero_kernels::DType;

pub mod inventory;
mod verdict;

pub use inventory::*;
use verdict::mismatch;
pub use verdict::*;

fn e(x: DeviceError) -> String {
    x.to_string()
}

/// The device list and peer facts. No CUDA → an inventory with no device, and why.
fn inventory() -> Result<CudaInventory, String> {
    let n = match raw::device_count() {
        Ok(n) => n,
        Err(DeviceError::NoCuda(why)) => return Err(format!("NoCuda: {why}")),
        Err(x) => return Err(x.to_string()),
    };
    let mut inv = CudaInventory::default();
    for o in 0..n {
        let name = Gpu::open(o).and_then(|g| Gpu::name(&g)).map_err(e)?;
        let uuid = raw::uuid_of(o).map_err(e)?;
        inv.devices.push(CudaDevice {
            ordinal: o,
            name,
            pci_bus_id: raw::pci_bus_id(o).map_err(e)?,
            uuid: uuid.iter().map(|b| format!("{b:02x}")).collect(),
        });
    }
    for a in 0..n {
        for b in (0..n).filter(|&b| b != a) {
            let p = raw::peer_access(a, b).map_err(e)?;
            inv.peers.push(CudaPeer {
                a,
                b,
                can_access: p.can_access,
                access_supported: p.access_supported,
                native_atomics: p.native_atomics,
                performance_rank: p.performance_rank,
            });
        }
    }
    Ok(inv)
}

/// Bytes the copy probes move per direction.
const COPY_BYTES: usize = 64 << 20;

fn copy(name: &str, a: usize, b: usize) -> Result<ProbeResult, String> {
    let ga = Gpu::open(a).map_err(e)?;
    let gb = if a == b {
        ga.clone()
    } else {
        Gpu::open(b).map_err(e)?
    };
    if a != b {
        ga.enable_peer_access(&gb).map_err(e)?;
        gb.enable_peer_access(&ga).map_err(e)?;
    }
    let dirs: Vec<(&Arc<Gpu>, &Arc<Gpu>, usize, usize)> = if a == b {
        vec![(&ga, &ga, a, a)]
    } else {
        vec![(&ga, &gb, a, b), (&gb, &ga, b, a)]
    };
    let (mut rates, mut min) = (Vec::new(), f64::INFINITY);
    for (from, to, fa, tb) in dirs {
        let pat: Vec<u8> = (0..COPY_BYTES).map(|i| pattern(fa, i)).collect();
        let src = from.upload(DType::U8, &pat).map_err(e)?;
        let dst = to.alloc(DType::U8, COPY_BYTES).map_err(e)?;
        let (sp, dp) = (from.ptr_of(&src), to.ptr_of(&dst));
        // SAFETY: `src` (on `from`) and `dst` (on `to`) hold COPY_BYTES each and live until the
        // timing below has waited for the last copy.
        let ms = from
            .time(3, || unsafe { from.copy_peer_at(dp, to, sp, COPY_BYTES) })
            .map_err(e)?;
        let mut seen = vec![0u8; COPY_BYTES];
        to.download(&dst, &mut seen).map_err(e)?;
        let gbs = COPY_BYTES as f64 / (ms * 1e-3) / 1e9;
        if let Some(bad) = mismatch(fa, &seen) {
            return Ok(result(
                name,
                ProbeStatus::WRONG_DATA,
                Some(gbs),
                format!("cuda:{fa} → cuda:{tb}: {bad}"),
            ));
        }
        rates.push(format!("cuda:{fa} → cuda:{tb} {gbs:.1} GB/s"));
        min = min.min(gbs);
    }
    Ok(result(
        name,
        ProbeStatus::OK,
        Some(min),
        format!(
            "{}; {} MiB of patterned data per direction, every byte checked",
            rates.join(", "),
            COPY_BYTES >> 20
        ),
    ))
}

fn staging(name: &str, a: usize) -> Result<ProbeResult, String> {
    let g = Gpu::open(a).map_err(e)?;
    let mut host: Vec<u8> = (0..COPY_BYTES).map(|i| pattern(1000, i)).collect();
    // SAFETY: `host` is neither moved nor resized while registered; `reg` drops first (below).
    let reg =
        unsafe { raw::HostRegistration::new(&g, host.as_mut_ptr(), COPY_BYTES) }.map_err(e)?;
    let hp = reg.device_ptr(host.as_ptr()).map_err(e)?;
    let dev = g.alloc(DType::U8, COPY_BYTES).map_err(e)?;
    let dp = g.ptr_of(&dev);
    // SAFETY: both ranges are COPY_BYTES long and live until `time` has waited for the copies.
    let h2d = g
        .time(3, || unsafe { Stream::copy(&g, dp, hp, COPY_BYTES) })
        .map_err(e)?;
    let mut seen = vec![0u8; COPY_BYTES];
    g.download(&dev, &mut seen).map_err(e)?;
    let bad_in = mismatch(1000, &seen).map(|b| format!("host → cuda:{a}: {b}"));
    let back: Vec<u8> = (0..COPY_BYTES).map(|i| pattern(2000, i)).collect();
    let dev2 = g.upload(DType::U8, &back).map_err(e)?;
    let dp2 = g.ptr_of(&dev2);
    // SAFETY: as above, device to host.
    let d2h = g
        .time(3, || unsafe { Stream::copy(&g, hp, dp2, COPY_BYTES) })
        .map_err(e)?;
    // Both ways at once, as host staging moves bytes: into `dev` from a second pinned buffer
    // while `dev2` goes out to `host` (checked again below).
    let mut other = vec![0u8; COPY_BYTES];
    // SAFETY: as for `host`; `reg2` drops before `other`.
    let reg2 =
        unsafe { raw::HostRegistration::new(&g, other.as_mut_ptr(), COPY_BYTES) }.map_err(e)?;
    let hp2 = reg2.device_ptr(other.as_ptr()).map_err(e)?;
    // SAFETY: four distinct live ranges of COPY_BYTES; the call drains both streams.
    let both = unsafe { g.time_both_ways(dp, hp2, hp, dp2, COPY_BYTES, 3) }.map_err(e)?;
    drop(reg2);
    drop(reg);
    let bad_out = mismatch(2000, &host).map(|b| format!("cuda:{a} → host: {b}"));
    let (i, o, b) = (
        COPY_BYTES as f64 / (h2d * 1e-3) / 1e9,
        COPY_BYTES as f64 / (d2h * 1e-3) / 1e9,
        COPY_BYTES as f64 / (both * 1e-3) / 1e9,
    );
    let gbs = Some(i.min(o));
    Ok(match bad_in.or(bad_out) {
        Some(bad) => result(name, ProbeStatus::WRONG_DATA, gbs, bad),
        None => result(
            name,
            ProbeStatus::OK,
            gbs,
            format!(
                "pinned host → cuda:{a} {i:.1} GB/s, cuda:{a} → host {o:.1} GB/s, both at once {b:.1} GB/s each way; {} MiB each way, every byte checked",
                COPY_BYTES >> 20
            ),
        ),
    })
}

/// Run the two ring ranks (`ringzero diag-ring-rank`) under the launcher and combine what they
/// print. They die with this process (the launcher's death signal), so the watchdog's kill
/// reaches them.
fn ring(name: &str, exe: &std::path::Path, a: usize, b: usize, staged: bool) -> ProbeResult {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let spec = crate::launch::LaunchSpec {
        ranks: 2,
        nodes: 1,
        program: exe.as_os_str().to_owned(),
        args: vec![
            "diag-ring-rank".into(),
            "--devices".into(),
            format!("{a},{b}").into(),
        ],
        env: vec![
            (
                "RINGZERO_P2P_DISABLE".into(),
                if staged { "1" } else { "0" }.into(),
            ),
            ("RINGZERO_TIMEOUT".into(), "20".into()),
            ("RINGZERO_TRANSPORT".into(), "auto".into()),
        ],
        grace: Duration::from_secs(5),
        dump_dir: None,
    };
    let outcome = crate::launch::launch(&spec, crate::launch::Output::Capture(lines.clone()));
    let lines = lines.lock().unwrap().clone();
    let mut results: Vec<(usize, ProbeResult)> = lines
        .iter()
        .filter_map(|(r, l)| Some((*r, serde_json::from_str::<ProbeResult>(l).ok()?)))
        .collect();
    results.sort_by_key(|(r, p)| (p.status == ProbeStatus::OK, *r));
    match (results.first(), outcome) {
        (Some((r, p)), _) => {
            let mut p = p.clone();
            p.name = name.into();
            if p.status != ProbeStatus::OK {
                p.detail = format!("rank {r} (cuda:{}): {}", [a, b][*r], p.detail);
            }
            p
        }
        (None, Ok(o)) => result(
            name,
            ProbeStatus::FAILED,
            None,
            format!(
                "the ranks exited ({}) without a result: {}",
                o.exit_code(),
                lines
                    .iter()
                    .rev()
                    .take(3)
                    .map(|(r, l)| if *r < 2 {
                        format!("[rank {r}] {l}")
                    } else {
                        format!("[launcher] {l}")
                    })
                    .collect::<Vec<_>>()
                    .join(" | ")
            ),
        ),
        (None, Err(x)) => result(name, ProbeStatus::FAILED, None, format!("launch: {x}")),
    }
}

/// One rank of the ring probe: device `devices[rank]`, ringzero's ring on device buffers, the
/// edge it receives on, an exact all-reduce and its bus bandwidth. Printed as one JSON line.
pub fn ring_rank(devices: [usize; 2]) -> ProbeResult {
    let name = "cuda-ring-rank";
    let go = || -> Result<ProbeResult, String> {
        use ringzero_collectives::{Communicator, Config, DeviceComm, ReduceOp, TransportKind};
        let cfg = Config::from_env().map_err(|x| x.to_string())?;
        let staged = cfg.p2p_disable;
        let comm = Communicator::init(cfg).map_err(|x| x.to_string())?;
        let rank = comm.rank();
        let gpu = Gpu::open(devices[rank % 2]).map_err(e)?;
        let dc = DeviceComm::new(&comm, gpu.clone()).map_err(|x| x.to_string())?;
        let edge = dc
            .edges()
            .iter()
            .find(|x| x.to == rank)
            .cloned()
            .ok_or("no receive edge was reported")?;
        let want = if staged {
            TransportKind::Shm
        } else {
            TransportKind::CudaIpc
        };
        let fell_back = (edge.kind != want && !staged).then(|| edge.reason.clone());
        if staged && edge.kind != TransportKind::Shm {
            return Ok(result(
                name,
                ProbeStatus::WRONG_DATA,
                None,
                format!(
                    "RINGZERO_P2P_DISABLE=1 but the edge uses {:?}: {}",
                    edge.kind, edge.reason
                ),
            ));
        }
        // Exact values: small integers sum without rounding in any order.
        let elems = 16usize << 20; // 64 MiB of f32
        let vals: Vec<f32> = (0..elems)
            .map(|i| ((i % 251) + 1 + 7 * rank) as f32)
            .collect();
        let send = gpu
            .upload(DType::F32, bytemuck::cast_slice(&vals))
            .map_err(e)?;
        let mut out = gpu.alloc(DType::F32, elems).map_err(e)?;
        dc.all_reduce(&send, &mut out, ReduceOp::Sum)
            .map_err(|x| x.to_string())?;
        let mut got = vec![0f32; elems];
        gpu.download(&out, bytemuck::cast_slice_mut(&mut got))
            .map_err(e)?;
        let n = comm.size();
        let bad = (0..elems).find(|&i| {
            let want: usize = (0..n).map(|r| (i % 251) + 1 + 7 * r).sum();
            got[i] != want as f32
        });
        // Both ranks start the timed calls together: the other rank may still be checking its
        // result, and a first call waiting for it timed that check (the H200's 64 MiB direct
        // all-reduce read 14 GB/s here, where the bench gave 750).
        dc.barrier().map_err(|x| x.to_string())?;
        let iters = 5;
        let t = Instant::now();
        for _ in 0..iters {
            dc.all_reduce(&send, &mut out, ReduceOp::Sum)
                .map_err(|x| x.to_string())?;
        }
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        let busbw = (elems * 4) as f64 / secs / 1e9 * 2.0 * (n - 1) as f64 / n as f64;
        let mut r = match bad {
            Some(i) => result(
                name,
                ProbeStatus::WRONG_DATA,
                Some(busbw),
                format!("all-reduce element {i} is {} (exact values)", got[i]),
            ),
            None => result(
                name,
                ProbeStatus::OK,
                Some(busbw),
                format!(
                    "edge rank {} → {rank}: {:?} ({}); 64 MiB f32 all-reduce exact, by {}",
                    edge.from,
                    edge.kind,
                    edge.reason,
                    if dc.direct().is_some() {
                        "the direct step (RINGZERO_DEVICE_ALGO)"
                    } else {
                        "the ring"
                    }
                ),
            ),
        };
        r.fell_back = fell_back;
        Ok(r)
    };
    go().unwrap_or_else(|x| result(name, ProbeStatus::FAILED, None, x))
}

/// Run the CUDA part: the inventory, then the planned probes, each in a child under the
/// watchdog. Returns the section and the probes' results.
pub fn diagnose(
    exe: &std::path::Path,
    base_timeout: Duration,
    progress: &mut dyn FnMut(&str),
) -> (CudaSection, Vec<ProbeResult>) {
    progress("listing CUDA devices (child process)");
    let inv = super::probe::run(
        exe,
        &CudaProbe::Inventory.name(),
        CudaProbe::Inventory.timeout(base_timeout),
    );
    let inventory = match (inv.status, inv.cuda) {
        (ProbeStatus::OK, Some(i)) if !i.devices.is_empty() => i,
        (ProbeStatus::FAILED, _) if inv.detail.starts_with("NoCuda: ") => {
            return (
                CudaSection {
                    inventory: None,
                    note: format!(
                        "no GPU found by CUDA ({}); CUDA probes not run",
                        inv.detail.trim_start_matches("NoCuda: ")
                    ),
                },
                Vec::new(),
            )
        }
        (status, _) => {
            let note = format!(
                "listing the CUDA devices failed ({status:?}): {}",
                inv.detail
            );
            let failed = ProbeResult::new(CudaProbe::Inventory.name(), status, None, inv.detail);
            return (
                CudaSection {
                    inventory: None,
                    note,
                },
                vec![failed],
            );
        }
    };
    let mut results = Vec::new();
    for p in plan(&inventory) {
        let t = p.timeout(base_timeout);
        progress(&format!(
            "probing {} (watchdog {:.0}s)",
            p.name(),
            t.as_secs_f64()
        ));
        results.push(super::probe::run(exe, &p.name(), t));
    }
    (
        CudaSection {
            note: format!("{} CUDA device(s)", inventory.devices.len()),
            inventory: Some(inventory),
        },
        results,
    )
}
