//! The engine on the host: [`Engine::new`] and [`Engine::new_hybrid`] on host communicators (the
//! model states in host memory, the work on a [`HostStream`]), the host-only ways in and out
//! ([`Engine::param`] as a slice, [`Engine::push_grad_f32`]), and [`hybrid_groups`].

use ringzero_collectives::{Collectives, Communicator, DeviceComm, HostStream};
use ringzero_kernels::cpu::{cast, Float};

use super::Engine;
use crate::config::ZeroConfig;
use crate::error::ZeroError;
use crate::partition::ParamSpec;

impl<T: Float> Engine<T, HostStream> {
    /// An engine for `specs` on the ranks of `comm`, its model states in host memory, every
    /// parameter element initialised by `init(param index, element index)` (the same function on
    /// every rank, so no broadcast is needed; with 16-bit `T` the master keeps the fp32 value and
    /// the parameter its rounding). A collective: every rank of `comm` calls it. The engine
    /// connects a communicator of its own on `comm`'s ranks ([`Engine::comm`]), so it borrows
    /// nothing and can live next to `comm` in a trainer's struct.
    pub fn new(
        comm: &Communicator,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, HostStream>, ZeroError> {
        Engine::on(DeviceComm::new(comm, HostStream::new())?, specs, init, cfg)
    }

    /// [`Engine::new`] on named weights — a safetensors file read with
    /// [`Weights::from_safetensors`](crate::Weights::from_safetensors) (a Hugging Face
    /// checkpoint, a consolidated ringzero one): its tensors are the parameters, in the file's
    /// order, and their values the initial ones.
    pub fn from_weights(
        comm: &Communicator,
        weights: &crate::Weights,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, HostStream>, ZeroError> {
        Engine::new(comm, weights.specs(), &|p, i| weights.init(p, i), cfg)
    }

    /// Hybrid sharding (FSDP's `HYBRID_SHARD`, DeepSpeed's MiCS): the model states are sharded
    /// over `shard` (typically the ranks of one node, whose links are fast) and replicated over
    /// `replicas` (the ranks that hold the same shard in the other shard groups, one per node).
    /// Parameters are gathered inside the shard group only; gradients are reduce-scattered in it
    /// and then averaged over `replicas` once per optimizer step, so the slow links carry
    /// 2(R−1)/R of a shard per step rather than a share of every all-gather. [`hybrid_groups`]
    /// builds the two communicators from the world.
    ///
    /// Every rank of `replicas` must hold the same shard: the same rank in shard groups of the
    /// same size (checked, with one all-gather over `replicas` and one agreement over `shard`;
    /// every rank fails alike if any does). Checkpoints are written by the first replica's shard
    /// group (an ordinary checkpoint of `S` ranks, loadable at any size) and read by every group;
    /// both stay all-or-nothing across the whole world.
    pub fn new_hybrid(
        shard: &Communicator,
        replicas: &Communicator,
        specs: &[ParamSpec],
        init: &dyn Fn(usize, usize) -> f32,
        cfg: ZeroConfig,
    ) -> Result<Engine<T, HostStream>, ZeroError> {
        let s = DeviceComm::new(shard, HostStream::new())?;
        let r = DeviceComm::new(replicas, HostStream::new())?;
        Engine::on_hybrid(s, r, specs, init, cfg)
    }

    /// The current values of parameter `name` in `T` (stage 3: only while gathered), read in
    /// place.
    pub fn param(&self, name: &str) -> Result<&[T], ZeroError> {
        let (addr, len) = self.param_addr(name)?;
        self.sync("reading a parameter")?;
        // SAFETY: the host stream's memory is host memory, 64-byte aligned; `addr` holds `len`
        // elements of `T` inside one of the engine's buffers (param_addr), which only `&mut
        // self` calls write or free, and the work queued before has completed (sync), so nothing
        // writes it while the returned borrow of `self` lives.
        Ok(unsafe { std::slice::from_raw_parts(addr as usize as *const T, len) })
    }

    /// Backward for a layer without copying its weights: `f` gets the current values of
    /// `names`' parameters, read in place as [`Engine::param`] reads them, and returns their
    /// gradients, one per name in order (times [`Engine::loss_scale`] under fp16), which are
    /// then pushed as [`Engine::push_grad`] pushes them. The count and lengths are checked
    /// before any is added: bad input changes nothing.
    pub fn push_grads_from(
        &mut self,
        names: &[&str],
        f: impl FnOnce(&[&[T]]) -> Vec<Vec<T>>,
    ) -> Result<(), ZeroError> {
        let grads = {
            let params = names
                .iter()
                .map(|n| self.param(n))
                .collect::<Result<Vec<&[T]>, _>>()?;
            f(&params)
        };
        if grads.len() != names.len() {
            return Err(ZeroError::NotNow {
                call: "push_grads_from",
                why: format!(
                    "{} gradients returned for {} parameters ({})",
                    grads.len(),
                    names.len(),
                    names.join(", ")
                ),
            });
        }
        for (n, g) in names.iter().zip(&grads) {
            self.led.check_push(n, g.len())?;
        }
        for (n, g) in names.iter().zip(&grads) {
            self.push_grad(n, &g[..])?;
        }
        Ok(())
    }

    /// [`Engine::push_grad`] from an `f32` gradient, rounded once into `T` (the sum with an
    /// earlier micro-step's gradient is rounded once too).
    pub fn push_grad_f32(&mut self, name: &str, grad: &[f32]) -> Result<(), ZeroError> {
        let (i, s) = self.led.check_push(name, grad.len())?;
        let dst = self.grad_slot(s)?;
        self.sync("adding a gradient")?;
        // SAFETY: the host stream's memory is host memory; `dst` is `s.len` elements of `T`
        // inside the engine's gradient buffer (grad_slot), written by no queued work (sync), and
        // `&mut self` keeps every other user away while the slice lives.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut T, s.len) };
        if T::IS_F32 {
            let d: &mut [f32] = bytemuck::cast_slice_mut(dst);
            d.iter_mut().zip(grad).for_each(|(a, g)| *a += g);
        } else {
            let mut acc = vec![0f32; dst.len()];
            cast(dst, &mut acc);
            acc.iter_mut().zip(grad).for_each(|(a, g)| *a += g);
            cast(&acc, dst);
        }
        self.pushed(i, s.bucket)
    }
}

/// Hybrid sharding's communicators on `world` for [`Engine::new_hybrid`]: shard groups of `size`
/// ranks that share a node wherever the nodes allow it, and replica groups of the ranks at the
/// same place in each. Ranks are taken node by node (nodes in the order of their lowest rank,
/// ranks in order inside a node, nodes told apart by `RINGZERO_NODE_ID`), then cut into groups of
/// `size`: with ranks numbered node by node these are runs of consecutive ranks, and with ranks
/// dealt round-robin over nodes (Slurm's cyclic distribution) the groups still stay inside nodes.
/// A collective (an all-gather of node ids, then two splits) that every rank of `world` calls with
/// the same `size` ([`ZeroConfig::shard_size`]); a size that does not divide the world into whole
/// groups is refused before anything is split.
pub fn hybrid_groups(
    world: &Communicator,
    size: usize,
) -> Result<(Communicator, Communicator), ZeroError> {
    let n = world.size();
    crate::mem::replicas(n, size).map_err(ZeroError::Config)?;
    use sha2::Digest;
    let mine = sha2::Sha256::digest(world.config().node_id.as_bytes());
    let mut all = vec![0u8; n * mine.len()];
    world.all_gather(&mine[..], &mut all)?;
    let nodes: Vec<&[u8]> = all.chunks(mine.len()).collect();
    let at = node_major(&nodes)
        .iter()
        .position(|&x| x == world.rank())
        .expect("every rank has a place");
    let key = |k: usize| u32::try_from(k).expect("a rank fits u32");
    let shard = world.split(Some(key(at / size)), key(at % size))?;
    let replicas = world.split(Some(key(at % size)), key(at / size))?;
    match (shard, replicas) {
        (Some(s), Some(rep)) => Ok((s, rep)),
        _ => unreachable!("every rank passed a color"),
    }
}

/// Ranks in node-major order, given each rank's node: nodes in the order of their lowest rank,
/// ranks ascending inside each.
fn node_major<K: PartialEq>(node_of: &[K]) -> Vec<usize> {
    let first: Vec<usize> = node_of
        .iter()
        .map(|k| node_of.iter().position(|x| x == k).expect("k is there"))
        .collect();
    let mut order: Vec<usize> = (0..node_of.len()).collect();
    order.sort_by_key(|&r| (first[r], r));
    order
}

#[cfg(test)]
mod node_major_tests {
    use super::node_major;

    #[test]
    fn node_major_keeps_node_major_numbering_and_regroups_round_robin() {
        assert_eq!(node_major(&["a", "a", "b", "b"]), [0, 1, 2, 3]);
        assert_eq!(node_major(&["a", "b", "a", "b"]), [0, 2, 1, 3]);
        assert_eq!(
            node_major(&["b", "a", "c", "a", "b", "c"]),
            [0, 4, 1, 3, 2, 5]
        );
        assert_eq!(node_major::<&str>(&[]), Vec::<usize>::new());
    }
}
