//! The wire codecs: PMI-1's request lines in and response lines out, and PMI-2's frames ([`pmi2`]). Pure
//! functions over bytes; rpmi's server decides what to answer. A crate of its own, so that rpmi's client
//! libraries (`libpmi.so.0`, `libpmi2.so.0`) share the formats without the server.

// Sans-I/O: bytes and state only, so nothing here may be unsafe.
#![forbid(unsafe_code)]

pub mod group;
pub mod image;
pub mod mapping;
pub mod node_barrier;
pub mod pmi2;
pub mod reply;
pub mod request;
pub mod response;
pub mod spawn;

pub use request::{parse, ParseError, Request};
pub use spawn::{Pairs, SpawnBuilder, SpawnCommand, SpawnRequest};
