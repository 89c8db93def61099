//! Reading the knobs from the environment: one reader per group of variables, each value
//! checked, and an error that names the variable and says what it should be.

use std::time::Duration;

use crate::error::{Error, Result};

use super::*;

/// A lookup of environment variables (the process's, or a test's map).
pub(super) type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// `var` parsed by `parse`, or an error saying its value is not `what`.
fn parsed<T>(
    env: Env,
    var: &'static str,
    what: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>> {
    env(var)
        .map(|v| parse(&v).ok_or_else(|| Error::config(var, format!("`{v}` is not {what}"))))
        .transpose()
}

/// `var` as one of `choices` (trimmed, any case; the empty value is `auto`'s), or an error
/// that lists them.
fn choice<T: Copy>(env: Env, var: &'static str, choices: &[(&str, T)]) -> Result<Option<T>> {
    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
    parsed(env, var, &format!("one of {}", names.join(", ")), |v| {
        let v = v.trim().to_ascii_lowercase();
        match v.as_str() {
            "" => choices.iter().find(|(n, _)| *n == "auto").map(|(_, t)| *t),
            v => choices.iter().find(|(n, _)| *n == v).map(|(_, t)| *t),
        }
    })
}

/// Who the job is: the secret, the job id, the node id.
pub(super) fn read_identity(c: &mut Config, env: Env) -> Result<()> {
    match env("RINGZERO_SECRET") {
        Some(s) => c.secret = s.into_bytes(),
        None if c.launch.world_size > 1 => tracing::warn!(
            target: "ringzero::bootstrap",
            "RINGZERO_SECRET is not set: connections are authenticated with an empty key, so anyone \
             who can reach the master port can join (`ringzero launch` sets one)"
        ),
        None => {}
    }
    if let Some(j) = env("RINGZERO_JOB_ID") {
        c.job_id = j;
    }
    if let Some(n) = env("RINGZERO_NODE_ID") {
        if n.is_empty() {
            return Err(Error::config("RINGZERO_NODE_ID", "is empty"));
        }
        c.node_id = n;
    }
    Ok(())
}

/// The deadline, the transports and their slots.
pub(super) fn read_links(c: &mut Config, env: Env) -> Result<()> {
    let most = super::MAX_TIMEOUT.as_secs_f64();
    let seconds = |t: &str| t.parse().ok().filter(|s: &f64| (0.001..=most).contains(s));
    let range = format!("a number of seconds between 0.001 and {most} (one week)");
    if let Some(secs) = parsed(env, "RINGZERO_TIMEOUT", &range, seconds)? {
        c.timeout = Duration::from_secs_f64(secs);
    }
    let transports = [
        ("tcp", TransportPref::Tcp),
        ("shm", TransportPref::Shm),
        ("cuda_ipc", TransportPref::CudaIpc),
        ("auto", TransportPref::Auto),
    ];
    if let Some(t) = choice(env, "RINGZERO_TRANSPORT", &transports)? {
        c.transport = t;
    }
    c.shm_disable = flag(env, "RINGZERO_SHM_DISABLE")?;
    c.p2p_disable = flag(env, "RINGZERO_P2P_DISABLE")?;
    // A slice is at least a page (smaller ones cost a frame each and make plans huge) and at
    // most a quarter of what a link may reserve (its slots: `Config::validate`).
    let slice = |v: &str| parse_bytes(v).filter(|b| (4 << 10..=256 << 20).contains(b));
    let slice_range = "a size between 4K and 256M";
    if let Some(b) = parsed(env, "RINGZERO_SLICE_BYTES", slice_range, slice)? {
        c.slice_bytes = b;
    }
    if let Some(b) = parsed(env, "RINGZERO_DEVICE_SLICE_BYTES", slice_range, slice)? {
        c.device_slice_bytes = Some(b);
    }
    let slots = |v: &str| v.parse().ok().filter(|s| (2..=64).contains(s));
    if let Some(s) = parsed(env, "RINGZERO_SLOTS", "a number between 2 and 64", slots)? {
        c.slots = s;
    }
    let sockets = |v: &str| {
        v.trim()
            .parse()
            .ok()
            .filter(|s| (1..=MAX_TCP_SOCKETS).contains(s))
    };
    let between = format!("a number between 1 and {MAX_TCP_SOCKETS}");
    if let Some(s) = parsed(env, "RINGZERO_TCP_SOCKETS", &between, sockets)? {
        c.tcp_sockets = s;
    }
    let stores = |v: &str| match v.trim().eq_ignore_ascii_case("off") {
        true => Some(usize::MAX),
        false => parse_bytes(v),
    };
    let size_or_off = "a size (like 8M) or `off`";
    if let Some(b) = parsed(env, "RINGZERO_STREAM_STORES_FROM", size_or_off, stores)? {
        c.stream_stores_from = b;
    }
    if let Some(b) = parsed(env, "RINGZERO_SINGLE_COPY_FROM", size_or_off, stores)? {
        c.single_copy_from = b;
    }
    if let Some(b) = parsed(env, "RINGZERO_SINGLE_COPY_BELOW", size_or_off, stores)? {
        c.single_copy_below = b;
    }
    if let Some(d) = env("RINGZERO_SHM_DIR") {
        c.shm_dir = d.into();
    }
    Ok(())
}

/// How device buffers move: host staging's way, the device algorithm, copy pairs.
pub(super) fn read_device(c: &mut Config, env: Env) -> Result<()> {
    let staging = [
        ("auto", StagingMode::Auto),
        ("mapped", StagingMode::Mapped),
        ("copy", StagingMode::Copy),
    ];
    if let Some(s) = choice(env, "RINGZERO_STAGING", &staging)? {
        c.staging = s;
    }
    let algos = [
        ("auto", DeviceAlgo::Auto),
        ("ring", DeviceAlgo::Ring),
        ("direct", DeviceAlgo::Direct),
    ];
    if let Some(a) = choice(env, "RINGZERO_DEVICE_ALGO", &algos)? {
        c.device_algo = a;
    }
    let pairs = [("on", true), ("off", false), ("1", true), ("0", false)];
    let on_off = |v: &str| {
        let v = v.trim().to_ascii_lowercase();
        match v.as_str() {
            "" => Some(true),
            v => pairs.iter().find(|(n, _)| *n == v).map(|(_, t)| *t),
        }
    };
    if let Some(p) = parsed(env, "RINGZERO_DEVICE_COPY_PAIRS", "one of on, off", on_off)? {
        c.device_copy_pairs = p;
    }
    Ok(())
}

/// The flight recorder: how many calls, where and when records are written.
pub(super) fn read_flight(c: &mut Config, env: Env) -> Result<()> {
    let entries = |v: &str| v.trim().parse().ok().filter(|n| *n <= 1 << 20);
    let up_to = "a number between 0 (off) and 1048576";
    if let Some(n) = parsed(env, "RINGZERO_FLIGHT_ENTRIES", up_to, entries)? {
        c.flight_entries = n;
    }
    match env("RINGZERO_DUMP_DIR") {
        Some(d) if d.trim().is_empty() => {
            return Err(Error::config(
                "RINGZERO_DUMP_DIR",
                "is empty (unset it to write no flight records)",
            ))
        }
        Some(d) => c.dump_dir = Some(d.into()),
        None => {}
    }
    c.dump_on_sigusr1 = flag(env, "RINGZERO_DUMP_ON_SIGUSR1")?;
    c.dump_on_sigterm = flag(env, "RINGZERO_DUMP_ON_SIGTERM")?;
    Ok(())
}

/// A 0/1 switch from the process environment (`0`, `false`, `no` or unset: off; `1`, `true`,
/// `yes`: on; anything else is an error naming the variable).
pub fn env_flag(var: &str) -> Result<bool> {
    flag(&|k| std::env::var(k).ok(), var)
}

pub(super) fn flag(env: Env, var: &str) -> Result<bool> {
    match env(var).as_deref().map(str::trim) {
        None | Some("") | Some("0") | Some("false") | Some("no") => Ok(false),
        Some("1") | Some("true") | Some("yes") => Ok(true),
        Some(v) => Err(Error::config(var, format!("`{v}` is not 0 or 1"))),
    }
}

/// Parse `4096`, `64K`, `4M`, `1G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

/// `RINGZERO_ALGO`, and `RINGZERO_DOUBLING_MAX`, `RINGZERO_HALVING_MAX` and
/// `RINGZERO_PAIRWISE_MAX` (auto's thresholds only).
pub(super) fn read_algo(env: Env) -> Result<Algo> {
    let size = |var: &'static str| -> Result<Option<usize>> {
        env(var)
            .map(|v| {
                parse_bytes(&v)
                    .ok_or_else(|| Error::config(var, format!("`{v}` is not a size (like 64K)")))
            })
            .transpose()
    };
    let (dmax, hmax, pmax) = (
        size("RINGZERO_DOUBLING_MAX")?,
        size("RINGZERO_HALVING_MAX")?,
        size("RINGZERO_PAIRWISE_MAX")?,
    );
    let algo = env("RINGZERO_ALGO").unwrap_or_default();
    let fixed = match algo.parse::<Algo>() {
        Ok(Algo::Auto { .. }) => {
            return Ok(Algo::Auto {
                doubling_max: dmax.unwrap_or(DEFAULT_DOUBLING_MAX),
                halving_max: hmax.unwrap_or(DEFAULT_HALVING_MAX),
                pairwise_max: pmax.unwrap_or(DEFAULT_PAIRWISE_MAX),
            })
        }
        Ok(fixed) => fixed,
        Err(e) => return Err(Error::config("RINGZERO_ALGO", e)),
    };
    let set = [
        ("RINGZERO_DOUBLING_MAX", dmax),
        ("RINGZERO_HALVING_MAX", hmax),
        ("RINGZERO_PAIRWISE_MAX", pmax),
    ];
    if let Some((var, _)) = set.iter().find(|(_, v)| v.is_some()) {
        return Err(Error::config(
            *var,
            format!(
                "sets where RINGZERO_ALGO=auto switches algorithm, but RINGZERO_ALGO is `{fixed}`"
            ),
        ));
    }
    Ok(fixed)
}
