//! Bad input never panics: the parsers that read what arrives from outside — a frame header, a
//! handshake, a store request, `meta.json`, the environment — are fed random and mutated input
//! (proptest, a bounded number of cases each) and must answer with an error or a value. The
//! listeners must also go on serving: after garbage, a real client still gets through.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use ringzero::Config;
use ringzero_collectives::internals::bootstrap::{handshake, Identity, StoreClient, StoreServer};
use ringzero_collectives::internals::wire::{FrameHeader, HEADER_LEN};

/// The variables ringzero reads, launchers' included.
const VARS: &[&str] = &[
    "RINGZERO_RANK",
    "RINGZERO_WORLD_SIZE",
    "RINGZERO_LOCAL_RANK",
    "RINGZERO_LOCAL_WORLD_SIZE",
    "RINGZERO_MASTER_ADDR",
    "RINGZERO_MASTER_PORT",
    "RINGZERO_SECRET",
    "RINGZERO_JOB_ID",
    "RINGZERO_NODE_ID",
    "RINGZERO_TIMEOUT",
    "RINGZERO_TRANSPORT",
    "RINGZERO_SHM_DISABLE",
    "RINGZERO_P2P_DISABLE",
    "RINGZERO_SLICE_BYTES",
    "RINGZERO_DEVICE_SLICE_BYTES",
    "RINGZERO_SLOTS",
    "RINGZERO_TCP_SOCKETS",
    "RINGZERO_STREAM_STORES_FROM",
    "RINGZERO_SINGLE_COPY_FROM",
    "RINGZERO_SINGLE_COPY_BELOW",
    "RINGZERO_SHM_DIR",
    "RINGZERO_STAGING",
    "RINGZERO_DEVICE_ALGO",
    "RINGZERO_DEVICE_COPY_PAIRS",
    "RINGZERO_FLIGHT_ENTRIES",
    "RINGZERO_DUMP_DIR",
    "RINGZERO_DUMP_ON_SIGUSR1",
    "RINGZERO_DUMP_ON_SIGTERM",
    "RINGZERO_ALGO",
    "RINGZERO_DOUBLING_MAX",
    "RINGZERO_HALVING_MAX",
    "RINGZERO_PAIRWISE_MAX",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
];

/// Values that stress a parser: numbers at and past every bound, sizes, words, garbage.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| v.to_string()),
        prop_oneof![
            Just("1e20"),
            Just("1e300"),
            Just("-0"),
            Just("NaN"),
            Just("inf"),
            Just("18446744073709551616"),
            Just("0x10"),
            Just("1G"),
            Just("16E"),
            Just("99999999999999999999K"),
            Just(""),
            Just(" "),
            Just("auto"),
            Just("on"),
            Just("ring"),
            Just("127.0.0.1"),
            Just("::1"),
            Just("/nonexistent/dir"),
        ]
        .prop_map(String::from),
        "[ -~]{0,40}",
        "\\PC{0,12}",
    ]
}

/// A valid `meta.json` (a two-rank fp16 checkpoint's, abridged), as a JSON value.
fn meta() -> serde_json::Value {
    serde_json::json!({
        "format": 1, "world": 2, "stage": 2, "precision": "fp16", "bucket_elems": 64,
        "params": [{"name": "w", "shape": [4, 3]}, {"name": "b", "shape": [3]}],
        "buckets": [16], "step": 3, "skipped": 1,
        "scaler": {"scale": 1024.0, "good": 2, "hysteresis_left": 2},
        "client_state": null,
        "shards": [
            {"file": "rank-00000-of-00002.safetensors", "bytes": 10, "sha256": "0".repeat(64)},
            {"file": "rank-00001-of-00002.safetensors", "bytes": 10, "sha256": "0".repeat(64)}
        ]
    })
}

/// Any JSON value, a few levels deep.
fn json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        "[ -~]{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

fn dir(name: &str) -> crate::common::Scratch {
    crate::common::fresh_dir(name)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_frame_header_bytes_decode_or_fail(bytes in prop::array::uniform32(any::<u8>()),
                                             tail in prop::collection::vec(any::<u8>(), HEADER_LEN)) {
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&tail);
        h[..32.min(HEADER_LEN)].copy_from_slice(&bytes[..32.min(HEADER_LEN)]);
        let _ = FrameHeader::decode(&h);
    }

    #[test]
    fn any_environment_configures_or_names_the_variable(
        vars in prop::collection::btree_map(prop::sample::select(VARS), value(), 0..8)
    ) {
        let lookup = |k: &str| vars.get(k).cloned();
        if let Err(e) = Config::from_lookup(&lookup) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn any_meta_json_field_value_opens_or_is_refused(field in prop::sample::select(
        &["format", "world", "stage", "precision", "bucket_elems", "params", "buckets",
          "step", "skipped", "scaler", "client_state", "shards"][..]),
        v in json()
    ) {
        let d = dir("no-panic-meta");
        let mut m = meta();
        m[field] = v;
        std::fs::write(d.join("meta.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        let _ = ringzero::zero::checkpoint::Checkpoint::open(&d);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Garbage to a handshake's server side: an error, within its deadline.
    #[test]
    fn any_bytes_to_a_handshake_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let sender = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        });
        let (mut s, _) = l.accept().unwrap();
        let me = Identity { secret: b"secret", job_id: "job", rank: 0 };
        let r = handshake::server(&mut s, &me, Duration::from_millis(300));
        drop(s);
        sender.join().unwrap();
        prop_assert!(r.is_err());
    }
}

/// Garbage to the store (before and after a valid handshake) drops that connection only: a
/// real rank still sets and gets keys.
#[test]
fn the_store_survives_garbage_and_serves_a_real_client() {
    let server = StoreServer::start(
        "127.0.0.1:0".parse().unwrap(),
        b"secret".to_vec(),
        "job".into(),
        Duration::from_secs(5),
    )
    .unwrap();
    let port = server.addr().port();
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let garbage = prop::collection::vec(any::<u8>(), 0..300);
    for _ in 0..40 {
        let bytes = garbage.new_tree(&mut runner).unwrap().current();
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let _ = s.write_all(&bytes);
        drop(s);
    }
    let me = Identity {
        secret: b"secret",
        job_id: "job",
        rank: 1,
    };
    // A real client whose requests turn to garbage after the handshake.
    {
        let mut c = StoreClient::connect("127.0.0.1", port, &me, Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
    }
    let raw_client = |rank: u32, tail: &[u8]| {
        let id = Identity {
            secret: b"secret",
            job_id: "job",
            rank,
        };
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        handshake::client(
            &mut s,
            &id,
            ringzero_collectives::internals::bootstrap::Role::Store,
            "store",
            Duration::from_secs(5),
        )
        .unwrap();
        let _ = s.write_all(tail);
    };
    raw_client(2, &[1, 0xff, 0xff, 0xff, 0xff]);
    raw_client(3, &[9, 1, 0, 0, 0, b'x']);
    raw_client(4, &[2, 1, 0, 0, 0, b'k', 1]);
    let me = Identity {
        secret: b"secret",
        job_id: "job",
        rank: 5,
    };
    let mut c = StoreClient::connect("127.0.0.1", port, &me, Duration::from_secs(5)).unwrap();
    assert_eq!(c.get("k", 1).unwrap(), b"v");
}
