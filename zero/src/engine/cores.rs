//! How many threads one rank's CPU optimizer step takes.
//!
//! The step is bound by memory bandwidth and the node's ranks step at once, so more threads than
//! cores only adds switches (and the step waits for its slowest thread). A rank takes the cores
//! it may run on — its CPU affinity, and a container's CPU quota, as the standard library
//! counts them — shared with the node's other ranks; unless the launcher already gave each rank
//! a share of its own (DeepSpeed's `--bind_cores_to_rank`, Slurm's `--cpu-bind`): a rank whose
//! affinity mask holds at most its share of the node's online CPUs takes all of its cores.

/// Threads for a rank's CPU step, one of `local_ranks` on its node.
pub(crate) fn step_threads(local_ranks: usize) -> usize {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mask = rustix::thread::sched_getaffinity(None)
        .map(|s| s.count() as usize)
        .unwrap_or(allowed);
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(&s))
        .unwrap_or(mask);
    share(allowed, (mask, online), local_ranks)
}

/// `allowed` cores (affinity and quota), of which the affinity `mask` holds some, on a node of
/// `online` CPUs shared by `local_ranks` ranks.
fn share(allowed: usize, (mask, online): (usize, usize), local_ranks: usize) -> usize {
    let local = local_ranks.max(1);
    if local > 1 && mask.saturating_mul(local) <= online {
        // Pinned to a share of the node already: every core of it is this rank's.
        allowed.max(1)
    } else {
        (allowed / local).max(1)
    }
}

/// The number of CPUs in a kernel CPU list (`0-15,32-47`, `3`), or `None` if it is not one.
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_takes_its_share_of_the_node_unless_pinned_to_one() {
        // 16 CPUs, 2 ranks, no pinning: 8 each.
        assert_eq!(share(16, (16, 16), 2), 8);
        // Each pinned to its own 8 (DeepSpeed's --bind_cores_to_rank): all 8, not 4.
        assert_eq!(share(8, (8, 16), 2), 8);
        // All ranks pinned to the same 12 of 16: more than a share each, so they divide them.
        assert_eq!(share(12, (12, 16), 2), 6);
        // A container's quota of 4 on a 64-CPU host, mask unpinned: the 4 are divided.
        assert_eq!(share(4, (64, 64), 2), 2);
        // One rank takes what it may; never fewer than one thread.
        assert_eq!(share(16, (16, 16), 1), 16);
        assert_eq!(share(2, (2, 2), 4), 1);
        assert_eq!(share(1, (1, 16), 1), 1);
    }

    #[test]
    fn cpu_lists_count_as_the_kernel_writes_them() {
        assert_eq!(count_cpu_list("0-15\n"), Some(16));
        assert_eq!(count_cpu_list("0-3,8-11,15"), Some(9));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
        // On this machine: at least the cores this process may use.
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
        let allowed = std::thread::available_parallelism().unwrap().get();
        assert!(count_cpu_list(&online).unwrap() >= allowed);
    }
}
