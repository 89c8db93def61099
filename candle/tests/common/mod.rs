//! What the candle tests share: ranks as threads of the test process, and a small GPT on a
//! small corpus.

use ringzero_candle::corpus::Corpus;
use ringzero_candle::gpt::GptConfig;
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

/// A 32 KiB corpus generated from `seed`, and a two-block GPT of width 32 over its vocabulary
/// (context 16, two heads).
#[allow(dead_code)] // not every test file trains this one
pub fn small_gpt(seed: u64) -> (Corpus, GptConfig) {
    let corpus = Corpus::generate(32 << 10, seed);
    let shape = GptConfig {
        vocab: corpus.vocab(),
        ctx: 16,
        dim: 32,
        heads: 2,
        layers: 2,
    };
    (corpus, shape)
}
