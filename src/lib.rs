//! rpmi: a PMI server that a resource manager loads as a plugin, so that MPI programs (above all legacy
//! ones that only speak PMI-1) start and wire up under it.
//!
//! What decides, without I/O, is the `rpmi-core` crate, whose modules this one re-exports:
//! - [`wire`] parses what a task writes on its `PMI_FD` and formats the answers.
//! - [`server`] is the engine: one [`server::Server`] per job shell serves all of that shell's tasks, and hands
//!   out what it asks of the host (the resource manager) as [`server::Effect`]s.
//! - [`collective`] is the exchange behind every barrier over a k-ary tree of nodes.
//!
//! The I/O around them is this crate's:
//! - [`driver`] is the I/O around a shell: task connections, epoll, completions from other threads.
//! - [`runtime`] is the runtime around one shell on one node: task connections, their environment, the hook in
//!   the forked child, the progress loop and the stop. Every host drives it.
//! - [`abi`] is the job-shell plugin ABI of `plugin-spec/rpmi_plugin.h`, through which hosts load the library.
//! - `slurm` (feature `slurm`) makes the same library Slurm's `mpi/rpmi` plugin: `srun --mpi=rpmi`.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod abi;
pub mod driver;
pub mod os;
pub mod runtime;
pub use rpmi_core::{collective, launch, server, wire};

#[cfg(feature = "slurm")]
pub mod slurm;
