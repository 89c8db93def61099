//! What the CUDA probes mean: the devices and pairs found, the probes planned for them, and the
//! verdict on each pair from its facts and its probes' results (pure: tested on made-up facts).

use std::time::Duration;

use serde::Serialize;

use super::inventory::{CudaInventory, CudaPeer};
use crate::diag::probe::{pattern, ProbeResult, ProbeStatus};
use crate::diag::{Fix, Reach, Verdict};

/// What the CUDA part of the report says.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CudaSection {
    /// The inventory, when a driver and a device were found.
    pub inventory: Option<CudaInventory>,
    /// Why there is none, or what went wrong getting it.
    pub note: String,
}

/// A CUDA probe, parsed from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaProbe {
    /// The device list and peer facts.
    Inventory,
    /// Peer copies between two devices (the same one: a copy within it).
    Copy(usize, usize),
    /// Pinned host ↔ device copies.
    Staging(usize),
    /// ringzero's ring in two processes on devices `a` and `b`; `staged`: P2P disabled.
    Ring {
        /// Rank 0's device.
        a: usize,
        /// Rank 1's device.
        b: usize,
        /// With `RINGZERO_P2P_DISABLE=1`.
        staged: bool,
    },
}

impl CudaProbe {
    /// Parse `cuda-…` probe names; `None` for anything else.
    pub fn parse(name: &str) -> Option<CudaProbe> {
        let mut it = name.split(':');
        let head = it.next()?;
        let nums: Vec<usize> = it.map(|x| x.parse().ok()).collect::<Option<_>>()?;
        match (head, nums.as_slice()) {
            ("cuda-inventory", []) => Some(CudaProbe::Inventory),
            ("cuda-copy", [a, b]) => Some(CudaProbe::Copy(*a, *b)),
            ("cuda-staging", [a]) => Some(CudaProbe::Staging(*a)),
            ("cuda-ring", [a, b]) => Some(CudaProbe::Ring {
                a: *a,
                b: *b,
                staged: false,
            }),
            ("cuda-ring-staged", [a, b]) => Some(CudaProbe::Ring {
                a: *a,
                b: *b,
                staged: true,
            }),
            _ => None,
        }
    }

    /// Its name (what [`CudaProbe::parse`] reads).
    pub fn name(self) -> String {
        match self {
            CudaProbe::Inventory => "cuda-inventory".into(),
            CudaProbe::Copy(a, b) => format!("cuda-copy:{a}:{b}"),
            CudaProbe::Staging(a) => format!("cuda-staging:{a}"),
            CudaProbe::Ring { a, b, staged } => {
                format!("cuda-ring{}:{a}:{b}", if staged { "-staged" } else { "" })
            }
        }
    }

    /// How long the watchdog gives it: `base`, more for the rings (two processes start, and
    /// NVRTC compiles the kernels on first use).
    pub fn timeout(self, base: Duration) -> Duration {
        match self {
            CudaProbe::Ring { .. } => base.max(Duration::from_secs(90)),
            _ => base,
        }
    }
}

/// The probes to run once the inventory is known: per device, the staging copies; per pair, the
/// peer copies and the ring over CUDA IPC; the ring over host staging once (its bandwidth is
/// what the `RINGZERO_P2P_DISABLE=1` fix offers). One device: the same on itself (two
/// processes share it, which is how CUDA IPC between processes is exercised).
pub fn plan(inv: &CudaInventory) -> Vec<CudaProbe> {
    let n = inv.devices.len();
    let mut out: Vec<CudaProbe> = (0..n).map(CudaProbe::Staging).collect();
    let pairs: Vec<(usize, usize)> = if n == 1 {
        vec![(0, 0)]
    } else {
        (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .collect()
    };
    for &(a, b) in &pairs {
        out.push(CudaProbe::Copy(a, b));
        out.push(CudaProbe::Ring {
            a,
            b,
            staged: false,
        });
    }
    if let Some(&(a, b)) = pairs.first() {
        out.push(CudaProbe::Ring { a, b, staged: true });
    }
    out
}

/// One pair's verdict from the CUDA side.
#[derive(Clone, Debug, PartialEq)]
pub struct Judged {
    /// The worst finding (OK when nothing stands in the way).
    pub verdict: Verdict,
    /// What it rests on.
    pub evidence: Vec<String>,
    /// What to do.
    pub fixes: Vec<Fix>,
}

/// What [`judge`] looks at for one GPU pair.
#[derive(Clone, Copy, Default)]
pub struct PairFacts<'a> {
    /// The driver's peer facts, both directions.
    pub peers: [Option<&'a CudaPeer>; 2],
    /// The peer copy probe.
    pub copy: Option<&'a ProbeResult>,
    /// The ring probe over CUDA IPC.
    pub ring: Option<&'a ProbeResult>,
    /// ringzero's all-reduce bus bandwidth over host staging (for the fix text).
    pub staging_busbw: Option<f64>,
    /// The slower direction of a pinned host ↔ device copy (what peer copies must beat).
    pub host_copy_gbs: Option<f64>,
    /// `RINGZERO_P2P_DISABLE` is set.
    pub p2p_disabled: bool,
}

/// Judge one GPU pair.
pub fn judge(f: PairFacts<'_>) -> Judged {
    let PairFacts {
        peers,
        copy,
        ring,
        staging_busbw: staging_gbs,
        host_copy_gbs,
        p2p_disabled,
    } = f;
    let mut j = Judged {
        verdict: Verdict::OK,
        evidence: Vec::new(),
        fixes: Vec::new(),
    };
    let worse = |v: Verdict, j: &mut Judged| {
        if v.severity() > j.verdict.severity() || j.verdict == Verdict::OK {
            j.verdict = v;
        }
    };
    let p2p_off = Fix {
        reach: Reach::Environment,
        what: "RINGZERO_P2P_DISABLE=1".into(),
        why: match staging_gbs {
            Some(g) => format!(
                "ringzero stages device buffers through pinned host memory instead of peer copies (measured here: \
                 {g:.1} GB/s all-reduce bus bandwidth); NCCL's equivalent is NCCL_P2P_DISABLE=1"
            ),
            None => "ringzero stages device buffers through pinned host memory instead of peer copies; NCCL's \
                     equivalent is NCCL_P2P_DISABLE=1"
                .into(),
        },
    };
    if p2p_disabled {
        worse(Verdict::POLICY_OFF, &mut j);
        j.evidence.push(
            "RINGZERO_P2P_DISABLE is set in this environment: ringzero uses host staging, never peer copies".into(),
        );
        j.fixes.push(Fix {
            reach: Reach::Environment,
            what: "unset RINGZERO_P2P_DISABLE".into(),
            why: "only if the probes below show peer copies working: they are faster than staging"
                .into(),
        });
    }
    match peers {
        [Some(ab), Some(ba)] => {
            j.evidence.push(format!(
                "driver: cuDeviceCanAccessPeer {}→{} = {}, {}→{} = {}; access supported {}, native atomics {}, \
                 performance rank {}",
                ab.a,
                ab.b,
                u8::from(ab.can_access),
                ba.a,
                ba.b,
                u8::from(ba.can_access),
                ab.access_supported && ba.access_supported,
                ab.native_atomics && ba.native_atomics,
                ab.performance_rank.max(ba.performance_rank)
            ));
            if !ab.can_access || !ba.can_access {
                worse(Verdict::UNSUPPORTED, &mut j);
                j.evidence.push(
                    "the driver refuses peer access between these GPUs: every peer copy is staged through the host"
                        .into(),
                );
                j.fixes.push(p2p_off.clone());
            }
        }
        _ => j.evidence.push(
            "driver: no peer facts (CUDA does not see both GPUs; CUDA_VISIBLE_DEVICES?)".into(),
        ),
    }
    let probe = |p: Option<&ProbeResult>, what: &str, j: &mut Judged| {
        let Some(p) = p else { return };
        let gbs = p.gbs.map_or(String::new(), |g| format!(" at {g:.1} GB/s"));
        match p.status {
            ProbeStatus::OK => j.evidence.push(format!("{what}: OK{gbs} ({})", p.detail)),
            ProbeStatus::HANG => {
                worse(Verdict::HANG, j);
                j.evidence.push(format!("{what}: HANG ({})", p.detail));
                j.fixes.push(p2p_off.clone());
            }
            ProbeStatus::WRONG_DATA => {
                worse(Verdict::WRONG_DATA, j);
                j.evidence
                    .push(format!("{what}: WRONG_DATA{gbs}: {}", p.detail));
                j.fixes.push(p2p_off.clone());
            }
            ProbeStatus::FAILED if is_ipc_failure(&p.detail) => {
                worse(Verdict::IPC_BLOCKED, j);
                j.evidence.push(format!(
                    "{what}: CUDA IPC between processes failed: {}",
                    p.detail
                ));
                j.fixes.push(Fix {
                    reach: Reach::BootOrBios,
                    what: "run every rank in one IPC namespace: one container, or docker run --ipc=host (Kubernetes: hostIPC)"
                        .into(),
                    why: "cuIpcOpenMemHandle only opens handles from processes that share the IPC namespace"
                        .into(),
                });
                j.fixes.push(p2p_off.clone());
            }
            ProbeStatus::FAILED => {
                worse(Verdict::WRONG_DATA, j);
                j.evidence.push(format!("{what}: FAILED: {}", p.detail));
                j.fixes.push(p2p_off.clone());
            }
        }
        if let Some(why) = &p.fell_back {
            worse(
                if why.contains("timed out") || why.contains("no frame") {
                    Verdict::HANG
                } else {
                    Verdict::WRONG_DATA
                },
                j,
            );
            j.evidence.push(format!(
                "{what}: ringzero's start-up probe found peer copies broken and fell back to host staging: {why}"
            ));
            j.fixes.push(p2p_off.clone());
        }
    };
    probe(copy, "peer copy probe", &mut j);
    probe(ring, "ringzero ring over CUDA IPC", &mut j);
    if let (Some(c), Some(s)) = (copy.filter(|c| c.status == ProbeStatus::OK), host_copy_gbs) {
        if let Some(g) = c.gbs.filter(|g| *g < s) {
            worse(Verdict::SLOW, &mut j);
            j.evidence.push(format!(
                "peer copies ({g:.1} GB/s) are slower than a pinned host copy ({s:.1} GB/s): peer traffic is \
                 detoured (ACS redirect or IOMMU) or crosses a slow link"
            ));
            j.fixes.push(p2p_off.clone());
        }
    }
    j
}

/// Whether a failure is CUDA IPC refusing to open another process's memory.
pub fn is_ipc_failure(detail: &str) -> bool {
    detail.contains("cuIpcOpenMemHandle") || detail.contains("cuIpcGetMemHandle")
}

/// The first byte of `seen` that differs from the pattern of `from`.
pub(super) fn mismatch(from: usize, seen: &[u8]) -> Option<String> {
    (0..seen.len())
        .find(|&i| seen[i] != pattern(from, i))
        .map(|i| {
            format!(
                "byte {i} of {}: expected {:#04x}, saw {:#04x}{}",
                seen.len(),
                pattern(from, i),
                seen[i],
                if seen[i] == 0 { " (never written)" } else { "" }
            )
        })
}

#[cfg(test)]
mod tests {
    use super::super::result;
    use super::*;
    use crate::diag::cuda::inventory::CudaDevice;

    fn peer(a: usize, b: usize, can: bool) -> CudaPeer {
        CudaPeer {
            a,
            b,
            can_access: can,
            access_supported: can,
            native_atomics: false,
            performance_rank: 0,
        }
    }

    fn probe(status: ProbeStatus, gbs: Option<f64>, detail: &str) -> ProbeResult {
        result("p", status, gbs, detail.into())
    }

    #[test]
    fn probe_names_round_trip_and_junk_is_refused() {
        for p in [
            CudaProbe::Inventory,
            CudaProbe::Copy(0, 3),
            CudaProbe::Staging(2),
            CudaProbe::Ring {
                a: 1,
                b: 1,
                staged: true,
            },
            CudaProbe::Ring {
                a: 0,
                b: 7,
                staged: false,
            },
        ] {
            assert_eq!(CudaProbe::parse(&p.name()), Some(p));
        }
        for bad in [
            "cuda-copy:1",
            "cuda-copy:a:b",
            "cuda-staging",
            "cuda-x:1",
            "shm",
        ] {
            assert_eq!(CudaProbe::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_plan_covers_every_pair_and_one_gpu_twice() {
        let dev = |o| CudaDevice {
            ordinal: o,
            name: "H100".into(),
            pci_bus_id: format!("0000:{o:02x}:00.0"),
            uuid: String::new(),
        };
        let one = CudaInventory {
            devices: vec![dev(0)],
            peers: vec![],
        };
        let names: Vec<String> = plan(&one).into_iter().map(CudaProbe::name).collect();
        assert_eq!(
            names,
            [
                "cuda-staging:0",
                "cuda-copy:0:0",
                "cuda-ring:0:0",
                "cuda-ring-staged:0:0"
            ]
        );
        let three = CudaInventory {
            devices: vec![dev(0), dev(1), dev(2)],
            peers: vec![],
        };
        let names: Vec<String> = plan(&three).into_iter().map(CudaProbe::name).collect();
        for want in [
            "cuda-copy:0:1",
            "cuda-copy:0:2",
            "cuda-copy:1:2",
            "cuda-ring:1:2",
            "cuda-ring-staged:0:1",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
        assert_eq!(names.len(), 3 + 2 * 3 + 1);
        assert_eq!(three.by_bdf("0000:02:00.0").map(|d| d.ordinal), Some(2));
        assert_eq!(
            three
                .by_bdf("0000:02:00.0".to_uppercase().as_str())
                .map(|d| d.ordinal),
            Some(2)
        );
    }

    #[test]
    fn healthy_peers_are_ok() {
        let (ab, ba) = (peer(0, 1, true), peer(1, 0, true));
        let c = probe(ProbeStatus::OK, Some(40.0), "fine");
        let r = probe(ProbeStatus::OK, Some(30.0), "fine");
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            copy: Some(&c),
            ring: Some(&r),
            host_copy_gbs: Some(10.0),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::OK, "{j:?}");
        assert!(j.fixes.is_empty());
        assert!(
            j.evidence[0].contains("cuDeviceCanAccessPeer 0→1 = 1, 1→0 = 1"),
            "{j:?}"
        );
    }

    #[test]
    fn refused_peer_access_is_unsupported_with_the_staging_fix() {
        let (ab, ba) = (peer(0, 1, false), peer(1, 0, false));
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            staging_busbw: Some(12.5),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::UNSUPPORTED);
        assert_eq!(j.fixes[0].what, "RINGZERO_P2P_DISABLE=1");
        assert!(j.fixes[0].why.contains("12.5 GB/s"), "{:?}", j.fixes);
    }

    #[test]
    fn hangs_wrong_data_and_ipc_failures_get_their_verdicts() {
        let (ab, ba) = (peer(0, 1, true), peer(1, 0, true));
        let hang = probe(ProbeStatus::HANG, None, "no result after 20.0s");
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            copy: Some(&hang),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::HANG);
        assert!(j
            .evidence
            .iter()
            .any(|e| e.contains("peer copy probe: HANG")));

        let wrong = probe(
            ProbeStatus::WRONG_DATA,
            Some(3.0),
            "byte 4096 of 67108864: expected 0x17, saw 0x00 (never written)",
        );
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            copy: Some(&wrong),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::WRONG_DATA);
        assert!(j.evidence.iter().any(|e| e.contains("saw 0x00")));

        let ipc = probe(
            ProbeStatus::FAILED,
            None,
            "rank 1 (cuda:1): device error: opening rank 0's device slots: cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE",
        );
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            ring: Some(&ipc),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::IPC_BLOCKED);
        assert!(j.fixes.iter().any(|f| f.what.contains("--ipc=host")));

        // A hang outranks IPC trouble.
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            copy: Some(&hang),
            ring: Some(&ipc),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::HANG);
    }

    #[test]
    fn a_ring_that_fell_back_and_slow_peers_are_reported() {
        let (ab, ba) = (peer(0, 1, true), peer(1, 0, true));
        let mut r = probe(ProbeStatus::OK, Some(9.0), "edge rank 0 → 1: Shm");
        r.fell_back = Some("cuda_ipc probe: byte 7 expected 0x12, saw 0x00".into());
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            ring: Some(&r),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::WRONG_DATA);
        assert!(j
            .evidence
            .iter()
            .any(|e| e.contains("fell back to host staging")));

        let slow = probe(ProbeStatus::OK, Some(5.0), "fine");
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            copy: Some(&slow),
            host_copy_gbs: Some(20.0),
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::SLOW);
        assert!(j
            .evidence
            .iter()
            .any(|e| e.contains("slower than a pinned host copy (20.0 GB/s)")));
    }

    #[test]
    fn p2p_disable_in_the_environment_is_policy_off() {
        let (ab, ba) = (peer(0, 1, true), peer(1, 0, true));
        let j = judge(PairFacts {
            peers: [Some(&ab), Some(&ba)],
            p2p_disabled: true,
            ..Default::default()
        });
        assert_eq!(j.verdict, Verdict::POLICY_OFF);
        assert_eq!(j.fixes[0].what, "unset RINGZERO_P2P_DISABLE");
        let j = judge(PairFacts::default());
        assert!(j.evidence[0].contains("CUDA does not see both GPUs"));
    }

    #[test]
    fn mismatches_name_the_byte_and_zeros() {
        let mut v: Vec<u8> = (0..100).map(|i| pattern(3, i)).collect();
        assert_eq!(mismatch(3, &v), None);
        v[42] = 0;
        let m = mismatch(3, &v).unwrap();
        assert!(
            m.starts_with("byte 42 of 100") && m.ends_with("(never written)"),
            "{m}"
        );
    }
}
