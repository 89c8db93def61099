//! What the candle tests share: ranks as threads of the test process.

use ringzero_collectives::{Communicator, Config};

/// Run `body` on `n` ranks, each a thread with its own communicator.
pub fn ranks<R: Send>(n: usize, body: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let body = &body;
                s.spawn(move || {
                    body(Communicator::init(Config::new(r, n, "127.0.0.1", port)).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
