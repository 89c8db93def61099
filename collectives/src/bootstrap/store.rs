//! The rendezvous store: a key-value map served by rank 0 over TCP.
//!
//! Requests (after the handshake), little-endian:
//! `SET`: `1, key_len u32, key, value_len u32, value` → `0`;
//! `GET`: `2, key_len u32, key, wait_ms u64` → `0, value_len u32, value`; `1, len u32, ranks`
//! (not set in time: the ranks that have reached the store, as text); `2` (the server is
//! stopping: rank 0 dropped its communicator); or `3, len u32, why` (the store refused a rank
//! that has not reached it since: another job id, secret or version — it will not come). Every
//! request of a second process started as a rank that joined already is answered `4, len u32,
//! why`, and its connection closed.
//! Keys are at most [`MAX_KEY`] bytes and values [`MAX_VALUE`]; anything else drops the
//! connection. A GET waits on the server until the key is set or its deadline passes, so
//! clients never poll; a refusal ends every wait at once, so the ranks that are right fail
//! within moments naming the rank that is wrong instead of waiting out their deadline.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::gate::{refuse_flooded, Gate, Permit, HANDSHAKE_DEADLINE};
use super::handshake::{self, Identity, Role};
use crate::error::{Error, Result};

/// Longest key.
pub const MAX_KEY: usize = 1024;
/// Longest value.
pub const MAX_VALUE: usize = 1 << 20;

const SET: u8 = 1;
const GET: u8 = 2;
/// The answer to every request of a second process started as a rank that joined already.
const DUPLICATE: u8 = 4;

#[derive(Default)]
struct Map {
    kv: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Who has come (locked after `kv` where both are held).
    arrivals: Mutex<Arrivals>,
}

/// The ranks that passed the store's handshake (and from where), and the callers it refused.
#[derive(Default)]
struct Arrivals {
    ranks: std::collections::BTreeMap<u32, String>,
    /// A caller refused (another job id, secret or version): the rank it claimed, and why.
    refused: Vec<(u32, String)>,
}

impl Arrivals {
    /// Why a rank that has not come was refused, if one was.
    fn refusal(&self) -> Option<&str> {
        self.refused
            .iter()
            .find(|(r, _)| !self.ranks.contains_key(r))
            .map(|(_, why)| why.as_str())
    }

    /// The ranks that have come, as text (`0, 1, 3`).
    fn arrived(&self) -> String {
        let v: Vec<String> = self.ranks.keys().map(u32::to_string).collect();
        v.join(", ")
    }
}

/// The server side, run by rank 0. Stops (and joins its accept thread) on drop.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    map: Arc<Map>,
}

impl StoreServer {
    /// Bind `addr` and serve until dropped.
    pub fn start(
        addr: SocketAddr,
        secret: Vec<u8>,
        job_id: String,
        timeout: Duration,
    ) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("binding the store on {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("store address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("store listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let map = Arc::new(Map::default());
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name("ringzero-store".into())
            .spawn({
                let map = map.clone();
                move || accept_loop(listener, map, stop2, secret, job_id, timeout)
            })
            .map_err(|e| Error::io("spawning the store thread", e))?;
        Ok(StoreServer {
            addr,
            stop,
            accept: Some(accept),
            map,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the store refused a rank (see the module docs) and rank 0 is failing because of
    /// it: keep serving, so that the ranks not there yet learn why too instead of finding no
    /// store, until every one of the `world` ranks has come or been refused (and a moment for
    /// their waits to be answered), or `most` has passed. Returns at once without a refusal.
    pub fn linger_for_refused(&self, world: usize, most: Duration) {
        let deadline = Instant::now() + most;
        loop {
            let told = {
                let a = self.map.arrivals.lock().unwrap();
                if a.refusal().is_none() {
                    return;
                }
                (0..world as u32)
                    .all(|r| a.ranks.contains_key(&r) || a.refused.iter().any(|(q, _)| *q == r))
            };
            if told || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Arrived ranks' waits see the refusal within one of their 100 ms looks.
        std::thread::sleep(Duration::from_millis(300).min(most));
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    l: TcpListener,
    map: Arc<Map>,
    stop: Arc<AtomicBool>,
    secret: Vec<u8>,
    job: String,
    timeout: Duration,
) {
    let secret: Arc<[u8]> = secret.into();
    let job: Arc<str> = job.into();
    let gate = Gate::default();
    while !stop.load(Ordering::Acquire) {
        match l.accept() {
            Ok((s, from)) => {
                let Some(permit) = gate.admit() else {
                    refuse_flooded(from, "store");
                    continue;
                };
                let (map, stop, secret, job) =
                    (map.clone(), stop.clone(), secret.clone(), job.clone());
                let _ = std::thread::Builder::new().name("ringzero-store-conn".into()).spawn(move || {
                    if let Err(e) = serve(s, permit, &map, &stop, (&secret, &job), timeout) {
                        tracing::warn!(target: "ringzero::bootstrap", "store connection dropped: {e}");
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => {
                tracing::warn!(target: "ringzero::bootstrap", "store accept failed: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Serve one store client: its handshake (holding `permit`, one of the listener's places for
/// handshakes, under [`HANDSHAKE_DEADLINE`]), then its requests until it leaves or the store
/// stops.
fn serve(
    mut s: TcpStream,
    permit: Permit,
    map: &Map,
    stop: &AtomicBool,
    (secret, job): (&[u8], &str),
    timeout: Duration,
) -> Result<()> {
    s.set_nonblocking(false)
        .map_err(|e| Error::io("store connection", e))?;
    let me = Identity {
        secret,
        job_id: job,
        rank: 0,
    };
    let hello = match handshake::server(&mut s, &me, timeout.min(HANDSHAKE_DEADLINE)) {
        Ok(h) => h,
        Err(e) => {
            // A rank of the job with another job id, secret or version: tell the ranks waiting
            // for it (a stray connection that is no ringzero rank claims no rank).
            if let Some(rank) = handshake::refused_rank(&e) {
                map.arrivals
                    .lock()
                    .unwrap()
                    .refused
                    .push((rank, e.to_string()));
                map.changed.notify_all();
            }
            return Err(e);
        }
    };
    drop(permit);
    let from = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    // A second process started as a rank that has joined already is refused (its requests
    // answered with why), so it cannot overwrite the first one's address.
    let duplicate = {
        let mut arrivals = map.arrivals.lock().unwrap();
        match arrivals.ranks.get(&hello.rank) {
            Some(first) => Some(format!(
                "rank {} joined this job already (from {first}); this process (from {from}) was \
                 started as rank {} too: start each rank once",
                hello.rank, hello.rank
            )),
            None => {
                arrivals.ranks.insert(hello.rank, from);
                None
            }
        }
    };
    let peer = format!("rank {} (store client)", hello.rank);
    if hello.role != Role::Store {
        return Err(Error::Protocol {
            peer,
            detail: "data connection sent to the store port".into(),
        });
    }
    // Short read timeouts let the thread notice `stop` while a client idles.
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| Error::io("store connection", e))?;
    let proto = |detail: String| Error::Protocol {
        peer: peer.clone(),
        detail,
    };
    loop {
        let mut op = [0u8; 1];
        match s.read(&mut op) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(Error::io(format!("reading from {peer}"), e)),
        }
        s.set_read_timeout(Some(timeout))
            .map_err(|e| Error::io("store connection", e))?;
        let key = read_blob(&mut s, MAX_KEY).map_err(|e| proto(format!("bad key: {e}")))?;
        let key = String::from_utf8(key).map_err(|_| proto("key is not UTF-8".into()))?;
        if let Some(why) = &duplicate {
            // The rest of the request, then the refusal.
            match op[0] {
                SET => drop(read_blob(&mut s, MAX_VALUE)),
                _ => drop(s.read_exact(&mut [0u8; 8])),
            }
            let mut out = vec![DUPLICATE];
            out.extend_from_slice(&(why.len() as u32).to_le_bytes());
            out.extend_from_slice(why.as_bytes());
            let _ = s.write_all(&out);
            return Err(proto(why.clone()));
        }
        match op[0] {
            SET => {
                let v =
                    read_blob(&mut s, MAX_VALUE).map_err(|e| proto(format!("bad value: {e}")))?;
                map.kv.lock().unwrap().insert(key, v);
                map.changed.notify_all();
                s.write_all(&[0])
                    .map_err(|e| Error::io(format!("answering {peer}"), e))?;
            }
            GET => {
                let mut w = [0u8; 8];
                s.read_exact(&mut w)
                    .map_err(|e| proto(format!("bad wait: {e}")))?;
                let deadline =
                    Instant::now() + Duration::from_millis(u64::from_le_bytes(w).min(86_400_000));
                let mut kv = map.kv.lock().unwrap();
                let (status, v) = loop {
                    if let Some(v) = kv.get(&key) {
                        break (0, v.clone());
                    }
                    let now = Instant::now();
                    if stop.load(Ordering::Acquire) {
                        break (2, Vec::new());
                    }
                    let arrivals = map.arrivals.lock().unwrap();
                    if let Some(why) = arrivals.refusal() {
                        break (3, why.as_bytes().to_vec());
                    }
                    if now >= deadline {
                        break (1, arrivals.arrived().into_bytes());
                    }
                    drop(arrivals);
                    let wait = (deadline - now).min(Duration::from_millis(100));
                    kv = map.changed.wait_timeout(kv, wait).unwrap().0;
                };
                drop(kv);
                let mut out = vec![status];
                if status != 2 {
                    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                    out.extend_from_slice(&v);
                }
                s.write_all(&out)
                    .map_err(|e| Error::io(format!("answering {peer}"), e))?;
            }
            other => return Err(proto(format!("unknown store request {other}"))),
        }
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| Error::io("store connection", e))?;
    }
}

fn read_blob(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    s.read_exact(&mut l)?;
    let len = u32::from_le_bytes(l) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{len} bytes, limit {max}"),
        ));
    }
    let mut v = vec![0u8; len];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// The addresses of the master (rank 0's store), or a configuration error naming the variable.
pub fn resolve_master(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    (host, port)
        .to_socket_addrs()
        .map(Iterator::collect)
        .map_err(|e| {
            Error::config(
                "RINGZERO_MASTER_ADDR",
                format!("cannot resolve `{host}`: {e}"),
            )
        })
}

/// A rank's connection to the store.
pub struct StoreClient {
    s: TcpStream,
    server: String,
    timeout: Duration,
}

impl StoreClient {
    /// Connect to the store at `host:port`, retrying while rank 0 starts, until `timeout`.
    pub fn connect(host: &str, port: u16, me: &Identity, timeout: Duration) -> Result<StoreClient> {
        let server = format!("store at {host}:{port}");
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no attempt");
        loop {
            for a in &resolve_master(host, port)? {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(10));
                match TcpStream::connect_timeout(a, left) {
                    Ok(mut s) => {
                        let _ = s.set_nodelay(true);
                        match handshake::client(&mut s, me, Role::Store, &server, timeout) {
                            Ok(_) => return Ok(StoreClient { s, server, timeout }),
                            // A store busy with other callers' handshakes: try again.
                            Err(e) if handshake::is_turned_away(&e) => last = e.to_string(),
                            Err(e) => return Err(e),
                        }
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    op: "bootstrap".into(),
                    seq: 0,
                    peer: 0,
                    waiting: format!("the {server} to accept a connection (last error: {last}; is rank 0 running?)"),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// This end's local address (the interface that reaches rank 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.s
            .local_addr()
            .map_err(|e| Error::io("store client address", e))
    }

    /// Set `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        if key.len() > MAX_KEY || value.len() > MAX_VALUE {
            return Err(Error::InvalidArgument {
                op: "store set".into(),
                msg: format!("key `{key}` or its value is too long"),
            });
        }
        let mut req = vec![SET];
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(value.len() as u32).to_le_bytes());
        req.extend_from_slice(value);
        self.s
            .write_all(&req)
            .map_err(|e| Error::io(format!("writing to the {}", self.server), e))?;
        let mut ack = [0u8; 1];
        self.s
            .read_exact(&mut ack)
            .map_err(|e| Error::io(format!("reading from the {}", self.server), e))?;
        if ack[0] == DUPLICATE {
            return Err(self.duplicate());
        }
        Ok(())
    }

    /// The store's refusal of this process as a second copy of its rank (read after the status).
    fn duplicate(&mut self) -> Error {
        let why = read_blob(&mut self.s, MAX_VALUE).map_or_else(
            |e| format!("(its reason could not be read: {e})"),
            |b| String::from_utf8_lossy(&b).into_owned(),
        );
        Error::Handshake {
            peer: self.server.clone(),
            reason: format!("refused: {why}"),
        }
    }

    /// Get `key`, waiting up to the store timeout for some rank to set it; `who` names the rank
    /// expected to set it, for the error message.
    pub fn get(&mut self, key: &str, who: usize) -> Result<Vec<u8>> {
        let mut req = vec![GET];
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(self.timeout.as_millis() as u64).to_le_bytes());
        self.s
            .write_all(&req)
            .map_err(|e| Error::io(format!("writing to the {}", self.server), e))?;
        // The server answers by its own deadline; allow it some slack before giving up on it.
        self.s
            .set_read_timeout(Some(self.timeout + Duration::from_secs(5)))
            .map_err(|e| Error::io("store client", e))?;
        let mut status = [0u8; 1];
        self.s
            .read_exact(&mut status)
            .map_err(|e| Error::io(format!("reading from the {}", self.server), e))?;
        if status[0] == 2 {
            return Err(Error::PeerLost {
                op: "bootstrap".into(),
                seq: 0,
                peer: 0,
                detail: format!(
                    "the store closed (rank 0 dropped its communicator) before rank {who} set \
                     `{key}`"
                ),
            });
        }
        if status[0] == DUPLICATE {
            return Err(self.duplicate());
        }
        let blob = read_blob(&mut self.s, MAX_VALUE)
            .map_err(|e| Error::io(format!("reading from the {}", self.server), e))?;
        let text = || String::from_utf8_lossy(&blob).into_owned();
        match status[0] {
            0 => Ok(blob),
            3 => Err(Error::PeerLost {
                op: "bootstrap".into(),
                seq: 0,
                peer: who,
                detail: format!(
                    "waiting for store key `{key}`, the store refused a rank that never joined \
                     since: {} — start every rank with the same RINGZERO_JOB_ID, RINGZERO_SECRET \
                     and build",
                    text()
                ),
            }),
            _ => Err(Error::Timeout {
                op: "bootstrap".into(),
                seq: 0,
                peer: who,
                waiting: format!(
                    "store key `{key}` from rank {who}; the ranks that reached the store: [{}] \
                     (is rank {who} running, with the same master address, job id and secret?)",
                    text()
                ),
                after: self.timeout,
            }),
        }
    }
}
