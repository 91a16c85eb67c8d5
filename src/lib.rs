//! rpmi: a PMI-1 server that a resource manager loads as a plugin, so that MPI programs (above all legacy
//! ones that only speak PMI-1) start and wire up under it.
//!
//! - [`wire`] parses what a task writes on its `PMI_FD` and formats the answers.
//! - [`server`] is the engine: one [`server::Shell`] per job shell serves all of that shell's tasks and talks
//!   to the host (the resource manager) only through the [`server::Host`] trait. It does no I/O.
//! - [`driver`] is the I/O around a shell: task connections, epoll, completions from other threads.
//! - [`node`] is the runtime around one shell on one node: task connections, their environment, the hook in
//!   the forked child, the progress loop and the stop. Every host drives it.
//! - [`collective`] is the exchange behind every barrier over a k-ary tree of nodes, as sans-I/O machines.
//! - [`abi`] is the job-shell plugin ABI of `plugin-spec/rpmi_plugin.h`, through which hosts load the library.
//! - `slurm` (feature `slurm`) makes the same library Slurm's `mpi/rpmi` plugin: `srun --mpi=rpmi`.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod abi;
// Public only for rpmi-run, which reads and writes its own frames with it: not part of the library's API.
#[doc(hidden)]
pub mod codec;
pub mod collective;
pub mod driver;
pub mod node;
pub mod os;
pub mod server;
pub use rpmi_wire as wire;

#[cfg(feature = "slurm")]
pub mod slurm;
