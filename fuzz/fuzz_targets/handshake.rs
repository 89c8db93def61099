//! The server side of the handshake, fed whatever a caller sends over a loopback connection.
#![no_main]
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use ringzero_collectives::internals::bootstrap::{handshake, Identity};

fuzz_target!(|data: &[u8]| {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut caller = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let _ = caller.write_all(data);
    let _ = caller.shutdown(std::net::Shutdown::Write);
    let (mut s, _) = l.accept().unwrap();
    let me = Identity {
        secret: b"secret",
        job_id: "job",
        rank: 0,
    };
    let _ = handshake::server(&mut s, &me, Duration::from_millis(50));
});
