//! What rpmi decides, without I/O: the machines a host feeds with the bytes it read, and which hand back
//! what to write and what to do. Nothing here owns a socket, a thread or a clock, and nothing is unsafe;
//! the runtime and the hosts (the `rpmi` crate: the plugin ABI, Slurm's plugin, rpmi-run) do the I/O.
//!
//! - [`wire`]: what a task writes on its `PMI_FD` and the answers (PMI-1, PMI 1.2, PMI-2).
//! - [`server`]: the PMI engine, one [`server::Server`] per job shell serving all of its tasks; what it asks
//!   of its host it hands out as [`server::Effect`]s.
//! - [`collective`]: the exchange behind every barrier, over a k-ary tree of nodes.
//! - [`launch`]: what a launch of several commands gives its ranks, and what a spawn may ask for.
//! - [`codec`]: the byte codec of every binary frame.
//! - `slurm` (feature `slurm`): the handshake and the frames between Slurm's slurmstepds and srun.

#![forbid(unsafe_code)]

pub mod codec;
pub mod collective;
pub mod launch;
pub mod server;
#[cfg(feature = "slurm")]
pub mod slurm;
pub use rpmi_wire as wire;
