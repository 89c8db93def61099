//! Connections between any two ranks after start-up, without rank 0's store.
//!
//! Every rank keeps a [`PeerListener`] for as long as its communicator lives; all ranks learn
//! every listener's address (and node) at start-up. A thread accepts on the listener,
//! authenticates each caller on a thread of its own (the same handshake as every data
//! connection: job, secret, rank), and files the connection under the caller's rank, where the
//! call that expects it takes it ([`PeerListener::take`]). Callers that fail the handshake are
//! dropped and logged. So two ranks can connect whenever both want to (a pair's first send/recv),
//! even after rank 0 has left, and a rank busy with one peer does not turn another away.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::gate::{refuse_flooded, Gate, HANDSHAKE_DEADLINE};
use super::handshake::{self, Identity, Role};
use crate::error::{Error, Result};
use crate::ring::failure::AbortFlag;

/// Authenticated connections waiting for the call that expects them, by caller rank and role.
#[derive(Default)]
struct Inbox {
    by_rank: Mutex<HashMap<(usize, Role), VecDeque<TcpStream>>>,
    arrived: Condvar,
}

/// A rank's listener for connections from any other rank of its job (see the module docs).
/// Stops (and joins its accept thread) on drop.
pub(crate) struct PeerListener {
    addr: SocketAddr,
    rank: usize,
    inbox: Arc<Inbox>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl PeerListener {
    /// Listen on `ip` (an ephemeral port) for ranks of the job `me` belongs to.
    pub(crate) fn start(ip: IpAddr, me: &Identity, timeout: Duration) -> Result<PeerListener> {
        let l = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("binding the peer listener on {ip}"), e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("peer listener address", e))?;
        let (inbox, stop) = (Arc::new(Inbox::default()), Arc::new(AtomicBool::new(false)));
        let (secret, job): (Arc<[u8]>, Arc<str>) = (me.secret.into(), me.job_id.into());
        let (rank, inbox2, stop2) = (me.rank, inbox.clone(), stop.clone());
        let hs_timeout = timeout.min(HANDSHAKE_DEADLINE);
        let gate = Gate::default();
        let accept = std::thread::Builder::new()
            .name(format!("ringzero-peers-{rank}"))
            .spawn(move || {
                // Blocking accepts (no polling); drop wakes the thread with a connection of its own.
                loop {
                    let accepted = l.accept();
                    if stop2.load(Ordering::Acquire) {
                        return;
                    }
                    match accepted {
                        Ok((s, from)) => {
                            let Some(permit) = gate.admit() else {
                                refuse_flooded(from, "peer listener");
                                continue;
                            };
                            let (secret, job, inbox) = (secret.clone(), job.clone(), inbox2.clone());
                            let _ = std::thread::Builder::new()
                                .name("ringzero-peer-hello".into())
                                .spawn(move || {
                                    let _permit = permit;
                                    let me = Identity {
                                        secret: &secret,
                                        job_id: &job,
                                        rank,
                                    };
                                    match authenticate(s, &me, hs_timeout) {
                                        Ok((caller, s)) => inbox.file(caller, s),
                                        Err(e) => tracing::warn!(
                                            target: "ringzero::bootstrap",
                                            "peer listener dropped a caller from {from}: {e}"
                                        ),
                                    }
                                });
                        }
                        Err(e) => {
                            tracing::warn!(target: "ringzero::bootstrap", "peer accept failed: {e}");
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
            })
            .map_err(|e| Error::io("spawning the peer listener thread", e))?;
        Ok(PeerListener {
            addr,
            rank: me.rank as usize,
            inbox,
            stop,
            accept: Some(accept),
        })
    }

    /// The address every rank learned at start-up.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next authenticated connection of `role` from rank `peer`, waiting up to `timeout`
    /// (checking `abort` as it waits). `what` names the call, for the errors.
    pub(crate) fn take(
        &self,
        (peer, role): (usize, Role),
        timeout: Duration,
        abort: &AbortFlag,
        what: &str,
    ) -> Result<TcpStream> {
        let deadline = Instant::now() + timeout;
        let mut by_rank = self.inbox.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(s) = by_rank.get_mut(&(peer, role)).and_then(|q| q.pop_front()) {
                return Ok(s);
            }
            if let Some(reason) = abort.reason() {
                return Err(Error::Aborted {
                    op: what.into(),
                    seq: 0,
                    reason,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: what.into(),
                    seq: 0,
                    peer,
                    waiting: match role {
                        Role::Pairwise => format!(
                            "rank {peer} to join its first pairwise collective with rank {} (the \
                             pair connects those links then)",
                            self.rank
                        ),
                        _ => format!(
                            "rank {peer} to make its first send or receive with rank {} (the \
                             pair connects its links then)",
                            self.rank
                        ),
                    },
                    after: timeout,
                });
            }
            let wait = (deadline - now).min(Duration::from_millis(20));
            by_rank = self
                .inbox
                .arrived
                .wait_timeout(by_rank, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl PeerListener {
    /// The ranks whose connections of `role` wait to be taken: ranks connecting to this one.
    pub(crate) fn waiting(&self, role: Role) -> Vec<usize> {
        let by_rank = self.inbox.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        by_rank
            .iter()
            .filter(|((_, r), q)| *r == role && !q.is_empty())
            .map(|((rank, _), _)| *rank)
            .collect()
    }
}

impl Drop for PeerListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept; if that connection cannot be made, leave the thread (it
        // holds nothing but the listener) rather than wait on it.
        let woken = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_ok();
        if let Some(t) = self.accept.take().filter(|_| woken) {
            let _ = t.join();
        }
    }
}

impl Inbox {
    fn file(&self, caller: (usize, Role), s: TcpStream) {
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|p| p.into_inner());
        by_rank.entry(caller).or_default().push_back(s);
        self.arrived.notify_all();
    }
}

/// Run the server side of the handshake on an accepted caller; its rank and role, and the
/// stream.
fn authenticate(
    mut s: TcpStream,
    me: &Identity,
    timeout: Duration,
) -> Result<((usize, Role), TcpStream)> {
    s.set_nonblocking(false)
        .map_err(|e| Error::io("accepted peer socket", e))?;
    let hello = handshake::server(&mut s, me, timeout)?;
    if !matches!(hello.role, Role::Data | Role::Pairwise) {
        return Err(Error::Handshake {
            peer: format!("rank {}", hello.rank),
            reason: format!("role {:?} on the peer listener", hello.role),
        });
    }
    Ok(((hello.rank as usize, hello.role), s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn files_authenticated_callers_by_rank_and_drops_strangers() {
        let me = Identity {
            secret: b"s3cret",
            job_id: "job",
            rank: 0,
        };
        let l =
            PeerListener::start("127.0.0.1".parse().unwrap(), &me, Duration::from_secs(5)).unwrap();
        // Garbage, and a caller with the wrong secret: dropped, never filed.
        let mut junk = TcpStream::connect(l.addr()).unwrap();
        junk.write_all(&[0xff; 64]).unwrap();
        let wrong = Identity {
            secret: b"guess",
            job_id: "job",
            rank: 3,
        };
        assert!(
            crate::transport::tcp::connect(l.addr(), &wrong, 0, Duration::from_secs(2)).is_err()
        );
        // Ranks 3 and 2 of the job: filed under their ranks (and roles), taken in any order.
        let tcp = |rank, role| {
            let who = Identity { rank, ..me };
            crate::transport::tcp::connect_as(l.addr(), &who, role, 0, Duration::from_secs(2))
                .unwrap()
        };
        let mut pairwise = tcp(3, Role::Pairwise);
        pairwise.write_all(b"pairwise").unwrap();
        let mut data = tcp(3, Role::Data);
        data.write_all(b"data").unwrap();
        tcp(2, Role::Data);
        let abort = AbortFlag::default();
        let take =
            |peer, role, secs| l.take((peer, role), Duration::from_secs(secs), &abort, "test");
        take(2, Role::Data, 5).unwrap();
        let mut got = String::new();
        let mut d = take(3, Role::Data, 5).unwrap();
        d.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        std::io::Read::read_to_string(&mut std::io::Read::take(&mut d, 4), &mut got).unwrap();
        assert_eq!(got, "data", "each role gets its own connection");
        take(3, Role::Pairwise, 5).unwrap();
        // Nobody else called: rank 3 has no second connection, and the wait says who is missing.
        let t = Instant::now();
        let e = l
            .take((3, Role::Data), Duration::from_millis(300), &abort, "test")
            .unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(
            e.to_string()
                .contains("rank 3 to make its first send or receive with rank 0"),
            "{e}"
        );
        // An abort ends the wait at once.
        abort.raise("watchdog".into());
        let e = take(1, Role::Pairwise, 30).unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
    }
}
