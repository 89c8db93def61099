//! `ringzero diag` on fixture trees standing in for /sys and /proc: a healthy two-GPU switch, ACS
//! redirection, a non-root (64-byte) config space, corrupt capability lists, a translating IOMMU,
//! a 64 MB /dev/shm; and the probe watchdog on a probe that hangs on purpose.

use std::os::unix::fs::symlink;
use std::path::PathBuf;
use std::process::Command;

const ACS: u16 = 0x000D;

struct Fixture {
    root: PathBuf,
}

#[derive(Clone, Copy)]
enum Config {
    /// 4 KiB with an ACS capability (behind another one) holding this control value.
    Acs(u16),
    /// What a non-root reader sees.
    Short,
    /// Extended capabilities that point back at themselves.
    Looping,
    /// Extended space reads all 0xFF.
    AllFf,
}

fn config_bytes(c: Config) -> Vec<u8> {
    let mut v = vec![0u8; 4096];
    let header = |id: u16, next: u32| (id as u32 | (1 << 16) | (next << 20)).to_le_bytes();
    match c {
        Config::Acs(ctrl) => {
            v[0x100..0x104].copy_from_slice(&header(0x0001, 0x150));
            v[0x150..0x154].copy_from_slice(&header(ACS, 0));
            v[0x156..0x158].copy_from_slice(&ctrl.to_le_bytes());
        }
        Config::Short => v.truncate(64),
        Config::Looping => {
            v[0x100..0x104].copy_from_slice(&header(0x0001, 0x140));
            v[0x140..0x144].copy_from_slice(&header(0x0002, 0x100));
        }
        Config::AllFf => v[0x100..].fill(0xff),
    }
    v
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let root =
            std::env::temp_dir().join(format!("ringzero-diag-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for d in [
            "sys/bus/pci/devices",
            "sys/devices",
            "sys/kernel/iommu_groups",
            "proc/sys/kernel",
            "proc/self",
            "proc/1",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let f = Fixture { root };
        f.write("proc/sys/kernel/osrelease", "6.8.0-fixture\n");
        f.write(
            "proc/cmdline",
            "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on\n",
        );
        f.write("proc/cpuinfo", "processor : 0\nflags : fpu sse2 avx2\n");
        f.write(
            "proc/mounts",
            "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=16777216k 0 0\n",
        );
        f.write("proc/self/limits", "Limit                     Soft Limit           Hard Limit           Units\nMax locked memory         unlimited            unlimited            bytes\n");
        f
    }

    fn write(&self, rel: &str, text: impl AsRef<[u8]>) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// A PCI function at `chain` (root complex first, this device last).
    fn device(
        &self,
        chain: &[&str],
        vendor: u16,
        class: u32,
        config: Config,
        group: Option<(u32, &str)>,
    ) {
        let rel: PathBuf = std::iter::once("sys/devices")
            .chain(chain.iter().copied())
            .collect();
        let d = self.root.join(&rel);
        std::fs::create_dir_all(&d).unwrap();
        let w = |f: &str, v: String| std::fs::write(d.join(f), v).unwrap();
        w("vendor", format!("0x{vendor:04x}\n"));
        w("device", "0x2330\n".into());
        w("class", format!("0x{class:06x}\n"));
        w("numa_node", "0\n".into());
        w("current_link_speed", "32.0 GT/s PCIe\n".into());
        w("current_link_width", "16\n".into());
        w("max_link_speed", "32.0 GT/s PCIe\n".into());
        w("max_link_width", "16\n".into());
        std::fs::write(d.join("config"), config_bytes(config)).unwrap();
        if let Some((g, kind)) = group {
            let gd = self.root.join(format!("sys/kernel/iommu_groups/{g}"));
            std::fs::create_dir_all(&gd).unwrap();
            std::fs::write(gd.join("type"), format!("{kind}\n")).unwrap();
            symlink(
                format!("../../../../kernel/iommu_groups/{g}"),
                d.join("iommu_group"),
            )
            .unwrap();
        }
        let bdf = chain.last().unwrap();
        let up = "../../..";
        symlink(
            format!("{up}/{}", rel.display()).replace("sys/", ""),
            self.root.join("sys/bus/pci/devices").join(bdf),
        )
        .unwrap();
    }

    /// Root port, switch, two downstream ports, two GPUs.
    fn two_gpu_switch(&self, bridge_cfg: Config, groups: [(u32, &str); 2]) {
        let rp = ["pci0000:00", "0000:00:01.0"];
        let up = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"];
        self.device(&rp, 0x8086, 0x060400, Config::Acs(0), None);
        self.device(&up, 0x10b5, 0x060400, Config::Acs(0), None);
        for (port, gpu, g) in [
            ("0000:02:08.0", "0000:03:00.0", groups[0]),
            ("0000:02:10.0", "0000:04:00.0", groups[1]),
        ] {
            let mut chain = up.to_vec();
            chain.push(port);
            self.device(&chain, 0x10b5, 0x060400, bridge_cfg, None);
            chain.push(gpu);
            self.device(&chain, 0x10de, 0x030200, Config::Acs(0), Some(g));
        }
    }

    fn diag(&self, extra: &[&str]) -> (i32, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_ringzero"))
            .arg("diag")
            .arg("--sysfs-root")
            .arg(self.root.join("sys"))
            .arg("--procfs-root")
            .arg(self.root.join("proc"))
            .args(if extra.contains(&"--probes") {
                vec![]
            } else {
                vec!["--probes", "none"]
            })
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
        (out.status.code().unwrap_or(-1), text)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn a_healthy_two_gpu_switch_is_ok() {
    let f = Fixture::new("healthy");
    f.two_gpu_switch(Config::Acs(0), [(5, "identity"), (5, "identity")]);
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("0000:03:00.0 ↔ 0000:04:00.0: OK"), "{text}");
    assert!(
        text.contains("path PIX through 3 bridge(s): 0000:02:08.0 → 0000:01:00.0 → 0000:02:10.0"),
        "{text}"
    );
    assert!(
        text.contains("GPU 0000:03:00.0 [10de:2330] link 32.0 GT/s PCIe x16"),
        "{text}"
    );
    assert!(text.contains("nothing to fix"), "{text}");
    assert!(
        text.contains("MPS               not running: processes that share a GPU take turns on it"),
        "{text}"
    );
    // comm holds 15 bytes: `nvidia-cuda-mps-control` and `-server` both read so.
    f.write("proc/4242/comm", "nvidia-cuda-mps\n");
    f.write("proc/77/comm", "bash\n");
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(
            "MPS               nvidia-cuda-mps (pid 4242): processes sharing a GPU run side by side"
        ),
        "{text}"
    );
}

#[test]
fn acs_redirect_on_two_bridges_is_slow_with_setpci_fixes() {
    let f = Fixture::new("acs");
    f.two_gpu_switch(Config::Acs(0x001d), [(5, "identity"), (5, "identity")]);
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("0000:03:00.0 ↔ 0000:04:00.0: SLOW"), "{text}");
    assert!(text.contains("bridge 0000:02:08.0: ACS control 0x001d at 0x150: Source Validation, P2P Request Redirect, P2P Completion Redirect, Upstream Forwarding"), "{text}");
    for bdf in ["0000:02:08.0", "0000:02:10.0"] {
        assert!(
            text.contains(&format!(
                "[root, until reboot] setpci -s {bdf} ECAP_ACS+0x6.w=0000"
            )),
            "{text}"
        );
    }
    let env = text
        .find("[environment, now] RINGZERO_P2P_DISABLE=1")
        .expect("env fix");
    let root = text.find("[root, until reboot]").unwrap();
    let bios = text
        .find("[boot / BIOS / container] disable ACS in the BIOS")
        .expect("bios fix");
    assert!(
        env < root && root < bios,
        "fixes are ranked by reach:\n{text}"
    );
}

#[test]
fn non_root_config_space_is_said_and_acs_is_inferred_from_split_iommu_groups() {
    let f = Fixture::new("nonroot");
    f.two_gpu_switch(Config::Short, [(7, "identity"), (8, "identity")]);
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("ACS control could not be read on 0000:02:08.0 (64 bytes visible)"),
        "{text}"
    );
    assert!(
        text.contains("in different IOMMU groups (7 vs 8)"),
        "{text}"
    );
    assert!(text.contains("sudo ringzero diag"), "{text}");
}

#[test]
fn looping_and_all_ff_capability_lists_are_reported_not_followed() {
    for (name, cfg, says) in [
        ("loop", Config::Looping, "loops back to 0x100"),
        ("ff", Config::AllFf, "all 0xFF"),
    ] {
        let f = Fixture::new(name);
        f.two_gpu_switch(cfg, [(5, "identity"), (5, "identity")]);
        let (code, text) = f.diag(&[]);
        assert_eq!(code, 0, "{text}");
        assert!(
            text.contains(&format!(
                "bridge 0000:02:08.0: ACS unknown, config space corrupt: capability list {says}"
            )) || text.contains(says),
            "{text}"
        );
    }
}

#[test]
fn a_translating_iommu_on_bare_metal_is_unsupported() {
    let f = Fixture::new("iommu");
    f.two_gpu_switch(Config::Acs(0), [(5, "DMA-FQ"), (6, "DMA")]);
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains(": UNSUPPORTED"), "{text}");
    assert!(
        text.contains("0000:03:00.0 is in IOMMU group 5 (type DMA-FQ)"),
        "{text}"
    );
    assert!(text.contains("iommu=pt"), "{text}");
    assert!(text.contains("kernel parameters intel_iommu=on"), "{text}");
}

#[test]
fn a_64_mb_dev_shm_is_flagged_with_its_fixes() {
    let f = Fixture::new("shm");
    f.write(
        "proc/mounts",
        "shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size=65536k 0 0\n",
    );
    let (code, text) = f.diag(&[]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("/dev/shm is only 64 MiB"), "{text}");
    assert!(
        text.contains("[environment, now] RINGZERO_SHM_DISABLE=1"),
        "{text}"
    );
    assert!(text.contains("docker run --shm-size=8g"), "{text}");
    assert!(text.contains("no NVIDIA GPU found"), "{text}");
}

#[test]
fn a_hanging_probe_is_killed_and_called_hang() {
    let f = Fixture::new("hang");
    let t = std::time::Instant::now();
    let (code, text) = f.diag(&["--probes", "hang", "--probe-timeout", "1"]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("hang   HANG: no result after 1.0s; the probe process was killed"),
        "{text}"
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn json_output_parses_and_real_probes_pass_here() {
    let f = Fixture::new("json");
    f.two_gpu_switch(Config::Acs(0x0004), [(5, "identity"), (5, "identity")]);
    let (code, text) = f.diag(&["--json", "--probes", "shm,tcp"]);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["exit_code"], code);
    assert_eq!(v["pairs"][0]["verdict"], "SLOW");
    assert_eq!(v["pairs"][0]["route"]["class"], "PIX");
    for p in v["probes"].as_array().unwrap() {
        assert_eq!(p["status"], "OK", "{p}");
        assert!(p["gbs"].as_f64().unwrap() > 0.0);
    }
    assert!(v["fixes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["what"] == "RINGZERO_P2P_DISABLE=1"
            && x["why"].as_str().unwrap().contains("measured here")));
}

#[test]
fn bad_roots_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ringzero"))
        .args([
            "diag",
            "--sysfs-root",
            "/nonexistent/sys",
            "--probes",
            "none",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--sysfs-root /nonexistent/sys: not a directory"));
}

/// The CUDA part: without a driver it says so and runs nothing; with one, every CUDA probe
/// (peer copies, pinned copies, CUDA IPC, ringzero's ring) must pass on a healthy machine.
#[test]
fn cuda_probes_report_why_they_did_not_run_or_pass() {
    let f = Fixture::new("cuda");
    f.two_gpu_switch(Config::Acs(0), [(5, "identity"), (5, "identity")]);
    let (code, text) = f.diag(&["--json", "--probes", "cuda"]);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let present = ringzero_kernels::device::cuda::driver_present()
        && ringzero_kernels::device::cuda::device_count().is_ok();
    if !present {
        eprintln!("no CUDA driver or GPU here: checking the report says so");
        assert_eq!(code, 0, "{text}");
        assert!(v["cuda"]["inventory"].is_null(), "{text}");
        let note = v["cuda"]["note"].as_str().unwrap();
        assert!(
            note.starts_with("no GPU found by CUDA (") && note.ends_with("CUDA probes not run"),
            "{note}"
        );
        assert!(v["probes"].as_array().unwrap().is_empty(), "{text}");
        // The fixture's GPUs are judged from topology alone, and the pair says why.
        let ev = v["pairs"][0]["evidence"].as_array().unwrap();
        assert!(
            ev.iter().any(|e| e
                .as_str()
                .unwrap()
                .starts_with("CUDA: no GPU found by CUDA")),
            "{text}"
        );
    } else {
        for p in v["probes"].as_array().unwrap() {
            assert_eq!(p["status"], "OK", "{p}");
        }
        assert!(!v["probes"].as_array().unwrap().is_empty(), "{text}");
    }
}

#[test]
fn a_cuda_probe_without_a_gpu_fails_by_name_and_never_panics() {
    if ringzero_kernels::device::cuda::device_count().is_ok() {
        eprintln!("skipped: this machine has a GPU (the probes run for real in gpu-check)");
        return;
    }
    for probe in [
        "cuda-copy:0:1",
        "cuda-staging:0",
        "cuda-inventory",
        "cuda-ring:0:0",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ringzero"))
            .args(["diag-probe", probe])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["name"], probe);
        assert_eq!(v["status"], "FAILED", "{text}");
        assert!(
            v["detail"]
                .as_str()
                .unwrap()
                .contains("no CUDA driver was found")
                || v["detail"].as_str().unwrap().contains("no device"),
            "{text}"
        );
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
}
