//! Cross-memory attach: one copy straight out of another process's memory
//! (`process_vm_readv`), what the host communicator's single-copy collectives read with
//! (`comm/direct.rs`).
//!
//! The kernel checks every access: a read from an address the other process does not map, or no
//! longer maps, fails with `EFAULT` and touches nothing of this process but the destination, so a
//! peer that returned early can make a read wrong, never unsound. A process may read another
//! only where `ptrace` would be allowed: same user, and under Yama (`kernel.yama.ptrace_scope`)
//! scope 0, or scope 1 when the read process has named its readers (`PR_SET_PTRACER`);
//! [`allow_readers`] does that, as Open MPI's shared-memory transport does for the same copies.

use std::io;

/// Copy `dst.len()` bytes at address `addr` of process `pid` into `dst`.
pub fn read(pid: u32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let rest = &mut dst[done..];
        let local = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `local` describes `rest`, memory this function holds exclusively (a `&mut`
        // borrow) for the whole call; the kernel writes at most `iov_len` bytes there. `remote`
        // is an address in another process (or this one), which the kernel validates: an
        // unmapped or unreadable range fails with EFAULT, and reading never writes there.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "process {pid} returned no bytes at {:#x}",
                        addr as usize + done
                    ),
                ))
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// The Yama `ptrace_scope` (`None` where Yama is not built in: reads are allowed between
/// processes of one user).
pub fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Make this process readable by the other ranks, or say why it cannot be: under Yama scope 1
/// (Ubuntu's default) a process is readable only by its ancestors unless it names its readers,
/// and ranks are siblings, so it names any process of the same user (the user's other processes
/// could attach a debugger to it anyway without Yama); scopes 2 and 3 forbid it outright.
pub fn allow_readers() -> Result<(), String> {
    match ptrace_scope() {
        None | Some(0) => Ok(()),
        Some(1) => rustix::process::set_ptracer(rustix::process::PTracer::Any).map_err(|e| {
            format!("kernel.yama.ptrace_scope is 1 and PR_SET_PTRACER was refused: {e}")
        }),
        Some(s) => Err(format!(
            "kernel.yama.ptrace_scope is {s}: no process may read another's memory (1 or 0 \
             allows it)"
        )),
    }
}

/// What the reader should do about `e`, a failed [`read`] of process `pid`.
pub fn explain(e: &io::Error, pid: u32) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) => format!(
            "process {pid} may not be read (EPERM: another user, a setuid binary, or Yama's \
             ptrace_scope; RINGZERO_SINGLE_COPY_FROM=off takes the slots)"
        ),
        Some(libc::ENOSYS) => "process_vm_readv is not available (ENOSYS: a kernel without \
                               CONFIG_CROSS_MEMORY_ATTACH, or a seccomp filter)"
            .to_string(),
        Some(libc::ESRCH) => format!("process {pid} has exited (ESRCH)"),
        _ => format!("reading process {pid}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_refuses_an_unmapped_address() {
        let src: Vec<u8> = (0..=255u8).cycle().take(3 << 20).collect();
        let mut dst = vec![0u8; src.len()];
        read(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(dst, src);
        let e = read(std::process::id(), 8, &mut dst[..16]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
        assert!(explain(&e, 1).contains("reading process 1"));
    }
}
