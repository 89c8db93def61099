//! Requests to the store after a valid handshake: whatever follows, the store answers or drops
//! that connection, and a real client is still served.
#![no_main]
use std::io::Write;
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use ringzero_collectives::internals::bootstrap::{handshake, Identity, Role, StoreServer};

fn store() -> &'static StoreServer {
    static S: OnceLock<StoreServer> = OnceLock::new();
    S.get_or_init(|| {
        let addr = "127.0.0.1:0".parse().unwrap();
        StoreServer::start(
            addr,
            b"secret".to_vec(),
            "job".into(),
            Duration::from_millis(200),
        )
        .unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let port = store().addr().port();
    let me = Identity {
        secret: b"secret",
        job_id: "job",
        rank: data.first().copied().unwrap_or(0) as u32,
    };
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    if handshake::client(&mut s, &me, Role::Store, "store", Duration::from_secs(1)).is_ok() {
        let _ = s.write_all(data);
    }
});
