//! What one rank holds while training the GPT through [`Zero`](crate::Zero), by category, and
//! the process's peak resident memory to set it against.
//!
//! The engine counts its own bytes exactly (model states by the ZeRO formula, communication
//! buffers as held); the communicators' ring slots follow from their configuration. candle adds the variables (the full parameters in f32, at every stage), the
//! gradient store (one f32 per parameter), and the forward graph: every op's output stays alive
//! until the loss is dropped after backward, so the activations are the sum of every
//! intermediate tensor ([`GptConfig::activation_elems`]); backward adds the gradients of one
//! block's worth of intermediates at a time on top.

use ringzero_zero::comm_peak::{comm_buffers_peak, Call};
use ringzero_zero::{ParamSpec, Partition, ZeroConfig};

use crate::gpt::GptConfig;
use crate::{Error, Result};

impl GptConfig {
    /// f32 elements of every intermediate tensor one forward and loss of `batch` sequences of
    /// `ctx` tokens create (what the graph keeps alive through backward), counted op by op as
    /// [`Gpt`](crate::gpt::Gpt) runs them: per block, each layer norm 5 of `(n, dim)` and 6 of
    /// `n` (n = batch × ctx), each linear its product and the bias sum, q/k/v a reshaped and a
    /// contiguous copy each, the scores 4 of `(batch, heads, ctx, ctx)` (product, scaled,
    /// masked, softmax), the attention output and its reshape, two residual sums and the GELU;
    /// then the final norm, the logits (2 of `(n, vocab)`) and the log-softmax (3 of `(n, vocab)`).
    pub fn activation_elems(&self, batch: usize) -> usize {
        let n = batch * self.ctx;
        let (c, v) = (self.dim, self.vocab);
        let norm = 5 * n * c + 6 * n;
        let scores = 4 * batch * self.heads * self.ctx * self.ctx;
        let block = 2 * norm
            + 2 * 3 * n * c // qkv
            + 3 * 2 * n * c // q, k, v reshaped and made contiguous
            + scores
            + 2 * n * c // attention output, reshaped
            + 2 * n * c // proj
            + 2 * 4 * n * c // fc
            + 4 * n * c // gelu
            + 2 * n * c // out
            + 2 * n * c; // residual sums
        let embed = 2 * n * c + self.ctx * c;
        embed + self.layers * block + norm + 2 * n * v + 3 * n * v
    }

    /// f32 elements of one block's intermediates (what backward holds the gradients of at once).
    pub fn block_activation_elems(&self, batch: usize) -> usize {
        let one = GptConfig { layers: 1, ..*self };
        let none = GptConfig { layers: 0, ..*self };
        one.activation_elems(batch) - none.activation_elems(batch)
    }
}

/// One rank's bytes while training, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// The engine's model states (parameters, gradients, optimizer state and master weights),
    /// the offload tier's host memory included (on the CPU it is this process's too).
    pub model_states: usize,
    /// The engine's communication buffers at their largest.
    pub comm_buffers: usize,
    /// The ring slots this rank's frames fill: its incoming and outgoing links' `slots ×
    /// slice_bytes` each, for the host communicator and for the engine's communicator on the
    /// host stream (shared memory, resident once touched).
    pub slots: usize,
    /// candle's variables: every parameter in f32.
    pub vars: usize,
    /// candle's gradient store: every parameter's gradient in f32.
    pub grads: usize,
    /// The forward graph's tensors.
    pub activations: usize,
    /// Backward's gradients of one block's intermediates.
    pub backward: usize,
    /// Of the engine's bytes, those in the memory candle computes in when that is a device's:
    /// the model states and communication buffers of an engine on a GPU (not its offload tier).
    /// Zero on the CPU, where all of it is host memory.
    pub engine_on_device: usize,
    /// The engine's device communicator's slots in the device's memory when candle computes on
    /// one ([`Footprint::on_gpu`]); zero on the CPU, where `slots` counts them.
    pub device_slots: usize,
}

impl Footprint {
    /// The GPT `shape` on `batch` sequences per micro-step, with the engine's counts.
    /// `slots` and `slice_bytes` are the communicator's (`Config::slots`, `Config::slice_bytes`).
    pub fn of(
        shape: &GptConfig,
        batch: usize,
        (model_states, comm_buffers): (usize, usize),
        (slots, slice_bytes): (usize, usize),
    ) -> Footprint {
        Footprint {
            model_states,
            comm_buffers,
            slots: 2 * 2 * slots * slice_bytes,
            vars: 4 * shape.params(),
            grads: 4 * shape.params(),
            activations: 4 * shape.activation_elems(batch),
            backward: 4 * shape.block_activation_elems(batch),
            engine_on_device: 0,
            device_slots: 0,
        }
    }

    /// The same footprint with candle and the engine on a GPU: `engine_on_device` of the
    /// engine's bytes in its memory, and its communicator's `device_slots` there too (over
    /// cuda_ipc the receive edge's `slots × device slice bytes`; explicit-copy host staging's
    /// device scratch: [`DeviceComm::device_bytes`](ringzero_collectives::DeviceComm::device_bytes)).
    /// Over cuda_ipc the engine's communicator has no slots in host memory, so of `slots` only
    /// the host communicator's stay; host staging (`staged`) keeps its slots in host memory.
    pub fn on_gpu(self, engine_on_device: usize, device_slots: usize, staged: bool) -> Footprint {
        Footprint {
            engine_on_device,
            device_slots,
            slots: if staged { self.slots } else { self.slots / 2 },
            ..self
        }
    }

    /// What lives where candle computes (on a GPU: its memory): the variables, the gradient
    /// store, the activations and backward's working set.
    pub fn candle(&self) -> usize {
        self.vars + self.grads + self.activations + self.backward
    }

    /// What the engine and the communicators hold.
    pub fn engine(&self) -> usize {
        self.model_states + self.comm_buffers + self.slots + self.device_slots
    }

    /// What lives in the device's memory when candle computes on one: candle's part, the
    /// engine's part there ([`Footprint::engine_on_device`]) and its communicator's slots.
    pub fn device(&self) -> usize {
        self.candle() + self.engine_on_device + self.device_slots
    }

    /// What lives in host memory when candle computes on a device: the rest.
    pub fn host(&self) -> usize {
        self.total() - self.device()
    }

    /// All of it.
    pub fn total(&self) -> usize {
        self.model_states
            + self.comm_buffers
            + self.slots
            + self.device_slots
            + self.vars
            + self.grads
            + self.activations
            + self.backward
    }
}

/// The engine's communication buffers at their peak while [`crate::train`] trains the GPT
/// `shape` under `cfg` on `world` ranks for `steps` optimizer steps: the calls it makes —
/// [`crate::Zero::on`]'s first load (at stage 3 bucket by bucket), then per micro-step
/// forward's gathers module by module (stage 3), backward's gradients last variable first, and
/// the step — replayed through the engine's bookkeeping ([`ringzero_zero::comm_peak`]). Steps
/// past the third repeat the third (its gathers follow the order the second recorded), so at
/// most three are replayed.
pub fn comm_buffers_peak_for(
    shape: &GptConfig,
    cfg: &ZeroConfig,
    world: usize,
    steps: usize,
) -> Result<usize> {
    let mut vars = shape.variables();
    // The engine's order (`Zero::on`).
    vars.sort_by_key(|(n, _)| crate::zero::natural(n));
    let specs: Vec<ParamSpec> = vars.iter().map(|(n, d)| ParamSpec::new(n, d)).collect();
    let shard = cfg.shard_size.unwrap_or(world);
    let part = Partition::new(&specs, shard, cfg.bucket_elems)
        .map_err(|e| Error::Invalid(format!("laying out the GPT's parameters: {e}")))?;
    let mut calls = Vec::new();
    let stage3 = cfg.stage == 3;
    if stage3 {
        for b in &part.buckets {
            calls.push(Call::Gather(b.params.clone()));
            calls.push(Call::Release(b.params.clone()));
        }
        calls.push(Call::RestartOrder);
    }
    let modules: Vec<Vec<usize>> = shape
        .modules()
        .iter()
        .map(|m| {
            (0..specs.len())
                .filter(|&i| specs[i].name.starts_with(m.as_str()))
                .collect()
        })
        .collect();
    for _ in 0..steps.min(3) * cfg.accumulation_steps.max(1) {
        if stage3 {
            for m in &modules {
                calls.push(Call::Gather(m.clone()));
                calls.push(Call::Release(m.clone()));
            }
        }
        calls.extend((0..specs.len()).rev().map(Call::Push));
        calls.push(Call::Step);
    }
    Ok(comm_buffers_peak(&part, cfg, calls)?)
}

/// This process's resident memory (`VmRSS`) and its peak (`VmHWM`), in bytes, from
/// `/proc/self/status`; `None` where there is none (not Linux).
pub fn rss() -> Option<(usize, usize)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<usize> {
        let line = s.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace()
            .nth(1)?
            .parse::<usize>()
            .ok()
            .map(|k| k * 1024)
    };
    Some((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// The GPU memory the CUDA driver reports for this process (`nvidia-smi
/// --query-compute-apps`), in bytes; `None` where `nvidia-smi` is missing or does not list it
/// (under MPS the server holds the memory, and no figure per client is given).
pub fn device_used() -> Option<usize> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    let me = std::process::id().to_string();
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let (pid, mib) = l.split_once(',')?;
        (pid.trim() == me)
            .then(|| mib.trim().parse::<usize>().ok())
            .flatten()
            .map(|m| m << 20)
    })
}

/// The high-water marks of the default memory pool of CUDA device `ordinal`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolPeak {
    /// The most candle's tensors held at once (candle allocates them there, stream-ordered).
    pub used: usize,
    /// The most the pool took from the driver at once: `used` and the free blocks it kept
    /// between them (freed tensors whose blocks did not fit the next request). The driver's
    /// figure for the process counts this.
    pub reserved: usize,
}

/// The high-water marks of the default memory pool of CUDA device `ordinal` ([`PoolPeak`]).
/// `restart` starts both again from what is used and reserved now. `None` in a build without
/// the `cuda` feature, or where the driver refuses.
pub fn pool_peak(ordinal: usize, restart: bool) -> Option<PoolPeak> {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A, CUresult};
        let pool = default_pool(ordinal)?;
        let high = |attr: A| {
            let mut v = 0u64;
            // SAFETY: `pool` is the device's default pool (`default_pool`); both high-water
            // attributes are cuuint64_t, read from and written to a local (setting one resets it).
            let ok = unsafe {
                (!restart
                    || sys::cuMemPoolSetAttribute(pool, attr, (&raw mut v).cast())
                        == CUresult::CUDA_SUCCESS)
                    && sys::cuMemPoolGetAttribute(pool, attr, (&raw mut v).cast())
                        == CUresult::CUDA_SUCCESS
            };
            ok.then_some(v as usize)
        };
        Some(PoolPeak {
            used: high(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: high(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, restart);
        None
    }
}

/// The default memory pool of CUDA device `ordinal` (where candle allocates its tensors);
/// `None` where the driver refuses.
#[cfg(feature = "cuda")]
fn default_pool(ordinal: usize) -> Option<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys::{self, CUresult};
    let (mut dev, mut pool) = (0, std::ptr::null_mut());
    // SAFETY: each call writes only through the pointer it is given, to a local of the type
    // the driver API names (CUdevice, CUmemoryPool); the driver was initialised when candle
    // opened the device, and a failure is returned, not acted on.
    let ok = unsafe {
        sys::cuDeviceGet(&mut dev, i32::try_from(ordinal).ok()?) == CUresult::CUDA_SUCCESS
            && sys::cuDeviceGetDefaultMemPool(&mut pool, dev) == CUresult::CUDA_SUCCESS
    };
    ok.then_some(pool)
}

/// Hand every free block of CUDA device `ordinal`'s default pool back to the driver (what
/// candle's freed tensors left there); whether the driver did (`false` without the `cuda`
/// feature).
pub fn trim_pool(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::sys::{self, CUresult};
        let Some(pool) = default_pool(ordinal) else {
            return false;
        };
        // SAFETY: `pool` is the device's default pool (`default_pool`); trimming frees only
        // blocks no allocation holds.
        unsafe { sys::cuMemPoolTrimTo(pool, 0) == CUresult::CUDA_SUCCESS }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

/// The most device memory ringzero's own allocations in this process held at once (the
/// engine's model states and buffers, its communicators' slots and scratch: every
/// `cuMemAlloc` it makes, outside candle's pool), and the most of its peers' memory it had
/// mapped at once (CUDA IPC: a direct collective's view of the other ranks' buffers, theirs,
/// though the driver may list it here too), in bytes; `restart` starts both marks again from
/// what is held now. `None` in a build without the `cuda` feature.
pub fn ringzero_device_peak(restart: bool) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    {
        use ringzero_kernels::device::cuda;
        if restart {
            cuda::reset_allocated_peak();
        }
        Some((cuda::allocated().peak, cuda::mapped().peak))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = restart;
        None
    }
}

/// Make the default memory pool of CUDA device `ordinal` keep what candle's tensors free (its
/// release threshold at the maximum, as PyTorch's caching allocator keeps its blocks) instead
/// of handing it back to the driver at every synchronisation: then the driver's figure for the
/// process holds the most the pool ever took, and no step maps memory afresh. Whether the
/// driver took the setting (`false` without the `cuda` feature).
pub fn keep_pool(ordinal: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::sys::{self, CUmemPool_attribute, CUresult};
        let keep = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        let Some(pool) = default_pool(ordinal) else {
            return false;
        };
        let mut v = u64::MAX;
        // SAFETY: `pool` is the device's default pool (`default_pool`); the threshold is a
        // cuuint64_t, read from a local.
        unsafe {
            sys::cuMemPoolSetAttribute(pool, keep, (&raw mut v).cast()) == CUresult::CUDA_SUCCESS
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        false
    }
}

/// Restart the peak (`VmHWM`) from the current resident memory (Linux's `clear_refs` 5);
/// whether it could.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_grow_with_the_batch_and_the_blocks_and_the_scores_with_context_squared() {
        let g = GptConfig::tiny(40);
        // Linear in the batch, past the position embeddings' one (ctx, dim) output.
        let a = |b| g.activation_elems(b);
        assert_eq!(a(8) - a(4), a(4) - a(0));
        assert_eq!(a(0), g.ctx * g.dim);
        let deeper = GptConfig { layers: 3, ..g };
        assert_eq!(
            deeper.activation_elems(4) - g.activation_elems(4),
            g.block_activation_elems(4)
        );
        let long = GptConfig {
            ctx: 2 * g.ctx,
            ..g
        };
        let (s1, s2) = (
            4 * g.heads * g.ctx * g.ctx,
            4 * long.heads * long.ctx * long.ctx,
        );
        assert_eq!(s2, 4 * s1);
        assert!(long.block_activation_elems(1) > 2 * g.block_activation_elems(1));
    }

    #[test]
    fn the_peak_can_be_read_and_restarted_here() {
        // Other tests run in this process at the same time and allocate a little, so the
        // peak is raised by a block far larger than theirs, touched page by page, then freed
        // (a block this size is mapped on its own and goes back to the system when dropped).
        const BLOCK: usize = 256 << 20;
        let (now, hwm) = rss().expect("Linux's /proc/self/status");
        assert!(now > 0 && hwm >= now);
        let block = vec![1u8; BLOCK];
        assert_eq!(std::hint::black_box(&block)[BLOCK - 1], 1);
        drop(block);
        let (_, raised) = rss().unwrap();
        assert!(
            raised >= now + BLOCK / 2,
            "peak {raised} after touching {BLOCK} bytes from {now}"
        );
        assert!(reset_peak());
        let (_, restarted) = rss().unwrap();
        assert!(
            restarted + BLOCK / 2 <= raised,
            "the peak {restarted} after clear_refs still holds the freed block (was {raised})"
        );
    }
}
