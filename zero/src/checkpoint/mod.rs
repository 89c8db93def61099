//! Checkpoints: one safetensors file per rank, then a `meta.json` that rank 0 writes last.
//!
//! A checkpoint directory saved by `n` ranks holds:
//! - `rank-RRRRR-of-NNNNN.safetensors`, one per rank: for every bucket `b`, the range that rank
//!   owned, as f32 tensors `bucketBBBBB.master` and one per optimizer state, named as torch
//!   names them (`bucketBBBBB.exp_avg` and `bucketBBBBB.exp_avg_sq` for Adam, `.exp_avg` for
//!   Lion, `.momentum_buffer` for SGD with momentum; padding included, it is always zero);
//! - `meta.json` ([`Meta`]): the layout (world size, bucket size, every parameter's name and
//!   shape, bucket lengths), the optimizer and its states' names, the optimizer step, skipped steps, the fp16 loss-scaler state, the
//!   trainer's own `client_state`, and each shard file's size and SHA-256.
//!
//! Every file is written atomically (temporary file, fsync, rename). `meta.json` is the commit
//! marker: it is written only after every rank reported its shard written, so a directory without
//! it is a save that did not finish, and loading it says so.
//!
//! The format does not depend on the stage or the precision: stage 0 ranks save their owned range
//! too, and masters are fp32 in every precision (the 16-bit parameters are their rounding). A
//! checkpoint therefore loads at any stage, precision, bucket size or world size: the loader maps
//! each element by parameter name ([`plan`]), reading only the shards that hold what this rank now
//! owns, and checks each file's size and checksum before using it. [`consolidate`] streams the
//! shards into one file of full fp32 (or 16-bit) weights, one parameter in memory at a time.

pub mod plan;
pub(crate) mod protocol;

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use ringzero_collectives::internals::atomic_file::write_atomically;
use ringzero_kernels::cpu::cast;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::Precision;
use crate::error::ZeroError;
use crate::partition::{ParamSpec, Partition};
pub use crate::scaler::ScalerState;

/// The version of the layout above; a checkpoint of another version is refused.
pub const FORMAT: u32 = 1;
/// The commit marker and metadata file.
pub const META_FILE: &str = "meta.json";
/// What a checkpoint from before the optimizer was recorded holds: AdamW's states.
fn adamw_name() -> String {
    "AdamW".into()
}

/// The states of [`adamw_name`].
fn adam_states() -> Vec<String> {
    vec!["exp_avg".into(), "exp_avg_sq".into()]
}

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoints are written as little-endian f32 straight from memory");

/// A parameter as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamMeta {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// One rank's shard file as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMeta {
    /// File name in the checkpoint directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// SHA-256 of its contents, in hex.
    pub sha256: String,
}

/// `meta.json`: everything but the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// [`FORMAT`].
    pub format: u32,
    /// World size at save time.
    pub world: usize,
    /// ZeRO stage at save time (informational: any stage can load it).
    pub stage: u8,
    /// Precision at save time (informational: masters are fp32 in every precision).
    pub precision: String,
    /// Bucket size in elements at save time.
    pub bucket_elems: usize,
    /// Parameters, in the order that defined the saved layout.
    pub params: Vec<ParamMeta>,
    /// Padded length of every bucket of the saved layout (checked when the layout is rebuilt).
    pub buckets: Vec<usize>,
    /// The optimizer that took the steps (`AdamW`, `Adam`, `Lion`, `SGD`).
    #[serde(default = "adamw_name")]
    pub optimizer: String,
    /// The optimizer's fp32 states saved per bucket after the master, by name (torch's:
    /// `exp_avg`, `exp_avg_sq`, `momentum_buffer`).
    #[serde(default = "adam_states")]
    pub states: Vec<String>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Optimizer steps skipped on overflow.
    pub skipped: u64,
    /// fp16 dynamic loss scaling state (absent in other precisions).
    pub scaler: Option<ScalerState>,
    /// Whatever the trainer passed to `save_checkpoint` (data position, epoch, ...).
    pub client_state: serde_json::Value,
    /// Per rank, its shard file.
    pub shards: Vec<ShardMeta>,
}

impl Meta {
    /// The saved layout, rebuilt from the parameter list and checked against the saved bucket
    /// lengths.
    pub fn partition(&self) -> Result<Partition, String> {
        self.check_fields()?;
        let specs: Vec<ParamSpec> = self
            .params
            .iter()
            .map(|p| ParamSpec::new(p.name.clone(), &p.shape))
            .collect();
        let part =
            Partition::new(&specs, self.world, self.bucket_elems).map_err(|e| e.to_string())?;
        let lens: Vec<usize> = part.buckets.iter().map(|b| b.len).collect();
        if lens != self.buckets {
            return Err(format!(
                "its bucket lengths {:?} do not follow from its parameters and bucket size \
                 ({lens:?})",
                self.buckets
            ));
        }
        if self.shards.len() != self.world {
            return Err(format!(
                "it lists {} shard files for a world of {}",
                self.shards.len(),
                self.world
            ));
        }
        Ok(part)
    }
}

impl Meta {
    /// Every field on its own: values a save writes, so anything else is a damaged or edited
    /// file, refused with the field named before any of it is used.
    fn check_fields(&self) -> Result<(), String> {
        let bad = |field: &str, why: String| Err(format!("field `{field}` {why}"));
        if self.world == 0 {
            return bad("world", "is 0; a checkpoint has at least one rank".into());
        }
        if self.stage > 3 {
            return bad(
                "stage",
                format!("is {}; ZeRO stages are 0 to 3", self.stage),
            );
        }
        let precision: crate::Precision = match self.precision.parse() {
            Ok(p) => p,
            Err(e) => return bad("precision", format!("is invalid: {e}")),
        };
        if self.bucket_elems == 0 {
            return bad(
                "bucket_elems",
                "is 0; a bucket holds at least one element".into(),
            );
        }
        match (&self.scaler, precision) {
            (Some(_), p) if p != crate::Precision::Fp16 => {
                return bad(
                    "scaler",
                    format!("is set but the precision is {p}, not fp16"),
                );
            }
            (Some(sc), _) if !(sc.scale.is_finite() && sc.scale > 0.0) => {
                return bad(
                    "scaler.scale",
                    format!("is {}, not a positive number", sc.scale),
                );
            }
            _ => {}
        }
        let known = ["AdamW", "Adam", "Lion", "SGD"];
        if !known.contains(&self.optimizer.as_str()) {
            return bad(
                "optimizer",
                format!("is `{}`, none of {known:?}", self.optimizer),
            );
        }
        let states = ["exp_avg", "exp_avg_sq", "momentum_buffer"];
        if self.states.len() > 2 || self.states.iter().any(|x| !states.contains(&x.as_str())) {
            return bad(
                "states",
                format!("is {:?}; at most two of {states:?}", self.states),
            );
        }
        let mut names = std::collections::HashSet::new();
        for p in &self.params {
            if p.name.is_empty() || !names.insert(p.name.as_str()) {
                return bad("params", format!("names `{}` empty or twice", p.name));
            }
        }
        for (rank, sh) in self.shards.iter().enumerate() {
            if sh.file != shard_file(rank, self.world) {
                return bad(
                    "shards",
                    format!(
                        "gives rank {rank} the file `{}`; its file is `{}`",
                        sh.file,
                        shard_file(rank, self.world)
                    ),
                );
            }
            if sh.sha256.len() != 64 || !sh.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return bad(
                    "shards",
                    format!(
                        "gives rank {rank} the checksum `{}`, not SHA-256 hex",
                        sh.sha256
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Whether `name` is a temporary file of a save that did not finish: this project's own
/// (`.NAME.PID.tmp`, see `write_atomically`) or the safetensors writer's (`.tmpXXXXXX`).
pub fn is_temporary(name: &str) -> bool {
    name.starts_with('.') && (name.ends_with(".tmp") || name.starts_with(".tmp"))
}

/// The temporary files in `dir` that a save which did not finish left behind.
pub fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_temporary))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// The file name of `rank`'s shard in a checkpoint saved by `world` ranks.
pub fn shard_file(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// The name of state `state` (`master`, or one of [`Meta::states`]) of bucket `b` in a shard file.
pub fn tensor_name(b: usize, state: &str) -> String {
    format!("bucket{b:05}.{state}")
}

pub(crate) fn err(path: &Path, msg: impl std::fmt::Display) -> ZeroError {
    ZeroError::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

/// An f32 tensor borrowed for writing.
struct F32s<'a> {
    data: &'a [f32],
    shape: [usize; 1],
}

impl View for F32s<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(bytemuck::cast_slice(self.data))
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Refuse to save into `dir` when it already holds a checkpoint; create it otherwise.
pub(crate) fn prepare_dir(dir: &Path, rank: usize) -> Result<(), ZeroError> {
    if dir.join(META_FILE).exists() {
        return Err(err(
            dir,
            "already holds a checkpoint (meta.json); save into a new directory",
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| err(dir, format!("cannot create it: {e}")))?;
    // A save into this directory that was killed left its temporaries; this save's own start
    // only after every rank has prepared (the collective that follows), so rank 0 removes them
    // now.
    if rank == 0 {
        for t in temporaries(dir) {
            let _ = std::fs::remove_file(t);
        }
    }
    Ok(())
}

/// Write one rank's shard (`states[b]` = the master's and the optimizer states' ranges of
/// bucket `b`, the latter named `names` in order); its size and SHA-256, read back from the file.
pub(crate) fn write_shard(
    dir: &Path,
    rank: usize,
    world: usize,
    states: &[Vec<&[f32]>],
    names: &[&str],
) -> Result<(u64, [u8; 32]), ZeroError> {
    let file = shard_file(rank, world);
    let path = dir.join(&file);
    let tensors: Vec<(String, F32s)> = states
        .iter()
        .enumerate()
        .flat_map(|(b, s)| {
            std::iter::once("master")
                .chain(names.iter().copied())
                .zip(s.iter())
                .map(move |(name, data)| {
                    let t = F32s {
                        data,
                        shape: [data.len()],
                    };
                    (tensor_name(b, name), t)
                })
        })
        .collect();
    write_atomically(&path, |tmp| {
        safetensors::serialize_to_file(tensors, None, tmp).map_err(std::io::Error::other)
    })
    .map_err(|e| err(&path, format!("cannot write it: {e}")))?;
    digest_file(&path)
}

/// Write `meta.json` (the commit).
pub(crate) fn write_meta(dir: &Path, meta: &Meta) -> Result<(), ZeroError> {
    let path = dir.join(META_FILE);
    let json = serde_json::to_vec_pretty(meta).map_err(|e| err(&path, e))?;
    write_atomically(&path, |tmp| std::fs::write(tmp, &json))
        .map_err(|e| err(&path, format!("cannot write it: {e}")))?;
    Ok(())
}

/// Size and SHA-256 (hex) of a file, read in 1 MiB pieces.
fn digest_file(path: &Path) -> Result<(u64, [u8; 32]), ZeroError> {
    let mut f = std::fs::File::open(path).map_err(|e| err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| err(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        bytes += k as u64;
    }
    Ok((bytes, h.finalize().into()))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A shard file, mapped, checked and parsed.
struct Shard {
    map: Mmap,
    /// Where the tensors' data starts in the file.
    start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// A checkpoint opened for reading: its metadata, its layout, and the shard files read so far.
pub struct Checkpoint {
    dir: PathBuf,
    meta: Meta,
    part: Partition,
    shards: Vec<Option<Shard>>,
}

impl Checkpoint {
    /// Open the checkpoint in `dir`: read and check `meta.json`. Shard files are read later, only
    /// those needed.
    pub fn open(dir: &Path) -> Result<Checkpoint, ZeroError> {
        let path = dir.join(META_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let what = if dir.is_dir() {
                    "has no meta.json: not a checkpoint, or a save that did not finish"
                } else {
                    "does not exist"
                };
                return Err(err(dir, what));
            }
            Err(e) => return Err(err(&path, e)),
        };
        let meta: Meta = serde_json::from_slice(&bytes)
            .map_err(|e| err(&path, format!("not a ringzero checkpoint's metadata: {e}")))?;
        if meta.format != FORMAT {
            return Err(err(
                &path,
                format!("format {} (this build reads format {FORMAT})", meta.format),
            ));
        }
        let part = meta.partition().map_err(|e| err(&path, e))?;
        let shards = (0..meta.world).map(|_| None).collect();
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            meta,
            part,
            shards,
        })
    }

    /// The metadata.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The saved layout.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Read, check (size, SHA-256, every tensor's dtype and shape) and keep the shard of `rank`.
    pub fn verify(&mut self, rank: usize) -> Result<(), ZeroError> {
        if self.shards[rank].is_some() {
            return Ok(());
        }
        let sm = &self.meta.shards[rank];
        let path = self.dir.join(&sm.file);
        let file = std::fs::File::open(&path).map_err(|e| err(&path, e))?;
        // SAFETY: the map is read-only and private to this process. Another process truncating
        // the file while it is mapped would fault on access; checkpoints are written under a
        // temporary name and renamed, never rewritten in place, so a file that exists is
        // complete and nothing truncates it.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(&path, e))?;
        if map.len() as u64 != sm.bytes {
            return Err(err(
                &path,
                format!(
                    "is {} bytes, meta.json says {} (truncated or replaced)",
                    map.len(),
                    sm.bytes
                ),
            ));
        }
        let sum = hex(&Sha256::digest(&map[..]));
        if sum != sm.sha256 {
            return Err(err(
                &path,
                format!(
                    "checksum mismatch: SHA-256 {sum}, meta.json says {} (the file is corrupt)",
                    sm.sha256
                ),
            ));
        }
        let (n, md): (usize, Metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| err(&path, e))?;
        let tensors: HashMap<String, TensorInfo> = md
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        for b in 0..self.part.buckets.len() {
            let want = [self.part.owned(b, rank).len()];
            for state in self.state_names() {
                let name = tensor_name(b, state);
                match tensors.get(&name) {
                    Some(t) if t.dtype == Dtype::F32 && t.shape == want => {}
                    Some(t) => {
                        return Err(err(
                            &path,
                            format!(
                                "tensor `{name}` is {:?} {:?}, the layout wants F32 {want:?}",
                                t.dtype, t.shape
                            ),
                        ))
                    }
                    None => return Err(err(&path, format!("has no tensor `{name}`"))),
                }
            }
        }
        self.shards[rank] = Some(Shard {
            map,
            start: 8 + n,
            tensors,
        });
        Ok(())
    }

    /// Check every shard file (what `ringzero ckpt inspect` does).
    pub fn verify_all(&mut self) -> Result<(), ZeroError> {
        (0..self.meta.world).try_for_each(|r| self.verify(r))
    }

    /// The states each bucket has in the shard files: `master`, then [`Meta::states`].
    pub fn state_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once("master").chain(self.meta.states.iter().map(String::as_str))
    }

    /// Copy `pieces` of state `state` into `out` (the shards they name must be verified).
    fn fill(&self, state: &str, pieces: &[plan::Piece], out: &mut [f32]) {
        for pc in pieces {
            let sh = self.shards[pc.rank].as_ref().expect("shard verified first");
            let t = &sh.tensors[&tensor_name(pc.bucket, state)];
            let at = sh.start + t.data_offsets.0 + pc.src * 4;
            let bytes = &sh.map[at..at + pc.len * 4];
            for (o, c) in out[pc.dst..pc.dst + pc.len]
                .iter_mut()
                .zip(bytes.chunks_exact(4))
            {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }

    /// The states ([`Checkpoint::state_names`]) of elements `range` of bucket `b` of layout
    /// `now` (padding zero), reading and checking the shards that hold them.
    pub fn read_range(
        &mut self,
        now: &Partition,
        b: usize,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>, ZeroError> {
        let pieces = plan::bucket_pieces(&self.part, now, b, range.clone());
        for pc in &pieces {
            self.verify(pc.rank)?;
        }
        Ok(self
            .state_names()
            .map(|state| {
                let mut v = vec![0f32; range.len()];
                self.fill(state, &pieces, &mut v);
                v
            })
            .collect())
    }

    /// State `state` of the whole parameter `p` of the saved layout (its shards verified).
    fn param(&self, p: usize, state: &str) -> Vec<f32> {
        let mut v = vec![0f32; self.part.slots[p].len];
        let pieces = plan::param_pieces(&self.part, p, 0..v.len());
        self.fill(state, &pieces, &mut v);
        v
    }
}

/// What [`consolidate`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Consolidated {
    /// Tensors written.
    pub tensors: usize,
    /// Parameter elements (Ψ).
    pub elements: usize,
    /// Bytes of the output file.
    pub bytes: u64,
}

/// One parameter's state, assembled from the shards when the writer asks for its bytes.
struct Assembled<'a> {
    ck: &'a Checkpoint,
    param: usize,
    state: &'a str,
    dtype: Precision,
}

impl View for Assembled<'_> {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16 => Dtype::BF16,
            Precision::Fp16 => Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.ck.part.specs[self.param].shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let v = self.ck.param(self.param, self.state);
        Cow::Owned(match self.dtype {
            Precision::Fp32 => bytemuck::cast_slice(&v).to_vec(),
            Precision::Bf16 => {
                let mut o = vec![half::bf16::ZERO; v.len()];
                cast(&v, &mut o);
                bytemuck::cast_slice(&o).to_vec()
            }
            Precision::Fp16 => {
                let mut o = vec![half::f16::ZERO; v.len()];
                cast(&v, &mut o);
                bytemuck::cast_slice(&o).to_vec()
            }
        })
    }
    fn data_len(&self) -> usize {
        let w = if self.dtype == Precision::Fp32 { 4 } else { 2 };
        self.ck.part.slots[self.param].len * w
    }
}

/// Write every parameter of the checkpoint in `dir` as one safetensors file `out`, named as
/// declared, in `dtype` (the fp32 masters, rounded for 16-bit); with `optimizer`, also its
/// optimizer's states as `<name>.<state>` (`exp_avg` and `exp_avg_sq` for Adam, `exp_avg` for
/// Lion, `momentum_buffer` for SGD with momentum; in the same dtype). Every shard is checked first;
/// then each parameter is assembled only when written, so memory holds one parameter at a time.
/// `out` is written atomically and never left half-written.
pub fn consolidate(
    dir: &Path,
    out: &Path,
    dtype: Precision,
    optimizer: bool,
) -> Result<Consolidated, ZeroError> {
    let mut ck = Checkpoint::open(dir)?;
    ck.verify_all()?;
    let kept = if optimizer { ck.meta.states.len() } else { 0 };
    let states: Vec<String> = ck.state_names().take(1 + kept).map(String::from).collect();
    let names: Vec<String> = ck.part.specs.iter().map(|p| p.name.clone()).collect();
    if optimizer {
        for n in &names {
            for s in &states[1..] {
                let derived = format!("{n}.{s}");
                if names.contains(&derived) {
                    return Err(err(
                        out,
                        format!(
                            "parameter `{derived}` would clash with the optimizer state of `{n}`"
                        ),
                    ));
                }
            }
        }
    }
    let (ck, states) = (&ck, &states);
    let tensors: Vec<(String, Assembled)> = (0..names.len())
        .flat_map(|p| {
            states.iter().enumerate().map(move |(k, state)| {
                let name = match k {
                    0 => ck.part.specs[p].name.clone(),
                    _ => format!("{}.{state}", ck.part.specs[p].name),
                };
                (
                    name,
                    Assembled {
                        ck,
                        param: p,
                        state,
                        dtype,
                    },
                )
            })
        })
        .collect();
    let count = tensors.len();
    let info = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("ringzero_step".to_string(), ck.meta.step.to_string()),
    ]);
    write_atomically(out, |tmp| {
        safetensors::serialize_to_file(tensors, Some(info), tmp).map_err(std::io::Error::other)
    })
    .map_err(|e| err(out, format!("cannot write it: {e}")))?;
    let bytes = std::fs::metadata(out).map_err(|e| err(out, e))?.len();
    Ok(Consolidated {
        tensors: count,
        elements: ck.part.numel(),
        bytes,
    })
}
