//! The handshake in front of every TCP connection: magic, protocol version, job id, rank, and a
//! mutual HMAC-SHA256 challenge-response over the job secret.
//!
//! ```text
//! client → server  Hello     magic "RZHS", version, role, rank, sha256(job id), client nonce
//! server → client  Challenge magic, version, status, rank, server nonce,
//!                            HMAC(secret, "server" ‖ Hello ‖ server nonce)
//! client → server  Proof     HMAC(secret, "client" ‖ Hello ‖ Challenge)
//! server → client  Verdict   status
//! ```
//! Status codes say *which* check failed (version, job id, secret) so both ends can print it.
//! The secret never crosses the wire; a replayed proof fails because both nonces are fresh.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::{Error, Result};

/// `RZHS`
const MAGIC: [u8; 4] = *b"RZHS";
/// Handshake protocol version.
pub const PROTOCOL_VERSION: u16 = 2;
const HELLO_LEN: usize = 76;
const CHALLENGE_LEN: usize = 76;

const OK: u8 = 0;
const BAD_VERSION: u8 = 1;
const BAD_JOB: u8 = 2;
const BAD_SECRET: u8 = 3;

/// What a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// A connection to the rendezvous store.
    Store = 1,
    /// A data link: the ring's, or a pair's for point-to-point calls.
    Data = 2,
    /// A pair's data link for the pairwise collectives (all-to-all-v, gather, ...), apart from
    /// its point-to-point one so that messages pending there never stand in their way.
    Pairwise = 3,
}

/// Who this end is.
#[derive(Clone, Copy, Debug)]
pub struct Identity<'a> {
    /// Shared job secret.
    pub secret: &'a [u8],
    /// Job id.
    pub job_id: &'a str,
    /// This rank.
    pub rank: u32,
}

/// What the server learned about the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerHello {
    /// The client's rank.
    pub rank: u32,
    /// What the client wants the connection for.
    pub role: Role,
}

fn mac(secret: &[u8], label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    let reason = match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("timed out {what}")
        }
        std::io::ErrorKind::UnexpectedEof => format!("connection closed {what}"),
        _ => format!("{what}: {e}"),
    };
    Error::Handshake {
        peer: peer.to_string(),
        reason,
    }
}

/// The words that start the reason of a connection the server closed before its challenge.
const TURNED_AWAY: &str = "closed by the peer before its challenge";

/// The error of a connection closed (or reset) before the server's challenge: a listener that
/// had no place for another handshake (see `gate.rs`), which the caller may retry; anything else
/// as [`io_err`] says it.
fn turned_away(peer: &str, what: &str, e: std::io::Error) -> Error {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::UnexpectedEof | K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted => {
            Error::Handshake {
                peer: peer.to_string(),
                reason: format!("{TURNED_AWAY} ({what})"),
            }
        }
        _ => io_err(peer, what, e),
    }
}

/// Whether `e` is a connection the server closed before its challenge (retry it: the listener
/// was busy), not a refusal.
pub fn is_turned_away(e: &Error) -> bool {
    matches!(e, Error::Handshake { reason, .. } if reason.starts_with(TURNED_AWAY))
}

/// Run the client side on a fresh connection; returns the server's rank.
pub fn client(
    s: &mut TcpStream,
    me: &Identity,
    role: Role,
    peer: &str,
    timeout: Duration,
) -> Result<u32> {
    set_timeouts(s, timeout, peer)?;
    let mut hello = [0u8; HELLO_LEN];
    hello[0..4].copy_from_slice(&MAGIC);
    hello[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello[6] = role as u8;
    hello[8..12].copy_from_slice(&me.rank.to_le_bytes());
    hello[12..44].copy_from_slice(&Sha256::digest(me.job_id.as_bytes()));
    hello[44..76].copy_from_slice(&rand::random::<[u8; 32]>());
    s.write_all(&hello)
        .map_err(|e| turned_away(peer, "sending hello", e))?;

    let mut ch = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut ch)
        .map_err(|e| turned_away(peer, "waiting for the challenge", e))?;
    if ch[0..4] != MAGIC {
        return Err(Error::Handshake {
            peer: peer.into(),
            reason: "the peer does not speak the ringzero handshake".into(),
        });
    }
    let their_version = u16::from_le_bytes([ch[4], ch[5]]);
    let server_rank = u32::from_le_bytes(ch[8..12].try_into().unwrap());
    match ch[6] {
        OK => {}
        BAD_VERSION => {
            return Err(Error::Handshake {
                peer: peer.into(),
                reason: format!(
                    "refused: protocol version mismatch (peer speaks v{their_version}, this build v{PROTOCOL_VERSION})"
                ),
            })
        }
        BAD_JOB => {
            return Err(Error::Handshake {
                peer: peer.into(),
                reason: format!(
                    "refused: job id mismatch (this rank's job id is `{}`; the peer belongs to another job — \
                     check RINGZERO_JOB_ID and the master port)",
                    me.job_id
                ),
            })
        }
        other => {
            return Err(Error::Handshake { peer: peer.into(), reason: format!("refused with unknown status {other}") })
        }
    }
    let server_nonce = &ch[12..44];
    if mac(me.secret, b"server", &[&hello, server_nonce])
        .verify_slice(&ch[44..76])
        .is_err()
    {
        return Err(Error::Handshake {
            peer: peer.into(),
            reason: "authentication failed: the peer could not prove the job secret (RINGZERO_SECRET differs)".into(),
        });
    }
    let proof = mac(me.secret, b"client", &[&hello, &ch])
        .finalize()
        .into_bytes();
    s.write_all(&proof)
        .map_err(|e| io_err(peer, "sending proof", e))?;
    let mut verdict = [0u8; 1];
    s.read_exact(&mut verdict)
        .map_err(|e| io_err(peer, "waiting for the verdict", e))?;
    match verdict[0] {
        OK => Ok(server_rank),
        BAD_SECRET => Err(Error::Handshake {
            peer: peer.into(),
            reason: "refused: wrong job secret (RINGZERO_SECRET differs between ranks)".into(),
        }),
        other => Err(Error::Handshake {
            peer: peer.into(),
            reason: format!("refused with unknown status {other}"),
        }),
    }
}

/// The rank a caller claimed when the server side refused it for another job id, secret or
/// protocol version (a ringzero rank of a job set up wrong), or `None` for any other failure.
pub fn refused_rank(e: &Error) -> Option<u32> {
    let Error::Handshake { peer, reason } = e else {
        return None;
    };
    if !reason.starts_with("refused:") {
        return None;
    }
    peer.strip_prefix("rank ")?.split(' ').next()?.parse().ok()
}

/// Run the server side on an accepted connection; returns who the client is.
pub fn server(s: &mut TcpStream, me: &Identity, timeout: Duration) -> Result<PeerHello> {
    let peer = s
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "<unknown>".into());
    set_timeouts(s, timeout, &peer)?;
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello)
        .map_err(|e| io_err(&peer, "waiting for hello", e))?;
    if hello[0..4] != MAGIC {
        return Err(Error::Handshake {
            peer,
            reason: format!(
                "not a ringzero handshake (first bytes {:02x?})",
                &hello[0..4]
            ),
        });
    }
    let version = u16::from_le_bytes([hello[4], hello[5]]);
    let role = match hello[6] {
        1 => Role::Store,
        2 => Role::Data,
        3 => Role::Pairwise,
        r => {
            return Err(Error::Handshake {
                peer,
                reason: format!("unknown role {r}"),
            })
        }
    };
    let rank = u32::from_le_bytes(hello[8..12].try_into().unwrap());
    let peer = format!("rank {rank} at {peer}");
    let status = if version != PROTOCOL_VERSION {
        BAD_VERSION
    } else if hello[12..44] != Sha256::digest(me.job_id.as_bytes())[..] {
        BAD_JOB
    } else {
        OK
    };
    let mut ch = [0u8; CHALLENGE_LEN];
    ch[0..4].copy_from_slice(&MAGIC);
    ch[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    ch[6] = status;
    ch[8..12].copy_from_slice(&me.rank.to_le_bytes());
    let nonce: [u8; 32] = rand::random();
    ch[12..44].copy_from_slice(&nonce);
    if status == OK {
        ch[44..76].copy_from_slice(
            &mac(me.secret, b"server", &[&hello, &nonce])
                .finalize()
                .into_bytes(),
        );
    }
    s.write_all(&ch)
        .map_err(|e| io_err(&peer, "sending challenge", e))?;
    match status {
        BAD_VERSION => {
            return Err(Error::Handshake {
                peer,
                reason: format!(
                    "refused: protocol version v{version}, this build speaks v{PROTOCOL_VERSION}"
                ),
            })
        }
        BAD_JOB => {
            return Err(Error::Handshake {
                peer,
                reason: "refused: job id mismatch".into(),
            })
        }
        _ => {}
    }
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).map_err(|e| {
        use std::io::ErrorKind as K;
        match e.kind() {
            // The caller read our proof and hung up: it could not verify it.
            K::UnexpectedEof | K::ConnectionReset | K::BrokenPipe => Error::Handshake {
                peer: peer.clone(),
                reason: "refused: the caller could not verify this side's proof of the job \
                         secret (RINGZERO_SECRET differs between ranks)"
                    .into(),
            },
            _ => io_err(&peer, "waiting for proof", e),
        }
    })?;
    if mac(me.secret, b"client", &[&hello, &ch])
        .verify_slice(&proof)
        .is_err()
    {
        let _ = s.write_all(&[BAD_SECRET]);
        return Err(Error::Handshake {
            peer,
            reason: "refused: wrong job secret (RINGZERO_SECRET differs between ranks)".into(),
        });
    }
    s.write_all(&[OK])
        .map_err(|e| io_err(&peer, "sending verdict", e))?;
    Ok(PeerHello { rank, role })
}

fn set_timeouts(s: &TcpStream, t: Duration, peer: &str) -> Result<()> {
    s.set_read_timeout(Some(t))
        .and_then(|_| s.set_write_timeout(Some(t)))
        .map_err(|e| Error::io(format!("setting handshake timeouts with {peer}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(
        server_id: Identity<'static>,
        client_id: Identity<'static>,
    ) -> (Result<PeerHello>, Result<u32>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            server(&mut s, &server_id, Duration::from_secs(5))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let r = client(
            &mut c,
            &client_id,
            Role::Data,
            "test",
            Duration::from_secs(5),
        );
        drop(c);
        (t.join().unwrap(), r)
    }

    const A: Identity<'static> = Identity {
        secret: b"s3cret",
        job_id: "job",
        rank: 0,
    };

    #[test]
    fn matching_identities_connect() {
        let (s, c) = pair(A, Identity { rank: 3, ..A });
        assert_eq!(
            s.unwrap(),
            PeerHello {
                rank: 3,
                role: Role::Data
            }
        );
        assert_eq!(c.unwrap(), 0);
    }

    #[test]
    fn wrong_secret_is_refused_on_both_ends_and_says_so() {
        let (s, c) = pair(
            A,
            Identity {
                secret: b"other",
                rank: 1,
                ..A
            },
        );
        assert!(c
            .unwrap_err()
            .to_string()
            .contains("RINGZERO_SECRET differs"));
        assert!(s.unwrap_err().to_string().contains("RINGZERO_SECRET"));
    }

    #[test]
    fn wrong_job_is_refused_and_says_so() {
        let (s, c) = pair(
            A,
            Identity {
                job_id: "other-job",
                rank: 1,
                ..A
            },
        );
        assert!(c.unwrap_err().to_string().contains("job id mismatch"));
        assert!(s.unwrap_err().to_string().contains("job id mismatch"));
    }

    #[test]
    fn wrong_version_is_refused_and_says_so() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            server(&mut s, &A, Duration::from_secs(5))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        hello[0..4].copy_from_slice(&MAGIC);
        hello[4..6].copy_from_slice(&99u16.to_le_bytes());
        hello[6] = 2;
        c.write_all(&hello).unwrap();
        let mut ch = [0u8; CHALLENGE_LEN];
        c.read_exact(&mut ch).unwrap();
        assert_eq!(ch[6], BAD_VERSION);
        assert!(t.join().unwrap().unwrap_err().to_string().contains("v99"));
    }

    #[test]
    fn random_bytes_are_dropped() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            server(&mut s, &A, Duration::from_secs(5))
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(&[0x5a; 200]).unwrap();
        assert!(t
            .join()
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("not a ringzero handshake"));
    }
}
