//! `ringzero ckpt`: look inside a ZeRO checkpoint (layout, state, every shard checked) and
//! consolidate its shards into one file of full weights, as DeepSpeed's `zero_to_fp32.py` does.

use std::path::Path;

use ringzero_zero::checkpoint::{self, Checkpoint};

/// What `ckpt inspect` found: the metadata and, per shard, the problem if any.
#[derive(Debug, serde::Serialize)]
pub struct Inspection {
    /// `meta.json`.
    pub meta: checkpoint::Meta,
    /// Parameter elements (Ψ) and with padding.
    pub numel: (usize, usize),
    /// Per rank: `None` when its shard checks out, else what is wrong with it.
    pub shards: Vec<Option<String>>,
    /// Temporary files of a save that did not finish (name, bytes): harmless to a load, removed
    /// by the next save into this directory, or by hand.
    pub temporaries: Vec<(String, u64)>,
}

impl Inspection {
    /// Whether every shard checks out.
    pub fn ok(&self) -> bool {
        self.shards.iter().all(Option::is_none)
    }
}

/// Open the checkpoint in `dir` and check every shard (size, SHA-256, tensors). An unreadable
/// `meta.json` is an error; a bad shard is reported in the inspection.
pub fn inspect(dir: &Path) -> Result<Inspection, ringzero_zero::ZeroError> {
    let mut ck = Checkpoint::open(dir)?;
    let shards = (0..ck.meta().world)
        .map(|r| ck.verify(r).err().map(|e| e.to_string()))
        .collect();
    let p = ck.partition();
    let temporaries = checkpoint::temporaries(dir)
        .into_iter()
        .map(|t| {
            let bytes = std::fs::metadata(&t).map_or(0, |m| m.len());
            let name = t.file_name().map(|n| n.to_string_lossy().into_owned());
            (name.unwrap_or_default(), bytes)
        })
        .collect();
    Ok(Inspection {
        numel: (p.numel(), p.padded_numel()),
        meta: ck.meta().clone(),
        shards,
        temporaries,
    })
}

fn size(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// The inspection as text.
pub fn text(dir: &Path, i: &Inspection) -> String {
    let m = &i.meta;
    let mut s = format!(
        "checkpoint {}: format {}, saved by {} ranks (stage {}, {}, buckets of {} elements) \
         after {} optimizer steps ({} skipped)\n",
        dir.display(),
        m.format,
        m.world,
        m.stage,
        m.precision,
        m.bucket_elems,
        m.step,
        m.skipped
    );
    s += &format!(
        "parameters: {} (Ψ = {} elements, {} with padding) in {} buckets; loads at any world \
         size, stage or precision\n",
        m.params.len(),
        i.numel.0,
        i.numel.1,
        m.buckets.len()
    );
    if let Some(sc) = m.scaler {
        s += &format!(
            "fp16 loss scale {} ({} good steps since its last change)\n",
            sc.scale, sc.good
        );
    }
    if !m.client_state.is_null() {
        s += &format!("client state: {}\n", m.client_state);
    }
    for (sh, bad) in m.shards.iter().zip(&i.shards) {
        s += &format!(
            "  {}  {:>10}  {}\n",
            sh.file,
            size(sh.bytes),
            match bad {
                None => "size and SHA-256 check out".to_string(),
                Some(e) => format!("BAD: {e}"),
            }
        );
    }
    if !i.temporaries.is_empty() {
        let bytes: u64 = i.temporaries.iter().map(|(_, b)| b).sum();
        s += &format!(
            "{} temporary file(s) of a save that did not finish ({}; not part of the checkpoint, \
             removed by the next save into this directory, or remove them by hand):\n",
            i.temporaries.len(),
            size(bytes)
        );
        for (name, b) in &i.temporaries {
            s += &format!("  {name}  {:>10}\n", size(*b));
        }
    }
    let bad = i.shards.iter().filter(|b| b.is_some()).count();
    s += &if bad == 0 {
        format!("all {} shards check out\n", m.world)
    } else {
        format!(
            "{bad} of {} shards are bad: this checkpoint cannot be loaded\n",
            m.world
        )
    };
    s
}
